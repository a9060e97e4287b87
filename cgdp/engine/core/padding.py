"""A model's own loss under padding: when weighting each part's mean by its samples is seen to be inexact.

``Σ_j n_j/N · loss_j`` is the global mean of a per-sample loss, but a language model's loss is a mean over its part's
tokens (labels other than -100): with uneven padding the combination is off (24 % of an update, measured).
:class:`OwnLossCheck` warns once per engine when the parts' tokens per sample differ, saying what makes it exact.
Counting reads the labels (on a GPU, a host sync), so only the first :data:`CHECKS` labelled batches are looked at.
"""
from __future__ import annotations

import warnings
from typing import Any, Callable, Sequence

import torch

IGNORE_INDEX = -100
"""The label of a padding position (PyTorch's and Hugging Face's ``ignore_index``)."""
CHECKS = 8
"""Batches with labels looked at per engine."""


def labels_of(part: Any) -> torch.Tensor | None:
    """The ``labels`` of a part given as a mapping (keyword arguments, a Hugging Face batch)."""
    try:
        labels = part.get("labels") if hasattr(part, "get") else None
    except Exception:  # a mapping-like object with another get()
        return None
    return labels if isinstance(labels, torch.Tensor) else None


def scalar_losses(output: Any) -> list[torch.Tensor]:
    """The floating 0-dim tensors of an output (losses the model computed)."""
    if isinstance(output, torch.Tensor):
        return [output] if output.dim() == 0 and output.is_floating_point() else []
    if isinstance(output, dict):
        output = list(output.values())
    if isinstance(output, (tuple, list)):
        return [t for v in output for t in scalar_losses(v)]
    return []


class OwnLossCheck:
    """Warns once when a per-sample mean of the parts' own losses is seen not to be the token mean."""

    def __init__(self, face: str, fix: str, warn: Callable[[str], None] | None = None):
        self.face, self.fix = face, fix
        # by default at the caller of Trainer.step: this lambda, warn_once, check, step, its operation wrapper
        self.warn = warn or (lambda message: warnings.warn(message, UserWarning, stacklevel=6))
        """How the warning is given (at the user's line)."""
        self.left = CHECKS

    def uneven(self, labels: Sequence[torch.Tensor | None]) -> str | None:
        """The warning, if the parts' labels hold different tokens per sample; None otherwise."""
        if self.left <= 0 or len(labels) < 2:
            return None
        if any(t is None or t.dim() < 1 or t.is_floating_point() or t.shape[0] == 0 for t in labels):
            return None
        self.left -= 1
        # note: reads the labels (a host sync on a GPU), for the first CHECKS batches only
        per_sample = [int((t != IGNORE_INDEX).sum()) / t.shape[0] for t in labels]
        if max(per_sample) == min(per_sample):
            return None
        shown = ", ".join(f"{v:.3g}" for v in per_sample)
        return (f"{self.face}: the model's own loss is combined across devices as a mean over samples, "
                f"but this batch's labels hold different numbers of tokens per sample on each device "
                f"({shown}; padding is -100), so the combined loss and its gradient are not the token "
                f"mean one device computes on the whole batch. To make it exact, {self.fix}")

    def warn_once(self, message: str) -> None:
        if self.left >= 0:
            self.left = -1
            self.warn(message)

    def check(self, labels: Sequence[torch.Tensor | None]) -> None:
        """Warn (once) if the labels are uneven: the caller trains on the per-sample mean."""
        message = self.uneven(labels)
        if message is not None:
            self.warn_once(message)

    def when_trained(self, output: Any, labels: Sequence[torch.Tensor | None]) -> None:
        """Warn once when a backward runs through a loss of ``output``'s with uneven labels (not a logged-only one)."""
        losses = [t for t in scalar_losses(output) if t.requires_grad]
        message = self.uneven(labels) if losses else None
        if message is not None:
            for t in losses:  # a backward through the other outputs hands this one a zero gradient
                t.register_hook(lambda grad: self.warn_once(message) if grad is not None and bool(grad.ne(0).any())
                                else None)
