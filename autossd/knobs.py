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
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields, replace
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
    # (old name, name now) of values renamed: a stored record or a caller naming a value by its
    # old name reads as the new one (a config is stored by its values' names)
    aliases: tuple[tuple[Any, Any], ...] = ()

    def _here(self, arch: Arch) -> bool:
        return arch.has(*self.needs)

    def offered_on(self, arch: Arch) -> bool:
        return self._here(arch) and len(self.values) > 1

    def values_on(self, arch: Arch) -> tuple:
        return self.values if self._here(arch) else (self.default,)

    def shapes(self, mode: Any) -> bool:
        """Whether this knob changes the kernels run under `mode` (the mode knob's value)."""
        return self.depths is None or mode in self.depths


def take(group: tuple[Knob, ...], only: tuple[str, ...] | None = None, *, defaults: Mapping[str, Any] | None = None,
         depths: tuple | Mapping[str, tuple] | None = None, values: Mapping[str, tuple] | None = None,
         docs: Mapping[str, str] | None = None) -> tuple[Knob, ...]:
    """An op's knobs of a group declared once for a kernel stage (the stage's tiles, warps,
    pipeline depth...): those named in `only` (in that order; default every one, in the group's),
    with what an op may set for itself: a knob's default, the modes it shapes (`depths`: one
    tuple for all, or per knob), a subset of its values (a range the op's kernel cannot take
    whole) and its description. Nothing else differs between ops."""
    by_name = {k.name: k for k in group}
    names = only if only is not None else tuple(by_name)
    unknown = sorted((set(names) | set(defaults or ()) | set(values or ()) | set(docs or ())) - set(by_name))
    if isinstance(depths, Mapping):
        unknown += sorted(set(depths) - set(by_name))
    if unknown:
        raise ValueError(f"take: {unknown} are no knobs of the group {sorted(by_name)}")
    out = []
    for name in names:
        k = by_name[name]
        kw: dict[str, Any] = {}
        if values and name in values:
            if not set(values[name]) <= set(k.values):
                raise ValueError(f"take: {name}'s values {values[name]} are not a subset of {k.values}")
            kw["values"] = tuple(values[name])
        if defaults and name in defaults:
            kw["default"] = defaults[name]
        if isinstance(depths, Mapping):
            if name in depths:
                kw["depths"] = depths[name]
        elif depths is not None:
            kw["depths"] = depths
        if docs and name in docs:
            kw["doc"] = docs[name]
        out.append(replace(k, **kw))
    return tuple(out)


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

    def arch_violations(self, config: "BaseConfig", arch: Arch) -> list[str]:
        """The one arch-capability check of every op: each knob whose value is not offered on
        `arch` (a value its capabilities lack, `Knob.needs`)."""
        return [f"{k.name}={config[k.name]} is not offered on {arch.name}"
                for k in self.knobs if config[k.name] not in k.values_on(arch)]

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
            if knob.aliases:
                v = next((new for old, new in knob.aliases if type(old) is type(v) and old == v), v)
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
    field names; `default_op`, the op whose records a problem of this type keys where a caller
    names none (a type several ops share names the one its drop-in runs)."""
    default_op: ClassVar[str | None] = None
    # how its problems are written on the command line (`ShapeForm`; None: --shapes cannot)
    shape_form: ClassVar["ShapeForm | None"] = None

    @classmethod
    def example(cls):
        """A small problem of this type, with the flags its model's call passes, that every op of
        the type runs in Triton's interpreter in seconds (the op-conformance tests); None where
        the type offers none."""
        return None

    def key(self) -> dict:
        return asdict(self)

    def replace(self, **kw):
        return type(self)(**{**asdict(self), **kw})

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in fields(cls)]


@dataclass(frozen=True)
class ShapeForm:
    """How one problem type is written on the command line (autossd.tuner.shapes parses and
    prints it): "key=value" sizes and 0/1 flags, or a model's prefix setting nheads, headdim,
    dstate and ngroups (the keys h p n g). A problem type names its form (`shape_form`), so
    adding an op adds its grammar, grid and help where its problem is declared."""
    keys: dict[str, str]              # key -> problem field (sizes)
    flags: dict[str, str]             # key -> problem field (0/1)
    flag_defaults: dict[str, bool]    # what the model's call passes
    model_sizes: dict[str, int]       # sizes a model prefix sets besides h p n g
    optional: tuple[str, ...]         # keys that may be left out: the field's `defaults`, else the type's
    example: str
    build: Callable[[dict, dict, str, str | None], Any]   # (sizes, flags, dtype, state dtype)
    states: bool = False              # its problems name the dtype their states are kept in
    defaults: dict[str, int] = field(default_factory=dict)   # field -> value when its key is left out
    presets: list[dict[str, int]] = field(default_factory=list)   # sizes of each preset shape
    model_presets: dict[str, list[dict[str, int]]] = field(default_factory=dict)   # a model's own presets
    # the grid the shipped databases cover, per model layer: the sizes of each point, and the
    # state dtypes of each input dtype (dtype, the caller's state dtype or None) -> state dtypes
    grid: list[dict[str, int]] = field(default_factory=list)
    grid_states: Callable[[str, str | None], tuple] = lambda dtype, state_dtype: (state_dtype,)
    summary: tuple[str, ...] = ()     # the size keys a summary line shows (default: every one)
    # a form that also takes Mamba-1 layers (tuner.shapes.MAMBA1_MODELS, named as a prefix, and
    # in its grid): (d_inner, d_state) -> the problem fields such a layer's call sets, sizes and flags
    mamba1_fields: Callable[[int, int], dict[str, Any]] | None = None
    # whether it takes the Mamba-2 (SSD) layers of tuner.shapes.MODELS (keys h p n g, model prefixes)
    mamba2_layers: bool = True
    help: str = ""                    # the grammar in a sentence (the CLI's --shapes help)
    preset_help: str = ""             # what a model's preset holds (the CLI's --preset help)
    grid_help: str = ""               # what its grid covers, per model layer (the CLI's --preset help)


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
