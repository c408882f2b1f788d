"""megacpp.kernels"""
