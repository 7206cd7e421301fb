"""Host time per call of the drop-in, phase by phase, on the local GPU (where the small-shape
time goes), and `--once` for running one forward under a profiler (ncu).

    python experiments/profile_host.py [--out DIR] [--shape 2.7b:1x2048] [--dtype bf16]
    ncu --set full --import-source yes -k regex:ssd_chunk_scan -c 1 -o REPORT \
        python experiments/profile_host.py --once --shape 2.7b:1x131072 --dtype fp16 [--config JSON [--on-pick]]

--once runs the drop-in (the database's pick), or with --config the sm90 default with those
overrides through ssd_forward (the pick with them, with --on-pick: e.g. a shipped record with
'{"scan_gluon": 2}', BENCHMARKS §139), and exits. Without --once, --config overrides knobs of the pick for
the phases from `allocate` on (e.g. '{"scan_gluon": 1}': the host cost of its TMA descriptors).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import autossd  # noqa: E402
from autossd import runtime  # noqa: E402
from autossd.ops.ssd import chunk as ssd_chunk  # noqa: E402
from autossd.ops.ssd import workspace as ssd_workspace  # noqa: E402
from autossd.problem import Problem, from_args  # noqa: E402
from autossd.ops.ssd.fwd_knobs import default_config, fit  # noqa: E402
from autossd.testing import make_inputs  # noqa: E402

MODELS = {"130m": (24, 64, 128, 1), "2.7b": (80, 64, 128, 1), "codestral": (128, 64, 128, 8)}


def per_call_us(fn, n=300):
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    host = (time.perf_counter() - t0) / n * 1e6
    torch.cuda.synchronize()
    return host


def compare(args, kw, cfg, out_dir):
    """The same kernels through the drop-in and through ssd_forward, alternating, three rounds."""
    from triton.testing import do_bench
    calls = {"drop_in": lambda: autossd.mamba_chunk_scan_combined(*args, **kw),
             "ssd_forward": lambda: ssd_chunk.ssd_forward(*args, **kw, config=cfg)}
    res = {k: {"do_bench_ms": [], "graph_ms": []} for k in calls}
    for _ in range(3):
        for name, fn in calls.items():
            res[name]["do_bench_ms"].append(do_bench(fn, warmup=10, rep=100, return_mode="median"))
            g = torch.cuda.CUDAGraph()
            fn()
            with torch.cuda.graph(g):
                fn()
            res[name]["graph_ms"].append(do_bench(g.replay, warmup=5, rep=50, return_mode="median"))
    for name, r in res.items():
        print(f"{name:12s} do_bench {[round(v, 3) for v in r['do_bench_ms']]}  graph {[round(v, 3) for v in r['graph_ms']]}")
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "compare_dropin.json"), "w") as f:
        json.dump({"config": cfg.as_dict(), **res}, f, indent=1)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "scratch", "profile_host"),
                    help="output folder (default: scratch/profile_host, git-ignored)")
    ap.add_argument("--shape", default="2.7b:1x2048")
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--once", action="store_true")
    ap.add_argument("--config", default=None, help="JSON overrides: with --once of the sm90 default, "
                    "else of the drop-in's pick for the phases from `allocate` on")
    ap.add_argument("--on-pick", action="store_true", help="with --once --config: override the pick, "
                    "not the sm90 default")
    ap.add_argument("--cprofile", action="store_true",
                    help="cProfile 300 warm eager drop-in calls; print and write the top functions")
    ap.add_argument("--compare", action="store_true",
                    help="GPU time of the drop-in vs ssd_forward with the same config, interleaved "
                         "(do_bench and graph replay)")
    a = ap.parse_args()
    model, bl = a.shape.split(":")
    b, l = (int(v) for v in bl.split("x"))
    h, p, n, g = MODELS[model]
    prob = Problem(batch=b, seqlen=l, nheads=h, headdim=p, dstate=n, ngroups=g, dtype=a.dtype,
                   chunk_size=256, has_D=True, has_dt_bias=True, dt_softplus=True)
    t = make_inputs(prob, "cuda", seed=1)
    args = (t["x"], t["dt"], t["A"], t["B"], t["C"], 256)
    kw = dict(D=t["D"], dt_bias=t["dt_bias"], dt_softplus=True)
    if a.once:
        if a.config is None:
            autossd.mamba_chunk_scan_combined(*args, **kw)
        else:
            base = runtime.get_kernel(prob).config if a.on_pick else default_config("sm90", prob)
            cfg = fit(base.replace(**json.loads(a.config)), prob)
            ssd_chunk.ssd_forward(*args, **kw, config=cfg)
        torch.cuda.synchronize()
        return
    if a.cprofile:
        import cProfile
        import io
        import pstats
        for _ in range(20):
            autossd.mamba_chunk_scan_combined(*args, **kw)
        torch.cuda.synchronize()
        pr = cProfile.Profile()
        pr.enable()
        for _ in range(300):
            autossd.mamba_chunk_scan_combined(*args, **kw)
        pr.disable()
        torch.cuda.synchronize()
        out = io.StringIO()
        pstats.Stats(pr, stream=out).sort_stats("tottime").print_stats(30)
        print(out.getvalue())
        os.makedirs(a.out, exist_ok=True)
        with open(os.path.join(a.out, "cprofile_drop_in.txt"), "w") as f:
            f.write(out.getvalue())
        return
    prob = from_args(*args, **kw)
    kern = autossd.get_kernel(prob, runtime.arch_of_device(t["x"].device))
    if a.compare:
        compare(args, kw, kern.config, a.out)
        return
    cfg = kern.config
    mod = kern.module()
    if a.config is not None:   # the phases below (from `allocate` on) on the pick with these overrides
        from autossd.render import load
        cfg = fit(cfg.replace(**json.loads(a.config)), prob)
        mod = load(cfg)
    tensors = {k: t.get(k) for k in ("x", "dt", "A", "B", "C", "D", "z", "dt_bias", "initial_states", "seq_idx")}
    buf = ssd_chunk.allocate(prob, cfg, "cuda")
    launches = ssd_chunk.plan(prob, cfg, tensors, buf)

    def launch_all():
        ssd_chunk.run(launches, mod)
    res = {
        "drop_in": per_call_us(lambda: autossd.mamba_chunk_scan_combined(*args, **kw)),
        "custom_op_body (no dispatcher)": per_call_us(lambda: runtime._ssd_fwd_eager(
            *args, kw["D"], None, kw["dt_bias"], None, None, None, True, 0.0, float("inf"), False, False, None)),
        "from_args": per_call_us(lambda: from_args(*args, **kw)),
        "arch_of_device": per_call_us(lambda: runtime.arch_of_device(t["x"].device)),
        "get_kernel": per_call_us(lambda: autossd.get_kernel(prob, "sm90")),
        "allocate": per_call_us(lambda: ssd_chunk.allocate(prob, cfg, "cuda")),
        "plan": per_call_us(lambda: ssd_chunk.plan(prob, cfg, tensors, buf)),
        f"{len(launches)} launch(es) via triton's JIT": per_call_us(launch_all),
        "execute (launch cache)": per_call_us(lambda: ssd_chunk.execute(prob, cfg, tensors, module=mod, keep=True)),
    }
    # the launch cache's replay alone, and inside it the launcher calls alone (arguments prebuilt)
    key = next((k for k in ssd_chunk._launch_cache if k[0] == prob and k[1] == cfg), None)
    if key is not None:
        cached = ssd_chunk._launch_cache[key]
        stream = torch.cuda.current_stream().cuda_stream
        # 50 calls: few enough launches that the queue never fills and blocks the host
        res[f"replay of {len(cached)} launch(es)"] = per_call_us(lambda: ssd_chunk._replay(cached, tensors, buf, stream), n=50)
        # the two comparisons with prebuilt arguments pass pointers: not for TMA descriptors
        plain = [] if any(d is not None for entry in cached for *_, d in entry[4]) else cached
        pre = [(ck, grid, [tensors[k].data_ptr() if kind == "in" else getattr(buf, k).data_ptr() if kind == "buf" else k
                           for kind, k in srcs]) for ck, grid, srcs, *_ in plain]

        def launcher_only():
            for ck, grid, args_ in pre:
                ck.run(grid[0], grid[1], grid[2], stream, ck.function, ck.packed_metadata, None, None, None, *args_)
        if plain:   # (with a TMA descriptor among the launches there is nothing to compare: skip)
            res["launcher calls alone (arguments prebuilt)"] = per_call_us(launcher_only, n=50)
            res["arguments per launch"] = float(sum(len(a) for _, _, a in pre) / len(pre))

        def replay_per_argument():   # the replay before argument templates (§53): every argument's source looked at
            for ck, grid, srcs, *_ in plain:
                ck.run(grid[0], grid[1], grid[2], stream, ck.function, ck.packed_metadata, None, None, None,
                       *[tensors[k].data_ptr() if kind == "in" else getattr(buf, k).data_ptr() if kind == "buf"
                         else k for kind, k in srcs])
        # the replay as it runs (_DirectLaunch: the launcher's entry point, each TMA descriptor
        # encoded once per address) vs every launch through triton's launcher (which encodes the
        # descriptors at every launch). Before §98 only descriptor kernels went direct; the key
        # keeps §94's name
        through_triton = [(*entry[:5], None) for entry in cached]
        rounds = {"templates": [], "per-argument": [], "templates, TMA encoded per launch": []}
        if not plain:
            del rounds["per-argument"]
        for _ in range(5):
            rounds["templates"].append(per_call_us(lambda: ssd_chunk._replay(cached, tensors, buf, stream), n=50))
            if plain:
                rounds["per-argument"].append(per_call_us(replay_per_argument, n=50))
            rounds["templates, TMA encoded per launch"].append(
                per_call_us(lambda: ssd_chunk._replay(through_triton, tensors, buf, stream), n=50))
        for k, v in rounds.items():
            res[f"replay, {k} (median of 5 interleaved)"] = sorted(v)[2]
    # the kept workspace (chunk.WORKSPACE_BYTES) against fresh allocations, interleaved rounds
    ab = {"drop_in": [], "drop_in, no workspace": [], "execute": [], "execute, no workspace": []}
    saved = ssd_workspace.WORKSPACE_BYTES
    for _ in range(3):
        for off in (False, True):
            ssd_workspace.WORKSPACE_BYTES = 0 if off else saved
            ssd_chunk.clear_workspaces()
            tag = ", no workspace" if off else ""
            ab["drop_in" + tag].append(per_call_us(lambda: autossd.mamba_chunk_scan_combined(*args, **kw)))
            ab["execute" + tag].append(per_call_us(lambda: ssd_chunk.execute(prob, cfg, tensors, module=mod, keep=True)))
    ssd_workspace.WORKSPACE_BYTES = saved
    for k, v in ab.items():
        res[f"{k} (median of 3 interleaved)"] = sorted(v)[1]
    res["workspace_rounds"] = ab
    g_ = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g_):
        launch_all()
    st, en = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    g_.replay()
    st.record()
    for _ in range(100):
        g_.replay()
    en.record()
    torch.cuda.synchronize()
    res["gpu_time_graph_replay"] = st.elapsed_time(en) / 100 * 1e3
    print(f"config: {cfg!r} ({kern.reason})")
    for k, v in res.items():
        if isinstance(v, float):
            print(f"{k:44s} {v:8.1f} us", flush=True)
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "profile_host.json"), "w") as f:
        json.dump({"date": time.strftime("%Y-%m-%d %H:%M:%S"), "device": torch.cuda.get_device_name(),
                   "shape": a.shape, "dtype": a.dtype, "config": cfg.as_dict(), "reason": kern.reason,
                   "host_us": res}, f, indent=1)


if __name__ == "__main__":
    main()
