"""The command-line applications: ``python -m cgdp.train`` and ``python -m cgdp.plan``.

``train`` (the training job) with ``config`` (typed configs, presets, overrides), ``checkpoint``
(atomic checkpoints), ``progress``, ``report`` (metrics and plots) and ``trace`` (Perfetto
timelines); ``plan`` (predict a step on hardware you describe).

May import every other part of cgdp (engine, planning, comm, data, models); nothing imports it.
"""
