"""The knob space: a Config holds only declared values, so it is safe to render."""
import pytest

from autossd.arch import ARCHS
from autossd.problem import Problem
from autossd.tuner import build_space
from autossd.ops.ssd.fwd_knobs import KNOB_BY_NAME, KNOBS, Config, ConfigError, default_config, fit, violations

PROB = Problem(batch=1, seqlen=2048, nheads=80, headdim=64, dstate=128, ngroups=1, dtype="fp16")


def test_every_knob_declared_once_with_its_default_allowed():
    names = [k.name for k in KNOBS]
    assert len(names) == len(set(names))
    for k in KNOBS:
        assert k.default in k.values, k.name


@pytest.mark.parametrize("bad", [
    {"chunk_size": 96}, {"chunk_size": "64"}, {"chunk_size": 64.0}, {"chunk_size": True},
    {"state_dtype": "fp64"}, {"state_dtype": "fp32'); import os; os.system('x"},
    {"scan_block_m": 48}, {"kpack": 3}, {"no_such_knob": 1}, {"bmm_warps": None},
])
def test_config_rejects_undeclared_values(bad):
    with pytest.raises(ConfigError, match=next(iter(bad))):
        Config(bad)


def test_config_is_immutable_hashable_and_round_trips():
    c = Config(chunk_size=128, scan_block_m=32)
    assert c.chunk_size == 128 and c["scan_block_m"] == 32
    with pytest.raises(AttributeError):
        c.chunk_size = 64
    assert Config.from_json(c.key()) == c and hash(Config.from_json(c.key())) == hash(c)
    assert c.replace(chunk_size=64) != c
    with pytest.raises(ConfigError, match="JSON"):
        Config.from_json("{not json")
    with pytest.raises(ConfigError, match="object"):
        Config.from_json("[1, 2]")


def test_amd_knobs_pinned_on_nvidia_and_offered_on_amd():
    for name in ("waves_per_eu", "matrix_instr_nonkdim", "kpack"):
        k = KNOB_BY_NAME[name]
        assert not k.offered_on(ARCHS["sm90"]) and k.offered_on(ARCHS["gfx942"])
    why = violations(Config(kpack=2), "sm90")
    assert any("kpack=2 is not offered on sm90" in w for w in why)
    assert not violations(Config(kpack=2), "gfx942")


def test_violations_catch_tiles_larger_than_chunk_or_problem():
    why = violations(Config(chunk_size=64, scan_block_m=128), "sm90", PROB)
    assert any("scan_block_m=128 exceeds chunk_size=64" in w for w in why)
    small = PROB.replace(headdim=16)
    assert any("scan_block_n=64 exceeds" in w for w in violations(Config(), "sm90", small))
    assert not violations(Config(scan_warps=8, bmm_stages=1), "gfx942")  # 8 x 64 lanes = 512 threads


def test_defaults_are_feasible_on_every_arch():
    for arch in ARCHS:
        for prob in (PROB, PROB.replace(headdim=16, dstate=16, nheads=4, chunk_size=64),
                     PROB.replace(headdim=32)):
            for depth in (5, 3, 1):
                cfg = default_config(arch, prob, launches=depth)
                assert violations(cfg, arch, prob) == [], (arch, prob, depth)


def test_single_launch_headdim_tiles_under_64_refused_on_sm90_only():
    # a Triton 3.6 wgmma miscompile (H100: wrong y, illegal address; scripts/repro_fused_tiles.py)
    cfg = fit(Config(launches=1, state_block_m=32, scan_block_m=64), PROB)
    assert any("miscompiled on sm90" in w for w in violations(cfg, "sm90", PROB))
    assert not violations(cfg.replace(scan_block_m=32), "sm90", PROB)
    assert not violations(cfg.replace(state_block_m=64), "sm90", PROB)
    assert not any("miscompiled" in w for a in ("sm80", "gfx942") for w in violations(cfg, a, PROB))
    narrow = PROB.replace(headdim=32)    # the default itself must step around it
    assert default_config("sm90", narrow, launches=1).scan_block_m == 32


def test_default_follows_requested_chunk_and_input_dtype():
    assert default_config("sm90", PROB.replace(chunk_size=128)).chunk_size == 128
    assert default_config("sm90", PROB).state_dtype == "fp16"
    assert default_config("sm90", PROB.replace(dtype="fp32")).state_dtype == "fp32"


def test_fit_shrinks_to_problem():
    small = PROB.replace(headdim=16, dstate=32)
    f = fit(Config(), small)
    assert f.scan_block_n == 16 and f.state_block_n == 32 and not violations(f, "sm90", small)


def test_smem_pad_only_at_five_launches_with_16_bit_inputs():
    pad = KNOB_BY_NAME["smem_pad"]
    assert pad.default == 0 and pad.stage == "chunk_state" and all(pad.offered_on(a) for a in ARCHS.values())
    assert not violations(Config(smem_pad=4), "sm90", PROB)
    for depth in (d for d in KNOB_BY_NAME["launches"].values if d != 5):
        # a fused depth never runs the Gluon kernel: the pad is dropped by Config or refused here
        cfg = Config(launches=depth, smem_pad=4)
        assert cfg.smem_pad == 0 or any("needs launches=5" in w for w in violations(cfg, "sm90", PROB))
    why = violations(Config(smem_pad=2), "gfx942", PROB.replace(dtype="fp32"))
    assert any("smem_pad=2 needs fp16/bf16 inputs" in w for w in why)
    assert not violations(Config(smem_pad=2), "gfx942", PROB)


def test_smem_pad_with_32_wide_mfma_needs_32_wide_tiles():
    cfg = Config(smem_pad=8, matrix_instr_nonkdim=32, state_block_m=16)
    assert any("needs state_block_m and state_block_n >= 32" in w for w in violations(cfg, "gfx90a"))
    assert not violations(cfg.replace(state_block_m=32), "gfx90a")
    assert not violations(cfg.replace(matrix_instr_nonkdim=16), "gfx90a")


def test_single_launch_is_infeasible_not_a_crash_when_dstate_exceeds_a_tile():
    from autossd.problem import Problem
    from autossd.ops.ssd.fwd_knobs import default_config, violations
    prob = Problem(batch=1, seqlen=4096, nheads=8, headdim=64, dstate=256, ngroups=1, dtype="bf16")
    cfg = default_config("sm90", prob, launches=1)
    assert any("must cover dstate" in w for w in violations(cfg, "sm90", prob))
    assert not violations(default_config("sm90", prob), "sm90", prob)


def test_state_walk_is_offered_on_sm90_at_five_launches_with_what_its_kernel_takes():
    knob = KNOB_BY_NAME["state_walk"]
    assert [a for a in sorted(ARCHS) if knob.offered_on(ARCHS[a])] == ["sm90"]
    good = default_config("sm90", PROB).replace(state_walk=1)
    assert violations(good, "sm90", PROB) == []
    assert violations(good.replace(scan_gluon=1), "sm90", PROB) == []
    assert violations(good.replace(fold_prep=2), "sm90", PROB) == []   # its own prep launch
    for d in (3, 1):   # no separate chunk-state and state-passing launches there
        assert Config(launches=d, state_walk=1).state_walk == 0
    for arch in ("sm80", "gfx942"):
        assert any("state_walk=1 is not offered" in w for w in violations(good, arch, PROB))
    bad = {  # each departure from what the kernel takes, with the words that name it
        "fold_prep": (good.replace(fold_prep=1), PROB, "fold_prep=1 folds the cumsum into"),
        "smem_pad": (good.replace(smem_pad=4), PROB, "replaces the Gluon chunk state"),
        "fp32 states": (good.replace(state_dtype="fp32"), PROB, "states in the input dtype"),
        "fp32 inputs": (good, PROB.replace(dtype="fp32"), "fp16/bf16 inputs"),
        "dstate": (good, PROB.replace(dstate=32), "dstate 64, 128 or 256"),
        "headdim": (good, PROB.replace(headdim=80), "headdim a multiple of 64"),
        "seq_idx": (good, PROB.replace(has_seq_idx=True), "does not take seq_idx"),
    }
    for name, (cfg, prob, words) in bad.items():
        assert any(words in w for w in violations(cfg, "sm90", prob)), name


def test_scan_gluon_is_offered_on_sm90_only_with_what_its_kernel_takes():
    knob = KNOB_BY_NAME["scan_gluon"]
    assert [a for a in sorted(ARCHS) if knob.offered_on(ARCHS[a])] == ["sm90"]
    good = default_config("sm90", PROB).replace(scan_gluon=1)
    assert violations(good, "sm90", PROB) == []
    assert Config(launches=1, scan_gluon=1).scan_gluon == 0     # no separate chunk scan there
    assert not violations(good.replace(launches=3), "sm90", PROB)
    for arch in ("sm80", "gfx942"):
        assert any("scan_gluon=1 is not offered" in w for w in violations(good, arch, PROB))
    bad = {  # each departure from what the kernel takes, with the words that name it
        "tiles": (good.replace(scan_block_m=32), PROB, "64 x 64 tiles in one warpgroup"),
        "warps": (good.replace(scan_warps=8), PROB, "scan_warps = 4"),
        "fp32 states": (good.replace(state_dtype="fp32"), PROB, "states in the input dtype"),
        "fp32 inputs": (good, PROB.replace(dtype="fp32"), "fp16/bf16 inputs"),
        "dstate": (good, PROB.replace(dstate=256), "dstate 64 or 128"),
        "headdim": (good, PROB.replace(headdim=80), "headdim a multiple of 64"),
        "seq_idx": (good, PROB.replace(has_seq_idx=True), "does not take seq_idx"),
    }
    for name, (cfg, prob, words) in bad.items():
        assert any(words in w for w in violations(cfg, "sm90", prob)), name


def test_pdl_is_offered_on_sm90_at_five_launches_only():
    knob = KNOB_BY_NAME["pdl"]
    assert [a for a in sorted(ARCHS) if knob.offered_on(ARCHS[a])] == ["sm90"]
    good = default_config("sm90", PROB).replace(pdl=1)
    assert violations(good, "sm90", PROB) == []
    for over in ({"state_walk": 1, "scan_gluon": 1, "fold_prep": 2}, {"fold_prep": 1}, {"smem_pad": 4}):
        assert violations(good.replace(**over), "sm90", PROB) == [], over
    for d in (3, 1):   # the fused depths order their programs by tickets: never with pdl
        assert Config(launches=d, pdl=1).pdl == 0
    for arch in ("sm80", "gfx90a", "gfx942"):   # griddepcontrol is sm90's
        assert any("pdl=1 is not offered" in w for w in violations(good, arch, PROB))
    early = good.replace(pdl=2)   # the Gluon scan's intra-chunk part before its wait
    assert any("pdl=2" in w and "scan_gluon=1" in w for w in violations(early, "sm90", PROB))
    assert violations(early.replace(scan_gluon=1), "sm90", PROB) == []
    follow = early.replace(pdl=3, scan_gluon=1)   # the scan follows the walk's published states
    assert any("pdl=3" in w and "state_walk=1" in w for w in violations(follow, "sm90", PROB))
    assert violations(follow.replace(state_walk=1), "sm90", PROB) == []


def test_walk_weights_are_offered_on_sm90_at_five_launches_with_the_walk_only():
    knob = KNOB_BY_NAME["walk_weights"]
    assert [a for a in sorted(ARCHS) if knob.offered_on(ARCHS[a])] == ["sm90"]
    walk = default_config("sm90", PROB).replace(state_walk=1, state_dtype=PROB.dtype)
    assert violations(walk.replace(walk_weights=1), "sm90", PROB) == []
    for over in ({"fold_prep": 2}, {"fold_prep": 2, "scan_gluon": 1, "pdl": 3}):
        assert violations(walk.replace(walk_weights=1, **over), "sm90", PROB) == [], over
    alone = walk.replace(state_walk=0, walk_weights=1)   # nothing would read them
    assert any("walk_weights=1" in w and "state_walk=1" in w for w in violations(alone, "sm90", PROB))
    for d in (3, 1):
        assert Config(launches=d, walk_weights=1).walk_weights == 0
    for arch in ("sm80", "gfx90a", "gfx942"):
        assert any("walk_weights=1 is not offered" in w for w in violations(walk.replace(walk_weights=1), arch, PROB))


def test_walk_split_is_offered_on_sm90_with_the_walk_and_the_chunk_walking_scan_only():
    knob = KNOB_BY_NAME["walk_split"]
    assert knob.default == 1 and [a for a in sorted(ARCHS) if knob.offered_on(ARCHS[a])] == ["sm90"]
    good = default_config("sm90", PROB).replace(state_walk=1, walk_weights=1, scan_gluon=3, walk_split=4,
                                                state_dtype=PROB.dtype)
    assert violations(good, "sm90", PROB) == []
    assert violations(good.replace(scan_gluon=2, fold_prep=2, walk_weights=0), "sm90", PROB) == []
    cases = [({"state_walk": 0, "walk_weights": 0}, "needs state_walk=1"),
             ({"scan_gluon": 1}, "needs scan_gluon=2 or 3, got 1"),
             ({"scan_gluon": 0}, "needs scan_gluon=2 or 3, got 0"),
             ({"pdl": 1}, "needs pdl=0, got 1")]
    for over, want in cases:
        assert any(w.startswith("walk_split=4") and want in w for w in violations(good.replace(**over), "sm90", PROB)), over
    for d in (3, 1):
        assert Config(launches=d, walk_split=2).walk_split == 1
    assert any("walk_split=4 is not offered" in w for w in violations(good, "sm80", PROB))


def test_walk_block_is_offered_on_sm90_with_the_walk_only():
    knob = KNOB_BY_NAME["walk_block"]
    assert knob.default == 128 and [a for a in sorted(ARCHS) if knob.offered_on(ARCHS[a])] == ["sm90"]
    good = default_config("sm90", PROB).replace(state_walk=1, walk_block=64, state_dtype=PROB.dtype)
    assert violations(good, "sm90", PROB) == []
    assert violations(good.replace(walk_weights=1, scan_gluon=3, walk_split=4), "sm90", PROB) == []
    assert any(w == "walk_block=64 sizes the Gluon walk's ring: needs state_walk=1"
               for w in violations(good.replace(state_walk=0), "sm90", PROB))
    assert Config(launches=3, walk_block=64).walk_block == 128
    assert any("walk_block=64 is not offered" in w for w in violations(good, "sm80", PROB))


def test_scan_gluon_2_is_the_chunk_walking_scan_with_the_gluon_scans_limits():
    knob = KNOB_BY_NAME["scan_gluon"]
    assert 2 in knob.values and [a for a in sorted(ARCHS) if knob.offered_on(ARCHS[a])] == ["sm90"]
    good = default_config("sm90", PROB).replace(scan_gluon=2, state_dtype=PROB.dtype)
    assert violations(good, "sm90", PROB) == []
    assert violations(good.replace(state_walk=1, walk_weights=1, fold_prep=2, pdl=1), "sm90", PROB) == []
    for pdl in (2, 3):   # the early scan is scan_gluon = 1's kernel
        assert any(f"pdl={pdl}" in w and "scan_gluon=1, got 2" in w
                   for w in violations(good.replace(pdl=pdl, state_walk=1), "sm90", PROB))
    assert any("scan_gluon=2 runs 64 x 64 tiles" in w for w in violations(good.replace(scan_block_m=32), "sm90", PROB))
    assert any("scan_gluon=2 does not take seq_idx" in w
               for w in violations(good, "sm90", PROB.replace(has_seq_idx=True)))
    assert any("scan_gluon=2 is not offered on sm80" in w for w in violations(good, "sm80", PROB))


@pytest.mark.parametrize("op", ["ssd_fwd", "ssd_bwd"])
@pytest.mark.parametrize("static", [False, True])
def test_no_tune_offers_chunk_states_narrower_than_the_inputs_and_a_static_one_no_other_16_bit_type(op, static):
    """Both ops (the backward's exclusions once lacked the rule): fp16 states for bf16 or fp32
    inputs (range) never; a static tune (no gate) also no bf16 states for fp16 inputs and no 16-bit
    states for fp32 inputs (precision); a measured tune offers those and its gate judges them."""
    allowed = {("bf16", False): {"fp32", "bf16"}, ("fp16", False): {"fp32", "bf16", "fp16"},
               ("fp32", False): {"fp32", "bf16"},
               ("bf16", True): {"fp32", "bf16"}, ("fp16", True): {"fp32", "fp16"}, ("fp32", True): {"fp32"}}
    for arch in ("sm80", "sm90", "gfx942"):
        for dtype in ("bf16", "fp16", "fp32"):
            prob = Problem(2, 4096, 80, 64, 128, 1, dtype)
            space = build_space(arch, prob, op=op, static=static)
            offered = {d.name: set(d.values) for d in space.dims}.get("state_dtype", {space.pinned.get("state_dtype")})
            assert offered <= allowed[(dtype, static)], (op, arch, dtype, offered)
            assert dtype in offered or "fp32" in offered


def test_a_knob_group_is_taken_with_an_ops_own_defaults_modes_and_values_only():
    from autossd.knobs import take
    from autossd.ops.ssd.stage_knobs import CHUNK_STATE, STATE_PASSING
    (blk,) = take(STATE_PASSING, ("pass_block",), defaults={"pass_block": 1024}, values={"pass_block": (256, 1024)},
                  depths=("stage",))
    assert (blk.name, blk.values, blk.default, blk.depths, blk.stage) == ("pass_block", (256, 1024), 1024, ("stage",),
                                                                          "state_passing")
    assert [k.name for k in take(CHUNK_STATE)] == [k.name for k in CHUNK_STATE]
    with pytest.raises(ValueError, match="no knobs of the group"):
        take(STATE_PASSING, ("scan_block_m",))
    with pytest.raises(ValueError, match="not a subset"):
        take(STATE_PASSING, values={"pass_block": (4096,)})


def test_the_ops_share_each_stage_knob_as_declared_once():
    """A knob name two ops use is one group's knob: the same stage, and values from one set."""
    from autossd.ops.registry import get_op, op_names
    from autossd.ops.ssd import stage_knobs
    groups = {k.name: k for g in (stage_knobs.CHUNK, stage_knobs.CUMSUM, stage_knobs.BMM, stage_knobs.CHUNK_STATE,
                                  stage_knobs.STATE_PASSING, stage_knobs.CHUNK_SCAN) for k in g}
    for name in op_names():
        for k in get_op(name).space.knobs:
            if k.name in groups:
                assert k.stage == groups[k.name].stage and set(k.values) <= set(groups[k.name].values), (name, k.name)


def test_a_value_no_arch_capability_offers_is_named_by_the_one_check():
    bad = Config(scan_maxnreg=128)   # a register cap: a CUDA compiler option
    assert violations(bad, "gfx942")[0] == "scan_maxnreg=128 is not offered on gfx942"


def test_a_value_renamed_reads_by_its_old_name_too():
    """A knob's value renamed keeps its old name as an alias: a record stored with the old name
    (config JSON validated on read) reads as the new value, and stores the new name."""
    from autossd.knobs import BaseConfig, Knob, KnobSpace
    space = KnobSpace("renamed", (Knob("mode", ("stage", "inline"), "stage", "where", aliases=(("staged", "stage"),)),
                                  Knob("tile", (16, 32), 16, "a tile", depths=("stage",))), mode_knob="mode")

    class Cfg(BaseConfig):
        __slots__ = ()
    Cfg.space = space
    old = Cfg.from_json('{"mode": "staged", "tile": 32}')
    assert old == Cfg(mode="stage", tile=32) and old.key() == '{"mode": "stage", "tile": 32}'
    with pytest.raises(ConfigError, match="mode"):
        Cfg(mode="stages")
