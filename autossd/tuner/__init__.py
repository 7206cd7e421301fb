"""The tuner: Optuna studies over an op's knob space (`autossd.ops.registry`), measured on the local GPU or predicted
for an absent arch (static mode), results stored through a small sink seam."""
from .api import choose_mode, make_runner, tune
from .sinks import JsonlSink, make_result, open_sink
from .shapes import ShapeError, parse_shape, parse_shapes, preset
from .search_space import SearchSpace, build_space, seed_configs
from .study import Settings, TuneResult, bucket, study_name, tune_problem
from .runners.measured import kept_eval_workers

__all__ = ["JsonlSink", "SearchSpace", "Settings", "ShapeError", "TuneResult", "bucket",
           "build_space", "choose_mode", "kept_eval_workers", "make_result", "make_runner",
           "open_sink", "parse_shape", "parse_shapes", "preset", "seed_configs", "study_name",
           "tune", "tune_problem"]
