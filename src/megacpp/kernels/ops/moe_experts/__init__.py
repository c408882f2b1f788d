"""MoE dispatch / expert compute / combine."""
