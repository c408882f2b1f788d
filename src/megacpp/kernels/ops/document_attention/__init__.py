"""Causal attention inside the documents of packed rows: ``reference.py`` (SDPA with the dense
mask), ``flex.py`` (FlexAttention over a block mask), ``triton.py`` (the block mask's tiles in
one launch), ``configs.py`` (launch settings), ``spec.py`` (its catalog entry)."""
