"""Plots to files (matplotlib, Agg backend): the tuning history of a study and a roofline of
stored records (achieved FLOP rate against arithmetic intensity, per arch)."""
from __future__ import annotations

import re
from collections.abc import Iterable
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from .arch import ARCHS  # noqa: E402
from .tuner.sinks import mode_of  # noqa: E402


def _slug(text: str) -> str:
    slug = re.sub(r"[^A-Za-z0-9_.-]+", "_", text)
    if len(slug) <= 150:
        return slug
    # a long study name (a decode or packed-prefill problem names every field) cut short could
    # name another study's file: the cut keeps a hash of the whole name
    import hashlib
    return slug[:141] + "_" + hashlib.sha256(text.encode()).hexdigest()[:8]


def history_plot(study, path: str | Path) -> Path:
    """Each evaluated candidate's time by trial number, failures marked, best so far as a line."""
    from optuna.trial import TrialState
    trials = [t for t in study.get_trials(deepcopy=False) if t.user_attrs.get("evaluated")]
    ok = [(t.number, t.value) for t in trials if t.state == TrialState.COMPLETE]
    bad = [t.number for t in trials if t.state == TrialState.FAIL]
    fig, ax = plt.subplots(figsize=(7, 4))
    if ok:
        xs, ys = zip(*ok)
        ax.scatter(xs, ys, s=14, label="candidate", color="tab:blue")
        best, run = [], float("inf")
        for y in ys:
            run = min(run, y)
            best.append(run)
        ax.step(xs, best, where="post", color="tab:red", label="best so far")
        top = max(ys)
        if bad:
            ax.scatter(bad, [top * 1.05] * len(bad), marker="x", color="gray", label="failed")
        ax.set_yscale("log")
    ax.set_xlabel("trial")
    ax.set_ylabel("time (ms)" + (" — predicted" if study.user_attrs.get("mode") == "static" else ""))
    ax.set_title(study.study_name, fontsize=7)
    ax.legend(fontsize=8)
    return _save(fig, path)


def roofline_points(records: Iterable[dict]) -> dict[str, list[tuple[str, float, float]]]:
    """(arch, intensity, TFLOP/s) per record, grouped by what its time measured: "gpu" (a
    measured graph replay), "static" (a model's prediction of GPU time) and "eager" (eager calls,
    also every measured record from before launch modes: tuner.records.mode_of; the host's
    launch time is in it, so at a small shape the point says how fast the host is, not the
    GPU). Intensity = causal FLOPs / min bytes, rate = FLOPs / time."""
    from .ops.registry import get_op
    out: dict[str, list] = {"gpu": [], "static": [], "eager": []}
    for r in records:
        prob = get_op(r.get("op", "ssd_fwd")).problem_type(**r["problem"])   # any op's problem type
        flops = prob.flops(r["config"].get("chunk_size", 256))
        group = ("static" if r["provenance"] != "measured"
                 else "eager" if mode_of(r) == "eager" else "gpu")
        out[group].append((r["arch"], flops / prob.min_bytes(), flops / (r["time_ms"] * 1e-3) / 1e12))
    return out


def roofline_plot(records: Iterable[dict], path: str | Path) -> Path:
    """Records as points under each arch's roofline min(peak, intensity x bandwidth): filled
    circles are measured GPU times, hollow ones static predictions, crosses eager-call times
    (host included; roofline_points)."""
    recs = list(records)
    fig, ax = plt.subplots(figsize=(7, 5))
    colors = dict(zip(sorted(ARCHS), ("tab:blue", "tab:orange", "tab:green", "tab:red")))
    for arch in sorted({r["arch"] for r in recs}):
        a = ARCHS.get(arch)
        if a is None:
            continue
        xs = [2.0 ** k for k in range(-2, 12)]
        ax.plot(xs, [min(a.matmul_tflops, x * a.hbm_gbps / 1e3) for x in xs], color=colors[arch],
                lw=1, label=f"{arch} roofline")
    style = {"gpu": dict(marker="o", filled=True, label="measured (GPU time)"),
             "static": dict(marker="o", filled=False, label="static prediction"),
             "eager": dict(marker="x", filled=True, label="eager calls (host time included)")}
    for group, pts in roofline_points(recs).items():
        st = style[group]
        for i, (arch, ai, rate) in enumerate(pts):
            c = colors.get(arch, "k")
            ax.scatter([ai], [rate], marker=st["marker"], s=30, color=c,
                       facecolors=c if st["filled"] else "none", label=st["label"] if i == 0 else None)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("arithmetic intensity (FLOP / min byte)")
    ax.set_ylabel("TFLOP/s")
    ax.set_title("autossd records", fontsize=9)
    ax.legend(fontsize=8)
    return _save(fig, path)


def plot_all(storage_spec: str | None, records: list[dict], out_dir: str | Path,
             arch: str | None = None) -> list[Path]:
    """History of every study in the storage (optionally of one arch) and one roofline."""
    import optuna

    from .tuner.storage import open_storage
    out = Path(out_dir)
    paths = []
    storage = open_storage(storage_spec)
    for s in optuna.get_all_study_summaries(storage, include_best_trial=False):
        if arch and f":{arch}:" not in s.study_name:
            continue
        study = optuna.load_study(study_name=s.study_name, storage=storage)
        paths.append(history_plot(study, out / f"history_{_slug(s.study_name)}.png"))
    if records:
        paths.append(roofline_plot([r for r in records if not arch or r["arch"] == arch],
                                   out / "roofline.png"))
    return paths


def _save(fig, path: str | Path) -> Path:
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
