"""The engine: one training step's data path, in rooms that follow a gradient (README, "Layout", says what each module
holds; ``docs/design.md`` the path in order).

``backend/`` the devices (CUDA or CPU-emulated): compute, D2H and H2D streams, events, pinned host memory, random
numbers. ``core/`` the gradient path both faces share, from the backward hooks through the host sum back to every
replica's update, and what surrounds it (replicas, threads, lifetime). ``trainer/`` the face ``cgdp.Trainer``, where
cgdp owns the step; ``dataparallel/`` the face ``cgdp.DataParallel``, behind the user's own loop. ``sync`` (loose): how
threads of one step wait for each other without hanging; every room uses it.

Arrows run one way: a face imports ``core``, ``backend`` and ``sync``; ``core`` imports ``backend`` and ``sync``;
``backend`` imports ``sync``; the two faces never import each other. The engine may import :mod:`cgdp.planning` and
:mod:`cgdp.comm`, never :mod:`cgdp.cli` (``tests/test_layout.py``).
"""
