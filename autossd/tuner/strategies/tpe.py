"""TPE, the default: good with many categorical/ordinal knobs and few trials. Multivariate so
that coupled tiles (block_m with chunk_size) are modelled together; constant liar so that
parallel workers do not all sample the same point."""
import optuna

from ..space import SearchSpace


def make(space: SearchSpace, seed: int | None) -> optuna.samplers.BaseSampler:
    startup = max(4, min(10, len(space.dims)))  # random trials before the model takes over
    return optuna.samplers.TPESampler(seed=seed, multivariate=True, constant_liar=True,
                                      n_startup_trials=startup)
