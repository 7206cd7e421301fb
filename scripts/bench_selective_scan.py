#!/usr/bin/env python
"""Time autossd.selective_scan_fn (Mamba-1's selective scan) against mamba_ssm's CUDA kernel, on a GPU.

    python scripts/bench_selective_scan.py                 # dim 5120, dstate 16: 1x2048, 8x2048, 1x65536, bf16 and fp16
    python scripts/bench_selective_scan.py --check         # first: out and every gradient against float64
    python scripts/bench_selective_scan.py --sizes 4x8192 --dtypes bf16 --dim 8192 --json out.json
    python scripts/bench_selective_scan.py --tune --trials 30   # measure records for these shapes first (autossd tune)

The call is Mamba-1's layer's: u, delta, z in the dtype, B and C (batch, dstate, seqlen) in the dtype, A
fp32 (negative), D and delta_bias fp32, softplus on. Rows per (shape, dtype, implementation):
  fwd         the forward alone (out), triton.testing.do_bench (host work included where it is
              longer than the kernel: the small shapes)
  fwd/g       the same replayed from a CUDA graph (triton.testing.do_bench_cudagraph): the kernels alone
  fwd+bwd     forward with gradients wanted (autossd then stores its checkpoints) and the backward
              of every input through torch.autograd.grad, one call after the other (both through
              autograd, as a training step calls them)
  fwd+bwd/g   the same replayed from a CUDA graph: the kernels alone, with no host work
  peak        fwd+bwd's rows also give one call's peak memory above what was allocated before it
              (torch.cuda.max_memory_allocated), autossd's and the peer's
  floor       the larger of two, both at rates measured in this run: bytes read and written once
              (forward: u, delta, z, B, C read, out written; the backward adds dout, u, delta, z,
              B, C read, du, ddelta, dz, dB, dC written) at the device-to-device copy bandwidth,
              and the decays' exponentials (one an element-step, batch x dim x dstate x seqlen;
              twice that with the backward, which must recompute them or read them back) at the
              fp32 exp2 rate (autossd.bench.measure_exp2_rate); "of floor" = floor / time
The peer is mamba_ssm's CUDA extension `selective_scan_cuda` (its fwd called directly for the
forward rows; fwd and bwd behind an autograd function for the training rows, as mamba_ssm's
selective_scan_fn calls them); else mamba_ssm's selective_scan_fn; else "peer: not available".
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

DEVICE = "cuda"
DT = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}


def make(batch, dim, dstate, seqlen, dtype, seed=0, device="cuda"):
    g = torch.Generator(device="cpu").manual_seed(seed)
    e = DT[dtype]

    def rnd(*s, dt=e, scale=1.0):
        return (torch.randn(*s, generator=g) * scale).to(dt).to(device)

    return dict(u=rnd(batch, dim, seqlen), delta=(torch.rand(batch, dim, seqlen, generator=g) * 4 - 6.5).to(e).to(device),
                A=(-torch.rand(dim, dstate, generator=g) * 4 - 0.5).to(device),
                B=rnd(batch, dstate, seqlen), C=rnd(batch, dstate, seqlen), D=rnd(dim, dt=torch.float32),
                z=rnd(batch, dim, seqlen), delta_bias=rnd(dim, dt=torch.float32, scale=0.5))


NAMES = ("u", "delta", "A", "B", "C", "D", "z", "delta_bias")


def floor_bytes(batch, dim, dstate, seqlen, dtype) -> tuple[int, int]:
    """(forward bytes, forward + backward bytes), each operand once."""
    e = BYTES[dtype]
    act = batch * dim * seqlen * e
    bc = batch * dstate * seqlen * e
    fwd = 4 * act + 2 * bc                 # u, delta, z read; out written; B, C read
    bwd = 4 * act + 3 * act + 4 * bc       # dout, u, delta, z read; du, ddelta, dz written; B, C read, dB, dC written
    return fwd, fwd + bwd


# --- the implementations ---------------------------------------------------------------------
def autossd_impl():
    import autossd

    def fwd(t):
        return autossd.selective_scan_fn(t["u"], t["delta"], t["A"], t["B"], t["C"], t["D"], t["z"], t["delta_bias"],
                                         delta_softplus=True)

    def fwdbwd(t, dout):
        x = {k: t[k].detach().requires_grad_() for k in NAMES}
        out = autossd.selective_scan_fn(*(x[k] for k in NAMES), delta_softplus=True)
        return torch.autograd.grad(out, list(x.values()), dout)

    return fwd, fwdbwd


def peer_impl():
    """(name, fwd, fwdbwd) of mamba_ssm's kernel, or None."""
    try:
        import selective_scan_cuda
    except Exception:   # noqa: BLE001 - any import failure: try the Python package next
        selective_scan_cuda = None
    if selective_scan_cuda is not None:
        def fwd(t):
            out, x, *rest = selective_scan_cuda.fwd(t["u"], t["delta"], t["A"], t["B"][:, None], t["C"][:, None],
                                                    t["D"], t["z"], t["delta_bias"], True)
            return rest[0]

        class Scan(torch.autograd.Function):
            """The extension's fwd and bwd behind autograd, as a training step reaches them through
            mamba_ssm's selective_scan_fn (so the eager rows compare like with like: autossd's
            call goes through autograd too). bwd returns du, ddelta, dA, dB, dC, dD,
            ddelta_bias, dz."""

            @staticmethod
            def forward(ctx, u, delta, A, B, C, D, z, delta_bias):
                out, x, *rest = selective_scan_cuda.fwd(u, delta, A, B[:, None], C[:, None], D, z, delta_bias, True)
                ctx.save_for_backward(u, delta, A, B, C, D, z, delta_bias, x, out)
                return rest[0]

            @staticmethod
            def backward(ctx, dout):
                u, delta, A, B, C, D, z, delta_bias, x, out = ctx.saved_tensors
                du, ddelta, dA, dB, dC, dD, ddelta_bias, dz, *_ = selective_scan_cuda.bwd(
                    u, delta, A, B[:, None], C[:, None], D, z, delta_bias, dout.contiguous(), x, out, None, True, False)
                return du, ddelta, dA, dB.squeeze(1), dC.squeeze(1), dD, dz, ddelta_bias

        def fwdbwd(t, dout):
            x = {k: t[k].detach().requires_grad_() for k in NAMES}
            return torch.autograd.grad(Scan.apply(*(x[k] for k in NAMES)), list(x.values()), dout)

        return "selective_scan_cuda", fwd, fwdbwd
    try:
        from mamba_ssm.ops.selective_scan_interface import selective_scan_fn
    except Exception:   # noqa: BLE001
        return None

    def fwd(t):
        return selective_scan_fn(*(t[k] for k in NAMES), delta_softplus=True)

    def fwdbwd(t, dout):
        x = {k: t[k].detach().requires_grad_() for k in NAMES}
        out = selective_scan_fn(*(x[k] for k in NAMES), delta_softplus=True)
        return torch.autograd.grad(out, list(x.values()), dout)

    return "mamba_ssm.selective_scan_fn", fwd, fwdbwd


def bench_ms(fn, graph: bool = False) -> float:
    """GPU time of one call: triton.testing.do_bench (calls back to back: a call's host work counts
    where it is longer than the kernel), or replayed from a CUDA graph (the kernels alone)."""
    import triton.testing
    if graph:
        return triton.testing.do_bench_cudagraph(fn, rep=100)
    return triton.testing.do_bench(fn, warmup=25, rep=100)


# --- the float64 check ---------------------------------------------------------------------------
def check() -> bool:
    """out, last_state and every gradient against float64 at a small shape per dtype and B/C form."""
    import autossd
    from autossd.ops.mamba1.bwd import reference
    from autossd.ops.mamba1.naive import selective_scan_ref
    from autossd.testing import grad_tolerance, rel_err, tolerance
    ok = True
    for dtype in ("fp32", "bf16", "fp16"):
        for form in ("3d", "groups", "invariant"):
            t = make(2, 64, 16, 300, dtype, seed=3, device=DEVICE)
            if form == "groups":
                t["B"] = torch.randn(2, 4, 16, 300, device=DEVICE).to(DT[dtype])
                t["C"] = torch.randn(2, 4, 16, 300, device=DEVICE).to(DT[dtype])
            elif form == "invariant":
                t["B"] = torch.randn(64, 16, device=DEVICE)
                t["C"] = torch.randn(64, 16, device=DEVICE)
            x = {k: t[k].detach().clone().requires_grad_() for k in NAMES}
            out, last = autossd.selective_scan_fn(*(x[k] for k in NAMES), delta_softplus=True, return_last_state=True)
            ref_out, ref_last = selective_scan_ref(*(t[k] for k in NAMES), delta_softplus=True, return_last_state=True)
            dout = torch.randn_like(out)
            dlast = torch.randn_like(last)
            grads = torch.autograd.grad((out, last), list(x.values()), (dout, dlast))
            ref = reference(t, True, dout, dlast)
            errs = {"out": (rel_err(out.detach(), ref_out), tolerance(dtype)),
                    "last": (rel_err(last.detach(), ref_last), tolerance(dtype))}
            errs |= {f"d{k}": (rel_err(g, ref[k]), grad_tolerance(dtype)) for k, g in zip(NAMES, grads)}
            bad = [k for k, (e, tol) in errs.items() if not e < tol]
            ok &= not bad
            print(f"check {dtype} {form:9s} " + " ".join(f"{k} {e:.1e}" for k, (e, _) in errs.items())
                  + ("  ok" if not bad else f"  FAIL {bad}"))
    return ok


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dim", type=int, default=5120)
    ap.add_argument("--dstate", type=int, default=16)
    ap.add_argument("--sizes", nargs="+", default=["1x2048", "8x2048", "1x65536"], help="BATCHxSEQLEN")
    ap.add_argument("--dtypes", nargs="+", default=["bf16", "fp16"], choices=list(DT))
    ap.add_argument("--check", action="store_true", help="check out and gradients against float64 first")
    ap.add_argument("--tune", action="store_true", help="run `autossd tune` (forward and backward) for these "
                                                        "shapes first, storing measured records in --db")
    ap.add_argument("--trials", type=int, default=30)
    ap.add_argument("--db", help="the tuning database to read (and --tune to write); default AUTOSSD_DB")
    ap.add_argument("--json", help="write the rows here")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        print("no GPU: this script times kernels on a CUDA or ROCm device")
        return 2
    if a.db:
        import os
        os.environ["AUTOSSD_DB"] = a.db
    sizes = [tuple(int(v) for v in s.lower().split("x")) for s in a.sizes]
    if a.tune:
        shapes = ";".join(f"b={b},l={l},d={a.dim},n={a.dstate}" for b, l in sizes)
        for op in ("sscan_fwd", "sscan_bwd"):
            for dtype in a.dtypes:
                cmd = [sys.executable, "-m", "autossd.cli", "tune", "--op", op, "--shapes", shapes, "--dtype", dtype,
                       "--trials", str(a.trials)] + (["--db", a.db] if a.db else [])
                print("$", " ".join(cmd), flush=True)
                subprocess.run(cmd, check=True, cwd=ROOT)
    print(f"{torch.cuda.get_device_name()}  dim={a.dim} dstate={a.dstate}  torch {torch.__version__}")
    if a.check and not check():
        raise SystemExit("autossd failed the float64 check")
    from autossd.bench import measure_ceilings, measure_exp2_rate, peak_mib
    bw = measure_ceilings()["copy_GBps"]   # the copy rate every benchmark measures
    exp_rate = measure_exp2_rate()
    print(f"device-to-device copy: {bw:.0f} GB/s; fp32 exp2: {exp_rate / 1e12:.2f} T/s")
    fwd, fwdbwd = autossd_impl()
    peer = peer_impl()
    print(f"peer: {peer[0] if peer else 'not available'}")
    rows = []
    print(f"{'shape':>10} {'dtype':>5} {'pass':>7} {'autossd ms':>10} {'peer ms':>9} {'floor ms':>9} {'of floor':>8} "
          f"{'vs peer':>7}")
    for b, l in sizes:
        for dtype in a.dtypes:
            t = make(b, a.dim, a.dstate, l, dtype)
            dout = torch.randn_like(t["u"])
            fb, fbb = floor_bytes(b, a.dim, a.dstate, l, dtype)
            exps = b * a.dim * a.dstate * l
            for name, f_ours, f_peer, nbytes, nexp, graph in (
                    ("fwd", lambda: fwd(t), peer and (lambda: peer[1](t)), fb, exps, False),
                    ("fwd/g", lambda: fwd(t), peer and (lambda: peer[1](t)), fb, exps, True),
                    ("fwd+bwd", lambda: fwdbwd(t, dout), peer and (lambda: peer[2](t, dout)), fbb, 2 * exps, False),
                    ("fwd+bwd/g", lambda: fwdbwd(t, dout), peer and (lambda: peer[2](t, dout)), fbb, 2 * exps,
                     True)):
                ours = bench_ms(f_ours, graph)
                theirs = None
                if f_peer:
                    try:
                        theirs = bench_ms(f_peer, graph)
                    except Exception as e:   # noqa: BLE001 - a peer's failure is reported, not fatal
                        print(f"  peer failed at {b}x{l} {dtype} {name}: {type(e).__name__}: {e}")
                floor_b, floor_e = nbytes / (bw * 1e9) * 1e3, nexp / exp_rate * 1e3
                floor = max(floor_b, floor_e)
                row = dict(batch=b, seqlen=l, dim=a.dim, dstate=a.dstate, dtype=dtype, what=name, autossd_ms=ours,
                           peer_ms=theirs, peer=peer[0] if peer else None, floor_ms=floor, floor_bytes_ms=floor_b,
                           floor_exp2_ms=floor_e, copy_gbps=bw, exp2_per_s=exp_rate,
                           device=torch.cuda.get_device_name())
                if name == "fwd+bwd":
                    row["autossd_peak_MiB"] = peak_mib(f_ours)
                    row["peer_peak_MiB"] = peak_mib(f_peer) if theirs is not None else None
                rows.append(row)
                vs = f"{theirs / ours:6.2f}x" if theirs else "      -"
                peak = (f"  peak {row['autossd_peak_MiB']:.0f} MiB (peer "
                        f"{row['peer_peak_MiB'] if row['peer_peak_MiB'] is not None else float('nan'):.0f})"
                        if name == "fwd+bwd" else "")
                print(f"{b:>4}x{l:<5} {dtype:>5} {name:>7} {ours:10.3f} {theirs if theirs else float('nan'):9.3f} "
                      f"{floor:9.3f} {100 * floor / ours:7.1f}% {vs}{peak}")
            del t, dout
            torch.cuda.empty_cache()
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
