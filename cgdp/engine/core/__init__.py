"""The gradient path both faces share (hooks → flat buffers → D2H → host sum → H2D) and what surrounds it.

May import ``engine.backend``, ``engine.sync``, ``cgdp.planning``, ``cgdp.comm``; never a face.
"""
