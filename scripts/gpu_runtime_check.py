#!/usr/bin/env python
"""Runtime checks of the drop-in on a GPU (the lead runs this on the H100):

  1. CUDA graph: autossd.mamba_chunk_scan_combined captured in a CUDA graph and replayed on new
     inputs gives the result of the graph-timed pick run eagerly (bitwise, the same kernels run;
     a captured call asks the lookup for the graph record, which may differ from the eager one).
  2. torch.compile: a layer calling the drop-in traces to one graph with no graph break
     (torch._dynamo.explain), and torch.compile(fullgraph=True) matches eager; with
     mode="reduce-overhead" (CUDA graphs) its replays match the graph-timed pick run eagerly.
  3. torch.compile(mode="reduce-overhead") in a fresh process, as a user's model meets it: the
     drop-in's first call ever made inside the compiled module's warm-up (nothing eager before),
     Mamba-2's call (bf16, D, dt_bias, softplus) with an op after it, several calls; the forward
     must match the graph-timed pick run eagerly (bitwise), and a compiled training step's
     gradients must match eager autograd's.
  4. Overheads: warm get_kernel (target <= 5 us), the drop-in's host time per call, eager vs
     graph-replay time per call.
  Plus the float64 reference error of each case, and which config the lookup chose and why.

Needs only torch, triton, jinja2, numpy, sqlalchemy, alembic, platformdirs (no mamba_ssm).

    python scripts/gpu_runtime_check.py --out scratch/runtime_check.json
    TRITON_INTERPRET=1 python scripts/gpu_runtime_check.py --cpu --out /tmp/x.json   # dry run
"""
from __future__ import annotations

import argparse
import json
import platform
import sys
import time
import timeit
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

import autossd  # noqa: E402
from autossd import runtime  # noqa: E402
from autossd.ops.ssd.naive import ssd_chunked  # noqa: E402
from autossd.problem import Problem, from_args  # noqa: E402
from autossd.testing import call_kwargs, make_inputs, rel_err, tolerance  # noqa: E402

LAYER = dict(has_D=True, has_dt_bias=True, dt_softplus=True)  # mamba_ssm's Mamba2 layer call


def cases(dtype: str, cpu: bool) -> dict[str, Problem]:
    if cpu:  # tiny shapes for the interpreter
        return {"tiny-layer": Problem(1, 130, 2, 16, 16, 1, dtype, 64, **LAYER),
                "tiny-varlen": Problem(1, 150, 2, 16, 16, 1, dtype, 64, has_seq_idx=True,
                                       return_final_states=True, return_varlen_states=True)}
    return {
        "mamba2-2.7b 1x2048 layer": Problem(1, 2048, 80, 64, 128, 1, dtype, 256, **LAYER),
        # the shipped graph pick (chunk 128) differs from the eager one here (at small shapes eager calls favour fewer launches)
        "mamba2-130m 1x2048 layer": Problem(1, 2048, 24, 64, 128, 1, dtype, 256, **LAYER),
        "mamba2-2.7b 1x2048 +final": Problem(1, 2048, 80, 64, 128, 1, dtype, 256, **LAYER,
                                             return_final_states=True),
        "mamba2-130m 4x4096 z,init,D(h,p)": Problem(4, 4096, 24, 64, 128, 1, dtype, 256, has_D=True,
                                                    D_has_hdim=True, has_z=True, has_dt_bias=True,
                                                    dt_softplus=True, has_initial_states=True,
                                                    return_final_states=True),
        "codestral 1x8192 varlen": Problem(1, 8192, 128, 64, 128, 8, dtype, 256, **LAYER,
                                           has_seq_idx=True, return_final_states=True,
                                           return_varlen_states=True),
    }


def _tensors(out) -> list[torch.Tensor]:
    return [out] if isinstance(out, torch.Tensor) else list(out)


def _same(a, b) -> dict:
    a, b = _tensors(a), _tensors(b)
    equal = len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))
    diff = max(float((x.float() - y.float()).abs().max()) for x, y in zip(a, b)) if len(a) == len(b) else float("inf")
    return {"bitwise_equal": equal, "max_abs_diff": diff}


def _split(p: Problem, t: dict):
    return tuple(t[k] for k in ("x", "dt", "A", "B", "C")), call_kwargs(p, t)


def _time_ms(fn, iters: int, sync) -> float:
    for _ in range(3):
        fn()
    sync()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    sync()
    return (time.perf_counter() - t0) / iters * 1e3


def check_case(name: str, p: Problem, device: str, iters: int) -> dict:
    res: dict = {"case": name, "problem": p.key()}
    kernel = autossd.get_kernel(p, runtime.arch_of_device(torch.device(device)))
    res["choice"] = {"source": kernel.source, "provenance": kernel.provenance, "distance": kernel.distance,
                     "stale": kernel.stale, "reason": kernel.reason, "config": kernel.config.as_dict()}
    t = make_inputs(p, device=device, seed=0)
    args, kw = _split(p, t)
    q = p.chunk_size
    f = lambda: autossd.mamba_chunk_scan_combined(*args, q, **kw)  # noqa: E731
    eager = f()

    # float64 reference
    ref = ssd_chunked(*args, chunk_size=q, **{k: v for k, v in kw.items() if not k.startswith("return_")})
    outs = _tensors(eager)
    refs = [ref[0]] + ([ref[1]] if p.return_final_states else []) + ([ref[2]] if p.return_varlen_states else [])
    errs = [rel_err(o, r) for o, r in zip(outs, refs)]
    res["reference"] = {"rel_err": errs, "tol": tolerance(p.dtype), "ok": all(e < tolerance(p.dtype) for e in errs)}
    del ref, refs

    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)

    # 1. CUDA graph capture and replay on new inputs
    if device == "cuda":
        try:
            s = torch.cuda.Stream()
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                for _ in range(3):
                    f()
            torch.cuda.current_stream().wait_stream(s)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                captured = f()
            fresh = make_inputs(p, device=device, seed=1)
            for k in t:  # new data into the captured input buffers
                if t[k] is not None and t[k].is_floating_point():
                    t[k].copy_(fresh[k])
            g.replay()
            sync()
            # a captured call runs the graph-timed pick, which may be another config than the
            # eager call's: compare with that pick run eagerly on the same inputs
            kg = autossd.get_kernel(p, runtime.arch_of_device(torch.device(device)), launch_mode="graph")
            eager_new = kg(*args, **kw)
            res["cuda_graph"] = {**_same(captured, eager_new), "ok": _same(captured, eager_new)["bitwise_equal"],
                                 "graph_pick": kg.config.as_dict(), "graph_reason": kg.reason}
            res["timing_ms"] = {"eager": _time_ms(f, iters, sync), "graph_replay": _time_ms(g.replay, iters, sync)}
        except Exception as e:  # report, go on with the other checks
            res["cuda_graph"] = {"ok": False, "error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()}
    else:
        res["timing_ms"] = {"eager": _time_ms(f, 2, sync)}

    # 2. torch.compile: no graph break, same result
    def layer(x, dt, A, B, C):
        out = autossd.mamba_chunk_scan_combined(x, dt, A, B, C, q, **kw)
        y = out if isinstance(out, torch.Tensor) else out[0]
        return (y * 2,) + tuple(_tensors(out)[1:])
    try:
        torch._dynamo.reset()
        ex = torch._dynamo.explain(layer)(*args)
        res["dynamo"] = {"graph_count": ex.graph_count, "graph_break_count": ex.graph_break_count,
                         "break_reasons": [str(r.reason) for r in ex.break_reasons]}
        torch._dynamo.reset()
        backend = "inductor" if device == "cuda" else "aot_eager"
        compiled = torch.compile(layer, fullgraph=True, backend=backend)
        got, want = compiled(*args), layer(*args)
        res["compile"] = {"backend": backend, **_same(got, want),
                          "ok": ex.graph_break_count == 0 and _same(got, want)["bitwise_equal"]}
    except Exception as e:
        res["compile"] = {"ok": False, "error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()}

    # 3. torch.compile "reduce-overhead" (CUDA graphs): its recording run captures the drop-in, so
    # the replays run the graph-timed pick, first launched inside that capture
    if device == "cuda":
        try:
            torch._dynamo.reset()
            kg = autossd.get_kernel(p, runtime.arch_of_device(torch.device(device)), launch_mode="graph")
            ro = torch.compile(layer, fullgraph=True, mode="reduce-overhead")
            for _ in range(3):   # warm-up (eager), recording (capture), replay
                got = tuple(o.clone() for o in ro(*args))
            out = kg(*args, **kw)
            want = (_tensors(out)[0] * 2,) + tuple(_tensors(out)[1:])
            res["reduce_overhead"] = {**_same(got, want), "ok": _same(got, want)["bitwise_equal"]}
        except Exception as e:  # noqa: BLE001 - report, go on
            res["reduce_overhead"] = {"ok": False, "error": f"{type(e).__name__}: {e}",
                                      "trace": traceback.format_exc()}
    return res


def fresh_reduce_overhead(dtype: str) -> dict:
    """Check 3, run in this (fresh) process: the first autossd call of the process happens
    inside torch.compile's CUDA graph trees (their warm-up allocates in the graph's pool)."""
    p = Problem(2, 4096, 80, 64, 128, 1, dtype, 256, **LAYER)
    t = make_inputs(p, device="cuda", seed=0)
    args, kw = _split(p, t)

    class M(torch.nn.Module):
        def forward(self, x, dt, A, B, C):
            return autossd.mamba_chunk_scan_combined(x, dt, A, B, C, 256, **kw) * 2

    res: dict = {"problem": p.key()}
    try:
        f = torch.compile(M(), fullgraph=True, mode="reduce-overhead")
        for _ in range(4):   # warm-up (eager, in the pool), recording (capture), replays
            got = f(*args).clone()
        torch.cuda.synchronize()
        kg = autossd.get_kernel(p, runtime.arch_of_device(torch.device("cuda")), launch_mode="graph")
        want = kg(*args, **kw) * 2
        res["forward"] = {**_same(got, want), "ok": _same(got, want)["bitwise_equal"]}
    except Exception as e:  # noqa: BLE001 - report, go on
        res["forward"] = {"ok": False, "error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()}
    # a training step under reduce-overhead: the backward's graph too
    names = ("x", "dt", "A", "B", "C", "D", "dt_bias")
    leaves = {k: t[k].detach().clone().requires_grad_(True) for k in names}

    def step(x, dt, A, B, C, D, dt_bias):
        y = autossd.mamba_chunk_scan_combined(x, dt, A, B, C, 256, D=D, dt_bias=dt_bias, dt_softplus=True)
        return (y.float() ** 2).mean()

    try:
        torch._dynamo.reset()
        fs = torch.compile(step, fullgraph=True, mode="reduce-overhead")
        for _ in range(4):
            for v in leaves.values():
                v.grad = None
            loss = fs(*leaves.values())
            loss.backward()
        got = {k: v.grad.clone() for k, v in leaves.items()}
        eager = {k: t[k].detach().clone().requires_grad_(True) for k in names}
        step(*eager.values()).backward()
        errs = {k: rel_err(got[k], eager[k].grad) for k in names}
        finite = all(bool(torch.isfinite(g).all()) for g in got.values())
        res["backward"] = {"rel_err_vs_eager": errs, "finite": finite,
                           "ok": finite and max(errs.values()) <= 10 * tolerance(dtype)}
    except Exception as e:  # noqa: BLE001 - report
        res["backward"] = {"ok": False, "error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()}
    res["ok"] = res["forward"]["ok"] and res["backward"]["ok"]
    return res


def overheads(p: Problem, device: str, n: int) -> dict:
    arch = runtime.arch_of_device(torch.device(device))
    autossd.get_kernel(p, arch)
    warm = min(timeit.repeat(lambda: autossd.get_kernel(p, arch), number=n, repeat=5)) / n
    t = make_inputs(p, device=device, seed=0)
    args, kw = _split(p, t)
    validate = min(timeit.repeat(lambda: from_args(*args, p.chunk_size, **kw), number=n // 100, repeat=5)) / (n // 100)
    return {"warm_get_kernel_us": warm * 1e6, "from_args_us": validate * 1e6, "target_us": 5.0,
            "ok": warm <= 5e-6}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True, help="JSON results")
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp16", "fp32"])
    ap.add_argument("--iters", type=int, default=100, help="timed calls per case")
    ap.add_argument("--cpu", action="store_true", help="dry run on CPU (TRITON_INTERPRET=1), no CUDA graph")
    ap.add_argument("--fresh-child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.fresh_child:   # check 3 in a process of its own; prints its JSON
        print("FRESH " + json.dumps(fresh_reduce_overhead(args.dtype), default=str))
        return 0
    device = "cpu" if args.cpu else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device; use --cpu for a dry run", file=sys.stderr)
        return 2
    import triton
    report = {"device": torch.cuda.get_device_name() if device == "cuda" else platform.processor() or "cpu",
              "arch": runtime.arch_of_device(torch.device(device)), "torch": torch.__version__,
              "triton": triton.__version__, "autossd": autossd.__version__, "dtype": args.dtype,
              "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "cases": []}
    for name, p in cases(args.dtype, args.cpu).items():
        t0 = time.time()
        r = check_case(name, p, device, args.iters)
        r["wall_s"] = time.time() - t0
        report["cases"].append(r)
        g, c, ref = r.get("cuda_graph", {}), r.get("compile", {}), r["reference"]
        print(f"{name:34s} choice={r['choice']['source']}/{r['choice']['provenance']}"
              f"  ref={'ok' if ref['ok'] else 'FAIL'} ({max(ref['rel_err']):.1e})"
              f"  graph={'ok' if g.get('ok') else ('n/a' if not g else 'FAIL')}"
              f"  compile={'ok' if c.get('ok') else 'FAIL'} breaks={r.get('dynamo', {}).get('graph_break_count')}"
              f"  reduce-overhead={'ok' if r.get('reduce_overhead', {}).get('ok') else ('n/a' if 'reduce_overhead' not in r else 'FAIL')}"
              f"  eager={r['timing_ms'].get('eager', float('nan')):.3f} ms"
              f"  replay={r['timing_ms'].get('graph_replay', float('nan')):.3f} ms")
        for key in ("cuda_graph", "compile", "reduce_overhead"):
            if r.get(key, {}).get("error"):
                print(f"    {key}: {r[key]['error']}")
    if device == "cuda":
        import subprocess
        run = subprocess.run([sys.executable, __file__, "--fresh-child", "--dtype", args.dtype, "--out", "-"],
                             capture_output=True, text=True)
        line = [ln for ln in run.stdout.splitlines() if ln.startswith("FRESH ")]
        fresh = json.loads(line[-1][6:]) if line else {"ok": False, "error": run.stderr[-4000:]}
        report["fresh_reduce_overhead"] = fresh
        print(f"fresh process, reduce-overhead: forward={'ok' if fresh.get('forward', {}).get('ok') else 'FAIL'}"
              f"  training step={'ok' if fresh.get('backward', {}).get('ok') else 'FAIL'}")
        for key in ("forward", "backward"):
            if fresh.get(key, {}).get("error"):
                print(f"    {key}: {fresh[key]['error']}")
        if fresh.get("error"):
            print(f"    {fresh['error']}")
    first = next(iter(cases(args.dtype, args.cpu).values()))
    report["overheads"] = overheads(first, device, 200_000 if device == "cuda" else 20_000)
    o = report["overheads"]
    print(f"warm get_kernel {o['warm_get_kernel_us']:.3f} us (target <= 5 us); from_args {o['from_args_us']:.1f} us")
    ok = all(r["reference"]["ok"] and r.get("compile", {}).get("ok") and r.get("cuda_graph", {"ok": True})["ok"]
             and r.get("reduce_overhead", {"ok": True})["ok"] for r in report["cases"]) and o["ok"] \
        and report.get("fresh_reduce_overhead", {"ok": True})["ok"]
    report["ok"] = bool(ok)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2, default=str))
    print(f"{'ALL OK' if ok else 'SOME CHECKS FAILED'}; wrote {args.out}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
