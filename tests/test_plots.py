"""plots: the roofline keeps eager-call times (host included) apart from GPU times."""
from autossd.db import make_record
from autossd.plots import roofline_plot, roofline_points
from autossd.problem import Problem
from autossd.ops.ssd.fwd_knobs import default_config
from autossd.tuner.sinks import db_record_dict

PROB = Problem(1, 2048, 80, 64, 128, 1, "fp16", 256, has_D=True)


def _rec(mode, provenance="measured", ms=0.1):
    time_ms, predicted_ms = (ms, None) if provenance == "measured" else (None, ms)
    return db_record_dict(make_record(PROB, default_config("sm90", PROB), "sm90", provenance=provenance,
                                      time_ms=time_ms, predicted_ms=predicted_ms, launch_mode=mode))


def test_roofline_groups_records_by_what_their_time_measured(tmp_path):
    recs = [_rec("graph", ms=0.08), _rec("eager", ms=0.16), _rec("any", "static", ms=0.05)]
    pts = roofline_points(recs)
    assert [len(pts[g]) for g in ("gpu", "eager", "static")] == [1, 1, 1]
    # the same problem: the eager point sits at half the graph point's rate, on its own marker
    (_, ai_g, rate_g), (_, ai_e, rate_e) = pts["gpu"][0], pts["eager"][0]
    assert ai_g == ai_e and abs(rate_e / rate_g - 0.5) < 1e-9
    assert roofline_plot(recs, tmp_path / "r.png").stat().st_size > 1000
    # a measured record from before launch modes was timed by eager calls (tuner.records.mode_of)
    legacy = {k: v for k, v in _rec("eager").items() if k != "launch_mode"}
    assert [len(roofline_points([legacy])[g]) for g in ("gpu", "eager")] == [0, 1]
