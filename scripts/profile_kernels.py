#!/usr/bin/env python
"""GPU time per kernel (torch.profiler) of one training step or one packed-prefill call, autossd's
against mamba_ssm's: which stage the time goes to. Needs a CUDA GPU.

Run it before and after changing a kernel of the backward or of packed prefill, when choosing a
knob's default (profile several override sets in one process with --sweep), or when a benchmark
of the whole op moves and you need to know which launch moved it.

  --op ssd_bwd (default): one forward + backward at Mamba-2's training call (D, z, dt_bias,
  softplus, chunk 256; --no-z without z), every input requiring grad.

    python scripts/profile_kernels.py [--shape mamba2-2.7b:8x2048] [--dtype bf16] [--set dx_block_m=32 ...]
    python scripts/profile_kernels.py --no-peer --sweep "dx_block_n=32; dcb_block_k=64 dcb_warps=8"
    python scripts/profile_kernels.py --no-peer --base record --sweep "; cb=stage cb_dtype=input"
    python scripts/profile_kernels.py --set dx_maxnreg=128 --check bf16,fp16

  --set overrides ssd_bwd knobs of the arch default (--base default) or of the config the lookup
  picks at this shape on this GPU (--base record); --sweep profiles several override sets (';'
  between sets) one after another and prints the stages matching --stages; --check runs
  scripts/bench_bwd.py's gradient check (every gradient against float64) with --set applied.

  --op ssd_varlen: one packed-prefill call (autossd.ssd_varlen, each sequence from its own initial
  state, with its chunk table given), autossd's batch drop-in over the same tokens as one
  sequence, and mamba_ssm's packed form (cu_seqlens, seq_idx, varlen states).

    python scripts/profile_kernels.py --op ssd_varlen [--model mamba2-2.7b] [--tokens 8192] [--seqs 16]
"""
from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def _script(name: str):
    """A sibling script as a module (the inputs, steps and checks of the benchmarks)."""
    spec = importlib.util.spec_from_file_location(f"_script_{name}", ROOT / "scripts" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


def profile(name, fn, reps=10, top=14):
    """Print (unless name is None) and return the GPU time per call and its split by kernel."""
    from autossd.bench import kernel_times
    rows = kernel_times(fn, reps)
    total = sum(v for v, _ in rows.values())
    if name is not None:
        print(f"{name}: {total:.1f} us per call on the GPU")
        for k, (v, c) in sorted(rows.items(), key=lambda kv: -kv[1][0])[:top]:
            print(f"   {v:8.1f} us  x{c:<3d} {k[:100]}")
    return total, rows


def profile_bwd(a) -> int:
    import torch

    import autossd
    from autossd.ops.ssd import backward as bw
    from autossd.ops.ssd.bwd_knobs import KNOB_BY_NAME, default_config
    from autossd.runtime import arch_of_device
    from autossd.testing import make_inputs
    bb = _script("bench_bwd")
    prob = bb._shape(a.shape, a.dtype, z=not a.no_z)
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
            k, eq, v = item.partition("=")
            if not eq or k not in KNOB_BY_NAME:
                raise SystemExit(f"{item!r}: expected KNOB=VALUE, KNOB one of {sorted(KNOB_BY_NAME)}")
            try:
                kv[k] = next(x for x in KNOB_BY_NAME[k].values if str(x) == v)
            except StopIteration:
                raise SystemExit(f"{item!r}: expected one of {list(KNOB_BY_NAME[k].values)}") from None
        return base.replace(**kv)
    if a.set:
        cfg = config_of(a.set)
        bw.config_for = lambda p, ar, d=None, _c=cfg: _c
        print("config:", cfg.as_dict())
        if a.check:
            # bench_bwd's checks run each at its own shape: the overrides on that shape's default,
            # knobs a shape cannot take set back, as the lookup does
            from autossd.db.lookup import transfer
            over = {k: cfg[k] for k in (x.split("=")[0] for x in a.set)}

            def at_shape(p, ar, d=None):
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
        return 0
    profile(f"autossd fwd+bwd {a.shape} {a.dtype}", step)
    if not a.no_peer:
        peer = bb._peer()
        if peer:
            profile(f"mamba_ssm fwd+bwd {a.shape} {a.dtype}", bb._step(peer, prob, t, dout))
    return 0


def profile_varlen(a) -> int:
    import torch

    import autossd
    from autossd.peer import load_mamba_ssm
    from autossd.tuner.shapes import MODELS
    bv = _script("bench_varlen")
    h, p, n, g = MODELS[a.model]
    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}[a.dtype]
    lens = bv.lengths(f"even:{a.seqs}", a.tokens, torch.Generator().manual_seed(3))
    t = bv.make(lens, h, p, n, g, dtype, "cuda")
    cuc, last, seq = autossd.varlen_chunks(t["cu_seqlens"], 256)
    out = torch.empty_like(t["x"])
    kw = dict(D=t["D"], dt_bias=t["dt_bias"], dt_softplus=True)
    what = f"{a.model} {a.tokens} tokens in {a.seqs} sequences {a.dtype}"
    profile(f"autossd ssd_varlen, {what}", lambda: autossd.ssd_varlen(
        t["x"], t["dt"], t["A"], t["B"], t["C"], 256, t["cu_seqlens"], z=t["z"],
        initial_states=t["initial_states"], cu_chunk_seqlens=cuc, last_chunk_indices=last, seq_idx=seq,
        out=out, **kw), reps=20, top=8)
    profile(f"autossd batch forward, one sequence of {a.tokens} (no seq_idx)", lambda: autossd.mamba_chunk_scan_combined(
        t["x"][None], t["dt"][None], t["A"], t["B"][None], t["C"][None], 256, z=t["z"][None], **kw), reps=20, top=8)
    peer = None if a.no_peer else load_mamba_ssm()
    if peer:
        tok_seq = torch.repeat_interleave(torch.arange(len(lens), device="cuda", dtype=torch.int32),
                                          torch.tensor(lens, device="cuda"))[None]
        profile(f"mamba_ssm packed, {what}", lambda: peer(
            t["x"][None], t["dt"][None], t["A"], t["B"][None], t["C"][None], 256, z=t["z"][None], seq_idx=tok_seq,
            cu_seqlens=t["cu_seqlens"], return_varlen_states=True, **kw), reps=20, top=8)
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--op", choices=("ssd_bwd", "ssd_varlen"), default="ssd_bwd")
    ap.add_argument("--dtype", default="bf16", choices=("fp16", "bf16"))
    ap.add_argument("--no-peer", action="store_true", help="leave mamba_ssm out")
    bwd = ap.add_argument_group("--op ssd_bwd")
    bwd.add_argument("--no-z", action="store_true",
                     help="the call without z (Mamba2's own: its gated norm applies the gate after the scan)")
    bwd.add_argument("--shape", default="mamba2-2.7b:8x2048",
                     help="MODEL:BxL, MODEL one of mamba2-2.7b, mamba2-130m, codestral")
    bwd.add_argument("--set", nargs="*", default=[], metavar="KNOB=VALUE", help="ssd_bwd knob overrides")
    bwd.add_argument("--base", choices=("default", "record"), default="default",
                     help="what --set / --sweep override: the arch default or the stored record's config")
    bwd.add_argument("--sweep", default="", help="override sets separated by ';'")
    bwd.add_argument("--check", default="", metavar="DTYPES",
                     help="scripts/bench_bwd.py's gradient check in these dtypes with --set applied")
    bwd.add_argument("--stages", default="dx,dcb,ssd_bwd_db,ssd_bwd_dc,chunk_state,dstates,state_passing,walk_rev",
                     help="kernel name parts shown per swept set")
    var = ap.add_argument_group("--op ssd_varlen")
    var.add_argument("--model", default="mamba2-2.7b", help="a model of autossd/tuner/shapes.py")
    var.add_argument("--tokens", type=int, default=8192, help="tokens of all sequences")
    var.add_argument("--seqs", type=int, default=16, help="sequences, of equal length")
    a = ap.parse_args(argv)
    import torch
    if not torch.cuda.is_available():
        print("profile_kernels.py: no GPU here; it profiles CUDA kernels")
        return 2
    return profile_bwd(a) if a.op == "ssd_bwd" else profile_varlen(a)


if __name__ == "__main__":
    sys.exit(main())
