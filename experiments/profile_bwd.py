"""Per-kernel GPU time of one forward + backward (torch.profiler), autossd and mamba_ssm, at
Mamba-2's training call (D, z, dt_bias, softplus, chunk 256): which stage the time goes to.

    python experiments/profile_bwd.py [--shape mamba2-2.7b:8x2048] [--dtype bf16] [--set dx_block_m=32 ...]
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import sys

import torch

ROOT = os.path.join(os.path.dirname(__file__), "..")
sys.path.insert(0, ROOT)
spec = importlib.util.spec_from_file_location("bench_bwd", os.path.join(ROOT, "scripts", "bench_bwd.py"))
bb = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bb)


def profile(name, fn, reps=10, top=14):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    rows = {}
    for e in prof.key_averages():
        if e.device_type == torch.autograd.DeviceType.CUDA and e.device_time_total > 0:
            rows[e.key] = (e.device_time_total / reps, e.count // reps)
    total = sum(v for v, _ in rows.values())
    print(f"{name}: {total:.1f} us per step on the GPU")
    for k, (v, c) in sorted(rows.items(), key=lambda kv: -kv[1][0])[:top]:
        print(f"   {v:8.1f} us  x{c:<3d} {k[:100]}")
    return total


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="mamba2-2.7b:8x2048")
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--set", nargs="*", default=[], help="ssd_bwd knob=value overrides of the config used")
    ap.add_argument("--no-peer", action="store_true")
    a = ap.parse_args()
    import autossd
    from autossd.ops.ssd import backward as bw
    from autossd.testing import make_inputs
    prob = bb._shape(a.shape, a.dtype)
    if a.set:
        from autossd.runtime import arch_of_device
        from autossd.ops.ssd.bwd_knobs import KNOB_BY_NAME, default_config
        arch = arch_of_device(torch.device("cuda"))
        cfg = default_config(arch, prob)
        kv = {}
        for s in a.set:
            k, v = s.split("=")
            kv[k] = next(x for x in KNOB_BY_NAME[k].values if str(x) == v)
        cfg = cfg.replace(**kv)
        bw.config_for = lambda p, ar, _c=cfg: _c
        print("config:", cfg.as_dict())
    t = make_inputs(prob, "cuda", seed=0)
    for k in bb.GRAD:
        if t.get(k) is not None:
            t[k].requires_grad_()
    dout = torch.randn_like(t["x"])
    profile(f"autossd fwd+bwd {a.shape} {a.dtype}", bb._step(autossd.mamba_chunk_scan_combined, prob, t, dout))
    if not a.no_peer:
        peer = bb._peer()
        if peer:
            profile(f"mamba_ssm fwd+bwd {a.shape} {a.dtype}", bb._step(peer, prob, t, dout))


if __name__ == "__main__":
    main()
