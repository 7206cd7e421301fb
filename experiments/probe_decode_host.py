"""Host time of one eager decode step per state dtype and batch: which config and lookup tier
serve the call, whether its launch record replays, the eager time per call in interleaved rounds,
and a cProfile of the slowest case (where an eager call's host time goes).

    python experiments/probe_decode_host.py [--batch 1 16] [--out FILE.json]

With --parts, also the host time of a replayed call's parts at batch 1 (bf16 state): the kept-key
check, the output's allocation, the current device and stream, the launch alone.
"""
from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "scripts"))
import autossd  # noqa: E402
from autossd.ops.ssd import decode  # noqa: E402
from bench_decode import call_of, make  # noqa: E402


def per_call_us(call, reps=500) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        call()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / reps * 1e6


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--out")
    ap.add_argument("--parts", action="store_true")
    a = ap.parse_args()
    cases = {}
    for batch in a.batch:
        for sd in ("fp32", "bf16", "fp16"):
            common, sets = make(batch, 80, 64, 128, 1, sd, 2)
            call = call_of(autossd.selective_state_update, common, sets[0])
            decode.clear_cache()
            call()
            c = list(decode._calls.values())[-1]
            cases[(batch, sd)] = (call, c)
            print(f"b={batch} {sd}: record {'replays' if c.record is not None else 'NONE'}; {c.why}; {c.config!r}")
    rows = {f"{b} {sd}": [] for b, sd in cases}
    for _ in range(3):   # interleaved rounds: a slow stretch of the host hits every case alike
        for (b, sd), (call, _) in cases.items():
            rows[f"{b} {sd}"].append(per_call_us(call))
    for k, v in rows.items():
        print(f"{k}: eager {min(v):.1f} us (rounds {', '.join(f'{x:.1f}' for x in v)})")
    worst = max(rows, key=lambda k: min(rows[k]))
    b, sd = worst.split()
    call = cases[(int(b), sd)][0]
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(300):
        call()
    prof.disable()
    s = io.StringIO()
    pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(14)
    print(f"profile of {worst}:\n" + s.getvalue()[-3500:])
    parts = host_parts() if a.parts else {}
    for k, v in parts.items():
        print(f"part {k}: {v:.2f} us")
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "eager_us": rows, "parts_us": parts}, f, indent=1)


def host_parts(reps: int = 20000) -> dict:
    from autossd.ops.common import launch_cache as lc
    common, sets = make(1, 80, 64, 128, 1, "bf16", 1)
    st = sets[0]
    args = (st["state"], st["x"], common["dt"], common["A"], st["B"], st["C"], common["D"], st["z"],
            common["dt_bias"], None, st["out"])
    call = call_of(autossd.selective_state_update, common, st)
    decode.clear_cache()
    call()
    call()
    extra = (True, -1, None)
    found = decode._recent.find(args, extra)
    t = dict(zip(decode.NAMES, args))
    out = {}

    def clock(name, f):
        for _ in range(100):
            f()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(reps):
            f()
        torch.cuda.synchronize()
        out[name] = (time.perf_counter() - t0) / reps * 1e6

    clock("whole call", call)
    if found is not None:
        c, names, ptrs = found
        clock("kept-key check (RecentCalls.find)", lambda: decode._recent.find(args, extra))
        clock("replay_ptrs (device, stream, launch)", lambda: lc.replay_ptrs(c.record, names, ptrs, c.device.index))
        d = lc._driver.active
        dev = d.get_current_device()
        stream = d.get_current_stream(dev)
        e = c.record[0]
        clock("launch alone (DirectLaunch.with_ptrs)", lambda: e[5].with_ptrs(e[1], stream, e[5].positions(names), ptrs))
        clock("current device and stream", lambda: d.get_current_stream(d.get_current_device()))
    clock("full key (input_sig) and its lookup", lambda: decode._calls.get((lc.input_sig(t, decode.NAMES), True, -1, None)))
    x = st["x"]
    clock("torch.empty_like(x)", lambda: torch.empty_like(x))
    clock("torch.empty(x.shape, dtype, device)", lambda: torch.empty(x.shape, dtype=x.dtype, device=x.device))
    return out


if __name__ == "__main__":
    main()
