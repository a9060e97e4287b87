"""``cgdp.integrations.transformers.Trainer``: Hugging Face's ``transformers.Trainer`` on several devices through cgdp.

The one-line change::

    from cgdp.integrations.transformers import Trainer   # was: from transformers import Trainer

Same arguments, plus ``devices=`` (default: every GPU; two CPU-emulated devices where there is
none, or with ``use_cpu=True``). Where one process sees several GPUs, ``transformers.Trainer``
wraps the model in ``torch.nn.DataParallel`` (``_wrap_model``) and adjusts its step for it
(``args.n_gpu > 1``). This subclass wraps it in :class:`cgdp.DataParallel` instead and takes over
each of those adjustments, so that training equals ``transformers.Trainer`` on one device running
the global batch:

* **Batch size.** ``per_device_train_batch_size`` (and ``per_device_eval_batch_size``) is per
  device, as in Hugging Face: the loader yields ``per_device × len(devices)`` samples, which
  ``cgdp.DataParallel`` splits in device order (an uneven last batch included).
* **n_gpu.** ``args.n_gpu`` is ``len(devices)``, as Hugging Face sets it for as many GPUs in one
  process: its batch arithmetic (``args.train_batch_size``, ``args.eval_batch_size``, the batch
  size saved in ``trainer_state.json`` and checked on resume, ``group_by_length``, auto batch
  size) is the one it does for ``nn.DataParallel``, but nothing is wrapped in ``nn.DataParallel``.
  Its per-GPU loss arithmetic (``num_items_in_batch`` divided by ``n_gpu`` or expanded to one row
  per GPU, the loss scaled by ``n_gpu``) sees one device instead (``compute_loss`` and
  ``_get_num_items_in_batch``): cgdp returns one loss, the global one.
* **num_items_in_batch.** The Trainer counts the tokens of the whole accumulated batch and the
  model divides its token sum by that count. ``cgdp.DataParallel`` sees ``num_items_in_batch`` in
  the call and sums the replicas' losses (``scalar_outputs="auto"``): the exact token mean over all
  micro-batches and devices, padding included. Evaluation passes it too.
* **The optimizer** (``create_optimizer``'s, or one passed in ``optimizers=``) is bound to the
  wrapper (``DataParallel.bind``) once both exist: its step steps every replica.
* **Gradient accumulation** runs every micro-batch but the last of a step inside
  ``model.no_sync()``: only the last backward sends gradients through the host.
* **Clipping** (``max_grad_norm``) uses ``model.clip_grad_norm_``: the norm taken on the first
  device, every replica clipped alike (``torch.nn.utils.clip_grad_norm_`` would change replica 0
  alone, which cgdp then copies to every replica with a warning).
* **Checkpoints, resume, evaluate(), save_model()** work on ``trainer.model``, which is replica 0
  (trained in place); loading into it reaches every replica. A checkpoint also holds the
  replicas' random streams (``cgdp_rng_state.pth``), so that a resumed run with dropout draws the
  masks the uninterrupted one would. ``accelerator.unwrap_model`` sees
  through the wrapper, as it does through ``nn.DataParallel``.

``trainer.close()`` stops cgdp's threads at once (otherwise when the trainer is freed). A model is
in one cgdp engine at a time (:mod:`cgdp.engine.core.claims`): a second Trainer of this kind
given the same model (one made for ``evaluate()`` after another trained) closes the first one's
wrapper when it wraps the model, and the first wraps it again if it is used again.
Mixed precision: ``bf16=True`` runs the forward under Accelerate's autocast on every replica.
"""
from __future__ import annotations

import contextlib
import os
from typing import Any, Iterator, Sequence

import torch

try:
    import transformers
except ImportError as exc:  # pragma: no cover - the hf extra is installed where this is tested
    raise ImportError("cgdp.integrations.transformers needs transformers and accelerate: "
                      "pip install -e \".[hf]\" (or pip install transformers accelerate)") from exc

from cgdp.engine.backend import default_devices, parse_devices
from cgdp.engine.core.claims import holder
from cgdp.engine.dataparallel.dataparallel import DataParallel

__all__ = ["Trainer"]

RNG_FILE = "cgdp_rng_state.pth"
"""Beside Hugging Face's rng_state.pth in a checkpoint: the replicas' random streams."""


class Trainer(transformers.Trainer):
    """``transformers.Trainer`` training on ``devices`` through :class:`cgdp.DataParallel`."""

    def __init__(self, *args: Any, devices: Sequence[str] | None = None, update: str = "devices", **kwargs: Any):
        self._cgdp: DataParallel | None = None
        self._cgdp_update = update  # "host": the optimizer steps float32 masters in host memory
        super().__init__(*args, **kwargs)
        if devices is None:
            devices = ["cpu:0", "cpu:1"] if self.args.use_cpu else default_devices()
        if isinstance(devices, (list, tuple)):  # torch.device("cuda", 1) is "cuda:1", as for DataParallel
            devices = [str(d) if isinstance(d, torch.device) else d for d in devices]
        parse_devices(devices)  # devices=[] is refused here in cgdp's words, not at train() in torch's
        self.devices = list(devices)
        """The devices the model trains on; ``trainer.model`` is replica 0, on ``devices[0]``."""
        self._one_process_view()
        self._train_batch_size = self.args.train_batch_size  # set by Hugging Face with its own n_gpu
        unwrap = self.accelerator.unwrap_model

        def unwrap_cgdp(model: torch.nn.Module, *a: Any, **kw: Any) -> torch.nn.Module:
            return unwrap(model.module if isinstance(model, DataParallel) else model, *a, **kw)
        self.accelerator.unwrap_model = unwrap_cgdp  # as it sees through nn.DataParallel

    def _one_process_view(self) -> None:
        """Hugging Face's batch arithmetic for len(devices) GPUs in one process (args.n_gpu): the
        global batch is per device x devices, wherever it is computed or saved."""
        self.args._n_gpu = len(self.devices)

    @contextlib.contextmanager
    def _one_loss(self) -> Iterator[None]:
        """cgdp returns one loss, exact over every device: Hugging Face's per-GPU loss arithmetic
        for nn.DataParallel (a count per GPU, a vector of losses) must see one device."""
        n_gpu, self.args._n_gpu = self.args._n_gpu, 1
        try:
            yield
        finally:
            self.args._n_gpu = n_gpu

    def compute_loss(self, *args: Any, **kwargs: Any):
        with self._one_loss():  # not loss * n_gpu (average_tokens_across_devices)
            return super().compute_loss(*args, **kwargs)

    def _get_num_items_in_batch(self, *args: Any, **kwargs: Any):
        with self._one_loss():  # the whole batch's count, neither divided nor expanded per GPU
            return super()._get_num_items_in_batch(*args, **kwargs)

    @property
    def replicas(self) -> list[torch.nn.Module]:
        """The model's replicas, one per device (empty before the first train or evaluate)."""
        return [] if self._cgdp is None else self._cgdp.replicas

    def close(self) -> None:
        """Stop cgdp's threads and free its buffers now; ``trainer.model`` keeps its weights."""
        if self._cgdp is not None:
            self._cgdp.close()
            self._cgdp = None
            self.model_wrapped = self.model

    def train(self, *args: Any, **kwargs: Any):
        if self.args.fp16:
            raise ValueError("cgdp.integrations.transformers.Trainer trains with bf16=True or in float32; "
                             "fp16=True needs a gradient scaler, which would unscale replica 0 only")
        self._one_process_view()  # args._n_gpu may have been set again since
        return super().train(*args, **kwargs)

    def _hp_search_setup(self, trial: Any) -> None:
        super()._hp_search_setup(trial)  # a trial sets _train_batch_size from args again
        self._one_process_view()
        self._train_batch_size = self.args.train_batch_size

    def _wrap_model(self, model: torch.nn.Module, training: bool = True, dataloader: Any = None) -> torch.nn.Module:
        """cgdp.DataParallel where the Trainer would use nn.DataParallel; the same wrapper for
        training and evaluation, made once per model."""
        if isinstance(model, DataParallel):
            if not model.closed:
                return model
            model = model.module  # closed (by close(), or by another Trainer that took the model)
        if self._cgdp is not None and not self._cgdp.closed and self._cgdp.module is model:
            return self._cgdp
        if self._cgdp is not None:  # model_init made a new model: the old wrapper goes
            self._cgdp.close()
        other = holder(model)
        if getattr(other, "hugging_face", False):  # another of these Trainers wrapped it: this one trains it now
            other.close()
        self._cgdp = DataParallel(model, self.devices, update=self._cgdp_update)
        self._cgdp.hugging_face = True
        self._bind()  # the optimizer is made before the model is wrapped
        return self._cgdp

    def create_optimizer(self, model: Any = None) -> torch.optim.Optimizer:
        optimizer = super().create_optimizer(model)
        self._bind()  # made after (a second train() of the same wrapper)
        return optimizer

    def _bind(self) -> None:
        """The optimizer, over the wrapped model's parameters, bound to the wrapper (its step
        steps every replica)."""
        opt = getattr(self.optimizer, "optimizer", self.optimizer)  # inside Accelerate's wrapper
        dp = self._cgdp
        if opt is None or dp is None or dp.closed:
            return
        ours = {id(p) for p in dp.parameters()}
        if any(id(p) in ours for g in opt.param_groups for p in g["params"]):
            dp.bind(opt)

    def training_step(self, model: torch.nn.Module, inputs: dict[str, Any],
                      num_items_in_batch: torch.Tensor | int | None = None) -> torch.Tensor:
        """A micro-batch that does not end an optimizer step accumulates without communication."""
        quiet = (isinstance(model, DataParallel) and not self.accelerator.sync_gradients
                 and not self.accelerator.gradient_state.plugin_kwargs.get("sync_each_batch", False))
        with model.no_sync() if quiet else contextlib.nullcontext():
            loss = super().training_step(model, inputs, num_items_in_batch)
        return loss.to(self.args.device)  # where the Trainer sums its losses (devices[0] may differ)

    def compute_loss_context_manager(self) -> contextlib.ExitStack:
        stack = super().compute_loss_context_manager()
        if self._cgdp is not None and self.accelerator.mixed_precision == "bf16":
            # one device gets autocast from accelerator.prepare_model, which a wrapped model skips
            stack.enter_context(self.accelerator.autocast())
        return stack

    def _clip_grad_norm(self, model: torch.nn.Module) -> torch.Tensor:
        if not isinstance(model, DataParallel):
            return super()._clip_grad_norm(model)
        return model.clip_grad_norm_(self.args.max_grad_norm)

    def _get_grad_norm(self, model: torch.nn.Module, grad_norm: Any = None) -> Any:
        if grad_norm is None and isinstance(model, DataParallel):
            grad_norm = model.clip_grad_norm_(float("inf"))  # measured, nothing clipped
        return super()._get_grad_norm(model, grad_norm)

    def _save_rng_state(self, output_dir: str) -> None:
        super()._save_rng_state(output_dir)
        if self._cgdp is not None:  # the replicas' own streams (dropout), beside torch's
            torch.save(self._cgdp.rng_state(), os.path.join(output_dir, RNG_FILE))

    def _load_rng_state(self, checkpoint: str | None) -> None:
        super()._load_rng_state(checkpoint)
        path = None if checkpoint is None else os.path.join(checkpoint, RNG_FILE)
        if self._cgdp is not None and path is not None and os.path.isfile(path):
            self._cgdp.set_rng_state(torch.load(path, weights_only=True))
