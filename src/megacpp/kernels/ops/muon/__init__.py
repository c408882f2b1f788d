"""Muon's elementwise passes: the momentum update and the weight update around Newton-Schulz."""
