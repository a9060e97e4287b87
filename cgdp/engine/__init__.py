"""The engine: one training step's data path, in rooms that follow a gradient.

``backend/`` the devices (CUDA or CPU-emulated): compute, D2H and H2D streams, events, pinned host
memory, each device's random numbers. Below everything else of the engine.

``core/`` the gradient path both faces share, in the order a gradient travels: ``layers`` (what a
layer is) → ``hooks`` (per-parameter backward hooks send a chunk when it is complete) →
``flatgrad`` (the flat gradient buffer in chunk order; ``param.grad`` are views into it) → the
device's D2H stream → ``host`` (pinned slots, the accumulator thread) → ``accumulate`` (the host
kernel) → the H2D stream back; ``stream`` (:class:`~cgdp.engine.core.stream.GradientStream`) holds
them together for G replicas. Around it, also shared: ``replicas`` (one copy of the model per
device, each device's share of the batch), ``threads`` (one host thread per device), ``buffers``
(BatchNorm statistics made identical), ``clip`` (clipping on the host norm), ``precision``
(gradient dtypes on the host), ``drain`` (bringing the engine to rest), ``lifetime`` (one caller at
a time; release on close or drop), ``update`` (how the averaged gradient becomes every replica's
parameters: each device steps its own replica, or the paper's baseline, device 0 gathers, steps and
broadcasts).

``trainer/`` the face ``cgdp.Trainer``, where cgdp owns the step: ``options`` (the modes, each an
update strategy; the arguments checked) → ``batch`` (split and weight) → ``passes`` (forward and
backward on the device threads) and ``losses`` (each device's loss and backward weight) → the core
→ ``hyperparameters`` (agreement across replicas and ranks, schedulers); ``state`` (checked
restores), ``timing`` (profiles and traces).

``dataparallel/`` the face ``cgdp.DataParallel``, behind the user's own loop: ``scatter`` (split the
arguments, gather the outputs) → the core → ``grads`` (what each replica's ``.grad`` holds
between backwards) → ``steps`` and ``binding`` (the bound optimizer steps every replica).

``sync`` (loose): how threads of one step wait for each other without hanging; every room uses it.

Arrows run one way: a face imports ``core``, ``backend`` and ``sync``; ``core`` imports ``backend``
and ``sync``; ``backend`` imports ``sync``; the two faces never import each other. The engine may
import :mod:`cgdp.planning` and :mod:`cgdp.comm`, never :mod:`cgdp.cli` (``tests/test_layout.py``).
"""
