"""The launch cache's feature check and its fallback to triton's plain launches.

The replay itself cannot run in Triton's CPU interpreter: there are no compiled kernels and no
streams, so the op never records on the CPU (execute passes stream=None). What runs here: the
feature check against the installed triton, the public drop-in end to end with the cache switched
off (by a failed check, or by AUTOSSD_LAUNCH_CACHE=0), and the routing decision in
chunk._execute with the plan and the launches stubbed, as on a GPU (a stream given)."""
from __future__ import annotations

import contextlib
import logging
import os
from types import SimpleNamespace

import pytest
import torch
import triton

import autossd
from autossd import runtime
from autossd.db import engine as dbengine
from autossd.ops.common import launch_cache
from autossd.ops.ssd import chunk
from autossd.ops.ssd.naive import ssd_chunked
from autossd.problem import Problem
from autossd.testing import call_kwargs, make_inputs, rel_err, tolerance

FAKE = "triton.runtime.fake_launcher (removed by an upgrade)"


@pytest.fixture(autouse=True)
def _fresh_decision(tmp_path, monkeypatch):
    """Each test decides anew (the decision is made once per process) on a private database."""
    monkeypatch.setenv("AUTOSSD_DB", str(tmp_path / "user.sqlite"))
    monkeypatch.setenv("AUTOSSD_CACHE_DIR", str(tmp_path / "cache"))
    for k in ("AUTOSSD_LAUNCH_CACHE", "AUTOSSD_FAST_LAUNCH", "AUTOSSD_ARCH"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setattr(launch_cache, "_enabled", None)
    runtime.clear_cache()
    yield
    runtime.clear_cache()
    dbengine.dispose_engines()


def _missing_internal(monkeypatch):
    monkeypatch.setattr(launch_cache, "missing", lambda: (FAKE,))


def test_feature_check_passes_on_the_installed_triton():
    """On the triton this was written against (3.6) every internal is there, so the check is not
    one that always fails; and it is not one that always passes (the next test)."""
    if not triton.__version__.startswith("3.6"):
        pytest.skip(f"written against triton 3.6, this is {triton.__version__}")
    assert launch_cache._check() == []
    assert launch_cache.missing() == () and launch_cache.supported()
    assert launch_cache.enabled()


def test_feature_check_names_an_internal_that_is_gone_or_changed(monkeypatch):
    from triton.backends.nvidia import driver as nv
    from triton.compiler.compiler import CompiledKernel

    monkeypatch.delattr(nv, "make_tensordesc_arg")
    monkeypatch.setattr(nv, "_BASE_ARGS_FORMAT_LEN", 14)
    monkeypatch.delattr(CompiledKernel, "_init_handles")
    gone = launch_cache._check()
    assert any("make_tensordesc_arg" in g for g in gone)
    assert any("_BASE_ARGS_FORMAT_LEN" in g for g in gone)
    assert any("_init_handles" in g for g in gone)
    assert len(gone) == 3
    # a launcher called with another signature
    monkeypatch.undo()
    monkeypatch.setattr(nv.CudaLauncher, "__call__", lambda self, grid, stream, *args: None)
    assert [g for g in launch_cache._check() if "CudaLauncher.__call__" in g]


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available(),
                    reason="runs the kernels: needs a GPU or TRITON_INTERPRET=1 from the start")
@pytest.mark.parametrize("off", ["missing", "switch"])
def test_drop_in_without_the_launch_cache_matches_the_float64_reference(monkeypatch, caplog, off):
    """A triton without an internal the cache uses (or AUTOSSD_LAUNCH_CACHE=0): calls take the
    plain launch path and stay correct; a missing internal is named in one warning per process,
    the switch warns nothing."""
    if off == "missing":
        _missing_internal(monkeypatch)
    else:
        monkeypatch.setenv("AUTOSSD_LAUNCH_CACHE", "0")
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    p = Problem(1, 100, 2, 16, 16, 1, "fp32", 64, has_D=True, dt_softplus=True, return_final_states=True)
    caplog.set_level(logging.WARNING, logger="autossd")
    for seed in (1, 2):   # the second call as the first: nothing recorded to replay
        t = make_inputs(p, dev, seed=seed)
        kw = call_kwargs(p, t)
        args = tuple(t[k] for k in ("x", "dt", "A", "B", "C"))
        y, final = autossd.mamba_chunk_scan_combined(*args, 64, **kw)
        yr, fr, _ = ssd_chunked(*args, chunk_size=64,
                                **{k: v for k, v in kw.items() if not k.startswith("return_")})
        assert rel_err(y, yr) < tolerance("fp32") and rel_err(final, fr) < tolerance("fp32")
    assert launch_cache.enabled() is False
    warned = [r.getMessage() for r in caplog.records if "launch cache is off" in r.getMessage()]
    want = (f"autossd: the launch cache is off: triton {triton.__version__} lacks {FAKE}. Every call "
            "launches through triton's JIT instead (correct, with more host time per call).")
    assert warned == ([want] if off == "missing" else [])


def _route(monkeypatch, calls: int = 3) -> dict:
    """chunk._execute on a stream (as on a GPU) with the plan, the launches, the recording and
    the replay stubbed: how often each ran over `calls` identical calls."""
    seen = {"run": 0, "record": 0, "replay": 0}
    monkeypatch.setattr(chunk, "_launch_cache", {})
    monkeypatch.setattr(chunk, "plan", lambda *a, **k: ["launch"])
    monkeypatch.setattr(chunk, "warm_up", lambda launches, module: 0)
    monkeypatch.setattr(chunk, "run", lambda launches, module: seen.__setitem__("run", seen["run"] + 1)
                        or ["compiled"])
    monkeypatch.setattr(chunk, "_record", lambda *a: seen.__setitem__("record", seen["record"] + 1) or ["rec"])
    monkeypatch.setattr(chunk, "_replay", lambda *a: seen.__setitem__("replay", seen["replay"] + 1))
    prob = Problem(batch=1, seqlen=64, nheads=2, headdim=16, dstate=16, ngroups=1, dtype="fp16")
    for _ in range(calls):
        assert chunk._execute(prob, None, {}, SimpleNamespace(y="y"), None, (0.0, 1.0), None, "cuda",
                              None, 7, sig=()) == "y"
    return seen


def test_routing_records_once_and_replays_when_the_cache_is_on(monkeypatch):
    monkeypatch.setattr(launch_cache, "missing", lambda: ())
    assert _route(monkeypatch) == {"run": 1, "record": 1, "replay": 2}


@pytest.mark.parametrize("off", ["missing", "switch", "old switch"])
def test_routing_takes_the_plain_launches_on_every_call_when_the_cache_is_off(monkeypatch, caplog, off):
    if off == "missing":
        _missing_internal(monkeypatch)
    else:
        monkeypatch.setattr(launch_cache, "missing", lambda: ())
        monkeypatch.setenv("AUTOSSD_LAUNCH_CACHE" if off == "switch" else "AUTOSSD_FAST_LAUNCH", "0")
    caplog.set_level(logging.WARNING, logger="autossd")
    assert _route(monkeypatch) == {"run": 3, "record": 0, "replay": 0}
    assert not chunk._launch_cache
    assert sum(FAKE in r.getMessage() for r in caplog.records) == (off == "missing")


def test_warm_up_compiles_nothing_without_the_internals_it_uses(monkeypatch):
    """warm_up loads compiled kernels' handles (a triton internal): without it, the JIT compiles
    each kernel at its first launch, as it would without warm_up."""
    _missing_internal(monkeypatch)
    monkeypatch.setattr(chunk, "interpreting", lambda: False)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "device", lambda d: contextlib.nullcontext())

    class Fn:
        def __init__(self):
            self.device_caches = {}

        def warmup(self, grid, **kw):
            raise AssertionError("compiled")

    module = SimpleNamespace(a=Fn(), b=Fn())
    launches = [chunk.Launch(n, n, (1, 1, 1), {}, {}) for n in ("a", "b")]
    assert chunk.warm_up(launches, module) == 0
    monkeypatch.setattr(launch_cache, "missing", lambda: ())
    with pytest.raises(AssertionError, match="compiled"):   # with them, both would compile
        chunk.warm_up(launches, module)


def test_nothing_else_launches_through_triton_internals():
    """The launch cache is the one module that reaches into triton's launch internals."""
    import pathlib
    import re

    root = pathlib.Path(autossd.__file__).parent
    pattern = re.compile(r"triton\.runtime\.driver|triton\.backends\.(nvidia|amd)\.driver|CompiledKernel|"
                         r"_init_handles|packed_metadata|CudaLauncher|make_tensordesc_arg|get_current_stream")
    users = sorted(str(p.relative_to(root)) for p in root.rglob("*.py") if pattern.search(p.read_text()))
    assert users == ["ops/common/launch_cache.py"], users


# --- the recent-calls memo ------------------------------------------------------------------------
NAMES3 = ("a", "b", "c")


def _three(dtype=torch.float16):
    return (torch.randn(4, 8, dtype=dtype), torch.randn(8, dtype=dtype).expand(4, 8), None)


def test_recent_calls_finds_a_kept_key_for_new_tensors_of_the_same_metadata():
    memo = launch_cache.RecentCalls(NAMES3)
    memo.add(_three(), ("flag",), "value")
    t = _three()
    value, names, ptrs = memo.find(t, ("flag",))
    assert value == "value" and dict(zip(names, ptrs)) == {"a": t[0].data_ptr(), "b": t[1].data_ptr()}


@pytest.mark.parametrize("change", ["dtype", "shape", "strides", "tensor where None was", "None where a tensor was",
                                    "extra", "misaligned", "requires_grad"])
def test_recent_calls_misses_every_change_of_the_key(change):
    memo = launch_cache.RecentCalls(NAMES3)
    memo.add(_three(), ("flag",), "value")
    a, b, c = _three()
    extra = ("flag",)
    if change == "dtype":
        a = a.float()
    elif change == "shape":
        a = torch.randn(5, 8, dtype=a.dtype)
    elif change == "strides":
        a = torch.randn(8, 4, dtype=a.dtype).t()
    elif change == "tensor where None was":
        c = torch.randn(3)
    elif change == "None where a tensor was":
        b = None
    elif change == "extra":
        extra = ("other",)
    elif change == "misaligned":   # same shape and strides, 2 bytes past a 16-byte boundary
        a = torch.randn(4 * 8 + 1, dtype=a.dtype)[1:].view(4, 8)
    elif change == "requires_grad":
        a = a.requires_grad_()
    assert memo.find((a, b, c), extra) is None
    assert memo.find(_three(), ("flag",))[0] == "value"   # and the kept key still matches


def test_recent_calls_keeps_no_aliased_key_and_evicts_the_oldest():
    memo = launch_cache.RecentCalls(NAMES3)
    a = torch.randn(4, 8)
    memo.add((a, a, None), (), "aliased")   # a record maps each pointer to one name: full key only
    assert memo.find((a, a, None), ()) is None
    for n in range(memo.SIZE + 1):
        memo.add((torch.randn(n + 1, 8), None, None), (), n)
    assert memo.find((torch.randn(1, 8), None, None), ()) is None   # the oldest is gone
    assert [memo.find((torch.randn(n + 1, 8), None, None), ())[0] for n in range(1, memo.SIZE + 1)] \
        == list(range(1, memo.SIZE + 1))


def test_recent_calls_keeps_nothing_without_torchs_guard(monkeypatch):
    monkeypatch.setattr(launch_cache, "_TensorGuard", None)
    memo = launch_cache.RecentCalls(NAMES3)
    memo.add(_three(), (), "value")
    assert memo.find(_three(), ()) is None


def test_recent_calls_keeps_nothing_looked_up_before_a_clear():
    """A value prepared before a clear (a database write may change what the lookup picks) is not
    kept after it: a steady loop would otherwise run the old pick for good."""
    memo = launch_cache.RecentCalls(NAMES3)
    gen = memo.generation
    memo.clear()
    memo.add(_three(), (), "old", gen)
    assert memo.find(_three(), ()) is None
    memo.add(_three(), (), "new", memo.generation)
    assert memo.find(_three(), ())[0] == "new"


def test_a_pointer_replay_puts_each_named_pointer_in_its_argument_and_refuses_a_missing_name(monkeypatch):
    """DirectLaunch takes the pointers of a kept call by name (RecentCalls.find's order, with out
    appended where the caller gave none): each goes to its argument whatever the names' order;
    a record taking a pointer the call does not name launches nothing (the checked path runs)."""
    launched = []
    raw = lambda gx, gy, gz, stream, *rest: launched.append((gx, gy, gz, stream, rest))  # noqa: E731
    template = [None, 7, None, 9, None]   # constants at 1 and 3; pointers at 0 (x), 2 (out), 4 (B)
    slots = (((0, True, "x"), (2, True, "out"), (4, True, "B")), ())
    dl = launch_cache.DirectLaunch(raw, ("head",), template, slots, None)
    for names, ptrs in ((("x", "B", "out"), [100, 400, 200]), (("B", "out", "x"), [400, 200, 100]),
                        (("x", "B", "z", "out"), [100, 400, 300, 200])):
        at = dl.positions(names)
        dl.with_ptrs((3, 1, 1), "stream", at, ptrs)
        assert launched.pop() == (3, 1, 1, "stream", ("head", 100, 7, 200, 9, 400)), names
    assert dl.positions(("x", "B")) is None   # out not named
    record = [(None, (3, 1, 1), None, None, None, dl)]
    monkeypatch.setattr(launch_cache, "_hooked", lambda: False)
    monkeypatch.setattr(launch_cache, "_driver", SimpleNamespace(active=SimpleNamespace(
        get_current_device=lambda: 0, get_current_stream=lambda dev: "s0")))
    assert launch_cache.replay_ptrs(record, ("x", "B"), [1, 2], 0) is False and not launched
    assert launch_cache.replay_ptrs(record, ("out", "x", "B"), [2, 1, 4], 0) is True
    assert launched == [(3, 1, 1, "s0", ("head", 1, 7, 2, 9, 4))]
    assert launch_cache.replay_ptrs(record, ("out", "x", "B"), [2, 1, 4], 1) is False   # another device
