"""`mamba_split_conv1d_scan_combined`: Mamba-2's whole training path after the in-projection, as
a drop-in for mamba_ssm's function of that name, differentiable in every tensor input.

zxbcdt (batch, seqlen, 2 * d_mlp + dim + conv_dim + nheads) is split into
  [x0, y0] (d_mlp each, usually absent)  z (dim)  xBC (conv_dim = dim + 2 * ngroups * dstate)  dt (nheads)
and then:
  xBC  <- causal depthwise conv1d over time (conv1d_weight, conv1d_bias), SiLU unless activation=None;
          with seq_idx no token sees another sequence's tokens
  x, B, C <- xBC split (dim, ngroups * dstate, ngroups * dstate)
  y    <- the SSD (autossd.mamba_chunk_scan_combined) with softplus(dt + dt_bias) clamped to
          dt_limit, D, initial_states, seq_idx; z gates it (y * silu(z)) unless rmsnorm_weight is
          given, in which case y <- gated RMSNorm of (y, z) per group of dim / ngroups columns,
          norm_before_gate picking rmsnorm(y) * w * silu(z) or rmsnorm(y * silu(z)) * w
  out  <- [silu(x0) * y0, y] (the gated-MLP part only where d_mlp > 0), then
          F.linear(out, outproj_weight, outproj_bias) where outproj_weight is given.
Returns out, or (out, final_states) with return_final_states.

Each stage is its own differentiable piece (the Triton conv1d and gated norm here, the SSD's
generated forward and backward, torch for the splits and the projection), so autograd chains
their backwards: nothing of mamba_ssm or causal_conv1d is needed. The stages keep what their own
backward needs (the conv's input, the norm's input and 1/rms), except the SSD's inputs x, B and
C: they are the conv's output (batch x seqlen x conv_dim per layer, 176 MB at mamba2-2.7b
8 x 2048 in 16 bits), so they are not kept from forward to backward but recomputed from the
conv's input, which the conv keeps anyway, when the SSD's backward first asks for them.
"""
from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F

ACTIVATIONS = (None, "silu", "swish")
_INPUT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _shape(t) -> tuple:
    return tuple(t.shape)


def _tensor(name: str, t, dims: int | None = None, floating: bool = False) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if dims is not None and t.dim() != dims:
        raise ValueError(f"{name}: expected {dims} dimensions, got shape {_shape(t)}")
    if floating and not t.is_floating_point():
        raise TypeError(f"{name}: expected a floating-point tensor, got {t.dtype}")


def _sizes(zxbcdt, conv1d_weight, conv1d_bias, dt_bias, A, D, seq_idx, activation, rmsnorm_weight,
           rmsnorm_eps, outproj_weight, outproj_bias, headdim, ngroups) -> tuple[int, int, int, int, int]:
    """Validate the arguments' shapes against each other, naming the argument at fault; returns
    (nheads, headdim, dim, dstate, d_mlp)."""
    _tensor("zxbcdt", zxbcdt, 3)
    if not zxbcdt.is_floating_point():
        raise TypeError(f"zxbcdt: expected a floating-point tensor, got {zxbcdt.dtype}")
    batch, seqlen, width = zxbcdt.shape
    if batch < 1 or seqlen < 1:
        raise ValueError(f"zxbcdt: expected at least one sequence of at least one token, got shape {_shape(zxbcdt)}")
    if not isinstance(rmsnorm_eps, (int, float)) or isinstance(rmsnorm_eps, bool) or not rmsnorm_eps >= 0:
        raise ValueError(f"rmsnorm_eps: expected a non-negative float, got {rmsnorm_eps!r}")
    _tensor("D", D)
    if D.dim() == 1:
        if headdim is None:
            raise ValueError("headdim: required when D has shape (nheads,) (a 2-D D (nheads, headdim) "
                             "gives it)")
        nheads = D.shape[0]
    elif D.dim() == 2:
        nheads, d_hdim = D.shape
        if headdim is not None and headdim != d_hdim:
            raise ValueError(f"headdim: {headdim!r} disagrees with D's shape {_shape(D)} (nheads, headdim)")
        headdim = d_hdim
    else:
        raise ValueError(f"D: expected shape (nheads,) or (nheads, headdim), got {_shape(D)}")
    if type(headdim) is not int or headdim < 1:
        raise ValueError(f"headdim: expected a positive int, got {headdim!r}")
    if nheads < 1:
        raise ValueError(f"D: expected at least one head, got shape {_shape(D)}")
    if type(ngroups) is not int or ngroups < 1 or nheads % ngroups:
        raise ValueError(f"ngroups: expected a positive int dividing nheads={nheads}, got {ngroups!r}")
    for name, t in (("A", A), ("dt_bias", dt_bias)):
        _tensor(name, t)
        if _shape(t) != (nheads,):
            raise ValueError(f"{name}: expected shape (nheads,) = ({nheads},), got {_shape(t)}")
    dim = nheads * headdim
    _tensor("conv1d_weight", conv1d_weight, 2, floating=True)
    conv_dim, conv_width = conv1d_weight.shape
    extra = conv_dim - dim
    if extra <= 0 or extra % (2 * ngroups):
        raise ValueError(f"conv1d_weight: expected (dim + 2 * ngroups * dstate, width) with dim = nheads * "
                         f"headdim = {dim} and ngroups = {ngroups}, got shape {_shape(conv1d_weight)}")
    if conv_width not in (2, 3, 4):
        raise ValueError(f"conv1d_weight: expected width 2, 3 or 4 (its last dimension), got {conv_width}")
    dstate = extra // (2 * ngroups)
    rest = width - (2 * dim + 2 * ngroups * dstate + nheads)
    if rest < 0 or rest % 2:
        raise ValueError(
            f"zxbcdt: last dimension {width} does not split into z ({dim}), xBC ({conv_dim}) and dt "
            f"({nheads}) (plus an even-sized gated-MLP part before them): expected "
            f"{2 * dim + 2 * ngroups * dstate + nheads} for nheads={nheads}, headdim={headdim}, "
            f"ngroups={ngroups}, dstate={dstate} (dstate from conv1d_weight's {conv_dim} channels)")
    d_mlp = rest // 2
    if conv1d_bias is not None:
        _tensor("conv1d_bias", conv1d_bias, floating=True)
        if _shape(conv1d_bias) != (conv_dim,):
            raise ValueError(f"conv1d_bias: expected shape ({conv_dim},) (conv1d_weight's channels), got "
                             f"{_shape(conv1d_bias)}")
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation: expected one of {ACTIVATIONS}, got {activation!r}")
    if seq_idx is not None:
        _tensor("seq_idx", seq_idx)
        if _shape(seq_idx) != (batch, seqlen):
            raise ValueError(f"seq_idx: expected shape (batch, seqlen) = ({batch}, {seqlen}), got {_shape(seq_idx)}")
    if rmsnorm_weight is not None:
        _tensor("rmsnorm_weight", rmsnorm_weight, floating=True)
        if _shape(rmsnorm_weight) != (dim,):
            raise ValueError(f"rmsnorm_weight: expected shape (dim,) = ({dim},), got {_shape(rmsnorm_weight)}")
    if outproj_weight is not None:
        _tensor("outproj_weight", outproj_weight, 2, floating=True)
        if outproj_weight.shape[1] != d_mlp + dim:
            raise ValueError(f"outproj_weight: expected (out_dim, {d_mlp + dim}), got {_shape(outproj_weight)}")
        if outproj_bias is not None:
            _tensor("outproj_bias", outproj_bias, floating=True)
            if _shape(outproj_bias) != (outproj_weight.shape[0],):
                raise ValueError(f"outproj_bias: expected shape ({outproj_weight.shape[0]},), got "
                                 f"{_shape(outproj_bias)}")
    elif outproj_bias is not None:
        raise ValueError("outproj_bias: given without outproj_weight")
    return nheads, headdim, dim, dstate, d_mlp


def _swiglu(xy: torch.Tensor) -> torch.Tensor:
    """silu(x0) * y0 of the gated-MLP part, in fp32, returned in the input's dtype."""
    x0, y0 = xy.float().chunk(2, dim=-1)
    return (F.silu(x0) * y0).to(xy.dtype)


class _ConvRecompute:
    """Saved-tensor hooks around the SSD's forward: a tensor it saves that views the conv's output
    (x, B, C) is kept as its view's geometry only, and rebuilt in backward from the conv run again
    (once, on its kept input). Only the SSD's call runs inside the hooks, while the conv's output is
    alive, so no other tensor can sit at its address. Under torch.compile the tensors are kept as
    before (saved-tensor hooks are not traced)."""

    def __init__(self, x, weight, bias, seq_idx, activation, out):
        self._args = (x.detach(), weight.detach(), bias.detach() if bias is not None else None, seq_idx,
                      activation in ("silu", "swish"))
        self._storage = out.untyped_storage().data_ptr()
        self._out = None

    def hooks(self):
        return torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def _pack(self, t):
        try:
            mine = t.untyped_storage().data_ptr() == self._storage
        except (RuntimeError, NotImplementedError):   # a tensor with no plain storage: kept as it is
            return t
        if mine:
            return (self, t.storage_offset(), tuple(t.shape), t.stride())
        return t

    def _unpack(self, packed):
        if not (isinstance(packed, tuple) and packed and packed[0] is self):
            return packed
        from ..conv1d.causal_conv1d import causal_conv1d_fwd
        if self._out is None:
            with torch.no_grad():
                self._out = causal_conv1d_fwd(*self._args)
        _, offset, shape, stride = packed
        return self._out.as_strided(shape, stride, offset)


def mamba_split_conv1d_scan_combined(zxbcdt, conv1d_weight, conv1d_bias, dt_bias, A, D, chunk_size,
                                     initial_states=None, seq_idx=None, dt_limit=(0.0, float("inf")),
                                     return_final_states=False, activation="silu", rmsnorm_weight=None,
                                     rmsnorm_eps=1e-6, outproj_weight=None, outproj_bias=None, headdim=None,
                                     ngroups=1, norm_before_gate=True):
    """Drop-in for mamba_ssm's mamba_split_conv1d_scan_combined: same arguments, same returns (out,
    or (out, final_states)); differentiable in zxbcdt, conv1d_weight, conv1d_bias, dt_bias, A, D,
    initial_states, rmsnorm_weight, outproj_weight and outproj_bias. See the module docstring."""
    from ...runtime import mamba_chunk_scan_combined
    from ..conv1d.causal_conv1d import causal_conv1d
    from ..norm.gated_rmsnorm import gated_rmsnorm

    nheads, headdim, dim, dstate, d_mlp = _sizes(
        zxbcdt, conv1d_weight, conv1d_bias, dt_bias, A, D, seq_idx, activation, rmsnorm_weight,
        rmsnorm_eps, outproj_weight, outproj_bias, headdim, ngroups)
    if zxbcdt.dtype not in _INPUT_DTYPES:   # what the SSD's kernels take
        raise TypeError(f"zxbcdt: expected float16, bfloat16 or float32, got {zxbcdt.dtype}")
    gn = ngroups * dstate
    # split, not slicing: its backward writes the parts' gradients into one tensor at once
    zx0, z, xBC, dt = torch.split(zxbcdt, [2 * d_mlp, dim, dim + 2 * gn, nheads], dim=-1)
    xBC_in = xBC
    xBC = causal_conv1d(xBC_in, conv1d_weight, conv1d_bias, seq_idx, activation)
    x, B, C = torch.split(xBC, [dim, gn, gn], dim=-1)
    z4 = z.unflatten(-1, (nheads, headdim))
    recompute = (torch.is_grad_enabled() and xBC.requires_grad and not torch.compiler.is_compiling())
    with (_ConvRecompute(xBC_in, conv1d_weight, conv1d_bias, seq_idx, activation, xBC).hooks() if recompute
          else contextlib.nullcontext()):
        res = mamba_chunk_scan_combined(
            x.unflatten(-1, (nheads, headdim)), dt, A, B.unflatten(-1, (ngroups, dstate)),
            C.unflatten(-1, (ngroups, dstate)), chunk_size, D=D, z=z4 if rmsnorm_weight is None else None,
            dt_bias=dt_bias, initial_states=initial_states, seq_idx=seq_idx, dt_softplus=True,
            dt_limit=dt_limit, return_final_states=return_final_states)
    y, final = res if return_final_states else (res, None)
    y = y.flatten(-2)
    if rmsnorm_weight is not None:
        y = gated_rmsnorm(y, rmsnorm_weight, z, rmsnorm_eps, group_size=dim // ngroups,
                          norm_before_gate=norm_before_gate)
    if d_mlp:
        y = torch.cat([_swiglu(zx0), y], dim=-1)
    if outproj_weight is not None:
        y = F.linear(y, outproj_weight, outproj_bias)
    return (y, final) if return_final_states else y


def mamba_split_conv1d_scan_ref(zxbcdt, conv1d_weight, conv1d_bias, dt_bias, A, D, chunk_size,
                                initial_states=None, seq_idx=None, dt_limit=(0.0, float("inf")),
                                return_final_states=False, activation="silu", rmsnorm_weight=None,
                                rmsnorm_eps=1e-6, outproj_weight=None, outproj_bias=None, headdim=None,
                                ngroups=1, norm_before_gate=True, recurrent=True):
    """The same function from the plain-torch references (naive conv1d, the SSD's float64
    reference, naive gated norm), computing in float64 and differentiable by autograd; returns
    float64 tensors. recurrent: the token-by-token SSD (short sequences) or the chunked one."""
    from ..conv1d.naive import causal_conv1d_ref
    from ..norm.naive import gated_rmsnorm_ref
    from .naive import ssd_chunked, ssd_recurrent

    nheads, headdim, dim, dstate, d_mlp = _sizes(
        zxbcdt, conv1d_weight, conv1d_bias, dt_bias, A, D, seq_idx, activation, rmsnorm_weight,
        rmsnorm_eps, outproj_weight, outproj_bias, headdim, ngroups)
    f64 = torch.float64

    def up(t):
        return t.to(f64) if t is not None else None
    gn = ngroups * dstate
    zx0, z, xBC, dt = torch.split(up(zxbcdt), [2 * d_mlp, dim, dim + 2 * gn, nheads], dim=-1)
    xBC = causal_conv1d_ref(xBC, up(conv1d_weight), up(conv1d_bias), seq_idx, activation)
    x, B, C = torch.split(xBC, [dim, gn, gn], dim=-1)
    z4 = z.unflatten(-1, (nheads, headdim))
    args = (x.unflatten(-1, (nheads, headdim)), dt, up(A), B.unflatten(-1, (ngroups, dstate)),
            C.unflatten(-1, (ngroups, dstate)))
    kw = dict(D=up(D), z=z4 if rmsnorm_weight is None else None, dt_bias=up(dt_bias),
              initial_states=up(initial_states), seq_idx=seq_idx, dt_softplus=True, dt_limit=tuple(dt_limit))
    y, final, _ = ssd_recurrent(*args, **kw) if recurrent else ssd_chunked(*args, chunk_size, **kw)
    y = y.flatten(-2)
    if rmsnorm_weight is not None:
        y = gated_rmsnorm_ref(y, up(rmsnorm_weight), z, rmsnorm_eps, dim // ngroups, norm_before_gate)
    if d_mlp:
        x0, y0 = zx0.chunk(2, dim=-1)
        y = torch.cat([F.silu(x0) * y0, y], dim=-1)
    if outproj_weight is not None:
        y = F.linear(y, up(outproj_weight), up(outproj_bias))
    return (y, final) if return_final_states else y
