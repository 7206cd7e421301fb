"""Serving with autossd: a packed prefill of several prompts, each continuing from its cached
state (chunked prefill), then decode steps updating the cached states in place, checked against
one uninterrupted pass over each whole sequence.

    python examples/serving.py            # on a GPU
    TRITON_INTERPRET=1 python examples/serving.py --tiny   # on a CPU, in Triton's interpreter (slow)
"""
from __future__ import annotations

import argparse

import torch

import autossd


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiny", action="store_true", help="small sizes (the CPU interpreter)")
    a = ap.parse_args()
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    h, p, n, g, q = (4, 16, 16, 1, 64) if a.tiny else (80, 64, 128, 1, 256)   # mamba2-2.7b's SSD layer
    dtype = torch.float32 if a.tiny else torch.bfloat16
    gen = torch.Generator().manual_seed(0)
    first, second = [37, 5, 90], [20, 64, 3]   # two prefill rounds of three prompts
    steps = 4                                  # then decode steps
    lens = [x + y + steps for x, y in zip(first, second)]

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen) * scale).to(dtype).to(dev)
    A = (-torch.rand(h, generator=gen) * 2 - 0.5).to(dev)
    D, dt_bias = rnd(h).float(), rnd(h, scale=0.5).float()
    seqs = [dict(x=rnd(L, h, p), dt=rnd(L, h), B=rnd(L, g, n), C=rnd(L, g, n)) for L in lens]

    def packed(lo: list[int], hi: list[int]):
        """Tokens lo[i]:hi[i] of every sequence, packed, and their cu_seqlens."""
        parts = {k: torch.cat([s[k][a:b] for s, a, b in zip(seqs, lo, hi)]) for k in ("x", "dt", "B", "C")}
        cu = torch.tensor([0] + torch.tensor([b - a for a, b in zip(lo, hi)]).cumsum(0).tolist(),
                          dtype=torch.int32, device=dev)
        return parts, cu

    kw = dict(D=D, dt_bias=dt_bias, dt_softplus=True)
    # round 1: the first part of each prompt, from zero states
    t, cu = packed([0] * 3, first)
    y1, states = autossd.ssd_varlen(t["x"], t["dt"], A, t["B"], t["C"], q, cu, **kw)
    # round 2: the rest of each prompt continues from its cached state; the chunk table lines
    # chunk ends up with the sequence positions (computed_tokens), as a prefix cache stores them
    t, cu = packed(first, [a + b for a, b in zip(first, second)])
    table = autossd.varlen_chunks(cu, q, computed_tokens=first)
    y2, states, chunk_states = autossd.ssd_varlen(
        t["x"], t["dt"], A, t["B"], t["C"], q, cu, initial_states=states, cu_chunk_seqlens=table[0],
        last_chunk_indices=table[1], seq_idx=table[2], return_intermediate_states=True, **kw)
    # decode: one token per sequence per step, the states updated in place (fp32 cache)
    cache = states.float().contiguous()
    ys = []
    for k in range(steps):
        pos = [a + b + k for a, b in zip(first, second)]
        x = torch.stack([s["x"][i] for s, i in zip(seqs, pos)])
        dt = torch.stack([s["dt"][i] for s, i in zip(seqs, pos)])
        B = torch.stack([s["B"][i] for s, i in zip(seqs, pos)])
        C = torch.stack([s["C"][i] for s, i in zip(seqs, pos)])
        ys.append(autossd.selective_state_update(cache, x, dt, A, B, C, D=D, dt_bias=dt_bias, dt_softplus=True))

    # the same sequences in one pass each, through the batch drop-in
    worst = 0.0
    off1 = off2 = 0
    for i, s in enumerate(seqs):
        y, final = autossd.mamba_chunk_scan_combined(s["x"][None], s["dt"][None], A, s["B"][None], s["C"][None],
                                                     max(q, 64), return_final_states=True, **kw)
        got = torch.cat([y1[off1:off1 + first[i]], y2[off2:off2 + second[i]]] + [yy[i:i + 1] for yy in ys])
        off1, off2 = off1 + first[i], off2 + second[i]
        err = ((got.double() - y[0].double()).norm() / y[0].double().norm()).item()
        serr = ((cache[i].double() - final[0].double()).norm() / final[0].double().norm()).item()
        worst = max(worst, err, serr)
        print(f"sequence {i}: {first[i]} + {second[i]} prefill tokens, {steps} decode steps: "
              f"output error {err:.1e}, final state error {serr:.1e}")
    print(f"chunk-end states kept for the prefix cache: {tuple(chunk_states.shape)}")
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    print("agrees with one pass per sequence" if worst < tol else f"MISMATCH (worst {worst:.1e})")


if __name__ == "__main__":
    main()
