"""Time autossd.selective_state_update (the decode step) against mamba_ssm's, on a GPU.

    python scripts/bench_decode.py                 # mamba2-2.7b dims, batch 1 / 16 / 64, fp32/bf16/fp16 states
    python scripts/bench_decode.py --check         # also compare with the float64 reference first
    python scripts/bench_decode.py --batch 1 128 --state fp32 --json out.json

Shapes: nheads 80, headdim 64, dstate 128, ngroups 1 (mamba2-2.7b), x/B/C/z in bf16, dt, A, D and
dt_bias in the tied forms Mamba-2 passes (expanded over headdim with stride 0), softplus on.
--form mamba1: Mamba-1's call instead (Mamba 2.8b: --dim 5120 --dstate 16, the defaults there):
state (batch, dim, dstate), x, dt, z (batch, dim) in bf16, A (dim, dstate) fp32, a value per
channel and state, B, C (batch, dstate), D and dt_bias (dim,) fp32, softplus on.

    python scripts/bench_decode.py --form mamba1 --batch 1 64 256 --check

Figures per (batch, state dtype) and implementation:
  eager_us  wall time of one call from the host, calls back to back then one synchronize (what a
            Python decode loop without CUDA graphs pays: launch and host work included)
  graph_us  GPU time of one call replayed from a CUDA graph of many calls
  %copy     bytes / graph time against the device-to-device copy bandwidth measured in the same
            run (bytes = state read + state write + x + dt + B + C + z + out; dt counted as one
            value per head)
A row "copy" times a device-to-device copy of the same bytes the same way (its %copy: how near a
kernel of that size can come to the 1 GB copy rate at all); a row "in-place" times torch's in-place
scaling of the state alone (`state.mul_`: the same addresses read and written in the state's
dtype, the step's traffic with no other work; its bytes are the state's read and write).
Each timed call takes the next of several state sets, so that together they exceed the L2 cache
and the state streams from HBM as it does in a model with many layers.
"""
from __future__ import annotations

import argparse
import json
import math
import time

import torch

DT = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
L2_BYTES = 64 << 20   # above the H100's 50 MB and the H200's L2


def copy_gbps(nbytes: int = 1 << 30, reps: int = 20) -> float:
    a = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    for _ in range(3):
        b.copy_(a)
    torch.cuda.synchronize()
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    e0.record()
    for _ in range(reps):
        b.copy_(a)
    e1.record()
    torch.cuda.synchronize()
    seconds = e0.elapsed_time(e1) * 1e-3 / reps
    return 2 * nbytes / seconds / 1e9   # read and written once each


def make(batch, h, p, n, g, state_dtype, nsets, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    dev = "cuda"

    def rnd(*s, dtype=torch.bfloat16):
        return torch.randn(*s, generator=gen, device=dev).to(dtype)

    common = dict(
        dt=(torch.rand(batch, h, generator=gen, device=dev) * 4 - 4).to(torch.bfloat16)[..., None].expand(batch, h, p),
        A=(-torch.rand(h, generator=gen, device=dev) * 4 - 0.5)[:, None, None].expand(h, p, n),
        D=torch.randn(h, generator=gen, device=dev)[:, None].expand(h, p),
        dt_bias=(torch.randn(h, generator=gen, device=dev) * 0.5)[:, None].expand(h, p))
    sets = [dict(state=rnd(batch, h, p, n, dtype=DT[state_dtype]), x=rnd(batch, h, p), B=rnd(batch, g, n),
                 C=rnd(batch, g, n), z=rnd(batch, h, p), out=torch.empty(batch, h, p, dtype=torch.bfloat16, device=dev))
            for _ in range(nsets)]
    return common, sets


def make_mamba1(batch, dim, n, state_dtype, nsets, seed=0):
    """Mamba-1's decode call: a dense A (dim, n) and one dt per channel."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    dev = "cuda"

    def rnd(*s, dtype=torch.bfloat16):
        return torch.randn(*s, generator=gen, device=dev).to(dtype)

    common = dict(A=-torch.rand(dim, n, generator=gen, device=dev) * 4 - 0.5,
                  D=torch.randn(dim, generator=gen, device=dev),
                  dt_bias=torch.randn(dim, generator=gen, device=dev) * 0.5)
    sets = [dict(state=rnd(batch, dim, n, dtype=DT[state_dtype]), x=rnd(batch, dim), B=rnd(batch, n), C=rnd(batch, n),
                 z=rnd(batch, dim), dt=(torch.rand(batch, dim, generator=gen, device=dev) * 4 - 4).to(torch.bfloat16),
                 out=torch.empty(batch, dim, dtype=torch.bfloat16, device=dev))
            for _ in range(nsets)]
    return common, sets


def nbytes(batch, h, p, n, g, state_dtype, form="mamba2") -> int:
    """State read and written, x, z and out, B and C, dt (one per head; Mamba-1: one per channel,
    and its dense fp32 A read once)."""
    s = {"fp32": 4, "bf16": 2, "fp16": 2}[state_dtype]
    base = 2 * batch * h * p * n * s + 3 * batch * h * p * 2 + 2 * batch * g * n * 2
    return base + (batch * p * 2 + p * n * 4 if form == "mamba1" else batch * h * 2)


def call_of(fn, common, st):
    # mamba_ssm's selective_state_update takes no out= (it returns a new tensor)
    kw = {} if getattr(fn, "__module__", "").startswith("mamba_ssm") else {"out": st["out"]}
    dt = st.get("dt", common.get("dt"))
    return lambda: fn(st["state"], st["x"], dt, common["A"], st["B"], st["C"], D=common["D"], z=st["z"],
                      dt_bias=common["dt_bias"], dt_softplus=True, **kw)


def eager_us(calls, reps=200) -> float:
    for c in calls[:3]:
        c()
    torch.cuda.synchronize()
    best = math.inf
    for _ in range(3):
        t0 = time.perf_counter()
        for i in range(reps):
            calls[i % len(calls)]()
        torch.cuda.synchronize()
        best = min(best, (time.perf_counter() - t0) / reps * 1e6)
    return best


def graph_us(calls, per_graph=None, reps=20) -> float:
    per_graph = per_graph or max(len(calls), 50)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for c in calls:
            c()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(per_graph):
            calls[i % len(calls)]()
    graph.replay()
    torch.cuda.synchronize()
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    e0.record()
    for _ in range(reps):
        graph.replay()
    e1.record()
    torch.cuda.synchronize()
    return e0.elapsed_time(e1) * 1e3 / reps / per_graph


def check(impls, h, p, n, g, form="mamba2") -> bool:
    from autossd.ops.ssd.naive import state_update_ref
    from autossd.testing import rel_err, tolerance
    ok = True
    for sd in ("fp32", "bf16", "fp16"):
        for batch in (1, 16):
            common, (st,) = (make_mamba1(batch, p, n, sd, 1, seed=7) if form == "mamba1"
                             else make(batch, h, p, n, g, sd, 1, seed=7))
            dt = st.get("dt", common.get("dt"))
            for label, idx in (("", None), (" +slots", "perm")):
                cache, idx_t = st["state"], None
                if idx == "perm":   # a permutation of cache slots with the last row padded out
                    cache = torch.randn(batch + 3, *st["state"].shape[1:], device="cuda").to(DT[sd])
                    idx_t = torch.randperm(batch + 3, device="cuda")[:batch].to(torch.int32)
                    idx_t[-1] = -1
                ref_y, ref_s = state_update_ref(cache, st["x"], dt, common["A"], st["B"], st["C"],
                                                common["D"], st["z"], common["dt_bias"], True, idx_t)
                for name, fn in impls.items():
                    s = cache.clone()
                    kw = {} if idx_t is None else {"state_batch_indices": idx_t, "pad_slot_id": -1}
                    if idx_t is not None and name != "autossd":
                        continue
                    y = fn(s, st["x"], dt, common["A"], st["B"], st["C"], D=common["D"], z=st["z"],
                           dt_bias=common["dt_bias"], dt_softplus=True, **kw)
                    e_y, e_s = rel_err(y, ref_y), rel_err(s, ref_s)
                    tol = tolerance("bf16", sd)
                    good = e_y < tol and e_s < max(tolerance(sd), 1e-4)
                    ok &= good or name != "autossd"
                    print(f"check {name:9s} state {sd} batch {batch:3d}{label:7s} out rel {e_y:.2e} "
                          f"state rel {e_s:.2e} (tol {tol:.1e}) {'ok' if good else 'FAIL'}")
    return ok


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--state", nargs="+", default=["fp32", "bf16", "fp16"], choices=list(DT))
    ap.add_argument("--nheads", type=int, default=80)
    ap.add_argument("--headdim", type=int, default=64)
    ap.add_argument("--dstate", type=int, default=None, help="default 128 (mamba2), 16 (mamba1)")
    ap.add_argument("--ngroups", type=int, default=1)
    ap.add_argument("--form", choices=("mamba2", "mamba1"), default="mamba2",
                    help="mamba1: Mamba-1's call, state (batch, --dim, --dstate), a dense A")
    ap.add_argument("--dim", type=int, default=5120, help="--form mamba1: the channels (d_inner)")
    ap.add_argument("--check", action="store_true", help="compare with the float64 reference first")
    ap.add_argument("--json", help="write the rows here")
    a = ap.parse_args()
    import autossd
    impls = {"autossd": autossd.selective_state_update}
    from autossd.peer import load_mamba_ssm   # its Triton path, without the package's CUDA extensions
    ms = load_mamba_ssm("selective_state_update", "selective_state_update")
    if ms is not None:
        impls["mamba_ssm"] = ms
    else:
        print("mamba_ssm not importable: timing autossd alone")
    h, p, n, g = a.nheads, a.headdim, a.dstate or 128, a.ngroups
    if a.form == "mamba1":   # one head of headdim = dim
        h, p, n, g = 1, a.dim, a.dstate or 16, 1
    print(f"{torch.cuda.get_device_name()}  form {a.form} h={h} p={p} n={n} g={g}  torch {torch.__version__}")
    if a.check and not check(impls, h, p, n, g, a.form):
        raise SystemExit("autossd failed the float64 check")
    bw = copy_gbps()
    print(f"device-to-device copy: {bw:.0f} GB/s")
    rows = []
    print(f"{'batch':>5} {'state':>5} {'impl':>9} {'eager_us':>9} {'graph_us':>9} {'GB/s':>7} {'%copy':>6}")
    for batch in a.batch:
        for sd in a.state:
            per_set = nbytes(batch, h, p, n, g, sd, a.form)
            nsets = max(2, math.ceil(L2_BYTES * 2 / per_set))
            common, sets = (make_mamba1(batch, p, n, sd, nsets) if a.form == "mamba1"
                            else make(batch, h, p, n, g, sd, nsets))
            # what a device copy of the same bytes (half read, half written, sets rotating the same
            # way) reaches at this size: the launch's ramp and tail weigh on a 10-40 us kernel
            # as they do on any, so the 1 GB copy rate is a bar no kernel of this size meets
            bufs = [(torch.empty(per_set // 2, dtype=torch.uint8, device="cuda"),
                     torch.empty(per_set // 2, dtype=torch.uint8, device="cuda")) for _ in range(nsets)]
            copies = {"copy": [(lambda s_, d_: (lambda: d_.copy_(s_)))(s_, d_) for s_, d_ in bufs],
                      # torch's own in-place elementwise kernel over the state alone (read and
                      # written at the same addresses in its dtype, as the step does): what a
                      # kernel with nothing else to do reaches on this traffic
                      "in-place": [(lambda s_: (lambda: s_.mul_(-1.0)))(st["state"]) for st in sets]}
            for name, fn in [*impls.items(), *copies.items()]:
                calls = fn if name in copies else [call_of(fn, common, st) for st in sets]
                e = eager_us(calls)
                gu = graph_us(calls)
                moved = 2 * sets[0]["state"].nbytes if name == "in-place" else per_set
                gbps = moved / (gu * 1e-6) / 1e9
                row = dict(form=a.form, dims=[h, p, n, g], batch=batch, state=sd, impl=name, eager_us=e, graph_us=gu, gbps=gbps,
                           pct_copy=100 * gbps / bw, copy_gbps=bw, device=torch.cuda.get_device_name())
                rows.append(row)
                print(f"{batch:5d} {sd:>5} {name:>9} {e:9.2f} {gu:9.2f} {gbps:7.0f} {row['pct_copy']:5.1f}%")
            del sets, bufs, copies
            torch.cuda.empty_cache()
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
