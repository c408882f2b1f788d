"""Causal self-attention (the A family's core)."""
