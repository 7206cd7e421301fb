"""Cross-compilation for all four archs without a GPU; every knob offered on an arch changes
the compiled code there; configs over an arch's limits are rejected with the reason."""
import pytest

from autossd.arch import ARCHS
from autossd.compile import compile_config
from autossd.problem import Problem
from autossd.space import KNOBS, Config, default_config

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


# Which stage to compile to see a knob: its own, or chunk_scan (it has both matmuls) for the rest.
def _stage(knob):
    return knob.stage if knob.stage != "all" else "chunk_scan"


def _offered(arch):
    return [(arch, k.name) for k in KNOBS if k.offered_on(ARCHS[arch])]


@pytest.mark.parametrize("arch,name", [p for a in sorted(ARCHS) for p in _offered(a)])
def test_every_offered_knob_changes_the_artifact(arch, name):
    knob = next(k for k in KNOBS if k.name == name)
    base = default_config(arch, PROB)
    shas = set()
    for v in knob.values:
        cfg = base.replace(**{name: v})
        rep = compile_config(cfg, arch, PROB, stages=(_stage(knob),))
        if not rep.ok:
            continue
        shas.add(rep.stages[0].artifact_sha)
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
