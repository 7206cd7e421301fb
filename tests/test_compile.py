"""Cross-compilation for all four archs without a GPU; every knob offered on an arch changes
the compiled code there; configs over an arch's limits are rejected with the reason."""
import pytest

from autossd.arch import ARCHS
from autossd.compile import compile_config, meta_inputs
from autossd.problem import Problem
from autossd.render import render
from autossd.ops.ssd.fwd import SEQUENCES as STAGES_BY_DEPTH
from autossd.ops.ssd.fwd_knobs import KNOB_BY_NAME, KNOBS, Config, default_config, fit

PROB = Problem(batch=1, seqlen=4096, nheads=8, headdim=64, dstate=128, ngroups=1, dtype="bf16",
               has_D=True, has_z=True, has_dt_bias=True, dt_softplus=True, return_final_states=True)


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_default_compiles_with_resource_report(arch):
    rep = compile_config(default_config(arch, PROB), arch, PROB)
    assert rep.ok, rep.why()
    assert [s.stage for s in rep.stages] == ["cumsum", "bmm", "chunk_state", "state_passing", "chunk_scan"]
    for s in rep.stages:
        assert s.registers > 0 and s.occupancy >= 1 and s.spill_bytes == 0 and s.artifact_sha
    assert any(s.shared_bytes > 0 for s in rep.stages)
    if ARCHS[arch].is_amd:
        assert any(s.agprs > 0 for s in rep.stages)  # MFMA accumulators are reported


@pytest.mark.parametrize("arch", sorted(ARCHS))
@pytest.mark.parametrize("depth", [3, 1])
def test_fused_depths_compile_with_resource_report(arch, depth):
    rep = compile_config(fit(default_config(arch, PROB).replace(launches=depth), PROB), arch, PROB)
    assert rep.ok, rep.why()
    assert [s.stage for s in rep.stages] == list(STAGES_BY_DEPTH[depth])
    for s in rep.stages:
        # no spill check: the fused kernels spill on sm80/sm90 (an open item)
        assert s.registers > 0 and s.occupancy >= 1 and s.artifact_sha


# Which stages to compile to see a knob: its own, chunk_scan (it has both matmuls) for the rest,
# and all of them for the fusion depth (each depth launches other kernels).
def _stages(knob):
    if knob.name == "launches":
        return None
    if knob.stage == "chunk_state":   # (the Gluon walk takes the chunk state's place)
        return ("cumsum", "chunk_state", "state_walk")
    return (knob.stage if knob.stage != "all" else "chunk_scan",)


# what a knob's other values need of the default config to be feasible
NEEDS = {"walk_weights": {"state_walk": 1}, "walk_split": {"state_walk": 1, "scan_gluon": 3},
         "walk_block": {"state_walk": 1}}


def _offered(arch):
    return [(arch, k.name) for k in KNOBS if k.offered_on(ARCHS[arch])]


@pytest.mark.parametrize("arch,name", [p for a in sorted(ARCHS) for p in _offered(a)])
def test_every_offered_knob_changes_the_artifact(arch, name):
    knob = next(k for k in KNOBS if k.name == name)
    base = default_config(arch, PROB).replace(**NEEDS.get(name, {}))
    shas = set()
    for v in knob.values:
        cfg = base.replace(**{name: v})
        rep = compile_config(cfg, arch, PROB, stages=_stages(knob))
        if not rep.ok:
            continue
        shas.add(tuple(s.artifact_sha for s in rep.stages))
        if len(shas) > 1:
            return
    pytest.fail(f"{name} offered on {arch} but no two of its values compile differently")


def test_config_over_limits_is_rejected_with_reason():
    huge = Config(scan_block_m=128, scan_block_n=64, scan_block_k=128, scan_block_d=128, scan_stages=4,
                  bmm_stages=1, state_stages=1)
    rep = compile_config(huge, "gfx90a", PROB, stages=("chunk_scan",))
    assert not rep.ok
    assert any("shared memory" in w or "spills" in w or "occupancy" in w or "compile error" in w
               for w in rep.why()), rep.why()
    rep = compile_config(Config(kpack=2), "sm90", PROB)
    assert not rep.ok and "kpack=2 is not offered on sm90" in rep.why()[0]


# smem_pad > 0 swaps in the Gluon chunk state (chunk_state_gluon.jinja). The CPU interpreter
# cannot run Gluon (tests/test_render.py), so these cross-compiles are its CI coverage; the GPU
# check is scripts/gpu_validate.py's smem_pad cases.
def _pad_arches():
    return [a for a in sorted(ARCHS) if KNOB_BY_NAME["smem_pad"].offered_on(ARCHS[a])]


@pytest.mark.parametrize("arch", _pad_arches())
def test_smem_pad_is_the_gluon_kernel_and_its_shared_bytes_grow_with_the_pad(arch):
    base = default_config(arch, PROB)
    sizes = []
    for pad in sorted(v for v in KNOB_BY_NAME["smem_pad"].values if v):
        cfg = base.replace(smem_pad=pad)
        assert "@gluon.jit\ndef ssd_chunk_state(" in render(cfg, ARCHS[arch].backend)
        rep = compile_config(cfg, arch, PROB, stages=("chunk_state",))
        assert rep.ok, rep.why()
        sizes.append(rep.stages[0].shared_bytes)
    # x (64 x 64) and B (64 x 64) tiles, 2 bytes per element, each row followed by the pad
    assert sizes == sorted(set(sizes)) and sizes[0] > 2 * 64 * 64 * 2, sizes


SEQ_PROB = PROB.replace(dtype="fp16", ngroups=2, has_seq_idx=True, has_initial_states=True)


@pytest.mark.parametrize("arch", _pad_arches())
def test_smem_pad_compiles_every_stage_with_other_tiles_and_seq_idx(arch):
    # tiles that split the MMA's warps differently from the default, and the HAS_SEQ branch
    cfg = default_config(arch, SEQ_PROB).replace(smem_pad=2, state_block_m=32, state_block_n=128,
                                                 state_block_k=32, state_warps=8)
    rep = compile_config(cfg, arch, SEQ_PROB)
    assert rep.ok, rep.why()
    assert [s.stage for s in rep.stages] == ["cumsum", "bmm", "chunk_state", "state_passing", "chunk_scan"]


@pytest.mark.parametrize("arch", ["sm80", "sm90"])
def test_register_cap_bounds_the_registers_and_reports_its_spills(arch):
    # the chunk scan takes more than 64 registers left alone; capped at 64 it fits more CTAs per
    # SM (the point of the knob) but ptxas spills, into the stack frame: cuobjdump reports that
    # as STACK, not LOCAL (once misread as "no spills")
    base = default_config(arch, PROB)
    free = compile_config(base, arch, PROB, stages=("chunk_scan",)).stages[0]
    rep = compile_config(base.replace(scan_maxnreg=64), arch, PROB, stages=("chunk_scan",))
    capped = rep.stages[0]
    assert free.registers > 64 and free.spill_bytes == 0
    assert capped.registers <= 64 and capped.spill_bytes > 0 and capped.occupancy > free.occupancy
    # reported, not refused: only a measurement can say whether the occupancy pays for the spills
    assert rep.ok and rep.spills() == [f"chunk_scan: spills {capped.spill_bytes} bytes per thread"]


def test_register_cap_is_not_offered_on_amd():
    from autossd.ops.ssd.fwd_knobs import violations
    cfg = default_config("gfx942", PROB).replace(scan_maxnreg=64)
    assert any("scan_maxnreg=64 is not offered on gfx942" in w for w in violations(cfg, "gfx942", PROB))


# scan_gluon = 1 swaps in the Gluon chunk scan (chunk_scan_gluon.jinja); as for smem_pad, these
# cross-compiles are its CI coverage and scripts/gpu_validate.py's scan_gluon cases its GPU check.
@pytest.mark.parametrize("features", [{}, {"has_z": True, "D_has_hdim": True, "seqlen": 2000, "batch": 2},
                                      {"dstate": 64, "headdim": 128}])
def test_gluon_chunk_scan_fits_four_ctas_per_sm_without_spills(features):
    """Its design point (9-12% faster than the tl scan at the large shapes on the H100): 48 KB of shared
    memory and at most 128 registers,
    so 4 CTAs per SM, and nothing spilled, with every epilogue feature it takes."""
    prob = Problem(batch=1, seqlen=4096, nheads=8, headdim=64, dstate=128, ngroups=1, dtype="bf16",
                   has_D=True).replace(**features)
    cfg = default_config("sm90", prob).replace(scan_gluon=1)
    rep = compile_config(cfg, "sm90", prob, stages=("chunk_scan",))
    assert rep.ok, rep.why()
    (st,) = rep.stages
    assert st.registers <= 128 and st.spill_bytes == 0 and st.occupancy == 4
    assert 48 * 1024 <= st.shared_bytes <= 49 * 1024
    # the tl scan of the same config compiles to a different artifact
    tl = compile_config(cfg.replace(scan_gluon=0), "sm90", prob, stages=("chunk_scan",))
    assert tl.stages[0].artifact_sha != st.artifact_sha


# state_walk = 1 swaps the chunk state and the state passing for the Gluon walk
# (state_walk_gluon.jinja); these cross-compiles are its CI coverage, gpu_validate.py's
# state_walk cases its GPU check.
@pytest.mark.parametrize("features", [{}, {"seqlen": 1000, "batch": 2, "has_initial_states": True,
                                           "return_final_states": True, "ngroups": 2},
                                      {"dstate": 64, "headdim": 128}, {"dstate": 256}])
def test_gluon_walk_replaces_two_stages_in_two_ctas_per_sm_without_spills(features):
    """Its design point (8-35% faster than the two stages on the H100): a two-stage ring of 128-token
    blocks, one warpgroup,
    nothing spilled, two CTAs per SM; four launches in all."""
    prob = Problem(batch=1, seqlen=4096, nheads=8, headdim=64, dstate=128, ngroups=1, dtype="fp16",
                   has_D=True).replace(**features)
    cfg = default_config("sm90", prob).replace(state_walk=1, state_dtype="fp16")
    rep = compile_config(cfg, "sm90", prob)
    assert rep.ok, rep.why()
    assert [s.stage for s in rep.stages] == ["cumsum", "bmm", "state_walk", "chunk_scan"]
    st = rep.stages[2]
    assert st.spill_bytes == 0 and st.occupancy >= 2 and st.shared_bytes <= 116 * 1024


# walk_split > 1 cuts the walk into segments: a join launch, and the chunk-walking scan completing
# each segment's states in shared memory before its first MMA (gpu_validate.py's walk_split cases
# are the GPU check)
@pytest.mark.parametrize("split,features", [(2, {}), (4, {"seqlen": 1000, "batch": 2, "has_initial_states": True,
                                                      "return_final_states": True, "ngroups": 2}),
                                            (8, {"dstate": 64}), (3, {"has_z": True})])
def test_walk_split_keeps_the_walk_and_scan_occupancy_without_spills(split, features):
    prob = Problem(batch=1, seqlen=16384, nheads=8, headdim=64, dstate=128, ngroups=1, dtype="fp16",
                   has_D=True).replace(**features)
    whole = default_config("sm90", prob).replace(state_walk=1, walk_weights=1, scan_gluon=3, state_dtype="fp16")
    rep = compile_config(whole.replace(walk_split=split), "sm90", prob)
    assert rep.ok, rep.why()
    assert [s.stage for s in rep.stages] == ["cumsum", "bmm", "state_walk", "walk_join", "chunk_scan"]
    ref = {s.stage: s for s in compile_config(whole, "sm90", prob).stages}
    for s in rep.stages:
        assert s.spill_bytes == 0, s
        if s.stage in ref:   # the segments' bookkeeping costs no CTA per SM
            assert s.occupancy == ref[s.stage].occupancy and s.shared_bytes == ref[s.stage].shared_bytes, s


# walk_block = 64 halves the walk's ring blocks: 66 KB of shared memory and 132-155 registers at
# dstate 128, so a third CTA per SM (gpu_validate.py's walk_block cases are the GPU check)
@pytest.mark.parametrize("features", [{}, {"walk_weights": 0}, {"walk_split": 4, "scan_gluon": 3},
                                      {"dstate": 64}, {"bf16": True}])
def test_walk_block_64_fits_three_walk_ctas_per_sm_without_spills(features):
    features = dict(features)
    dtype = "bf16" if features.pop("bf16", False) else "fp16"
    prob = Problem(batch=8, seqlen=2048, nheads=80, headdim=64, dstate=features.pop("dstate", 128), ngroups=1,
                   dtype=dtype, has_D=True)
    cfg = default_config("sm90", prob).replace(**{"state_walk": 1, "walk_weights": 1, "scan_gluon": 1,
                                                  "state_dtype": dtype, **features})
    rep = compile_config(cfg.replace(walk_block=64), "sm90", prob)
    assert rep.ok, rep.why()
    walk = {s.stage: s for s in rep.stages}["state_walk"]
    ref = {s.stage: s for s in compile_config(cfg, "sm90", prob).stages}["state_walk"]
    assert walk.spill_bytes == 0 and walk.shared_bytes <= 72 * 1024, walk
    # dstate 128: 2 CTAs per SM at 128-token blocks, 3 at 64; dstate 64 (64-wide B blocks): 3 and 5
    assert walk.occupancy > ref.occupancy and walk.occupancy >= 3 and walk.shared_bytes < ref.shared_bytes, (walk, ref)


# pdl = 1 launches every kernel with programmatic dependent launch; the GPU check is
# gpu_validate.py's pdl cases. Here: each kernel of each depth-5 variant is launched with it, and
# waits (griddepcontrol.wait) before its first access to global memory (compile.pdl_order_reasons
# makes that a reason to refuse the config, so `rep.ok` says it).
@pytest.mark.parametrize("over,pdl", [({}, 1), ({"fold_prep": 1}, 1), ({"smem_pad": 4}, 1),
                                      ({"fold_prep": 2, "state_walk": 1, "scan_gluon": 1, "state_dtype": "fp16"}, 1),
                                      ({"fold_prep": 2, "state_walk": 1, "scan_gluon": 1, "state_dtype": "fp16"}, 2),
                                      ({"scan_gluon": 1, "state_dtype": "fp16"}, 2),
                                      ({"fold_prep": 2, "state_walk": 1, "scan_gluon": 1, "state_dtype": "fp16"}, 3)])
def test_pdl_kernels_wait_before_their_first_memory_access(over, pdl):
    """pdl = 2's chunk scan reads before its wait (what earlier launches wrote), but writes only
    after it: the order check allows it that and no more (compile.pdl_order_reasons)."""
    prob = PROB.replace(dtype="fp16")
    base = default_config("sm90", prob).replace(**over)
    on = compile_config(base.replace(pdl=pdl), "sm90", prob)
    assert on.ok, on.why()
    assert len(on.stages) >= 3 and all(s.pdl for s in on.stages), [(s.stage, s.pdl) for s in on.stages]
    off = compile_config(base, "sm90", prob)
    assert off.ok and not any(s.pdl for s in off.stages)
    # the wait and the release cost no registers worth a CTA
    assert [s.occupancy for s in on.stages] == [s.occupancy for s in off.stages]


def test_pdl_order_check_names_an_access_before_the_wait():
    from autossd.compile import pdl_order_reasons
    ok = "ld.param.u64 %rd1, [k_param_0];\ngriddepcontrol.wait;\nld.global.b32 %r1, [%rd1];\n"
    assert pdl_order_reasons(ok) == []
    early = "@%p1 ld.global.b32 %r1, [%rd1];\ngriddepcontrol.wait;\n"
    assert "ld.global.b32" in pdl_order_reasons(early)[0]
    tma = "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%r1], [%rd1, {%r2, %r3}], [%r4];\ngriddepcontrol.wait;\n"
    assert "cp.async.bulk.tensor" in pdl_order_reasons(tma)[0]
    assert "no griddepcontrol.wait" in pdl_order_reasons("st.global.b32 [%rd1], %r1;\n")[0]
    # loads_first: reads and copies into shared memory may come first, writes may not
    assert pdl_order_reasons(early + tma, loads_first=True) == []
    assert "st.global" in pdl_order_reasons("st.global.b32 [%rd1], %r1;\ngriddepcontrol.wait;\n",
                                            loads_first=True)[0]
    tma_store = "cp.async.bulk.tensor.2d.global.shared::cta.bulk_group [%rd1, {%r2, %r3}], [%r4];\ngriddepcontrol.wait;\n"
    assert "cp.async.bulk.tensor.2d.global" in pdl_order_reasons(tma_store, loads_first=True)[0]


@pytest.mark.parametrize("features", [{"seqlen": 1000, "batch": 2, "has_initial_states": True,
                                       "return_final_states": True, "ngroups": 2, "has_z": True},
                                      {"dstate": 64, "headdim": 128}])
def test_pdl_follow_compiles_with_every_feature_in_four_ctas_per_sm(features):
    """pdl = 3 (the scan follows the walk's flags) on a ragged, batched, grouped call with initial
    and final states, and on dstate 64: nothing spilled, the scan still at 4 CTAs per SM."""
    prob = Problem(batch=1, seqlen=4096, nheads=8, headdim=64, dstate=128, ngroups=1, dtype="fp16",
                   has_D=True).replace(**features)
    cfg = default_config("sm90", prob).replace(pdl=3, state_walk=1, scan_gluon=1, fold_prep=2, state_dtype="fp16")
    rep = compile_config(cfg, "sm90", prob)
    assert rep.ok, rep.why()
    assert [s.stage for s in rep.stages] == ["prep", "state_walk", "chunk_scan"]
    assert all(s.pdl and s.spill_bytes == 0 for s in rep.stages)
    assert rep.stages[2].occupancy >= 4 and rep.stages[1].occupancy >= 2


# walk_weights = 1: the launch that computes dt' and dA writes the walk's per-token weights and
# the walk loads them; these cross-compiles and plans are its CI coverage (the interpreter
# cannot run the walk: tests/test_chunk.py runs the weights' write), gpu_validate.py's walk cases
# its GPU check.
@pytest.mark.parametrize("fold,pdl", [(0, 0), (2, 0), (2, 3)])
def test_walk_weights_written_for_the_walk_and_loaded_by_it(fold, pdl):
    """The weights are written when the walk runs (HAS_W) and the walk takes them in dt's place;
    on a ragged, batched, grouped call with initial and final states: nothing spilled, the walk
    still two CTAs per SM and no more registers than the walk that computes them."""
    from autossd.ops.ssd.chunk import allocate, plan
    from autossd.render import _interpret
    prob = Problem(batch=2, seqlen=1000, nheads=8, headdim=64, dstate=128, ngroups=2, dtype="fp16",
                   has_D=True, has_initial_states=True, return_final_states=True)
    off = default_config("sm90", prob).replace(state_walk=1, state_dtype="fp16", fold_prep=fold,
                                               scan_gluon=int(pdl > 0), pdl=pdl)
    on = off.replace(walk_weights=1)
    assert on.walk_weights == 1
    with _interpret(False):   # meta tensors stand for an sm90 GPU: the walk runs
        buf = allocate(prob, on, "meta")
        launches = {ln.stage: ln for ln in plan(prob, on, meta_inputs(prob), buf)}
    first = launches["prep" if fold else "cumsum"]
    assert first.constexprs["HAS_W"] is True and first.args["w_out_ptr"] is buf.w
    assert buf.w.shape == buf.dt.shape and buf.w.dtype == buf.dt.dtype
    assert launches["state_walk"].args["w_ptr"] is buf.w and "dt_ptr" not in launches["state_walk"].args
    reps = {}
    for name, cfg in (("off", off), ("on", on)):
        rep = compile_config(cfg, "sm90", prob)
        assert rep.ok, (name, rep.why())
        reps[name] = {s.stage: s for s in rep.stages}
    walk_on, walk_off = reps["on"]["state_walk"], reps["off"]["state_walk"]
    assert walk_on.spill_bytes == 0 and walk_on.occupancy >= 2
    assert walk_on.registers <= walk_off.registers and walk_on.artifact_sha != walk_off.artifact_sha
    assert all(s.spill_bytes == 0 for s in reps["on"].values())



# scan_gluon = 2: one program per chunk and head (chunk_scan_gluon.jinja's
# ssd_chunk_scan_gluon_chunk); these cross-compiles are its CI coverage, gpu_validate.py's
# --scan-chunk-only cases its GPU check.
@pytest.mark.parametrize("features", [{}, {"seqlen": 1000, "batch": 2, "has_z": True, "D_has_hdim": True,
                                           "has_initial_states": True, "return_final_states": True, "ngroups": 2},
                                      {"dstate": 64, "headdim": 128}, {"chunk_size": 128}, {"chunk_size": 64}])
@pytest.mark.parametrize("value", [2, 3])
def test_chunk_walking_gluon_scan_fits_three_ctas_per_sm_without_spills(features, value):
    """Its design point (5-7% faster than scan_gluon = 1 at the large shapes on the H100): the state
    tile and the chunk's x blocks resident
    (72 KB at 256-token chunks), at most 168 registers (its launch's cap), so 3 CTAs per SM,
    nothing spilled, with every epilogue feature it takes; one program per chunk and head.
    scan_gluon = 3 is the same program storing y by TMA through a ring stage (10-15% off the scan): the
    same budget."""
    from autossd.ops.ssd.chunk import allocate, plan
    from autossd.render import _interpret
    prob = Problem(batch=1, seqlen=4096, nheads=8, headdim=64, dstate=128, ngroups=1, dtype="fp16",
                   has_D=True).replace(**features)
    cfg = default_config("sm90", prob).replace(scan_gluon=value, state_dtype="fp16")
    with _interpret(False):
        (scan,) = [ln for ln in plan(prob, cfg, meta_inputs(prob), allocate(prob, cfg, "meta"))
                   if ln.stage == "chunk_scan"]
    assert scan.kernel == "ssd_chunk_scan_gluon_chunk" and scan.options["maxnreg"] == 168
    assert ("y_desc" in scan.args) == (value == 3)
    assert scan.grid == ((prob.headdim // 64) * prob.nheads, -(-prob.seqlen // cfg.chunk_size), prob.batch)
    rep = compile_config(cfg, "sm90", prob, stages=("chunk_scan",))
    assert rep.ok, rep.why()
    (st,) = rep.stages
    assert st.registers <= 168 and st.spill_bytes == 0 and st.occupancy == 3
    assert st.shared_bytes <= 73 * 1024 + 1024
    one = compile_config(cfg.replace(scan_gluon=1), "sm90", prob, stages=("chunk_scan",))
    assert one.stages[0].artifact_sha != st.artifact_sha


def test_a_cubin_seen_before_takes_its_resource_report_from_memory(monkeypatch):
    """cuobjdump runs once per distinct cubin (a tune compiles the same configs at many shapes);
    the report of a cubin seen before comes from memory. (Under the interpreter the compiles run
    in a worker process of their own, so the memo is checked here on its own.)"""
    from autossd import compile as comp
    monkeypatch.setattr(comp, "_RESOURCES", {})
    calls = []
    monkeypatch.setattr(comp, "_cuobjdump_resources", lambda cubin: calls.append(cubin) or (len(cubin), 0))
    assert comp._nvidia_resources(b"cubin-a") == (7, 0)
    assert comp._nvidia_resources(b"cubin-a") == (7, 0)
    assert comp._nvidia_resources(b"cubin-bb") == (8, 0)
    assert calls == [b"cubin-a", b"cubin-bb"]


def test_a_compile_worker_that_dies_is_replaced_rather_than_waited_for():
    """In the interpreter, compiles go to a spawned worker. One killed between two compiles (or
    one whose result cannot be read back) must not leave the caller waiting forever for a lost
    task, as multiprocessing's Pool did: the next compile gets a new worker."""
    import threading

    from autossd import compile as comp
    from autossd.render import interpreting
    if not interpreting():
        pytest.skip("compiles run in this process, not in a worker")
    p = Problem(1, 256, 2, 64, 64, 1, "fp16")
    cfg = default_config("sm90", p)
    assert compile_config(cfg, "sm90", p).ok
    for proc in list(comp._pool._processes.values()):
        proc.kill()
        proc.join()
    got = []
    t = threading.Thread(target=lambda: got.append(compile_config(cfg, "sm90", p)), daemon=True)
    t.start()
    t.join(600)   # generous: a loaded machine is only slow; a lost task never ends
    assert got and got[0].ok


# Packed prefill on sm90 runs the forward's Gluon walk and chunk-walking scan over the chunk table
# (state_walk = 1 with scan_gluon = 2 or 3): the same templates in their packed form. These
# cross-compiles are its CI coverage; `scripts/bench_varlen.py --check --config ...` is its GPU
# check against float64.
@pytest.mark.parametrize("scan,walk_block,flags,dims", [
    (3, 128, {"has_D": True, "has_dt_bias": True, "dt_softplus": True, "has_init": True}, (80, 64, 128, 1, 256)),
    (2, 64, {"has_z": True, "D_has_hdim": True, "has_D": True}, (8, 128, 64, 2, 128)),
    (3, 64, {}, (8, 64, 128, 1, 64))])
def test_packed_prefill_runs_the_forwards_gluon_walk_and_scan_without_spills(scan, walk_block, flags, dims):
    from autossd.ops.ssd import varlen as vl
    h, p, n, g, q = dims
    prob = vl.problem_for(8192, 16, h, p, n, g, q, "bf16", **flags)
    cfg = vl.default_config("sm90", prob).replace(scan_gluon=scan, walk_block=walk_block)
    assert cfg.state_walk == 1   # the sm90 default where the problem fits the Gluon pair
    rep = compile_config(cfg, "sm90", prob)
    assert rep.ok, rep.why()
    assert [s.stage for s in rep.stages] == ["cumsum", "bmm", "state_walk", "chunk_scan"]
    walk, scan_st = rep.stages[2], rep.stages[3]
    assert walk.spill_bytes == 0 and scan_st.spill_bytes == 0
    # the walk's ring: two stages of x and B blocks; the scan: x resident, a three-stage ring,
    # its 168-register cap (three CTAs an SM)
    assert walk.occupancy >= (2 if min(q, walk_block) == 128 else 3)
    assert scan_st.occupancy >= 3
    # the forward's own walk and scan render the same templates in their dense form
    assert vl.includes(cfg, "cuda")[-3:] == ["state_walk_gluon.jinja", "chunk_scan.jinja", "chunk_scan_gluon.jinja"]
