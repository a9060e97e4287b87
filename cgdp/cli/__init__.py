"""The command-line applications: ``python -m cgdp.train``, ``python -m cgdp.plan``, ``python -m cgdp.mpi_check``.

``train`` (the training job) with ``config`` (typed configs, presets, overrides), ``checkpoint``
(atomic checkpoints), ``resume`` (a checkpoint checked against the run before anything changes),
``memory`` (what a run needs against what the machine has), ``output`` (metrics and result files,
and a full disk), ``progress``, ``report`` (metrics and plots), ``startup`` (MPI start-up and data
checks) and ``trace`` (Perfetto timelines); ``plan`` (predict a step on hardware you describe);
``mpi_check`` (which network the MPI ranks' data crosses, and the allreduce bandwidth).

May import every other part of cgdp (engine, planning, comm, data, models); nothing imports it.
"""
