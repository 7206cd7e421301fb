"""Sampler choices, one small module each. `make_sampler(name, space, seed)` builds one."""
from __future__ import annotations

import warnings
from collections.abc import Callable

import optuna

from ..search_space import SearchSpace
from . import brute, cmaes, gp, local, random, tpe

SAMPLERS: dict[str, Callable[[SearchSpace, int | None], optuna.samplers.BaseSampler]] = {
    "tpe": tpe.make,
    "gp": gp.make,
    "cmaes": cmaes.make,
    "brute": brute.make,
    "random": random.make,
    "local": local.make,
}
DEFAULT = "tpe"
# multivariate TPE and GP are marked experimental by Optuna; we choose them knowingly
warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)


class SamplerError(ValueError):
    pass


def make_sampler(name: str, space: SearchSpace, seed: int | None = None) -> optuna.samplers.BaseSampler:
    try:
        factory = SAMPLERS[name]
    except KeyError:
        raise SamplerError(f"sampler: unknown {name!r}; expected one of {sorted(SAMPLERS)}") from None
    return factory(space, seed)
