"""MoE dispatch / expert compute / combine: ``reference.py`` (the per-expert loop),
``grouped.py`` (the grouped-GEMM path and its plain-PyTorch steps), its Triton kernels
(``dispatch.py``, ``swiglu.py``, ``gemm.py``), ``configs.py`` (their launch settings) and
``spec.py`` (the catalog entry)."""
