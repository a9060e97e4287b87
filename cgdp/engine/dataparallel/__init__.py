"""The face ``cgdp.DataParallel``: the core behind the user's own loop (scatter, gather, replica gradients, the bound optimizer).

May import ``engine.core``, ``engine.backend``, ``engine.sync``, ``cgdp.planning``, ``cgdp.comm``; not the other face.
"""
