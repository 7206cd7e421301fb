"""The generated kernels of every fusion depth (5, 3, 1 launches) against the float64 reference,
in Triton's interpreter on the CPU (on a GPU when there is one): every contract feature, every
state dtype, fp32/bf16/fp16 inputs, several configs. Fresh random inputs per case, outputs
poisoned with NaN before each run."""
import random
import types

import pytest
import torch
import triton

from autossd.arch import local_arch
from autossd.ops.ssd.chunk import ssd_forward
from autossd.ops.ssd.naive import ssd_chunked
from autossd.problem import Problem
from autossd.ops.ssd.fwd_knobs import KNOBS, Config, fit, violations
from autossd.testing import StubKernel, call_kwargs, make_inputs, rel_err, replayed_as_planned, tolerance

DEV = "cuda" if torch.cuda.is_available() else "cpu"
# configs must be feasible where they run; the interpreter is checked as sm80 (no arch-specific
# miscompile rules: space.violations refuses some single-launch tiles on sm90 only)
ARCH = (local_arch() or "sm80") if DEV == "cuda" else "sm80"
TORCH = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
# Small tiles keep the interpreter quick; the GPU suite (scripts/gpu_validate.py) runs defaults.
SMALL = Config(chunk_size=64, cumsum_block_h=2, bmm_block_m=16, bmm_block_n=32, bmm_block_k=16,
               state_block_m=16, state_block_n=16, state_block_k=32, pass_block=64,
               scan_block_m=32, scan_block_n=16, scan_block_k=16, scan_block_d=16)
FULL = dict(has_D=True, D_has_hdim=True, has_z=True, has_dt_bias=True, dt_softplus=True,
            has_dt_limit=True, has_initial_states=True, has_seq_idx=True, return_final_states=True)
_seed = iter(range(10_000, 20_000))


@pytest.fixture(params=[5, 3, 1], ids=lambda d: f"launches{d}")
def depth(request):
    return request.param


def check(prob: Problem, cfg: Config, depth: int = 5):
    """Run the kernels of `depth` and the reference on fresh inputs; assert every output is
    within the dtype-aware tolerance."""
    cfg = fit(cfg.replace(launches=depth), prob)
    why = violations(cfg, ARCH, prob)
    if why and DEV == "cuda" and all("miscompiled" in w for w in why):
        pytest.skip(f"refused on {ARCH}: {why}")
    assert not why, why
    t = make_inputs(prob, DEV, seed=next(_seed))
    kw = call_kwargs(prob, t)
    out = ssd_forward(t["x"], t["dt"], t["A"], t["B"], t["C"], cfg.chunk_size, config=cfg, poison=True,
                      state_dtype=TORCH[cfg.state_dtype], **kw)
    out = out if isinstance(out, tuple) else (out,)
    ref_kw = {k: v for k, v in kw.items() if not k.startswith("return_")}
    y_ref, f_ref, v_ref = ssd_chunked(t["x"], t["dt"], t["A"], t["B"], t["C"], cfg.chunk_size, **ref_kw)
    tol = tolerance(prob.dtype, cfg.state_dtype)
    assert out[0].dtype == TORCH[prob.dtype] and out[0].shape == t["x"].shape
    errs = {"y": rel_err(out[0], y_ref)}
    i = 1
    if prob.return_final_states:
        assert out[i].dtype == torch.float32
        errs["final"] = rel_err(out[i], f_ref)
        i += 1
    if prob.return_varlen_states:
        errs["varlen"] = rel_err(out[i], v_ref)
    assert all(e <= tol for e in errs.values()), (errs, tol)
    return errs


# every (input dtype, state dtype) pair once, at a depth chosen so that each depth sees every
# input dtype and every state dtype (a Latin square: 9 interpreted runs instead of 27), and the
# production pair (bf16 inputs, fp32 states) at every depth
_DT = ["fp32", "fp16", "bf16"]
_SQUARE = [(d, s, (5, 3, 1)[(i + j) % 3]) for i, d in enumerate(_DT) for j, s in enumerate(_DT)]


@pytest.mark.parametrize("dtype,state_dtype,depth_", _SQUARE + [("bf16", "fp32", d) for d in (5, 3, 1)
                                                                if ("bf16", "fp32", d) not in _SQUARE])
def test_every_feature_every_dtype(dtype, state_dtype, depth_):
    prob = Problem(batch=2, seqlen=150, nheads=4, headdim=16, dstate=16, ngroups=2, dtype=dtype, **FULL)
    check(prob, SMALL.replace(state_dtype=state_dtype), depth_)


FOLDED = {1: ["ssd_chunk_state_prep", "ssd_state_passing", "ssd_chunk_scan"],
          2: ["ssd_prep", "ssd_chunk_state", "ssd_state_passing", "ssd_chunk_scan"]}


@pytest.mark.parametrize("fold", [1, 2])
@pytest.mark.parametrize("dtype,state_dtype", [("fp32", "fp32"), ("fp16", "fp16"), ("bf16", "fp32")])
def test_fold_prep_every_feature(dtype, state_dtype, fold):
    # fold 1: several state tiles per (batch, chunk, head), all writing that chunk's dt' and dA,
    # and several C·Bᵀ tiles per chunk and group after them in the same grid; fold 2: the C·Bᵀ
    # tiles, then blocks of heads' cumsums (two blocks of 2 here), in one grid of their own; two
    # chunks, the second ragged, the first passing its state on
    prob = Problem(batch=2, seqlen=86, nheads=4, headdim=32, dstate=32, ngroups=2, dtype=dtype, **FULL)
    cfg = SMALL.replace(state_dtype=state_dtype, fold_prep=fold, cumsum_block_h=2)
    assert [ln.kernel for ln in _launches(prob, cfg)] == FOLDED[fold]
    check(prob, cfg, 5)


@pytest.mark.parametrize("fold", [1, 2])
@pytest.mark.parametrize("seqlen", [1, 64, 300])
def test_fold_prep_with_ragged_and_single_chunks(seqlen, fold):
    prob = Problem(batch=1, seqlen=seqlen, nheads=3, headdim=16, dstate=16, ngroups=1, dtype="fp16",
                   has_D=True, dt_softplus=True, has_dt_bias=True, return_final_states=True)
    check(prob, SMALL.replace(fold_prep=fold, bmm_block_m=16, bmm_block_n=16), 5)


@pytest.mark.parametrize("fold,pdl", [(0, 1), (1, 1), (2, 2), (2, 3)])
def test_pdl_launches_run_the_same_kernels_to_the_same_bits(fold, pdl):
    """pdl = 1 adds a wait-then-release at the top of every depth-5 kernel and a launch option.
    In the interpreter the launches run in order and the wait is compiled out (inline PTX), so
    the result is bitwise pdl = 0's, and within tolerance of float64: the rendering with the
    helpers runs, on every kernel of the depth. (On sm90, gpu_validate.py's pdl cases; one batch
    row: the wait and release open each kernel whatever its program's row.)"""
    if DEV == "cuda" and ARCH != "sm90":
        pytest.skip("pdl is sm90's")
    prob = Problem(batch=1, seqlen=150, nheads=4, headdim=16, dstate=16, ngroups=2, dtype="fp16", **FULL)
    base = fit(SMALL.replace(fold_prep=fold, state_dtype="fp16", scan_gluon=int(pdl >= 2),
                             state_walk=int(pdl == 3)), prob)
    on = base.replace(pdl=pdl)   # (the Gluon kernels need a GPU: here their tl fallbacks run)
    assert on.pdl == pdl and all(ln.options.get("launch_pdl") for ln in _launches(prob, on))
    t = make_inputs(prob, DEV, seed=next(_seed))
    kw = call_kwargs(prob, t)
    outs = [ssd_forward(t["x"], t["dt"], t["A"], t["B"], t["C"], 64, config=c, poison=True,
                        state_dtype=torch.float16, **kw) for c in (base, on)]
    for a, b in zip(*outs):
        assert torch.equal(a, b)
    ref_kw = {k: v for k, v in kw.items() if not k.startswith("return_")}
    y_ref, f_ref, _ = ssd_chunked(t["x"], t["dt"], t["A"], t["B"], t["C"], 64, **ref_kw)
    tol = tolerance("fp16", "fp16")
    assert rel_err(outs[1][0], y_ref) <= tol and rel_err(outs[1][1], f_ref) <= tol


@pytest.mark.parametrize("fold", [0, 2])
@pytest.mark.parametrize("seqlen", [150, 128])
def test_walk_weights_are_written_by_the_cumsum(fold, seqlen):
    """walk_weights = 1: the launch that computes dt' and dA (the cumsum, or the prep at fold 2)
    also writes each token's weight in its chunk's state, exp(dA_last - dA_t) dt'_t, which the
    Gluon walk loads (on sm90: gpu_validate.py's walk cases). It writes them only when the walk
    runs (HAS_W, set by plan() from the walk's launch): here, where the walk cannot run, the tl
    stages run bitwise as walk_weights = 0, and the write itself is run with HAS_W set, against
    float64, 0 past the sequence's end."""
    from autossd.ops.ssd.chunk import allocate, plan, run
    from autossd.ops.ssd.naive import process_dt
    from autossd.render import load
    prob = Problem(batch=2, seqlen=seqlen, nheads=4, headdim=64, dstate=64, ngroups=2, dtype="fp16",
                   has_dt_bias=True, dt_softplus=True, has_dt_limit=True, return_final_states=True)
    base = fit(SMALL.replace(fold_prep=fold, state_dtype="fp16", state_walk=1, state_block_m=64, state_block_n=64,
                             scan_block_n=64, scan_block_d=64), prob)   # wide tiles: fewer programs to interpret
    cfg = base.replace(walk_weights=1)
    assert cfg.walk_weights == 1 and violations(cfg, "sm90", prob) == []
    t = make_inputs(prob, DEV, seed=next(_seed))
    kw = call_kwargs(prob, t)
    if DEV == "cpu" and (fold, seqlen) == (0, 150):   # the tl stages, bitwise walk_weights = 0's
        row = prob.replace(batch=1)   # (one batch row: the configs' kernels are the same)
        assert fit(base, row) == base and fit(cfg, row) == cfg
        t1 = make_inputs(row, DEV, seed=next(_seed))
        kw1 = call_kwargs(row, t1)
        outs = [ssd_forward(t1["x"], t1["dt"], t1["A"], t1["B"], t1["C"], 64, config=c, poison=True,
                            state_dtype=torch.float16, **kw1) for c in (base, cfg)]
        for a, b in zip(*outs):
            assert torch.equal(a, b)
    buf = allocate(prob, cfg, DEV, poison=True)
    ln = plan(prob, cfg, t, buf, dt_limit=kw["dt_limit"])[0]
    assert ln.kernel == ("ssd_prep" if fold else "ssd_cumsum")
    assert ln.constexprs["HAS_W"] is (DEV == "cuda" and ARCH == "sm90")   # (test_compile: set there)
    ln.constexprs["HAS_W"] = True
    run([ln], load(cfg))
    q, nc = 64, -(-seqlen // 64)
    dtp = process_dt(t["dt"], t["dt_bias"], True, kw["dt_limit"])                     # (b, l, h)
    dtp = torch.nn.functional.pad(dtp, (0, 0, 0, nc * q - seqlen)).reshape(2, nc, q, 4).permute(0, 3, 1, 2)
    cs = torch.cumsum(dtp * t["A"].double()[None, :, None, None], dim=-1)             # (b, h, c, q)
    ref = torch.exp(cs[..., -1:] - cs) * dtp
    assert not buf.w.isnan().any()
    assert rel_err(buf.w, ref) <= 1e-5
    assert not buf.w.reshape(2, 4, nc * q)[..., seqlen:].any()   # 0 past the end: the walk loads them


def _launches(prob, cfg):
    from autossd.compile import meta_inputs
    from autossd.ops.ssd.chunk import allocate, plan
    t = meta_inputs(prob)
    return plan(prob, cfg, t, allocate(prob, cfg, "meta"))


@pytest.mark.parametrize("pass_stages", [2, 4])
@pytest.mark.parametrize("seqlen", [1, 64, 300])
def test_pass_stages_pipeline_the_state_passing_to_the_same_bits(seqlen, pass_stages):
    """pass_stages > 1: the state passing's loads come through tl.range's cp.async ring instead
    of a one-chunk prefetch in registers. Every feature the stage sees (initial states, seq_idx
    resets, final and varlen states, a ragged last chunk, a single token) against float64, then
    the same inputs through pass_stages = 1: the same arithmetic in the same order, so the same
    bits."""
    prob = Problem(batch=1, seqlen=seqlen, nheads=2, headdim=16, dstate=16, ngroups=1, dtype="fp16",
                   **{**FULL, "return_varlen_states": True})   # (varlen states: one packed batch)
    cfg = fit(SMALL.replace(launches=5, state_dtype="fp32", pass_stages=pass_stages), prob)
    assert cfg.pass_stages == pass_stages and violations(cfg, ARCH, prob) == []
    check(prob, cfg)
    t = make_inputs(prob, DEV, seed=next(_seed))
    kw = call_kwargs(prob, t)
    outs = [ssd_forward(t["x"], t["dt"], t["A"], t["B"], t["C"], cfg.chunk_size, config=c, poison=True,
                        state_dtype=torch.float32, **kw) for c in (cfg, cfg.replace(pass_stages=1))]
    assert len(outs[0]) == 3
    for a, b in zip(*outs):
        assert torch.equal(a, b)


@pytest.mark.parametrize("chunk", [64, 128, 256])
def test_chunk_sizes_with_ragged_length(chunk, depth):
    prob = Problem(batch=1, seqlen=2 * chunk + 37, nheads=2, headdim=16, dstate=16, ngroups=1, dtype="fp16",
                   has_D=True, dt_softplus=True, has_initial_states=True, return_final_states=True)
    cfg = SMALL.replace(chunk_size=chunk, scan_block_m=64, bmm_block_m=64, bmm_block_n=64, state_block_k=64,
                        scan_block_k=64)
    check(prob, cfg, depth)


@pytest.mark.parametrize("ngroups", [1, 4])
def test_ngroups_one_and_equal_to_nheads(ngroups, depth):
    prob = Problem(batch=1, seqlen=100, nheads=4, headdim=16, dstate=32, ngroups=ngroups, dtype="fp32",
                   has_D=True, has_z=True, dt_softplus=True, return_final_states=True)
    check(prob, SMALL, depth)


@pytest.mark.parametrize("seqlen", [1, 64])
def test_single_token_and_exact_chunk(seqlen, depth):
    prob = Problem(batch=2, seqlen=seqlen, nheads=2, headdim=16, dstate=16, ngroups=1, dtype="fp32",
                   has_D=True, has_initial_states=True, has_seq_idx=True, return_final_states=True)
    check(prob, SMALL, depth)


def test_no_optional_inputs(depth):
    prob = Problem(batch=1, seqlen=90, nheads=2, headdim=16, dstate=16, ngroups=1, dtype="bf16")
    check(prob, SMALL, depth)


def test_varlen_states(depth):
    prob = Problem(batch=1, seqlen=200, nheads=2, headdim=16, dstate=16, ngroups=1, dtype="fp16",
                   has_seq_idx=True, return_varlen_states=True, return_final_states=True, dt_softplus=True,
                   has_initial_states=True)
    check(prob, SMALL, depth)


def test_headdim_and_dstate_not_multiples_of_tiles(depth):
    prob = Problem(batch=1, seqlen=80, nheads=2, headdim=24, dstate=40, ngroups=1, dtype="fp32",
                   has_D=True, D_has_hdim=True, has_z=True, return_final_states=True)
    check(prob, SMALL, depth)


@pytest.mark.parametrize("seqlen,feats", [(128, "plain"), (128, "full"), (150, "full")],
                         ids=["full_chunks", "full_chunks-features", "ragged-features"])
def test_decay_split_with_full_and_ragged_chunks(seqlen, feats, depth):
    """The factored decay (row factor on the accumulator after the blocks before the diagonal)
    with full chunks (the chunk scan's masks compiled out: EVEN_L/EVEN_P/EVEN_N) and ragged ones;
    full chunks with and without seq_idx / initial states / z, ragged with them; 4 m tiles per
    chunk, so 3 of them have blocks before the diagonal. One batch row: the split changes only the
    walk of a chunk's tiles, after every batch, head and group offset is taken (the batch rows are
    test_every_feature_every_dtype's); seq_idx puts sequence starts inside the row."""
    flags = FULL if feats == "full" else dict(has_D=True, has_dt_bias=True, dt_softplus=True,
                                              return_final_states=True)
    prob = Problem(batch=1, seqlen=seqlen, nheads=4, headdim=32, dstate=32, ngroups=2, dtype="fp16", **flags)
    check(prob, SMALL.replace(decay_split=True, scan_block_m=16, scan_block_n=32, scan_block_d=32), depth)


@pytest.mark.parametrize("decay_split", [False, True])
def test_scan_tile_wider_than_bmm_tiles(decay_split):
    """A chunk-scan m tile that spans several bmm tiles reads CB tiles above the diagonal, which
    bmm never writes (poisoned with NaN here): their weights must be selected away, not multiplied
    by a zero decay (0 * NaN is NaN). Found on the H100 with scan_block_m=128 over 64-wide bmm tiles."""
    prob = Problem(batch=1, seqlen=256, nheads=2, headdim=32, dstate=32, ngroups=1, dtype="fp16",
                   has_D=True, has_dt_bias=True, dt_softplus=True, return_final_states=True)
    # chunk 128 = two 64-row scan tiles: the second has blocks before the diagonal (k_split = 64)
    check(prob, SMALL.replace(chunk_size=128, bmm_block_m=16, bmm_block_n=16, scan_block_m=64,
                              scan_block_k=16, decay_split=decay_split))


@pytest.mark.parametrize("decay_split", [False, True])
def test_decay_split_with_headdim_and_dstate_not_multiples_of_tiles(decay_split):
    """The masked x and state loads (EVEN_P / EVEN_N false) under the factored decay too."""
    prob = Problem(batch=1, seqlen=150, nheads=2, headdim=24, dstate=40, ngroups=1, dtype="fp16",
                   has_D=True, has_z=True, has_dt_bias=True, dt_softplus=True, has_seq_idx=True,
                   return_final_states=True)
    check(prob, SMALL.replace(decay_split=decay_split, scan_block_m=16))


def test_scan_tiles_wider_than_the_chunk_keep_their_masks():
    """ssd_forward runs any valid Config, also one whose scan tiles exceed the chunk (violations()
    would refuse it, fit() would shrink it): full chunks must not drop the masks then, or the
    tile's extra rows are stored into the next chunk or past the end of y."""
    prob = Problem(batch=1, seqlen=128, nheads=2, headdim=16, dstate=16, ngroups=1, dtype="fp32",
                   has_D=True)
    cfg = Config(chunk_size=64, scan_block_m=128, scan_block_k=128, scan_block_n=16, scan_block_d=16,
                 bmm_block_m=16, bmm_block_n=16, bmm_block_k=16, state_block_m=16, state_block_n=16,
                 state_block_k=16, decay_split=True)
    t = make_inputs(prob, DEV, seed=next(_seed))
    kw = call_kwargs(prob, t)
    y = ssd_forward(t["x"], t["dt"], t["A"], t["B"], t["C"], 64, config=cfg, poison=True, **kw)
    y_ref = ssd_chunked(t["x"], t["dt"], t["A"], t["B"], t["C"], 64,
                        **{k: v for k, v in kw.items() if not k.startswith("return_")})[0]
    assert rel_err(y, y_ref) <= tolerance("fp32", cfg.state_dtype)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_configs(seed, depth):
    """Several tile/warp/stage choices drawn from the declared space: all compute the same function."""
    rng = random.Random(seed)
    prob = Problem(batch=1, seqlen=130, nheads=2, headdim=32, dstate=32, ngroups=1, dtype="fp16",
                   has_D=True, has_dt_bias=True, dt_softplus=True, has_seq_idx=True, return_final_states=True)
    over = {k.name: rng.choice([v for v in k.values if isinstance(v, bool) or not isinstance(v, int) or v >= 32 or "warps" in k.name
                                 or "stages" in k.name or k.name in ("cumsum_block_h", "fold_prep")])
            for k in KNOBS if not k.needs and k.name not in ("chunk_size", "launches", "smem_pad")}
    cfg = fit(Config(over, chunk_size=64), prob)  # tiles >= 32 keep the interpreter's program count small
    check(prob, cfg, depth)


def test_poison_is_caught():
    """The NaN poisoning is live: an output left unwritten fails the error check."""
    prob = Problem(batch=1, seqlen=64, nheads=2, headdim=16, dstate=16, ngroups=1, dtype="fp32")
    y = torch.full((1, 64, 2, 16), float("nan"))
    assert rel_err(y, torch.ones(1, 64, 2, 16, dtype=torch.float64)) == float("inf")
    t = make_inputs(prob, DEV, seed=1)
    y = ssd_forward(t["x"], t["dt"], t["A"], t["B"], t["C"], 64, config=SMALL, poison=True)
    assert torch.isfinite(y).all()


def _replays_what_a_fresh_plan_would_launch(prob, config):
    from autossd.ops.ssd import chunk
    from autossd.render import load

    t1, t2 = make_inputs(prob, seed=1), make_inputs(prob, seed=2)
    mod = load(config)

    def planned(t):
        buf = chunk.allocate(prob, config, "cpu")
        return buf, chunk.plan(prob, config, t, buf, "cuda", (0.001, 0.1))

    buf1, launches1 = planned(t1)
    stubs = [StubKernel() for _ in launches1]
    rec = chunk._record(launches1, stubs, t1, buf1, mod)
    buf2, launches2 = planned(t2)
    buf3, launches3 = planned(t1)   # a third call, on the first call's inputs and new buffers
    for bufn, tn, lns in ((buf2, t2, launches2), (buf3, t1, launches3)):
        chunk._replay(rec, tn, bufn, stream=7)   # the recorded argument templates stay as recorded
        replayed_as_planned(lns, stubs, mod)
    for _, _, _, template, slots, _ in rec:   # a replay fills a copy: concurrent replays share these
        assert all(template[i] is None for i, _, _, _ in slots)
    return launches1


def test_launch_cache_replays_what_a_fresh_plan_would_launch():
    """The replay of a recorded call passes, for new inputs and buffers, exactly the arguments a
    fresh plan makes (compiled kernels stubbed: the interpreter has none)."""
    prob = Problem(batch=2, seqlen=100, nheads=4, headdim=16, dstate=16, ngroups=2, dtype="fp16", **FULL)
    _replays_what_a_fresh_plan_would_launch(prob, SMALL)


def test_launch_cache_replays_the_gluon_scan_on_each_calls_tensors(monkeypatch):
    """The Gluon chunk scan takes TMA descriptors, which hold a tensor: a replay builds each on the
    new call's tensor (x, C, and the new buffers), never reuses the recorded call's. The plan is
    made as on an sm90 GPU (gluon_scan_gaps stubbed: the CPU has none); nothing is launched."""
    from autossd.ops.ssd import chunk
    from autossd.ops.ssd.fwd_knobs import default_config

    prob = Problem(batch=2, seqlen=300, nheads=2, headdim=64, dstate=128, ngroups=1, dtype="bf16",
                   **{**FULL, "has_seq_idx": False})   # the Gluon scan does not take seq_idx
    cfg = default_config("sm90", prob).replace(scan_gluon=1)
    assert violations(cfg, "sm90", prob) == []
    monkeypatch.setattr("autossd.ops.ssd.plan.gluon_scan_gaps", lambda *a, **k: [])
    launches = _replays_what_a_fresh_plan_would_launch(prob, cfg)
    scan = launches[-1]
    assert scan.kernel == "ssd_chunk_scan_gluon"
    assert sum(isinstance(v, chunk._TMA_DESCRIPTORS) for v in scan.args.values()) == 4
    assert scan.constexprs["EVEN_L"] is False and scan.constexprs["N"] == 128


@pytest.mark.parametrize("scan_fits", [True, False])
def test_walk_split_plans_segments_a_join_and_the_scan_that_completes_them(monkeypatch, scan_fits):
    """walk_split = 3 at 7 chunks: segments of 3, 3 and 1 chunks, one walk program per (state
    tile, head, segment, batch) from a zero state, the join (which takes the initial state) before
    the chunk scan, which adds each segment's entering state; its buffers are the call's own
    on a replay. Where the Gluon scan cannot take the call, the walk runs whole: the tl scan would
    read the segments' states as the sequence's."""
    from autossd.ops.ssd import chunk
    from autossd.ops.ssd.fwd_knobs import default_config

    prob = Problem(batch=2, seqlen=1700, nheads=4, headdim=64, dstate=128, ngroups=2, dtype="fp16",
                   **{**FULL, "has_seq_idx": False})
    cfg = default_config("sm90", prob).replace(state_walk=1, walk_weights=1, scan_gluon=3, walk_split=3,
                                               state_dtype="fp16")
    assert violations(cfg, "sm90", prob) == [] and chunk.walk_segments(prob, cfg) == (3, 3)
    monkeypatch.setattr("autossd.ops.ssd.plan.walk_gaps", lambda *a, **k: [])
    monkeypatch.setattr("autossd.ops.ssd.plan.gluon_scan_gaps", lambda *a, **k: [] if scan_fits else ["no"])
    launches = _replays_what_a_fresh_plan_would_launch(prob, cfg)
    walk = launches[2]
    if not scan_fits:
        assert [ln.stage for ln in launches] == ["cumsum", "bmm", "state_walk", "chunk_scan"]
        assert launches[-1].kernel == "ssd_chunk_scan"   # tl
        assert walk.grid == (1, 4, 2) and (walk.args["SEG"], walk.args["NSEG"]) == (7, 1)
        assert walk.constexprs["HAS_INIT"] and walk.args["final_ptr"].shape == (2, 4, 64, 128)
        return
    assert [ln.stage for ln in launches] == ["cumsum", "bmm", "state_walk", "walk_join", "chunk_scan"]
    join, scan = launches[3], launches[4]
    assert walk.grid == (1, 4, 2 * 3) and (walk.args["SEG"], walk.args["NSEG"]) == (3, 3)
    assert walk.args["init_ptr"] is None and not walk.constexprs["HAS_INIT"] and walk.constexprs["HAS_FINAL"]
    seg = walk.args["final_ptr"]
    assert seg.shape == (2, 4, 3, 64, 128) and seg.dtype == torch.float32 and walk.args["s_fin_k"] == 64 * 128
    assert join.args["seg_ptr"] is seg and join.args["gs_ptr"] is walk.args["gs_ptr"]
    sen = join.args["sen_ptr"]
    assert sen.shape == (2, 4, 3, 64, 128) and sen.dtype == torch.float16
    assert join.constexprs == dict(N=128, HAS_INIT=True, HAS_FINAL=True, BLOCK=1024, SEGS=4)
    assert join.args["final_ptr"].shape == (2, 4, 64, 128)
    assert scan.kernel == "ssd_chunk_scan_gluon_chunk" and scan.constexprs["SPLIT"]
    assert scan.args["sen_ptr"] is sen and scan.args["gam_ptr"] is walk.args["g_ptr"]
    assert (scan.args["SEG"], scan.args["NSEG"], scan.args["K1"]) == (3, 3, 0)   # 0: the initial state


# (batch, heads) small where the tile is large: the interpreter runs every program of the grid
@pytest.mark.parametrize("nseg,p,n,b,h", [(3, 64, 128, 1, 2), (11, 64, 40, 1, 1)])
def test_walk_join_chains_segment_finals_into_entering_states(nseg, p, n, b, h):
    """The join (walk_split): S_0 = the initial state, S_k+1 = g_k S_k + F_k from the segments'
    finals F_k, the S_k in the states' dtype, and the final states S_NSEG (fp32); against
    float64, on fresh random data, with the outputs poisoned first and the finals left as they
    were. At the plan's 1024 columns per program: 3 segments in a 4-row scan, 8 whole programs
    per head; 11 in a 16-row scan over 2560 columns, the third program ragged (one batch row, one
    head: the 16 x 1024 tiles are the interpreter's slowest)."""
    from autossd.ops.ssd.chunk import _walk_join
    from autossd.render import load
    from autossd.ops.ssd.fwd_knobs import default_config

    prob = Problem(batch=b, seqlen=4096, nheads=h, headdim=p, dstate=n, ngroups=1, dtype="fp16")
    cfg = default_config("sm90", prob).replace(state_walk=1, scan_gluon=3, walk_split=4, state_dtype="fp16")
    mod = load(cfg)
    g = torch.Generator().manual_seed(5 + nseg)
    for has_init in (True, False):
        F = torch.randn(b, h, nseg, p, n, generator=g)
        gs = torch.rand(b, h, nseg, generator=g) * 0.9 + 0.05
        init = torch.randn(b, h, n, p, generator=g).transpose(2, 3)   # strided, as a caller's may be
        seg = F.clone()
        buf = types.SimpleNamespace(seg=seg, gseg=gs, sen=torch.full((b, h, nseg, p, n), float("nan"), dtype=torch.float16),
                              final=torch.full((b, h, p, n), float("nan")))
        ln = _walk_join(prob, cfg, {"initial_states": init if has_init else None}, buf)
        assert ln.constexprs["BLOCK"] == 1024 and ln.constexprs["SEGS"] == triton.next_power_of_2(nseg)
        mod.ssd_walk_join[ln.grid](**ln.args, **ln.constexprs, **ln.options)
        assert torch.equal(seg, F)
        sen, final = buf.sen, buf.final
        S = init.double() if has_init else torch.zeros(b, h, p, n, dtype=torch.float64)
        for k in range(nseg):
            if k or has_init:
                assert rel_err(sen[:, :, k], S) < 1e-3, (has_init, k)   # fp16's rounding
            else:
                assert torch.equal(sen[:, :, k], torch.zeros_like(sen[:, :, k]))
            S = gs[:, :, k, None, None].double() * S + F[:, :, k].double()
        assert rel_err(final, S) < 1e-6


def test_launch_cache_replays_the_gluon_walk_on_each_calls_tensors(monkeypatch):
    """The walk (state_walk = 1) replaces the chunk state and the state passing: four launches,
    its descriptors on x, B and the states rebuilt on each call's tensors by a replay (planned as
    on an sm90 GPU, walk_gaps stubbed; nothing is launched)."""
    from autossd.ops.ssd import chunk
    from autossd.ops.ssd.fwd_knobs import default_config

    prob = Problem(batch=2, seqlen=300, nheads=4, headdim=64, dstate=128, ngroups=2, dtype="bf16",
                   **{**FULL, "has_seq_idx": False})   # the walk does not take seq_idx
    cfg = default_config("sm90", prob).replace(state_walk=1, scan_gluon=1, state_dtype="bf16")
    assert violations(cfg, "sm90", prob) == []
    monkeypatch.setattr("autossd.ops.ssd.plan.walk_gaps", lambda *a, **k: [])
    monkeypatch.setattr("autossd.ops.ssd.plan.gluon_scan_gaps", lambda *a, **k: [])
    folded = _replays_what_a_fresh_plan_would_launch(prob, cfg.replace(fold_prep=2))
    assert [ln.stage for ln in folded] == ["prep", "state_walk", "chunk_scan"]   # three launches
    launches = _replays_what_a_fresh_plan_would_launch(prob, cfg)
    assert [ln.stage for ln in launches] == ["cumsum", "bmm", "state_walk", "chunk_scan"]
    walk = launches[2]
    assert sum(isinstance(v, chunk._TMA_DESCRIPTORS) for v in walk.args.values()) == 3
    assert walk.constexprs == dict(N=128, BN=128, HAS_INIT=True, HAS_FINAL=True, EVEN_L=False, FIRST_STORED=0)
    assert walk.grid == (1, 4, 2)   # (headdim / 64) x (dstate / 128) tiles, heads, batch


@pytest.mark.parametrize("init,final,walk_block,scan_gluon,stored,state", [
    (False, False, 128, 3, 1, 1),   # the shipped large records' calls: chunk 0's state neither stored nor read
    (True, False, 128, 3, 0, 0),    # an initial state: chunk 0 enters with it
    (False, True, 128, 2, 1, 1),
    (False, False, 64, 3, 0, 1),    # the 64-token ring stores it (16% slower without); the scan skips it
    (False, False, 128, 1, 0, None),  # the other Gluon scans read it: stored
])
def test_plan_leaves_out_the_states_no_output_reads(monkeypatch, init, final, walk_block, scan_gluon, stored, state):
    """Chunk 0's entering state is 0 without an initial state, so the chunk-walking scan
    (scan_gluon >= 2) skips its term (FIRST_STATE = 1) and the walk with the 128-token ring does
    not store it (FIRST_STORED = 1); without final states (HAS_FINAL) the walk stops at the last
    chunk's entering state. gpu_validate.py --stored-only is the GPU check of what they do."""
    from autossd.ops.ssd import chunk
    from autossd.ops.ssd.fwd_knobs import default_config

    prob = Problem(batch=2, seqlen=700, nheads=4, headdim=64, dstate=128, ngroups=1, dtype="fp16",
                   has_D=True, has_initial_states=init, return_final_states=final)
    cfg = default_config("sm90", prob).replace(state_walk=1, scan_gluon=scan_gluon, walk_block=walk_block,
                                               state_dtype="fp16")
    assert violations(cfg, "sm90", prob) == []
    monkeypatch.setattr("autossd.ops.ssd.plan.walk_gaps", lambda *a, **k: [])
    monkeypatch.setattr("autossd.ops.ssd.plan.gluon_scan_gaps", lambda *a, **k: [])
    t = make_inputs(prob, seed=3)
    buf = chunk.allocate(prob, cfg, "cpu")
    by = {ln.stage: ln for ln in chunk.plan(prob, cfg, t, buf, "cuda")}
    walk, scan = by["state_walk"], by["chunk_scan"]
    assert walk.constexprs["FIRST_STORED"] == stored
    assert walk.constexprs["HAS_FINAL"] == final and (walk.args["final_ptr"] is not None) == final
    assert scan.constexprs.get("FIRST_STATE") == state


def test_launch_cache_encodes_each_tma_descriptor_once_per_address(monkeypatch):
    """A replay calls each launcher's compiled entry point itself, the Gluon chunk scan's with each
    TMA descriptor encoded once per base address, and passes it exactly what triton's launcher
    would (that launcher built without a GPU: its entry point and encoder are stand-ins that
    record what they get)."""
    from triton.backends.nvidia import driver as nv

    from autossd.ops.ssd import chunk
    from autossd.render import load
    from autossd.ops.ssd.fwd_knobs import default_config

    encoded = []

    def encode(arg, meta):   # triton's make_tensordesc_arg, without the driver call
        encoded.append(arg.base.data_ptr())
        return [("tmap", arg.base.data_ptr(), meta), *arg.shape, *arg.strides]

    monkeypatch.setattr(nv, "make_tensordesc_arg", encode)
    monkeypatch.setattr("autossd.ops.ssd.plan.gluon_scan_gaps", lambda *a, **k: [])
    prob = Problem(batch=1, seqlen=256, nheads=2, headdim=64, dstate=64, ngroups=1, dtype="fp16")
    cfg = default_config("sm90", prob).replace(scan_gluon=1)
    mod = load(cfg)
    t1, t2 = make_inputs(prob, seed=1), make_inputs(prob, seed=2)
    buf = chunk.allocate(prob, cfg, "cpu")
    launches = chunk.plan(prob, cfg, t1, buf, "cuda", (0.0, float("inf")))
    entry = []

    class Compiled:   # a CompiledKernel's parts that _record and the launch use
        function, packed_metadata = "fn", "meta"

        def __init__(self, ln):
            values = {**ln.args, **ln.constexprs}
            names = getattr(mod, ln.kernel).arg_names
            sig = {i: "tensordesc<fp16[64, 64]>" if isinstance(values[n], chunk._TMA_DESCRIPTORS) else "i32"
                   for i, n in enumerate(names)}
            ndesc = sum(v.startswith("tensordesc") for v in sig.values())
            self.run = nv.CudaLauncher.__new__(nv.CudaLauncher)
            self.run.launch = nv.wrap_handle_tensordesc(lambda *a: entry.append(a), sig,
                                                        [{"m": i} for i in range(ndesc)] or None)
            self.run.num_ctas, self.run.launch_cooperative_grid, self.run.launch_pdl = 1, False, False
            self.run.global_scratch_size = self.run.profile_scratch_size = 0
            self.run.global_scratch_align = self.run.profile_scratch_align = 1

        def _init_handles(self):
            pass

    rec = chunk._record(launches, [Compiled(ln) for ln in launches], t1, buf, mod)
    assert all(d is not None for *_, d in rec)   # every launch, with descriptors or without
    # A record outlives its call and must hold none of that call's tensors, not even through a
    # TMA descriptor's base: under torch.compile's CUDA graph trees a first call made in the
    # warm-up allocates in the graph's pool, and a kept tensor of the pool fails torch's check.
    assert _tensors_reachable(rec) == []
    del encoded[:]

    def through_triton(entry_of, t):   # what triton's own launch path passes to the entry point
        ck, grid, srcs, _, slots, _ = entry_of
        args = [k if kind == "const" else None for kind, k in srcs]
        for i, from_input, k, desc in slots:
            v = t[k] if from_input else getattr(buf, k)
            args[i] = v.data_ptr() if desc is None else chunk._DescArg(v, desc)
        ck.run(*grid, 7, ck.function, ck.packed_metadata, None, None, None, *args)
        return entry.pop()

    for t, new in ((t1, 4), (t1, 0), (t2, 2), (t1, 0)):   # x and C are new in t2; CB, states kept
        for ln, e in zip(launches, rec):
            e[-1](e[1], 7, t, buf)
            got = entry.pop()
            assert len(encoded) == (new if ln.kernel == "ssd_chunk_scan_gluon" else 0)
            del encoded[:]
            assert got == through_triton(e, t), ln.kernel
            del encoded[:]
    direct = rec[-1][-1]
    assert all(len(enc) <= chunk._DirectLaunch.KEEP for *_, enc in direct.slots[1])
    # a launcher with scratch memory, or another launcher type, keeps triton's path
    ck = Compiled(launches[0])
    ck.run.global_scratch_size = 64
    assert chunk._DirectLaunch.of(ck, rec[0][3], rec[0][4], {}) is None


def _tensors_reachable(root) -> list:
    """The tensors and TMA descriptors reachable from `root` through containers and objects'
    attributes (not through modules, classes or functions)."""
    import gc
    import types

    from autossd.ops.ssd import chunk
    found, seen, todo = [], set(), [root]
    while todo:
        o = todo.pop()
        if id(o) in seen or isinstance(o, (type, types.ModuleType, types.FunctionType, types.BuiltinFunctionType,
                                           types.MethodType, str, bytes, int, float)):
            continue
        seen.add(id(o))
        if isinstance(o, (torch.Tensor, *chunk._TMA_DESCRIPTORS)):
            found.append(type(o).__name__)
            continue
        todo.extend(gc.get_referents(o))
    return found


def test_launch_cache_is_bounded(monkeypatch):
    """At most LAUNCH_CACHE_MAX recorded calls are kept (one per sequence length and config),
    then the cache starts over; a call after that records again (plan and compile stubbed)."""
    from types import SimpleNamespace

    from autossd.ops.ssd import chunk
    monkeypatch.setattr(chunk, "LAUNCH_CACHE_MAX", 2)
    monkeypatch.setattr(chunk, "_launch_cache", {})
    recorded = []
    monkeypatch.setattr(chunk, "plan", lambda *a, **k: ["launch"])
    monkeypatch.setattr(chunk, "run", lambda launches, module: ["compiled"])
    monkeypatch.setattr(chunk, "_record", lambda *a: recorded.append(a[0]) or [])
    monkeypatch.setattr(chunk, "_replay", lambda *a: None)
    buf = SimpleNamespace(y="y")
    for l in (64, 65, 66, 64, 66):
        prob = Problem(batch=1, seqlen=l, nheads=2, headdim=16, dstate=16, ngroups=1, dtype="fp16")
        assert chunk._execute(prob, SMALL, {}, buf, None, (0.0, 1.0), None, "cuda", None, 7, sig=()) == "y"
        assert 1 <= len(chunk._launch_cache) <= 2
    # 64, 65 recorded; 66 starts over; 64 again (gone) records; 66 is still there
    assert len(recorded) == 4


def test_launch_cache_goes_through_triton_when_a_launch_hook_is_set():
    """A profiler's launch hook (triton.knobs.runtime.launch_enter_hook) still sees every launch:
    with one set, the replay calls triton's runner, which calls the hooks, not the launcher."""
    from triton import knobs

    from autossd.ops.ssd import chunk

    calls = []

    class Stub:
        function, packed_metadata = "fn", "meta"

        def __getitem__(self, grid):
            return lambda *args: calls.append(("runner", grid))

        def run(self, *args):
            calls.append(("launcher",))

    t = {"x": torch.zeros(4)}
    rec = [(Stub(), (1, 1, 1), (("in", "x"), ("const", 3)), [None, 3], ((0, True, "x", None),), None)]
    hook = lambda meta: None  # noqa: E731
    knobs.runtime.launch_enter_hook.add(hook)
    try:
        chunk._replay(rec, t, None, stream=0)
    finally:
        knobs.runtime.launch_enter_hook.remove(hook)
    chunk._replay(rec, t, None, stream=0)
    assert calls == [("runner", (1, 1, 1)), ("launcher",)]


def test_launch_cache_key_sees_aliasing_strides_alignment_and_shapes():
    from autossd.ops.ssd.chunk import input_sig
    prob = Problem(batch=1, seqlen=64, nheads=2, headdim=16, dstate=16, ngroups=1, dtype="fp16")
    t = make_inputs(prob, seed=3)
    aliased = dict(t, C=t["B"])
    assert input_sig(t) != input_sig(aliased)
    wide = dict(t, x=torch.randn(1, 64, 2, 32, dtype=torch.float16)[..., :16])
    assert input_sig(t) != input_sig(wide)
    shifted = dict(t, x=torch.randn(1 * 64 * 2 * 16 + 1, dtype=torch.float16)[1:].view(1, 64, 2, 16))
    assert input_sig(t) != input_sig(shifted)          # 2 bytes off a 16-byte boundary
    longer = make_inputs(prob.replace(seqlen=65), seed=3)
    assert input_sig(t) != input_sig(longer)
    assert input_sig(t) == input_sig(make_inputs(prob, seed=4))


@pytest.mark.skipif(DEV != "cpu", reason="reorders the interpreter's programs")
@pytest.mark.parametrize("depth_", [3, 1])
def test_fused_depths_ignore_program_start_order(depth_, monkeypatch):
    """The fused depths take their work from an atomic ticket, so programs may start in any
    order: run the interpreter's programs in a shuffled order over many chunks. A program that
    waited on a later one would spin for ever in the (sequential) interpreter; an alarm fails it."""
    import signal
    import threading

    from triton.runtime import interpreter

    builder = interpreter.interpreter_builder
    order, seen = {}, []
    real_dim, real_idx = builder.set_grid_dim, builder.set_grid_idx

    def set_grid_dim(x, y, z):
        perm = list(range(x * y * z))
        random.Random(x).shuffle(perm)
        order["perm"] = perm
        order["n"] = 0
        order["dims"] = (y, z)
        real_dim(x, y, z)

    def set_grid_idx(x, y, z):
        i = order["perm"][order["n"]]
        order["n"] += 1
        seen.append(i)
        y, z = order["dims"]
        real_idx(i // (y * z), (i // z) % y, i % z)

    monkeypatch.setattr(builder, "set_grid_dim", set_grid_dim)
    monkeypatch.setattr(builder, "set_grid_idx", set_grid_idx)
    guard = threading.current_thread() is threading.main_thread()
    if guard:
        def timeout(*_):
            raise TimeoutError("a fused program waited on one that had not started")
        old = signal.signal(signal.SIGALRM, timeout)
        signal.alarm(900)   # turns a deadlock into a failure; a loaded machine is only slow
    try:
        # 7 chunks (the last ragged): each (batch, head, state tile) chain passes its state through 7
        prob = Problem(batch=2, seqlen=64 * 6 + 5, nheads=2, headdim=32, dstate=16, ngroups=1, dtype="fp32",
                       has_initial_states=True, has_seq_idx=True, return_final_states=True, dt_softplus=True)
        cfg = SMALL.replace(state_block_m=16, state_block_n=16)
        check(prob, cfg, depth_)
    finally:
        if guard:
            signal.alarm(0)
            signal.signal(signal.SIGALRM, old)
    assert len(seen) > 24 and seen != sorted(seen)  # the reordering was live


@pytest.mark.parametrize("depth_", [3, 1])
def test_fused_launches_reuse_their_ticket_words_without_a_reset(depth_):
    """The fused depths' ticket counter and flags are zeroed once, at allocation, and only grow:
    the e-th launch on a buffer takes tickets e*G.., and its chunk c waits for flag e*NC + c.
    Relaunch on the same (never reset) words with fresh inputs each time: every launch is right,
    and the words hold exactly what three launches leave."""
    from autossd.ops.ssd import chunk
    from autossd.render import load

    prob = Problem(batch=2, seqlen=100, nheads=2, headdim=16, dstate=16, ngroups=1, dtype="fp32",
                   has_D=True, has_initial_states=True, return_final_states=True)
    cfg = fit(SMALL.replace(launches=depth_), prob)
    t = make_inputs(prob, DEV, seed=5)
    buf = chunk.allocate(prob, cfg, DEV, poison=True)
    launches = chunk.plan(prob, cfg, t, buf)
    mod = load(cfg)
    fused = [ln for ln in launches if ln.stage in ("fused", "state_fused")]
    assert len(fused) == 1
    grid, nc, chains = fused[0].grid[0], -(-prob.seqlen // cfg.chunk_size), chunk.chains(prob, cfg)
    for e in range(1, 4):
        fresh = make_inputs(prob, DEV, seed=5 + e)
        for k, v in t.items():
            if isinstance(v, torch.Tensor) and v.is_floating_point():
                v.copy_(fresh[k])           # the launches hold these tensors
        buf.y.fill_(float("nan"))
        chunk.run(launches, mod)
        y_ref, f_ref, _ = ssd_chunked(t["x"], t["dt"], t["A"], t["B"], t["C"], cfg.chunk_size, D=t["D"],
                                      dt_bias=t["dt_bias"], initial_states=t["initial_states"])
        tol = tolerance(prob.dtype)
        assert rel_err(buf.y, y_ref) <= tol and rel_err(buf.final, f_ref) <= tol, e
        assert int(buf.sync[0]) == e * grid
        assert buf.sync[1:1 + chains].tolist() == [e * nc] * chains   # one flag per chain
        assert not buf.sync[1 + chains:].any()                         # the AMD fences' scratch


# --- the kept workspace of the intermediates --------------------------------------------------
def _call(prob, cfg, seed):
    t = make_inputs(prob, DEV, seed=seed)
    kw = call_kwargs(prob, t)
    out = ssd_forward(t["x"], t["dt"], t["A"], t["B"], t["C"], cfg.chunk_size, config=cfg, **kw)
    ref_kw = {k: v for k, v in kw.items() if not k.startswith("return_")}
    ref = ssd_chunked(t["x"], t["dt"], t["A"], t["B"], t["C"], cfg.chunk_size, **ref_kw)
    return (out if isinstance(out, tuple) else (out,)), ref


@pytest.fixture
def workspaces():
    from autossd.ops.ssd import workspace
    workspace.clear_workspaces()
    yield workspace
    workspace.clear_workspaces()


def test_calls_reuse_the_intermediates_and_return_fresh_outputs(workspaces, depth):
    prob = Problem(batch=1, seqlen=150, nheads=2, headdim=16, dstate=16, ngroups=1, dtype="fp32",
                   has_D=True, dt_softplus=True, return_final_states=True)
    cfg = fit(SMALL.replace(launches=depth), prob)
    (y1, f1), ref1 = _call(prob, cfg, 1)
    (kept,) = [w[1] for w in workspaces._workspaces.values()]
    assert kept.y is None                       # y is never kept: every call returns a fresh one
    y1c, f1c = y1.clone(), f1.clone()
    # NaN in every kept intermediate: whatever the next call reads, it must have written first
    for name in ("dt", "dA", "cb", "states", "final"):
        if getattr(kept, name) is not None:
            getattr(kept, name).fill_(float("nan"))
    (y2, f2), ref2 = _call(prob, cfg, 2)
    assert len(workspaces._workspaces) == 1 and next(iter(workspaces._workspaces.values()))[1] is kept
    assert rel_err(y2, ref2[0]) < tolerance("fp32") and rel_err(f2, ref2[1]) < tolerance("fp32")
    assert rel_err(y1, ref1[0]) < tolerance("fp32")
    # the first call's outputs are its own: not overwritten by the second
    assert y1.data_ptr() != y2.data_ptr() and f1.data_ptr() != f2.data_ptr()
    assert torch.equal(y1, y1c) and torch.equal(f1, f1c)


def test_workspace_budget_is_least_recently_used(workspaces, monkeypatch):
    cfg = SMALL
    probs = [Problem(batch=1, seqlen=l, nheads=2, headdim=16, dstate=16, ngroups=1, dtype="fp32")
             for l in (100, 130, 160)]
    sizes = {}
    for p in probs:
        workspaces.clear_workspaces()
        _call(p, fit(cfg, p), 0)
        sizes[p] = next(iter(workspaces._workspaces.values()))[2]
    workspaces.clear_workspaces()
    monkeypatch.setattr(workspaces, "WORKSPACE_BYTES", sizes[probs[1]] + sizes[probs[2]])
    for p in probs:
        _call(p, fit(cfg, p), 0)
    assert [k[0].seqlen for k in workspaces._workspaces] == [130, 160]   # the oldest went first
    monkeypatch.setattr(workspaces, "WORKSPACE_BYTES", 0)           # AUTOSSD_WORKSPACE_MB=0: off
    workspaces.clear_workspaces()
    (y,), ref = _call(probs[0], fit(cfg, probs[0]), 3)
    assert not workspaces._workspaces and rel_err(y, ref[0]) < tolerance("fp32")


@pytest.mark.parametrize("depth", [3, 1])
def test_a_call_that_stops_part_way_never_leaves_its_words_for_the_next(workspaces, monkeypatch, depth):
    # a fused launch interrupted after some programs took tickets leaves the counter off its
    # epoch; the next call on that workspace would mix in another call's carry (a reviewer's
    # repro: Ctrl-C in the interpreter, then errors of 1e0 in every later call)
    prob = Problem(batch=1, seqlen=150, nheads=2, headdim=16, dstate=16, ngroups=1, dtype="fp32",
                   return_final_states=True)
    cfg = fit(SMALL.replace(launches=depth), prob)
    _call(prob, cfg, 1)
    (kept,) = [w[1] for w in workspaces._workspaces.values()]
    from autossd.ops.ssd import chunk
    real = chunk._execute

    def stop_part_way(prob, config, t, buf, *a, **k):
        buf.sync[0] += 3                       # as if 3 programs had taken their tickets
        raise KeyboardInterrupt

    monkeypatch.setattr(chunk, "_execute", stop_part_way)
    with pytest.raises(KeyboardInterrupt):
        _call(prob, cfg, 2)
    # checked before the next call: with the words left in place, that call would wait for ever
    assert all(w[1] is not kept for w in workspaces._workspaces.values())
    monkeypatch.setattr(chunk, "_execute", real)
    (y, f), ref = _call(prob, cfg, 3)
    assert rel_err(y, ref[0]) < tolerance("fp32") and rel_err(f, ref[1]) < tolerance("fp32")
    (fresh,) = [w[1] for w in workspaces._workspaces.values()]
    assert fresh is not kept


def test_workspace_budget_from_the_environment(monkeypatch, caplog):
    from autossd.ops.ssd import chunk
    for text, want in (("64", 64 << 20), ("0", 0), ("abc", 256 << 20), ("inf", 256 << 20)):
        monkeypatch.setenv("AUTOSSD_WORKSPACE_MB", text)
        assert chunk._budget_from_env() == want, text


def test_ssd_forward_keys_its_launches_on_dt_limit_by_value(monkeypatch):
    # a 0-d tensor in dt_limit, changed in place between calls, must not replay its old value
    from autossd.ops.ssd import chunk
    seen = []
    monkeypatch.setattr(chunk, "execute", lambda prob, config, t, **kw: seen.append(kw["dt_limit"]) or t["x"])
    prob = Problem(batch=1, seqlen=64, nheads=2, headdim=16, dstate=16, ngroups=1, dtype="fp32", has_dt_limit=True)
    t = make_inputs(prob, DEV, seed=0)
    hi = torch.tensor(0.1)
    ssd_forward(t["x"], t["dt"], t["A"], t["B"], t["C"], 64, dt_limit=(0.001, hi), config=SMALL)
    assert seen == [(0.001, pytest.approx(0.1))] and all(type(v) is float for v in seen[0])


def test_poisoned_calls_never_use_the_workspace(workspaces):
    prob = Problem(batch=1, seqlen=100, nheads=2, headdim=16, dstate=16, ngroups=1, dtype="fp32")
    check(prob, SMALL, 5)
    assert not workspaces._workspaces


def test_a_workspace_too_large_to_keep_allocates_nothing_extra(workspaces, monkeypatch):
    prob = Problem(batch=1, seqlen=100, nheads=2, headdim=16, dstate=16, ngroups=1, dtype="fp32")
    monkeypatch.setattr(workspaces, "WORKSPACE_MAX_ONE", 1024)
    devices = []
    real = workspaces.allocate
    monkeypatch.setattr(workspaces, "allocate", lambda p, c, device, *a, **k: devices.append(str(device))
                        or real(p, c, device, *a, **k))
    for seed in (0, 1):
        (y,), ref = _call(prob, fit(SMALL, prob), seed)
        assert rel_err(y, ref[0]) < tolerance("fp32")
    # sized once on meta tensors, then one ordinary allocation per call
    assert devices[0] == "meta" and len(devices) == 3 and not workspaces._workspaces
    assert all(d.split(":")[0] == DEV for d in devices[1:])


@pytest.mark.skipif(DEV != "cuda", reason="CUDA graphs need a GPU")
def test_a_capture_never_uses_or_makes_a_workspace(workspaces):
    """A captured call allocates in the graph's pool: no kept intermediates may be baked into the
    graph, nor created inside the capture."""
    prob = Problem(batch=1, seqlen=300, nheads=4, headdim=64, dstate=64, ngroups=1, dtype="fp16",
                   has_D=True, dt_softplus=True)
    cfg = fit(SMALL.replace(chunk_size=128), prob)
    (y_eager,), _ = _call(prob, cfg, 1)
    assert len(workspaces._workspaces) == 1
    t = make_inputs(prob, DEV, seed=2)
    kw = call_kwargs(prob, t)
    run = lambda: ssd_forward(t["x"], t["dt"], t["A"], t["B"], t["C"], cfg.chunk_size, config=cfg, **kw)  # noqa: E731
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        run()                     # warm-up on the capture's kind of side stream: its own workspace
    torch.cuda.current_stream().wait_stream(s)
    before = dict(workspaces._workspaces)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        y = run()
    # nothing made while capturing (the capture runs on a stream of its own, so a kept workspace
    # would have been a new key)
    assert dict(workspaces._workspaces) == before
    g.replay()
    torch.cuda.synchronize()
    ref = ssd_chunked(t["x"], t["dt"], t["A"], t["B"], t["C"], cfg.chunk_size,
                      **{k: v for k, v in kw.items() if not k.startswith("return_")})[0]
    assert rel_err(y, ref) < tolerance("fp16")


# --- first-call compile ------------------------------------------------------------------------
def test_warm_up_compiles_only_never_compiled_kernels_side_by_side(monkeypatch):
    """On a GPU a call's first launches compile each kernel and its launcher in turn; warm_up
    compiles the ones this process never compiled, each in its own thread, and re-raises a
    compile error. (The interpreter compiles nothing: there it does nothing.)"""
    import contextlib
    import threading

    from autossd.ops.ssd import chunk
    if not torch.cuda.is_available():
        assert chunk.warm_up([object(), object()], None) == 0     # interpreter: nothing to do
    monkeypatch.setattr(chunk, "interpreting", lambda: False)
    monkeypatch.setattr(chunk.torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(chunk.torch.cuda, "device", lambda d: contextlib.nullcontext())
    monkeypatch.setattr(chunk.torch.cuda, "current_device", lambda: 3)
    seen, barrier = [], threading.Barrier(2, timeout=120)   # both cold kernels compile at once

    class Compiled:
        def _init_handles(self):
            seen.append(("loaded", threading.current_thread().name))

    class Fn:
        def __init__(self, name, compiled_on=(), fail=False):
            self.name, self.fail = name, fail
            self.device_caches = {d: ({"key": Compiled()}, {}, None, None, None) for d in compiled_on}

        def warmup(self, grid, **kw):
            barrier.wait()
            if self.fail:
                raise RuntimeError(f"{self.name}: compile error")
            seen.append((self.name, kw["a"], grid))
            return Compiled()

    def launches(*names):
        return [chunk.Launch(n, n, (n.__len__(), 1, 1), {"a": n}, {}) for n in names]

    module = types.SimpleNamespace(one=Fn("one"), two=Fn("two"), done=Fn("done", compiled_on=(3,)),
                                   other=Fn("other", compiled_on=(0,)))
    assert chunk.warm_up(launches("one", "done", "two"), module) == 2
    assert sorted(s for s in seen if s[0] != "loaded") == [("one", "one", (3, 1, 1)), ("two", "two", (3, 1, 1))]
    assert [s[1].startswith("autossd-compile") for s in seen if s[0] == "loaded"] == [True, True]
    assert chunk.warm_up(launches("one", "done"), module) == 0       # one cold kernel: the JIT's job
    seen.clear()
    module.bad = Fn("bad", fail=True)
    with pytest.raises(RuntimeError, match="bad: compile error"):
        chunk.warm_up(launches("other", "bad"), module)              # compiled for device 0 only


def test_walk_gaps_name_what_keeps_a_call_on_the_two_state_stages():
    """A config with state_walk = 1 runs the walk only where the call fits it; the reasons name
    what does not (the CPU, a B whose rows TMA cannot address), and the plan then launches the
    chunk state and the state passing, which the interpreter runs to the same result."""
    from autossd.ops.ssd import chunk
    from autossd.ops.ssd.fwd_knobs import default_config

    prob = Problem(batch=2, seqlen=300, nheads=2, headdim=64, dstate=64, ngroups=1, dtype="fp16",
                   has_D=True)
    cfg = default_config("sm90", prob).replace(state_walk=1, state_dtype="fp16")
    t = make_inputs(prob, seed=4)
    buf = chunk.allocate(prob, cfg, "cpu")
    assert chunk.walk_gaps(prob, cfg, t, buf) == ["the Gluon walk runs on an NVIDIA GPU only (no interpreter)"]
    wide = torch.randn(2, 301, 1, 64, dtype=torch.float16)[:, :300]
    assert any("B's strides" in w for w in chunk.walk_gaps(prob, cfg, {**t, "B": wide}, buf))
    assert [ln.stage for ln in chunk.plan(prob, cfg, t, buf)] == \
        ["cumsum", "bmm", "chunk_state", "state_passing", "chunk_scan"]
    args = (t["x"], t["dt"], t["A"], t["B"], t["C"], cfg.chunk_size)
    y = ssd_forward(*args, D=t["D"], config=cfg)
    assert torch.equal(y, ssd_forward(*args, D=t["D"], config=cfg.replace(state_walk=0)))


def test_gluon_scan_gaps_name_what_keeps_a_call_on_the_tl_scan():
    """A config with scan_gluon = 1 runs the Gluon chunk scan only where the call fits it; the
    reasons name what does not (here: the CPU, and an x whose rows TMA cannot address), and the
    plan then launches the tl scan of the same config."""
    from autossd.ops.ssd import chunk
    from autossd.ops.ssd.fwd_knobs import default_config

    prob = Problem(batch=2, seqlen=300, nheads=2, headdim=64, dstate=128, ngroups=1, dtype="fp16")
    cfg = default_config("sm90", prob).replace(scan_gluon=1)
    t = make_inputs(prob, seed=3)
    buf = chunk.allocate(prob, cfg, "cpu")
    why = chunk.gluon_scan_gaps(prob, cfg, t, buf)
    assert why == ["the Gluon chunk scan runs on an NVIDIA GPU only (no interpreter)"]
    # x as a slice of a wider projection whose batches are not one row stride apart
    wide = torch.randn(2, 301, 2, 64, dtype=torch.float16)[:, :300]
    why = chunk.gluon_scan_gaps(prob, cfg, {**t, "x": wide}, buf)
    assert any("x's strides" in w for w in why)
    sliced = torch.randn(2, 300, 2 * 64 + 8, dtype=torch.float16)[..., :128].view(2, 300, 2, 64)
    assert not any("x's strides" in w for w in chunk.gluon_scan_gaps(prob, cfg, {**t, "x": sliced}, buf))
    assert chunk.plan(prob, cfg, t, buf)[-1].kernel == "ssd_chunk_scan"
