"""What every registered op must do, checked for each op the registry knows without naming one:
its default config at its problem type's small example matches the op's float64 reference in
Triton's interpreter through the op's own gate hooks; every knob changes the code a config
renders or what its plan launches it with; the default cross-compiles for every arch; and a record stored for the example is what
the one selector (autossd.core.select) picks for it. A new op gets these by being registered."""
from __future__ import annotations

import itertools

import pytest

from autossd import render
from autossd.arch import ARCHS
from autossd.compile import compile_config
from autossd.core import select
from autossd.db import add_records, make_record
from autossd.ops.registry import get_op, op_names
from autossd.tuner.gate import check, make_inputs, reference

OPS = op_names()


def _example(name):
    op = get_op(name)
    prob = op.problem_type.example()
    assert prob is not None, f"{op.problem_type.__name__} offers no example problem"
    return op, prob


@pytest.fixture
def interpret(monkeypatch):
    import triton
    monkeypatch.setattr(triton.knobs.runtime, "interpret", True)


@pytest.mark.parametrize("name", OPS)
def test_the_default_matches_the_float64_reference_through_the_gate(interpret, name):
    op, prob = _example(name)
    cfg = op.fn("default_config")("sm90", prob)
    assert not op.fn("violations")(cfg, "sm90", prob)
    t = make_inputs(prob, "cpu", seed=3, op=name)
    ref = reference(prob, t, name)
    res = check(prob, cfg, t, ref)
    assert res.ok, res.why
    # the gate can fail: the same run with one output element moved far off is refused
    def corrupted(p, c, t):
        out = op.fn("tune_run")(p, c, t, "cuda", poison=True)
        y = out[0] if isinstance(out, tuple) else next(iter(out.values())) if isinstance(out, dict) else out
        y.view(-1)[0] += 10 * float(y.abs().max()) + 1.0
        return out
    assert not check(prob, cfg, make_inputs(prob, "cpu", seed=3, op=name), ref, corrupted).ok


def _backend_for(knob) -> str | None:
    """The backend of an arch that offers the knob (an AMD compiler knob shows under hip only)."""
    return next((a.backend for a in ARCHS.values() if knob.offered_on(a)), None)


def _launches(op, prob, cfg, backend):
    """What a config's launches compile with beyond its rendered code: kernels, grids, constexpr
    arguments and launch options (the plan's, on meta tensors)."""
    try:
        return [(ln.kernel, ln.grid, sorted(ln.constexprs.items()), sorted(ln.options.items()))
                for ln in op.fn("meta_launches")(prob, cfg, backend)]
    except Exception:   # noqa: BLE001 - a combination the plan refuses shows nothing
        return None


def _changes_code(op, prob, base, knob, backend, deep: bool = True) -> bool:
    """Whether some other value of `knob` compiles other code than `base` does (its rendering,
    or the constexprs and options its plan launches it with), from `base` or from `base` with
    one other knob changed (a knob may need another's value to matter: the forward's walk knobs
    shape only the walk)."""
    space = base.space

    def differs(cfg) -> bool:
        h = render.kernel_hash(cfg, backend)
        others = [cfg.replace(**{knob.name: v}) for v in knob.values if v != cfg[knob.name]]
        if any(render.kernel_hash(c, backend) != h for c in others):
            return True
        mine = _launches(op, prob, cfg, backend)
        return mine is not None and any(_launches(op, prob, c, backend) not in (None, mine) for c in others)

    if differs(base):
        return True
    for other in space.knobs if deep else ():
        if other.name == knob.name:
            continue
        for v in other.values:
            try:
                cfg = base.replace(**{other.name: v})
                if differs(cfg):
                    return True
            except ValueError:   # a value this backend cannot render (pdl on hip)
                continue
    return False


def _bases(op, name, prob) -> list:
    """(config, problem) pairs to vary a knob from: each arch's default at the example, and the
    distinct configs of the shipped records at their own problems (the combinations tuned, where
    one knob may need several others or a shape: the forward's walk block sizes the walk only
    at chunks longer than its block, and packed prefill's chunk is its problem's)."""
    from autossd.db.lookup import shipped_db_path
    from autossd.db.records import read_records
    out = {op.fn("default_config")(a, prob): prob for a in sorted(ARCHS)}
    for a in sorted(ARCHS):
        path = shipped_db_path(a)
        if path is not None:
            for r in read_records(str(path), a, name, immutable=True):
                out.setdefault(r.config, r.problem)
    return list(out.items())[:40]


@pytest.mark.parametrize("name", OPS)
def test_every_knob_changes_the_code_a_config_compiles_to(name):
    op, prob = _example(name)
    space = op.space
    bases = _bases(op, name, prob)
    quiet = []
    for knob in space.knobs:
        backend = _backend_for(knob)
        if backend is None or len(knob.values) < 2:
            continue
        modes = [m for m in space.modes if knob.shapes(m)]
        first = op.fn("default_config")("gfx942" if backend == "hip" else "sm90", prob)
        if not any(_changes_code(op, prob, first.replace(**{space.mode_knob: m}), knob, backend) for m in modes) \
                and not any(_changes_code(op, p, b, knob, backend, deep=False) for b, p in bases
                            if knob.shapes(b[space.mode_knob])):
            quiet.append(knob.name)
    assert not quiet, f"{name}: knobs that change no rendered code: {quiet}"


@pytest.mark.parametrize("name,arch", list(itertools.product(OPS, sorted(ARCHS))))
def test_the_default_cross_compiles_for_every_arch(name, arch):
    op, prob = _example(name)
    rep = compile_config(op.fn("default_config")(arch, prob), arch, prob)
    assert rep.ok, rep.why
    assert rep.stages and all(s.registers > 0 and s.artifact_sha for s in rep.stages)


@pytest.mark.parametrize("name", OPS)
def test_a_stored_record_is_what_the_selector_picks(isolated_db, no_shipped_db, name):
    op, prob = _example(name)
    cfg = op.fn("default_config")("sm90", prob)
    select.clear()
    assert select.select(name, prob, "sm90").kind == "default"
    add_records(str(isolated_db), [make_record(prob, cfg, "sm90", provenance="measured", time_ms=0.01)])
    m = select.select(name, prob, "sm90")   # the write voided the answer cached above
    assert m.kind == "exact" and m.config == cfg and m.record.op == name, m.reason
    assert m.record.problem == prob and not m.stale
