"""The command-line applications: ``python -m cgdp.train``, ``python -m cgdp.plan``, ``python -m cgdp.mpi_check``.

``train`` (the training job) with ``config`` (typed configs, presets, overrides), ``checkpoint``
(atomic checkpoints), ``progress``, ``report`` (metrics and plots) and ``trace`` (Perfetto
timelines); ``plan`` (predict a step on hardware you describe); ``mpi_check`` (which network the
MPI ranks' data crosses, and the allreduce bandwidth).

May import every other part of cgdp (engine, planning, comm, data, models); nothing imports it.
"""
