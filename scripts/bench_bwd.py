"""Benchmark and GPU gradient check of autossd's SSD forward + backward (ssd_fwd + ssd_bwd).

    python scripts/bench_bwd.py [--out FILE.json] [--dtypes bf16,fp16] [--shapes mamba2-2.7b:8x2048,...]
    python scripts/bench_bwd.py --no-z [--out FILE.json] ...
    python scripts/bench_bwd.py --check [--dtypes fp32,bf16,fp16]

Timing: forward + backward of autossd.mamba_chunk_scan_combined (Mamba2's call: D (h,), dt_bias,
dt_softplus, z, chunk 256, x, dt, A, B, C, D, z, dt_bias requiring grad), against mamba_ssm's
mamba_chunk_scan_combined where it imports, and the floor of a training step's SSD:
    bytes = element size x (5 b l h p + 3 b l h + 6 b l g n)   over the measured copy rate
            (3 b l h p with --no-z: neither z nor its gradient)
    FLOPs = 3 x the forward's causal FLOPs                     over the measured bf16 matmul rate
    floor = max(bytes time, FLOPs time).

--no-z: the call without z, as the Mamba2 module makes it with its default gated norm (the gate is
applied in the norm after the scan). autossd is timed twice with z: as it runs by default (the
forward keeps the ungated output for z's gradient) and with autossd.grad.KEEP_UNGATED_OUTPUT off
(the backward runs the forward again). Beside each wall time (`*_ms`), the GPU time of one step
(`*_gpu_ms`: the sum of its kernels' times under torch.profiler): where the wall time is well above
it, the step waits on the host. Peak memory: torch.cuda.max_memory_allocated over one forward +
backward, above what the inputs and their gradients take. Each library is timed from the same
inputs (do_bench, median).

--check: on the GPU, every input's gradient against float64 autograd through the chunked
reference (naive.ssd_chunked, run on the GPU in float64), relative L2 error per input, at a few
shapes and features; exits 1 if any is above the test-suite's bound for its dtype.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch
from triton.testing import do_bench

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import autossd  # noqa: E402
from autossd import grad  # noqa: E402
from autossd.bench import kernel_times, measure_ceilings, peak_mib  # noqa: E402
from autossd.ops.ssd import backward as bw  # noqa: E402
from autossd.problem import DTYPE_BYTES, Problem  # noqa: E402
from autossd.testing import call_kwargs, grad_tolerance, make_inputs, rel_err  # noqa: E402

MODELS = {"mamba2-2.7b": dict(nheads=80, headdim=64, dstate=128, ngroups=1),
          "mamba2-130m": dict(nheads=24, headdim=64, dstate=128, ngroups=1),
          "codestral": dict(nheads=128, headdim=64, dstate=128, ngroups=8)}
DEFAULT_SHAPES = ("mamba2-2.7b:8x2048,mamba2-2.7b:4x16384,mamba2-2.7b:1x65536,mamba2-130m:4x8192,"
                  "codestral:1x65536")
GRAD = ("x", "dt", "A", "B", "C", "D", "z", "dt_bias")


def _shape(spec: str, dtype: str, z: bool = True) -> Problem:
    model, bl = spec.split(":")
    b, l = (int(v) for v in bl.split("x"))
    return Problem(b, l, dtype=dtype, chunk_size=256, has_D=True, has_z=z, has_dt_bias=True,
                   dt_softplus=True, **MODELS[model])


def floor_ms(prob: Problem, ceil: dict) -> tuple[float, float, float]:
    e = DTYPE_BYTES[prob.dtype]
    b, l, h, p, n, g = prob.batch, prob.seqlen, prob.nheads, prob.headdim, prob.dstate, prob.ngroups
    nbytes = e * ((5 if prob.has_z else 3) * b * l * h * p + 3 * b * l * h + 6 * b * l * g * n)
    bytes_ms = nbytes / ceil["copy_GBps"] / 1e6
    flops_ms = 3 * prob.flops(256) / ceil["bf16_matmul_TFLOPs"] / 1e9
    return max(bytes_ms, flops_ms), bytes_ms, flops_ms


def _peer():
    from autossd.peer import load_mamba_ssm   # its Triton path, without the package's CUDA extensions
    try:
        fn = load_mamba_ssm()
    except Exception as e:   # noqa: BLE001 - built for another torch, say
        fn, why = None, f"{type(e).__name__}: {e}"
    else:
        why = "not installed"
    if fn is None:
        print(f"mamba_ssm not importable ({why}); timing autossd only")
    return fn


def _step(fn, prob: Problem, t: dict, dout):
    leaves = {k: t[k] for k in GRAD if t.get(k) is not None}

    def run():
        for v in leaves.values():
            v.grad = None
        y = fn(t["x"], t["dt"], t["A"], t["B"], t["C"], 256, D=t["D"], z=t.get("z"), dt_bias=t["dt_bias"],
               dt_softplus=True)
        y.backward(dout)
    return run


def bench(shapes: list[str], dtypes: list[str], out: str | None, z: bool = True) -> None:
    ceil = measure_ceilings()
    print(f"ceilings: copy {ceil['copy_GBps']:.0f} GB/s, bf16 matmul {ceil['bf16_matmul_TFLOPs']:.0f} TFLOP/s")
    peer = _peer()
    rows = []
    for dtype in dtypes:
        for spec in shapes:
            prob = _shape(spec, dtype, z)
            before = torch.cuda.memory_allocated()
            t = make_inputs(prob, "cuda", seed=0)
            for k in GRAD:
                if t.get(k) is not None:
                    t[k].requires_grad_()
            dout = torch.randn_like(t["x"])
            inputs_mib = (torch.cuda.memory_allocated() - before) / 2**20
            row = {"shape": spec, "dtype": dtype, "z": z}
            # autossd_recompute: the backward runs the forward again for z's gradient instead of
            # the forward keeping the ungated output
            for name, fn, keep in (("autossd", autossd.mamba_chunk_scan_combined, True),
                                   ("autossd_recompute", autossd.mamba_chunk_scan_combined, False),
                                   ("mamba_ssm", peer, True)):
                if fn is None or (not keep and not z):   # without z there is no ungated output
                    continue
                grad.KEEP_UNGATED_OUTPUT = keep
                step = _step(fn, prob, t, dout)
                step()   # compile, and gradients allocated
                row[f"{name}_peak_MiB"] = peak_mib(step)
                row[f"{name}_ms"] = do_bench(step, warmup=25, rep=200, return_mode="median")
                row[f"{name}_gpu_ms"] = sum(v for v, _ in kernel_times(step, reps=5).values()) / 1e3
                grad.KEEP_UNGATED_OUTPUT = True
            fl, fb, ff = floor_ms(prob, ceil)
            row.update(floor_ms=fl, floor_bytes_ms=fb, floor_flops_ms=ff,
                       inputs_MiB=inputs_mib)
            row["autossd_floor_share"] = fl / row["autossd_ms"]
            if "mamba_ssm_ms" in row:
                row["speedup"] = row["mamba_ssm_ms"] / row["autossd_ms"]
            print(json.dumps({k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items()}))
            rows.append(row)
            if out:   # after every row: a run cut short keeps what it measured
                with open(out, "w") as f:
                    json.dump({"ceilings": ceil, "device": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)
            # the last step's closure holds the inputs and their gradients: free them before the
            # next shape's inputs are counted
            del t, dout, step
            torch.cuda.empty_cache()


CHECKS = [
    Problem(2, 1000, 8, 64, 128, 2, "fp32", chunk_size=256, has_D=True, has_z=True, has_dt_bias=True,
            dt_softplus=True, has_dt_limit=True, has_initial_states=True, return_final_states=True, has_seq_idx=True),
    Problem(1, 2048, 24, 64, 128, 1, "fp32", chunk_size=256, has_D=True, D_has_hdim=True, has_dt_bias=True,
            dt_softplus=True),
    Problem(2, 333, 4, 32, 64, 4, "fp32", chunk_size=64, has_initial_states=True, return_final_states=True),
    Problem(1, 1, 4, 64, 128, 1, "fp32", chunk_size=128, has_z=True, has_D=True),
    # shapes the sm90 Gluon dx takes (16-bit, headdim in 64s, dstate 64 or 128, no seq_idx): a
    # ragged last chunk, chunks of 64 and 128, groups, initial and final states
    Problem(2, 700, 8, 128, 64, 2, "fp32", chunk_size=128, has_D=True, D_has_hdim=True,
            has_initial_states=True, return_final_states=True),
    Problem(3, 1000, 6, 64, 128, 3, "fp32", chunk_size=64, has_D=True, has_z=True, has_dt_bias=True,
            dt_softplus=True),
]


def check(dtypes: list[str]) -> int:
    failed = 0
    for dtype in dtypes:
        for base in CHECKS:
            prob = base.replace(dtype=dtype)
            t = make_inputs(prob, "cuda", seed=1)
            kw = call_kwargs(prob, t)
            leaves = {k: t[k].clone().requires_grad_() for k in GRAD + ("initial_states",) if t.get(k) is not None}
            for k in ("D", "z", "dt_bias", "initial_states"):
                if k in leaves:
                    kw[k] = leaves[k]
            out = autossd.mamba_chunk_scan_combined(*(leaves[k] for k in ("x", "dt", "A", "B", "C")),
                                                    prob.chunk_size, **kw)
            y, final = out if prob.return_final_states else (out, None)
            # seeded like the inputs: at one token a gradient such as B's is one scalar (a sum
            # over heads) times C, so an unlucky draw where that sum nearly cancels makes its
            # relative error large in any 16-bit implementation (bf16, H200: 9e-2 at one
            # unseeded draw, 3.8e-3 to 4.0e-3 at three seeded ones, bitwise the same kernels)
            g = torch.Generator(device=y.device).manual_seed(2)
            dout = torch.randn(y.shape, generator=g, device=y.device, dtype=y.dtype)
            dfinal = (torch.randn(final.shape, generator=g, device=y.device, dtype=final.dtype)
                      if final is not None else None)
            torch.autograd.backward([y] + ([final] if final is not None else []),
                                    [dout] + ([dfinal] if dfinal is not None else []))
            ref = bw.reference(t["x"], t["dt"], t["A"], t["B"], t["C"], prob.chunk_size, t["D"], t["z"], t["dt_bias"],
                               t["initial_states"], t["seq_idx"], prob.dt_softplus,
                               kw.get("dt_limit", (0.0, float("inf"))), dout, dfinal)
            # a gradient whose reference is zero (A at a one-token sequence without an initial
            # state: y does not depend on the decay then) is judged against the size of the
            # others, not against itself (its relative error would divide by zero)
            scale = max(float(r.norm()) for r in ref.values())
            errs = {k: (rel_err(leaves[k].grad, ref[k]) if float(ref[k].norm()) > 1e-12 * scale
                        else float(leaves[k].grad.double().norm()) / scale) for k in ref}
            worst = max(errs.values())
            ok = worst < grad_tolerance(dtype)
            failed += not ok
            print(f"{'ok  ' if ok else 'FAIL'} {dtype} b={prob.batch} l={prob.seqlen} h={prob.nheads} "
                  f"p={prob.headdim} n={prob.dstate} g={prob.ngroups} chunk={prob.chunk_size}: "
                  + " ".join(f"{k}={e:.1e}" for k, e in errs.items()))
    return 1 if failed else 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", action="store_true", help="gradients vs float64 reference on the GPU")
    ap.add_argument("--dtypes", default=None, help="comma-separated: fp32, bf16, fp16")
    ap.add_argument("--shapes", default=DEFAULT_SHAPES)
    ap.add_argument("--out", default=None, help="JSON file for the timing rows")
    ap.add_argument("--no-z", action="store_true", help="time the call without z (Mamba2's default gated norm)")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        print("no GPU: this script times and checks on a GPU")
        return 2
    if a.check:
        return check((a.dtypes or "fp32,bf16,fp16").split(","))
    bench(a.shapes.split(","), (a.dtypes or "bf16,fp16").split(","), a.out, z=not a.no_z)
    return 0


if __name__ == "__main__":
    sys.exit(main())
