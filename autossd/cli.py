"""The `autossd` command: tune, show, bench, export, merge, plot, doctor."""
from __future__ import annotations

import json
import math
import os
import platform
import sys
import tempfile
import time

import click

from . import __version__
from .arch import ARCHS, local_arch
from .tuner.shapes import preset_help, shapes_help, stated_ops

# the op a command acts on where --op is not given: the SSD forward (bench and compile run only it)
DEFAULT_OP = "ssd_fwd"


# --- option parsing ---------------------------------------------------------------------------

def _arch(ctx, param, value):
    if value is None:
        return None
    if value not in ARCHS:
        raise click.BadParameter(f"unknown architecture {value!r}; expected one of {sorted(ARCHS)}",
                                 ctx=ctx, param=param)
    return value


def _knob_value(kind: type, raw: str):
    # bool("False") is True: a bool knob takes click's words (true/false, 1/0, yes/no, on/off)
    if kind is bool:
        try:
            return click.BOOL.convert(raw, None, None)
        except click.BadParameter:
            raise ValueError(raw) from None
    return kind(raw)


def _knob_settings(ctx, param, values) -> dict:
    """KNOB=VALUE items (each may hold several, comma-separated) as one checked dict of the op's
    knobs."""
    from .knobs import ConfigError
    from .ops.registry import get_op
    op = get_op((ctx.params.get("op") if ctx is not None else None) or DEFAULT_OP)   # --op is eager: parsed first
    KNOB_BY_NAME, Config = op.space.by_name, op.config_type
    out = {}
    for item in values:
        for part in filter(None, (s.strip() for s in item.split(","))):
            name, eq, raw = part.partition("=")
            name = name.strip()
            if not eq or name not in KNOB_BY_NAME:
                raise click.BadParameter(f"{part!r}: expected knob=value with a knob of "
                                         f"{sorted(KNOB_BY_NAME)}", ctx=ctx, param=param)
            default = KNOB_BY_NAME[name].default
            try:
                out[name] = _knob_value(type(default), raw.strip())
            except ValueError:
                raise click.BadParameter(f"{part!r}: {raw!r} is not a {type(default).__name__}",
                                         ctx=ctx, param=param) from None
    try:
        Config(out)
    except ConfigError as e:
        raise click.BadParameter(str(e), ctx=ctx, param=param) from None
    return out


def _starts(ctx, param, values) -> list[dict]:
    """One start config per --start: the knobs it names, the rest from the op's default."""
    return [_knob_settings(ctx, param, (v,)) for v in values]


def _op(ctx, param, value) -> str:
    """An op whose problems --shapes describes (autossd/tuner/shapes.py: the forward's and the
    backward's batch x sequence shapes, the decode step's batches, packed prefill's batches)."""
    from .tuner.shapes import shaped_ops
    shaped = shaped_ops()
    if value not in shaped:
        raise click.BadParameter(f"{value!r}: expected one of {shaped} (ops whose problems --shapes "
                                 "describes)", ctx=ctx, param=param)
    return value


def _known_op(ctx, param, values) -> tuple[str, ...]:
    from .ops.registry import op_names
    for v in values:
        if v not in op_names():
            raise click.BadParameter(f"{v!r}: expected one of {list(op_names())}", ctx=ctx, param=param)
    return values


def _problems(ctx, shapes: tuple[str, ...], presets: tuple[str, ...], dtype: str, op: str = DEFAULT_OP,
              state_dtype: str | None = None):
    from .tuner.shapes import ShapeError, form_of, parse_shapes, preset
    if state_dtype is not None and not form_of(op).states:
        raise click.BadParameter(f"the problems of {op} name no state dtype (a config knob, where the "
                                 "op has one: --fix state_dtype=...)", ctx=ctx, param_hint="'--state-dtype'")
    probs = []
    try:
        probs += parse_shapes(shapes, dtype, op=op, state_dtype=state_dtype)
    except ShapeError as e:
        raise click.BadParameter(str(e), ctx=ctx, param_hint="'--shapes'") from None
    for p in presets:
        try:
            if p == "grid" and ctx.get_parameter_source("dtype") is click.core.ParameterSource.DEFAULT:
                from .tuner.shapes import grid
                probs += grid(op=op, state_dtype=state_dtype)   # both half dtypes; --dtype narrows it to one
            else:
                probs += preset(p, dtype, op=op, state_dtype=state_dtype)
        except ShapeError as e:
            raise click.BadParameter(str(e), ctx=ctx, param_hint="'--preset'") from None
    if not probs:
        raise click.UsageError("give at least one --shapes or --preset")
    return probs


def _shape_str(p) -> str:
    from .tuner.shapes import describe
    return describe(p)


def _table(rows: list[list[str]], header: list[str]) -> str:
    cols = [max(len(str(x)) for x in col) for col in zip(header, *rows)]
    fmt = lambda r: "  ".join(str(x).ljust(w) for x, w in zip(r, cols))  # noqa: E731
    return "\n".join([fmt(header), fmt(["-" * w for w in cols])] + [fmt(r) for r in rows])


def _ms(v) -> str:
    return "-" if v is None else f"{v:.4f}"


class _sigterm_unwinds:
    """`kill -TERM` unwinds the tune as Ctrl-C does (exit status 143), so the runners' `finally`
    blocks shut their worker pools down; SIGTERM's default action would end this process on the
    spot and leave the workers to notice it by themselves (autossd/lifeline.py)."""

    def __enter__(self):
        import signal
        import threading
        self.prev = None
        if threading.current_thread() is threading.main_thread():   # signals go to the main thread

            def unwind(signum, frame):
                raise SystemExit(128 + signum)
            self.prev = signal.signal(signal.SIGTERM, unwind)
        return self

    def __exit__(self, *exc) -> None:
        if self.prev is not None:
            import signal
            signal.signal(signal.SIGTERM, self.prev)


DB_EXTENSIONS = (".sqlite", ".sqlite3", ".db")   # what export writes as an SQLite database


class _Interrupted(click.ClickException):
    """Ctrl-C: exit status 130 (128 + SIGINT, what a shell reports for a command it stopped)
    with one line, instead of click's bare "Aborted!" and status 1."""
    exit_code = 130

    def __init__(self) -> None:
        super().__init__("interrupted (Ctrl-C)")

    def show(self, file=None) -> None:
        click.echo("autossd: interrupted (Ctrl-C)", err=True)


def _interrupted(e: BaseException) -> bool:
    """Whether `e` is a Ctrl-C, or an error raised while clean-up ran after one (e.g. Optuna's
    journal lock, interrupted half-way through taking it, fails to release a lock file it never
    renamed): either way the user stopped the command."""
    seen = set()
    while e is not None and id(e) not in seen:
        if isinstance(e, KeyboardInterrupt):
            return True
        seen.add(id(e))
        e = e.__context__
    return False


class _Group(click.Group):
    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except KeyboardInterrupt:   # the command's own clean-up (finally blocks) has run
            raise _Interrupted() from None
        except Exception as e:
            if _interrupted(e):
                raise _Interrupted() from None
            raise


class _OpOption(click.Option):
    """--op whose help lists the ops --shapes describes, asked of the op registry when the help
    is shown (not at import: the registry imports every op)."""

    def get_help_record(self, ctx):
        from .tuner.shapes import shaped_ops
        self.help = f"the op to tune: {', '.join(shaped_ops())}"
        return super().get_help_record(ctx)


# the optional packages the samplers need, and the extra that installs them (pyproject.toml)
SAMPLER_NEEDS = {"gp": ("scipy",), "cmaes": ("cmaes",)}


def _sampler(ctx, param, value):
    import importlib.util
    missing = [m for m in SAMPLER_NEEDS.get(value, ()) if importlib.util.find_spec(m) is None]
    if missing:
        raise click.BadParameter(f"{value} needs {', '.join(missing)}, which the 'tune' extra installs: "
                                 "pip install \"autossd[tune]\" (from a checkout: pip install \".[tune]\")",
                                 ctx=ctx, param=param)
    return value


# --- commands ---------------------------------------------------------------------------------

@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="autossd")
def main() -> None:
    """autossd: generated, tuned Triton kernels for the Mamba-2 SSD layer (forward, backward, decode step, packed prefill)."""


@main.command()
@click.option("--arch", callback=_arch, help="target arch (default: the local GPU's)")
@click.option("--shapes", multiple=True, metavar="SHAPE",
              help=shapes_help(DEFAULT_OP))
@click.option("--preset", multiple=True,
              type=click.Choice(["mamba2-130m", "mamba2-2.7b", "codestral-7b", "mamba-130m", "mamba-2.8b",
                                 "falcon-mamba-7b", "grid"]),
              help=preset_help(DEFAULT_OP))
@click.option("--dtype", type=click.Choice(["fp16", "bf16", "fp32"]), default="fp16", show_default=True)
@click.option("--state-dtype", type=click.Choice(["fp32", "bf16", "fp16"]), default=None,
              help=f"--op {' / '.join(stated_ops())}: the dtype the caller keeps its states in (a decode "
                   "cache, packed prefill's chunk states), part of each problem [default: fp32]")
@click.option("--trials", type=click.IntRange(1), default=20, show_default=True,
              help="evaluated candidates per shape (a resumed study counts its earlier ones)")
@click.option("--timeout", type=click.FloatRange(min=1), default=None, help="seconds per shape")
@click.option("--db", default=None, help="record store: a .jsonl file, or a database (a path, or an "
              "SQLAlchemy URL such as postgresql+psycopg://USER@HOST/DB for a fleet of workers)")
@click.option("--storage", default=None, help="Optuna storage: a journal file path or an RDB URL "
              "(default: the record store's URL when that is a database server, else the journal)")
@click.option("--sampler", type=click.Choice(["tpe", "gp", "cmaes", "brute", "random", "local"]), default="tpe",
              show_default=True, callback=_sampler,
              help="local: one knob at a time from the best so far (hill climbing); gp and cmaes need "
                   "the 'tune' extra (pip install \"autossd[tune]\")")
@click.option("--workers", type=click.IntRange(1), default=1, show_default=True,
              help="worker processes sharing each study (measured: one per GPU)")
@click.option("--mode", type=click.Choice(["auto", "measured", "static"]), default="auto", show_default=True,
              help="auto: measured when --arch is the local GPU, else static")
@click.option("--op", cls=_OpOption, default=DEFAULT_OP, show_default=True, is_eager=True, callback=_op,
              help="the op to tune")
@click.option("--fix", multiple=True, callback=_knob_settings, metavar="KNOB=VALUE", help="pin knobs, e.g. chunk_size=256")
@click.option("--start", multiple=True, callback=_starts, metavar="KNOB=VALUE,...",
              help="a config to evaluate early in each shape's study, after the default and the stored "
                   "picks (the knobs named; the rest the default's); the local sampler climbs from "
                   "the best of them. Repeat for several")
@click.option("--allow-unvalidated", is_flag=True,
              help="static tunes: also offer configs whose correctness was never shown on the arch's "
                   "hardware (on AMD: the fused depths' inter-program hand-off)")
@click.option("--seed", type=int, default=None, help="sampler seed")
@click.option("--compile-workers", type=click.IntRange(0), default=2, show_default=True,
              help="parallel compile processes (0: in this process)")
@click.option("--eval-timeout", type=click.FloatRange(min=1), default=60.0, show_default=True,
              help="measured: seconds before a candidate counts as hung")
@click.option("--objective", type=click.Choice(["graph", "eager"]), default="graph", show_default=True,
              help="measured mode on a GPU: what the search minimizes, CUDA-graph replay time (GPU "
                   "time) or eager time per call (host launch cost included); both are timed, and "
                   "each one's best is stored for the runtime to pick by how the caller launches "
                   "(ignored in static mode and in the CPU interpreter, which time neither)")
@click.option("--confirm", type=click.IntRange(0), default=3, show_default=True,
              help="measured mode: re-time each launch mode's N fastest candidates twice more, "
                   "interleaved, and store the best median (a single noisy sample no longer wins); 0: off")
@click.option("--plot-dir", type=click.Path(file_okay=False), default=None, help="write plots here")
@click.option("--progress/--no-progress", default=True)
@click.pass_context
def tune(ctx, arch, shapes, preset, dtype, state_dtype, trials, timeout, db, storage, sampler, workers, mode,
         op, fix, start, allow_unvalidated,
         seed, compile_workers, eval_timeout, objective, confirm, plot_dir, progress) -> None:
    """Tune kernels for shapes on an arch: measured on the local GPU, static (predicted) otherwise."""
    from .tuner import Settings, choose_mode, open_sink, tune as run_tune
    from .tuner.storage import describe

    local = local_arch()
    arch = arch or local
    if arch is None:
        raise click.BadParameter("no local GPU; name a target arch for static tuning "
                                 f"(one of {sorted(ARCHS)})", ctx=ctx, param_hint="'--arch'")
    for s in start:
        clash = sorted(k for k, v in s.items() if k in fix and fix[k] != v)
        if clash:
            raise click.BadParameter(f"{', '.join(f'{k}={s[k]}' for k in clash)}: --fix pins "
                                     f"{', '.join(f'{k}={fix[k]}' for k in clash)}", ctx=ctx, param_hint="'--start'")
    probs = _problems(ctx, shapes, preset, dtype, op, state_dtype)
    if plot_dir:   # found now, not after the search
        _writable_dir(plot_dir, "'--plot-dir'")
    try:
        mode = choose_mode(arch, mode, local)
    except ValueError as e:
        raise click.BadParameter(str(e), ctx=ctx, param_hint="'--mode'") from None
    try:
        sink = open_sink(db)
    except RuntimeError as e:
        where = "'--db'" if db else ("AUTOSSD_DB" if os.environ.get("AUTOSSD_DB") else "the user database")
        raise click.BadParameter(str(e), ctx=ctx, param_hint=where) from None
    if storage is None:
        # workers sharing a server database share their studies there too: a fleet needs
        # nothing but the one URL
        storage = _server_url(getattr(sink, "url", None))
    if mode == "measured":
        click.echo(f"== MEASURED tuning on the local GPU ({arch}): every candidate is checked "
                   "against the float64 reference, then timed ==")
    else:
        click.echo(f"== STATIC tuning for {arch} (local GPU: {local or 'none'}): candidates are "
                   "cross-compiled and ranked by a performance model ==")
        click.echo("== The times below are PREDICTIONS, not measurements; records are stored "
                   "with provenance 'static' ==")
        from .ops.registry import get_op
        caveat = get_op(op).static_caveat
        if caveat:
            click.echo(f"== Caveat for {op}: {caveat} ==")
    click.echo(f"storage: {describe(storage)}   records: {sink!r}   sampler: {sampler}   "
               f"trials/shape: {trials}")
    settings = Settings(trials=trials, timeout_s=timeout, sampler=sampler, seed=seed, storage=storage,
                        batch=max(1, compile_workers), fixed=fix, progress=progress, confirm=confirm,
                        op=op, allow_unvalidated=allow_unvalidated,
                        extra_seeds=list(start))
    runner_kw = {"compile_workers": compile_workers}
    if mode == "measured":
        runner_kw["timeout"] = eval_timeout
        runner_kw["objective"] = objective
    try:
        from .tuner.storage import kept_journals
        from .tuner.runners.measured import kept_eval_workers
        # the journal replayed once, and the measured runner's evaluation process started once,
        # not once a shape
        with _sigterm_unwinds(), kept_journals(), kept_eval_workers():
            results, not_tuned = [], []
            start = time.monotonic()
            if workers > 1:
                # one set of worker processes for every shape (each shape's study shared): the
                # shapes run in order, their lines come together at the end
                results += run_tune(arch, probs, mode, settings, sink, workers=workers, runner_kw=runner_kw)
            for i, prob in enumerate(probs if workers == 1 else ()):
                if progress and len(probs) > 1:
                    # a grid's thousand shapes: where the run is, and when it should end
                    took = time.monotonic() - start
                    eta = f", ~{took / i * (len(probs) - i) / 60:.0f} min left" if i else ""
                    click.echo(f"[{i + 1}/{len(probs)}] {_shape_str(prob)} ({took / 60:.1f} min{eta})")
                try:
                    results += run_tune(arch, [prob], mode, settings, sink, workers=workers, runner_kw=runner_kw)
                except RuntimeError as e:
                    # one shape that cannot be tuned here (its evaluation worker died, the GPU ran
                    # out of memory) leaves the others to run; the exit status still says so
                    click.echo(f"{_shape_str(prob)}: not tuned: {type(e).__name__}: {e}", err=True)
                    not_tuned.append(_shape_str(prob))
    except (ValueError, ImportError) as e:
        raise click.ClickException(str(e)) from None
    unit = "predicted ms" if mode == "static" else "ms"
    rows = []
    for r in results:
        speed = f"{r.default_ms / r.best_ms:.2f}x" if r.best_ms and r.default_ms else "-"
        pct = f"{r.pct_floor:.1f}%" if r.pct_floor else "-"
        rows.append([_shape_str(r.problem), r.complete, r.failed, r.pruned, _ms(r.default_ms),
                     _ms(r.best_ms), speed, _ms(r.floor_ms), pct])
    click.echo("")
    click.echo(_table(rows, ["shape", "ok", "failed", "pruned", f"default ({unit})",
                             f"best ({unit})", "vs default", "floor ms", "of floor"]))
    for r in results:
        if r.best_by_mode:
            for m, (cfg, ms) in sorted(r.best_by_mode.items()):
                click.echo(f"best {_shape_str(r.problem)} by {m} time ({_ms(ms)} ms): {cfg!r}")
        elif r.best_config is not None:
            click.echo(f"best {_shape_str(r.problem)}: {r.best_config!r}")
        if r.failures:
            # one line per cause; the full texts (compiler dumps included) are in the log
            from .tuner import failures
            causes = r.failure_causes or [failures.classify(why) for _, why in r.failures]
            texts = r.failure_reasons or [why for _, why in r.failures]
            for cause, n, line in failures.summary(list(zip(causes, texts))):
                click.echo(f"  failed {n}x: {cause}: {line}")
            if r.failure_log:
                click.echo(f"  full failure texts: {r.failure_log}")
            if "compiler crash" in causes and failures.compiler_log().exists():
                click.echo(f"  compiler output: {failures.compiler_log()}")
    if mode == "measured" and objective == "graph" and any(r.objective == "eager" for r in results):
        click.echo("note: this device could not capture a CUDA/HIP graph, so the studies minimized "
                   "eager time (records are stored for the eager launch mode only)")
    if mode == "static":
        click.echo("(static: predicted times from the performance model in autossd/tuner/model.py)")
    if plot_dir:
        from .plots import plot_all
        recs = sink.load() if hasattr(sink, "load") else [r.record for r in results if r.record]
        for p in plot_all(storage, recs, plot_dir, arch):
            click.echo(f"plot: {p}")
    if not_tuned:
        raise click.ClickException(f"{len(not_tuned)} of {len(probs)} shapes not tuned (see above): "
                                   + "; ".join(not_tuned))
    if not any(r.best_config is not None for r in results):
        raise click.ClickException("no candidate passed; nothing stored")


def _server_url(url: str | None) -> str | None:
    """`url` when it names a database server (a store several hosts can share), else None."""
    from .tuner.sinks import db_layer
    layer = db_layer()
    return url if url and layer is not None and layer.engine.is_server(url) else None


def _writable_dir(path: str, hint: str) -> None:
    """Refuse, naming the option, a folder that cannot be made or written: tried by making it
    and a nameless file in it (asking os.access would say yes to root on a read-only mount)."""
    import tempfile
    try:
        os.makedirs(path, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as e:
        raise click.BadParameter(f"{path}: cannot write plots there ({e.strerror or e})",
                                 param_hint=hint) from None


def _load_records(db: str | None, shipped: bool = False) -> list[dict]:
    """Records of a store as dicts: a .jsonl file, else the tuning database (default: the user
    database the runtime reads), plus the shipped per-arch databases when asked."""
    from .tuner.sinks import DbSink, JsonlSink, db_layer, db_record_dict, default_records_path
    layer = db_layer()
    if db is not None and "://" not in db and not os.path.exists(db):
        # a store named on the command line that is not there is a mistake, not an empty store
        raise click.BadParameter(f"{db}: no such file", param_hint="'--db'")
    if db is not None and db.endswith(".jsonl"):
        try:
            recs = JsonlSink(db).load()
        except ValueError as e:   # RecordStoreError: a .jsonl file that is no record store
            raise click.BadParameter(str(e), param_hint="'--db'") from None
    elif layer is not None:
        try:
            recs = DbSink(db).load()
        except Exception as e:  # noqa: BLE001 - TuningDBError, RecordError: say which store
            why = str(getattr(e, "orig", None) or e).splitlines()[0]
            env = os.environ.get("AUTOSSD_DB")
            if db is None and not env:
                raise click.ClickException(f"the user database {layer.user_db_url(None)}: {why}") from None
            # blame where the store came from: the option, or the environment variable
            raise click.BadParameter(f"{db or env}: {why}", param_hint="'--db'" if db else "AUTOSSD_DB") from None
    elif db is None:
        recs = JsonlSink(default_records_path()).load()
    else:
        raise click.BadParameter(f"{db}: reading it needs the database layer (autossd.db)",
                                 param_hint="'--db'")
    if shipped and layer is not None:
        for arch in sorted(ARCHS):
            path = layer.shipped_db_path(arch)
            if path is not None:
                recs += [db_record_dict(r) for r in layer.read_records(str(path), arch, strict=False,
                                                                       readonly=True, origin="shipped")]
    return recs


@main.command()
@click.option("--db", default=None, help="record store (.jsonl or database); default: the user store")
@click.option("--arch", callback=_arch, default=None, help="only this arch")
@click.option("--all", "show_all", is_flag=True, help="every record, not only the best per problem")
@click.option("--shipped", is_flag=True, help="include the databases shipped with autossd")
@click.option("--op", "ops", multiple=True, callback=_known_op, metavar="OP",
              help="only this op's records (repeatable; default: every op's)")
@click.option("--json", "as_json", is_flag=True, help="print JSON")
def show(db, arch, show_all, shipped, ops, as_json) -> None:
    """Stored tuning records of every op, with provenance (measured / static = predicted)."""
    from .ops.registry import get_op
    from .ops.registry import LEGACY_OP
    from .tuner.sinks import best_records, mode_of
    recs = _load_records(db, shipped)
    if arch:
        recs = [r for r in recs if r["arch"] == arch]
    if ops:
        recs = [r for r in recs if r.get("op", LEGACY_OP) in ops]
    if not show_all:
        recs = best_records(recs)
    if as_json:
        click.echo(json.dumps(recs, indent=1, sort_keys=True))
        return
    if not recs:
        click.echo("no records")
        return

    def config_str(op, values) -> str:
        text = repr(op.config(values))   # "<ConfigType>({knobs off their default})"
        return text[text.index("(") + 1:-1]   # whole: the last column, a cut one would mislead
    rows = []
    for r in recs:
        op = get_op(r.get("op", LEGACY_OP))
        rows.append([r["arch"], op.name, r["device"], _shape_str(op.problem_type(**r["problem"])), r["provenance"],
                     mode_of(r), _ms(r["time_ms"]) + (" (pred.)" if r["provenance"] == "static" else ""),
                     r["date"][:16], r.get("origin", ""), config_str(op, r["config"])])
    click.echo(_table(rows, ["arch", "op", "device", "shape", "provenance", "timed by", "ms", "date", "from",
                             "config (vs default)"]))


@main.command()
@click.option("--shapes", multiple=True, metavar="SHAPE", help="as for tune")
@click.option("--preset", multiple=True, type=click.Choice(["mamba2-130m", "mamba2-2.7b", "codestral-7b"]))
@click.option("--dtype", type=click.Choice(["fp16", "bf16", "fp32"]), default="fp16", show_default=True)
@click.option("--db", default=None, help="use the best stored config for each shape")
@click.pass_context
def bench(ctx, shapes, preset, dtype, db) -> None:
    """autossd vs mamba_ssm (if importable) vs the floor, on the local GPU."""
    from .bench import NoGPU, bench as run_bench, measure_ceilings
    from .ops.ssd.fwd_knobs import Config
    probs = _problems(ctx, shapes, preset, dtype)
    arch = local_arch()
    if arch is None:
        raise click.ClickException("bench needs a GPU (CUDA or ROCm); none is visible on this machine")
    from .tuner.sinks import best_records, mode_of
    # bench times eager calls (do_bench): the best record of each problem timed that way, this
    # GPU's own where the store holds several devices' (sorted last, so that it is the one kept;
    # among other devices' the fastest)
    from .db.lookup import device_name
    here = device_name()
    recs = {json.dumps(r["problem"], sort_keys=True): r
            for r in sorted(best_records(r for r in _load_records(db)
                                         if r["arch"] == arch and mode_of(r) != "graph"),
                            key=lambda r: (r.get("device") == here, -(r.get("time_ms") or math.inf)))
            } if db else {}
    ceil = measure_ceilings()  # once, in this run: the floor is against this GPU as it is now
    click.echo(f"ceilings measured: copy {ceil['copy_GBps']:.0f} GB/s, "
               f"bf16 matmul {ceil['bf16_matmul_TFLOPs']:.0f} TFLOP/s")
    rows = []
    for p in probs:
        rec = recs.get(json.dumps(p.key(), sort_keys=True))
        try:
            out = run_bench(p, Config(rec["config"]) if rec else None, arch, ceilings=ceil)
        except NoGPU as e:
            raise click.ClickException(str(e)) from None
        rows.append([_shape_str(p), _ms(out["autossd_ms"]), _ms(out["peer_ms"]), _ms(out["floor_ms"]),
                     f"{100 * out['floor_ms'] / out['autossd_ms']:.1f}%", "tuned" if rec else "default"])
    click.echo(_table(rows, ["shape", "autossd ms", "mamba_ssm ms", "floor ms", "of floor", "config"]))


@main.command()
@click.option("--db", default=None, help="store to export from (default: the user database)")
@click.option("--out", "out_path", required=True, type=click.Path(dir_okay=False),
              help="file to write: .sqlite (a shippable database) or .jsonl")
@click.option("--arch", callback=_arch, default=None)
@click.option("--overwrite", is_flag=True, help="replace --out if it exists")
def export(db, out_path, arch, overwrite) -> None:
    """Export records (e.g. one arch's, for a shipped database)."""
    from .tuner.sinks import best_records, db_layer
    ext = os.path.splitext(out_path)[1].lower()
    if ext not in (".jsonl", *DB_EXTENSIONS):
        # any other name used to get an SQLite file that nothing would read by its name
        raise click.BadParameter(f"{out_path}: unknown format {ext or '(no extension)'!r}; expected "
                                 f"{' / '.join(DB_EXTENSIONS)} (an SQLite tuning database) or .jsonl "
                                 f"(JSON lines, one record a line)", param_hint="'--out'")
    layer = db_layer()
    if layer is not None and not out_path.endswith(".jsonl") and not (db or "").endswith(".jsonl"):
        if os.path.exists(out_path) and not overwrite:
            raise click.BadParameter(f"{out_path} exists (use --overwrite)", param_hint="'--out'")
        try:
            n = layer.export_db(layer.user_db_url(db), out_path, arch=arch, overwrite=overwrite)
        except Exception as e:  # noqa: BLE001 - file exists, unreadable source: say so plainly
            raise click.ClickException(f"export: {e}") from None
        click.echo(f"exported {n} records -> {out_path}")
        return
    if not out_path.endswith(".jsonl"):
        # a .jsonl source: its lines are no database; writing them under another name would make
        # a file that every reader refuses
        raise click.BadParameter(f"{out_path}: a .jsonl store exports to a .jsonl file; to make a "
                                 f"database of it, run: autossd merge {db or 'STORE.jsonl'} --into {out_path}",
                                 param_hint="'--out'")
    if os.path.exists(out_path) and not overwrite:
        raise click.BadParameter(f"{out_path} exists (use --overwrite)", param_hint="'--out'")
    recs = [r for r in best_records(_load_records(db)) if not arch or r["arch"] == arch]
    with open(out_path, "w") as f:
        for r in recs:
            f.write(json.dumps(r, sort_keys=True) + "\n")
    click.echo(f"exported {len(recs)} records -> {out_path}")


def _sources(ctx, param, values):
    """Files that must exist, or database URLs (a fleet's server database)."""
    for v in values:
        if os.path.isdir(v):
            raise click.BadParameter(f"{v}: is a directory, not a record store (.sqlite or .jsonl)",
                                     ctx=ctx, param=param)
        if "://" not in v and not os.path.isfile(v):
            raise click.BadParameter(f"{v}: no such file", ctx=ctx, param=param)
    return values


@main.command()
@click.argument("sources", nargs=-1, required=True, callback=_sources)
@click.option("--into", "into", required=True, help="destination store (.sqlite or .jsonl); kept records "
              "already there take part in the merge")
def merge(sources, into) -> None:
    """Merge record stores into one: per problem, measured beats static, then the faster record;
    measured records are kept one per launch mode (eager / CUDA graph)."""
    from .tuner.sinks import DbSink, JsonlSink, RecordStoreError, best_records, db_layer
    if os.path.isdir(into):
        raise click.BadParameter(f"{into}: is a directory; --into names the store file to write "
                                 f"(.sqlite or .jsonl), e.g. {os.path.join(into, 'merged.sqlite')}",
                                 param_hint="'--into'")
    try:   # every .jsonl involved must be a record store before anything is written
        for s in [*sources, into]:
            if s.endswith(".jsonl"):
                JsonlSink(s).load()
    except RecordStoreError as e:
        bad = str(e).split(":")[0]
        raise click.BadParameter(str(e), param_hint="'--into'" if os.path.abspath(bad) == os.path.abspath(into)
                                 else "SOURCES") from None
    if "://" in into:
        # merge builds a new file and renames it over the destination: no database server
        raise click.BadParameter(f"{into}: merge writes a file (.sqlite or .jsonl); a server database "
                                 "can be a source", param_hint="'--into'")
    layer = db_layer()
    if layer is not None and not into.endswith(".jsonl"):
        dbs = [s for s in sources if not s.endswith(".jsonl")]
        if os.path.exists(into):
            dbs = [into] + dbs
        try:
            jsonl = [s for s in sources if s.endswith(".jsonl")]
            with tempfile.TemporaryDirectory() as tmp:
                if jsonl:
                    # .jsonl records join the merge as a database of their own, with their own
                    # dates and code hashes: the merge rule then picks among all of them (no
                    # duplicates, no stale record relabelled as fresh)
                    conv = os.path.join(tmp, "jsonl.sqlite")
                    sink = DbSink(conv)
                    layer.add_records(conv, [sink.to_db(r, copied=True) for s in jsonl
                                             for r in best_records(JsonlSink(s).load())])
                    dbs.append(conv)
                try:
                    res = layer.merge_dbs(dbs, into, overwrite=True)
                finally:
                    from .db.engine import dispose_engines, to_url
                    dispose_engines(to_url(os.path.join(tmp, "jsonl.sqlite")))
        except Exception as e:  # noqa: BLE001 - the errors name their file (exchange._read_named)
            why = str(getattr(e, "orig", None) or e).splitlines()[0]
            if os.path.abspath(into) in why:   # the destination's own records take part
                why += " (the --into destination, whose records take part in the merge)"
            raise click.ClickException(f"merge: {why}") from None
        click.echo(f"merged {len(sources)} sources into {into}: {res.kept} record{'s' * (res.kept != 1)} "
                   f"kept, {res.dropped} dropped (lost to a better record of the same problem, "
                   f"device and launch mode; {res.conflicts} problem{'s' * (res.conflicts != 1)} had several)")
        return
    if not into.endswith(".jsonl"):
        raise click.BadParameter("without the database layer, merge writes a .jsonl store",
                                 param_hint="'--into'")
    recs = JsonlSink(into).load()
    for s in sources:
        recs += JsonlSink(s).load() if s.endswith(".jsonl") else _load_records(s)
    best = best_records(recs)
    tmp = into + ".tmp"
    with open(tmp, "w") as f:
        for r in best:
            f.write(json.dumps(r, sort_keys=True) + "\n")
    os.replace(tmp, into)
    click.echo(f"merged {len(sources)} sources into {into}: {len(best)} records")


@main.command()
@click.option("--db", default=None, help="record store for the roofline")
@click.option("--storage", default=None, help="Optuna storage with the studies (default: --db when it "
              "is a database server, else the journal)")
@click.option("--arch", callback=_arch, default=None)
@click.option("--out-dir", required=True, type=click.Path(file_okay=False))
def plot(db, storage, arch, out_dir) -> None:
    """Tuning-history plots of the studies and a roofline of the records (PNG files)."""
    from .plots import plot_all
    from .tuner.storage import JournalError
    if storage is None and db is not None and "://" in db:
        storage = _server_url(db)
    _writable_dir(out_dir, "'--out-dir'")
    try:
        paths = plot_all(storage, _load_records(db), out_dir, arch)
    except JournalError as e:   # names the journal and says what to do
        raise click.ClickException(str(e)) from None
    except OSError as e:   # a folder that became unwritable, a full disk
        raise click.BadParameter(f"{out_dir}: cannot write plots there ({e.strerror or e})",
                                 param_hint="'--out-dir'") from None
    for p in paths:
        click.echo(f"plot: {p}")
    if not paths:
        click.echo("nothing to plot")


@main.command()
def doctor() -> None:
    """What autossd sees here: arch, device, versions, stores, caches."""
    import torch
    import triton

    from .render import cache_dir, template_hash
    from .tuner.sinks import db_layer, default_records_path
    from .tuner.storage import default_journal_path
    layer = db_layer()
    arch = local_arch()
    lines = [("python", platform.python_version()), ("torch", torch.__version__),
             ("triton", triton.__version__)]
    for mod in ("optuna", "sqlalchemy", "psycopg", "scipy", "cmaes", "mamba_ssm"):
        try:
            lines.append((mod, getattr(__import__(mod), "__version__", "installed")))
        except Exception:  # noqa: BLE001
            lines.append((mod, "not installed"))
    dev = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none"
    from .arch import implicit_arch
    try:   # whose records get_kernel and the drop-ins use here (the same words as their reason)
        runtime_arch = implicit_arch(arch)[1]
    except ValueError as e:   # an unknown AUTOSSD_ARCH: every call would refuse it
        runtime_arch = f"error: {e}"
    lines += [("local arch", arch or "none (static tuning only)"), ("device", dev),
              ("runtime uses", runtime_arch)]
    lines += [(var, os.environ[var]) for var in ("AUTOSSD_ARCH", "AUTOSSD_DB", "AUTOSSD_CACHE_DIR",
                                                  "AUTOSSD_DATA_DIR") if os.environ.get(var)]
    lines += [("interpreter", os.environ.get("TRITON_INTERPRET", "0")),
              ("template hash (studies)", template_hash()), ("kernel cache", str(cache_dir())),
              ("records (default)", layer.user_db_url(None) if layer else
               f"{default_records_path()}{'' if default_records_path().exists() else ' (none yet)'}"),
              ("studies (default)", f"{default_journal_path()}"
               f"{'' if default_journal_path().exists() else ' (none yet)'}"),
              ("database layer", "autossd.db present" if layer else "not installed")]
    from .db.lookup import shipped_dir   # the installed package's copy, or the checkout's
    where = shipped_dir()
    shipped = sorted(where.glob("*.sqlite")) if where.is_dir() else []
    lines.append(("shipped databases", f"{', '.join(p.name for p in shipped)} ({where})" if shipped else "none"))
    w = max(len(k) for k, _ in lines)
    for k, v in lines:
        click.echo(f"{k.ljust(w)}  {v}")


if __name__ == "__main__":
    sys.exit(main())
