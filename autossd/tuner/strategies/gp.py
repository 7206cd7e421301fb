"""Gaussian-process BO (Optuna's GPSampler; needs scipy and torch). Sample-efficient for small
budgets, slower per suggestion than TPE."""
import optuna

from ..search_space import SearchSpace


def make(space: SearchSpace, seed: int | None) -> optuna.samplers.BaseSampler:
    try:
        import scipy  # noqa: F401
    except ImportError:
        raise ImportError("sampler gp needs scipy, which the 'tune' extra installs: "
                          "pip install \"autossd[tune]\"") from None
    return optuna.samplers.GPSampler(seed=seed, n_startup_trials=8)
