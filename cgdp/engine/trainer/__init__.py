"""The face ``cgdp.Trainer``, where cgdp owns the step: options (the modes), batch, losses, passes (the device threads'
forward and backward), hyperparameters (agreement, schedulers), restores, timing (profiles).

May import ``engine.core``, ``engine.backend``, ``engine.sync``, ``cgdp.planning``, ``cgdp.comm``; not the other face.
"""
