"""Knobs, knob spaces and validated configs, for any op.

An op declares its knobs once (a `KnobSpace`): from that declaration flow the op's typed config
class (validation), the template variables (the renderer passes the config's values), the
tuner's Optuna space, the constraints and the tuning database's JSON (validated against the same
space on read). A value outside a knob's declared set cannot enter a config, so no unvalidated
value reaches generated source.

Each space has a *mode knob* (the forward's `launches`: its fusion depth) whose value decides
which kernels run; a knob names the modes whose kernels it shapes (`Knob.depths`), and takes its
default under any other mode, so there is one config per distinct set of kernels.
"""
from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields, replace
from typing import Any, ClassVar, Iterator

from .arch import Arch


@dataclass(frozen=True)
class Knob:
    name: str
    values: tuple
    default: Any
    doc: str
    stage: str = "all"            # which kernel stage it shapes
    depths: tuple | None = None   # values of the space's mode knob whose kernels it shapes (None: all)
    measured_only: bool = False   # the static model cannot rank it: static tunes keep the default
    # capabilities an arch must have for the knob to be offered there (Arch.capabilities):
    # elsewhere it is pinned to its default. "cuda"/"hip" name a backend's compiler options.
    needs: tuple = ()

    def _here(self, arch: Arch) -> bool:
        return arch.has(*self.needs)

    def offered_on(self, arch: Arch) -> bool:
        return self._here(arch) and len(self.values) > 1

    def values_on(self, arch: Arch) -> tuple:
        return self.values if self._here(arch) else (self.default,)

    def shapes(self, mode: Any) -> bool:
        """Whether this knob changes the kernels run under `mode` (the mode knob's value)."""
        return self.depths is None or mode in self.depths


class ConfigError(ValueError):
    pass


class KnobSpace:
    """An op's knobs, declared once. `mode_knob` names the knob whose value picks the kernels."""

    def __init__(self, op: str, knobs: tuple[Knob, ...], mode_knob: str) -> None:
        self.op = op
        names = [k.name for k in knobs]
        if len(set(names)) != len(names):
            raise ValueError(f"{op}: a knob is declared twice")
        if mode_knob not in names:
            raise ValueError(f"{op}: mode knob {mode_knob!r} is not declared")
        modes = next(k.values for k in knobs if k.name == mode_knob)
        # a knob that names no modes shapes every mode's kernels
        self.knobs = tuple(k if k.depths is not None else replace(k, depths=modes) for k in knobs)
        self.by_name: dict[str, Knob] = {k.name: k for k in self.knobs}
        self.mode_knob = mode_knob

    @property
    def modes(self) -> tuple:
        return self.by_name[self.mode_knob].values

    def __repr__(self) -> str:
        return f"KnobSpace({self.op!r}, {len(self.knobs)} knobs)"


class BaseConfig(Mapping):
    """An immutable, validated assignment of every knob of one op's space (the subclass's
    `space`). Unknown names and values outside a knob's declared set raise ConfigError, so a
    config is safe to render."""

    space: ClassVar[KnobSpace]
    __slots__ = ("_values", "_key")

    def __init__(self, values: Mapping[str, Any] | None = None, **kw: Any) -> None:
        space = type(self).__dict__.get("space") or getattr(type(self), "space", None)
        if space is None:
            raise TypeError("BaseConfig has no knob space: construct an op's config type "
                            "(autossd.ops.registry.get_op(name).config_type)")
        given = dict(values or {}, **kw)
        unknown = sorted(set(given) - set(space.by_name))
        if unknown:
            raise ConfigError(f"config: unknown knob(s) {unknown} for {space.op}; known: {sorted(space.by_name)}")
        out = {}
        for knob in space.knobs:
            v = given.get(knob.name, knob.default)
            # exact type match: True is not 1, "64" is not 64, 64.0 is not 64
            if type(v) is not type(knob.default) or v not in knob.values:
                raise ConfigError(f"config: {knob.name}={v!r} is not allowed; expected one of {list(knob.values)}")
            out[knob.name] = v
        mode = out[space.mode_knob]
        for knob in space.knobs:   # a knob the chosen mode does not use takes its default: one
            if not knob.shapes(mode):   # config per distinct set of kernels
                out[knob.name] = knob.default
        object.__setattr__(self, "_values", out)
        object.__setattr__(self, "_key", json.dumps(out, sort_keys=True))  # hashed on hot paths

    @property
    def op(self) -> str:
        return self.space.op

    def __getitem__(self, k: str) -> Any:
        return self._values[k]

    def __iter__(self) -> Iterator[str]:
        return iter(self._values)

    def __len__(self) -> int:
        return len(self._values)

    def __getattr__(self, k: str) -> Any:
        if k.startswith("_"):   # not a knob: e.g. copy asking for _values before __init__ ran
            raise AttributeError(k)
        try:
            return self._values[k]
        except KeyError:
            raise AttributeError(k) from None

    def __setattr__(self, k, v):  # pragma: no cover - immutability guard
        raise AttributeError("a config is immutable; use replace()")

    def __hash__(self) -> int:
        return hash((self.space.op, self._key))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, BaseConfig) and other.space is self.space and other._key == self._key

    def __repr__(self) -> str:
        diff = {k: v for k, v in self._values.items() if v != self.space.by_name[k].default}
        return f"{type(self).__name__}({diff})"

    def __reduce__(self):  # pickles through validation, like any other construction
        return (type(self), (self._values,))

    def replace(self, **kw: Any) -> "BaseConfig":
        return type(self)({**self._values, **kw})

    def as_dict(self) -> dict[str, Any]:
        return dict(self._values)

    def key(self) -> str:
        """Canonical JSON of the values (what a database stores)."""
        return self._key

    @classmethod
    def from_json(cls, text: str) -> "BaseConfig":
        try:
            data = json.loads(text)
        except (TypeError, json.JSONDecodeError) as e:
            raise ConfigError(f"config: not valid JSON ({e})") from None
        if not isinstance(data, dict):
            raise ConfigError("config: expected a JSON object")
        return cls(data)


class ProblemFields:
    """What every op's problem type (a frozen dataclass) offers the store and the tuner: its fields
    as the record's key, a copy with some changed (validated again by the constructor), and the
    field names."""

    def key(self) -> dict:
        return asdict(self)

    def replace(self, **kw):
        return type(self)(**{**asdict(self), **kw})

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in fields(cls)]


def pow2_at_least(n: int) -> int:
    """The smallest power of two >= n (1 for n <= 1): the padded size a tile covers."""
    return 1 << max(0, (int(n) - 1).bit_length())


# The chunk states' storage types (the forward's and the backward's `state_dtype`) a tune never
# offers for an input dtype. fp16's range (65504) is narrower than bf16's and fp32's, so its
# states could overflow to inf where the inputs' own type would not: the gate checks random
# inputs, which cannot show that. A caller may still ask for them (state_dtype=, --fix).
NARROWER_STATES = {"bf16": ("fp16",), "fp32": ("fp16",)}
# A static tune runs no gate, and its model sees bytes, not rounding: it offers no 16-bit type
# but the inputs' own (bf16 states keep less precision than fp16 inputs carry; static records
# for gfx942 had picked them, and fp16 states for bf16 training shapes in the backward, whose
# exclusions lacked the rule above).
UNGATED_STATES = {"fp16": ("bf16",), "bf16": ("fp16",), "fp32": ("fp16", "bf16")}


def state_dtype_excluded(problem, static: bool = False) -> dict[str, tuple]:
    """The `state_dtype` values a tune of `problem` never offers (static: run without a gate)."""
    return {"state_dtype": (UNGATED_STATES if static else NARROWER_STATES).get(problem.dtype, ())}


def shrink(config: BaseConfig, limits: Mapping[str, int]) -> BaseConfig:
    """`config` with each knob named in `limits` that exceeds its limit set to the largest
    declared value within it (the ops' `fit`: tiles past a problem's padded size or the chunk)."""
    by_name = config.space.by_name
    changes = {name: max(v for v in by_name[name].values if v <= cap)
               for name, cap in limits.items() if config[name] > cap}
    return config.replace(**changes) if changes else config
