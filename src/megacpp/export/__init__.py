"""Hugging Face export and import.

* :mod:`megacpp.export.hf_format` -- the directory format itself (safetensors weights,
  config.json, tokenizer files): reading and writing, on top of ``model`` and ``data`` only,
  so training can read an export (``[train] init_from``).
* :mod:`megacpp.export.hf` -- ``megacpp export hf``: a trained run to such a directory, with
  the modeling files and a model card; :func:`~megacpp.export.hf.load_hf_export` back.
* ``remote/`` -- the ``configuration_megacpp.py`` / ``modeling_megacpp.py`` files copied into
  every export for ``trust_remote_code``.
"""
