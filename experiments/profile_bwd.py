"""Per-kernel GPU time of one forward + backward (torch.profiler), autossd and mamba_ssm, at
Mamba-2's training call (D, z, dt_bias, softplus, chunk 256): which stage the time goes to.

    python experiments/profile_bwd.py [--shape mamba2-2.7b:8x2048] [--dtype bf16] [--set dx_block_m=32 ...]
    python experiments/profile_bwd.py --no-peer --sweep "dx_block_n=32; dcb_block_k=64 dcb_warps=8"
    python experiments/profile_bwd.py --no-peer --base record --sweep "; cb=stage cb_dtype=input"

--sweep: several override sets (';' between sets), each profiled in turn in the same process,
with the stages matching --stages shown.
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
    from autossd.bench import kernel_times
    rows = kernel_times(fn, reps)
    total = sum(v for v, _ in rows.values())
    if name is None:
        return total, rows
    print(f"{name}: {total:.1f} us per step on the GPU")
    for k, (v, c) in sorted(rows.items(), key=lambda kv: -kv[1][0])[:top]:
        print(f"   {v:8.1f} us  x{c:<3d} {k[:100]}")
    return total, rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="mamba2-2.7b:8x2048")
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--set", nargs="*", default=[], help="ssd_bwd knob=value overrides of the config used")
    ap.add_argument("--no-peer", action="store_true")
    ap.add_argument("--base", choices=("default", "record"), default="default",
                    help="what --set / --sweep override: the arch default or the stored record's config")
    ap.add_argument("--sweep", default="", help="override sets separated by ';'")
    ap.add_argument("--check", default="", help="dtypes: scripts/bench_bwd.py's gradient check with --set applied")
    ap.add_argument("--stages", default="dx,dcb,ssd_bwd_db,ssd_bwd_dc,chunk_state,dstates,state_passing",
                    help="kernel name parts shown per swept set")
    a = ap.parse_args()
    import autossd
    from autossd.ops.ssd import backward as bw
    from autossd.testing import make_inputs
    prob = bb._shape(a.shape, a.dtype)
    from autossd.ops.ssd.bwd_knobs import KNOB_BY_NAME, default_config
    from autossd.runtime import arch_of_device
    arch = arch_of_device(torch.device("cuda"))
    if a.base == "record":   # what the drop-in runs at this shape on this GPU: the lookup's pick
        from autossd.db.lookup import device_name
        base = bw.config_for(prob, arch, device_name(torch.device("cuda")))
    else:
        base = default_config(arch, prob)
    print("base config:", a.base, base.key())

    def config_of(sets):
        kv = {}
        for item in sets:
            k, v = item.split("=")
            kv[k] = next(x for x in KNOB_BY_NAME[k].values if str(x) == v)
        return base.replace(**kv)
    if a.set:
        cfg = config_of(a.set)
        bw.config_for = lambda p, ar, d=None, _c=cfg: _c
        print("config:", cfg.as_dict())
        if a.check:
            # bench_bwd's checks run each at its own shape: the overrides on that shape's default
            from autossd.db.lookup import transfer
            over = {k: cfg[k] for k in (x.split("=")[0] for x in a.set)}

            def at_shape(p, ar, d=None):   # knobs a shape cannot take are set back, as the lookup does
                c = default_config(ar, p).replace(**over)
                return transfer(c, ar, p, op="ssd_bwd") or default_config(ar, p)
            bw.config_for = at_shape
            return bb.check(a.check.split(","))
    t = make_inputs(prob, "cuda", seed=0)
    for k in bb.GRAD:
        if t.get(k) is not None:
            t[k].requires_grad_()
    dout = torch.randn_like(t["x"])
    step = bb._step(autossd.mamba_chunk_scan_combined, prob, t, dout)
    if a.sweep:
        show = a.stages.split(",")
        for spec in [x.split() for x in a.sweep.split(";")]:
            cfg = config_of(spec)
            bw.config_for = lambda p, ar, d=None, _c=cfg: _c
            try:
                total, rows = profile(None, step)
            except Exception as e:   # noqa: BLE001 - a set that does not compile or fit
                print(f"{' '.join(spec) or 'default':40s} failed: {type(e).__name__}: {str(e)[:120]}")
                continue
            parts = " ".join(f"{k.replace('ssd_bwd_', '')}={v:.0f}" for k, (v, _) in rows.items()
                             if any(x in k for x in show))
            print(f"{' '.join(spec) or 'default':40s} {total:7.0f} us | {parts}")
        return
    profile(f"autossd fwd+bwd {a.shape} {a.dtype}", step)
    if not a.no_peer:
        peer = bb._peer()
        if peer:
            profile(f"mamba_ssm fwd+bwd {a.shape} {a.dtype}", bb._step(peer, prob, t, dout))


if __name__ == "__main__":
    main()
