"""Packed prefill on the local GPU: autossd.ssd_varlen against its float64 reference (--check),
and timed against mamba_ssm's packed form (mamba_chunk_scan_combined with cu_seqlens and seq_idx,
batch 1, its varlen states; mamba_ssm has no per-sequence initial states, so its calls run
without them), autossd's own batch drop-in in the same form, and the speed-of-light floor
(bytes / measured copy bandwidth, FLOPs / measured bf16 matmul rate), all in one run on one card.

    python scripts/bench_varlen.py --check --json out.json

--config NAME=JSON (repeatable) checks and times forced configs beside the one the selector
picks, e.g. --config 'gluon={"state_walk": 1, "scan_gluon": 3}'.
"""
from __future__ import annotations

import argparse
import json
import time

import torch


def lengths(kind: str, total: int, gen) -> list[int]:
    """A packed batch's sequence lengths: 'one' (one sequence), 'even:N' (N equal ones),
    'mixed:N' (N drawn lengths), 'long+short:N' (one long, N - 1 of 64 tokens), 'gaps:N' (N drawn,
    every third empty)."""
    name, _, k = kind.partition(":")
    k = int(k or 1)
    if name == "one":
        return [total]
    if name == "even":
        return [total // k] * k
    if name == "mixed":
        w = torch.rand(k, generator=gen) + 0.05
        lens = (w / w.sum() * (total - k)).floor().long() + 1
        lens[0] += total - int(lens.sum())
        return [int(v) for v in lens]
    if name == "long+short":
        return [total - 64 * (k - 1)] + [64] * (k - 1)
    if name == "gaps":   # N drawn lengths, every third sequence empty (a request with no new tokens)
        w = torch.rand(k, generator=gen) + 0.05
        w[::3] = 0
        lens = (w / w.sum() * total).floor().long()
        lens[1] += total - int(lens.sum())
        return [int(v) for v in lens]
    raise ValueError(kind)


def make(lens, h, p, n, g, dtype, device, init=True, seed=0):
    gen = torch.Generator().manual_seed(seed)
    T = sum(lens)

    def rnd(*s, dt=dtype, scale=1.0):
        return (torch.randn(*s, generator=gen) * scale).to(dt).to(device)
    return dict(x=rnd(T, h, p), dt=(torch.rand(T, h, generator=gen) * 4 - 4).to(dtype).to(device),
                A=(-torch.rand(h, generator=gen) * 4 - 0.5).to(device), B=rnd(T, g, n), C=rnd(T, g, n),
                D=rnd(h, dt=torch.float32), z=rnd(T, h, p), dt_bias=rnd(h, dt=torch.float32, scale=0.5),
                initial_states=rnd(len(lens), h, p, n, dt=torch.float32, scale=0.5) if init else None,
                cu_seqlens=torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device=device))


def forced(args) -> dict:
    """The --config NAME=JSON pairs as {name: VarlenConfig}."""
    from autossd.ops.ssd.varlen_knobs import VarlenConfig
    out = {}
    for item in args.config or ():
        name, _, text = item.partition("=")
        out[name] = VarlenConfig(json.loads(text))
    return out


def check(args) -> list[dict]:
    """Every output against float64, for the selector's pick and each forced config, in shapes
    that reach each path's corners: ragged chunks, a prefix-cached resume mid-chunk (the chunk
    table's first chunk of each sequence ends at the cache's block edge), chunk 64 and 128,
    dstate 64, headdim 128, no initial states, the chunk states kept or not, a strided out=
    (not TMA-addressable: the tl stages take it), empty sequences (no chunk: the final state is
    the initial one)."""
    import autossd
    from autossd.ops.ssd.naive import varlen_ref
    from autossd.testing import rel_err, tolerance
    rows = []
    gen = torch.Generator().manual_seed(1)
    cases = [("mixed:32", 8192, {}), ("long+short:64", 100_000 + 63 * 64, {}), ("even:256", 256, {}), ("one", 1, {}),
             ("mixed:7", 3000, {}), ("mixed:9", 5000, {"resume": True}), ("mixed:5", 3000, {"chunk": 64}),
             ("mixed:5", 3000, {"chunk": 128, "n": 64}), ("mixed:6", 4000, {"p": 128, "init": False}),
             ("mixed:6", 4000, {"keep": False}), ("mixed:6", 4000, {"strided_out": True}), ("gaps:9", 3000, {})]
    configs = {"pick": None, **forced(args)}
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        for kind, total, opt in cases:
            lens = lengths(kind, total, gen)
            q, n, p = opt.get("chunk", 256), opt.get("n", 128), opt.get("p", 64)
            t = make(lens, 24, p, n, 1, dtype, "cuda", init=opt.get("init", True), seed=len(rows))
            done = (torch.randint(0, 4 * q, (len(lens),), generator=gen) if opt.get("resume") else None)
            cuc, last, seq = autossd.varlen_chunks(t["cu_seqlens"], q, computed_tokens=done)
            yr, fr, sr = varlen_ref(t["x"], t["dt"], t["A"], t["B"], t["C"], cuc, last, seq, D=t["D"], z=t["z"],
                                    dt_bias=t["dt_bias"], initial_states=t["initial_states"], dt_softplus=True)
            d = str(dtype).replace("torch.", "")
            tol = tolerance({"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}[d])
            keep = opt.get("keep", True)
            for name, cfg in configs.items():
                if cfg is not None and dtype == torch.float32:
                    continue   # the forced (Gluon) configs take 16-bit inputs
                out = (torch.full((t["x"].shape[0], 24, 2 * p), float("nan"), dtype=dtype, device="cuda")[..., ::2]
                       if opt.get("strided_out") else torch.full_like(t["x"], float("nan")))
                try:
                    got = autossd.ssd_varlen(t["x"], t["dt"], t["A"], t["B"], t["C"], q, t["cu_seqlens"], D=t["D"],
                                             z=t["z"], dt_bias=t["dt_bias"], initial_states=t["initial_states"],
                                             dt_softplus=True, cu_chunk_seqlens=cuc, last_chunk_indices=last,
                                             seq_idx=seq, out=out, return_intermediate_states=keep, config=cfg,
                                             poison=True)
                except ValueError as e:   # a forced config that cannot take the case
                    print(f"check {name:8s} {d:9s} {kind:14s} {opt}: skipped ({str(e)[:120]})")
                    continue
                errs = {"y": rel_err(got[0], yr), "final": rel_err(got[1], fr)}
                if keep:
                    errs["chunk_states"] = rel_err(got[2], sr)
                ok = all(e <= tol for e in errs.values())
                rows.append({"config": name, "dtype": d, "lengths": kind, "options": opt, "tokens": sum(lens),
                             "seqs": len(lens), "tol": tol, **errs, "ok": ok})
                print(f"check {name:8s} {d:9s} {kind:14s} T={sum(lens):7d} {opt}  "
                      + "  ".join(f"{k} {v:.2e}" for k, v in errs.items()) + f"  {'ok' if ok else 'FAIL'}", flush=True)
    return rows


def graph_ms(fn, reps=20) -> float:
    """ms per call replayed in a CUDA graph (no host time)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    from triton.testing import do_bench
    return do_bench(lambda: g.replay(), warmup=10, rep=100, return_mode="median")


def bench(args, ceilings) -> list[dict]:
    import autossd
    from autossd.bench import back_to_back_ms
    from autossd.ops.ssd.varlen_knobs import VarlenProblem
    from autossd.peer import load_mamba_ssm
    peer = load_mamba_ssm()
    rows = []
    gen = torch.Generator().manual_seed(2)
    models = {"mamba2-2.7b": (80, 64, 128, 1), "codestral": (128, 64, 128, 8), "mamba2-130m": (24, 64, 128, 1)}
    cases = [("mamba2-2.7b", "one", 8192), ("mamba2-2.7b", "even:16", 8192), ("mamba2-2.7b", "mixed:64", 8192),
             ("mamba2-2.7b", "long+short:64", 65536), ("mamba2-2.7b", "even:64", 4096), ("codestral", "mixed:16", 16384),
             ("mamba2-130m", "mixed:128", 32768)]
    for model, kind, total in cases:
        h, p, n, g = models[model]
        lens = lengths(kind, total, gen)
        t = make(lens, h, p, n, g, torch.bfloat16, "cuda")
        cuc, last, seq = autossd.varlen_chunks(t["cu_seqlens"], 256)
        out = torch.empty_like(t["x"])
        kw = dict(D=t["D"], z=t["z"], dt_bias=t["dt_bias"], dt_softplus=True)

        def ours(init=True):
            return autossd.mamba_chunk_scan_combined_varlen(
                t["x"], t["dt"], t["A"], t["B"], t["C"], 256, t["cu_seqlens"], cuc, last, seq, out,
                initial_states=t["initial_states"] if init else None, **kw)

        def forced_fn(cfg):
            return lambda: autossd.ssd_varlen(
                t["x"], t["dt"], t["A"], t["B"], t["C"], 256, t["cu_seqlens"], cu_chunk_seqlens=cuc,
                last_chunk_indices=last, seq_idx=seq, out=out, initial_states=t["initial_states"], config=cfg, **kw)

        def dense():   # the dense forward of the same tokens as one sequence (the "one" case)
            return autossd.mamba_chunk_scan_combined(t["x"][None], t["dt"][None], t["A"], t["B"][None], t["C"][None],
                                                     256, initial_states=t["initial_states"], return_final_states=True,
                                                     **{**kw, "z": t["z"][None]})
        tok_seq = torch.repeat_interleave(torch.arange(len(lens), device="cuda", dtype=torch.int32),
                                          torch.tensor(lens, device="cuda"))[None]
        batch = dict(seq_idx=tok_seq, cu_seqlens=t["cu_seqlens"], return_varlen_states=True,
                     **{**kw, "z": t["z"][None]})

        def drop_in():
            return autossd.mamba_chunk_scan_combined(t["x"][None], t["dt"][None], t["A"], t["B"][None], t["C"][None],
                                                     256, **batch)

        def mamba():
            return peer(t["x"][None], t["dt"][None], t["A"], t["B"][None], t["C"][None], 256, **batch)
        pr = VarlenProblem(tokens=sum(lens), seqs=len(lens), chunks=int(seq.shape[0]), nheads=h, headdim=p, dstate=n,
                           ngroups=g, chunk_size=256, dtype="bf16", has_D=True, has_z=True, has_dt_bias=True,
                           dt_softplus=True, has_init=True)
        floor = max(pr.min_bytes() / (ceilings["copy_GBps"] * 1e6), pr.flops() / (ceilings["bf16_matmul_TFLOPs"] * 1e9))
        row = {"model": model, "lengths": kind, "tokens": sum(lens), "seqs": len(lens), "floor_ms": floor}
        for name, fn in (("autossd_varlen", ours), ("autossd_varlen_noinit", lambda: ours(False)),
                         *((f"autossd_{k}", forced_fn(c)) for k, c in forced(args).items()),
                         ("autossd_dense_one", dense if kind == "one" else None),
                         ("autossd_batch_seq_idx", drop_in), ("mamba_ssm", mamba if peer else None)):
            if fn is None:
                continue
            try:
                fn()
                torch.cuda.synchronize()
                row[f"{name}_graph_ms"] = graph_ms(fn)
                row[f"{name}_eager_ms"] = back_to_back_ms(fn)
            except Exception as e:   # a peer that cannot take the shape is reported, not fatal
                row[f"{name}_error"] = f"{type(e).__name__}: {e}"[:200]
        rows.append(row)
        gm = row.get("mamba_ssm_graph_ms")
        print(f"{model:12s} {kind:14s} T={row['tokens']:6d} S={row['seqs']:4d}  varlen {row.get('autossd_varlen_graph_ms', float('nan')):.3f} ms"
              f" (eager {row.get('autossd_varlen_eager_ms', float('nan')):.3f})  batch+seq_idx {row.get('autossd_batch_seq_idx_graph_ms', float('nan')):.3f}"
              f"  mamba_ssm {gm if gm else float('nan'):.3f}  floor {floor:.3f}  "
              f"{'%.2fx mamba_ssm, ' % (gm / row['autossd_varlen_graph_ms']) if gm and 'autossd_varlen_graph_ms' in row else ''}"
              f"{100 * floor / row.get('autossd_varlen_graph_ms', float('inf')):.0f}% of floor", flush=True)
        # mamba_ssm's packed call takes no per-sequence initial states: the like-for-like ratio is
        # against autossd's call without them
        ni = row.get("autossd_varlen_noinit_graph_ms")
        if ni and gm:
            print(f"    without initial states (as mamba_ssm's call): {ni:.3f} ms, {gm / ni:.2f}x mamba_ssm")
        for k in forced(args):
            ms = row.get(f"autossd_{k}_graph_ms")
            print(f"    {k}: " + (f"{ms:.3f} ms, {gm / ms:.2f}x mamba_ssm" if ms and gm else str(row.get(f'autossd_{k}_error'))))
        if "autossd_dense_one_graph_ms" in row:
            print(f"    dense forward 1x{row['tokens']}: {row['autossd_dense_one_graph_ms']:.3f} ms")
    return rows


def sweep(args) -> list[dict]:
    """Graph-timed configs of the packed prefill at one shape (2.7b, 8192 tokens in 16 sequences,
    bf16): the knobs a measured tune would search, around the default."""
    import itertools

    import autossd
    from autossd.ops.ssd.varlen_knobs import VarlenConfig
    gen = torch.Generator().manual_seed(3)
    lens = lengths("even:16", 8192, gen)
    t = make(lens, 80, 64, 128, 1, torch.bfloat16, "cuda")
    cuc, last, seq = autossd.varlen_chunks(t["cu_seqlens"], 256)
    out = torch.empty_like(t["x"])
    rows = []
    base = VarlenConfig()
    grid = itertools.product((False, True), (64, 128), ((64, 64, 64), (64, 128, 64)), ((4, 2), (2, 3)), (0, 128),
                             (64, 128))
    configs = [base.replace(decay_split=ds, scan_block_d=sd, state_block_m=tm, state_block_n=tn, state_block_k=tk,
                            state_warps=sw, state_stages=ss, scan_maxnreg=mr, scan_block_m=sm)
               for ds, sd, (tm, tn, tk), (sw, ss), mr, sm in grid]
    configs += [base.replace(cb="inline"), base.replace(cb="inline", decay_split=True)]
    for cfg in configs:
        def fn():
            return autossd.ssd_varlen(t["x"], t["dt"], t["A"], t["B"], t["C"], 256, t["cu_seqlens"], D=t["D"], z=t["z"],
                                      dt_bias=t["dt_bias"], initial_states=t["initial_states"], dt_softplus=True,
                                      cu_chunk_seqlens=cuc, last_chunk_indices=last, seq_idx=seq, out=out, config=cfg)
        try:
            fn()
            torch.cuda.synchronize()
            ms = graph_ms(fn)
        except Exception as e:  # noqa: BLE001 - an infeasible config is skipped
            print(f"skip {cfg}: {type(e).__name__}")
            continue
        rows.append({"config": cfg.as_dict(), "graph_ms": ms})
    rows.sort(key=lambda r: r["graph_ms"])
    for r in rows[:5]:
        print(f"sweep {r['graph_ms']:.3f} ms  {VarlenConfig(r['config'])!r}")
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--check", action="store_true", help="correctness against float64 first")
    ap.add_argument("--no-bench", action="store_true")
    ap.add_argument("--sweep", action="store_true", help="time configs around the default at one shape")
    ap.add_argument("--json", default=None)
    ap.add_argument("--config", action="append", metavar="NAME=JSON",
                    help="a forced packed-prefill config to check and time beside the pick (repeatable)")
    args = ap.parse_args()
    from autossd.bench import measure_ceilings
    res = {"date": time.strftime("%Y-%m-%d"), "gpu": torch.cuda.get_device_name(), "torch": torch.__version__}
    if args.check:
        res["check"] = check(args)
    if not args.no_bench:
        res["ceilings"] = measure_ceilings()
        print(f"ceilings: copy {res['ceilings']['copy_GBps']:.0f} GB/s, bf16 matmul {res['ceilings']['bf16_matmul_TFLOPs']:.0f} TFLOP/s")
        res["bench"] = bench(args, res["ceilings"])
    if args.sweep:
        res["sweep"] = sweep(args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
