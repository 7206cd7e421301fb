"""CMA-ES over the ordinal knobs (indices); the categorical ones (state_dtype) are sampled
independently by Optuna's fallback. Needs the `cmaes` package."""
import optuna

from ..search_space import SearchSpace


def make(space: SearchSpace, seed: int | None) -> optuna.samplers.BaseSampler:
    try:
        import cmaes  # noqa: F401
    except ImportError:
        raise ImportError("sampler cmaes needs the cmaes package, which the 'tune' extra installs: "
                          "pip install \"autossd[tune]\"") from None
    return optuna.samplers.CmaEsSampler(seed=seed,
                                        independent_sampler=optuna.samplers.RandomSampler(seed=seed))
