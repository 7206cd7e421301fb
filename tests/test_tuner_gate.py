"""The tuner's correctness gate in Triton's interpreter (CPU): a correct candidate passes, wrong
ones (one corrupted element, a small bias, NaN, an exception) are rejected; and in measured
mode, candidates that hang, crash their process or answer wrong are recorded as failed while
the run goes on."""
from __future__ import annotations

import pytest
import torch

from autossd.problem import Problem
from autossd.ops.ssd.fwd_knobs import default_config
from autossd.tuner import Settings, tune_problem
from autossd.tuner.gate import check, default_run, make_inputs, reference
from autossd.tuner.runners import faults
from autossd.tuner.runners.measured import MeasuredRunner

TINY = Problem(1, 128, 2, 16, 16, 1, "fp16", has_D=True, has_dt_bias=True, dt_softplus=True)


@pytest.fixture
def interpret(monkeypatch):
    import triton
    monkeypatch.setenv("TRITON_INTERPRET", "1")   # for the spawned evaluation workers
    # and for this process: an earlier in-process compile may have pinned the knob to False
    monkeypatch.setattr(triton.knobs.runtime, "interpret", True)


@pytest.fixture
def case(interpret):
    cfg = default_config("sm90", TINY).replace(chunk_size=64)
    t = make_inputs(TINY, "cpu")
    return cfg, t, reference(TINY, t)


def test_correct_candidate_passes(case):
    cfg, t, ref = case
    res = check(TINY, cfg, t, ref)
    assert res.ok, res.why
    assert res.rel_l2 < 3e-3


def _perturbed(how):
    def run(problem, config, t):
        return how(default_run(problem, config, t))
    return run


def _one_element(y):
    y = y.clone()
    y.view(-1)[7] += 5 * y.abs().max()
    return y


@pytest.mark.parametrize("name, run", [
    ("one corrupted element", _perturbed(_one_element)),
    ("2% bias", _perturbed(lambda y: y * 1.02)),
    ("a NaN", _perturbed(lambda y: y.index_fill(0, torch.tensor([0]), float("nan")))),
    ("injected wrong answer", faults.wrap(default_run, "wrong")),
])
def test_wrong_candidate_is_rejected(case, name, run):
    cfg, t, ref = case
    res = check(TINY, cfg, t, ref, run)
    assert not res.ok, name
    assert res.why


def test_candidate_that_raises_is_a_failed_gate_not_a_crash(case):
    cfg, t, ref = case

    def boom(problem, config, t):
        raise RuntimeError("illegal memory access (simulated)")
    res = check(TINY, cfg, t, ref, boom)
    assert not res.ok and "illegal memory access" in res.why


def test_measured_mode_isolates_hang_crash_and_wrong(interpret, tmp_path):
    base = default_config("sm90", TINY).replace(chunk_size=64)
    bad = {"hang": base.replace(scan_warps=2), "crash": base.replace(scan_warps=8),
           "wrong": base.replace(bmm_warps=2)}
    # the hang costs the whole timeout, the one the runner reads at each candidate's evaluation: the
    # hang's own is short (it never answers, however long it is given), every other candidate's
    # long (a good one takes about 1 s here; 60 s leaves a loaded machine room before a slow good
    # one is taken for a hang)
    runner = MeasuredRunner("sm90", TINY, device="cpu", compile_workers=0, timeout=60.0,
                            inject={c.key(): kind for kind, c in bad.items()}, precompile=False)
    evaluate, timeouts = runner.evaluate, []

    def evaluate_with_its_timeout(config, prepared):
        runner.timeout = 2.0 if config.key() == bad["hang"].key() else 60.0
        timeouts.append(runner.timeout)
        return evaluate(config, prepared)
    runner.evaluate = evaluate_with_its_timeout
    st = Settings(trials=8, sampler="random", seed=0, storage=str(tmp_path / "j.journal"),
                  fixed={"chunk_size": 64}, extra_seeds=[c.as_dict() for c in bad.values()],
                  progress=False)
    try:
        res = tune_problem("sm90", TINY, runner, st)
    finally:
        runner.close()
    why = {kind: next(w for c, w in res.failures if c == bad[kind].as_dict()) for kind in bad}
    assert why["hang"].startswith("hang") and why["crash"].startswith("crash")
    assert why["wrong"].startswith("gate")
    assert res.complete >= 2 and res.best_config not in bad.values()   # the run went on
    assert res.default_ms is not None and runner.worker.restarts >= 2
    assert timeouts.count(2.0) == 1 and len(timeouts) > 1   # the short wait was the hang's alone


def _decode(**kw):
    from autossd.ops.ssd.decode_knobs import DecodeProblem
    return DecodeProblem(**{**dict(batch=3, nheads=4, headdim=16, dstate=16, ngroups=1, dtype="fp32",
                                   state_dtype="bf16", has_D=True, has_dt_bias=True, dt_softplus=True), **kw})


def _varlen(**kw):
    from autossd.ops.ssd.varlen import problem_for
    return problem_for(60, 3, 4, 16, 16, 1, 16, **{"dtype": "fp16", "has_D": True, "has_dt_bias": True,
                                                   "dt_softplus": True, "has_init": True, **kw})


@pytest.mark.parametrize("op, problem", [
    ("ssd_decode", _decode()),     # the updated state in bf16: its rounding, not the inputs', bounds it
    ("ssd_varlen", _varlen()),     # final states of half inputs carry the inputs' precision
    ("ssd_fwd", TINY.replace(return_final_states=True)),
], ids=["decode-bf16-state", "varlen-fp16", "fwd-final-states"])
def test_both_outputs_are_judged_at_the_looser_of_the_problems_dtypes(interpret, op, problem):
    from autossd.ops.registry import get_op
    cfg = get_op(op).fn("default_config")("sm90", problem)
    cfg = cfg.replace(chunk_size=64) if op == "ssd_fwd" else cfg
    t = make_inputs(problem, "cpu", op=op)
    ref = reference(problem, t, op)
    assert ref[1] is not None
    res = check(problem, cfg, t, ref)
    assert res.ok, res.why

    def corrupt_second(p, c, t):
        y, s = default_run(p, c, t)
        s = s.clone()
        s.view(-1)[3] += 5 * float(s.abs().max()) + 1.0
        return y, s

    res = check(problem, cfg, t, ref, corrupt_second)
    assert not res.ok and res.why.startswith("states: max error")
    res = check(problem, cfg, t, ref, lambda p, c, t: default_run(p, c, t)[0])
    assert not res.ok and "second output" in res.why


def test_a_measured_decode_tune_gates_every_candidate_on_the_inputs_of_its_reference(interpret, tmp_path):
    """The decode step is timed updating its state in place (as a model's cache is), its inputs in
    the forms Mamba-2 passes (dt, A, D, dt_bias expanded with stride 0): every candidate's gate
    still sees the state the reference was computed from, so none fails, and the record stored
    is a valid measured one."""
    from autossd.db import read_records
    from autossd.tuner.sinks import DbSink
    op, problem = "ssd_decode", _decode(dtype="fp16", state_dtype="fp32")
    db = str(tmp_path / "t.sqlite")
    runner = MeasuredRunner("sm90", problem, device="cpu", compile_workers=0, precompile=False, op=op)
    st = Settings(trials=2, sampler="random", seed=0, storage=str(tmp_path / "j.journal"), progress=False,
                  op=op, confirm=0)
    try:
        res = tune_problem("sm90", problem, runner, st, DbSink(db).prepare())
    finally:
        runner.close()
    assert res.complete == 2 and res.failed == 0, res.failures
    [rec] = read_records(db, "sm90", op)
    assert rec.provenance == "measured" and rec.launch_mode == "eager" and rec.problem == problem
    assert rec.config == res.best_config and rec.time_ms > 0 and rec.gbps > 0 and rec.tflops > 0


def test_graph_objective_falls_back_to_eager_where_capture_fails(monkeypatch):
    """Some ROCm stacks cannot capture graphs: a graph-objective study there would time no
    candidate at all. The runner asks its worker before the study is named, and minimizes eager
    time instead, saying why."""
    from autossd.tuner.runners import measured
    if not torch.cuda.is_available():   # the probe itself: no device, a reason
        assert "Error" in measured.graph_capture_error()
    assert measured.objective_on("graph", None) == ("graph", None)
    assert measured.objective_on("eager", "RuntimeError: x") == ("eager", None)

    monkeypatch.setattr(measured, "probe_graph_capture",
                        lambda: "RuntimeError: hipErrorStreamCaptureUnsupported")
    runner = MeasuredRunner("gfx942", TINY, device="cuda", compile_workers=0, precompile=False)
    try:
        assert runner.objective == "eager"
        assert "hipErrorStreamCaptureUnsupported" in runner.objective_note
        assert runner.worker.opts["no_graphs"]          # its worker does not try, per candidate
    finally:
        runner.close()
    monkeypatch.setattr(measured, "probe_graph_capture", lambda: None)
    runner = MeasuredRunner("sm90", TINY, device="cuda", compile_workers=0, precompile=False)
    try:
        assert runner.objective == "graph" and runner.objective_note is None
        assert runner.worker.opts["no_graphs"] is None
    finally:
        runner.close()


def test_timed_rounds_interleave_the_modes_and_keep_each_median():
    """The GPU's speed drifts for seconds at a time (up to 9% on the H100): a candidate's eager and
    graph times are taken in interleaved rounds and each mode keeps its median, so one slow
    round neither ranks the config nor one mode against the other."""
    from autossd.tuner.runners.measured import timed_rounds
    order = []
    eager_ms, graph_ms = iter([1.0, 5.0, 1.2]), iter([0.9, 0.95, 3.0])

    def eager():
        order.append("e")
        return next(eager_ms)

    def graph(e):
        order.append(("g", e))
        return next(graph_ms)

    times, err, samples = timed_rounds(eager, graph, 3)
    assert times == {"eager": 1.2, "graph": 0.95} and err is None
    assert samples == {"eager": [1.0, 5.0, 1.2], "graph": [0.9, 0.95, 3.0]}
    assert order == ["e", ("g", 1.0), "e", ("g", 5.0), "e", ("g", 1.2)]   # each graph after its eager

    # a graph that fails (e.g. out of memory for its pool) ends the graph rounds, not the eager ones
    calls = iter([0.8, RuntimeError("out of memory")])

    def flaky(_):
        v = next(calls)
        if isinstance(v, Exception):
            raise v
        return v
    times, err, samples = timed_rounds(lambda: 2.0, flaky, 3)
    assert times == {"eager": 2.0, "graph": 0.8} and samples["eager"] == [2.0] * 3
    assert err == "RuntimeError: out of memory"
    # a device without graphs: eager only
    assert timed_rounds(lambda: 3.0, None, 3) == ({"eager": 3.0}, None, {"eager": [3.0] * 3})


def test_a_reference_of_the_leading_sequences_judges_a_large_batch(interpret, monkeypatch):
    """When float64 chunk states of every sequence would not fit, the reference covers the leading
    ones: a correct candidate passes and one wrong in those sequences fails."""
    from autossd.ops.ssd import fwd
    prob = Problem(3, 128, 2, 16, 16, 1, "fp16", has_D=True, has_dt_bias=True, dt_softplus=True)
    monkeypatch.setattr(fwd, "REF_STATE_BYTES", 2 * 1 * 2 * 16 * 16 * 8 * 2)   # two sequences' worth
    assert fwd.reference_rows(prob) == 2
    cfg = default_config("sm90", prob).replace(chunk_size=64)
    t = make_inputs(prob, "cpu")
    ref = reference(prob, t)
    assert ref[0].shape[0] == 2
    assert check(prob, cfg, t, ref).ok
    assert not check(prob, cfg, t, ref, _perturbed(_one_element)).ok


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_the_backward_gate_checks_every_gradient_at_the_gradient_bound(interpret, dtype):
    """The backward's candidates are judged on every gradient the call makes (a config that buys
    speed with dA's accuracy shows in dA alone), each at `testing.grad_tolerance`: the default
    passes; a 5% error in A's gradient only, or a gradient missing, fails and names it."""
    from autossd.ops.registry import get_op
    from autossd.testing import grad_tolerance
    prob = Problem(1, 96, 2, 16, 16, 1, dtype, has_D=True, has_z=True, has_dt_bias=True, dt_softplus=True)
    cfg = get_op("ssd_bwd").fn("default_config")("sm90", prob).replace(chunk_size=64)
    t = make_inputs(prob, "cpu", op="ssd_bwd")
    ref = reference(prob, t, "ssd_bwd")
    assert set(ref) == {"x", "dt", "A", "B", "C", "D", "z", "dt_bias"}
    res = check(prob, cfg, t, ref)
    assert res.ok and res.rel_l2 < grad_tolerance(dtype), res

    def off(name, scale):
        def run(p, c, tt):
            out = default_run(p, c, tt)
            return {**out, name: out[name] * scale}
        return run
    res = check(prob, cfg, t, ref, off("A", 1.05))
    assert not res.ok and res.why.startswith("A: ") and "relative L2 error" in res.why, res.why
    res = check(prob, cfg, t, ref, lambda p, c, tt: {k: v for k, v in default_run(p, c, tt).items() if k != "dt_bias"})
    assert not res.ok and "expected" in res.why


def test_a_reference_of_a_subset_of_heads_judges_a_large_problem(interpret, monkeypatch):
    """Past REF_WORK the float64 reference covers the first, middle and last head of every group: it is
    the full reference at those heads; a correct candidate passes, one wrong in a covered head
    fails, and a non-finite value in a head it does not cover still fails (the whole output is
    checked for that)."""
    from autossd.ops.ssd import fwd
    prob = Problem(2, 96, 8, 16, 16, 2, "fp16", has_D=True, D_has_hdim=True, has_z=True, has_dt_bias=True,
                   dt_softplus=True, has_initial_states=True, return_final_states=True)
    cfg = default_config("sm90", prob).replace(chunk_size=64)
    t = make_inputs(prob, "cpu")
    assert fwd.reference_heads(prob) is None   # small: every head
    full = reference(prob, t)
    monkeypatch.setattr(fwd, "REF_WORK", 0)
    assert fwd.reference_heads(prob) == [0, 2, 3, 4, 6, 7]
    y_ref, final_ref, heads = ref = reference(prob, t)
    assert heads == [0, 2, 3, 4, 6, 7] and y_ref.shape[2] == 6 and final_ref.shape[1] == 6
    assert torch.allclose(y_ref, full[0][:, :, heads]) and torch.allclose(final_ref, full[1][:, heads])
    assert check(prob, cfg, t, ref).ok
    assert not check(prob, cfg, t, ref, _perturbed(lambda o: (_one_element(o[0]), o[1]))).ok   # head 0

    def nan_in_head_1(p, c, tt):
        y, s = default_run(p, c, tt)
        y = y.clone()
        y[0, 5, 1, 2] = float("nan")
        return y, s
    res = check(prob, cfg, t, ref, nan_in_head_1)
    assert not res.ok and "all of it checked" in res.why


def test_the_gate_runs_a_candidate_into_nan_filled_buffers(interpret, monkeypatch):
    """An element no kernel writes stays NaN in the gate's run and fails it, instead of holding
    whatever the memory held (an earlier candidate's right answer, in a reused buffer)."""
    from autossd.ops.ssd import chunk
    from autossd.tuner.gate import poisoned_run
    cfg, prob = default_config("sm90", TINY).replace(chunk_size=64), TINY
    t = make_inputs(prob, "cpu")
    ref = reference(prob, t)
    monkeypatch.setattr(chunk, "plan", lambda *a, **kw: [])   # kernels that write nothing
    assert torch.isnan(poisoned_run(prob, cfg, t)).all()
    res = check(prob, cfg, t, ref)
    assert not res.ok and "non-finite" in res.why


def test_one_evaluation_process_serves_the_shapes_of_a_tune(interpret):
    """Each shape's runner points the kept evaluation process at its own problem (its inputs and
    reference rebuilt there) instead of starting a process per shape; a candidate is judged
    against its own shape's reference (a process left on the other shape would fail it on the
    output's shape), and after the process is killed a fresh one starts on the current shape."""
    other = TINY.replace(batch=2, seqlen=96)
    cfg = default_config("sm90", TINY).replace(chunk_size=64)
    pids, outs = [], []
    for prob in (TINY, other, TINY):
        runner = MeasuredRunner("sm90", prob, device="cpu", compile_workers=0, timeout=60.0, precompile=False)
        outs.append(runner.evaluate(cfg, None))
        pids.append(runner.worker.proc.pid)
        runner.close()
    assert all(o.ok for o in outs), [o.why for o in outs]
    assert len(set(pids)) == 1, pids
    # each answer names the problem it judged, and one about another problem is refused
    assert runner.worker.evaluate(cfg, 60.0)["problem"] == TINY.key()
    runner.worker.use(other)
    runner.worker.loaded = other   # as if it had switched: it has not
    res = runner.worker.evaluate(cfg, 60.0)
    assert not res["ok"] and "another problem" in res["why"] and runner.worker.proc is None
    runner = MeasuredRunner("sm90", other, device="cpu", compile_workers=0, timeout=60.0, precompile=False)
    out = runner.evaluate(cfg, None)
    assert out.ok, out.why
    assert runner.worker.proc.pid != pids[0] and runner.worker.loaded == other


def test_the_evaluation_process_gates_candidates_in_nan_filled_buffers(interpret):
    """In the measured runner's own process: a candidate whose kernels write nothing fails the
    gate on non-finite values (its buffers were NaN-filled), not by whatever the memory held."""
    cfg = default_config("sm90", TINY).replace(chunk_size=64)
    runner = MeasuredRunner("sm90", TINY, device="cpu", compile_workers=0, timeout=60.0, precompile=False,
                            inject={cfg.key(): "unwritten"})
    out = runner.evaluate(cfg, None)
    assert not out.ok and "non-finite" in out.why, out.why
    good = cfg.replace(scan_warps=8)
    assert runner.evaluate(good, None).ok


def test_tune_calls_inside_kept_eval_workers_share_one_evaluation_process(interpret, tmp_path):
    """A caller tuning shape by shape (the CLI prints a line per shape) keeps one evaluation
    process across its tune() calls inside kept_eval_workers(); a tune() on its own ends its."""
    from autossd.tuner import Settings, kept_eval_workers, open_sink, tune
    from autossd.tuner.runners import measured
    other = TINY.replace(batch=2, seqlen=96)
    kw = {"device": "cpu", "compile_workers": 0, "timeout": 60.0, "precompile": False}
    sink = open_sink(str(tmp_path / "r.jsonl"))

    def one(prob):
        st = Settings(trials=1, sampler="random", seed=0, storage=str(tmp_path / "j.log"), progress=False,
                      confirm=0, fixed={"chunk_size": 64})
        res = tune("sm90", [prob], "measured", st, sink, runner_kw=kw)[0]
        assert res.best_config is not None, res.failures
        return [w.proc.pid for w in measured._EVAL_WORKERS.values()]

    with kept_eval_workers():
        pids = one(TINY) + one(other)
    assert len(pids) == 2 and len(set(pids)) == 1, pids   # kept after each call, the same one
    assert not measured._EVAL_WORKERS   # the block's end closed it
    assert one(other.replace(seqlen=64)) == []   # outside a block, each tune() closes its own
