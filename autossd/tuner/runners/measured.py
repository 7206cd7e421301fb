"""Measured mode: the arch is the local GPU.

1. Candidates compile in parallel in a process pool (`CompilePool`, compile_config for the local
   arch): a resource-limit verdict rejects them there (spills are reported, not refused: the
   measurement judges them), and the compile warms Triton's on-disk cache for the launch.
2. Each candidate is then checked and timed, one at a time, in an evaluation subprocess
   (`EvalWorker`) that keeps the inputs and the float64 reference between candidates. The gate
   (`autossd.tuner.gate`) runs first; a wrong candidate is failed and never timed. Each right
   candidate is then timed both ways, each as the median of ROUNDS interleaved rounds of
   medians of CUDA-event timings (the GPU's speed drifts for seconds at a time); when one input set fits
   in L2, calls rotate over several sets so the timed kernels do not read warm L2:
   - eager: batches of back-to-back calls (host launch cost included, as an eager caller pays
     it; no cache flush between calls for the host's work to hide behind);
   - graph: the replay of a CUDA graph of the same calls (GPU time alone, as a captured forward
     pays it; triton.testing.do_bench of the replay).
   At a small shape the two can rank configs differently (eager favours fewer launches). The study
   minimizes `objective` ("graph" by default) and the tuner stores each mode's best.
3. A candidate that hangs (no answer within `timeout`) or kills its process (fault, abort) is
   recorded as failed; the worker is killed and a fresh one started; the run goes on. After a
   CUDA error the worker exits by itself, since the context is unusable.

On a machine without a GPU the same code runs under TRITON_INTERPRET=1 with device "cpu" and
wall-clock timing (used by the tests of the isolation machinery).
"""
from __future__ import annotations

import atexit
import contextlib
import multiprocessing as mp
import os
import time
from typing import Any

from ...problem import Problem
from ...knobs import BaseConfig as Config
from ...ops.registry import get_op, op_of
from .base import Outcome, report_from, shared_pool

READY_TIMEOUT = 600.0   # s: inputs and the float64 reference of a large problem
OBJECTIVES = ("graph", "eager")


def _cuda_alive() -> bool:
    import torch
    try:
        torch.cuda.synchronize()
        return True
    except Exception:  # noqa: BLE001 - any error here means the context is gone
        return False


def _copy(t: dict) -> dict:
    """Another input set like `t`: each tensor copied with its strides, except those expanded over
    a dimension (stride 0: the forms Mamba-2 passes dt, A, D and dt_bias in), which are shared. A
    clone of an expanded tensor is a dense one, which an entry may refuse (the decode step takes
    A only in its per-head form), and no call can update an expanded tensor in place."""
    import torch

    def one(v):
        if not isinstance(v, torch.Tensor):
            return v
        if any(st == 0 and n > 1 for st, n in zip(v.stride(), v.shape)):
            return v
        return torch.empty_strided(v.shape, v.stride(), dtype=v.dtype, device=v.device).copy_(v)
    return {k: one(v) for k, v in t.items()}


def _input_sets(problem: Problem, device: str, max_sets: int, op: str) -> list[dict]:
    """The first set, plus copies enough to exceed twice the L2 when one set fits in it."""
    from ..gate import input_bytes, make_inputs
    first = make_inputs(problem, device, seed=0, op=op)
    if device != "cuda":
        return [first]
    import torch
    l2 = getattr(torch.cuda.get_device_properties(0), "L2_cache_size", 50 << 20)
    size = max(1, input_bytes(first))
    if size >= l2:
        return [first]
    n = min(max_sets, -(-2 * l2 // size))
    free, _ = torch.cuda.mem_get_info()
    n = max(1, min(n, int(free * 0.25 // size)))
    sets = [first]
    for _ in range(n - 1):
        sets.append(_copy(first))
    return sets


def _time_ms(fn, device: str, warmup_ms: int, rep_ms: int, n_sets: int = 1) -> float:
    if device == "cuda":
        from ...bench import back_to_back_ms
        return back_to_back_ms(fn, n_sets, warmup_ms, rep_ms)
    times = []
    fn()
    for _ in range(3):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return sorted(times)[len(times) // 2]


# Rounds of (eager, graph) timings per candidate, interleaved; each mode keeps its median. The
# H100 runs the same large forward up to 9% slower for seconds at a time (measured:
# eager and graph alike, three rounds of one config spanning 6.27-7.06 ms), so one round can
# rank a mode, or a config, by when it happened to run.
ROUNDS = 3


def timed_rounds(eager, graph, rounds: int) -> tuple[dict, str | None, dict]:
    """({"eager": median ms, "graph": median ms}, graph error or None, every round's ms).
    eager() -> ms; graph(eager_ms) -> ms, or None when the device captures no graphs. A graph
    failure (say, out of memory for its pool) ends the graph rounds; eager ones go on."""
    import statistics
    samples: dict[str, list[float]] = {"eager": [], "graph": []}
    error = None
    for _ in range(max(1, rounds)):
        samples["eager"].append(eager())
        if graph is not None and error is None:
            try:
                samples["graph"].append(graph(samples["eager"][-1]))
            except Exception as e:  # noqa: BLE001
                error = f"{type(e).__name__}: {e}"[:300]
    times = {m: statistics.median(v) for m, v in samples.items() if v}
    return times, error, {m: v for m, v in samples.items() if v}


GRAPH_MIN_MS = 1.0   # a captured graph repeats the call until one replay lasts about this long
GRAPH_MAX_CALLS = 64


def _graph_ms(fn, n_sets: int, eager_ms: float, warmup_ms: int, rep_ms: int) -> float:
    """ms per call by replaying a CUDA graph of k calls (k a multiple of the input sets, so
    the rotation over them is captured too)."""
    import torch
    import triton.testing
    per = max(1, min(GRAPH_MAX_CALLS // n_sets, -(-GRAPH_MIN_MS // (max(eager_ms, 1e-3) * n_sets))))
    calls = int(per) * n_sets
    torch.cuda.empty_cache()   # the graph's private pool must not sit beside the eager calls' cache
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    try:
        return float(triton.testing.do_bench(graph.replay, warmup=warmup_ms, rep=rep_ms,
                                             return_mode="median")) / calls
    finally:
        del graph
        torch.cuda.synchronize()


def graph_capture_error() -> str | None:
    """None when this device captures and replays a CUDA graph (HIP graph on ROCm); else why
    not. Some ROCm stacks cannot capture; the tuner then has no graph times at all."""
    try:
        import torch
        x = torch.zeros(1, device="cuda")
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            x.add_(1)
        graph.replay()
        torch.cuda.synchronize()
        if float(x) != 1.0:
            return f"a captured add replayed to {float(x)}, not 1.0"
        return None
    except Exception as e:  # noqa: BLE001 - any failure means no graph timing here
        return f"{type(e).__name__}: {e}"[:300]


_probed: dict[str, str | None] = {}


def probe_graph_capture() -> str | None:
    """graph_capture_error() of the local GPU, asked once per process of a spawned child (this
    process keeps no CUDA context: the evaluation workers own the GPU)."""
    if "cuda" not in _probed:
        ctx = mp.get_context("spawn")
        from ...lifeline import die_with_parent, initargs
        with ctx.Pool(1, initializer=die_with_parent, initargs=initargs()) as pool:
            try:
                _probed["cuda"] = pool.apply_async(graph_capture_error).get(READY_TIMEOUT)
            except mp.TimeoutError:
                _probed["cuda"] = "the capture probe did not answer"
    return _probed["cuda"]


def objective_on(objective: str, graph_error: str | None) -> tuple[str, str | None]:
    """The objective a study can minimize on a device, and why it differs from the one asked:
    a device that cannot capture graphs has eager times only."""
    if objective == "graph" and graph_error:
        return "eager", f"graph capture fails on this device ({graph_error}); minimizing eager time"
    return objective, None


def _problem_state(problem: dict, op: str, device: str):
    """(problem, input sets, float64 reference, the gate's input set) of one problem."""
    from ..gate import reference
    prob = get_op(op).problem_type(**problem)
    sets = _input_sets(prob, device, 8, op)
    ref = reference(prob, sets[0], op)
    # an op whose timed call updates its inputs in place (Op.tune_time) is gated on a copy that
    # no timing touches, so each candidate's gate sees the inputs the reference was computed from
    gate_set = _copy(sets[0]) if get_op(op).tune_time else sets[0]
    return prob, sets, ref, gate_set


def _forget_calls(device: str, collect: bool = True) -> None:
    """Drop what the calls made so far keep alive: the kept workspaces, the recorded launches
    (a TMA descriptor holds its tensor: the gate's inputs and buffers of every candidate, which
    piled up across the shapes a process serves) and the runtime's caches; then, on a switch,
    the memory itself."""
    from ...runtime import clear_cache
    clear_cache()
    if collect:
        import gc
        gc.collect()
        if device == "cuda":
            import torch
            torch.cuda.empty_cache()


def worker_main(conn, problem: dict, opts: dict) -> None:
    """The evaluation subprocess: build a problem's inputs + reference, then judge configs on
    request; {"problem": key} switches it to another problem (the shapes of a tune share one
    process: a fresh one per shape spent 7-10 s starting on an H200, more than its three
    candidates' checks and timings)."""
    from ...lifeline import die_with_parent
    from ..gate import check, default_run
    from . import faults

    die_with_parent(*opts.get("lifeline", (None,)))   # a killed tuner takes this worker with it
    device = opts["device"]
    backend = opts.get("backend", "cuda")
    op = opts["op"]
    prob, sets, ref, gate_set = _problem_state(problem, op, device)
    timed = get_op(op).tune_time
    time_fn = get_op(op).fn("tune_time") if timed else None
    # the runner's probe said whether this device captures graphs (probe_graph_capture)
    no_graphs = opts.get("no_graphs") if device == "cuda" else "no CUDA graphs on the CPU"
    conn.send({"ready": True, "sets": len(sets)})
    run = lambda p, c, t: default_run(p, c, t, backend)  # noqa: E731
    gate_run = lambda p, c, t: default_run(p, c, t, backend, poison=True)  # noqa: E731
    timed_run = (lambda p, c, t: time_fn(p, c, t, backend)) if time_fn else run  # noqa: E731
    while True:
        try:
            msg = conn.recv()
        except EOFError:
            return
        if msg is None:
            return
        if "problem" in msg:   # the next shape: the last one's tensors go first
            prob = sets = ref = gate_set = None
            _forget_calls(device)
            prob, sets, ref, gate_set = _problem_state(msg["problem"], op, device)
            conn.send({"ready": True, "sets": len(sets)})
            continue
        cfg = get_op(op).config(msg["config"])
        inject = msg.get("inject")
        this_run = faults.wrap(gate_run, inject) if inject else gate_run
        this_timed = faults.wrap(timed_run, inject) if inject else timed_run
        res: dict[str, Any]
        gate = check(prob, cfg, gate_set, ref, this_run)
        if not gate.ok:
            res = {"ok": False, "why": f"gate: {gate.why}", "gate": gate.as_dict()}
        else:
            try:
                calls = iter(range(1 << 62))
                fn = lambda: this_timed(prob, cfg, sets[next(calls) % len(sets)])  # noqa: E731
                warm, rep = opts.get("warmup_ms", 25), opts.get("rep_ms", 100)
                rounds = ROUNDS if device == "cuda" else 1
                eager = lambda: _time_ms(fn, device, warm, rep, len(sets))  # noqa: E731
                # a device that cannot capture is not asked to, per candidate
                graph = None if no_graphs else (lambda e: _graph_ms(fn, len(sets), e, warm, rep))
                times, graph_error, samples = timed_rounds(eager, graph, rounds)
                res = {"ok": True, "times": times, "gate": gate.as_dict(), "sets": len(sets),
                       "rounds_ms": samples}
                if graph_error:   # e.g. out of memory for the graph's pool
                    res["graph_error"] = graph_error
            except Exception as e:  # noqa: BLE001 - a failure while timing fails the candidate
                res = {"ok": False, "why": f"timing: {type(e).__name__}: {e}"}
        if device != "cpu":   # each candidate's kept intermediates and recorded calls: not the next one's
            _forget_calls(device, collect=False)
        res["problem"] = prob.key()   # the parent checks the answer is about its own problem
        poisoned = device == "cuda" and (not res["ok"] or "graph_error" in res) and not _cuda_alive()
        res["worker_exits"] = poisoned  # said before exiting, so the parent never writes to a dead pipe
        conn.send(res)
        if poisoned:
            os._exit(3)   # the context is poisoned: the parent starts a fresh worker


class EvalWorker:
    """Parent side of one evaluation subprocess (spawned: no CUDA state is inherited). `problem`
    is the one asked for; the process switches to it at the next evaluation (`use`)."""

    def __init__(self, problem: Problem, opts: dict) -> None:
        self.problem = problem
        self.loaded: Problem | None = None   # the problem the live process holds
        self.opts = opts
        self.proc: mp.process.BaseProcess | None = None
        self.conn = None
        self.restarts = 0

    def use(self, problem: Problem) -> None:
        """Evaluate `problem`'s candidates from now on (the process reloads at the next one)."""
        self.problem = problem

    def _switch(self) -> None:
        try:
            self.conn.send({"problem": self.problem.key()})
            ready = self.conn.poll(self.opts.get("ready_timeout", READY_TIMEOUT))
            if ready:
                self.conn.recv()
                self.loaded = self.problem
                return
        except (BrokenPipeError, OSError, EOFError):
            pass
        self.kill()   # it died or did not answer while loading: a fresh one starts with it
        self.restarts += 1
        self._start()

    def _start(self) -> None:
        ctx = mp.get_context("spawn")
        parent, child = ctx.Pipe()
        from ...lifeline import initargs
        opts = {**self.opts, "lifeline": initargs()}
        self.proc = ctx.Process(target=worker_main, args=(child, self.problem.key(), opts),
                                daemon=True, name="autossd-eval")
        self.proc.start()
        child.close()
        self.conn = parent
        if not parent.poll(self.opts.get("ready_timeout", READY_TIMEOUT)):
            self.kill()
            raise RuntimeError("evaluation worker did not start (inputs/reference timed out)")
        try:
            parent.recv()
        except EOFError:
            code = self.proc.exitcode
            self.kill()
            raise RuntimeError(f"evaluation worker died while starting (exit {code})") from None
        self.loaded = self.problem

    def kill(self) -> None:
        if self.proc is not None:
            if self.proc.is_alive():
                self.proc.kill()
            self.proc.join(10)
        self.proc = None
        self.conn = None
        self.loaded = None

    def evaluate(self, config: Config, timeout: float, inject: str | None = None) -> dict:
        if self.proc is None or not self.proc.is_alive():
            if self.proc is not None:
                self.restarts += 1
            self.kill()
            self._start()
        elif self.loaded != self.problem:
            self._switch()
        assert self.conn is not None
        try:
            self.conn.send({"config": config.as_dict(), "inject": inject})
        except (BrokenPipeError, OSError):  # it died after its last answer: start afresh, once
            self.kill()
            self.restarts += 1
            self._start()
            self.conn.send({"config": config.as_dict(), "inject": inject})
        try:
            if not self.conn.poll(timeout):
                self.kill()
                self.restarts += 1
                return {"ok": False, "why": f"hang: no result within {timeout:.0f}s; worker killed"}
            res = self.conn.recv()
        except EOFError:
            self.proc.join(5)
            code = self.proc.exitcode
            self.kill()
            self.restarts += 1
            return {"ok": False, "why": f"crash: evaluation process died (exit code {code})"}
        except BaseException:
            # interrupted with the answer unread (KeyboardInterrupt, an error in the caller): a
            # kept process would hand it to the next question
            self.kill()
            raise
        if res.pop("worker_exits", False):
            self.kill()
            self.restarts += 1
        if res.get("problem") != self.problem.key():
            self.kill()
            self.restarts += 1
            return {"ok": False, "why": f"evaluation answered for another problem ({res.get('problem')}); worker killed"}
        return res

    def close(self) -> None:
        if self.proc is not None and self.proc.is_alive() and self.conn is not None:
            try:
                self.conn.send(None)
                self.proc.join(5)
            except (BrokenPipeError, OSError):
                pass
        self.kill()


_EVAL_WORKERS: dict[tuple, EvalWorker] = {}


def shared_eval_worker(problem: Problem, opts: dict) -> EvalWorker:
    """The evaluation worker of these options, kept across the problems of a tune (each runner
    points it at its own problem); closed by `close_eval_workers` or at exit."""
    key = tuple(sorted(opts.items()))
    w = _EVAL_WORKERS.get(key)
    if w is None:
        w = _EVAL_WORKERS[key] = EvalWorker(problem, opts)
        atexit.register(w.close)
    w.use(problem)
    return w


_KEEP_DEPTH = 0   # open kept_eval_workers() blocks in this process


def close_eval_workers(force: bool = True) -> None:
    """End the kept evaluation workers (a tuning worker process's last step). force=False (the
    end of one `tune()` call) leaves them to an enclosing kept_eval_workers() block."""
    if not force and _KEEP_DEPTH:
        return
    while _EVAL_WORKERS:
        _EVAL_WORKERS.popitem()[1].close()


@contextlib.contextmanager
def kept_eval_workers():
    """Within: the evaluation process outlives each `tune()` call and serves the next one's shape,
    so a caller tuning shape by shape (the CLI, for its per-shape progress lines) starts one
    process, not one per shape (each start cost the shape's first candidate 6-10 s on an H200:
    two thirds of a small shape's tune). Closed when the outermost block ends."""
    global _KEEP_DEPTH
    _KEEP_DEPTH += 1
    try:
        yield
    finally:
        _KEEP_DEPTH -= 1
        if not _KEEP_DEPTH:
            close_eval_workers()


class MeasuredRunner:
    mode = "measured"
    provenance = "measured"

    def __init__(self, arch: str, problem: Problem, device: str = "cuda", compile_workers: int = 2,
                 timeout: float = 60.0, inject: dict[str, str] | None = None,
                 warmup_ms: int = 25, rep_ms: int = 100, precompile: bool = True,
                 objective: str = "graph", op: str | None = None) -> None:
        from ...arch import get_arch
        if objective not in OBJECTIVES:
            raise ValueError(f"objective: expected one of {OBJECTIVES}, got {objective!r}")
        # the interpreter (device "cpu") has no CUDA graphs: eager wall-clock time is all there is
        self.objective = objective if device == "cuda" else "eager"
        self.arch = get_arch(arch).name
        self.problem = problem
        self.timeout = timeout
        self.inject = dict(inject or {})      # config.key() -> "hang" | "fault" | "crash" | "wrong"
        self.precompile = precompile
        self.pool = shared_pool(compile_workers)   # kept across the shapes of a tune
        backend = get_arch(arch).backend
        # the study is named after its objective before the first candidate runs: ask now
        # whether this device can capture graphs at all
        no_graphs = probe_graph_capture() if self.objective == "graph" else None
        self.objective, self.objective_note = objective_on(self.objective, no_graphs)
        if self.objective_note:
            import logging
            logging.getLogger("autossd").warning("autossd tune: %s", self.objective_note)
        self.worker = shared_eval_worker(problem, {"device": device, "backend": backend, "no_graphs": no_graphs,
                                                   "warmup_ms": warmup_ms, "rep_ms": rep_ms,
                                                   "op": op_of(problem, op)})
        self.device = _device_name(device)

    def prepare(self, configs: list[Config]) -> list[Any]:
        if not self.precompile:
            return [None] * len(configs)
        return self.pool.map(configs, self.arch, self.problem)

    def evaluate(self, config: Config, prepared: Any) -> Outcome:
        self.worker.use(self.problem)   # the shared worker may have served another runner since
        if isinstance(prepared, str):
            return Outcome(False, why=prepared)
        if prepared is not None:
            rep = report_from(prepared, self.arch, config)
            if not rep.ok:
                return Outcome(False, why="; ".join(rep.why()), info={"stage": "compile"})
        t0 = time.perf_counter()
        res = self.worker.evaluate(config, self.timeout, self.inject.get(config.key()))
        info = {"eval_s": round(time.perf_counter() - t0, 3)}
        if "graph_error" in res:
            info["graph_error"] = res["graph_error"]
        if "gate" in res:
            info["gate"] = res["gate"]
        if res.get("ok"):
            times = {m: float(v) for m, v in res["times"].items()}
            if self.objective not in times:   # right and timed eagerly, but not by its objective
                return Outcome(False, why=f"{self.objective} timing: {res.get('graph_error', 'missing')}",
                               info=info, times=times)
            return Outcome(True, times[self.objective], info=info, times=times)
        return Outcome(False, why=res.get("why", "failed"), info=info)

    def close(self) -> None:
        pass   # the compile pool and the evaluation worker are shared: they stay for the next shape


def _device_name(device: str) -> str:
    if device != "cuda":
        return "cpu (interpreter)"
    import torch
    try:
        return torch.cuda.get_device_name(0)
    except Exception:  # noqa: BLE001
        return "cuda"
