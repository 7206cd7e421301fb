"""Problem shapes from the command line: "b=1,l=16384,h=80,p=64,n=128,g=1" or a model preset
(the benchmark's table of model shapes), optionally with overrides: "mamba2-2.7b:b=4,l=16k".

Each problem type brings its own form (`knobs.ShapeForm`, the type's `shape_form`): its keys and
flags, its presets and grid, its help. The forward's and the backward's batch x sequence shapes
(autossd/problem.py); the decode step's "b=64[,t=1]" (rows per call, tokens per row) and packed
prefill's "t=8192,s=16[,q=256]" (total tokens, sequences, chunk length), both with a model
prefix for h p n g or the keys themselves (beside their problem types in autossd/ops/ssd/). The
state dtype of a form whose problems name one comes from the caller (`state_dtype`), not a key:
the same letters mean other things in the forms. Nothing here names an op or its problem type.
"""
from __future__ import annotations

from ..knobs import ShapeForm
from ..ops.registry import get_op, op_names
# the forward's grammar and grid, offered here as they always were
from ..problem import (FLAGS, GRID_BATCHES, GRID_MAX_TOKENS, GRID_SEQLENS, KEYS, MODEL_FLAGS,  # noqa: F401
                       PRESET_SHAPES, grid_sizes)

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

# model -> (d_inner, d_state) of its Mamba-1 layers (d_inner = expand 2 x d_model): Mamba
# 130m-2.8b (d_model 768, 1024, 1536, 2048, 2560) and Falcon-Mamba 7B (d_model 4096), whose dims
# Jamba's Mamba layers share. Only a form that declares `mamba1_fields` takes them.
MAMBA1_MODELS: dict[str, tuple[int, int]] = {
    "mamba-130m": (1536, 16),
    "mamba-370m": (2048, 16),
    "mamba-790m": (3072, 16),
    "mamba-1.4b": (4096, 16),
    "mamba-2.8b": (5120, 16),
    "falcon-mamba-7b": (8192, 16),
}

GRID_DTYPES = ("fp16", "bf16")


class ShapeError(ValueError):
    pass


def _int(raw: str) -> int:
    """An integer; a k suffix means x1024 (16k = 16384)."""
    raw = raw.strip().lower()
    return int(raw[:-1]) * 1024 if raw.endswith("k") else int(raw)


def form_of(op: str) -> ShapeForm:
    """The shape form of `op`'s problems; ShapeError when --shapes cannot describe them."""
    form = get_op(op).problem_type.shape_form
    if form is None:
        raise ShapeError(f"op {op!r}: its problems have no --shapes form")
    return form


def shaped_ops() -> list[str]:
    """The ops whose problems --shapes describes."""
    return [n for n in op_names() if get_op(n).problem_type.shape_form is not None]


def stated_ops() -> list[str]:
    """The ops whose problems name the dtype their states are kept in (--state-dtype)."""
    return [n for n in shaped_ops() if form_of(n).states]


def describe(problem) -> str:
    """A problem as a summary line: its sizes in its form's keys, the dtype (and state dtype)."""
    form = type(problem).shape_form
    if form is None:
        return str(problem.key())
    keys = form.summary or tuple(form.keys)
    sizes = ",".join(f"{k}={getattr(problem, form.keys[k])}" for k in keys)
    state = f" state {problem.state_dtype}" if form.states else ""
    return f"{sizes} {problem.dtype}{state}"


def _forms() -> list[tuple[ShapeForm, list[str]]]:
    """Each form, with the ops whose problems it describes (in the registry's order)."""
    out: list[tuple[ShapeForm, list[str]]] = []
    for name in shaped_ops():
        form = form_of(name)
        for f, names in out:
            if f is form:
                names.append(name)
                break
        else:
            out.append((form, [name]))
    return out


def shapes_help(default_op: str) -> str:
    """The --shapes help: `default_op`'s grammar, then each other form's, named by its ops."""
    forms = sorted(_forms(), key=lambda fn: default_op not in fn[1])
    return ". ".join(f.help if default_op in names else f"--op {' / '.join(names)}: {f.help}" for f, names in forms)


def preset_help(default_op: str) -> str:
    """The --preset help: what a model's preset and the grid hold, per form."""
    forms = sorted(_forms(), key=lambda fn: default_op not in fn[1])
    each = "; ".join(f.preset_help + ("" if default_op in names else f" for {' / '.join(names)}") for f, names in forms)
    grids = "; ".join(f.grid_help + ("" if default_op in names else f" for {' / '.join(names)}") for f, names in forms)
    return (f"every shape benchmarked for a model ({each}). grid: the model grid the shipped databases "
            f"cover, every distinct SSD layer of the models in autossd/tuner/shapes.py x {grids}; fp16 and "
            "bf16 unless --dtype is given")


def parse_shape(text: str, dtype: str = "fp16", *, op: str, state_dtype: str | None = None):
    """One shape of `op`'s problem type. Forward keys: b l h p n g
    (required unless a model prefix gives h p n g), q (pins the chunk size), flags d z bias
    softplus final (0/1; default d=1 bias=1 softplus=1). Other forms: see the module docstring
    and `ShapeForm`. `state_dtype`: the state dtype of a form whose problems name one (default
    fp32)."""
    form = form_of(op)
    if state_dtype is not None and not form.states:
        raise ShapeError(f"op {op!r}: its problems name no state dtype")
    text = text.strip()
    model = None
    if ":" in text or text in MODELS or text in MAMBA1_MODELS:
        model, _, text = text.partition(":")
        known = model_names(form)
        if model in MAMBA1_MODELS and not form.mamba1_fields:
            raise ShapeError(f"{model!r} is a Mamba-1 model; op {op!r} takes Mamba-2 (SSD) layers: one of {known}")
        if model in MODELS and not form.mamba2_layers:
            raise ShapeError(f"{model!r} is a Mamba-2 model; op {op!r} takes Mamba-1 layers: one of {known}")
        if model not in known:
            raise ShapeError(f"unknown model {model!r}; expected one of {known}")
    vals: dict = dict(form.defaults)
    flags = dict(form.flag_defaults)
    if model in MAMBA1_MODELS:
        fields = form.mamba1_fields(*MAMBA1_MODELS[model])
        flag_fields = set(form.flags.values())
        vals.update({k: v for k, v in fields.items() if k not in flag_fields}, **form.model_sizes)
        flags.update({k: v for k, v in fields.items() if k in flag_fields})
    elif model:
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


def parse_shapes(texts: list[str] | tuple[str, ...], dtype: str = "fp16", *, op: str,
                 state_dtype: str | None = None) -> list:
    """Several shapes: repeated options and/or ';'-separated."""
    out = []
    for t in texts:
        for one in filter(None, (s.strip() for s in t.split(";"))):
            out.append(parse_shape(one, dtype, op=op, state_dtype=state_dtype))
    return out


def model_names(form: ShapeForm) -> list[str]:
    """The models whose layers `form` takes as a prefix or preset: the Mamba-2 ones, the Mamba-1
    ones, or both."""
    return (sorted(MODELS) if form.mamba2_layers else []) + (sorted(MAMBA1_MODELS) if form.mamba1_fields else [])


def grid_dims() -> list[tuple[int, int, int, int]]:
    """The distinct (nheads, headdim, dstate, ngroups) of MODELS (models sharing a layer's dims
    share its records), ordered by headdim and dstate, then groups and heads."""
    return sorted(set(MODELS.values()), key=lambda d: (d[1], d[2], d[3], d[0]))


def grid(dtypes: tuple[str, ...] | list[str] = GRID_DTYPES, *, op: str, state_dtype: str | None = None) -> list:
    """Every grid shape as a problem of `op`, with the flags Mamba-2's layer passes: the layers
    of MODELS x the form's grid points, at each dtype and each state dtype the form gives it
    (the forward and the backward: (batch, seqlen) up to a token cap; the decode step: batches x
    a cache in fp32 and in the inputs' type, or `state_dtype`; packed prefill: packed batches,
    states in fp32, or `state_dtype`). Ordered for a tune: by dtype (and state dtype), then
    headdim and dstate (the kernels' tile sizes), then groups and heads, then size, so that
    shapes whose candidates compile to the same kernels come one after another and the later
    ones find them in Triton's cache."""
    form = form_of(op)
    keys = {f: k for k, f in form.keys.items()}
    layers = [f"h={h},p={p},n={n},g={g}" for h, p, n, g in grid_dims()] if form.mamba2_layers else []
    if form.mamba1_fields:   # one model per distinct Mamba-1 layer, as a prefix (it sets the flags too)
        firsts = {dims: m for m, dims in reversed(MAMBA1_MODELS.items())}
        layers += [f"{firsts[dims]}:" for dims in sorted(firsts)]
    return [parse_shape(layer + ",".join(f"{keys[f]}={v}" for f, v in point.items())
                        if layer.endswith(":") else
                        ",".join([*(f"{keys[f]}={v}" for f, v in point.items()), layer]),
                        dtype, op=op, state_dtype=sd)
            for dtype in dtypes for sd in form.grid_states(dtype, state_dtype)
            for layer in layers for point in form.grid]


def preset(name: str, dtype: str = "fp16", *, op: str, state_dtype: str | None = None) -> list:
    """Every shape of a model's preset for `op`'s problem type; "grid": the grid at `dtype`."""
    if name == "grid":
        return grid((dtype,), op=op, state_dtype=state_dtype)
    form = form_of(op)
    known = model_names(form)
    if name not in known:
        raise ShapeError(f"unknown preset {name!r}; expected one of {known + ['grid']}")
    keys = {f: k for k, f in form.keys.items()}
    return [parse_shape(f"{name}:" + ",".join(f"{keys[f]}={v}" for f, v in sizes.items()), dtype, op=op,
                        state_dtype=state_dtype)
            for sizes in form.model_presets.get(name, form.presets)]
