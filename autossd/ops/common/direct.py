"""What the hand-written (not generated) Triton kernels share: the conv1d and the gated RMSNorm
launch plain @triton.jit kernels with a few block-size constants, no tuning and no templates.

`ready(t, name)` is called before a launch: the CPU interpreter needs its bfloat16 fixes
(autossd.interpret) before a bf16 kernel runs, and CPU tensors need the interpreter at all.
`acc_dtype` picks what the kernels accumulate in: fp32, or fp64 where an input is fp64 (the
interpreter and the GPUs run fp64, so float64 gradchecks reach the kernels themselves).
"""
from __future__ import annotations

import torch

from ...render import interpreting

_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def ready(t: torch.Tensor, name: str) -> None:
    if t.device.type == "cpu":
        if not interpreting():
            raise RuntimeError(f"autossd: {name} is on the CPU, but these Triton kernels need a CUDA "
                               "or ROCm GPU; move the tensors to the GPU, or set TRITON_INTERPRET=1 "
                               "before importing triton to run Triton's (slow) CPU interpreter")
        from ... import interpret
        interpret.apply()
    elif t.device.type != "cuda":
        raise ValueError(f"{name}: on device {t.device.type}; expected a CUDA/ROCm GPU or the CPU "
                         "interpreter")


def acc_dtype(*tensors):
    """tl.float64 where any given tensor is float64, else tl.float32."""
    import triton.language as tl
    f64 = any(t is not None and t.dtype == torch.float64 for t in tensors)
    return tl.float64 if f64 else tl.float32


def check_float(name: str, t) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in _FLOATS:
        raise TypeError(f"{name}: expected float16, bfloat16, float32 or float64, got {t.dtype}")


def check_device(name: str, t, ref: torch.Tensor, ref_name: str) -> None:
    if t is not None and t.device != ref.device:
        raise ValueError(f"{name}: on {t.device}, but {ref_name} is on {ref.device}; expected one device")
