"""Causal depthwise conv1d (Mamba-2's short conv over time): `naive` (the float64-capable torch
reference) beside `causal_conv1d` (the Triton forward and backward)."""
