"""cgdp.integrations.transformers.Trainer against transformers.Trainer on one device running the
global batch: a tiny GPT-2 built from its config (no download), padded sequences, gradient
accumulation, clipping, an uneven last batch; a resume bitwise equal to an uninterrupted run; and
the Trainer as a multi-GPU machine sets it up (``args._n_gpu``), on simulated GPUs.

Dropout is 0: each device has its own random stream, so with dropout the masks would differ from
one device's.
"""
import math
import warnings

import pytest
import torch

from helpers import assert_params_close

transformers = pytest.importorskip("transformers", minversion="5.0")  # what the hf extra supports
pytest.importorskip("accelerate")

from cgdp import DataParallel  # noqa: E402
from cgdp.integrations.transformers import Trainer as CgdpTrainer  # noqa: E402
from cgdp.testing import simulated_cuda  # noqa: E402

# the integration binds the optimizer: an unbound one would be followed through replica 0, warning
pytestmark = pytest.mark.filterwarnings("error:replica 0's parameters were changed outside")

VOCAB, T, N = 40, 10, 21  # 21 sequences: the last global batch is uneven on 2 and 3 devices
PER_DEVICE = 2


def gpt2(dropout=0.0):
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(vocab_size=VOCAB, n_positions=16, n_embd=16, n_layer=2, n_head=2,
                                  resid_pdrop=dropout, embd_pdrop=dropout, attn_pdrop=dropout, bos_token_id=0,
                                  eos_token_id=0, pad_token_id=0)
    return transformers.GPT2LMHeadModel(cfg)


class Padded(torch.utils.data.Dataset):
    """Right-padded sequences of 1 to T tokens: attention_mask 0 and label -100 on the padding."""

    def __init__(self, n=N, seed=1):
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(1, VOCAB, (n, T), generator=g)
        self.mask = (torch.arange(T) < torch.randint(1, T + 1, (n, 1), generator=g)).long()

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        ids, mask = self.ids[i] * self.mask[i], self.mask[i]
        return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def arguments(out, per_device, optim="sgd", **kw):
    """use_cpu: the devices are emulated whatever the machine has (simulated ones: use_cpu=False)."""
    base = dict(output_dir=str(out), per_device_train_batch_size=per_device, per_device_eval_batch_size=per_device,
                gradient_accumulation_steps=2, max_grad_norm=1.0, num_train_epochs=2, logging_steps=1,
                report_to="none", disable_tqdm=True, use_cpu=True, save_strategy="no", seed=0,
                optim=optim, learning_rate=0.5 if optim == "sgd" else 5e-3)
    return transformers.TrainingArguments(**{**base, **kw})


def logged(trainer, key):
    return [h[key] for h in trainer.state.log_history if key in h and "train_runtime" not in h]


def reference(tmp_path, g, optim="sgd"):
    """transformers.Trainer on one device, its batch the global batch of g devices."""
    model = gpt2()
    tr = transformers.Trainer(model=model, args=arguments(tmp_path / "ref", PER_DEVICE * g, optim),
                              train_dataset=Padded(), eval_dataset=Padded(9, seed=2))
    tr.train()
    return model, tr


def assert_same_run(tr, ref, model, ref_model, rtol=1e-5):
    assert len(logged(tr, "loss")) == len(logged(ref, "loss")) > 0
    assert logged(tr, "loss") == pytest.approx(logged(ref, "loss"), rel=1e-5)
    assert logged(tr, "grad_norm") == pytest.approx(logged(ref, "grad_norm"), rel=1e-5)
    assert max(logged(ref, "grad_norm")) > 1.0  # max_grad_norm=1.0 clipped some steps
    assert_params_close(model, ref_model, rtol=rtol, floor=1e-3)
    for r in tr.replicas[1:]:
        for p, q in zip(model.parameters(), r.parameters()):
            assert torch.equal(p, q)


@pytest.mark.parametrize("g,optim", [(2, "sgd"), (3, "sgd"), (3, "adamw_torch_fused")])
def test_equals_transformers_trainer_on_one_device(tmp_path, g, optim, monkeypatch):
    """SGD: parameters to 1e-5. AdamW (Hugging Face's default) divides each element's step by its
    own gradient's running magnitude: an element whose gradient is a near-cancelling sum (the
    attention's key bias is zero in exact arithmetic) turns the rounding of a different summation
    order, any data-parallel split's, into steps that differ by up to the learning rate, so there
    the parameters are compared to 1e-3 (the losses and gradient norms still to 1e-5)."""
    ref_model, ref = reference(tmp_path, g, optim)
    model = gpt2()
    quiet, no_sync = [], DataParallel.no_sync
    monkeypatch.setattr(DataParallel, "no_sync", lambda self: quiet.append(1) or no_sync(self))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no warning of gradients changed on replica 0 alone
        tr = CgdpTrainer(model=model, args=arguments(tmp_path / "cgdp", PER_DEVICE, optim),
                         devices=[f"cpu:{i}" for i in range(g)], train_dataset=Padded(), eval_dataset=Padded(9, seed=2))
        tr.train()
    assert len(next(iter(tr.get_train_dataloader()))["input_ids"]) == PER_DEVICE * g  # per device x g
    # every micro-batch but the last of each step accumulated without communication
    assert len(quiet) == 2 * math.ceil(N / (PER_DEVICE * g)) - len(logged(tr, "loss"))
    assert_same_run(tr, ref, model, ref_model, rtol=1e-5 if optim == "sgd" else 1e-3)
    # evaluate(): the token mean of each padded eval batch, exactly
    assert tr.evaluate()["eval_loss"] == pytest.approx(ref.evaluate()["eval_loss"], rel=1e-5)
    tr.save_model(tmp_path / "saved")
    loaded = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "saved")
    assert_params_close(loaded, model, rtol=0)
    tr.close()


class Labelled(Padded):
    """The same sequences with a class each (sequence classification: the loss is a per-sample mean)."""

    def __getitem__(self, i):
        return {**super().__getitem__(i), "labels": self.ids[i, 0] % 3}


def test_sequence_classifier_that_ignores_num_items_in_batch(tmp_path):
    """BERT's classifier takes num_items_in_batch (its forward has **kwargs) and ignores it: its
    loss is each replica's per-sample mean, and cgdp weights it by samples, not sums it."""
    def bert():
        torch.manual_seed(0)
        return transformers.BertForSequenceClassification(transformers.BertConfig(
            vocab_size=VOCAB, hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32,
            max_position_embeddings=16, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, num_labels=3))

    ref_model, model = bert(), bert()
    ref = transformers.Trainer(model=ref_model, args=arguments(tmp_path / "ref", PER_DEVICE * 3), train_dataset=Labelled())
    ref.train()
    tr = CgdpTrainer(model=model, args=arguments(tmp_path / "cgdp", PER_DEVICE), devices=["cpu:0", "cpu:1", "cpu:2"],
                     train_dataset=Labelled())
    tr.train()
    assert logged(tr, "loss") == pytest.approx(logged(ref, "loss"), rel=1e-5)
    assert_params_close(model, ref_model, floor=1e-3)
    tr.close()


def test_a_second_trainer_on_the_same_model_takes_it_over(tmp_path):
    """A model is in one cgdp engine at a time: a second Trainer given the model (here to evaluate
    it) closes the first one's wrapper, and the first takes the model back when it trains again."""
    model = gpt2()
    args = arguments(tmp_path / "a", PER_DEVICE, num_train_epochs=1, gradient_accumulation_steps=1)
    first = CgdpTrainer(model=model, args=args, devices=["cpu:0", "cpu:1"], train_dataset=Padded(8))
    first.train()
    wrapper = first.replicas and first._cgdp
    second = CgdpTrainer(model=model, args=arguments(tmp_path / "b", PER_DEVICE), devices=["cpu:0", "cpu:1"],
                         eval_dataset=Padded(5, seed=2))
    loss = second.evaluate()["eval_loss"]
    assert wrapper.closed and not second._cgdp.closed
    ref = transformers.Trainer(model=gpt2(), args=arguments(tmp_path / "r", PER_DEVICE * 2, num_train_epochs=1,
                                                            gradient_accumulation_steps=1), train_dataset=Padded(8))
    ref.train()
    assert_params_close(model, ref.model, floor=1e-3)
    first.train()  # takes the model back
    assert second._cgdp.closed and not first._cgdp.closed
    first.close()
    second.close()
    assert math.isfinite(loss)


def test_resume_in_the_middle_is_bitwise_an_uninterrupted_run(tmp_path):
    """With dropout: the checkpoint holds the replicas' random streams as well as torch's."""
    model = gpt2(dropout=0.1)
    args = arguments(tmp_path / "run", PER_DEVICE, "adamw_torch_fused", save_strategy="steps", save_steps=2)
    whole = CgdpTrainer(model=model, args=args, devices=["cpu:0", "cpu:1"], train_dataset=Padded())
    whole.train()  # 6 steps, checkpoints after steps 2, 4, 6 (step 2: in the middle of epoch 1)
    resumed_model = gpt2(dropout=0.1)
    resumed = CgdpTrainer(model=resumed_model, args=arguments(tmp_path / "resumed", PER_DEVICE, "adamw_torch_fused"),
                          devices=["cpu:0", "cpu:1"], train_dataset=Padded())
    resumed.train(resume_from_checkpoint=str(tmp_path / "run" / "checkpoint-2"))
    for p, q in zip(model.parameters(), resumed_model.parameters()):
        assert torch.equal(p, q)
    # the resumed log starts with the checkpoint's two steps, then its own four
    assert len(logged(whole, "loss")) == 6
    assert logged(resumed, "loss") == logged(whole, "loss")
    assert logged(resumed, "grad_norm") == logged(whole, "grad_norm")
    whole.close()
    resumed.close()


def test_with_n_gpu_as_a_multi_gpu_machine_sets_it(tmp_path):
    """On a two-GPU machine Hugging Face sets args._n_gpu = 2 (and would then wrap the model in
    nn.DataParallel, expand num_items_in_batch per GPU and take loss.mean()); devices=None is
    every GPU, here the two simulated ones."""
    ref_model, ref = reference(tmp_path, 2)
    model = gpt2()
    args = arguments(tmp_path / "cgdp", PER_DEVICE, use_cpu=False, dataloader_pin_memory=False)
    args._n_gpu = 2
    with simulated_cuda(2, seed=5, max_delay_s=0.0005):
        tr = CgdpTrainer(model=model, args=args, train_dataset=Padded())
        assert tr.devices == ["cuda:0", "cuda:1"]
        tr.train()
        assert_same_run(tr, ref, model, ref_model)
        tr.close()
