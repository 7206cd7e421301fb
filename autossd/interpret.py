"""Fixes to Triton 3.6's CPU interpreter, applied only when autossd runs kernels interpreted.

The interpreter stores bfloat16 as its uint16 bit pattern and then treats those integers as numbers
wherever it hands the array to numpy: (a) `tl.dot` multiplies the integers, (b) casts to/from any
float other than fp32 convert the integers, (c) elementwise arithmetic, comparisons, min/max, fma
and reductions on bf16 operands (e.g. `x_bf16 * v_bf16`) multiply, compare or sum bit patterns; the
wrapped-around products decode to arbitrary bf16 values, NaN and Inf among them, which a later dot
then spreads over whole rows. All of this is silent (and a Python float meeting a bf16 tensor fails:
there is no bf16 constant). We route bf16 through fp32: decode the bit
pattern exactly, compute in fp32 and round the result back to bf16 to nearest-even, which is what
the hardware does (its bf16 MMA accumulates bf16 products exactly in fp32; its bf16 arithmetic
rounds each result to nearest-even).

A GPU's float arithmetic raises no exceptions: an overflow gives inf, 0 * inf NaN, and a kernel
may compute such values where it then selects them away (the SSD scan's decay above the
diagonal, exp2 of a positive difference times whatever an unwritten CB tile holds, dropped by a
tl.where). numpy warns on each ("RuntimeWarning: overflow encountered in multiply"), so normal
calls printed warnings about values no output holds. An interpreted launch runs with numpy's
floating-point error reports off, as the hardware has none; other warnings still show, and the
results (NaN and inf included) are the same.

Scans and reductions with a combine function of the kernel's own (a linear recurrence's pairs, an
xor: tl.flip is built of xor sums) fall back to a Python loop over every element, each calling the
combine function on scalars: the selective scan's training step on a 2-layer test model took 118
s. They now step along the axis with the combine function applied to whole slices (it is
elementwise), in the same order, so the results are the same.
"""
from __future__ import annotations

import numpy as np

_applied = False
ELEMENTWISE_SCAN = ELEMENTWISE_REDUCE = None   # Triton's fallbacks, once apply() replaced them


def bf16_to_f32(bits: np.ndarray) -> np.ndarray:
    """bf16 bit patterns (uint16) -> the same values as float32; exact, NaN and Inf included."""
    return (np.asarray(bits).astype(np.uint32) << 16).view(np.float32)


def f32_to_bf16(x: np.ndarray) -> np.ndarray:
    """float32 -> bf16 bit patterns (uint16), rounded to nearest-even like the hardware's
    conversion (the interpreter's own fp32 -> bf16 cast truncates). NaN must stay NaN: rounding
    its payload could carry into the exponent and turn it into Inf."""
    x = np.asarray(x, dtype=np.float32)
    u = x.view(np.uint32)
    rounded = ((u + np.uint32(0x7FFF) + ((u >> 16) & np.uint32(1))) >> 16).astype(np.uint16)
    return np.where(np.isnan(x), np.uint16(0x7FC0) | (u >> 16).astype(np.uint16), rounded)


def apply() -> None:
    global _applied
    if _applied:
        return
    import triton.language as tl
    from triton.runtime import interpreter as it

    builder = it.InterpreterBuilder
    orig_dot = builder.create_dot
    orig_cast = builder.cast_impl
    bf16 = tl.bfloat16

    def _is_bf16(h):
        # A comparison's result may carry its operands' dtype on bool data: check the storage too.
        return h.dtype.scalar == bf16 and h.data.dtype == np.uint16

    def _f32(h):
        return bf16_to_f32(h.data) if _is_bf16(h) else h.data

    def _as_f32(h):
        return it.TensorHandle(bf16_to_f32(h.data), tl.float32) if _is_bf16(h) else h

    def _as_bf16(h):
        # A float result of a bf16 computation goes back to bf16; bool (comparisons) stays bool.
        if h.data.dtype == np.bool_:
            return it.TensorHandle(h.data, tl.int1)
        return it.TensorHandle(f32_to_bf16(h.data), bf16)

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        if _is_bf16(a) or _is_bf16(b):
            # bf16 products are exact in fp32, so this is the MMA's result up to summation order
            out = np.matmul(_f32(a).astype(np.float32), _f32(b).astype(np.float32))
            if _is_bf16(d):
                return it.TensorHandle(f32_to_bf16(out + _f32(d)), bf16)
            return it.TensorHandle(out.astype(d.data.dtype) + d.data, d.dtype.scalar)
        return orig_dot(self, a, b, d, input_precision, max_num_imprecise_acc)

    def cast_impl(self, src, dst_type):
        s, t = src.dtype.scalar, dst_type.scalar
        if s == t:
            return orig_cast(self, src, dst_type)
        if _is_bf16(src):                  # to fp16/fp32/fp64 or an integer: from the value
            return orig_cast(self, _as_f32(src), dst_type)
        if t == bf16:                      # from any float or integer: via its fp32 value
            mid = orig_cast(self, src, tl.float32)
            return it.TensorHandle(f32_to_bf16(mid.data), bf16)
        return orig_cast(self, src, dst_type)

    def _via_f32(orig):
        """Wrap a builder op whose leading arguments are operand handles: bf16 operands are
        computed on as fp32 values and a float result rounded back to bf16."""
        def op(self, *args):
            n = next((i for i, a in enumerate(args) if not isinstance(a, it.TensorHandle)), len(args))
            if not any(_is_bf16(a) for a in args[:n]):
                return orig(self, *args)
            out = orig(self, *(_as_f32(a) for a in args[:n]), *args[n:])
            return _as_bf16(out)
        return op

    # Every float arithmetic, comparison, min/max, select and clamp goes through binary_op or
    # ternary_op; fma and the reductions below compute on .data directly. (Triton's math functions
    # refuse bf16 before they reach the builder; fabs and bitcast act on the bits and are right.)
    for name in ("binary_op", "ternary_op", "create_fma"):
        setattr(builder, name, _via_f32(getattr(builder, name)))

    def _reduce_via_f32(orig):
        """Wrap a reduction/scan fast path (numpy sum, min/max, cumsum on .data) the same way."""
        def op(self, input, *args, **kwargs):
            if not _is_bf16(input.handle):
                return orig(self, input, *args, **kwargs)
            out = orig(self, tl.core.tensor(_as_f32(input.handle), input.type.with_element_ty(tl.float32)),
                       *args, **kwargs)
            single = not isinstance(out, (list, tuple))
            res = [tl.core.tensor(_as_bf16(r.handle), r.type.with_element_ty(bf16)) if r.dtype == tl.float32 else r
                   for r in ([out] if single else out)]     # min_max's int32 indices stay as they are
            return res[0] if single else type(out)(res)
        return op

    def _slices(self, input, axis):
        # each operand with `axis` first (views), and a tensor of its slice k
        moved = [np.moveaxis(np.asarray(a.handle.data), axis, 0) for a in input]
        return moved, lambda k: tuple(self.to_tensor(m[k], a.dtype) for m, a in zip(moved, input))

    def _combine(self, acc, x):
        r = self.combine_fn.fn(*acc, *x)
        return r if isinstance(r, tuple) else (r,)

    def _store(out, k, r):
        for o, t in zip(out, r):
            o[k] = np.asarray(t.handle.data if isinstance(t, tl.core.tensor) else t).reshape(o[k].shape)

    def vector_scan(self, input):
        """ScanOps.generic_scan, a combine call per step of the axis on whole slices."""
        moved, at = _slices(self, input, self.axis)
        out = [np.empty_like(m) for m in moved]
        acc = at(0)
        _store(out, 0, acc)
        for k in range(1, moved[0].shape[0]):
            acc = _combine(self, acc, at(k))
            _store(out, k, acc)
        return [self.to_tensor(np.moveaxis(o, 0, self.axis), a.dtype) for o, a in zip(out, input)]

    def vector_reduce(self, input):
        """ReduceOps.generic_reduce the same way: the slices combined in the axis's order."""
        original_axis = self.axis
        input, axis = self.unravel(input, self.axis)
        moved, at = _slices(self, input, axis)
        acc = at(0)
        for k in range(1, moved[0].shape[0]):
            acc = _combine(self, acc, at(k))
        ret = []
        for t, a, m in zip(acc, input, moved):
            data = np.asarray(t.handle.data if isinstance(t, tl.core.tensor) else t).reshape(m.shape[1:])
            data = data.astype(m.dtype)
            if self.keep_dims:
                if original_axis is not None:
                    data = np.expand_dims(data, axis)
                else:
                    for _ in range(m.ndim):
                        data = np.expand_dims(data, 0)
            elif original_axis is None:
                data = data.item()
            ret.append(self.to_tensor(data, a.dtype))
        return ret

    global ELEMENTWISE_SCAN, ELEMENTWISE_REDUCE   # Triton's own, kept for the test that compares
    ELEMENTWISE_SCAN, ELEMENTWISE_REDUCE = it.ScanOps.generic_scan, it.ReduceOps.generic_reduce
    it.ScanOps.generic_scan = vector_scan
    it.ReduceOps.generic_reduce = vector_reduce

    for cls, names in ((it.ReduceOps, ("sum", "min_max")), (it.ScanOps, ("cumsum", "cumprod"))):
        for name in names:
            setattr(cls, name, _reduce_via_f32(getattr(cls, name)))

    # a Python float meeting a bf16 tensor (x * 3.0) becomes a bf16 constant, which the
    # interpreter has no builder method for
    builder.get_bf16 = lambda self, value: it.TensorHandle(f32_to_bf16(np.array([value], np.float32)), bf16)
    builder.create_dot = create_dot
    builder.cast_impl = cast_impl

    run_grid = it.GridExecutor.__call__

    def run_quietly(self, *args, **kwargs):
        with np.errstate(over="ignore", invalid="ignore", divide="ignore", under="ignore"):
            return run_grid(self, *args, **kwargs)
    it.GridExecutor.__call__ = run_quietly
    for name in ("create_fp_ext", "create_fp_trunc"):
        setattr(builder, name, lambda self, src, dst_type: self.cast_impl(src, dst_type))
    _applied = True
