"""RMSNorm with an optional fused residual add."""
