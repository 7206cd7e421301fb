"""Problem shapes from the command line: "b=1,l=16384,h=80,p=64,n=128,g=1" or a model preset
(the benchmark's table of model shapes), optionally with overrides: "mamba2-2.7b:b=4,l=16384".

Each problem type has its own form (`ShapeForm`, looked up by the op's problem type): the
forward's and the backward's batch x sequence shapes above; the decode step's "b=64[,t=1]" (rows
per call, tokens per row) and packed prefill's "t=8192,s=16[,q=256]" (total tokens, sequences,
chunk length), both with a model prefix for h p n g or the keys themselves. The state dtype of
the decode step's and packed prefill's problems comes from the caller (`state_dtype`), not a key:
the same letters mean other things in the forms.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ..ops.ssd.decode_knobs import DecodeProblem
from ..ops.ssd.varlen_knobs import VarlenProblem
from ..problem import Problem, check_grid

# model -> (nheads, headdim, dstate, ngroups) of its SSD layers, the dims a --shapes prefix sets.
# Mamba-2: d_model 768 / 1024 / 1536 / 2048 / 2560, expand 2, headdim 64, d_state 128, one group,
# so nheads = 2 * d_model / 64. Codestral Mamba 7B: 128 heads of 64, d_state 128, 8 groups. The
# hybrids' values are their published configs' fields: Granite 4.0-H and Bamba mamba_n_heads,
# mamba_d_head, mamba_d_state, mamba_n_groups; Nemotron-H mamba_num_heads, mamba_head_dim,
# ssm_state_size, n_groups; Zamba2 hidden_size * 2 / mamba_headdim heads, state_size and
# mamba_ngroups (1 where the config names none: its default); Falcon-H1 mamba_n_heads,
# mamba_d_head, mamba_d_state, mamba_n_groups. Not read from a config: Nemotron-H 47B/56B's 8
# groups (the family's default), Falcon-H1 3B's one group, and Bamba's 128 heads and one group
# (the config class's defaults; its hidden_size 4096 and d_state 128 are the checkpoint's).
MODELS: dict[str, tuple[int, int, int, int]] = {
    "mamba2-130m": (24, 64, 128, 1),
    "mamba2-2.7b": (80, 64, 128, 1),
    "codestral-7b": (128, 64, 128, 8),
    "mamba2-370m": (32, 64, 128, 1),
    "mamba2-780m": (48, 64, 128, 1),
    "mamba2-1.3b": (64, 64, 128, 1),
    "granite-4.0-h-tiny": (48, 64, 128, 1),
    "granite-4.0-h-small": (128, 64, 128, 1),
    "nemotron-h-8b": (128, 64, 128, 8),
    "nemotron-h-47b": (256, 64, 256, 8),
    "nemotron-h-56b": (256, 64, 256, 8),
    "zamba2-1.2b": (64, 64, 128, 1),
    "zamba2-2.7b": (80, 64, 64, 1),
    "zamba2-7b": (112, 64, 64, 2),
    "falcon-h1-0.5b": (24, 64, 128, 1),
    "falcon-h1-1.5b": (48, 64, 256, 1),
    "falcon-h1-3b": (32, 128, 256, 1),
    "falcon-h1-7b": (24, 128, 256, 1),
    "falcon-h1-34b": (32, 128, 256, 2),
    "bamba-9b": (128, 64, 128, 1),
}

# The grid the shipped databases cover: every distinct SSD layer above x (batch, seqlen) across
# prefill and training x fp16 and bf16. Batch and length step by 4x, so a shape between grid
# points is within 2x of one in each: the lookup's nearest tier (same dims and dtype, at most
# 2 in summed |log2| ratios) reaches it. The token cap keeps the largest calls to what one GPU
# holds in a training step (64 x 8k, 16 x 32k, 4 x 128k).
GRID_BATCHES = (1, 4, 16, 64)
GRID_SEQLENS = (512, 2048, 8192, 32768, 131072)
GRID_MAX_TOKENS = 2 ** 19
GRID_DTYPES = ("fp16", "bf16")
# The decode step's grid: rows per step from one sequence to a served batch, each with its cache
# in fp32 or in the inputs' 16-bit type. The lookup's nearest tier reaches other batches.
GRID_DECODE_BATCHES = (1, 16, 64)
# Packed prefill's grid: (tokens, sequences) of an engine's prefill step, many short sequences
# and few long ones; states in fp32 (the engines' default cache).
GRID_VARLEN = ((8192, 16), (65536, 64))

# (batch, seqlen) shapes per model: the benchmark's for the first three; the grid's for the rest
PRESET_SHAPES: dict[str, list[tuple[int, int]]] = {
    "mamba2-130m": [(1, 2048), (1, 131072)],
    "mamba2-2.7b": [(1, 2048), (8, 2048), (4, 16384), (1, 131072)],
    "codestral-7b": [(1, 131072)],
}
KEYS = {"b": "batch", "l": "seqlen", "h": "nheads", "p": "headdim", "n": "dstate", "g": "ngroups",
        "q": "chunk_size"}
FLAGS = {"d": "has_D", "z": "has_z", "bias": "has_dt_bias", "softplus": "dt_softplus",
         "final": "return_final_states"}
# What Mamba-2's layer passes: D (h,), dt_bias, softplus; z is applied by the gated norm.
MODEL_FLAGS = {"has_D": True, "has_dt_bias": True, "dt_softplus": True}


class ShapeError(ValueError):
    pass


def _int(raw: str) -> int:
    """An integer; a k suffix means x1024 (16k = 16384)."""
    raw = raw.strip().lower()
    return int(raw[:-1]) * 1024 if raw.endswith("k") else int(raw)


def _forward(vals: dict, flags: dict, dtype: str, state_dtype: str | None) -> Problem:
    prob = Problem(dtype=dtype, **vals, **flags)
    check_grid(prob.batch, prob.seqlen, prob.nheads)   # what the runtime could never run
    return prob


def _decode(vals: dict, flags: dict, dtype: str, state_dtype: str | None) -> DecodeProblem:
    return DecodeProblem(dtype=dtype, state_dtype=state_dtype or "fp32", **vals, **flags)


def _varlen(vals: dict, flags: dict, dtype: str, state_dtype: str | None) -> VarlenProblem:
    if vals["tokens"] < vals["seqs"]:
        raise ValueError(f"t={vals['tokens']} tokens cannot hold s={vals['seqs']} sequences "
                         "(each sequence has at least one token)")
    from ..ops.ssd.varlen import problem_for   # imports torch: only when a packed shape is asked for
    # the chunk count follows from the sequence lengths the tuner draws (tune_inputs)
    return problem_for(dtype=dtype, state_dtype=state_dtype or "fp32", **vals, **flags)


@dataclass(frozen=True)
class ShapeForm:
    """How one problem type is written on the command line."""
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


_MODEL_KEYS = {"h": "nheads", "p": "headdim", "n": "dstate", "g": "ngroups"}
FORWARD = ShapeForm(KEYS, FLAGS, MODEL_FLAGS, {"batch": 1, "seqlen": 2048}, ("q",),
                    "b=1,l=16384,h=80,p=64,n=128,g=1", _forward)
# Mamba-2's decode step passes D, dt_bias and softplus; z only when the layer has no gated norm
# (the default layer has one, as the forward's presets assume). b: rows per call; t: tokens per
# row of a multi-token step. Presets: the batches scripts/bench_decode.py measures.
DECODE = ShapeForm({"b": "batch", "t": "tokens", **_MODEL_KEYS},
                   {"d": "has_D", "z": "has_z", "bias": "has_dt_bias", "softplus": "dt_softplus"},
                   MODEL_FLAGS, {"batch": 1}, ("t",), "b=64,h=80,p=64,n=128,g=1", _decode,
                   states=True, defaults={"tokens": 1}, presets=[{"batch": b} for b in (1, 16, 64)])
# An engine's packed prefill passes D, dt_bias, softplus and each sequence's initial state (zeros
# for a fresh one). t: tokens of every sequence together; s: sequences; q: the model's chunk
# length (256 for Mamba-2). Presets: packed batches scripts/bench_varlen.py times.
VARLEN = ShapeForm({"t": "tokens", "s": "seqs", "q": "chunk_size", **_MODEL_KEYS},
                   {"d": "has_D", "z": "has_z", "bias": "has_dt_bias", "softplus": "dt_softplus",
                    "init": "has_init"},
                   {**MODEL_FLAGS, "has_init": True}, {"tokens": 2048, "seqs": 1}, ("q",),
                   "t=8192,s=16,h=80,p=64,n=128,g=1", _varlen, states=True, defaults={"chunk_size": 256},
                   presets=[{"tokens": t, "seqs": n} for t, n in ((8192, 1), (8192, 16), (8192, 64), (65536, 64))])
FORMS: dict[type, ShapeForm] = {Problem: FORWARD, DecodeProblem: DECODE, VarlenProblem: VARLEN}


def form_of(op: str = "ssd_fwd") -> ShapeForm:
    """The shape form of `op`'s problems; ShapeError when --shapes cannot describe them."""
    from ..ops.registry import get_op
    form = FORMS.get(get_op(op).problem_type)
    if form is None:
        raise ShapeError(f"op {op!r}: its problems have no --shapes form")
    return form


def shaped_ops() -> list[str]:
    """The ops whose problems --shapes describes."""
    from ..ops.registry import get_op, op_names
    return [n for n in op_names() if get_op(n).problem_type in FORMS]


def describe(problem) -> str:
    """A problem as a summary line: its sizes in its form's keys, the dtype (and state dtype)."""
    if isinstance(problem, Problem):
        p = problem
        return f"b={p.batch},l={p.seqlen},h={p.nheads},p={p.headdim},n={p.dstate},g={p.ngroups} {p.dtype}"
    form = FORMS.get(type(problem))
    if form is None:
        return str(problem.key())
    sizes = ",".join(f"{k}={getattr(problem, f)}" for k, f in form.keys.items())
    state = f" state {problem.state_dtype}" if form.states else ""
    return f"{sizes} {problem.dtype}{state}"


def parse_shape(text: str, dtype: str = "fp16", op: str = "ssd_fwd", state_dtype: str | None = None):
    """One shape of `op`'s problem type (the forward's by default). Forward keys: b l h p n g
    (required unless a model prefix gives h p n g), q (pins the chunk size), flags d z bias
    softplus final (0/1; default d=1 bias=1 softplus=1). Other forms: see the module docstring
    and `ShapeForm`. `state_dtype`: the state dtype of a form whose problems name one (default
    fp32)."""
    form = form_of(op)
    if state_dtype is not None and not form.states:
        raise ShapeError(f"op {op!r}: its problems name no state dtype")
    text = text.strip()
    model = None
    if ":" in text or text in MODELS:
        model, _, text = text.partition(":")
        if model not in MODELS:
            raise ShapeError(f"unknown model {model!r}; expected one of {sorted(MODELS)}")
    vals: dict = dict(form.defaults)
    flags = dict(form.flag_defaults)
    if model:
        h, p, n, g = MODELS[model]
        vals.update(nheads=h, headdim=p, dstate=n, ngroups=g, **form.model_sizes)
    keys, flag_keys = form.keys, form.flags
    seen = set()
    for part in filter(None, (s.strip() for s in text.split(","))):
        key, eq, raw = part.partition("=")
        key = key.strip().lower()
        if not eq or not raw.strip():
            raise ShapeError(f"{part!r} is not key=value")
        if key in seen:
            raise ShapeError(f"{key!r} given twice in {text!r}")
        seen.add(key)
        if key not in keys and key not in flag_keys:
            raise ShapeError(f"unknown key {key!r} in {part!r}; expected {sorted(keys) + sorted(flag_keys)}")
        try:
            num = _int(raw)
        except ValueError:
            raise ShapeError(f"{part!r}: {raw.strip()!r} is not an integer") from None
        if key in flag_keys:
            if num not in (0, 1):
                raise ShapeError(f"{part!r}: flags take 0 or 1")
            flags[flag_keys[key]] = bool(num)
        else:
            vals[keys[key]] = num
    missing = [k for k, f in keys.items() if f not in vals and k not in form.optional]
    if missing:
        raise ShapeError(f"missing {', '.join(missing)} in {text!r} (e.g. {form.example})")
    try:
        return form.build(vals, flags, dtype, state_dtype)
    except (ValueError, TypeError) as e:
        raise ShapeError(str(e)) from None


def parse_shapes(texts: list[str] | tuple[str, ...], dtype: str = "fp16", op: str = "ssd_fwd",
                 state_dtype: str | None = None) -> list:
    """Several shapes: repeated options and/or ';'-separated."""
    out = []
    for t in texts:
        for one in filter(None, (s.strip() for s in t.split(";"))):
            out.append(parse_shape(one, dtype, op, state_dtype))
    return out


def grid_dims() -> list[tuple[int, int, int, int]]:
    """The distinct (nheads, headdim, dstate, ngroups) of MODELS (models sharing a layer's dims
    share its records), ordered by headdim and dstate, then groups and heads."""
    return sorted(set(MODELS.values()), key=lambda d: (d[1], d[2], d[3], d[0]))


def grid_sizes() -> list[tuple[int, int]]:
    """The grid's (batch, seqlen) pairs: GRID_BATCHES x GRID_SEQLENS up to GRID_MAX_TOKENS."""
    return [(b, l) for l in GRID_SEQLENS for b in GRID_BATCHES if b * l <= GRID_MAX_TOKENS]


def grid(dtypes: tuple[str, ...] | list[str] = GRID_DTYPES, op: str = "ssd_fwd",
         state_dtype: str | None = None) -> list:
    """Every grid shape as a problem of `op`, with the flags Mamba-2's layer passes: for the
    forward and the backward the layers x `grid_sizes()`; for the decode step the layers x
    GRID_DECODE_BATCHES x a cache in fp32 and in the inputs' type (or `state_dtype`); for packed
    prefill the layers x GRID_VARLEN, states in fp32 (or `state_dtype`). Ordered for a tune: by
    dtype, then headdim and dstate (the kernels' tile sizes), then groups and heads, then size,
    so that shapes whose candidates compile to the same kernels come one after another and the
    later ones find them in Triton's cache."""
    form = form_of(op)
    dims = grid_dims()
    if form is DECODE:
        return [parse_shape(f"b={b},h={h},p={p},n={n},g={g}", dtype, op, sd)
                for dtype in dtypes for sd in ((state_dtype,) if state_dtype else ("fp32", dtype))
                for h, p, n, g in dims for b in GRID_DECODE_BATCHES]
    if form is VARLEN:
        return [parse_shape(f"t={t},s={n_seq},h={h},p={p},n={n},g={g}", dtype, op, state_dtype or "fp32")
                for dtype in dtypes for h, p, n, g in dims for t, n_seq in GRID_VARLEN]
    return [parse_shape(f"b={b},l={l},h={h},p={p},n={n},g={g}", dtype, op)
            for dtype in dtypes for h, p, n, g in dims for b, l in grid_sizes()]


def preset(name: str, dtype: str = "fp16", op: str = "ssd_fwd", state_dtype: str | None = None) -> list:
    """Every shape of a model's preset for `op`'s problem type; "grid": the grid at `dtype`."""
    if name == "grid":
        return grid((dtype,), op, state_dtype)
    if name not in MODELS:
        raise ShapeError(f"unknown preset {name!r}; expected one of {sorted(MODELS) + ['grid']}")
    form = form_of(op)
    if form is FORWARD:
        sizes = PRESET_SHAPES.get(name, grid_sizes())
        return [parse_shape(f"{name}:b={b},l={l}", dtype, op) for b, l in sizes]
    keys = {f: k for k, f in form.keys.items()}
    return [parse_shape(f"{name}:" + ",".join(f"{keys[f]}={v}" for f, v in sizes.items()), dtype, op, state_dtype)
            for sizes in form.presets]
