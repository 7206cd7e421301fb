"""The selective scan's problem type (`ScanProblem`: what the sscan_fwd and sscan_bwd records key
on), its command-line form, and the validation of a `selective_scan_fn` call (`from_args`), which
raises TypeError/ValueError naming the offending argument so bad input never reaches a kernel."""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from ...knobs import ProblemFields, ShapeForm
from ...problem import DTYPE_BYTES, DTYPES, as_flag

MAX_DSTATE = 256        # the state tile (BLOCK_D x dstate, padded to a power of two) lives in registers
MAX_GRID_Y = 65535      # the launch grid's y extent: the batch


@dataclass(frozen=True)
class ScanProblem(ProblemFields):
    """One selective_scan_fn call: sizes, u's dtype and the flags that change the kernels.
    `B_var` / `C_var`: B / C vary over time ((batch, [ngroups,] dstate, seqlen)); False: the
    time-invariant (dim, dstate) form. `ngroups` is 1 for the 3-D and the time-invariant forms."""
    default_op: ClassVar[str] = "sscan_fwd"   # the backward keys its records by this type too
    # the lookup's nearest tier: a record within a factor of about 4 in batch, length or width
    DISTANCE_WEIGHTS: ClassVar[dict] = {"batch": 1.0, "seqlen": 1.0, "dim": 1.0}

    batch: int
    dim: int
    dstate: int
    seqlen: int
    ngroups: int
    dtype: str                      # u's (and out's)
    has_D: bool = False
    has_z: bool = False
    has_delta_bias: bool = False
    delta_softplus: bool = False
    B_var: bool = True
    C_var: bool = True
    return_last_state: bool = False

    def __post_init__(self) -> None:
        for f in ("batch", "dim", "dstate", "seqlen", "ngroups"):
            v = getattr(self, f)
            if type(v) is not int or v < 1:
                raise ValueError(f"{f}: expected a positive int, got {v!r}")
        for f in ("has_D", "has_z", "has_delta_bias", "delta_softplus", "B_var", "C_var", "return_last_state"):
            if type(getattr(self, f)) is not bool:
                raise TypeError(f"{f}: expected a bool, got {getattr(self, f)!r}")
        if self.dim % self.ngroups:
            raise ValueError(f"ngroups: dim={self.dim} is not divisible by ngroups={self.ngroups}")
        if self.ngroups > 1 and not (self.B_var or self.C_var):
            raise ValueError("ngroups: groups need a time-varying B or C")
        if self.dtype not in DTYPE_BYTES:
            raise ValueError(f"dtype: expected one of {sorted(DTYPE_BYTES)}, got {self.dtype!r}")
        if self.dstate > MAX_DSTATE:
            raise ValueError(f"dstate: {self.dstate} is past the kernels' {MAX_DSTATE} (the state tile is held "
                             "in registers)")
        if self.batch > MAX_GRID_Y:
            raise ValueError(f"batch: {self.batch} is past the launch grid's {MAX_GRID_Y}")

    @classmethod
    def example(cls) -> "ScanProblem":
        # two groups, a length that is no multiple of any chunk, Mamba-1's flags
        return cls(batch=2, dim=8, dstate=16, seqlen=50, ngroups=2, dtype="fp32", has_D=True, has_z=True,
                   has_delta_bias=True, delta_softplus=True, return_last_state=True)

    @property
    def channels_per_group(self) -> int:
        return self.dim // self.ngroups

    def min_bytes(self) -> int:
        """The forward's operands once each: u, delta, z and out (u's dtype stands for delta's and
        z's), B and C, the last state; A, D and delta_bias are a rounding error."""
        e = DTYPE_BYTES[self.dtype]
        act = self.batch * self.dim * self.seqlen * e * (4 if self.has_z else 3)
        bc = sum(self.batch * self.ngroups * self.dstate * self.seqlen * e if var else self.dim * self.dstate * 4
                 for var in (self.B_var, self.C_var))
        last = self.batch * self.dim * self.dstate * 4 if self.return_last_state else 0
        return act + bc + last

    def flops(self, chunk_size: int = 0) -> int:
        """Per state element and time step: the decay's exp and product, the update, the product
        with C and its sum (about 6)."""
        return 6 * self.batch * self.dim * self.dstate * self.seqlen


# --- validation of a call ----------------------------------------------------------------------
def _tensor(name: str, t, ndims: tuple[int, ...]) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if t.is_complex():
        raise TypeError(f"{name}: complex tensors are not supported (dtype {t.dtype}); the kernels take "
                        "real float32, bfloat16 or float16")
    if t.dtype not in DTYPES:
        raise TypeError(f"{name}: expected float32, bfloat16 or float16, got {t.dtype}")
    if t.dim() not in ndims:
        raise ValueError(f"{name}: expected {' or '.join(map(str, ndims))} dims, got shape {tuple(t.shape)}")
    return t


def _shape(name: str, t, want: tuple, what: str) -> None:
    if tuple(t.shape) != tuple(want):
        raise ValueError(f"{name}: expected shape {tuple(want)} ({what}), got {tuple(t.shape)}")


def _bc(name: str, M, batch: int, dim: int, dstate: int, seqlen: int) -> tuple[bool, int]:
    """(time-varying, ngroups) of B or C, checked."""
    _tensor(name, M, (2, 3, 4))
    if M.dim() == 2:
        _shape(name, M, (dim, dstate), "time-invariant: dim, dstate")
        return False, 1
    if M.dim() == 3:
        _shape(name, M, (batch, dstate, seqlen), "batch, dstate, seqlen")
        return True, 1
    g = M.shape[1]
    if g < 1 or dim % g:
        raise ValueError(f"{name}: ngroups={g} must divide dim={dim} (shape {tuple(M.shape)})")
    _shape(name, M, (batch, g, dstate, seqlen), "batch, ngroups, dstate, seqlen")
    return True, g


def from_args(u, delta, A, B, C, D=None, z=None, delta_bias=None, delta_softplus=False,
              return_last_state=False) -> ScanProblem:
    """Validate a selective_scan_fn call and describe it."""
    delta_softplus = as_flag("delta_softplus", delta_softplus)
    return_last_state = as_flag("return_last_state", return_last_state)
    if isinstance(A, torch.Tensor) and A.is_complex():
        raise TypeError(f"A: complex A ({A.dtype}) is not supported by autossd's selective scan; pass a real "
                        "A (float32), as every Mamba-1 model does")
    _tensor("u", u, (3,))
    batch, dim, seqlen = u.shape
    if batch == 0 or dim == 0 or seqlen == 0:
        raise ValueError(f"u: expected non-empty (batch, dim, seqlen), got {tuple(u.shape)}")
    _tensor("delta", delta, (3,))
    _shape("delta", delta, u.shape, "like u: batch, dim, seqlen")
    _tensor("A", A, (2,))
    if A.shape[0] != dim or A.shape[1] == 0:
        raise ValueError(f"A: expected shape ({dim}, dstate), got {tuple(A.shape)}")
    dstate = A.shape[1]
    if dstate > MAX_DSTATE:
        raise ValueError(f"A: dstate={dstate} is past the kernels' {MAX_DSTATE}")
    b_var, gb = _bc("B", B, batch, dim, dstate, seqlen)
    c_var, gc = _bc("C", C, batch, dim, dstate, seqlen)
    if b_var and c_var and gb != gc:
        raise ValueError(f"C: ngroups={gc} differs from B's {gb}")
    if D is not None:
        _tensor("D", D, (1,))
        _shape("D", D, (dim,), "dim")
    if delta_bias is not None:
        _tensor("delta_bias", delta_bias, (1,))
        _shape("delta_bias", delta_bias, (dim,), "dim")
    if z is not None:
        _tensor("z", z, (3,))
        _shape("z", z, u.shape, "like u: batch, dim, seqlen")
    for name, t in (("delta", delta), ("A", A), ("B", B), ("C", C), ("D", D), ("z", z), ("delta_bias", delta_bias)):
        if t is not None and t.device != u.device:
            raise ValueError(f"{name}: on {t.device}, but u is on {u.device}; expected one device")
    if batch > MAX_GRID_Y:
        raise ValueError(f"u: batch={batch} is past the launch grid's {MAX_GRID_Y}")
    return ScanProblem(batch=batch, dim=dim, dstate=dstate, seqlen=seqlen, ngroups=max(gb, gc),
                       dtype=DTYPES[u.dtype], has_D=D is not None, has_z=z is not None,
                       has_delta_bias=delta_bias is not None, delta_softplus=delta_softplus,
                       B_var=b_var, C_var=c_var, return_last_state=return_last_state)


# --- how a problem is written on the command line (autossd.tuner.shapes) --------------------------
# The grid's layers are the Mamba-1 models' (tuner.shapes.MAMBA1_MODELS: d_inner 1536-8192, d_state
# 16, B and C shared by every channel: one group), named by a model prefix ("mamba-2.8b:b=1,l=2048").
GRID_DSTATE = 16
GRID_SIZES = ((1, 2048), (8, 2048), (1, 8192), (4, 8192), (1, 32768), (1, 65536))   # (batch, seqlen)
KEYS = {"b": "batch", "l": "seqlen", "d": "dim", "n": "dstate", "g": "ngroups"}
FLAGS = {"skip": "has_D", "z": "has_z", "bias": "has_delta_bias", "softplus": "delta_softplus",
         "bvar": "B_var", "cvar": "C_var", "last": "return_last_state"}
# What Mamba-1's layer passes: D, z, delta_bias (dt_proj's bias), softplus; B, C vary over time
MODEL_FLAGS = {"has_D": True, "has_z": True, "has_delta_bias": True, "delta_softplus": True,
               "B_var": True, "C_var": True}


def _build(vals: dict, flags: dict, dtype: str, state_dtype: str | None) -> ScanProblem:
    return ScanProblem(dtype=dtype, **vals, **flags)


FORM = ShapeForm(
    KEYS, FLAGS, MODEL_FLAGS, {}, ("g", "n"), "b=1,l=2048,d=5120,n=16", _build,
    defaults={"ngroups": 1, "dstate": GRID_DSTATE},
    presets=[{"batch": b, "seqlen": l} for b, l in GRID_SIZES],
    grid=[{"batch": b, "seqlen": l} for b, l in GRID_SIZES],
    mamba1_fields=lambda d_inner, d_state: {"dim": d_inner, "dstate": d_state, "ngroups": 1}, mamba2_layers=False,
    summary=("b", "l", "d", "n", "g"),
    help='e.g. "mamba-2.8b:b=1,l=2048" or "b=1,l=2048,d=5120,n=16"; keys b l d n g (n default 16, g default 1); flags skip '
         "(D) z bias softplus bvar cvar last (0/1), default skip=1,z=1,bias=1,softplus=1,bvar=1,cvar=1: the call "
         "Mamba-1's layer makes",
    preset_help="a Mamba-1 model's (batch, length) shapes 1x2k-1x64k",
    grid_help="Mamba-1 d_inner 1536-8192, d_state 16 x (batch, length) 1x2k, 8x2k, 1x8k, 4x8k, 1x32k, 1x64k")
ScanProblem.shape_form = FORM
