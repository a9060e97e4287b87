"""The face ``cgdp.Trainer``, where cgdp owns the step: batch, losses, update, typical mode, restores, profiles.

May import ``engine.core``, ``engine.backend``, ``engine.sync``, ``cgdp.planning``, ``cgdp.comm``; not the other face.
"""
