"""Bad input gets a clear error, and the trainer stays usable after a rejected call."""
import threading
import time

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import cgdp
from helpers import assert_replicas_identical, mlp

SGD = lambda p: torch.optim.SGD(p, lr=0.1)  # noqa: E731
X, Y = torch.randn(6, 12), torch.randint(0, 5, (6,))


@pytest.mark.parametrize("devices, match", [
    (["gpu:0"], "unknown device 'gpu:0'"),
    (["cpu"], "index is required"),
    ("cpu:0", "list of device strings"),
    ([], "empty"),
    (["cpu:0", "cpu:0"], "more than once"),
    (["cpu:0", "cuda:0"], "mixes"),
])
def test_bad_devices(devices, match):
    with pytest.raises((ValueError, TypeError), match=match):
        cgdp.Trainer(mlp(), SGD, devices)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU message")
def test_cuda_device_that_is_not_there():
    with pytest.raises(ValueError, match=r"cuda:0 is not there: this machine has 0 CUDA"):
        cgdp.Trainer(mlp(), SGD, ["cuda:0"])


def test_cuda_index_beyond_count():
    n = torch.cuda.device_count()
    with pytest.raises(ValueError, match=f"cuda:{n} is not there"):
        cgdp.Trainer(mlp(), SGD, [f"cuda:{n}"])


@pytest.mark.parametrize("kw, match", [
    (dict(mode="ddp"), "mode must be one of"),
    (dict(mode="single"), "one device"),
    (dict(chunks=0), "k must be >= 1"),
    (dict(chunks=-3), "k must be >= 1"),
    (dict(chunks=[[3, 2], [1]]), r"leaves out layer\(s\) \[0\]"),
    (dict(chunks=[[3, 2, 1, 0, 4]]), "names layer 4, but the model has 4 layers"),
    (dict(chunks=[[3, 2], [1, 0, 2]]), "appears in chunk 0 and again"),
    (dict(chunks="fast"), "'auto'"),
    (dict(chunks=1.5), "int chunk size"),
    (dict(comm="nccl"), "comm must be None"),
    (dict(mode="typical", comm="gloo"), "mode='typical' averages the gradient on this machine's devices only"),
    (dict(timeout_s=0), "timeout_s"),
])
def test_bad_options(kw, match):
    with pytest.raises((ValueError, TypeError), match=match):
        cgdp.Trainer(mlp(), SGD, ["cpu:0", "cpu:1"], **kw)


def test_bad_model_and_optimizer():
    frozen = mlp().requires_grad_(False)
    with pytest.raises(ValueError, match="no trainable parameters"):
        cgdp.Trainer(frozen, SGD, ["cpu:0"])
    with pytest.raises(TypeError, match="nn.Module"):
        cgdp.Trainer(lambda x: x, SGD, ["cpu:0"])
    model = mlp()
    with pytest.raises(TypeError, match="callable that takes parameters"):
        cgdp.Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), ["cpu:0"])
    with pytest.raises(TypeError, match="must return a torch.optim.Optimizer"):
        cgdp.Trainer(model, lambda p: None, ["cpu:0"])
    with pytest.raises(TypeError, match="one dtype"):
        cgdp.Trainer(nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2).double()), SGD, ["cpu:0"])


def test_rejected_steps_leave_the_trainer_usable():
    with cgdp.Trainer(mlp(), SGD, ["cpu:0", "cpu:1", "cpu:2"]) as tr:
        with pytest.raises(ValueError, match="got an empty batch"):
            tr.step(X[:0], Y[:0], F.cross_entropy)
        with pytest.raises(TypeError, match="scalar tensor"):
            tr.step(X, Y, lambda o, t: F.cross_entropy(o, t, reduction="none"))
        with pytest.raises(TypeError, match="scalar tensor"):
            tr.step(X, Y, lambda o, t: 1.0)
        with pytest.raises(ValueError, match="does not depend"):
            tr.step(X, Y, lambda o, t: torch.tensor(1.0))
        with pytest.raises(ValueError, match="share the batch dimension"):
            tr.step(X, Y[:5], F.cross_entropy)
        with pytest.raises(TypeError, match="loss_fn"):
            tr.step(X, Y, "cross_entropy")
        with pytest.raises(TypeError, match="inputs must be a tensor"):
            tr.step([1, 2, 3], Y, F.cross_entropy)
        assert tr.step_count == 0
        before = [p.detach().clone() for p in tr.replicas[0].parameters()]
        loss = tr.step(X, Y, F.cross_entropy)
        assert loss > 0 and tr.step_count == 1
        assert any(not torch.equal(a, b) for a, b in zip(before, tr.replicas[0].parameters()))
        assert_replicas_identical(tr)


def test_non_finite_gradient_is_reported_not_applied():
    with cgdp.Trainer(mlp(), SGD, ["cpu:0", "cpu:1"], chunks=1) as tr:
        tr.step(X, Y, F.cross_entropy)
        before = [p.detach().clone() for p in tr.replicas[0].parameters()]
        bad = X.clone()
        bad[4, 0] = float("inf")  # only device 1's part is poisoned
        with pytest.raises(cgdp.NonFiniteGradientError, match="NaN/Inf.*not applied"):
            tr.step(bad, Y, F.cross_entropy)
        for a, b in zip(before, tr.replicas[0].parameters()):
            assert torch.equal(a, b)
        assert_replicas_identical(tr)
        tr.step(X, Y, F.cross_entropy)  # and training goes on
        assert tr.step_count == 2


def test_a_step_rejected_after_backward_keeps_its_forwards_buffer_writes_on_every_replica_alike():
    """A tensor learning rate changed on one replica only is found on the devices after backward:
    the step is rejected with no update, and what the forwards wrote in BatchNorm's statistics is
    kept as one device that skips optimizer.step() keeps it, averaged on every replica (each
    replica kept its own part's statistics before)."""
    from cgdp.engine.trainer.hyperparameters import HyperparameterMismatchError
    from cgdp.testing import simulated_cuda

    def tensor_lr(params):  # on each replica's GPU: compared there, the verdict read with the losses
        params = list(params)
        return torch.optim.SGD(params, lr=torch.tensor(0.05, device=params[0].device))

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(12, 16), nn.BatchNorm1d(16), nn.Tanh(), nn.Linear(16, 4))
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(12, 12, generator=g), torch.randint(0, 4, (12,), generator=g)) for _ in range(3)]
    with simulated_cuda(2, max_delay_s=0.0), cgdp.Trainer(model, tensor_lr, ["cuda:0", "cuda:1"], chunks=1) as tr:
        tr.step(*data[0], F.cross_entropy)
        params = [p.detach().clone() for p in tr.replicas[0].parameters()]
        stats = tr.replicas[0][1].running_mean.clone()
        with torch.no_grad():
            tr.optimizers[0].param_groups[0]["lr"].fill_(0.01)  # replica 0 only
        with pytest.raises(HyperparameterMismatchError):
            tr.step(*data[1], F.cross_entropy)
        assert all(torch.equal(a, b) for a, b in zip(params, tr.replicas[0].parameters()))
        assert not torch.equal(stats, tr.replicas[0][1].running_mean)  # the forward's writes, kept
        assert_replicas_identical(tr)
        with torch.no_grad():
            tr.optimizers[0].param_groups[0]["lr"].fill_(0.05)
        tr.step(*data[2], F.cross_entropy)
        assert_replicas_identical(tr)


def test_typical_mode_reports_non_finite_too():
    with cgdp.Trainer(mlp(), SGD, ["cpu:0", "cpu:1"], mode="typical") as tr:
        bad = X.clone()
        bad[0, 0] = float("nan")
        with pytest.raises(cgdp.NonFiniteGradientError):
            tr.step(bad, Y, F.cross_entropy)


def test_failure_on_one_device_thread_surfaces_without_hang():
    calls = []

    def flaky(out, target):
        calls.append(threading.current_thread().name)
        if out.shape[0] == 2:  # the last device's part (uneven split 2,2,... of 7 → 3,2,2)
            raise RuntimeError("boom on one device")
        return F.cross_entropy(out, target)

    with cgdp.Trainer(mlp(), SGD, ["cpu:0", "cpu:1", "cpu:2"]) as tr:
        t0 = time.monotonic()
        with pytest.raises(RuntimeError, match="boom on one device"):
            tr.step(torch.randn(7, 12), torch.randint(0, 5, (7,)), flaky)
        assert time.monotonic() - t0 < 60  # not the 300 s timeout: the failure ended the wait
        assert len(set(calls)) == 3  # every device ran on its own thread
        tr.step(X, Y, F.cross_entropy)
        assert_replicas_identical(tr)


def test_failure_inside_backward_does_not_hang():
    """A layer whose backward raises on one device: the other devices wait for its chunks."""
    class Boom(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            ctx.bad = x.shape[0] == 2
            return x.clone()

        @staticmethod
        def backward(ctx, g):
            if ctx.bad:
                raise RuntimeError("backward failed on one device")
            return g

    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(12, 8), nn.Linear(8, 5)

        def forward(self, x):
            return self.b(Boom.apply(self.a(x)))

    with cgdp.Trainer(M(), SGD, ["cpu:0", "cpu:1"], chunks=1, timeout_s=120) as tr:
        t0 = time.monotonic()
        with pytest.raises(RuntimeError, match="backward failed on one device"):
            tr.step(torch.randn(5, 12), torch.randint(0, 5, (5,)), F.cross_entropy)
        assert time.monotonic() - t0 < 60  # the failure ended the wait, not timeout_s
        tr.step(torch.randn(6, 12), torch.randint(0, 5, (6,)), F.cross_entropy)
        assert_replicas_identical(tr)


def test_lost_chunk_times_out_with_a_clear_error(monkeypatch):
    from cgdp.engine.core.host import Arrivals
    monkeypatch.setattr(Arrivals, "arrived", lambda self, u: None)  # the host never hears of any chunk
    with cgdp.Trainer(mlp(), SGD, ["cpu:0", "cpu:1"], chunks=1, timeout_s=0.5) as tr:
        with pytest.raises(TimeoutError, match="waited 0.5 s for the averaged gradients"):
            tr.step(X, Y, F.cross_entropy)


@pytest.mark.parametrize("kw, match", [
    (dict(segment_bytes=0, host_memory=1 << 20), r"segment_bytes must be an int number of bytes >= 1024"),
    (dict(segment_bytes=1, host_memory=1 << 20), r"segment_bytes must be an int number of bytes >= 1024"),
    (dict(segment_bytes=4096.0, host_memory=1 << 20), r"segment_bytes .* got 4096\.0"),
    (dict(segment_bytes=-4096, host_memory=1 << 20), r"segment_bytes .* got -4096"),
    (dict(segment_bytes=0), "segment_bytes"),
    (dict(segment_bytes=True), "segment_bytes"),
    (dict(host_memory=0), r"host_memory must be a positive int .* or None"),
    (dict(host_memory=1.5e6), r"host_memory must be a positive int"),
    (dict(host_memory=-1), r"host_memory must be a positive int"),
    (dict(timeout_s="300"), r"timeout_s must be a number of seconds > 0 .* or None"),
    (dict(timeout_s=0), "timeout_s must be a number of seconds > 0"),
    (dict(timeout_s=float("nan")), "timeout_s must be a number of seconds > 0"),
    (dict(chunks=0), "k must be >= 1"),
    (dict(chunks=2.5), "int chunk size"),
])
@pytest.mark.parametrize("face", ["DataParallel", "Trainer"])
def test_numeric_arguments_are_checked_on_both_faces(face, kw, match):
    """DataParallel took segment_bytes=0 or 1 with host_memory to a ZeroDivisionError, 4096.0 to a bare
    TypeError and -4096 to 'at least -24576 bytes'; both faces now say what the argument must be."""
    with pytest.raises(ValueError if "chunks" not in kw or kw["chunks"] == 0 else TypeError, match=match):
        if face == "DataParallel":
            cgdp.DataParallel(mlp(), ["cpu:0", "cpu:1"], **kw)
        else:
            cgdp.Trainer(mlp(), SGD, ["cpu:0", "cpu:1"], **kw)


@pytest.mark.parametrize("devices, match", [([], "devices is empty; pass at least one device"),
                                            (["gpu:0"], "unknown device 'gpu:0'")])
def test_hugging_face_trainer_refuses_bad_devices_when_built(tmp_path, devices, match):
    """devices=[] reached train() and failed in torch's words ("batch_size should be a positive integer")."""
    transformers = pytest.importorskip("transformers", minversion="5.0")
    pytest.importorskip("accelerate")
    from cgdp.integrations.transformers import Trainer as HFTrainer
    args = transformers.TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to="none")
    with pytest.raises(ValueError, match=match):
        HFTrainer(model=mlp(), args=args, devices=devices)


class TokenLM(nn.Module):
    """A tiny language model that computes its own loss, the mean over its labels other than -100
    (as Hugging Face's do), or the sum over them divided by ``num_items_in_batch`` when given."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb, self.out = nn.Embedding(11, 8), nn.Linear(8, 11)

    def forward(self, input_ids, labels=None, num_items_in_batch=None):
        logits = self.out(self.emb(input_ids))
        loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum")
        n = num_items_in_batch if num_items_in_batch is not None else (labels != -100).sum()
        return {"loss": loss / n, "logits": logits}


def _padded(uneven: bool):
    ids = torch.randint(0, 11, (4, 6), generator=torch.Generator().manual_seed(1))
    lengths = torch.tensor([6, 6, 1, 2] if uneven else [6, 1, 6, 1])  # tokens per sample: 6 vs 1.5, or 3.5 vs 3.5
    labels = ids.masked_fill(torch.arange(6) >= lengths[:, None], -100)
    return {"input_ids": ids, "labels": labels}


def test_a_models_own_loss_under_uneven_padding_is_said_once_on_both_faces():
    """The model's own token-mean loss, combined as a per-sample mean, is not the global token mean
    when the devices' parts hold different tokens per sample: both faces warn, once, with the fix;
    even padding, num_items_in_batch, or training on the gathered logits gives no warning."""
    import warnings
    model = cgdp.DataParallel(TokenLM(), ["cpu:0", "cpu:1"], chunks=1)
    with pytest.warns(UserWarning, match=r"tokens per sample on each device \(6, 1\.5; .* pass num_items_in_batch"):
        model(**_padded(uneven=True))["loss"].backward()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model(**_padded(uneven=True))["loss"].backward()  # once
    model.close()
    with cgdp.DataParallel(TokenLM(), ["cpu:0", "cpu:1"], chunks=1) as model, warnings.catch_warnings():
        warnings.simplefilter("error")
        model(**_padded(uneven=False))["loss"].backward()
        batch = _padded(uneven=True)
        model(**batch, num_items_in_batch=(batch["labels"] != -100).sum())["loss"].backward()
        out = model(**batch)  # the model's loss only logged, training on the gathered logits: exact
        F.cross_entropy(out["logits"].flatten(0, 1), batch["labels"].flatten()).backward()

    own = lambda m, b: m(**b)["loss"]  # noqa: E731
    with cgdp.Trainer(TokenLM(), SGD, ["cpu:0", "cpu:1"], chunks=1) as tr:
        with pytest.warns(UserWarning, match=r"cgdp.Trainer: .*\(6, 1\.5; .* return \(loss_sum, count\)"):
            tr.step(_padded(uneven=True), own)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            tr.step(_padded(uneven=True), own)  # once
    with cgdp.Trainer(TokenLM(), SGD, ["cpu:0", "cpu:1"], chunks=1) as tr, warnings.catch_warnings():
        warnings.simplefilter("error")
        tr.step(_padded(uneven=False), own)
