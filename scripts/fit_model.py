"""Fit the static performance model's constants (autossd/tuner/model.py `Constants`) to configs
measured on a GPU by scripts/model_quality.py, and report the ranking quality on held-out shapes.

    python scripts/fit_model.py DATA.json [MORE.json ...] [--hold-out 1,4] [--trials 400] [--seed 0]
        [--out constants.json]

The search is Optuna's TPE over the constants (log-uniform ranges around the defaults) and a time
factor per stage; each candidate is scored on the training shapes by

    loss = mean over shapes of (1 - Spearman rho) + 2 x log(measured time of the model's top-1
           over the best measured time)

(ranking all configs, and the top-1 pick, which is what a static tune stores). The cost model of
each (problem, config) is computed once; only the constants change between candidates. The report
prints, per shape, rho and the top-1 ratio under the default constants and under the fitted
ones, held-out shapes marked; --out writes the fitted constants as JSON (model.py's CONSTANTS
takes them as a Constants(...) literal). No GPU needed.
"""
from __future__ import annotations

import argparse
import dataclasses
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
        with open(path) as f:
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

    from autossd.tuner.model import constants_for
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    stages = sorted({s.stage for c in cases for s in c.costs})
    base = constants_for(arch)
    train_cases = [c for c in cases if c.shape in train]
    remap = {s: i for i, s in enumerate(train)}
    for c in train_cases:   # per_shape over range(len(train))
        c.shape = remap[c.shape]

    def make(params: dict):
        k = {f: params[f] for f, _, _ in RANGES}
        scale = tuple((s, params[f"scale_{s}"]) for s in stages)
        return dataclasses.replace(base, **k, stage_scale=scale)

    def objective(trial: optuna.Trial) -> float:
        params = {f: trial.suggest_float(f, lo, hi, log=True) for f, lo, hi in RANGES}
        params.update({f"scale_{s}": trial.suggest_float(f"scale_{s}", *SCALE_RANGE, log=True) for s in stages})
        return loss(per_shape(arch, train_cases, make(params), range(len(train))))

    study = optuna.create_study(sampler=optuna.samplers.TPESampler(seed=seed))
    start = {f: getattr(base, f) for f, _, _ in RANGES}
    start.update({f"scale_{s}": base.scale(s) for s in stages})
    study.enqueue_trial(start)
    study.optimize(objective, n_trials=trials)
    inv = {i: s for s, i in remap.items()}
    for c in train_cases:
        c.shape = inv[c.shape]
    return make(study.best_params), study.best_value


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("data", nargs="+", help="scripts/model_quality.py JSON files")
    ap.add_argument("--hold-out", default="", help="comma-separated shape indices kept out of the fit")
    ap.add_argument("--trials", type=int, default=400)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", help="write the fitted constants here (JSON)")
    a = ap.parse_args(argv)
    from autossd.tuner.model import DEFAULT_CONSTANTS
    arch, shapes, cases = load(a.data)
    held = {int(x) for x in a.hold_out.split(",") if x}
    train = [i for i in range(len(shapes)) if i not in held]
    before = per_shape(arch, cases, DEFAULT_CONSTANTS, range(len(shapes)))
    k, best = fit(arch, cases, train, a.trials, a.seed)
    after = per_shape(arch, cases, k, range(len(shapes)))
    f = lambda v: "-" if v is None else f"{v:.3f}"   # noqa: E731
    print(f"{arch}: {len(cases)} measured configs over {len(shapes)} shapes; training loss {best:.3f}")
    print(f"{'idx':>3} {'shape':48s} {'n':>4}  {'rho before':>10} {'top1 before':>11}  {'rho after':>9} {'top1 after':>10}")
    for i, s in enumerate(shapes):
        n = sum(c.shape == i for c in cases)
        tag = " (held out)" if i in held else ""
        print(f"{i:3d} {s[:48]:48s} {n:4d}  {f(before[i][0]):>10} {f(before[i][1]):>11}  "
              f"{f(after[i][0]):>9} {f(after[i][1]):>10}{tag}")
    print("fitted:", k)
    if a.out:
        with open(a.out, "w") as fh:
            json.dump({"arch": arch, "constants": dataclasses.asdict(k), "shapes": shapes, "held_out": sorted(held),
                       "before": {shapes[i]: v for i, v in before.items()},
                       "after": {shapes[i]: v for i, v in after.items()}}, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
