"""Uniform random sampling: the baseline the model-based samplers must beat."""
import optuna

from ..search_space import SearchSpace


def make(space: SearchSpace, seed: int | None) -> optuna.samplers.BaseSampler:
    return optuna.samplers.RandomSampler(seed=seed)
