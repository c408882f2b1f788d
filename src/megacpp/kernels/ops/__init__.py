"""megacpp.kernels.ops: one folder per catalog surface, named as the surface.

Each holds ``reference.py`` (the plain-PyTorch truth), ``spec.py`` (the surface's catalog
entry: contract, cases, FLOP and byte model, backends), and for a fast backend of ours its
kernels (``triton.py``, or split by stage: ``common.py``, ``chunk_fwd.py``, ``chunk_bwd.py``,
``op.py``) with their launch settings in ``configs.py``. Beside them: kernels shared by
several ops (``sum_rows.py``, ``multi_tensor.py``). ``sparse_attention/`` also holds the
reference ops of DSA's index path (scores, top-k, the indexer KL), which have no surface.
"""
