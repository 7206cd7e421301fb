"""Fixes to Triton 3.6's CPU interpreter, applied only when autossd runs kernels interpreted.

The interpreter stores bfloat16 as uint16 and (a) multiplies those integers in `tl.dot`, (b) casts
bf16 to/from any float other than fp32 by integer conversion. Both give garbage, silently. We
route bf16 through fp32, which is what the hardware's bf16 MMA computes in exactly.
"""
from __future__ import annotations

import numpy as np

_applied = False


def apply() -> None:
    global _applied
    if _applied:
        return
    import triton.language as tl
    from triton.runtime import interpreter as it

    builder = it.InterpreterBuilder
    orig_dot = builder.create_dot
    orig_cast = builder.cast_impl

    def _f32(h):
        if h.dtype.scalar == tl.bfloat16:
            return it._convert_float(h.data, tl.bfloat16, tl.float32, None).view(np.float32)
        return h.data

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        if tl.bfloat16 in (a.dtype.scalar, b.dtype.scalar):
            out = np.matmul(_f32(a).astype(np.float32), _f32(b).astype(np.float32)).astype(d.data.dtype)
            return it.TensorHandle(out + d.data, d.dtype.scalar)
        return orig_dot(self, a, b, d, input_precision, max_num_imprecise_acc)

    def cast_impl(self, src, dst_type):
        s, t = src.dtype.scalar, dst_type.scalar
        if s == tl.bfloat16 and t != tl.float32 and t.is_floating():
            mid = orig_cast(self, src, tl.float32)
            return orig_cast(self, mid, dst_type)
        if t == tl.bfloat16 and s != tl.float32 and s.is_floating():
            mid = orig_cast(self, src, tl.float32)
            return orig_cast(self, mid, dst_type)
        return orig_cast(self, src, dst_type)

    builder.create_dot = create_dot
    builder.cast_impl = cast_impl
    for name in ("create_fp_ext", "create_fp_trunc"):
        setattr(builder, name, lambda self, src, dst_type: self.cast_impl(src, dst_type))
    _applied = True
