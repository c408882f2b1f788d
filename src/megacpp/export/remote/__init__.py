"""The files copied into every Hugging Face export for ``trust_remote_code`` (they import
transformers and megacpp; nothing in megacpp imports them)."""
