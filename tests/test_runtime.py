"""autossd.runtime: get_kernel, Kernel, the autossd::ssd_fwd custom op and the drop-in
mamba_chunk_scan_combined, run on CPU through Triton's interpreter on tiny shapes."""
from __future__ import annotations

import json
import logging
import os
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import autossd
from autossd import render, runtime
from autossd.db import add_records, make_record
from autossd.db import engine as dbengine
from autossd.ops.ssd.naive import ssd_chunked
from autossd.problem import Problem
from autossd.ops.ssd.fwd_knobs import default_config
from autossd.testing import call_kwargs, make_inputs, rel_err, tolerance

ROOT = Path(__file__).resolve().parent.parent
# CPU tensors need the interpreter, switched on before triton's import (tests/conftest.py)
pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                reason="runs CPU kernels: needs TRITON_INTERPRET=1 from the start")
TILE16 = {k: 16 for k in ("bmm_block_m", "bmm_block_n", "bmm_block_k", "state_block_m", "state_block_n",
                          "state_block_k", "scan_block_m", "scan_block_n", "scan_block_k", "scan_block_d")}


def tiny(dtype="fp32", **flags) -> Problem:
    return Problem(1, 130, 2, 16, 16, 1, dtype, 64, **flags)


def tuned_for(p: Problem):
    return default_config("sm90", p).replace(**TILE16, scan_warps=2)


@pytest.fixture(autouse=True)
def _isolated(tmp_path, monkeypatch):
    monkeypatch.setenv("AUTOSSD_DB", str(tmp_path / "user.sqlite"))
    monkeypatch.setenv("AUTOSSD_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("AUTOSSD_ARCH", raising=False)
    runtime.clear_cache()
    yield
    runtime.clear_cache()
    dbengine.dispose_engines()


def _args(p: Problem, seed: int = 0):
    t = make_inputs(p, seed=seed)
    return tuple(t[k] for k in ("x", "dt", "A", "B", "C")), call_kwargs(p, t)


def _reference(args, chunk, kw):
    return ssd_chunked(*args, chunk_size=chunk, **{k: v for k, v in kw.items() if not k.startswith("return_")})


# --- get_kernel ----------------------------------------------------------------------------
def test_get_kernel_exposes_choice_config_record_and_source(tmp_path):
    p = tiny(has_D=True)
    cfg = tuned_for(p)
    add_records(str(tmp_path / "user.sqlite"), [make_record(p, cfg, "sm90", provenance="measured", time_ms=0.02)])
    k = autossd.get_kernel(p, "sm90")
    assert isinstance(k, autossd.Kernel)
    assert (k.source, k.provenance, k.distance, k.stale) == ("exact", "measured", 0.0, False)
    assert k.config == cfg and k.record.config == cfg and "exact match" in k.reason
    src = Path(k.source_path)
    assert src.is_file() and src.read_text() == render.render(cfg, "cuda")
    # the same kernel for the other spellings of the problem
    assert autossd.get_kernel(p.key(), "sm90") is k
    fields = (p.batch, p.seqlen, p.nheads, p.headdim, p.dstate, p.ngroups, p.dtype)
    assert autossd.get_kernel(fields, "sm90").problem == p.replace(chunk_size=None, has_D=False)
    with pytest.raises(TypeError, match="expected a Problem"):
        autossd.get_kernel("1x130", "sm90")


def test_get_kernel_default_and_nearest(tmp_path):
    p = tiny()
    assert autossd.get_kernel(p, "sm90").source == "default"
    assert autossd.get_kernel(p, "sm90").config == default_config("sm90", p)
    near = p.replace(seqlen=260)
    add_records(str(tmp_path / "user.sqlite"), [make_record(near, tuned_for(near), "sm90", provenance="static")])
    k = autossd.get_kernel(p, "sm90")        # the write cleared the cache
    assert (k.source, k.provenance, k.distance) == ("nearest", "static", 1.0)


def test_first_call_renders_and_loads_only_the_chosen_config(monkeypatch):
    # a fresh process's state: no kernels, no loaded modules (an earlier test in this worker may
    # have loaded this very config)
    runtime.clear_cache()
    monkeypatch.setattr(render, "_modules", {})
    monkeypatch.setattr(render, "_by_config", {})
    p = tiny()
    before = set(render._modules)
    k = autossd.get_kernel(p, "sm90")
    assert set(render._modules) == before            # lookup alone loads nothing
    args, kw = _args(p)
    k(*args, **kw)
    new = set(render._modules) - before
    assert len(new) == 1 and next(iter(new))[0] == str(k.source_path)


def test_a_warm_lookup_is_one_dict_lookup(monkeypatch):
    """A warm get_kernel answers from the per-process cache: the lookup (records, ranking,
    Problem checks) runs once per shape. Checked by what runs, not by a clock (a timed bound
    holds only on a machine as fast and as idle as the one it was set on)."""
    p = tiny()
    shape = {f: getattr(p, f) for f in ("batch", "seqlen", "nheads", "headdim", "dstate", "ngroups", "dtype",
                                        "chunk_size")}
    k = autossd.get_kernel(p, "sm90")
    assert autossd.get_kernel(p.replace(), "sm90") is k and autossd.get_kernel(shape, "sm90") is k

    def cold(*a, **kw):
        raise AssertionError("a warm get_kernel took the cold path")
    monkeypatch.setattr(runtime, "_get_kernel_cold", cold)
    for _ in range(1000):
        assert autossd.get_kernel(p, "sm90") is k


def test_an_unknown_autossd_arch_is_refused_by_the_variables_name(monkeypatch):
    """AUTOSSD_ARCH=sm100: get_kernel and the drop-in say which variable holds the unknown name
    and which archs there are (a bare "arch: unknown" left the user to guess where it came from)."""
    p = tiny()
    args, kw = _args(p)
    monkeypatch.setenv("AUTOSSD_ARCH", "sm100")
    runtime.clear_cache()
    for call in (lambda: autossd.get_kernel(p), lambda: autossd.mamba_chunk_scan_combined(*args, 64, **kw)):
        with pytest.raises(ValueError, match=r"AUTOSSD_ARCH='sm100': unknown architecture; expected one of "
                                             r"\['gfx90a', 'gfx942', 'sm80', 'sm90'\]"):
            call()
    assert autossd.get_kernel(p, "sm90").arch == "sm90"   # a named arch does not consult it


def test_the_drop_in_takes_B_C_and_z_in_another_dtype_than_x_as_mamba_ssm_does():
    """mamba_ssm's function takes x in bf16 with B, C (and z) in fp32 (its kernels cast each
    product's operands), and so does autossd.ssd_varlen: the drop-in casts them to x's dtype,
    giving the all-bf16 call's output, within bf16's bound of float64, and the fp32 inputs'
    gradients in fp32."""
    p = tiny("bf16", has_D=True, has_z=True, has_dt_bias=True, dt_softplus=True)
    args, kw = _args(p, seed=3)
    x, dt, A, B, C = args
    B32, C32, z32 = B.float().requires_grad_(), C.float().requires_grad_(), kw["z"].float()
    y = autossd.mamba_chunk_scan_combined(x, dt, A, B32, C32, 64, **{**kw, "z": z32})
    assert y.dtype == torch.bfloat16
    assert torch.equal(y, autossd.mamba_chunk_scan_combined(x, dt, A, B, C, 64, **kw))
    assert rel_err(y.detach(), _reference(args, 64, kw)[0]) < tolerance("bf16")
    y.float().sum().backward()
    assert B32.grad.dtype == C32.grad.dtype == torch.float32 and B32.grad.abs().sum() > 0
    # packed prefill takes the same mix (one sequence: the same tokens)
    cu = torch.tensor([0, p.seqlen], dtype=torch.int32)
    yv, _ = autossd.ssd_varlen(x[0], dt[0], A, B32[0].detach(), C32[0].detach(), 64, cu, D=kw["D"],
                               z=z32[0], dt_bias=kw["dt_bias"], dt_softplus=True)
    assert rel_err(yv, _reference(args, 64, kw)[0][0]) < tolerance("bf16")


def test_kernel_refuses_inputs_of_another_problem():
    k = autossd.get_kernel(tiny(), "sm90")
    args, kw = _args(tiny().replace(seqlen=100))
    with pytest.raises(ValueError, match="get_kernel for the new problem"):
        k(*args, **kw)


# --- the drop-in ---------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", ["fp32", "fp16", "bf16"])
def test_drop_in_matches_the_float64_reference(dtype):
    p = tiny(dtype, has_D=True, D_has_hdim=True, has_z=True, has_dt_bias=True, dt_softplus=True,
             has_initial_states=True, return_final_states=True)
    args, kw = _args(p, seed=1)
    y, final = autossd.mamba_chunk_scan_combined(*args, 64, **kw)
    yr, fr, _ = _reference(args, 64, kw)
    assert y.dtype == args[0].dtype and final.dtype == torch.float32
    assert rel_err(y, yr) < tolerance(dtype) and rel_err(final, fr) < tolerance(dtype)


@pytest.mark.parametrize("final,varlen", [(False, False), (True, False), (False, True), (True, True)])
def test_drop_in_returns_what_mamba_ssm_returns(final, varlen):
    p = Problem(1, 150, 2, 16, 16, 1, "fp32", 64, has_seq_idx=True, has_dt_limit=True,
                return_final_states=final, return_varlen_states=varlen)
    args, kw = _args(p, seed=2)
    if not varlen:  # cu_seqlens is only needed (and only allowed by from_args' check) with varlen
        kw["cu_seqlens"] = None
    out = autossd.mamba_chunk_scan_combined(*args, 64, **kw)
    yr, fr, vr = _reference(args, 64, {**kw, "cu_seqlens": kw["cu_seqlens"]})
    parts = [out] if not (final or varlen) else list(out)
    assert isinstance(out, torch.Tensor) == (not (final or varlen))
    assert len(parts) == 1 + final + varlen
    refs = [yr] + ([fr] if final else []) + ([vr] if varlen else [])
    for got, ref in zip(parts, refs):
        assert got.shape == ref.shape and rel_err(got, ref) < tolerance("fp32")


def test_drop_in_runs_the_tuned_config(tmp_path):
    p = tiny(has_D=True)
    cfg = tuned_for(p)
    add_records(str(tmp_path / "user.sqlite"), [make_record(p, cfg, "sm90", provenance="measured", time_ms=0.02)])
    args, kw = _args(p)
    y = autossd.mamba_chunk_scan_combined(*args, 64, **kw)
    assert rel_err(y, _reference(args, 64, kw)[0]) < tolerance("fp32")
    k = runtime.get_kernel(p, "sm90")  # what the op looked up (CPU -> the interpreter's sm90)
    assert k.config == cfg and render.load(cfg) is k.module()


def test_a_config_the_gpu_cannot_load_falls_back_to_one_that_fits(tmp_path, monkeypatch, caplog):
    # e.g. an H100-tuned record (227 KB of shared memory per block) on a 99 KB sm89 part: Triton
    # raises OutOfResources at the kernel's first load; the call runs again, on the arch default
    from triton.runtime.errors import OutOfResources
    monkeypatch.setattr(runtime, "_unfit", {})   # this test's verdicts end with it (they outlive clear_cache)
    p = tiny(has_D=True)
    cfg = tuned_for(p)
    add_records(str(tmp_path / "user.sqlite"), [make_record(p, cfg, "sm90", provenance="measured", time_ms=0.02)])
    real = runtime.execute
    too_big = {cfg}

    def execute(prob, config, *a, **k):
        if config in too_big:
            raise OutOfResources(232448, 101376, "shared memory")
        return real(prob, config, *a, **k)

    monkeypatch.setattr(runtime, "execute", execute)
    args, kw = _args(p)
    ref = _reference(args, 64, kw)[0]
    with caplog.at_level(logging.WARNING, logger="autossd"):
        y = autossd.mamba_chunk_scan_combined(*args, 64, **kw)
    assert rel_err(y, ref) < tolerance("fp32")
    k = runtime.get_kernel(p, "sm90")
    base, flat = runtime.fallback_configs("sm90", k.problem)
    assert k.config == base and k.source == "default" and "shared memory" in k.reason
    assert "232448 > 101376" in caplog.text and "fell back" in caplog.text
    # clear_cache (which every database write triggers) keeps the verdict: the next Kernel starts
    # from the default, without loading the record's config again or warning again
    runtime.clear_cache()
    tried = []
    monkeypatch.setattr(runtime, "execute", lambda prob, config, *a, **k: (tried.append(config),
                                                                          execute(prob, config, *a, **k))[1])
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="autossd"):
        assert rel_err(autossd.mamba_chunk_scan_combined(*args, 64, **kw), ref) < tolerance("fp32")
    k = runtime.get_kernel(p, "sm90")
    assert tried == [base] and k.config == base and "shared memory" in k.reason
    assert "fell back" not in caplog.text
    # the default does not fit either: its unpipelined form; then nothing is left, and the
    # error says so (never a loop, never a GPU fault)
    too_big.add(base)
    assert rel_err(autossd.mamba_chunk_scan_combined(*args, 64, **kw), ref) < tolerance("fp32")
    assert k.config == flat and flat.scan_stages == flat.state_stages == flat.bmm_stages == 1
    too_big.add(flat)
    with pytest.raises(RuntimeError, match="no config fits this GPU.*shared memory"):
        autossd.mamba_chunk_scan_combined(*args, 64, **kw)


def test_state_dtype_sets_the_precision_of_the_states_not_only_their_storage():
    # mamba_ssm's state_dtype: asking fp32 states of a bf16 call (whose config keeps bf16 states)
    # must give what an fp32-state config gives, not bf16-rounded states stored as fp32
    from autossd.ops.ssd.chunk import ssd_forward
    p = tiny("bf16", has_D=True, return_final_states=True)
    args, kw = _args(p, seed=4)
    kw.pop("return_final_states", None)
    cfg = runtime.get_kernel(p, "sm90").config
    assert cfg.state_dtype == "bf16"
    y32, f32 = autossd.mamba_chunk_scan_combined(*args, 64, **kw, return_final_states=True,
                                                 state_dtype=torch.float32)
    ye, fe = ssd_forward(*args, 64, **kw, return_final_states=True, config=cfg.replace(state_dtype="fp32"))
    assert torch.equal(y32, ye) and torch.equal(f32, fe)
    y16, f16 = autossd.mamba_chunk_scan_combined(*args, 64, **kw, return_final_states=True)
    assert not torch.equal(f16, f32)     # bf16 states do differ: the check above can fail


def test_varlen_states_for_empty_and_malformed_cu_seqlens_never_read_out_of_bounds():
    # cu_seqlens's values stay on the GPU (no sync per call): an empty sequence's state is 0,
    # a malformed cu_seqlens poisons every state with NaN instead of an out-of-bounds read (a
    # device-side assert on a GPU, an IndexError here)
    p = Problem(1, 150, 2, 16, 16, 1, "fp32", 64, has_seq_idx=True, return_varlen_states=True)
    args, kw = _args(p, seed=5)
    cu = kw["cu_seqlens"]
    with_empty = torch.cat([cu[:2], cu[1:2], cu[2:]])          # a sequence of length 0 after the first
    y, states = autossd.mamba_chunk_scan_combined(*args, 64, **{**kw, "cu_seqlens": with_empty})
    _, _, ref = _reference(args, 64, kw)
    assert torch.equal(states[1], torch.zeros_like(states[1]))
    keep = [0] + list(range(2, len(with_empty) - 1))
    assert rel_err(states[keep], ref) < tolerance("fp32")
    for bad in (torch.tensor([0, 200], dtype=cu.dtype),            # past the end
                torch.tensor([0, 90, 40, 150], dtype=cu.dtype),     # decreasing
                torch.tensor([-5, 150], dtype=cu.dtype)):           # negative
        _, states = autossd.mamba_chunk_scan_combined(*args, 64, **{**kw, "cu_seqlens": bad})
        assert states.shape[0] == len(bad) - 1 and torch.isnan(states).all()
    # padding before the first or after the last sequence is no error (as in mamba_ssm)
    for padded in (torch.tensor([0, 100], dtype=cu.dtype), torch.tensor([5, 60, 140], dtype=cu.dtype)):
        _, states = autossd.mamba_chunk_scan_combined(*args, 64, **{**kw, "cu_seqlens": padded})
        _, _, ref = _reference(args, 64, {**kw, "cu_seqlens": padded})
        assert rel_err(states, ref) < tolerance("fp32")


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_varlen_states_at_chunk_edges_groups_and_ragged_tiles(dtype):
    # sequences ending on a chunk's last token, on its first, mid-chunk, spanning three chunks, and
    # one token long; two groups of three heads; headdim and dstate off the kernel's tile sizes;
    # x read through a strided view. Each state against float64, and none left unwritten.
    p = Problem(1, 300, 6, 24, 40, 2, dtype, 64, has_seq_idx=True, return_varlen_states=True,
                has_D=True, has_dt_bias=True, dt_softplus=True)
    args, kw = _args(p, seed=11)
    cu = torch.tensor([0, 64, 65, 100, 101, 290, 300], dtype=torch.int32)
    seq = torch.repeat_interleave(torch.arange(6, dtype=torch.int32), cu[1:] - cu[:-1])[None]
    x = torch.empty(1, 300, 6, 48, dtype=args[0].dtype)[..., ::2]
    x.copy_(args[0])
    args = (x,) + args[1:]
    kw = {**kw, "cu_seqlens": cu, "seq_idx": seq}
    y, states = autossd.mamba_chunk_scan_combined(*args, 64, **kw)
    _, _, ref = _reference(args, 64, kw)
    assert states.shape == (6, 6, 24, 40) and torch.isfinite(states).all()
    assert rel_err(states, ref) < tolerance(dtype)
    for i in range(6):   # each sequence on its own: a wrong carry or cut shows in one of them
        assert rel_err(states[i], ref[i]) < 2 * tolerance(dtype), i


def test_get_kernel_without_an_arch_follows_the_current_device(monkeypatch):
    # a process with GPUs of two archs: get_kernel(shape) must not keep the first device's kernel
    current = {"dev": 0}
    archs = {0: "sm90", 1: "sm80"}
    monkeypatch.setattr(runtime, "_current_device", lambda: current["dev"])
    monkeypatch.setattr(runtime, "arch_of_device", lambda device=None: archs[current["dev"]])
    shape = (1, 130, 2, 16, 16, 1, "fp32")
    assert runtime.get_kernel(shape).arch == "sm90"
    current["dev"] = 1
    assert runtime.get_kernel(shape).arch == "sm80"
    current["dev"] = 0
    assert runtime.get_kernel(shape).arch == "sm90"


def test_a_captured_call_runs_the_graph_timed_record(tmp_path, monkeypatch):
    p = tiny(has_D=True)
    eager, graph = tuned_for(p), tuned_for(p).replace(scan_warps=4, launches=3)
    add_records(str(tmp_path / "user.sqlite"), [
        make_record(p, eager, "sm90", provenance="measured", time_ms=0.02, launch_mode="eager"),
        make_record(p, graph, "sm90", provenance="measured", time_ms=0.01, launch_mode="graph")])
    ran = []
    real_run = runtime.Kernel.run
    monkeypatch.setattr(runtime.Kernel, "run", lambda self, *a, **k: ran.append(self) or real_run(self, *a, **k))
    args, kw = _args(p)
    ref = _reference(args, 64, kw)[0]
    y_eager = autossd.mamba_chunk_scan_combined(*args, 64, **kw)
    monkeypatch.setattr(runtime, "launch_mode_of", lambda x: "graph")   # as while a stream captures
    y_graph = autossd.mamba_chunk_scan_combined(*args, 64, **kw)
    assert [(k.launch_mode, k.config) for k in ran] == [("eager", eager), ("graph", graph)]
    assert rel_err(y_eager, ref) < tolerance("fp32") and rel_err(y_graph, ref) < tolerance("fp32")
    assert runtime.get_kernel(p, "sm90", launch_mode="graph").config == graph
    with pytest.raises(ValueError, match="launch_mode"):
        runtime.get_kernel(p, "sm90", launch_mode="cudagraph")


def test_launch_mode_is_graph_only_while_a_cuda_stream_captures(monkeypatch):
    from types import SimpleNamespace
    gpu = SimpleNamespace(device=torch.device("cuda", 0))
    for capturing in (False, True):
        monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: capturing)
        assert runtime.launch_mode_of(gpu) == ("graph" if capturing else "eager")
        assert runtime.launch_mode_of(torch.zeros(1)) == "eager"        # CPU tensors: never


def test_cpu_without_interpreter_asks_for_a_gpu(monkeypatch):
    # as if TRITON_INTERPRET were unset (render pins triton's knob once set, so patch the probe)
    monkeypatch.setattr(runtime, "interpreting", lambda: False)
    args, kw = _args(tiny())
    with pytest.raises(RuntimeError, match="need a CUDA or ROCm GPU.*TRITON_INTERPRET=1"):
        autossd.mamba_chunk_scan_combined(*args, 64, **kw)


def test_only_eager_calls_keep_a_workspace():
    """torch.compile runs the custom op; under mode="reduce-overhead" its warm-up allocates in the
    CUDA graph's pool without capturing, where a kept tensor fails torch's pool check: that path
    allocates every call. The eager drop-in keeps its intermediates."""
    from autossd.ops.ssd import chunk
    p = tiny(has_D=True)
    args, kw = _args(p)
    chunk.clear_workspaces()
    y_op, _, _ = torch.ops.autossd.ssd_fwd(*args, 64, kw["D"], None, None, None, None, None, False,
                                           0.0, float("inf"), False, False, None)
    assert not chunk._workspaces
    y = autossd.mamba_chunk_scan_combined(*args, 64, **kw)
    assert len(chunk._workspaces) == 1 and torch.equal(y, y_op)


def test_a_repeated_call_skips_the_checks_and_a_changed_one_is_checked_again(monkeypatch):
    """The drop-in keeps validated calls by their input signature: a call with new tensors of the
    same dtypes, shapes, strides and devices is not validated again, and runs on its own inputs;
    a call that differs in anything from_args checks is validated (and refused) as ever."""
    checked = []
    real = runtime.from_args
    monkeypatch.setattr(runtime, "from_args", lambda *a, **k: checked.append(1) or real(*a, **k))
    p = tiny(has_D=True, has_dt_bias=True, dt_softplus=True)
    for seed in (0, 1):
        args, kw = _args(p, seed=seed)
        y = autossd.mamba_chunk_scan_combined(*args, 64, **kw)
        assert rel_err(y, _reference(args, 64, kw)[0]) < tolerance("fp32")
    assert len(checked) == 1
    x, dt, A, B, C = args
    bad = [  # each differs from the cached call in one thing from_args checks
        (dict(chunk_size=64.0), ValueError, "chunk_size"),
        (dict(B=B.double()), TypeError, "B: dtype"),   # (a strided last dimension is copied, not refused)
        (dict(dt=dt.to(torch.int32)), TypeError, "dt"),
        (dict(D=torch.randn(3)), ValueError, "D: expected shape"),
        (dict(dt_limit=(1.0, 0.0)), ValueError, "dt_limit"),
        (dict(dt_limit=(0.0, "x")), ValueError, "dt_limit"),
        (dict(x=x.double()), TypeError, "x"),
        (dict(x=x.tolist()), TypeError, "x: expected a torch.Tensor"),   # no signature: checked
    ]
    for change, exc, match in bad:
        call = dict(x=x, dt=dt, A=A, B=B, C=C, chunk_size=64, **kw)
        call.update(change)
        with pytest.raises(exc, match=match):
            autossd.mamba_chunk_scan_combined(**call)
    n = len(checked)
    # the first call, and every bad one but chunk_size=64.0 and the two dt_limits: the drop-in
    # refuses those itself, before any key is built
    assert n == len(bad) - 2
    autossd.mamba_chunk_scan_combined(*args, 64, **kw)
    assert len(checked) == n
    runtime.clear_cache()
    autossd.mamba_chunk_scan_combined(*args, 64, **kw)
    assert len(checked) == n + 1


def test_a_recent_call_is_found_without_building_its_key(monkeypatch):
    """The last few validated calls are found by a guard check of the tensors (RecentCalls): a
    call with new tensors of the same metadata builds no key and runs on its own inputs; one
    that differs in strides, dtype, a None, or an argument builds the key (and is checked)."""
    built = []
    real = runtime._call_key
    monkeypatch.setattr(runtime, "_call_key", lambda *a, **k: built.append(1) or real(*a, **k))
    p = tiny(has_D=True, has_dt_bias=True, dt_softplus=True)
    for seed in (0, 1, 2):
        args, kw = _args(p, seed=seed)
        y = autossd.mamba_chunk_scan_combined(*args, 64, **kw)
        assert rel_err(y, _reference(args, 64, kw)[0]) < tolerance("fp32")
    assert len(built) == 1
    x, dt, A, B, C = args
    dt_t = torch.cat([dt, dt], dim=-1)[..., :dt.shape[-1]]   # same values, other strides
    changes = [dict(dt=dt_t), dict(x=x.double()), dict(D=None), dict(chunk_size=128)]
    for i, change in enumerate(changes):
        call = dict(x=x, dt=dt, A=A, B=B, C=C, chunk_size=64, **kw)
        call.update(change)
        try:
            autossd.mamba_chunk_scan_combined(**call)
        except TypeError:   # x in float64: refused by the checks the key leads to
            pass
        assert len(built) == 2 + i, change


def test_the_call_cache_is_bounded(monkeypatch):
    """At most _CALLS_MAX validated calls are kept; then the cache starts over."""
    monkeypatch.setattr(runtime, "_CALLS_MAX", 2)
    for l in (70, 130, 200, 70):
        args, kw = _args(tiny(has_D=True).replace(seqlen=l))
        y = autossd.mamba_chunk_scan_combined(*args, 64, **kw)
        assert rel_err(y, _reference(args, 64, kw)[0]) < tolerance("fp32")
        assert 1 <= len(runtime._calls) <= 2


def test_a_cached_call_follows_autossd_arch_and_checks_cu_seqlens(monkeypatch):
    """A hit still runs the kernel of the arch the device maps to now (AUTOSSD_ARCH may change
    between calls), and a call whose cu_seqlens differs from a checked one is checked."""
    ran = []
    real_run = runtime.Kernel.run
    monkeypatch.setattr(runtime.Kernel, "run", lambda self, *a, **k: ran.append(self.arch) or real_run(self, *a, **k))
    p = Problem(1, 150, 2, 16, 16, 1, "fp32", 64, has_seq_idx=True, return_varlen_states=True)
    args, kw = _args(p, seed=2)
    autossd.mamba_chunk_scan_combined(*args, 64, **kw)
    monkeypatch.setenv("AUTOSSD_ARCH", "sm80")
    autossd.mamba_chunk_scan_combined(*args, 64, **kw)
    assert ran == ["sm90", "sm80"]
    for bad, exc, match in ((kw["cu_seqlens"].to(torch.int16), TypeError, "cu_seqlens: expected int32"),
                            (kw["cu_seqlens"][:1], ValueError, "cu_seqlens: expected at least 2")):
        with pytest.raises(exc, match=match):
            autossd.mamba_chunk_scan_combined(*args, 64, **{**kw, "cu_seqlens": bad})


def test_a_kernel_keys_dt_limit_by_value(monkeypatch):
    """Kernel calls normalize dt_limit before keying: 0-d tensors hash by identity, so a cached
    key would otherwise let an in-place change to lo > hi skip the check."""
    p = tiny(has_D=True, has_dt_limit=True)
    k = autossd.get_kernel(p, "sm90")
    args, kw = _args(p)
    lo, hi = torch.tensor(0.001), torch.tensor(0.1)
    k(*args, **{**kw, "dt_limit": (lo, hi)})
    lo.fill_(1.0)
    hi.fill_(0.0)
    with pytest.raises(ValueError, match="dt_limit: expected lo <= hi"):
        k(*args, **{**kw, "dt_limit": (lo, hi)})
    with pytest.raises(ValueError, match="dt_limit: expected a pair of floats"):
        k(*args, **{**kw, "dt_limit": (0j, float("inf"))})


def test_a_kernel_checks_a_call_once_per_signature(monkeypatch):
    checked = []
    real = runtime.from_args
    monkeypatch.setattr(runtime, "from_args", lambda *a, **k: checked.append(1) or real(*a, **k))
    p = tiny(has_D=True)
    k = autossd.get_kernel(p, "sm90")
    for seed in (0, 1):
        args, kw = _args(p, seed=seed)
        assert rel_err(k(*args, **kw), _reference(args, 64, kw)[0]) < tolerance("fp32")
    assert len(checked) == 1
    with pytest.raises(ValueError, match="get_kernel for the new problem"):
        k(*_args(p.replace(seqlen=100))[0], **kw)
    with pytest.raises(TypeError, match="dt"):
        k(args[0], args[1].to(torch.int32), *args[2:], **kw)


def test_a_record_written_after_a_call_serves_the_next_call(tmp_path, monkeypatch):
    p = tiny(has_D=True)
    ran = []
    real_run = runtime.Kernel.run
    monkeypatch.setattr(runtime.Kernel, "run", lambda self, *a, **k: ran.append(self.config) or real_run(self, *a, **k))
    args, kw = _args(p)
    autossd.mamba_chunk_scan_combined(*args, 64, **kw)
    cfg = tuned_for(p)
    assert ran == [default_config("sm90", p)] != [cfg]
    add_records(str(tmp_path / "user.sqlite"), [make_record(p, cfg, "sm90", provenance="measured", time_ms=0.02)])
    autossd.mamba_chunk_scan_combined(*args, 64, **kw)
    assert ran[-1] == cfg


def test_bad_call_is_rejected_before_any_kernel():
    args, kw = _args(tiny())
    x, dt, A, B, C = args
    with pytest.raises(ValueError, match="^chunk_size"):
        autossd.mamba_chunk_scan_combined(x, dt, A, B, C, 0)
    with pytest.raises(ValueError, match="dt"):
        autossd.mamba_chunk_scan_combined(x, dt[:, :10], A, B, C, 64)


def test_tampered_user_db_warns_and_the_program_goes_on(tmp_path, caplog):
    p = tiny()
    path = tmp_path / "user.sqlite"
    add_records(str(path), [make_record(p, tuned_for(p), "sm90", provenance="measured", time_ms=0.02)])
    dbengine.dispose_engines()
    con = sqlite3.connect(str(path))
    (text,) = con.execute("SELECT config_json FROM tuned_records").fetchone()
    cfg = {**json.loads(text), "scan_block_m": 100}   # a value outside the knob's declared set
    con.execute("UPDATE tuned_records SET config_json = ?, device = 'x\"); import os; (\"'",
                (json.dumps(cfg, sort_keys=True),))
    con.commit()
    con.close()
    runtime.clear_cache()
    args, kw = _args(p)
    with caplog.at_level(logging.WARNING, logger="autossd.db"):
        y = autossd.mamba_chunk_scan_combined(*args, 64, **kw)
    assert rel_err(y, _reference(args, 64, kw)[0]) < tolerance("fp32")
    assert runtime.get_kernel(p, "sm90").source == "default"
    assert any("record skipped" in r.getMessage() for r in caplog.records)


# --- torch integration ---------------------------------------------------------------------
def test_opcheck_schema_fake_and_aot_dispatch():
    p = tiny(has_D=True, return_final_states=True)
    (x, dt, A, B, C), kw = _args(p)
    torch.library.opcheck(torch.ops.autossd.ssd_fwd.default,
                          (x, dt, A, B, C, 64, kw["D"], None, None, None, None, None, False, 0.0,
                           float("inf"), True, False, None))


def test_torch_compile_fullgraph_matches_eager():
    p = tiny(has_D=True, has_z=True, return_final_states=True)
    (x, dt, A, B, C), kw = _args(p)

    def layer(x, dt, A, B, C, D, z):
        y, final = autossd.mamba_chunk_scan_combined(x, dt, A, B, C, 64, D=D, z=z, return_final_states=True)
        return y * 2, final.sum()

    eager = layer(x, dt, A, B, C, kw["D"], kw["z"])
    torch._dynamo.reset()
    compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")(x, dt, A, B, C, kw["D"], kw["z"])
    assert all(torch.equal(a, b) for a, b in zip(eager, compiled))
    explain = torch._dynamo.explain(layer)(x, dt, A, B, C, kw["D"], kw["z"])
    assert explain.graph_break_count == 0 and explain.graph_count == 1


def test_torch_compile_fullgraph_takes_a_chunk_size_the_kernels_lack():
    p = tiny(has_D=True)
    (x, dt, A, B, C), kw = _args(p)

    def layer(x, dt, A, B, C, D):
        return autossd.mamba_chunk_scan_combined(x, dt, A, B, C, 100, D=D)

    torch._dynamo.reset()
    explain = torch._dynamo.explain(layer)(x, dt, A, B, C, kw["D"])
    assert explain.graph_break_count == 0 and explain.graph_count == 1
    compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")(x, dt, A, B, C, kw["D"])
    assert torch.equal(compiled, layer(x, dt, A, B, C, kw["D"]))


def test_choice_is_the_same_in_another_process(tmp_path):
    p = tiny(has_D=True)
    base = tuned_for(p)
    # four records that tie on everything the ranking uses except the config key
    recs = [make_record(p, base.replace(scan_warps=w), "sm90", provenance="measured", time_ms=0.02)
            for w in (8, 2, 4)]
    add_records(str(tmp_path / "user.sqlite"), recs)
    here = autossd.get_kernel(p, "sm90").config.key()
    code = ("import json, autossd; from autossd.problem import Problem; "
            f"p = Problem(**json.loads({json.dumps(json.dumps(p.key()))})); "
            "print(autossd.get_kernel(p, 'sm90').config.key())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.stdout.strip().splitlines()[-1] == here


# --- layouts mamba_ssm accepts -------------------------------------------------------------------
def _last_dim_strided(t: torch.Tensor) -> torch.Tensor:
    """The same values with a last dimension that is not contiguous (stored with the last two
    dimensions swapped, as a channels-last projection's output may be)."""
    out = t.transpose(-1, -2).contiguous().transpose(-1, -2)
    assert torch.equal(out, t) and out.stride(-1) != 1
    return out


def test_inputs_with_a_strided_last_dimension_give_the_same_result():
    p = Problem(1, 70, 2, 8, 8, 2, "fp32", 64, has_D=True, has_z=True, has_dt_bias=True, dt_softplus=True)
    args, kw = _args(p, seed=3)
    want = autossd.mamba_chunk_scan_combined(*args, 64, **kw)
    x, dt, A, B, C = args
    strided = dict(x=_last_dim_strided(x), B=_last_dim_strided(B), C=_last_dim_strided(C),
                   dt=dt.transpose(1, 2).contiguous().transpose(1, 2))
    for name in ("x", "B", "C", "dt"):
        one = {**dict(x=x, dt=dt, A=A, B=B, C=C), name: strided[name]}
        got = autossd.mamba_chunk_scan_combined(*one.values(), 64, **kw)
        assert torch.allclose(got, want, rtol=1e-5, atol=1e-5), name
    got = autossd.mamba_chunk_scan_combined(strided["x"], strided["dt"], A, strided["B"], strided["C"], 64,
                                            **{**kw, "z": _last_dim_strided(kw["z"])})
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-5)
    # a Kernel called directly takes them too
    k = autossd.get_kernel(p, "sm90")
    assert torch.allclose(k(strided["x"], dt, A, B, strided["C"], **kw), want, rtol=1e-5, atol=1e-5)


def test_get_kernel_converts_a_dict_once():
    p = tiny(has_D=True)
    runtime._problem_from_items.cache_clear()
    k = autossd.get_kernel(p.key(), "sm90")
    assert autossd.get_kernel(dict(p.key()), "sm90") is k
    info = runtime._problem_from_items.cache_info()
    assert (info.misses, info.hits) == (1, 1)
    with pytest.raises(ValueError, match="batch"):   # a float is no batch, however equal to an int
        autossd.get_kernel({**p.key(), "batch": 1.0}, "sm90")


def test_meta_tensors_are_refused_by_name():
    args, kw = _args(tiny())
    meta = [t.to("meta") for t in args]
    with pytest.raises(ValueError, match=r"^x: on device meta; autossd runs on CUDA/ROCm GPUs or the CPU"):
        autossd.mamba_chunk_scan_combined(*meta, 64)
    k = autossd.get_kernel(tiny(), "sm90")
    with pytest.raises(ValueError, match=r"^x: on device meta"):
        k(*meta)


def test_a_positive_A_is_taken_as_mamba_ssm_takes_it_on_every_call():
    args, kw = _args(tiny())
    x, dt, A, B, C = args
    pos = (x, dt, A.abs() * 0.05, B, C)   # a slowly growing state: finite over 130 steps
    ref = _reference(pos, 64, {})[0]
    for _ in range(2):   # the first call of a signature and a cached one alike
        assert rel_err(autossd.mamba_chunk_scan_combined(*pos, 64), ref) < tolerance("fp32")


@pytest.mark.parametrize("chunk", [32, 100, 512])
def test_a_chunk_size_the_kernels_lack_gives_the_same_result(chunk):
    args, kw = _args(tiny(has_D=True))
    ref = _reference(args, 64, kw)[0]
    assert rel_err(autossd.mamba_chunk_scan_combined(*args, chunk, **kw), ref) < tolerance("fp32")


def test_get_kernel_refuses_a_float_dimension_also_after_the_int_one_is_cached():
    shape = (1, 130, 2, 16, 16, 1, "fp32")
    autossd.get_kernel(shape, "sm90")
    with pytest.raises(ValueError, match=r"^seqlen: expected a positive int"):
        autossd.get_kernel((1, 130.0, 2, 16, 16, 1, "fp32"), "sm90")
    with pytest.raises(TypeError, match=r"^db: expected a path"):
        autossd.get_kernel(shape, "sm90", db=5)
    with pytest.raises(ValueError, match=r"^device: expected a GPU index"):
        autossd.get_kernel(shape, "sm90", device=-5)


@pytest.mark.parametrize("value", ["False", "true", 2, None, 0.0])
def test_dt_softplus_takes_bools_only(value):
    args, kw = _args(tiny())
    with pytest.raises(TypeError, match=r"^dt_softplus: expected a bool"):
        autossd.mamba_chunk_scan_combined(*args, 64, dt_softplus=value)


def test_a_default_pick_says_how_many_records_were_rejected(tmp_path):
    import sqlite3
    p = tiny()
    path = tmp_path / "user.sqlite"
    add_records(str(path), [make_record(p, tuned_for(p), "sm90", provenance="measured", time_ms=0.02)])
    dbengine.dispose_engines()
    con = sqlite3.connect(str(path))
    cols = [c[0] for c in con.execute("SELECT * FROM tuned_records").description]
    col = next((c for c in cols if c.endswith("bmm_warps")), None)
    if col is not None:   # a knob column, or the config's JSON
        con.execute(f'UPDATE tuned_records SET "{col}" = 3')
    else:
        (cfg,) = con.execute("SELECT config_json FROM tuned_records").fetchone()
        con.execute("UPDATE tuned_records SET config_json = ?", (json.dumps({**json.loads(cfg), "bmm_warps": 3}),))
    con.commit()
    con.close()
    runtime.clear_cache()
    k = autossd.get_kernel(p, "sm90")
    assert k.source == "default" and "1 record rejected (" in k.reason and "=3 is not allowed" in k.reason, k.reason
