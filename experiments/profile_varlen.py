"""Per-kernel GPU time of one packed-prefill call (torch.profiler), autossd and mamba_ssm's packed
form, at 2.7b, 8192 tokens in 16 sequences, bf16: which stage the time goes to.

    python experiments/profile_varlen.py
"""
from __future__ import annotations

import importlib.util
import os
import sys

import torch

ROOT = os.path.join(os.path.dirname(__file__), "..")
sys.path.insert(0, ROOT)
spec = importlib.util.spec_from_file_location("bench_varlen", os.path.join(ROOT, "scripts", "bench_varlen.py"))
bv = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bv)


def profile(name, fn, reps=20):
    from autossd.bench import kernel_times
    rows = {k: v for k, (v, _) in kernel_times(fn, reps).items()}
    total = sum(rows.values())
    print(f"{name}: {total:.1f} us per call on the GPU")
    for k, v in sorted(rows.items(), key=lambda kv: -kv[1])[:8]:
        print(f"   {v:8.1f} us  {k[:90]}")


def main():
    import autossd
    from autossd.peer import load_mamba_ssm
    gen = torch.Generator().manual_seed(3)
    lens = bv.lengths("even:16", 8192, gen)
    t = bv.make(lens, 80, 64, 128, 1, torch.bfloat16, "cuda")
    cuc, last, seq = autossd.varlen_chunks(t["cu_seqlens"], 256)
    out = torch.empty_like(t["x"])
    kw = dict(D=t["D"], dt_bias=t["dt_bias"], dt_softplus=True)
    profile("autossd varlen", lambda: autossd.ssd_varlen(
        t["x"], t["dt"], t["A"], t["B"], t["C"], 256, t["cu_seqlens"], z=t["z"], initial_states=t["initial_states"],
        cu_chunk_seqlens=cuc, last_chunk_indices=last, seq_idx=seq, out=out, **kw))
    profile("autossd batch forward, one sequence of 8192 (no seq_idx)", lambda: autossd.mamba_chunk_scan_combined(
        t["x"][None], t["dt"][None], t["A"], t["B"][None], t["C"][None], 256, z=t["z"][None], **kw))
    peer = load_mamba_ssm()
    if peer:
        tok_seq = torch.repeat_interleave(torch.arange(len(lens), device="cuda", dtype=torch.int32),
                                          torch.tensor(lens, device="cuda"))[None]
        profile("mamba_ssm packed", lambda: peer(t["x"][None], t["dt"][None], t["A"], t["B"][None], t["C"][None], 256,
                                                 z=t["z"][None], seq_idx=tok_seq, cu_seqlens=t["cu_seqlens"],
                                                 return_varlen_states=True, **kw))


if __name__ == "__main__":
    main()
