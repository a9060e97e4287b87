"""Hugging Face's own Trainer tests (the CPU part of transformers' tests/trainer/test_trainer.py, for
the transformers 5 the hf extra installs), ported to cgdp.integrations.transformers.Trainer on 2
emulated devices.

The fixtures are those tests' regression problem (y = a x + b + noise, a model with the two
parameters a and b), rewritten here. Where Hugging Face's test states a figure for ``n_gpu`` GPUs in
one process (``nn.DataParallel``), the port states it for 2 devices; where it compares with a run of
known result, the port compares with ``transformers.Trainer`` on one device running the global batch
(``per_device x 2``). Each test passes as Hugging Face wrote it; the differences, each tested here:

* ``num_items_in_batch``: with ``nn.DataParallel`` Hugging Face divides the count by ``n_gpu`` and
  sends each GPU a copy (an approximation, in its words); every cgdp replica gets the whole batch's
  count and the replicas' losses are added: the exact loss of one device
  (:func:`test_num_items_in_batch_is_the_whole_batch_count`).
"""
import numpy as np
import pytest
import torch
from torch import nn

transformers = pytest.importorskip("transformers", minversion="5.0")
pytest.importorskip("accelerate")
from transformers.testing_utils import CaptureLogger  # noqa: E402

from cgdp.integrations.transformers import Trainer as CgdpTrainer  # noqa: E402

G = 2  # emulated devices: "n_gpu" in Hugging Face's tests
DEVICES = [f"cpu:{j}" for j in range(G)]


class Regression(torch.utils.data.Dataset):
    """y = a x + b + noise, one feature per sample; label_names: one noisy target each."""

    def __init__(self, a=2.0, b=3.0, length=64, seed=42, label_names=("labels",)):
        rng = np.random.default_rng(seed)
        self.x = rng.normal(size=length).astype(np.float32)
        self.ys = {name: (a * self.x + b + rng.normal(scale=0.1, size=length)).astype(np.float32)
                   for name in label_names}
        self.y = self.ys[label_names[0]]

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return {"input_x": self.x[i], **{name: y[i] for name, y in self.ys.items()}}


class Shapes(torch.utils.data.Dataset):
    """test_dynamic_shapes' data: every `batch` consecutive samples have one length, batches differ."""

    def __init__(self, length=64, batch=16, seed=42):
        rng = np.random.default_rng(seed)
        sizes = rng.integers(1, 20, length // batch).repeat(batch)
        self.x = [rng.normal(size=s).astype(np.float32) for s in sizes]
        self.y = [rng.normal(size=s).astype(np.float32) for s in sizes]

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return {"input_x": self.x[i], "labels": self.y[i]}


class RegressionModel(nn.Module):
    """y = a x + b; with labels, the mean squared error first (double_output: y twice). Its forward
    takes **kwargs: the Trainer passes it num_items_in_batch, which it ignores (a per-sample mean)."""

    def __init__(self, a=0.0, b=0.0, double_output=False):
        super().__init__()
        self.a = nn.Parameter(torch.tensor(a))
        self.b = nn.Parameter(torch.tensor(b))
        self.double_output = double_output
        self.config = None

    def forward(self, input_x, labels=None, **kwargs):
        y = input_x * self.a + self.b
        out = (y, y) if self.double_output else (y,)
        return out if labels is None else (nn.functional.mse_loss(y, labels), *out)


def almost_accuracy(pred):
    return {"accuracy": float((np.abs(pred.predictions - pred.label_ids) <= 0.25).mean())}


def make(tmp_path, cgdp=True, train_len=64, eval_len=64, a=0.0, b=0.0, model=None, double_output=False,
         label_names=("labels",), **kw):
    """Hugging Face's get_regression_trainer: on 2 devices through cgdp, or (cgdp=False) plain
    transformers.Trainer on one device with the global batch of 2 devices."""
    per_train = kw.pop("per_device_train_batch_size", 8)
    per_eval = kw.pop("per_device_eval_batch_size", 8)
    scale = 1 if cgdp else G
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / ("cgdp" if cgdp else "one")), use_cpu=True, report_to="none", disable_tqdm=True,
        save_strategy=kw.pop("save_strategy", "no"), per_device_train_batch_size=per_train * scale,
        per_device_eval_batch_size=per_eval * scale, label_names=list(label_names), **{"learning_rate": 0.1, **kw})
    extra = {"devices": DEVICES} if cgdp else {}
    cls = CgdpTrainer if cgdp else transformers.Trainer
    return cls(model=model or RegressionModel(a, b, double_output), args=args, train_dataset=Regression(length=train_len),
               eval_dataset=Regression(length=eval_len, seed=7, label_names=label_names),
               compute_metrics=almost_accuracy if len(label_names) == 1 and not double_output else None, **extra)


def trained(trainer):
    return trainer.model.a.item(), trainer.model.b.item()


def logs(trainer, key):
    return [h[key] for h in trainer.state.log_history if key in h]


@pytest.fixture(scope="module")
def baseline(tmp_path_factory):
    """Hugging Face's regression run (3 epochs of 64 samples, 8 per device) on one device with the
    global batch and on 2 devices through cgdp."""
    tmp = tmp_path_factory.mktemp("baseline")
    one, two = make(tmp, cgdp=False), make(tmp)
    before = two.args.to_dict()
    outputs = one.train(), two.train()
    assert two.args.to_dict() == before  # test_training_arguments_are_left_untouched
    yield one, two, outputs
    two.close()


def test_trained_model_equals_one_device(baseline):
    """test_trainer_works / test_reproducible_training: the trained a and b."""
    one, two, _ = baseline
    assert trained(two) == pytest.approx(trained(one), rel=1e-5)
    assert trained(two)[0] > 0.5 and trained(two)[1] > 0.5  # on its way to a = 2, b = 3


def test_number_of_steps(baseline):
    """test_number_of_steps_in_training: epochs x len / (per device x n_gpu)."""
    assert baseline[2][1].global_step == 3 * 64 / (8 * G) == baseline[2][0].global_step


def test_batch_size_arithmetic(baseline, tmp_path):
    """args.n_gpu, train_batch_size and eval_batch_size as Hugging Face computes them for n_gpu
    GPUs in one process; nothing is an nn.DataParallel."""
    two = baseline[1]
    assert two.args.n_gpu == G
    assert two.args.train_batch_size == 8 * G and two.args.eval_batch_size == 8 * G
    assert two.state.train_batch_size == 8 * G
    assert not any(isinstance(m, nn.DataParallel) for m in (two.model, two.model_wrapped))
    t = make(tmp_path, per_device_train_batch_size=4, per_device_eval_batch_size=3)
    assert t.args.train_batch_size == 4 * G and t.args.eval_batch_size == 3 * G and t._train_batch_size == 4 * G


def test_train_and_eval_dataloaders(tmp_path):
    """test_train_and_eval_dataloaders: batch sizes per device x n_gpu, lengths, drop_last."""
    t = make(tmp_path, per_device_train_batch_size=16, per_device_eval_batch_size=16)
    assert t.get_train_dataloader().total_batch_size == 16 * G
    assert t.get_eval_dataloader().total_batch_size == 16 * G
    t = make(tmp_path, train_len=66, eval_len=74, per_device_train_batch_size=16, per_device_eval_batch_size=32)
    assert len(t.get_train_dataloader()) == 66 // (16 * G) + 1
    assert len(t.get_eval_dataloader()) == 74 // (32 * G) + 1
    t = make(tmp_path, train_len=66, eval_len=74, per_device_train_batch_size=16, per_device_eval_batch_size=32,
             dataloader_drop_last=True)
    assert len(t.get_train_dataloader()) == 66 // (16 * G)
    assert len(t.get_eval_dataloader()) == 74 // (32 * G)
    assert len(t.get_eval_dataloader(Regression(length=78))) == 78 // (32 * G)


def test_gradient_accumulation(baseline, tmp_path):
    """test_gradient_accumulation: 2 micro-batches of 4 per device train as batches of 8."""
    accumulated = make(tmp_path, per_device_train_batch_size=4, gradient_accumulation_steps=2)
    accumulated.train()
    assert trained(accumulated) == pytest.approx(trained(baseline[0]), rel=1e-5)
    accumulated.close()


def test_logged_loss_grad_norm_and_schedule(tmp_path):
    """Logged training loss, gradient norms (clipped by max_grad_norm) and the learning rate of a
    warmup-then-linear schedule: those of one device."""
    kw = dict(logging_steps=1, max_grad_norm=0.5, warmup_steps=3, lr_scheduler_type="linear", num_train_epochs=2)
    one, two = make(tmp_path, cgdp=False, **kw), make(tmp_path, **kw)
    one.train()
    two.train()
    for key in ("loss", "grad_norm", "learning_rate"):
        assert logs(two, key) == pytest.approx(logs(one, key), rel=1e-5), key
    assert max(logs(one, "grad_norm")) > 0.5
    assert trained(two) == pytest.approx(trained(one), rel=1e-5)
    two.close()


def test_evaluate(tmp_path):
    """test_evaluate: eval_loss is the mse of the whole eval set (an uneven last batch included) and
    compute_metrics sees every prediction in order."""
    t = make(tmp_path, a=1.5, b=2.5, eval_len=66)
    results = t.evaluate()
    x, y = t.eval_dataset.x, t.eval_dataset.y
    pred = 1.5 * x + 2.5
    assert results["eval_loss"] == pytest.approx(float(((pred - y) ** 2).mean()), rel=1e-5)
    assert results["eval_accuracy"] == pytest.approx(float((np.abs(pred - y) <= 0.25).mean()))
    t.close()


def test_predict(tmp_path):
    """test_predict: the predictions of every sample, in order, with its labels."""
    t = make(tmp_path, a=1.5, b=2.5, eval_len=66)
    out = t.predict(t.eval_dataset)
    np.testing.assert_allclose(out.predictions, 1.5 * t.eval_dataset.x + 2.5, rtol=1e-6)
    np.testing.assert_array_equal(out.label_ids, t.eval_dataset.y)
    t.close()


def test_predict_double_output_and_several_labels(tmp_path):
    """test_predict: a model with two outputs, a dataset with two targets (label_names)."""
    t = make(tmp_path, a=1.5, b=2.5, eval_len=66, double_output=True, label_names=("labels", "labels_2"))
    out = t.predict(t.eval_dataset)
    x = t.eval_dataset.x
    assert len(out.predictions) == 2 and len(out.label_ids) == 2
    for p in out.predictions:
        np.testing.assert_allclose(p, 1.5 * x + 2.5, rtol=1e-6)
    np.testing.assert_array_equal(out.label_ids[1], t.eval_dataset.ys["labels_2"])
    t.close()


def test_dynamic_shapes_and_eval_accumulation(tmp_path):
    """test_dynamic_shapes (and eval_accumulation_steps): batches of different lengths, padded
    with -100 across batches in the gathered predictions; each sample's own values first."""
    for accumulate in (None, 2):
        t = make(tmp_path, a=1.0, b=1.0, eval_accumulation_steps=accumulate)
        t.eval_dataset = Shapes()
        t.compute_metrics = None
        out = t.predict(t.eval_dataset)
        for i, (x, y) in enumerate(zip(t.eval_dataset.x, t.eval_dataset.y)):
            np.testing.assert_allclose(out.predictions[i, :len(x)], x + 1.0, rtol=1e-6)
            assert (out.predictions[i, len(x):] == -100).all()
            np.testing.assert_array_equal(out.label_ids[i, :len(y)], y)
        t.close()


def test_evaluate_iterable_dataset(tmp_path):
    """test_evaluate_with_iterable_dataset: no length, batches of per device x n_gpu."""

    class Stream(torch.utils.data.IterableDataset):
        def __iter__(self):
            data = Regression(length=66, seed=7)
            return (data[i] for i in range(len(data)))

    t = make(tmp_path, a=1.5, b=2.5)
    assert t.get_eval_dataloader(Stream()).batch_size == 8 * G
    x, y = Regression(length=66, seed=7).x, Regression(length=66, seed=7).y
    result = t.evaluate(Stream())
    assert result["eval_loss"] == pytest.approx(float(((1.5 * x + 2.5 - y) ** 2).mean()), rel=1e-5)
    t.close()


def test_save_and_resume_from_checkpoint(tmp_path):
    """test_resume_training: resumed from the checkpoint of step 5, the run ends where the
    uninterrupted one did, with the same log; resuming with the batch size unchanged does not warn
    of a changed batch size (trainer_state.json holds per device x n_gpu), resuming with another
    one does, as on n_gpu GPUs."""
    kw = dict(save_strategy="steps", save_steps=5, logging_steps=5, learning_rate=0.1, max_steps=12)
    whole = make(tmp_path, **kw)
    assert whole.train().global_step == 12
    whole.close()
    ckpt = tmp_path / "cgdp" / "checkpoint-5"
    state = transformers.TrainerState.load_from_json(str(ckpt / "trainer_state.json"))
    assert state.train_batch_size == 8 * G
    said = transformers.utils.logging.get_logger("transformers.trainer_utils")
    for per_device in (8, 4):
        resumed = make(tmp_path, per_device_train_batch_size=per_device, **kw)
        with CaptureLogger(said) as cl:
            resumed.train(resume_from_checkpoint=str(ckpt))
        resumed.close()
        if per_device == 8:
            assert "per_device_train_batch_size" not in cl.out
            assert trained(resumed) == trained(whole)
            assert logs(resumed, "loss") == logs(whole, "loss")
        else:
            assert "per_device_train_batch_size: 4 (from args) != 8 (from trainer_state.json)" in cl.out


class OutOfMemoryAbove(transformers.TrainerCallback):
    """test_auto_batch_size_finder's callback: a step with a batch this large 'runs out of memory'."""

    def __init__(self, limit):
        self.limit, self.tried = limit, []

    def on_step_end(self, args, state, control, **kwargs):
        self.tried.append(state.train_batch_size)
        if state.train_batch_size >= self.limit:
            raise RuntimeError("CUDA out of memory.")


def test_auto_find_batch_size(tmp_path):
    """auto_find_batch_size starts from the global batch (per device x n_gpu) and shrinks it until
    a step fits (each try costs Accelerate's gc.collect() calls: one retry here)."""
    t = make(tmp_path, per_device_train_batch_size=16, auto_find_batch_size=True, max_steps=1)
    oom = OutOfMemoryAbove(30)
    t.add_callback(oom)
    t.train()
    assert oom.tried[0] == 16 * G and len(oom.tried) == 2
    assert t.state.train_batch_size == oom.tried[-1] < 30
    assert len(next(iter(t.get_train_dataloader()))["labels"]) == oom.tried[-1]
    t.close()


class Lengths(torch.utils.data.Dataset):
    """Sequences of varied lengths; the collator returns the indices of a batch."""

    def __init__(self, n=2000):
        self.lengths = np.random.default_rng(3).integers(1, 100, n)

    def __len__(self):
        return len(self.lengths)

    def __getitem__(self, i):
        return {"input_ids": [1] * int(self.lengths[i]), "labels": i}


def test_group_by_length_orders_by_the_global_batch(tmp_path):
    """train_sampling_strategy="group_by_length" groups by the global batch: the sample order of
    one device at that batch."""
    order = []
    for cgdp in (False, True):
        t = make(tmp_path, cgdp=cgdp, per_device_train_batch_size=4, train_sampling_strategy="group_by_length")
        t.train_dataset = Lengths()
        t.data_collator = lambda features: torch.tensor([f["labels"] for f in features])
        transformers.set_seed(5)
        order.append(torch.cat(list(t.get_train_dataloader())).tolist())
    assert sorted(order[1]) == list(range(2000))
    assert order[1] == order[0]


class CountingModel(RegressionModel):
    """A model whose loss is a share of a global sum: it divides by num_items_in_batch."""

    def __init__(self):
        super().__init__()
        self.counts = []

    def forward(self, input_x, labels=None, num_items_in_batch=None, **kwargs):
        y = input_x * self.a + self.b
        if labels is None:
            return (y,)
        if num_items_in_batch is None:
            return (nn.functional.mse_loss(y, labels), y)
        self.counts.append(num_items_in_batch)
        return (((y - labels) ** 2).sum() / num_items_in_batch, y)


def test_num_items_in_batch_is_the_whole_batch_count(tmp_path):
    """The documented difference: every replica gets the whole accumulated batch's count (Hugging
    Face with nn.DataParallel: count // n_gpu, one copy per GPU), so the loss, the gradient and the
    trained model are one device's."""
    kw = dict(per_device_train_batch_size=4, gradient_accumulation_steps=2, max_steps=4, logging_steps=1)
    one_model, two_model = CountingModel(), CountingModel()
    one, two = make(tmp_path, cgdp=False, model=one_model, **kw), make(tmp_path, model=two_model, **kw)
    one.train()
    two.train()
    assert [int(c) for c in one_model.counts] == [16] * 8  # 2 micro-batches of 8: 16 samples a step
    replicas = two.replicas
    assert [c.shape for c in two_model.counts] == [torch.Size([])] * 8
    assert [int(c) for c in two_model.counts] == [16] * 8
    assert len(replicas) == G
    assert logs(two, "loss") == pytest.approx(logs(one, "loss"), rel=1e-5)
    assert trained(two) == pytest.approx(trained(one), rel=1e-5)
    two.close()
