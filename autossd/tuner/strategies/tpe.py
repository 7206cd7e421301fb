"""TPE, the default: good with many categorical/ordinal knobs and few trials. Multivariate so
that coupled tiles (block_m with chunk_size) are modelled together; constant liar so that
parallel workers do not all sample the same point; grouped because the space is conditional
(each fusion depth draws only the knobs its kernels use)."""
import warnings

import optuna

from ..search_space import SearchSpace


def make(space: SearchSpace, seed: int | None) -> optuna.samplers.BaseSampler:
    startup = max(4, min(10, len(space.dims)))  # random trials before the model takes over
    with warnings.catch_warnings():  # group= is marked experimental; it is what conditional spaces need
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        return optuna.samplers.TPESampler(seed=seed, multivariate=True, group=True, constant_liar=True,
                                          n_startup_trials=startup)
