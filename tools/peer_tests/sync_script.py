"""Accelerate's ``test_utils/scripts/test_sync.py`` (run by its tests/test_grad_sync.py through a launcher), each
function one test in this process. ``test_noop_sync`` is what one process expects of ``no_sync`` (nothing);
``test_distributed_sync*`` and ``test_gradient_accumulation*`` what several processes expect (Accelerate runs them
only with several)."""
import itertools

import pytest
from accelerate.state import AcceleratorState, GradientState
from accelerate.test_utils.scripts import test_sync as script

FLAGS = list(itertools.product([True, False], repeat=3))  # split_batches, dispatch_batches, sync_each_batch


@pytest.fixture(autouse=True)
def fresh_state():
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    yield
    AcceleratorState._reset_state(True)
    GradientState._reset_state()


@pytest.mark.parametrize("name", ["test_noop_sync", "test_distributed_sync", "test_distributed_sync_multiple_fwd"])
def test_with_accelerator(name):
    accelerator = script.Accelerator()
    try:
        getattr(script, name)(accelerator)
    finally:
        accelerator.free_memory()


def test_dataloader_break():
    script.test_dataloader_break()


@pytest.mark.parametrize("split,dispatch,each", FLAGS)
def test_gradient_accumulation(split, dispatch, each):
    script.test_gradient_accumulation(split, dispatch, each)


@pytest.mark.parametrize("split,dispatch,each", FLAGS)
def test_gradient_accumulation_with_opt_and_scheduler(split, dispatch, each):
    script.test_gradient_accumulation_with_opt_and_scheduler(split, dispatch, each)
