"""The data path of one step, in the order a gradient travels.

``hooks`` (per-parameter backward hooks mark layers ready) → ``flatgrad`` (the flat gradient buffer,
laid out in chunk order; ``param.grad`` are views into it) → ``backend`` (device streams: CUDA or
CPU-emulated) → ``host`` (pinned slots, the accumulator thread) → ``accumulate`` (the host kernel)
→ copy back; ``stream`` holds these together for G replicas (what both faces, ``Trainer`` and
``DataParallel``, share) → ``trainer`` (the step and the update) and ``dataparallel`` (the same
data path behind the user's own loop: ``scatter`` splits arguments and gathers outputs, ``mirror``
steps every replica with the user's optimizer). Around the step: ``batch`` (splitting and
weighting), ``losses`` (each device's loss, its backward weight, autocast), ``typical`` (the
paper's baseline), ``buffers`` (BatchNorm statistics), ``update`` (clipping, schedulers,
hyperparameter agreement), ``precision`` (gradient dtypes on the host), ``replicas``,
``replica_grads`` (DataParallel's gradient bookkeeping), ``threads`` (one host thread per
device), ``lifetime`` (one caller at a time; release on close or drop), ``state`` (checked
restores), ``drain`` (bringing the engine to rest), ``timing`` (profiles and traces), ``rng``
(random streams per device), ``sync`` (waiting without hanging), ``layers`` (what a layer is).

May import: :mod:`cgdp.planning` (plans, profiles, tuners) and :mod:`cgdp.comm`. Never imports
:mod:`cgdp.cli`.
"""
