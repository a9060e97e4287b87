"""Planning: which layers travel together, and what a step will cost.

``chunks`` (chunk plans, the paper's uniform plan) → ``profile`` (what a profiled step measured)
→ ``costmodel`` (the paper's Definitions 3.3 and 3.4) → ``costs`` (the per-chunk stage costs and
link models) → ``flowshop`` (the closed form for identical devices) → ``simulator`` (a
discrete-event model of links, host threads and MPI) → ``calibrate``, ``probe``, ``hardware``, ``paper_profiles`` (the
simulator's inputs) → ``planner`` (the best plan under the model) → ``tuner`` (Algorithm 1 and
the auto tuner, driven by measured step times).

Pure Python with no device dependence: imports nothing of cgdp outside this package. The engine
imports it; it never imports the engine.
"""
