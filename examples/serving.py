"""Serving with autossd: a packed prefill of several prompts, each continuing from its cached
state (chunked prefill), then decode steps updating the cached states in place, checked against
one uninterrupted pass over each whole sequence.

    python examples/serving.py            # on a GPU
    TRITON_INTERPRET=1 python examples/serving.py --tiny   # on a CPU, in Triton's interpreter (slow)
    python examples/serving.py --time     # the same loop timed at serving sizes, against mamba_ssm

--time runs 16 prompts of drawn lengths (8192 tokens in all) at mamba2-2.7b's SSD layer, bf16: a
packed prefill of each prompt's first half, a second packed round continuing from the cached
states, then 32 decode steps at batch 16, called eagerly as an engine calls prefill. mamba_ssm's
kernels run the same loop where they can: its packed form takes no per-sequence initial states,
so its second round is one call per prompt (the batch form with that prompt's state).
"""
from __future__ import annotations

import argparse

import torch

import autossd


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiny", action="store_true", help="small sizes (the CPU interpreter)")
    ap.add_argument("--time", action="store_true", help="time the loop at serving sizes against mamba_ssm (GPU)")
    ap.add_argument("--json", default=None, help="with --time: write the timings here")
    a = ap.parse_args()
    if a.time:
        return timed(json_path=a.json)
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


def timed(prompts: int = 16, tokens: int = 8192, steps: int = 32, reps: int = 20, json_path=None) -> None:
    """The serving loop at mamba2-2.7b's SSD layer, milliseconds per phase (CUDA events around
    eager calls, median of `reps`), autossd against mamba_ssm's kernels."""
    from autossd.peer import load_mamba_ssm
    dev, dtype, (h, p, n, g, q) = "cuda", torch.bfloat16, (80, 64, 128, 1, 256)
    gen = torch.Generator().manual_seed(1)
    w = torch.rand(prompts, generator=gen) + 0.1
    lens = ((w / w.sum()) * tokens).long().clamp(min=2)
    lens[0] += tokens - int(lens.sum())
    first = [int(v) // 2 for v in lens]
    second = [int(v) - f for v, f in zip(lens, first)]

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen) * scale).to(dtype).to(dev)

    def part(sizes):
        T = sum(sizes)
        cu = torch.tensor([0] + torch.tensor(sizes).cumsum(0).tolist(), dtype=torch.int32, device=dev)
        return dict(x=rnd(T, h, p), dt=rnd(T, h), B=rnd(T, g, n), C=rnd(T, g, n)), cu
    A = (-torch.rand(h, generator=gen) * 2 - 0.5).to(dev)
    D, dt_bias = rnd(h).float(), rnd(h, scale=0.5).float()
    kw = dict(D=D, dt_bias=dt_bias, dt_softplus=True)
    (r1, cu1), (r2, cu2) = part(first), part(second)
    table = autossd.varlen_chunks(cu2, q, computed_tokens=first)   # built once, as an engine does
    dec = [dict(x=rnd(prompts, h, p), dt=rnd(prompts, h), B=rnd(prompts, g, n), C=rnd(prompts, g, n))
           for _ in range(steps)]
    seq1 = torch.repeat_interleave(torch.arange(prompts, device=dev, dtype=torch.int32),
                                   torch.tensor(first, device=dev))[None]
    offs2 = [0] + torch.tensor(second).cumsum(0).tolist()

    def ours():
        _, st = autossd.ssd_varlen(r1["x"], r1["dt"], A, r1["B"], r1["C"], q, cu1, **kw)
        _, st = autossd.ssd_varlen(r2["x"], r2["dt"], A, r2["B"], r2["C"], q, cu2, initial_states=st,
                                   cu_chunk_seqlens=table[0], last_chunk_indices=table[1], seq_idx=table[2], **kw)
        return st

    def ours_decode(cache):
        for d in dec:
            autossd.selective_state_update(cache, d["x"], d["dt"], A, d["B"], d["C"], **kw)

    scan = load_mamba_ssm()
    ssu = load_mamba_ssm("selective_state_update", "selective_state_update")

    def theirs():
        _, st = scan(r1["x"][None], r1["dt"][None], A, r1["B"][None], r1["C"][None], q, seq_idx=seq1,
                     cu_seqlens=cu1, return_varlen_states=True, **kw)
        out = []
        for i in range(prompts):   # its packed form takes no per-sequence initial states
            a, b = offs2[i], offs2[i + 1]
            _, fin = scan(r2["x"][None, a:b], r2["dt"][None, a:b], A, r2["B"][None, a:b], r2["C"][None, a:b], q,
                          initial_states=st[i:i + 1], return_final_states=True, **kw)
            out.append(fin)
        return torch.cat(out)

    # mamba_ssm's step takes the Mamba-2 form as expanded views (tie_hdim): dt per channel, A per
    # channel and state, D and dt_bias per channel
    A_e, D_e, bias_e = A[:, None, None].expand(h, p, n), D[:, None].expand(h, p), dt_bias[:, None].expand(h, p)

    def theirs_decode(cache):
        for d in dec:
            ssu(cache, d["x"], d["dt"][..., None].expand(-1, -1, p), A_e, d["B"], d["C"], D=D_e, dt_bias=bias_e,
                dt_softplus=True)

    def ms(fn, *args):
        times = []
        for i in range(reps + 3):
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            out = fn(*args)
            e.record()
            torch.cuda.synchronize()
            if i >= 3:
                times.append(s.elapsed_time(e))
        return sorted(times)[len(times) // 2], out

    rows = {}
    for name, prefill, decode in (("autossd", ours, ours_decode), ("mamba_ssm", theirs if scan else None, theirs_decode)):
        if prefill is None or (name == "mamba_ssm" and ssu is None):
            print(f"{name}: not installed")
            continue
        t_pre, states = ms(prefill)
        cache = states.float().contiguous()
        t_dec, _ = ms(decode, cache)
        rows[name] = (t_pre, t_dec)
        print(f"{name:10s} prefill (2 rounds, {sum(first)} + {sum(second)} tokens, {prompts} prompts) {t_pre:.3f} ms, "
              f"decode {steps} steps at batch {prompts} {t_dec:.3f} ms ({1e3 * t_dec / steps:.1f} us a step), "
              f"total {t_pre + t_dec:.3f} ms")
    if len(rows) == 2:
        (a_pre, a_dec), (m_pre, m_dec) = rows["autossd"], rows["mamba_ssm"]
        print(f"autossd against mamba_ssm: prefill {m_pre / a_pre:.2f}x, decode {m_dec / a_dec:.2f}x, "
              f"the loop {(m_pre + m_dec) / (a_pre + a_dec):.2f}x")
    if json_path:
        import json
        import time
        with open(json_path, "w") as f:
            json.dump({"date": time.strftime("%Y-%m-%d"), "gpu": torch.cuda.get_device_name(), "prompts": prompts,
                       "lengths": [int(v) for v in lens], "decode_steps": steps,
                       "ms": {k: {"prefill": v[0], "decode": v[1]} for k, v in rows.items()}}, f, indent=1)


if __name__ == "__main__":
    main()
