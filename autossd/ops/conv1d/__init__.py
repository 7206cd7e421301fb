"""Causal depthwise conv1d (Mamba's short conv over time): `naive` (the float64-capable torch
reference) beside `causal_conv1d` (the Triton forward and backward, and the one-step decode
update of Mamba's (batch, dim, seqlen) layout, `causal_conv1d_update`)."""
