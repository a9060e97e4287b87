"""Accelerate through cgdp: ``from cgdp.integrations.accelerate import Accelerator``.

The user's Accelerate loop stays as it is (``accelerator.prepare(...)``, ``with
accelerator.accumulate(model):``, ``accelerator.backward(loss)``, ``optimizer.step()``); the
batch a prepared loader yields is the global batch, which the model splits across ``devices``.
Plain Accelerate runs one process on one device (``DistributedType.NO``); this one process drives
every device, equal to Accelerate on one device with the same batches:

* ``prepare`` wraps each model in :class:`cgdp.DataParallel` (``net`` is replica 0, on
  ``devices[0]``, which is ``accelerator.device``: batches and targets land where the outputs
  are gathered), instead of moving it with ``.to(accelerator.device)``. ``mixed_precision="bf16"``
  autocasts the wrapper's forward (every replica, through cgdp's caller context), as Accelerate
  autocasts a model's; ``"fp16"`` is refused (its gradient scaler would unscale replica 0 only).
* ``accumulate()`` runs every micro-batch but the last of a step inside ``model.no_sync()``
  (plain Accelerate enters ``no_sync`` only with several processes): one transfer per step;
  ``GradientAccumulationPlugin(sync_each_batch=True)``: none, every backward sums.
* ``trigger_sync_in_backward(model)`` is the model's ``sync_in_backward()``: several forwards under
  ``no_sync``, then the backward inside it sums everything the replicas accumulated (exact).
* ``prepare`` binds each optimizer to the cgdp model whose parameters it holds
  (``model.bind(optimizer)``): its ``step()`` steps every replica.
* ``trigger_sync_in_backward(model)`` makes the backward inside sum every replica's gradient
  (Accelerate's own does nothing without DDP); ``GradientAccumulationPlugin(sync_each_batch=True)``
  keeps ``accumulate()`` out of ``no_sync``, as Accelerate does with several processes.
* ``clip_grad_norm_(model.parameters(), ...)`` is the model's, every replica clipped alike (other parameter lists: Accelerate's own clipping of replica 0,
  which cgdp copies to every replica with a warning).
* ``unwrap_model`` and ``get_state_dict`` give the user's module and its keys; an attribute the prepared model
  lacks is read on the user's module (``model.config``), as on the module plain Accelerate returns.
* ``save_state`` / ``load_state`` also keep the replicas' random streams (:data:`RNG_FILE`), so that
  a resumed run with dropout is bitwise the uninterrupted one (on as many devices). The model file
  ``save_state`` writes has the wrapper's ``module.`` keys, as with DDP in Accelerate.
"""
from __future__ import annotations

import contextlib
import os
from typing import Any, Iterable, Iterator, Sequence

import torch
from torch import nn

try:
    import accelerate
except ImportError as exc:  # pragma: no cover - the accelerate extra is installed where this is tested
    raise ImportError("cgdp.integrations.accelerate needs Accelerate: pip install -e \".[accelerate]\" "
                      "(or pip install accelerate)") from exc

from accelerate.utils import is_bitsandbytes_multi_backend_available, is_xpu_available

from cgdp.engine.backend import default_devices
from cgdp.engine.dataparallel.dataparallel import DataParallel

__all__ = ["Accelerator", "RNG_FILE"]

RNG_FILE = "cgdp_rng_state.pth"
"""Beside Accelerate's files in a ``save_state`` folder: the replicas' random streams."""


class Accelerator(accelerate.Accelerator):
    """``accelerate.Accelerator`` whose ``prepare`` trains each model on ``devices`` through cgdp.

    Args:
        devices: cgdp device strings; ``None``: every GPU, or two CPU-emulated devices without one
            (and with ``cpu=True``).
        cgdp_options: :class:`cgdp.DataParallel`'s options (``chunks``, ``timeout_s``, ...).
        **accelerate_kwargs: ``accelerate.Accelerator``'s arguments.
    """

    def __init__(self, devices: Sequence[str] | None = None, *, cgdp_options: dict[str, Any] | None = None,
                 **accelerate_kwargs: Any):
        if accelerate_kwargs.get("mixed_precision") == "fp16":
            raise ValueError(_FP16)
        if devices is None:
            devices = ["cpu:0", "cpu:1"] if accelerate_kwargs.get("cpu") else default_devices()
        self.devices = [str(d) for d in devices]
        """The devices every prepared model trains on; ``accelerator.device`` is ``devices[0]``."""
        self._cgdp_options = dict(cgdp_options or {})
        self._each_batch = False  # inside accumulate() with sync_each_batch: no no_sync()
        first = self.devices[0]
        self._first_device = torch.device("cpu") if first.startswith("cpu") else torch.device(first)
        super().__init__(**accelerate_kwargs)
        if self.mixed_precision == "fp16":  # from the environment or a config file
            raise ValueError(_FP16)
        if self.num_processes > 1:
            raise RuntimeError("cgdp.integrations.accelerate.Accelerator drives every device from one process: "
                               "run the script with python, not with several processes of accelerate launch")
        self.register_save_state_pre_hook(_save_replica_rng)
        self.register_load_state_pre_hook(_load_replica_rng)

    @property
    def device(self) -> torch.device:
        """``devices[0]``, where the replicas' outputs are gathered (batches are put there)."""
        return self._first_device

    def prepare_model(self, model: nn.Module, device_placement: bool | None = None,
                      evaluation_mode: bool = False) -> nn.Module:
        if (isinstance(model, nn.Module) and not isinstance(model, DataParallel)
                and not getattr(model, "_is_accelerate_prepared", False)):
            self._check_loading(model)
            model = _Prepared(model, self.devices, **self._cgdp_options)
        # the wrapper places every replica; Accelerate's autocast goes on the wrapper's forward
        model = super().prepare_model(model, device_placement=False, evaluation_mode=evaluation_mode)
        if isinstance(model, _Prepared):
            model.__dict__["_cgdp_reads_module"] = True  # Accelerate's own checks above read the wrapper
        self._bind()  # an optimizer prepared before its model
        return model

    def _check_loading(self, model: nn.Module) -> None:
        """Accelerate's ``prepare_model`` guards on how the model was loaded (``hf_device_map``,
        ``is_loaded_in_8bit`` / ``4bit``), read on the user's module before cgdp wraps it (the wrapper
        has neither). Accelerate refuses a device map of several entries in a distributed mode only;
        cgdp copies the model to each device, which counts as one when there are several."""
        several = len(self.devices) > 1
        if several and self.verify_device_map(model):
            raise ValueError(_SPREAD)
        device_map = getattr(model, "hf_device_map", None)
        quantized = getattr(model, "is_loaded_in_8bit", False) or getattr(model, "is_loaded_in_4bit", False)
        if not (quantized and device_map):
            return
        where = set(device_map.values())
        bnb_cpu = is_bitsandbytes_multi_backend_available()  # bitsandbytes that trains on CPU
        if len(where) == 1 and not where & {"cpu", "disk"} and not (self.device.type == "cpu" and bnb_cpu):
            (at,) = where
            index = at if isinstance(at, int) else torch.device(at).index
            if torch.device(self.device.type, index) != self.device and (self.device.index is not None or index != 0):
                raise ValueError(_QUANTIZED_ELSEWHERE)
        if "disk" in where or ("cpu" in where and (not bnb_cpu or is_xpu_available())):
            raise ValueError(_QUANTIZED_OFFLOAD)

    def prepare_optimizer(self, optimizer: torch.optim.Optimizer, device_placement: bool | None = None):
        optimizer = super().prepare_optimizer(optimizer, device_placement=device_placement)
        self._bind()
        return optimizer

    def _bind(self) -> None:
        """Every prepared optimizer over a prepared cgdp model's parameters is bound to it (once)."""
        for model in self._models:
            if isinstance(model, DataParallel) and not model.closed:
                ours = {id(p) for p in model.parameters()}
                for opt in self._optimizers:
                    raw = getattr(opt, "optimizer", opt)
                    if any(id(p) in ours for g in raw.param_groups for p in g["params"]):
                        model.bind(raw)

    @contextlib.contextmanager
    def accumulate(self, *models: nn.Module) -> Iterator[None]:
        """Accelerate's, which enters ``no_sync`` on every micro-batch but a step's last; with
        ``GradientAccumulationPlugin(sync_each_batch=True)`` none: every backward sums (Accelerate
        honours it only with several processes)."""
        if self.gradient_state.plugin_kwargs.get("sync_each_batch", False):
            models = ()  # Accelerate's counting of micro-batches, no no_sync
        with super().accumulate(*models):
            yield

    @contextlib.contextmanager
    def no_sync(self, model: nn.Module) -> Iterator[None]:
        """For a cgdp model, its ``no_sync()`` (accumulation without communication)."""
        if isinstance(model, DataParallel) and not self._each_batch:
            with model.no_sync():
                yield
        else:
            with super().no_sync(model):
                yield

    @staticmethod
    @contextlib.contextmanager
    def trigger_sync_in_backward(model: nn.Module) -> Iterator[None]:
        """For a cgdp model, its ``sync_in_backward()``: the backward run inside sums every replica's gradient,
        also through forwards run under ``no_sync`` (Accelerate's own does nothing for a model that is not DDP)."""
        if isinstance(model, DataParallel):
            with model.sync_in_backward():
                yield
        else:
            with accelerate.Accelerator.trigger_sync_in_backward(model):
                yield

    def clip_grad_norm_(self, parameters: Iterable[torch.Tensor], max_norm: float, norm_type: float = 2):
        parameters = list(parameters)
        for model in self._models:
            if isinstance(model, DataParallel) and parameters == list(model.parameters()):
                return model.clip_grad_norm_(max_norm, norm_type)  # every replica alike
        return super().clip_grad_norm_(parameters, max_norm, norm_type=norm_type)

    def unwrap_model(self, model: nn.Module, keep_fp32_wrapper: bool = True, keep_torch_compile: bool = True):
        if isinstance(model, DataParallel):
            return model.module  # the user's module: Accelerate's autocast is on the wrapper
        return super().unwrap_model(model, keep_fp32_wrapper=keep_fp32_wrapper, keep_torch_compile=keep_torch_compile)

    def free_memory(self, *objects: Any) -> Any:
        for model in self._models:  # the replicas, threads and host buffers go with the models
            if isinstance(model, DataParallel):
                model.close()
        return super().free_memory(*objects)


_PLAIN = (int, float, complex, bool, str, bytes, type(None), torch.dtype, torch.device)


def _plain(value: Any) -> bool:
    """A value reading cannot change: a number, a string, a tuple of such."""
    return isinstance(value, _PLAIN) or (type(value) is tuple and all(map(_plain, value)))


class _Prepared(DataParallel):
    """What ``prepare`` returns for a model: a :class:`cgdp.DataParallel` on which an attribute it does not have is
    read on the user's module (``model.a``, a parameter; ``model.num_labels``) when it is a plain value, as on the very
    module plain Accelerate returns on one device. Anything else (``model.config``, a method, a submodule) would be
    replica 0's alone, and a change to it would not reach the others: refused with a sentence. Names with a leading
    underscore stay the wrapper's; attributes set go on the wrapper, as with DDP."""

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            if name.startswith("_") or not self.__dict__.get("_cgdp_reads_module"):
                raise
            value = getattr(self.module, name)
            # a parameter or buffer: an edit in place is followed to every replica (a plain tensor attribute is not)
            if _plain(value) or (isinstance(value, torch.Tensor) and any(
                    value is t for t in (*self.module.parameters(), *self.module.buffers()))):
                return value
            raise AttributeError(
                f"the model prepared by cgdp.integrations.accelerate.Accelerator is a cgdp.DataParallel; {name!r} of "
                f"your module is a {type(value).__name__}, which it reads for you only when it is a plain value "
                f"(a number, a string, a parameter or buffer): a change made through it would reach replica 0 alone. Read it as "
                f"accelerator.unwrap_model(model).{name}, and make changes (config, gradient checkpointing, "
                f"resizing) before accelerator.prepare(model)") from None


_FP16 = ("cgdp.integrations.accelerate.Accelerator trains with mixed_precision='bf16' or in float32; "
         "'fp16' needs a gradient scaler, which would unscale replica 0 only: use 'bf16'")


# Accelerate's own sentences (accelerator.py, prepare_model), then cgdp's for a model spread over devices
_QUANTIZED_OFFLOAD = (
    "You can't train a model that has been loaded in 8-bit or 4-bit precision with CPU or disk offload. "
    "If you want train the 8-bit or 4-bit model in CPU, please install bitsandbytes with multi-backend, see "
    "https://huggingface.co/docs/bitsandbytes/main/en/installation#multi-backend")
_QUANTIZED_ELSEWHERE = (
    "You can't train a model that has been loaded in 8-bit or 4-bit precision on a different device than the one "
    "you're training on. Make sure you loaded the model on the correct device using for example "
    "`device_map={'':torch.cuda.current_device()}` or `device_map={'':torch.xpu.current_device()}`")
_SPREAD = ("cgdp.integrations.accelerate.Accelerator trains a copy of the model on each of its devices, and this "
           "model was dispatched by a device_map of several entries (its hf_device_map: device_map='auto' or a "
           "dict), whose hooks tie each layer to the device the map names: load it without a device_map or on "
           "one device (device_map={'': 0}), or train it over its device_map with plain accelerate.Accelerator")


def _save_replica_rng(models: list[nn.Module], weights: list, output_dir: str) -> None:
    states = {i: m.rng_state() for i, m in enumerate(models) if isinstance(m, DataParallel)}
    if states:
        os.makedirs(output_dir, exist_ok=True)
        torch.save(states, os.path.join(output_dir, RNG_FILE))


def _load_replica_rng(models: list[nn.Module], input_dir: str) -> None:
    path = os.path.join(input_dir, RNG_FILE)
    if not os.path.isfile(path):
        return
    for i, state in torch.load(path, weights_only=True).items():
        if i < len(models) and isinstance(models[i], DataParallel):
            models[i].set_rng_state(state)
