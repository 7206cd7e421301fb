"""Brute force: every point of the space once, via GridSampler. Only for small spaces (pin
knobs with --fix to shrink one); infeasible points are pruned before compile, so they are cheap."""
import optuna

from ..search_space import SearchSpace

MAX_POINTS = 50_000


class BruteSampler(optuna.samplers.GridSampler):
    """GridSampler for an ask/tell loop: its after_trial calls study.stop(), which is only legal
    inside optimize(); our loop checks is_exhausted() itself."""

    def after_trial(self, study, trial, state, values) -> None:
        pass


def make(space: SearchSpace, seed: int | None) -> optuna.samplers.BaseSampler:
    if any(d.name == "launches" for d in space.dims):
        raise ValueError("sampler brute: a grid cannot follow the fusion depth's conditional knobs; "
                         "pin it with --fix launches=5 (or 3, or 1) and run one brute force per depth")
    n = space.size()
    if n > MAX_POINTS:
        raise ValueError(f"sampler brute: the space has {n} points (> {MAX_POINTS}); "
                         "pin knobs with --fix name=value to shrink it")
    return BruteSampler(space.grid(), seed=seed)
