"""Render a validated Config into Triton source, cache it on disk by content hash, import it.

Templates use StrictUndefined: a missing variable is an error, not an empty string. Only a
`Config` (every value from its knob's declared set) and a backend from a fixed set reach them.
"""
from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import os
import re
import sys
import threading
from functools import lru_cache
from pathlib import Path
from types import ModuleType

import jinja2

from .knobs import BaseConfig
from .ops.registry import get_op

BACKENDS = ("cuda", "hip")
_lock = threading.Lock()
_modules: dict[tuple[str, bool], ModuleType] = {}
_by_config: dict[tuple[BaseConfig, str, bool], ModuleType] = {}


def templates_dir() -> Path:
    """templates/ ships inside the package as autossd/templates (see pyproject); from a source
    checkout it is the top-level templates/ folder."""
    installed = Path(__file__).parent / "templates"
    return installed if installed.is_dir() else Path(__file__).parent.parent / "templates"


SHARED_DIR = "common"   # the templates every family's ops may include (the LAUNCH table)


def search_path(template_dir: str) -> list[Path]:
    """Where an op's templates are looked up, first match wins: the op's own folder, then its
    family's kernel library (templates/<family>/, the op folder's name up to its first
    underscore: ssd_fwd and ssd_varlen share templates/ssd/), then templates/common/. A file of
    the op's folder thus overrides a library file of the same name; folders that do not exist
    are left out."""
    root = templates_dir()
    names = [template_dir, template_dir.split("_", 1)[0], SHARED_DIR]
    out = []
    for name in dict.fromkeys(names):   # unique, in order
        if name == template_dir or (root / name).is_dir():
            out.append(root / name)
    return out


@lru_cache(maxsize=None)
def _env(template_dir: str = "ssd_fwd") -> jinja2.Environment:
    return jinja2.Environment(loader=jinja2.FileSystemLoader([str(p) for p in search_path(template_dir)]),
                              undefined=jinja2.StrictUndefined, autoescape=False,
                              keep_trailing_newline=True)


@lru_cache(maxsize=None)
def template_hash() -> str:
    """Hash of every template file. Names the tuner's studies (a study spans every depth), and
    is what records made before kernel_hash stored: such a record is fresh while it matches."""
    h = hashlib.sha256()
    for p in sorted(templates_dir().rglob("*.jinja")):
        h.update(p.name.encode())
        h.update(p.read_bytes())
    return h.hexdigest()[:16]


# A Python string literal (triple-quoted first; a prefix such as f or r sits before the quote
# and changes no boundary) or a comment: scanning for both in one pass finds each comment's start
# the way Python's tokenizer does, since a "#" inside a string is not one.
_STRING_OR_COMMENT = re.compile(
    r'("""(?:\\.|[^\\])*?"""|\'\'\'(?:\\.|[^\\])*?\'\'\'|"(?:\\.|[^"\\\n])*"|\'(?:\\.|[^\'\\\n])*\')'
    r"|(#[^\n]*)", re.S)


def _code_tokens(source: str) -> str:
    """The source without its comments, trailing blanks or blank lines (the header naming the
    config is a comment too): what the compiler sees, as text. A reworded comment, or a knob
    added later with the old behaviour as its default, leaves this (and so a record's freshness)
    as it was. Comments are found by one regular-expression pass over strings and comments, not
    by Python's tokenizer: the same positions (a test holds it to tokenize's COMMENT tokens) at
    a tenth of the time, which a cold process's first lookup pays once per candidate config."""
    cut: dict[int, int] = {}
    for m in _STRING_OR_COMMENT.finditer(source):
        if m.group(2) is not None:
            start = m.start(2)
            cut[source.count("\n", 0, start)] = start - (source.rfind("\n", 0, start) + 1)
    out = []
    for i, line in enumerate(source.splitlines()):
        line = line[:cut[i]] if i in cut else line
        line = line.rstrip()
        if line:
            out.append(line)
    return "\n".join(out)


@lru_cache(maxsize=4096)
def kernel_hash(config: BaseConfig, backend: str) -> str:
    """Hash of the code a config launches: its rendering, which holds only the kernels its
    mode (the forward's fusion depth) runs and the shared helpers they call, reduced to its
    tokens (`_code_tokens`). A tuned record stores it; an edit to a kernel a config does not
    launch, or to a comment, leaves the record fresh. Rendering costs a few ms, once per config
    and process."""
    return hashlib.sha256(_code_tokens(render(config, backend)).encode()).hexdigest()[:16]


@lru_cache(maxsize=4096)
def legacy_kernel_hash(config: BaseConfig, backend: str) -> str:
    """The hash records stored before `kernel_hash` ignored comments: the rendered text less its
    header line. Such a record is fresh while its rendering is unchanged to the letter."""
    text = "\n".join(ln for ln in render(config, backend).splitlines()
                     if not ln.startswith("# config: "))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def launch_options(config: BaseConfig, backend: str) -> dict[str, dict[str, int]]:
    """The launch options of each stage of the config's op (its module's LAUNCH table)."""
    return get_op(config.op).launch_options(config, backend)


def render(config: BaseConfig, backend: str = "cuda") -> str:
    """The Triton source of a config: its op's module.py.jinja with the templates the op
    says the config includes (the kernels of its mode and the helpers they call)."""
    if not isinstance(config, BaseConfig):
        raise TypeError(f"config: expected an autossd config, got {type(config).__name__}")
    if backend not in BACKENDS:
        raise ValueError(f"backend: expected one of {BACKENDS}, got {backend!r}")
    if config.get("pdl") and backend != "cuda":   # griddepcontrol is PTX (offered where Arch.pdl)
        raise ValueError(f"config: pdl={config.pdl} is programmatic dependent launch, a CUDA (sm90) feature; "
                         f"backend {backend!r} has none")
    op = get_op(config.op)
    return _env(op.template_dir).get_template("module.py.jinja").render(
        cfg=config, backend=backend, config_json=config.key(),
        includes=op.fn("includes")(config, backend), launch=op.launch_options(config, backend),
        warp_size=64 if backend == "hip" else 32, **op.fn("render_context")(config, backend))


def cache_dir() -> Path:
    env = os.environ.get("AUTOSSD_CACHE_DIR")
    if env:
        return Path(env) / "kernels"
    import platformdirs
    return Path(platformdirs.user_cache_dir("autossd")) / "kernels"


# Where this process writes rendered kernels once the cache directory refused a write (a
# read-only mount, a full disk): the kernels still run, from a temporary directory, with one
# warning. Triton's JIT needs each kernel's source in a file, so there is no file-less way.
_fallback_dir: Path | None = None


def source_path(source: str) -> Path:
    digest = hashlib.sha256(source.encode()).hexdigest()[:24]
    path = (_fallback_dir or cache_dir()) / f"ssd_{digest}.py"
    if not path.exists() or path.read_text() != source:
        try:
            _write(path, source)
        except OSError as e:
            if _fallback_dir is not None:
                raise
            path = _fall_back(path.parent, e) / path.name
            _write(path, source)
    return path


def _write(path: Path, source: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.{threading.get_ident()}.tmp")
    tmp.write_text(source)
    os.replace(tmp, path)  # atomic: concurrent writers leave one whole file


def _fall_back(wanted: Path, err: OSError) -> Path:
    global _fallback_dir
    import logging
    import tempfile
    env = os.environ.get("AUTOSSD_CACHE_DIR")
    origin = f"AUTOSSD_CACHE_DIR={env}" if env else "the user cache directory"
    _fallback_dir = Path(tempfile.mkdtemp(prefix="autossd-kernels-"))
    logging.getLogger("autossd").warning(
        "autossd: cannot write rendered kernels to %s (from %s): %s; this process renders them into "
        "%s instead. Set AUTOSSD_CACHE_DIR to a writable directory to keep them between runs",
        wanted, origin, err.strerror or err, _fallback_dir)
    return _fallback_dir


@contextlib.contextmanager
def _interpret(flag: bool):
    import triton
    rt = triton.knobs.runtime
    explicit = "interpret" in rt.__dict__  # set by code, not read from TRITON_INTERPRET
    old = rt.__dict__.get("interpret")
    env = os.environ.get("TRITON_INTERPRET")  # triton's setter writes the variable too
    rt.interpret = flag
    try:
        yield
    finally:
        if explicit:
            rt.interpret = old
        else:
            del rt.interpret  # back to following the environment variable
        if env is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = env


def interpreting() -> bool:
    import triton
    return bool(triton.knobs.runtime.interpret)


def _check_interpreter_from_import() -> None:
    """triton.language builds its own @jit helpers (tl.sigmoid, ...) when it is imported, as
    interpreted functions only if TRITON_INTERPRET was set then. Set later, the kernels run
    interpreted but those helpers do not, and the first call fails deep in Triton ("Cannot call
    @triton.jit'd outside of the scope of a kernel"): say what to do instead."""
    import triton.language as tl
    from triton.runtime.interpreter import InterpretedFunction
    if not isinstance(tl.sigmoid, InterpretedFunction):
        raise RuntimeError("autossd: TRITON_INTERPRET=1 was set after triton was imported, so "
                           "Triton's CPU interpreter cannot run these kernels; set it before "
                           "importing triton (or autossd, or anything that imports them)")


def load(config: BaseConfig, backend: str = "cuda", interpret: bool | None = None) -> ModuleType:
    """Import the rendered module for a config. `interpret` picks triton's interpreter
    (default: TRITON_INTERPRET); the two flavours are cached apart because @triton.jit decides
    at import time."""
    interpret = interpreting() if interpret is None else interpret
    hit = _by_config.get((config, backend, interpret))
    if hit is not None:  # the hot path: no rendering, no file access
        return hit
    if interpret and config.get("smem_pad"):
        # Triton 3.6's gluon.jit ignores TRITON_INTERPRET and compiles for the active GPU
        raise RuntimeError(f"autossd: smem_pad={config.smem_pad} selects the Gluon chunk-state "
                           "kernel, which Triton's CPU interpreter cannot run; it needs a GPU "
                           "(autossd.compile.compile_config cross-compiles it without one)")
    if interpret:
        _check_interpreter_from_import()
    source = render(config, backend)
    path = source_path(source)
    key = (str(path), interpret)
    with _lock:
        mod = _modules.get(key)
        if mod is None:
            name = f"autossd_gen_{path.stem}_{'i' if interpret else 'c'}"
            spec = importlib.util.spec_from_file_location(name, path)
            mod = importlib.util.module_from_spec(spec)
            sys.modules[name] = mod  # triton looks functions' globals up through the module
            if interpret:
                from . import interpret as _fix
                _fix.apply()
            with _interpret(interpret):
                spec.loader.exec_module(mod)
            mod.SOURCE_PATH = path
            _modules[key] = mod
        _by_config[(config, backend, interpret)] = mod
    return mod
