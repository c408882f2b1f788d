"""Short causal depthwise conv + SiLU (Gated DeltaNet's q | k | v conv)."""
