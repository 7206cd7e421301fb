"""The whole Mamba-1 mixer from the input projection's output, as mamba_ssm's `mamba_inner_fn`
computes it (its training path): causal conv1d with SiLU, the x projection into dt, B and C, the
dt projection, the selective scan gated by silu(z), the output projection.

    xz (batch, 2 * dim, seqlen): x, then the gate z, along channels
    x' = silu(conv1d(x) + conv1d_bias)                       autossd's Triton conv1d
    [dt_low, B, C] = x' x_proj_weight^T                      (rank, dstate, dstate per token)
    delta = dt_low delta_proj_weight^T                        (dim per token; no bias here)
    y = selective_scan(x', delta, A, B, C, D, z, delta_bias, delta_softplus)   autossd.selective_scan_fn
    out = y out_proj_weight^T + out_proj_bias                 (batch, seqlen, d_model)

B and C come from the x projection when not given (then B_proj_bias / C_proj_bias are added to
them); given, they go to the scan as they are. b_rms_weight, c_rms_weight and dt_rms_weight (the
FalconMamba form) RMS-normalize B and C over dstate and delta over dim, each times its weight,
with eps b_c_dt_rms_eps, in fp32, as mamba_ssm does: note that delta is normalized after the dt
projection, where FalconMamba's own PyTorch code (and its inference) normalizes dt_low before it.
Unlike mamba_ssm, whose backward treats the normalized B, C and delta as if they had not been
normalized, the gradients here go through the norms.

Every step is a differentiable op (the conv's Triton backward, torch's matmuls, the scan's own
backward), so autograd gives the gradient of every tensor input. checkpoint_lvl is accepted for
mamba_ssm's signature; autograd keeps what each op saves for its backward (the conv keeps its
input, the scan its inputs), so there is nothing for it to choose here.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..common.direct import check_device, check_float
from ..conv1d import causal_conv1d as _conv
from ..conv1d.causal_conv1d import WIDTHS
from .scan import selective_scan_fn


def _rms(v, weight, eps, dim=-1):
    """RMSNorm of v over `dim` times weight, computed in fp32 (float64 for float64 v), in v's dtype."""
    acc = torch.promote_types(v.dtype, torch.float32)
    vf = v.to(acc)
    w = weight.to(acc)
    if dim != -1:
        w = w[:, None]
    return (vf * torch.rsqrt(vf.pow(2).mean(dim, keepdim=True) + eps) * w).to(v.dtype)


def _check(xz, conv1d_weight, conv1d_bias, x_proj_weight, delta_proj_weight, out_proj_weight, out_proj_bias,
           A, B, C, D, delta_bias, B_proj_bias, C_proj_bias, checkpoint_lvl, b_rms_weight, c_rms_weight,
           dt_rms_weight):
    check_float("xz", xz)
    if xz.dim() != 3 or xz.shape[1] % 2 or 0 in xz.shape:
        raise ValueError(f"xz: expected non-empty (batch, 2 * dim, seqlen), got shape {tuple(xz.shape)}")
    dim = xz.shape[1] // 2
    check_float("A", A)
    if A.is_complex() or A.dim() != 2 or A.shape[0] != dim:
        raise ValueError(f"A: expected a real (dim={dim}, dstate) tensor, got shape {tuple(A.shape)}")
    n = A.shape[1]
    check_float("conv1d_weight", conv1d_weight)
    shape = tuple(conv1d_weight.shape)
    if not ((len(shape) == 3 and shape[:2] == (dim, 1)) or (len(shape) == 2 and shape[0] == dim)) \
            or shape[-1] not in WIDTHS:
        raise ValueError(f"conv1d_weight: expected (dim={dim}, 1, width) with width in {WIDTHS}, got {shape}")
    check_float("x_proj_weight", x_proj_weight)
    check_float("delta_proj_weight", delta_proj_weight)
    if delta_proj_weight.dim() != 2 or delta_proj_weight.shape[0] != dim:
        raise ValueError(f"delta_proj_weight: expected (dim={dim}, rank), got shape {tuple(delta_proj_weight.shape)}")
    rank = delta_proj_weight.shape[1]
    rows = rank + (n if B is None else 0) + (n if C is None else 0)
    if x_proj_weight.dim() != 2 or tuple(x_proj_weight.shape) != (rows, dim):
        raise ValueError(f"x_proj_weight: expected (rank + dstate for each of B, C not given = {rows}, dim={dim}), "
                         f"got shape {tuple(x_proj_weight.shape)}")
    check_float("out_proj_weight", out_proj_weight)
    if out_proj_weight.dim() != 2 or out_proj_weight.shape[1] != dim:
        raise ValueError(f"out_proj_weight: expected (d_model, dim={dim}), got shape {tuple(out_proj_weight.shape)}")
    vectors = {"conv1d_bias": (conv1d_bias, dim), "out_proj_bias": (out_proj_bias, out_proj_weight.shape[0]),
               "D": (D, dim), "delta_bias": (delta_bias, dim), "B_proj_bias": (B_proj_bias, n),
               "C_proj_bias": (C_proj_bias, n), "b_rms_weight": (b_rms_weight, n), "c_rms_weight": (c_rms_weight, n),
               "dt_rms_weight": (dt_rms_weight, dim)}
    for name, (t, size) in vectors.items():
        if t is not None:
            check_float(name, t)
            if tuple(t.shape) != (size,):
                raise ValueError(f"{name}: expected shape ({size},), got {tuple(t.shape)}")
    for name, t, bias in (("B", B, B_proj_bias), ("C", C, C_proj_bias)):
        if t is None:
            continue
        if bias is not None:
            raise ValueError(f"{name}_proj_bias: only for {name} from the x projection ({name}=None)")
        check_float(name, t)
        if t.dim() not in (3, 4) or t.shape[0] != xz.shape[0] or t.shape[-2:] != (n, xz.shape[2]):
            raise ValueError(f"{name}: expected input-dependent (batch, [ngroups,] dstate={n}, seqlen={xz.shape[2]}), "
                             f"got shape {tuple(t.shape)}")
    if checkpoint_lvl not in (0, 1):
        raise ValueError(f"checkpoint_lvl: expected 0 or 1, got {checkpoint_lvl!r}")
    if not torch.is_autocast_enabled(xz.device.type):
        for name, w in (("x_proj_weight", x_proj_weight), ("delta_proj_weight", delta_proj_weight),
                        ("out_proj_weight", out_proj_weight)):
            if w.dtype != xz.dtype:
                raise TypeError(f"{name}: {w.dtype}, but xz is {xz.dtype}; expected one dtype (or autocast)")
    for name, t in (("conv1d_weight", conv1d_weight), ("conv1d_bias", conv1d_bias), ("x_proj_weight", x_proj_weight),
                    ("delta_proj_weight", delta_proj_weight), ("out_proj_weight", out_proj_weight),
                    ("out_proj_bias", out_proj_bias), ("A", A), ("B", B), ("C", C), ("D", D),
                    ("delta_bias", delta_bias), ("B_proj_bias", B_proj_bias), ("C_proj_bias", C_proj_bias),
                    ("b_rms_weight", b_rms_weight), ("c_rms_weight", c_rms_weight), ("dt_rms_weight", dt_rms_weight)):
        check_device(name, t, xz, "xz")
    return dim, n, rank


def _pieces(xz, conv1d_weight, conv1d_bias, x_proj_weight, delta_proj_weight, A, B, C, B_proj_bias, C_proj_bias,
            b_rms_weight, c_rms_weight, dt_rms_weight, eps, n, rank, conv):
    """conv output u (batch, dim, seqlen), delta (batch, dim, seqlen), B and C for the scan, and
    the gate z (batch, dim, seqlen): the part shared by the op and its float64 reference (`conv`
    is the only step that differs)."""
    dim = xz.shape[1] // 2
    x, z = xz[:, :dim], xz[:, dim:]
    w = conv1d_weight.reshape(dim, conv1d_weight.shape[-1])
    u = conv(x.transpose(1, 2), w, conv1d_bias)                       # (batch, seqlen, dim)
    x_dbl = F.linear(u, x_proj_weight)                                # (batch, seqlen, rank [+ n] [+ n])
    delta = F.linear(x_dbl[..., :rank], delta_proj_weight)            # (batch, seqlen, dim)
    if dt_rms_weight is not None:
        delta = _rms(delta, dt_rms_weight, eps)
    col = rank
    if B is None:
        B = x_dbl[..., col:col + n]
        col += n
        if B_proj_bias is not None:
            B = B + B_proj_bias.to(B.dtype)
        B = B.transpose(1, 2)                                         # (batch, dstate, seqlen)
    if C is None:
        C = x_dbl[..., col:col + n]
        if C_proj_bias is not None:
            C = C + C_proj_bias.to(C.dtype)
        C = C.transpose(1, 2)
    if b_rms_weight is not None:
        B = _rms(B, b_rms_weight, eps, dim=-2)
    if c_rms_weight is not None:
        C = _rms(C, c_rms_weight, eps, dim=-2)
    return u.transpose(1, 2), delta.transpose(1, 2), B, C, z


def _project_out(y, out_proj_weight, out_proj_bias):
    bias = out_proj_bias
    if bias is not None and not torch.is_autocast_enabled(y.device.type):
        bias = bias.to(out_proj_weight.dtype)   # transformers passes it in fp32 beside a bf16 weight
    return F.linear(y.transpose(1, 2), out_proj_weight, bias)


def mamba_inner_fn(xz, conv1d_weight, conv1d_bias, x_proj_weight, delta_proj_weight, out_proj_weight, out_proj_bias,
                   A, B=None, C=None, D=None, delta_bias=None, B_proj_bias=None, C_proj_bias=None,
                   delta_softplus=True, checkpoint_lvl=1, b_rms_weight=None, c_rms_weight=None, dt_rms_weight=None,
                   b_c_dt_rms_eps=1e-6):
    """The Mamba-1 mixer after its input projection, mamba_ssm's `mamba_inner_fn` (same
    parameters and meaning; the module docstring gives the steps). xz (batch, 2 * dim, seqlen);
    conv1d_weight (dim, 1, width) with width 2 to 4, conv1d_bias (dim,); x_proj_weight
    (rank + 2 * dstate, dim) (fewer rows for B or C given); delta_proj_weight (dim, rank);
    out_proj_weight (d_model, dim), out_proj_bias (d_model,); A (dim, dstate) real; D,
    delta_bias (dim,). Returns (batch, seqlen, d_model) in the projection's dtype,
    differentiable in every tensor input."""
    dim, n, rank = _check(xz, conv1d_weight, conv1d_bias, x_proj_weight, delta_proj_weight, out_proj_weight,
                          out_proj_bias, A, B, C, D, delta_bias, B_proj_bias, C_proj_bias, checkpoint_lvl,
                          b_rms_weight, c_rms_weight, dt_rms_weight)
    def conv(x, w, b):
        return _conv.causal_conv1d(x, w, b, activation="silu")
    u, delta, B, C, z = _pieces(xz, conv1d_weight, conv1d_bias, x_proj_weight, delta_proj_weight, A, B, C,
                                B_proj_bias, C_proj_bias, b_rms_weight, c_rms_weight, dt_rms_weight, b_c_dt_rms_eps,
                                n, rank, conv)
    y = selective_scan_fn(u, delta, A, B, C, D=D, z=z, delta_bias=delta_bias, delta_softplus=bool(delta_softplus))
    return _project_out(y, out_proj_weight, out_proj_bias)


def mamba_inner_ref(xz, conv1d_weight, conv1d_bias, x_proj_weight, delta_proj_weight, out_proj_weight,
                    out_proj_bias, A, B=None, C=None, D=None, delta_bias=None, B_proj_bias=None, C_proj_bias=None,
                    delta_softplus=True, b_rms_weight=None, c_rms_weight=None, dt_rms_weight=None,
                    b_c_dt_rms_eps=1e-6):
    """mamba_inner_fn in plain torch, in the inputs' dtype (pass float64 tensors for a float64
    reference), differentiable by autograd, written apart from the op (channel-major, as the
    scan's layout): the naive conv1d, explicit per-token products, a token-by-token scan."""
    from ..conv1d.naive import causal_conv1d_ref
    bsz, two_dim, L = xz.shape
    dim, n, rank = two_dim // 2, A.shape[1], delta_proj_weight.shape[1]
    x, z = xz.split(dim, dim=1)
    w = conv1d_weight.reshape(dim, -1)
    u = causal_conv1d_ref(x.permute(0, 2, 1), w, conv1d_bias, activation="silu").permute(0, 2, 1)   # (b, d, l)
    proj = torch.einsum("rd,bdl->brl", x_proj_weight, u)             # (b, rows, l)
    delta = torch.einsum("dr,brl->bdl", delta_proj_weight, proj[:, :rank])

    def rms(v, weight):   # over the channel axis (1) of (b, channels, l)
        return v / torch.sqrt((v * v).mean(1, keepdim=True) + b_c_dt_rms_eps) * weight[:, None]
    if dt_rms_weight is not None:
        delta = rms(delta, dt_rms_weight)
    rows = rank
    if B is None:
        B = proj[:, rows:rows + n] + (B_proj_bias[:, None] if B_proj_bias is not None else 0)
        rows += n
    if C is None:
        C = proj[:, rows:rows + n] + (C_proj_bias[:, None] if C_proj_bias is not None else 0)
    B = B if B.dim() == 4 else B[:, None]
    C = C if C.dim() == 4 else C[:, None]
    if b_rms_weight is not None:
        B = B / torch.sqrt((B * B).mean(2, keepdim=True) + b_c_dt_rms_eps) * b_rms_weight[:, None]
    if c_rms_weight is not None:
        C = C / torch.sqrt((C * C).mean(2, keepdim=True) + b_c_dt_rms_eps) * c_rms_weight[:, None]
    if delta_bias is not None:
        delta = delta + delta_bias[:, None]
    if delta_softplus:
        delta = F.softplus(delta)
    chan = torch.arange(dim, device=xz.device)
    gB, gC = chan // (dim // B.shape[1]), chan // (dim // C.shape[1])   # channel d reads group d // (dim / groups)
    h = u.new_zeros(bsz, dim, n)
    ys = []
    for t in range(L):
        h = h * torch.exp(delta[:, :, t, None] * A) + (delta[:, :, t] * u[:, :, t])[..., None] * B[:, gB, :, t]
        ys.append((h * C[:, gC, :, t]).sum(-1))
    y = torch.stack(ys, dim=2)
    if D is not None:
        y = y + D[:, None] * u
    y = y * z * torch.sigmoid(z)
    out = torch.einsum("ed,bdl->ble", out_proj_weight, y)
    return out + out_proj_bias if out_proj_bias is not None else out
