"""MegaCpp: train, measure and serve small hybrid language models for C++ code."""

__version__ = "0.1.0"
