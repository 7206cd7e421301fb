"""The tuner's view of an op's knob space: which knobs are searched for an (arch, problem), how
each maps to an Optuna distribution, and back. The op (`autossd.ops.registry`) supplies its
knobs, defaults, constraints, per-problem tile caps, excluded values and seed configs.

Numeric knobs are sampled as an *index* into their offered values (IntDistribution), so samplers
that model order (TPE, GP, CMA-ES) see 16 < 32 < 64 rather than unordered labels; string knobs
(state_dtype) are categorical. Values that exceed the problem's padded sizes are dropped from the
space up front (they could only be pruned); cross-knob rules (tile <= chunk) are left to the
op's `violations`, checked before any compile.
"""
from __future__ import annotations

import itertools
import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import optuna
from optuna.distributions import BaseDistribution, CategoricalDistribution, IntDistribution

from ..arch import Arch, get_arch
from ..knobs import BaseConfig as Config
from ..ops.registry import Op, get_op, op_of


@dataclass(frozen=True)
class Dim:
    """One searched knob: its name and the values offered for this (arch, problem)."""
    name: str
    values: tuple

    @property
    def ordinal(self) -> bool:
        return all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in self.values)

    def distribution(self) -> BaseDistribution:
        if self.ordinal:
            return IntDistribution(0, len(self.values) - 1)
        return CategoricalDistribution(self.values)

    def encode(self, value: Any) -> Any:
        """The param of a value; ValueError when the dimension does not offer it (a seed from a
        record made before a value was excluded would otherwise fail the study at its trial)."""
        if value not in self.values:
            raise ValueError(f"{self.name}={value!r} is not among {self.values}")
        return self.values.index(value) if self.ordinal else value

    def decode(self, param: Any) -> Any:
        return self.values[int(param)] if self.ordinal else param


@dataclass(frozen=True)
class SearchSpace:
    arch: str
    dims: tuple[Dim, ...]
    pinned: Mapping[str, Any]      # knobs with one value here (not offered, capped, or fixed)
    # per fusion depth, pinned values that differ by depth (a static tune keeps each depth's
    # default for the knobs it cannot rank: the sm90 chunk scan's register cap is 128 at five
    # and three launches, none at one)
    pinned_at: Mapping[int, Mapping[str, Any]] = field(default_factory=dict)
    op: str = ""   # (build_space sets it: the op whose knobs these are)

    @property
    def _op(self) -> Op:
        return get_op(self.op)

    @property
    def mode(self) -> str:
        """The op's mode knob (the forward's fusion depth, `launches`)."""
        return self._op.mode_knob

    def _default(self, name: str) -> Any:
        return self._op.space.by_name[name].default

    def _make(self, values: Mapping[str, Any]) -> Config:
        return self._op.config_type(values)

    def pins(self, launches: Any) -> dict[str, Any]:
        """The pinned values at a mode (the forward's fusion depth)."""
        return {**self.pinned, **self.pinned_at.get(launches, {})}

    def distributions(self) -> dict[str, BaseDistribution]:
        return {d.name: d.distribution() for d in self.dims}

    def _dims_at(self, launches: int) -> list[Dim]:
        return [d for d in self.dims if d.name != self.mode and self._used(d.name, launches)]

    def _depths(self) -> tuple:
        depth = next((d for d in self.dims if d.name == self.mode), None)
        return depth.values if depth else (self.pinned.get(self.mode, self._default(self.mode)),)

    def size(self) -> int:
        """Distinct configs: at each fusion depth, the product of the knobs that depth uses."""
        return sum(math.prod(len(d.values) for d in self._dims_at(n)) for n in self._depths())

    def _used(self, name: str, launches: int) -> bool:
        return self._op.space.by_name[name].shapes(launches)

    def suggest(self, trial: optuna.Trial) -> Config:
        """Sample a Config through Optuna's define-by-run API. The fusion depth is drawn first
        and only the knobs its kernels use are drawn after it (a conditional space), so the
        samplers never model a knob that cannot change the result."""
        values = dict(self.pinned)

        def draw(d: Dim) -> None:
            if d.ordinal:
                values[d.name] = d.decode(trial.suggest_int(d.name, 0, len(d.values) - 1))
            else:
                values[d.name] = trial.suggest_categorical(d.name, list(d.values))
        for d in self.dims:
            if d.name == self.mode:
                draw(d)
        launches = values.get(self.mode, self._default(self.mode))
        values.update(self.pinned_at.get(launches, {}))
        for d in self._dims_at(launches):
            draw(d)
        return self._make(values)

    def config_from_params(self, params: Mapping[str, Any]) -> Config:
        drawn = {d.name: d.decode(params[d.name]) for d in self.dims if d.name in params}
        launches = drawn.get(self.mode, self.pinned.get(self.mode, self._default(self.mode)))
        return self._make({**self.pins(launches), **drawn})

    def params(self, config: Config) -> dict[str, Any] | None:
        """The Optuna params of a config (the knobs its depth uses), or None when it lies
        outside this space."""
        mode = config[self.mode]
        if any(config[k] != v for k, v in self.pins(mode).items()
               if self._used(k, mode) or k == self.mode):
            return None
        try:
            return {d.name: d.encode(config[d.name]) for d in self.dims
                    if d.name == self.mode or self._used(d.name, mode)}
        except ValueError:
            return None

    def grid(self) -> dict[str, list]:
        """GridSampler's search space (encoded values). A grid cannot be conditional: brute force
        needs the fusion depth pinned (build_space then drops the knobs that depth ignores)."""
        return {d.name: [d.encode(v) for v in d.values] for d in self.dims}

    def enumerate(self) -> Iterator[Config]:
        """Every distinct config of the space, depth by depth, in a fixed order (feasible or not)."""
        for n in self._depths():
            dims = self._dims_at(n)
            for combo in itertools.product(*(d.values for d in dims)):
                yield self._make({**self.pins(n), self.mode: n, **{d.name: v for d, v in zip(dims, combo)}})


def build_space(arch: Arch | str, problem, fixed: Mapping[str, Any] | None = None,
                static: bool = False, op: str | None = None, allow_unvalidated: bool = False) -> SearchSpace:
    """The search space of `op` for `problem` on `arch`. `fixed` pins knobs (validated like a
    config). `static` (model-ranked, no GPU): knobs the model cannot rank (Knob.measured_only)
    keep each mode's default unless fixed. On an arch whose hardware never ran autossd, the
    values whose correctness only a run there could show (Op.unvalidated) are left out unless
    `allow_unvalidated` (or a `fixed` pin asks for one)."""
    arch = get_arch(arch) if isinstance(arch, str) else arch
    op = op_of(problem, op)
    o = get_op(op)
    mode = o.mode_knob
    fixed = dict(fixed or {})
    o.config_type(fixed)  # unknown names / values outside a knob's set raise ConfigError here
    if getattr(problem, "chunk_size", None) is not None and "chunk_size" in o.space.by_name:
        fixed.setdefault("chunk_size", problem.chunk_size)
    limit = o.fn("caps")(problem) if o.caps else {}
    excluded = o.fn("excluded")(problem, static=static) if o.excluded else {}
    if o.unvalidated and not allow_unvalidated:
        for name, values in o.fn("unvalidated")(arch).items():
            excluded[name] = tuple(excluded.get(name, ())) + tuple(values)
    default = o.fn("default_config")
    dims, pinned, pinned_at = [], {}, {}
    for knob in o.space.knobs:
        if knob.name in fixed:
            pinned[knob.name] = fixed[knob.name]
            continue
        if static and knob.measured_only:   # each mode's default for this arch
            pinned[knob.name] = knob.default
            for d in knob.depths:
                pinned_at.setdefault(d, {})[knob.name] = default(arch, problem, **{mode: d})[knob.name]
            continue
        values = tuple(v for v in knob.values_on(arch)
                       if (knob.name not in limit or v <= limit[knob.name])
                       and v not in excluded.get(knob.name, ()))
        if len(values) > 1 and (mode not in fixed or knob.shapes(fixed[mode])):
            dims.append(Dim(knob.name, values))
        else:   # one value here, or unused by the pinned mode's kernels
            pinned[knob.name] = values[0] if len(values) == 1 else knob.default
    return SearchSpace(arch.name, tuple(dims), pinned, pinned_at, op)


def space_default(arch: Arch | str, problem, space: SearchSpace) -> Config:
    """The op's default for the problem at the space's pinned mode, with the space's pins set
    (feasible or not)."""
    o = get_op(space.op)
    mode = space.pinned.get(space.mode)
    base = o.fn("default_config")(arch, problem, **({space.mode: mode} if mode is not None else {}))
    return base.replace(**{k: v for k, v in space.pins(base[space.mode]).items() if base[k] != v})


def seed_configs(arch: Arch | str, problem, space: SearchSpace) -> list[Config]:
    """Known-good starting points enqueued before sampling, the op's default first: the op's
    own seeds where it declares them (`Op.seeds`), each inside the space and feasible."""
    o = get_op(space.op)
    if o.seeds:
        return o.fn("seeds")(arch, problem, space)
    base = space_default(arch, problem, space)
    ok = space.params(base) is not None and not o.fn("violations")(base, arch, problem)
    return [base] if ok else []
