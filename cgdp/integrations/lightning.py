"""Lightning through cgdp: ``L.Trainer(accelerator="gpu", devices=4, strategy=CGDPStrategy())``.

One process drives every device (no launcher, no ``torch.distributed``); the user's
``LightningModule`` is unchanged. Importing this module registers ``strategy="cgdp"``.

* **What is wrapped.** Not the ``LightningModule`` (Lightning calls its ``training_step`` and
  ``self.log`` on it, and a deep copy per device would lose its ``trainer``), but the one child
  module that holds every trainable parameter (``self.model``, ``self.net``...; ``module=`` names
  it when there are several children), run by a :class:`cgdp.DataParallel` for the duration of
  each ``fit`` / ``validate`` / ``test`` / ``predict``. The wrapper stays outside the user's module
  tree, as Lightning's DDP keeps its wrapper outside: the child stays where it is, of its own type,
  and only its ``forward`` is routed (:class:`_Route`), so ``self.net(x)`` inside ``training_step``
  splits the batch across the devices and gathers the output on ``devices[0]``, where the loss,
  ``self.log`` and every metric are computed as on one device, while ``self.net.g``,
  ``self.layer.weight`` and its ``.grad``, ``self.parameters()`` and ``state_dict()`` read as on
  one device (replica 0 is the user's module, and after a synced backward its ``.grad`` holds the
  whole batch's gradient). ``configure_optimizers`` runs on that tree; the strategy binds each of
  its optimizers over the child's parameters to the DataParallel (``DataParallel.bind``), so its
  step steps every replica, schedulers included. An optimizer over the child's parameters and others
  (``SGD(self.parameters())`` beside a frozen sibling) is refused with a sentence.
* **Optimizer step.** Lightning's precision plugins call ``optimizer.step(closure=...)``; cgdp
  refuses a closure (every replica must step after one backward), so the strategy hands the
  plugin an optimizer whose ``step`` runs the closure once (forward, backward, Lightning's
  ``on_before_optimizer_step`` and clipping) and then ``optimizer.step()``, as Lightning's AMP
  plugin does. An optimizer whose ``step`` needs the closure to re-run forward and backward
  (``torch.optim.LBFGS``: ``closure`` without a default) is refused when the Trainer sets up the
  optimizers, before training starts.
* **Accumulation.** Lightning enters ``block_backward_sync()`` for every micro-batch but the last
  of a step: that is ``no_sync()``, so one transfer per optimizer step.
* **Clipping** by norm is ``DataParallel.clip_grad_norm_`` (the norm taken on the first device):
  every replica clipped alike. Clipping by value changes
  replica 0 and is copied to the others, with cgdp's warning.
* **Precision.** ``"32-true"`` and ``"bf16-mixed"`` (autocast on every replica). Refused:
  ``"16-mixed"`` (its gradient scaler would unscale replica 0 only) and the ``"*-true"``
  precisions other than ``"32-true"`` (they convert the module in place; convert it yourself before
  ``fit`` if you want that, cgdp trains it in its dtype).
* **Checkpoints.** The state dict is the user's module's (nothing of cgdp in the tree); the checkpoint also
  holds the replicas' random streams (:data:`RNG_KEY`), restored by ``fit(ckpt_path=...)`` so that a
  resumed run with dropout is bitwise the uninterrupted one (on as many devices).
* ``self.log(..., sync_dist=True)`` is one process's value, as on one device (there is nothing to
  reduce); ``trainer.world_size`` is 1.
"""
from __future__ import annotations

import contextlib
import inspect
import types
from typing import Any, Callable, Iterator, Sequence

import torch
from torch import nn

try:
    import lightning.pytorch as pl
    from lightning.pytorch.plugins.precision import MixedPrecision, Precision
    from lightning.pytorch.strategies import ParallelStrategy, StrategyRegistry
except ImportError as exc:  # pragma: no cover - the lightning extra is installed where this is tested
    raise ImportError("cgdp.integrations.lightning needs Lightning: pip install -e \".[lightning]\" "
                      "(or pip install lightning)") from exc

from cgdp.engine.backend import default_devices
from cgdp.engine.dataparallel.dataparallel import DataParallel

__all__ = ["CGDPStrategy", "RNG_KEY"]

RNG_KEY = "cgdp_rng_state"
"""The key of the replicas' random streams in a Lightning checkpoint."""


class _StepAfterClosure:
    """What a precision plugin steps: runs the closure, then ``optimizer.step()`` without it."""

    def __init__(self, optimizer: torch.optim.Optimizer):
        self.optimizer = optimizer

    def step(self, closure: Callable[[], Any] | None = None, **kwargs: Any) -> Any:
        result = closure() if closure is not None else None
        self.optimizer.step(**kwargs)
        return result

    def __getattr__(self, name: str) -> Any:  # param_groups, state... for the hooks that see it
        return getattr(self.optimizer, name)

    @property
    def __class__(self) -> type:  # isinstance(optimizer, torch.optim.AdamW) in the user's hooks
        return type(self.optimizer)


class _Route:
    """The wrapped child's ``forward`` while a :class:`DataParallel` runs it, an attribute of that one instance.

    ``self.net(x)`` in the user's code enters the DataParallel (the batch split across the devices, the output
    gathered on the first); the DataParallel's own call of replica 0, which is the same module, runs the module's
    forward. The module stays where the user put it: its attributes, submodules, ``parameters()`` and
    ``state_dict()`` are the user's, as on one device. A deep copy or a pickle of the module while it is wrapped
    (``StochasticWeightAveraging``) gets the plain forward. :meth:`remove` puts the module back as it was.
    """

    def __init__(self, child: nn.Module, dp: DataParallel):
        self.child, self.dp = child, dp
        self.own = child.__dict__.get("forward")  # a forward the user set on the instance, kept
        self.inner = _plain_forward(child, self.own)
        self.inside = False  # the DataParallel is running: this call is replica 0's
        child.forward = self

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.inside:
            return self.inner(*args, **kwargs)
        self.inside = True
        try:
            return self.dp(*args, **kwargs)
        finally:
            self.inside = False

    def __reduce__(self) -> tuple:
        return _plain_forward, (self.child, self.own)

    def remove(self) -> None:
        d = self.child.__dict__
        if d.get("forward") is self:
            if self.own is None:
                del d["forward"]
            else:
                d["forward"] = self.own
        self.dp.close()


def _plain_forward(child: nn.Module, own: Callable[..., Any] | None) -> Callable[..., Any]:
    return own if own is not None else types.MethodType(type(child).forward, child)


def _refuse_closure_optimizer(opt: Any) -> None:
    """An optimizer whose ``step(closure)`` must re-run forward and backward (``LBFGS``): refused at setup."""
    closure = inspect.signature(type(opt).step).parameters.get("closure")
    if closure is not None and closure.default is inspect.Parameter.empty:
        name = type(opt).__name__
        raise ValueError(f"CGDPStrategy cannot train with {name}: its step(closure) re-runs your forward and "
                         f"backward inside the step, while cgdp.DataParallel steps every replica after one "
                         f"backward (the replicas would step apart). Use an optimizer whose step() needs no "
                         f"closure (SGD, Adam, AdamW, ...), or train {name} on one device "
                         f"(strategy='auto', devices=1)")


class CGDPStrategy(ParallelStrategy):
    """Lightning's strategy for several devices in one process, through :class:`cgdp.DataParallel`.

    Args:
        devices: cgdp device strings (``["cuda:0", "cuda:1"]``, ``["cpu:0", "cpu:1"]``); ``None``:
            the Trainer's ``accelerator`` and ``devices`` (``accelerator="cpu", devices=N``: N
            CPU-emulated devices).
        module: the name of the LightningModule's child to wrap; ``None``: the one child that
            holds trainable parameters.
        **options: :class:`cgdp.DataParallel`'s options (``chunks``, ``timeout_s``, ...).
    """

    strategy_name = "cgdp"

    def __init__(self, devices: Sequence[str] | None = None, *, module: str | None = None, **options: Any):
        if "comm" in options:
            raise NotImplementedError("CGDPStrategy trains on one machine; several machines: "
                                      "cgdp.DataParallel(..., comm='mpi') behind your own loop (docs/mpi.md)")
        super().__init__()
        self._devices = None if devices is None else [str(d) for d in devices]
        if self._devices is not None:
            self.parallel_devices = [_torch_device(d) for d in self._devices]
        self._child = module
        self._options = options
        self._route: _Route | None = None  # the wrapped child's forward while a DataParallel runs it
        self._rng_to_restore: dict[str, Any] | None = None

    # ------------------------------------------------------------------ devices
    @property
    def devices(self) -> list[str]:
        """cgdp's device strings: given, or the Trainer's devices (``cpu`` ones numbered)."""
        if self._devices is not None:
            return self._devices
        found = self.parallel_devices or []
        if not found:
            return default_devices()
        if all(d.type == "cpu" for d in found):
            return [f"cpu:{j}" for j in range(len(found))]
        return [str(d) for d in found]

    @property
    def root_device(self) -> torch.device:
        return _torch_device(self.devices[0])

    @property
    def num_processes(self) -> int:
        return len(self.devices)

    @property
    def world_size(self) -> int:
        return 1  # one process drives every device

    @property
    def global_rank(self) -> int:
        return 0

    @property
    def local_rank(self) -> int:
        return 0

    @property
    def node_rank(self) -> int:
        return 0

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        return {"num_replicas": 1, "rank": 0}

    def model_to_device(self) -> None:
        assert self.model is not None
        self.model.to(self.root_device)

    # ------------------------------------------------------------------ setup and teardown
    def setup(self, trainer: "pl.Trainer") -> None:
        self._check_precision()
        super().setup(trainer)  # convert_module, model_to_device, _setup_model, optimizers
        dp = self._dp
        if self._rng_to_restore is not None and dp is not None:
            state, self._rng_to_restore = self._rng_to_restore, None
            if len(state["states"]) == len(dp.devices) or trainer.state.fn == "fit":
                dp.set_rng_state(state)  # fit on another number of devices: its clear error

    def _check_precision(self) -> None:
        plugin = self.precision_plugin
        if type(plugin) is Precision:
            return
        if type(plugin) is MixedPrecision and plugin.precision == "bf16-mixed":
            return
        name = getattr(plugin, "precision", type(plugin).__name__)
        if name == "16-mixed":
            raise ValueError("CGDPStrategy trains with precision='bf16-mixed' or '32-true'; '16-mixed' needs a "
                             "gradient scaler, which would unscale replica 0 only: use 'bf16-mixed'")
        raise ValueError(f"CGDPStrategy trains with precision='bf16-mixed' or '32-true', not {name!r}: "
                         f"to train in another dtype, convert the model before fit (e.g. model.to(torch.bfloat16)) "
                         f"and keep precision='32-true'")

    def _setup_model(self, model: nn.Module) -> nn.Module:
        """Build the DataParallel over the child that holds the trainable parameters; the tree stays the user's."""
        name = self._child_to_wrap(model)
        if name is not None:
            child = getattr(model, name)
            self._route = _Route(child, DataParallel(child, self.devices, **self._options))
        return model

    @property
    def _dp(self) -> DataParallel | None:
        return self._route.dp if self._route is not None else None

    def setup_optimizers(self, trainer: "pl.Trainer") -> None:
        """``configure_optimizers``'s optimizers; those over the wrapped child's parameters bound to its
        DataParallel. An optimizer whose ``step`` needs a closure is refused here, before training starts."""
        super().setup_optimizers(trainer)
        for opt in self.optimizers:
            _refuse_closure_optimizer(opt)
        dp = self._dp
        if dp is not None:
            ours = {id(p) for p in dp.parameters()}
            for opt in self.optimizers:
                held = [p for g in opt.param_groups for p in g["params"]]
                if any(id(p) in ours for p in held):  # and others (a frozen sibling): stepped where they are
                    dp.bind(opt)

    def _child_to_wrap(self, model: nn.Module) -> str | None:
        own = [n for n, p in model.named_parameters(recurse=False) if p.requires_grad]
        if own:
            raise ValueError(f"CGDPStrategy wraps a child module of your LightningModule, which holds its own "
                             f"parameters {own}: move them into a child module (e.g. self.model) whose forward "
                             f"your training_step calls")
        if self._child is not None:
            if not isinstance(getattr(model, self._child, None), nn.Module):
                raise ValueError(f"CGDPStrategy(module={self._child!r}): your LightningModule has no child "
                                 f"module of that name")
            outside = [n for n, c in model.named_children() if n != self._child
                       and any(p.requires_grad for p in c.parameters())]
            if outside:
                raise ValueError(f"CGDPStrategy(module={self._child!r}): the children {outside} also hold trainable "
                                 f"parameters, which would train on devices[0] only: freeze them, or put them "
                                 f"inside {self._child!r}")
            return self._child
        trained = [n for n, c in model.named_children() if any(p.requires_grad for p in c.parameters())]
        if len(trained) > 1:
            raise ValueError(f"CGDPStrategy wraps the one child module of your LightningModule that holds every "
                             f"trainable parameter; {trained} all do: put them in one module whose forward "
                             f"your training_step calls, or name one with CGDPStrategy(module=...) and freeze "
                             f"the others")
        if trained:
            return trained[0]
        children = [n for n, c in model.named_children() if any(True for _ in c.parameters())]
        return children[0] if len(children) == 1 else None  # nothing trains: inference on every device

    def _unwrap(self) -> None:
        if self._route is not None:
            route, self._route = self._route, None
            route.remove()

    def teardown(self) -> None:
        self._unwrap()  # before Lightning moves the module to the CPU: a wrapper refuses to move
        super().teardown()

    def on_exception(self, exception: BaseException) -> None:
        self._unwrap()

    # ------------------------------------------------------------------ the step
    def optimizer_step(self, optimizer: torch.optim.Optimizer, closure: Callable[[], Any],
                       model: "pl.LightningModule | nn.Module | None" = None, **kwargs: Any) -> Any:
        model = model or self.lightning_module
        if self._route is None:
            return super().optimizer_step(optimizer, closure, model, **kwargs)
        return self.precision_plugin.optimizer_step(_StepAfterClosure(optimizer), model=model, closure=closure,
                                                    **kwargs)

    @contextlib.contextmanager
    def block_backward_sync(self) -> Iterator[None]:
        """A micro-batch that does not end an optimizer step accumulates without communication."""
        with self._dp.no_sync() if self._dp is not None else contextlib.nullcontext():
            yield None

    def _clip_grad_by_norm(self, optimizer: torch.optim.Optimizer, clip_val: float) -> None:
        self._dp.clip_grad_norm_(clip_val)

    def setup_precision_plugin(self) -> None:
        super().setup_precision_plugin()
        if self._route is not None:  # the model's clip_grad_norm_: every replica clipped alike
            self.precision_plugin.clip_grad_by_norm = self._clip_grad_by_norm

    # ------------------------------------------------------------------ one process
    def reduce(self, tensor: Any, group: Any = None, reduce_op: Any = "mean") -> Any:
        return tensor  # one process: the value is already the whole batch's

    def barrier(self, name: str | None = None) -> None:
        pass

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        return obj

    def all_gather(self, tensor: torch.Tensor, group: Any = None, sync_grads: bool = False) -> torch.Tensor:
        return tensor

    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:
        return decision

    def teardown_environment(self) -> None:
        pass

    # ------------------------------------------------------------------ checkpoints
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any = None) -> None:
        if self._dp is not None:
            checkpoint = {**checkpoint, RNG_KEY: self._dp.rng_state()}
        super().save_checkpoint(checkpoint, filepath, storage_options)

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        # weights_only: the random streams are plain tensors and lists
        checkpoint = super().load_checkpoint(checkpoint_path, weights_only=weights_only)
        self._rng_to_restore = checkpoint.get(RNG_KEY)  # set once the replicas exist (setup)
        return checkpoint

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        strategy_registry.register(cls.strategy_name, cls, description="one process, several devices, through cgdp",
                                   override=True)


def _torch_device(device: str) -> torch.device:
    """The torch device of a cgdp device string (``"cpu:1"`` is the CPU)."""
    return torch.device("cpu") if str(device).startswith("cpu") else torch.device(device)


CGDPStrategy.register_strategies(StrategyRegistry)
