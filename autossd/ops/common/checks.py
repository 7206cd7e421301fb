"""Argument checks the ops share."""
from __future__ import annotations

import torch


def check_no_overlap(name: str, out: torch.Tensor) -> None:
    """Refuse an output whose elements share memory (an expanded tensor: a stride 0 over a
    dimension longer than 1), where the kernels' writes would land on each other. torch's own
    check answers yes, no or "too hard to tell"; only a sure yes is refused."""
    if torch._debug_has_internal_overlap(out) == 1:
        raise ValueError(f"{name}: its elements overlap in memory (strides {tuple(out.stride())} over shape "
                         f"{tuple(out.shape)}); pass a tensor of its own, e.g. torch.empty_like(x)")
