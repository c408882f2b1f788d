"""Linear layers in FP8 for training (torchao float8, dynamic scaling)."""
