"""Fit the static performance model's constants (autossd/tuner/model.py `Constants`) to configs
measured on a GPU by scripts/model_quality.py, and report the ranking quality on held-out shapes.

    python scripts/fit_model.py DATA.json [MORE.json ...] [--ridge 10] [--trials 0] [--seed 0]
        [--out autossd/../tuning_db/model_sm90.json]

Two parts, the second on top of the first:
  constants (--trials N > 0): Optuna's TPE over the analytic constants (log-uniform ranges around
      the defaults) and a time factor per stage, scored on the training shapes by
      mean (1 - Spearman rho) + 2 x log(measured time of the model's top-1 over the best measured);
  knob terms (--ridge L): ridge regression (penalty L) of log(measured / predicted) on the one-hot
      values of every knob, centred per shape (only the ranking within a shape matters): a value's
      typical effect that the analytic part leaves out.
Quality is reported per shape by leave-one-shape-out: each shape ranked by the fit of the others
(Spearman rho, and the measured time of the predicted best over the measured best), beside the
unfitted model. --out writes the fit on all shapes (what tuning_db/model_<arch>.json holds: the
model loads it for that arch). No GPU needed.
"""
from __future__ import annotations

import argparse
import dataclasses
import gzip
import json
import math
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))
from model_quality import problem_of, spearman  # noqa: E402

# (field, low, high): log-uniform search ranges of Constants' fields
RANGES = (("l2_ratio", 1.0, 12.0), ("w_mem", 4.0, 128.0), ("w_mma", 1.0, 32.0),
          ("t_launch", 0.5e-6, 20e-6), ("t_dep", 0.1e-6, 5e-6), ("t_handoff", 0.5e-6, 12e-6),
          ("pipe_gain", 0.05, 2.0), ("mma_k", 8.0, 128.0))
SCALE_RANGE = (0.25, 4.0)


@dataclasses.dataclass
class Case:
    """One measured config of one shape, with what predict needs precomputed."""
    shape: int
    problem: object
    config: object
    report: object
    costs: list
    measured_ms: float


def load(paths: list[str], measured: str = "graph_ms") -> tuple[str, list[str], list[Case]]:
    from autossd.compile import CompileReport, StageReport
    from autossd.ops.registry import get_op
    op = get_op("ssd_fwd")
    cases, shapes, arch = [], [], None
    for path in paths:
        with (gzip.open(path, "rt") if path.endswith(".gz") else open(path)) as f:
            data = json.load(f)
        arch = arch or data["arch"]
        if data["arch"] != arch:
            raise SystemExit(f"{path}: arch {data['arch']}, the others {arch}")
        for r in data["rows"]:
            if not (r.get("ok") and r.get(measured) and r.get("report")):
                continue
            key = f"{r['shape']} {data.get('dtype', 'fp16')}"
            if key not in shapes:
                shapes.append(key)
            prob = problem_of(r["shape"], data.get("dtype", "fp16"))
            cfg = op.config(r["config"])
            rep = CompileReport(arch, cfg, [StageReport(**s) for s in r["report"]], [])
            cases.append(Case(shapes.index(key), prob, cfg, rep, op.fn("cost_model")(prob, cfg), r[measured]))
    return arch, shapes, cases


def predictions(arch: str, cases: list[Case], k) -> list[float]:
    from autossd.tuner.model import predict
    return [predict(arch, c.problem, c.config, c.report, k, c.costs)[0] for c in cases]


def quality(cases: list[Case], pred: list[float]) -> tuple[float | None, float]:
    """(Spearman rho, measured ms of the lowest predicted over the best measured)."""
    meas = [c.measured_ms for c in cases]
    top = min(range(len(cases)), key=lambda i: pred[i])
    return spearman(pred, meas), meas[top] / min(meas)


def per_shape(arch: str, cases: list[Case], k, shapes: range) -> dict[int, tuple]:
    pred = predictions(arch, cases, k)
    out = {}
    for s in shapes:
        idx = [i for i, c in enumerate(cases) if c.shape == s]
        out[s] = quality([cases[i] for i in idx], [pred[i] for i in idx])
    return out


def loss(q: dict[int, tuple]) -> float:
    return sum((1 - (rho if rho is not None else 0.0)) + 2 * math.log(top) for rho, top in q.values()) / len(q)


def fit(arch: str, cases: list[Case], train: list[int], trials: int, seed: int):
    import optuna

    from autossd.tuner.model import DEFAULT_CONSTANTS
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    stages = sorted({s.stage for c in cases for s in c.costs})
    # from the round defaults, not the arch's shipped fit: a fit does not feed on the last one
    base = DEFAULT_CONSTANTS
    train_cases = [c for c in cases if c.shape in train]

    def make(params: dict):
        k = {f: params[f] for f, _, _ in RANGES}
        scale = tuple((s, params[f"scale_{s}"]) for s in stages)
        return dataclasses.replace(base, **k, stage_scale=scale)

    def objective(trial: optuna.Trial) -> float:
        params = {f: trial.suggest_float(f, lo, hi, log=True) for f, lo, hi in RANGES}
        params.update({f"scale_{s}": trial.suggest_float(f"scale_{s}", *SCALE_RANGE, log=True) for s in stages})
        return loss(per_shape(arch, train_cases, make(params), train))

    study = optuna.create_study(sampler=optuna.samplers.TPESampler(seed=seed))
    start = {f: getattr(base, f) for f, _, _ in RANGES}
    start.update({f"scale_{s}": base.scale(s) for s in stages})
    study.enqueue_trial(start)
    study.optimize(objective, n_trials=trials)
    return make(study.best_params), study.best_value


def features(cases: list[Case]) -> list[tuple[str, str]]:
    """(knob, value) pairs of the knobs that take more than one value in `cases`."""
    vals: dict[str, set] = {}
    for c in cases:
        for k, v in c.config.as_dict().items():
            vals.setdefault(k, set()).add(str(v))
    return [(k, v) for k in sorted(vals) for v in sorted(vals[k]) if len(vals[k]) > 1]


def ridge(arch: str, cases: list[Case], base, lam: float):
    """`base` with knob terms fitted on `cases` (see the module docstring)."""
    import torch
    base = dataclasses.replace(base, knob_terms=())
    feats = features(cases)
    pred = predictions(arch, cases, base)
    A = torch.tensor([[1.0 if str(c.config[k]) == v else 0.0 for k, v in feats] for c in cases], dtype=torch.float64)
    y = torch.tensor([math.log(c.measured_ms / p) for c, p in zip(cases, pred)], dtype=torch.float64)
    for s in {c.shape for c in cases}:
        idx = torch.tensor([i for i, c in enumerate(cases) if c.shape == s])
        y[idx] -= y[idx].mean()
    w = torch.linalg.solve(A.T @ A + lam * torch.eye(len(feats), dtype=torch.float64), A.T @ y)
    terms = tuple((k, v, round(float(x), 5)) for (k, v), x in zip(feats, w) if abs(float(x)) > 1e-6)
    return dataclasses.replace(base, knob_terms=terms)


def fit_all(arch: str, cases: list[Case], train: list[int], a):
    from autossd.tuner.model import DEFAULT_CONSTANTS
    base = DEFAULT_CONSTANTS
    if a.trials > 0:
        base, _ = fit(arch, cases, train, a.trials, a.seed)
    return ridge(arch, [c for c in cases if c.shape in train], base, a.ridge)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("data", nargs="+", help="scripts/model_quality.py JSON files (.json or .json.gz)")
    ap.add_argument("--ridge", type=float, default=10.0, help="ridge penalty of the knob terms")
    ap.add_argument("--trials", type=int, default=0, help="Optuna trials of the analytic constants (0: keep them)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--source", default="", help="provenance text stored with --out")
    ap.add_argument("--out", help="write the fit on all shapes here (JSON, tuning_db/model_<arch>.json)")
    a = ap.parse_args(argv)
    from autossd.tuner.model import DEFAULT_CONSTANTS
    arch, shapes, cases = load(a.data)
    everything = list(range(len(shapes)))
    before = per_shape(arch, cases, DEFAULT_CONSTANTS, everything)
    cv = {}
    for s in everything:   # leave one shape out
        k = fit_all(arch, cases, [i for i in everything if i != s], a)
        cv[s] = per_shape(arch, cases, k, [s])[s]
    f = lambda v: "-" if v is None else f"{v:.3f}"   # noqa: E731
    print(f"{arch}: {len(cases)} measured configs over {len(shapes)} shapes; each shape ranked by the fit "
          f"of the others (ridge {a.ridge:g}, {a.trials} constant trials)")
    print(f"{'idx':>3} {'shape':44s} {'n':>4}  {'rho unfitted':>12} {'top1 unfitted':>13}  {'rho held out':>12} "
          f"{'top1 held out':>13}")
    for i, s in enumerate(shapes):
        n = sum(c.shape == i for c in cases)
        print(f"{i:3d} {s[:44]:44s} {n:4d}  {f(before[i][0]):>12} {f(before[i][1]):>13}  {f(cv[i][0]):>12} {f(cv[i][1]):>13}")
    rhos = [cv[i][0] for i in everything if cv[i][0] is not None]
    print(f"held out: min rho {min(rhos):.3f}, worst top-1 ratio {max(cv[i][1] for i in everything):.3f}")
    if a.out:
        k = dataclasses.replace(fit_all(arch, cases, everything, a), source=a.source)
        with open(a.out, "w") as fh:
            json.dump({"arch": arch, "constants": dataclasses.asdict(k), "shapes": shapes,
                       "measured_configs": len(cases), "ridge": a.ridge, "constant_trials": a.trials,
                       "unfitted": {shapes[i]: {"rho": v[0], "top1_ratio": v[1]} for i, v in before.items()},
                       "held_out": {shapes[i]: {"rho": v[0], "top1_ratio": v[1]} for i, v in cv.items()}},
                      fh, indent=1)
        print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
