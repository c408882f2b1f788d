"""megacpp.kernels.ops: one folder per op surface, each with a plain-PyTorch reference."""
