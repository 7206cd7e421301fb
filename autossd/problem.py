"""One object that describes a call: dims, dtypes and flags. It is what the kernels are
specialized on, what the floor is computed from, and (later) the tuning-database key.

`from_args` validates a `mamba_chunk_scan_combined` call and raises ValueError/TypeError naming
the offending argument, so bad input never reaches a kernel.
"""
from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import ClassVar

import torch

from .knobs import ProblemFields, ShapeForm

DTYPES = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}
TORCH_DTYPES = {v: k for k, v in DTYPES.items()}
DTYPE_BYTES = {"fp16": 2, "bf16": 2, "fp32": 4}
CHUNK_SIZES = (64, 128, 256)
MAX_GRID_YZ = 65535  # CUDA/HIP limit on grid dims 1 and 2


@dataclass(frozen=True)
class Problem(ProblemFields):
    default_op: ClassVar[str] = "ssd_fwd"   # the backward keys its records by this type too

    batch: int
    seqlen: int
    nheads: int
    headdim: int
    dstate: int
    ngroups: int
    dtype: str                    # x, B, C, z
    chunk_size: int | None = None  # the caller's request; the config decides
    has_D: bool = False
    D_has_hdim: bool = False
    has_z: bool = False
    has_dt_bias: bool = False
    dt_softplus: bool = False
    has_dt_limit: bool = False
    has_initial_states: bool = False
    has_seq_idx: bool = False
    return_final_states: bool = False
    return_varlen_states: bool = False

    def __post_init__(self) -> None:
        for f in ("batch", "seqlen", "nheads", "headdim", "dstate", "ngroups"):
            v = getattr(self, f)
            if type(v) is not int or v < 1:
                raise ValueError(f"{f}: expected a positive int, got {v!r}")
        for f in ("has_D", "D_has_hdim", "has_z", "has_dt_bias", "dt_softplus", "has_dt_limit",
                  "has_initial_states", "has_seq_idx", "return_final_states", "return_varlen_states"):
            if type(getattr(self, f)) is not bool:
                raise TypeError(f"{f}: expected a bool, got {getattr(self, f)!r}")
        if self.nheads % self.ngroups:
            raise ValueError(f"ngroups: nheads={self.nheads} is not divisible by ngroups={self.ngroups}")
        if self.dtype not in DTYPE_BYTES:
            raise ValueError(f"dtype: expected one of {sorted(DTYPE_BYTES)}, got {self.dtype!r}")
        if self.chunk_size is not None and self.chunk_size not in CHUNK_SIZES:
            raise ValueError(f"chunk_size: expected one of {CHUNK_SIZES}, got {self.chunk_size!r}")


    @classmethod
    def example(cls) -> "Problem":
        return cls(1, 100, 2, 16, 16, 1, "fp32", chunk_size=64, has_D=True, has_dt_bias=True, dt_softplus=True,
                   return_final_states=True)

    # --- speed-of-light figures ---------------------------------------------------------
    def min_bytes(self) -> int:
        """Each input read once, each output written once: x + y + B + C + dt (+ z)."""
        e = DTYPE_BYTES[self.dtype]
        blh = self.batch * self.seqlen * self.nheads
        xy = 2 * blh * self.headdim * e
        bc = 2 * self.batch * self.seqlen * self.ngroups * self.dstate * e
        z = blh * self.headdim * e if self.has_z else 0
        return xy + bc + blh * e + z

    def flops(self, chunk_size: int = 256) -> int:
        """Causal FLOPs of the chunked algorithm: intra-chunk (C·Bᵀ per group, masked product
        with x), chunk states and the C·state term."""
        q = min(chunk_size, self.seqlen)
        bl = self.batch * self.seqlen
        cb = bl * self.ngroups * q * self.dstate          # half of Q x Q x n x 2
        intra = bl * self.nheads * q * self.headdim       # half of Q x Q x p x 2
        states = 2 * 2 * bl * self.nheads * self.headdim * self.dstate
        return cb + intra + states


def _check_tensor(name: str, t, ndim: int, shape: tuple | None = None) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if t.dim() != ndim:
        raise ValueError(f"{name}: expected {ndim} dims, got shape {tuple(t.shape)}")
    if shape is not None:
        for i, (got, want) in enumerate(zip(t.shape, shape)):
            if want is not None and got != want:
                raise ValueError(f"{name}: expected shape {_fmt(shape)}, got {tuple(t.shape)} (dim {i})")


def _fmt(shape) -> str:
    inner = ", ".join("*" if s is None else str(s) for s in shape)
    return f"({inner},)" if len(shape) == 1 else f"({inner})"


def as_flag(name: str, v) -> bool:
    """A flag argument as a bool: True/False, a numpy bool, or the ints 0 and 1. Anything else
    (the string "False" above all, which bool() makes True) is a TypeError naming the argument."""
    if v is True or v is False:
        return v
    if type(v).__module__ == "numpy" and type(v).__name__ in ("bool_", "bool"):
        return bool(v)
    if isinstance(v, int) or (type(v).__module__ == "numpy" and hasattr(v, "__index__")):
        if v in (0, 1):
            return bool(v)
    raise TypeError(f"{name}: expected a bool, got {type(v).__name__} {v!r}")


def _check_float(name: str, t) -> None:
    if t.dtype not in DTYPES:
        raise TypeError(f"{name}: expected float16, bfloat16 or float32, got {t.dtype}")


def supported_chunk(chunk_size) -> int:
    """The chunk length the kernels run for a caller's `chunk_size`: itself when it is one of
    CHUNK_SIZES, else the nearest of them in log scale (below the geometric mean of two
    neighbours, the smaller). The SSD's outputs do not depend on the chunk length (it only splits
    the same sums differently), so any positive length mamba_ssm takes is taken here too. Plain
    integer arithmetic: torch.compile traces it."""
    if type(chunk_size) is not int:
        if isinstance(chunk_size, bool) or not isinstance(chunk_size, numbers.Integral):
            raise ValueError(f"chunk_size: expected a positive int, got {chunk_size!r}")
        chunk_size = int(chunk_size)
    if chunk_size < 1:
        raise ValueError(f"chunk_size: expected a positive int, got {chunk_size!r}")
    for lo, hi in zip(CHUNK_SIZES, CHUNK_SIZES[1:]):
        if chunk_size * chunk_size < lo * hi:
            return lo
    return CHUNK_SIZES[-1]


def parse_dt_limit(dt_limit) -> tuple[float, float]:
    """dt_limit as the pair (lo, hi) of floats, lo <= hi (a TypeError or ValueError naming it)."""
    try:
        lo, hi = (float(v) for v in dt_limit)
    except (TypeError, ValueError):
        raise ValueError(f"dt_limit: expected a pair of floats (lo, hi), got {dt_limit!r}") from None
    if math.isnan(lo) or math.isnan(hi) or lo > hi:
        raise ValueError(f"dt_limit: expected lo <= hi, got {dt_limit!r}")
    return lo, hi


def check_grid(batch: int, seqlen: int, nheads: int) -> None:
    """Grid dims 1 and 2 carry chunks and batch (state passing: batch * nheads): the CUDA/HIP
    limit on those dims bounds the shapes the kernels can run."""
    nchunks = -(-seqlen // min(CHUNK_SIZES))
    if nchunks > MAX_GRID_YZ or batch * nheads > MAX_GRID_YZ:
        raise ValueError(f"x: batch*nheads={batch * nheads} and seqlen/64={nchunks} must each be <= {MAX_GRID_YZ}")


def in_x_dtype(x, *others):
    """`others` (B, C, z) in x's dtype. mamba_ssm's mamba_chunk_scan_combined takes them in
    another float dtype than x (its kernels cast the operands of each product to a common dtype
    in the kernel); the kernels here take one dtype, x's, so the drop-in casts them first, which
    autograd records (their gradients come back in their own dtype). Anything but a tensor of
    float16, bfloat16 or float32 (and None) is passed on as it is, for from_args to refuse by
    name."""
    if not isinstance(x, torch.Tensor) or x.dtype not in DTYPES:
        return others
    return tuple(t.to(x.dtype) if isinstance(t, torch.Tensor) and t.dtype in DTYPES and t.dtype != x.dtype
                 else t for t in others)


def from_args(x, dt, A, B, C, chunk_size, D=None, z=None, dt_bias=None, initial_states=None,
              seq_idx=None, cu_seqlens=None, dt_softplus=False, dt_limit=(0.0, float("inf")),
              return_final_states=False, return_varlen_states=False, state_dtype=None) -> Problem:
    """Validate a mamba_chunk_scan_combined call and describe it."""
    dt_softplus = as_flag("dt_softplus", dt_softplus)
    return_final_states = as_flag("return_final_states", return_final_states)
    return_varlen_states = as_flag("return_varlen_states", return_varlen_states)
    _check_tensor("x", x, 4)
    b, l, h, p = x.shape
    if l == 0:
        raise ValueError("x: sequence length is 0; expected at least one token")
    if b == 0 or h == 0 or p == 0:
        raise ValueError(f"x: expected non-empty (batch, seqlen, nheads, headdim), got {tuple(x.shape)}")
    if x.dtype not in DTYPES:
        raise TypeError(f"x: expected float16, bfloat16 or float32, got {x.dtype}")
    _check_tensor("dt", dt, 3, (b, l, h))
    _check_tensor("A", A, 1, (h,))
    _check_tensor("B", B, 4, (b, l, None, None))
    g, n = B.shape[2], B.shape[3]
    if g == 0 or n == 0:
        raise ValueError(f"B: expected non-empty (ngroups, dstate), got {tuple(B.shape)}")
    _check_tensor("C", C, 4, (b, l, g, n))
    if h % g:
        raise ValueError(f"B: nheads={h} is not divisible by ngroups={g}")
    for name, t in (("dt", dt), ("A", A)):
        _check_float(name, t)
    for name, t in (("B", B), ("C", C)):
        if t.dtype != x.dtype:
            raise TypeError(f"{name}: dtype {t.dtype} differs from x's {x.dtype}; expected the same dtype")
    d_has_hdim = False
    if D is not None:
        if not isinstance(D, torch.Tensor):
            raise TypeError(f"D: expected a torch.Tensor or None, got {type(D).__name__}")
        if tuple(D.shape) == (h,):
            pass
        elif tuple(D.shape) == (h, p):
            d_has_hdim = True
        else:
            raise ValueError(f"D: expected shape ({h},) or ({h}, {p}), got {tuple(D.shape)}")
        _check_float("D", D)
    if z is not None:
        _check_tensor("z", z, 4, (b, l, h, p))
        if z.dtype != x.dtype:
            raise TypeError(f"z: dtype {z.dtype} differs from x's {x.dtype}; expected the same dtype")
    if dt_bias is not None:
        _check_tensor("dt_bias", dt_bias, 1, (h,))
        _check_float("dt_bias", dt_bias)
    if initial_states is not None:
        _check_tensor("initial_states", initial_states, 4, (b, h, p, n))
        _check_float("initial_states", initial_states)
    if seq_idx is not None:
        _check_tensor("seq_idx", seq_idx, 2, (b, l))
        if seq_idx.dtype not in (torch.int32, torch.int64):
            raise TypeError(f"seq_idx: expected int32 (or int64), got {seq_idx.dtype}")
    if cu_seqlens is not None:
        _check_tensor("cu_seqlens", cu_seqlens, 1)
        if cu_seqlens.dtype not in (torch.int32, torch.int64):
            raise TypeError(f"cu_seqlens: expected int32 or int64, got {cu_seqlens.dtype}")
        if cu_seqlens.numel() < 2:
            raise ValueError("cu_seqlens: expected at least 2 entries (0 and the total length)")
        if b != 1:
            raise ValueError(f"cu_seqlens: expected batch 1 (packed sequences), got batch {b}")
        if seq_idx is None:
            raise ValueError("seq_idx: required with cu_seqlens (the state resets where sequences meet)")
    if return_varlen_states and cu_seqlens is None:
        raise ValueError("cu_seqlens: required when return_varlen_states=True")
    tensors = {"x": x, "dt": dt, "A": A, "B": B, "C": C, "D": D, "z": z, "dt_bias": dt_bias,
               "initial_states": initial_states, "seq_idx": seq_idx, "cu_seqlens": cu_seqlens}
    for name, t in tensors.items():
        if t is not None and t.device != x.device:
            raise ValueError(f"{name}: on {t.device}, but x is on {x.device}; expected one device")
    # The kernels vectorize along the last dim of these: it must be contiguous.
    for name in ("x", "z", "B", "C"):
        t = tensors[name]
        if t is not None and t.shape[-1] > 1 and t.stride(-1) != 1:
            raise ValueError(f"{name}: last dimension is not contiguous (stride {t.stride(-1)}); "
                             f"expected stride 1, pass {name}.contiguous()")
    # The kernels index a batch row's tokens from an int64 base, but head, group and in-chunk
    # offsets are 32-bit products (program ids times strides): a layout whose strides would
    # overflow them (head- or group-major storage of a long sequence) is refused here rather
    # than read out of bounds. Contiguous inputs are far from it.
    for name, t, dims in (("x", x, (2, 3)), ("z", z, (2, 3)), ("B", B, (2, 3)), ("C", C, (2, 3))):
        if t is None:
            continue
        reach = max(CHUNK_SIZES) * abs(t.stride(1)) + sum((t.shape[d] - 1) * abs(t.stride(d)) for d in dims)
        if reach >= 2**31:
            raise ValueError(f"{name}: strides {tuple(t.stride())} put elements of one chunk of one "
                             f"batch row {reach} elements apart, past the kernels' 32-bit offsets "
                             f"(< 2**31); pass {name}.contiguous()")
    chunk_size = supported_chunk(chunk_size)
    lo, hi = parse_dt_limit(dt_limit)
    if state_dtype is not None and state_dtype not in DTYPES:
        raise TypeError(f"state_dtype: expected torch.float32, bfloat16 or float16, got {state_dtype}")
    check_grid(b, l, h)
    return Problem(
        batch=b, seqlen=l, nheads=h, headdim=p, dstate=n, ngroups=g, dtype=DTYPES[x.dtype],
        chunk_size=chunk_size, has_D=D is not None, D_has_hdim=d_has_hdim, has_z=z is not None,
        has_dt_bias=dt_bias is not None, dt_softplus=bool(dt_softplus),
        has_dt_limit=(lo, hi) != (0.0, float("inf")), has_initial_states=initial_states is not None,
        has_seq_idx=seq_idx is not None, return_final_states=bool(return_final_states),
        return_varlen_states=bool(return_varlen_states))


# --- how a forward (and backward) problem is written on the command line (autossd.tuner.shapes)
KEYS = {"b": "batch", "l": "seqlen", "h": "nheads", "p": "headdim", "n": "dstate", "g": "ngroups",
        "q": "chunk_size"}
FLAGS = {"d": "has_D", "z": "has_z", "bias": "has_dt_bias", "softplus": "dt_softplus",
         "final": "return_final_states"}
# What Mamba-2's layer passes: D (h,), dt_bias, softplus; z is applied by the gated norm.
MODEL_FLAGS = {"has_D": True, "has_dt_bias": True, "dt_softplus": True}
# The grid the shipped databases cover: every distinct SSD layer of the models
# (autossd.tuner.shapes.MODELS) x (batch, seqlen) across prefill and training x fp16 and bf16.
# Batch and length step by 4x, so a shape between grid points is within 2x of one in each: the
# lookup's nearest tier (same dims and dtype, at most 2 in summed |log2| ratios) reaches it. The
# token cap keeps the largest calls to what one GPU holds in a training step (64 x 8k, 16 x 32k,
# 4 x 128k).
GRID_BATCHES = (1, 4, 16, 64)
GRID_SEQLENS = (512, 2048, 8192, 32768, 131072)
GRID_MAX_TOKENS = 2 ** 19
# (batch, seqlen) shapes per model: the benchmark's for the first three; the grid's for the rest
PRESET_SHAPES: dict[str, list[tuple[int, int]]] = {
    "mamba2-130m": [(1, 2048), (1, 131072)],
    "mamba2-2.7b": [(1, 2048), (8, 2048), (4, 16384), (1, 131072)],
    "codestral-7b": [(1, 131072)],
}


def grid_sizes() -> list[tuple[int, int]]:
    """The grid's (batch, seqlen) pairs: GRID_BATCHES x GRID_SEQLENS up to GRID_MAX_TOKENS."""
    return [(b, l) for l in GRID_SEQLENS for b in GRID_BATCHES if b * l <= GRID_MAX_TOKENS]


def _build(vals: dict, flags: dict, dtype: str, state_dtype: str | None) -> Problem:
    prob = Problem(dtype=dtype, **vals, **flags)
    check_grid(prob.batch, prob.seqlen, prob.nheads)   # what the runtime could never run
    return prob


FORM = ShapeForm(
    KEYS, FLAGS, MODEL_FLAGS, {"batch": 1, "seqlen": 2048}, ("q",), "b=1,l=16384,h=80,p=64,n=128,g=1", _build,
    presets=[{"batch": b, "seqlen": l} for b, l in grid_sizes()],
    model_presets={m: [{"batch": b, "seqlen": l} for b, l in v] for m, v in PRESET_SHAPES.items()},
    grid=[{"batch": b, "seqlen": l} for b, l in grid_sizes()], grid_states=lambda dtype, state_dtype: (None,),
    summary=("b", "l", "h", "p", "n", "g"),
    help='e.g. "b=1,l=16384,h=80,p=64,n=128,g=1" or "mamba2-2.7b:b=4,l=16k"; ";" separates. Keys b l h p n g, '
         "q (pins the chunk size); flags d z bias softplus final (0/1), default d=1,bias=1,softplus=1: the call "
         "Mamba-2's layer makes",
    preset_help="the benchmark's (batch, length) shapes", grid_help="batch 1-64 x length 512-128k")
Problem.shape_form = FORM
