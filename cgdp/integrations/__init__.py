"""Integrations: cgdp behind other libraries' trainers (Hugging Face's ``transformers.Trainer``).

May import ``cgdp.engine`` (the ``DataParallel`` face) and the library it integrates, imported only
when its module is; ``import cgdp`` never imports them.
"""
