"""Gated RMSNorm (Mamba-2's norm after the SSD): `naive` (the float64-capable torch reference)
beside `gated_rmsnorm` (the Triton forward and backward)."""
