"""Problem shapes from the command line: "b=1,l=16384,h=80,p=64,n=128,g=1" or a model preset
(the benchmark's table of model shapes), optionally with overrides: "mamba2-2.7b:b=4,l=16384"."""
from __future__ import annotations

from ..problem import Problem, check_grid

# model -> (nheads, headdim, dstate, ngroups), and the (batch, seqlen) shapes measured for it
MODELS: dict[str, tuple[int, int, int, int]] = {
    "mamba2-130m": (24, 64, 128, 1),
    "mamba2-2.7b": (80, 64, 128, 1),
    "codestral-7b": (128, 64, 128, 8),
}
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


def parse_shape(text: str, dtype: str = "fp16") -> Problem:
    """One shape. Keys: b l h p n g (required unless a model prefix gives h p n g), q (pins the
    chunk size), flags d z bias softplus final (0/1; default d=1 bias=1 softplus=1)."""
    text = text.strip()
    model = None
    if ":" in text or text in MODELS:
        model, _, text = text.partition(":")
        if model not in MODELS:
            raise ShapeError(f"unknown model {model!r}; expected one of {sorted(MODELS)}")
    vals: dict = {}
    flags = dict(MODEL_FLAGS)
    if model:
        h, p, n, g = MODELS[model]
        vals.update(nheads=h, headdim=p, dstate=n, ngroups=g, batch=1, seqlen=2048)
    seen = set()
    for part in filter(None, (s.strip() for s in text.split(","))):
        key, eq, raw = part.partition("=")
        key = key.strip().lower()
        if not eq or not raw.strip():
            raise ShapeError(f"{part!r} is not key=value")
        if key in seen:
            raise ShapeError(f"{key!r} given twice in {text!r}")
        seen.add(key)
        if key not in KEYS and key not in FLAGS:
            raise ShapeError(f"unknown key {key!r} in {part!r}; expected {sorted(KEYS) + sorted(FLAGS)}")
        try:
            num = _int(raw)
        except ValueError:
            raise ShapeError(f"{part!r}: {raw.strip()!r} is not an integer") from None
        if key in FLAGS:
            if num not in (0, 1):
                raise ShapeError(f"{part!r}: flags take 0 or 1")
            flags[FLAGS[key]] = bool(num)
        else:
            vals[KEYS[key]] = num
    missing = [k for k, f in KEYS.items() if f not in vals and k != "q"]
    if missing:
        raise ShapeError(f"missing {', '.join(missing)} in {text!r} (e.g. b=1,l=16384,h=80,p=64,n=128,g=1)")
    try:
        prob = Problem(dtype=dtype, **vals, **flags)
        check_grid(prob.batch, prob.seqlen, prob.nheads)   # what the runtime could never run
    except ValueError as e:
        raise ShapeError(str(e)) from None
    return prob


def parse_shapes(texts: list[str] | tuple[str, ...], dtype: str = "fp16") -> list[Problem]:
    """Several shapes: repeated options and/or ';'-separated."""
    out = []
    for t in texts:
        for one in filter(None, (s.strip() for s in t.split(";"))):
            out.append(parse_shape(one, dtype))
    return out


def preset(name: str, dtype: str = "fp16") -> list[Problem]:
    if name not in MODELS:
        raise ShapeError(f"unknown preset {name!r}; expected one of {sorted(MODELS)}")
    return [parse_shape(f"{name}:b={b},l={l}", dtype) for b, l in PRESET_SHAPES[name]]
