"""``cgdp.integrations.transformers.Trainer(..., update="host")``: the same run as one device."""
from __future__ import annotations

import pytest

transformers = pytest.importorskip("transformers")

from cgdp.integrations.transformers import Trainer as CgdpTrainer  # noqa: E402
from helpers import assert_params_close  # noqa: E402
from test_hf_trainer import PER_DEVICE, Padded, arguments, gpt2, logged  # noqa: E402

# the integration binds the optimizer: an unbound one would be followed through replica 0, warning
pytestmark = pytest.mark.filterwarnings("error:replica 0's parameters were changed outside")


def test_hugging_face_trainer_steps_on_the_host(tmp_path):
    """One epoch of 16 sequences (2 steps of 2 accumulated micro-batches, clipped), against
    transformers.Trainer on one device with the global batch."""
    kw = dict(num_train_epochs=1, max_grad_norm=0.5)
    ref_model = gpt2()
    ref = transformers.Trainer(model=ref_model, args=arguments(tmp_path / "ref", 2 * PER_DEVICE, **kw),
                               train_dataset=Padded(16))
    ref.train()
    model = gpt2()
    tr = CgdpTrainer(model=model, args=arguments(tmp_path / "cgdp", PER_DEVICE, **kw), devices=["cpu:0", "cpu:1"],
                     train_dataset=Padded(16), update="host")
    tr.train()
    report = tr.model_wrapped.memory_report()
    assert report["host"]["parameters"] == 4 * sum(p.numel() for p in model.parameters())  # the masters
    assert report["cpu:0"]["optimizer_state"] == report["cpu:1"]["optimizer_state"] == 0
    assert logged(tr, "loss") == pytest.approx(logged(ref, "loss"), rel=1e-5) and len(logged(tr, "loss")) == 2
    assert_params_close(model, ref_model, floor=1e-3)
    tr.close()
