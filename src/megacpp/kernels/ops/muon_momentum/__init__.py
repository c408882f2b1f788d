"""Muon's momentum pass (the optimizer's, no autograd): ``reference.py`` (foreach), ``triton.py``
(one multi-tensor launch), ``configs.py`` (its launch setting), ``spec.py`` (its catalog
entry)."""
