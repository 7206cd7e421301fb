"""Which config runs a problem: three small steps, in the style of vLLM's config lookup.

    db_filename(arch)                    -> "sm90.sqlite", the shipped database's file name
    load_records(arch, op, db)           -> validated records, user database first, then shipped
    pick(problem, records, arch, mode)   -> Match: exact / nearest / default, distance, reason

Sources and precedence
    The user database: an SQLAlchemy URL or path from the `db` argument, else env AUTOSSD_DB,
    else `<cache>/tuning.sqlite` (cache = env AUTOSSD_CACHE_DIR or platformdirs'
    user_cache_dir("autossd")). It is never created by a lookup; an older schema is migrated (in
    a temporary copy when the file or its folder is read-only). It is read through a read-only
    connection.
    The shipped database: `<arch>.sqlite` in the package `autossd.tuning_db` (the top-level
    tuning_db/ folder of a source checkout), opened immutable (read-only, no locking).

Match tiers, in order
    1. exact: a record whose Problem equals the query in every field (a record tuned with the
       chunk size free, chunk_size None, matches any requested chunk_size: the caller's
       chunk_size is a request, the tuned config's chunk size computes the same function).
    2. nearest: a record with the same dtype, chunk_size, headdim, dstate and main-loop flags,
       at a distance
           d = sum |log2(a/b)| over (batch, seqlen, nheads, ngroups)
               + FLAG_PENALTY (0.5) per differing soft flag
       (a problem type may name its own size dimensions and weights instead, `DISTANCE_WEIGHTS`:
       packed prefill's tokens, and at half the weight its sequences)
       of at most `max_distance` (default MAX_DISTANCE = 2.0: e.g. 4x the sequence length, or 2x
       batch and 2x seqlen, or 2x seqlen and two soft flags). headdim and dstate must match
       (distance infinite): tile sizes are chosen for them and do not transfer. Soft flags are
       those the op declares (`Op.soft_flags`) as changing only its kernels' prologue or
       epilogue, not a main loop: for the forward z, D (and its shape), dt's bias, softplus and
       limit, the initial and the final states. A record tuned without z thus serves a query
       with z (its config's tiles and loops are those the query runs, plus an epilogue); every
       other field (for the forward: has_seq_idx, return_varlen_states) must match, and an op
       that declares none (the backward) matches every flag. The record's config must also be
       feasible for the query (`space.violations`, run on the query's problem). Records of
       provenance "default" are not used for nearest: they carry no information beyond
       `default_config` of another shape, and the default of the query's own shape (tier 3) is
       better.
    3. transfer: where no record is within the bound (or the exact or nearest one is a prediction,
       static or default, while the arch has fresh measured records: then among those), the
       best-ranked record of the arch and op at any size, headdim or dstate (a 16-bit dtype
       serves the other 16-bit one), its config carried over to the query (`transfer`): chunk
       size set to a requested one, states kept in the record's own 16-bit type kept in the
       query's, tiles shrunk to the query's caps, and every knob the
       query's problem cannot run (`violations`) set back to the arch default's value, one at
       a time, until none is left. Measured on an H100 at 12 random shapes no database was
       tuned at, the configs 30-trial tunes found there were the shipped records' family (the
       Gluon walk and scans) with the knobs a dstate or headdim rules out set back; carried
       over, it ran within 8% of them, where the arch default ran 1.26-1.67x slower at 11 of
       the 12: the family transfers where single tiles do not. Distance: the nearest tier's over every numeric
       field (headdim and dstate too), FLAG_PENALTY per other differing field.
    4. default: `space.default_config(arch, problem)`.

Ranking within a tier (first difference wins; the result is deterministic, with no timing):
    fresh before stale  >  measured > static > default  >  user before shipped
    >  measured on this device (the runtime passes the GPU's name: an H200 prefers H200 records
    to H100 ones of the same arch; then the other cards one after another, the one with the most
    measured records first, so that a GPU with few or none of its own, or a caller naming none,
    takes one card's configs rather than a mix by raw time)  >  the launch mode asked for  >  smaller distance  >  smaller
    time (time_ms; for static records predicted_ms)  >  config key (text)  >  record id.
    A measurement beats a prediction wherever each is stored: a static tune on a machine without
    the GPU writes predictions into the user database, and those must not hide the shipped
    database's measured record of the same shape (the Match's reason then names the user record
    passed over). Among records of one provenance the user's own come first.

Launch modes
    A measured record says what its time was measured under (`launch_mode`): "eager" calls, whose
    time includes the host's launch cost, or "graph" replay, which is GPU time alone. At a small
    shape the two pick different configs (eager favours fewer launches). The
    runtime asks for "graph" while the current stream is capturing a CUDA graph, else "eager";
    a record of the mode asked for ranks first, then any other of its tier and provenance
    (static and default records are "any": a prediction of GPU time). Origin ranks above the
    mode: a user record of either mode beats a shipped record of its provenance of the mode
    asked for (a user who
    tuned before launch modes existed, whose records are all "eager", keeps them when capturing
    too; `autossd tune` now stores both modes).

Stale records (policy)
    A record is stale when its triton version or template hash differs from the running ones.
    Stale records are still used (their config is validated and feasible; only the timing may no
    longer hold), but rank below every fresh record of the same tier, and the Match says so:
    `stale=True` and the reason names the mismatch. An exact stale record still beats a nearest
    fresh one: the shape is the stronger signal.

Bad data
    A database that cannot be read (corrupt file, foreign schema) is skipped with a logged
    warning (but a user database left in WAL mode in a folder this process cannot write raises
    `ReadOnlyWALError`, naming the file and what to do: the user's tuning is not dropped unsaid); a row that fails validation (`records.validate_row`) is skipped with a logged
    warning naming the row and field. Lookup then goes on with the other records, down to the
    default, so the user's program runs. Nothing unvalidated reaches `render`.
"""
from __future__ import annotations

import functools
import importlib.resources
import logging
import math
import os
import threading
from dataclasses import dataclass, replace
from pathlib import Path

from ..knobs import BaseConfig
from ..ops.registry import get_op, op_of
from ..problem import Problem
from .engine import ReadOnlyWALError, TuningDBError, sqlite_path, to_url, upgrade_if_older, writable
from .records import PROVENANCE_RANK, Record, _freshness, on_write, read_records, record_time  # noqa: F401

log = logging.getLogger("autossd.db")

MAX_DISTANCE = 2.0
DISTANCE_DIMS = ("batch", "seqlen", "nheads", "ngroups")
# The distance a differing soft flag adds (see Op.soft_flags). Half of a 2x size step: such a flag
# changes an epilogue (or a prologue) only, so it moves the best config less than doubling the
# work of every main loop does, yet a record with the query's own flags at the same size still
# ranks first, and a record that differs in flags must be that much closer in size to stay
# within the bound (four differing flags at the query's size reach it). Measured on an H100 at
# mamba2-2.7b 8x2048 bf16 with z, the config tuned without z ran the forward in ~300 us where
# the arch default took ~520 us.
FLAG_PENALTY = 0.5
ORIGIN_RANK = {"user": 0, "shipped": 1}
CALLER_MODES = ("eager", "graph")   # how a caller launches: the launch modes a lookup asks for
USER_DB_FILE = "tuning.sqlite"


@dataclass(frozen=True)
class Match:
    kind: str                 # "exact" | "nearest" | "transfer" | "default"
    config: BaseConfig
    distance: float           # 0 for exact; the nearest candidate's distance (or inf) for default
    reason: str
    record: Record | None = None
    stale: bool = False


# --- where the databases are ---------------------------------------------------------------
def db_filename(arch: str) -> str:
    """File name of an arch's shipped database (all ops of the arch in one file)."""
    return f"{arch}.sqlite"


def shipped_dir() -> Path:
    """tuning_db/ ships as the package autossd.tuning_db (see pyproject); from a source
    checkout it is the top-level tuning_db/ folder."""
    try:
        res = importlib.resources.files("autossd.tuning_db")
        path = Path(str(res))
        if path.is_dir():
            return path
    except (ModuleNotFoundError, TypeError):
        pass
    return Path(__file__).resolve().parent.parent.parent / "tuning_db"


def shipped_db_path(arch: str) -> Path | None:
    path = shipped_dir() / db_filename(arch)
    return path if path.is_file() else None


def user_db_url(db: str | os.PathLike | None = None) -> str:
    """The user database's URL: `db`, else env AUTOSSD_DB, else `<cache>/tuning.sqlite` (cache =
    env AUTOSSD_CACHE_DIR or platformdirs' user cache folder). Every call of the runtime asks
    this (the selector keys its cache on it), so the answer is kept per (what names the place,
    working directory, home): resolving a path costs a few filesystem calls, 0.2-0.3 ms per call
    on an H200 host, which a training step paid twice."""
    if db is not None:
        return _resolved(os.fspath(db), os.getcwd())
    env = os.environ.get("AUTOSSD_DB")
    if env:
        return _resolved(env, os.getcwd())
    cache = os.environ.get("AUTOSSD_CACHE_DIR")
    if cache:
        return _resolved(os.path.join(cache, USER_DB_FILE), os.getcwd())
    return _default_user_db(os.environ.get("XDG_CACHE_HOME"), os.environ.get("HOME"))


@functools.lru_cache(maxsize=64)
def _resolved(place: str, cwd: str) -> str:
    return to_url(place)   # a relative path resolves against `cwd`, part of the key


@functools.lru_cache(maxsize=8)
def _default_user_db(xdg_cache: str | None, home: str | None) -> str:
    # platformdirs' answer depends on these two variables (on Linux; on other systems on home)
    import platformdirs
    return to_url(Path(platformdirs.user_cache_dir("autossd")) / USER_DB_FILE)


# --- loading -------------------------------------------------------------------------------
_records: dict[tuple[str, str, str], list[Record]] = {}
_records_lock = threading.Lock()


def clear_cache(url: str | None = None) -> None:
    """Forget loaded records (all, or those loaded with user database `url`)."""
    with _records_lock:
        for key in [k for k in _records if url is None or k[2] == url]:
            del _records[key]


on_write(clear_cache)  # a write through records.add_records invalidates what was loaded from it


def _load_user(url: str, arch: str, op: str) -> list[Record]:
    path = sqlite_path(url)
    if url.startswith("sqlite") and (path is None or not path.exists()):
        return []  # a lookup never creates the user database
    if not writable(url):
        # a read-only place (a mounted or shared cache): read as it is, an older schema through
        # an upgraded temporary copy, never failing for want of write access
        from .exchange import read_source
        return [replace(r, origin="user") for r in read_source(url, arch, op, strict=False)]
    upgrade_if_older(url)
    return read_records(url, arch, op, strict=False, origin="user")


def _load_shipped(arch: str, op: str) -> list[Record]:
    path = shipped_db_path(arch)
    if path is None:
        return []
    return read_records(str(path), arch, op, strict=False, readonly=True, immutable=True, origin="shipped")


def loaded(arch: str, op: str, url: str) -> list[Record] | None:
    """The records `load_records` holds for (arch, op, user database URL), or None."""
    return _records.get((arch, op, url))


def load_records(arch: str, op: str, db: str | os.PathLike | None = None) -> list[Record]:
    """Validated records for (arch, op): the user database's first, then the shipped one's.
    Cached per process; an unreadable database is skipped with a warning."""
    url = user_db_url(db)
    key = (arch, op, url)
    recs = _records.get(key)
    if recs is not None:
        return recs
    recs = []
    for name, load in (("user", lambda: _load_user(url, arch, op)), ("shipped", lambda: _load_shipped(arch, op))):
        try:
            recs.extend(load())
        except ReadOnlyWALError:
            # the user's own tuning that cannot be read where it is: say so rather than run on
            # defaults without it (the error names the file and what to do)
            raise
        except (TuningDBError, OSError) as e:
            log.warning("autossd: ignoring the %s tuning database: %s; falling back to other records "
                        "and defaults", name, e)
        except Exception as e:  # noqa: BLE001 - a broken database must not stop the user's program
            log.warning("autossd: ignoring the %s tuning database (%s: %s); falling back to other "
                        "records and defaults", name, type(e).__name__, e)
    with _records_lock:
        _records[key] = recs
    return recs


# --- picking -------------------------------------------------------------------------------
@functools.lru_cache(maxsize=None)
def _fields(ptype: type) -> tuple[tuple[tuple[str, float], ...], tuple[str, ...]]:
    """((field, weight) of each size dimension a problem type has, its other fields): each op's
    problem type (the forward's and backward's Problem, the decode step's, packed prefill's) keys
    its records. A type names its own size dimensions and their weights in
    `DISTANCE_WEIGHTS` (packed prefill: tokens, half as much the sequences, and not its chunk
    count, which follows from them); else the DISTANCE_DIMS it has count once each."""
    names = ptype.field_names()
    weights = getattr(ptype, "DISTANCE_WEIGHTS", None)
    if weights is None:
        weights = {f: 1.0 for f in DISTANCE_DIMS if f in names}
    dims = tuple((f, float(w)) for f, w in weights.items())
    return dims, tuple(f for f in names if f not in weights)


def _size_distance(a, b, dims) -> float:
    return sum(w * abs(math.log2(getattr(a, f) / getattr(b, f))) for f, w in dims if w)


def _compare(a, b, soft: frozenset) -> tuple[float, tuple[str, ...]]:
    """(distance, the soft flags that differ); the distance is infinite where a field outside
    the distance dims and `soft` differs, or the problems are of different types."""
    if type(a) is not type(b):
        return math.inf, ()
    dims, keyed = _fields(type(a))
    flags = []
    for f in keyed:
        if f == "chunk_size" and b.chunk_size is None:
            continue
        if getattr(a, f) != getattr(b, f):
            if f not in soft:
                return math.inf, ()
            flags.append(f)
    d = _size_distance(a, b, dims)
    return d + FLAG_PENALTY * len(flags), tuple(flags)


# Fields whose values a transferred config may differ in at their log2 distance, like the
# nearest tier's dims (tiles are shrunk to the query's, and violations set back what cannot run)
TRANSFER_DIMS = ("headdim", "dstate")
HALF_DTYPES = frozenset({"fp16", "bf16"})


def _transfer_distance(a, b) -> float:
    """The transfer tier's distance of record problem `b` from query `a`: |log2| over the
    nearest tier's dims and TRANSFER_DIMS, FLAG_PENALTY per other differing field (a fp16 record
    serves bf16 and back, for the inputs and for a decode state; other dtypes, and problems of
    another type, never)."""
    if type(a) is not type(b):
        return math.inf
    dims, keyed = _fields(type(a))
    d = _size_distance(a, b, dims)
    for f in keyed:
        va, vb = getattr(a, f), getattr(b, f)
        if f == "chunk_size" or va == vb:
            continue
        if f in TRANSFER_DIMS:
            d += abs(math.log2(va / vb))
        elif f.endswith("dtype") and not {va, vb} <= HALF_DTYPES:   # the inputs', the decode state's
            return math.inf
        else:
            d += FLAG_PENALTY
    return d


def transfer(config: BaseConfig, arch: str, problem, op: str | None = None, source=None) -> BaseConfig | None:
    """`config` carried over to `problem`: its requested chunk size, states kept in the record's
    own 16-bit input type (`source`: the record's problem) kept in the query's (a bf16 call
    never gets fp16 states, whose range is narrower, nor an fp16 call bf16 ones, whose precision
    is), tiles shrunk to the problem's caps (Op.caps), then, while the op's `violations` name
    reasons, the knob they name (else any knob) set back to the arch default's value where that
    leaves fewer reasons. None when no such step is left (the default itself then serves)."""
    o = get_op(op or config.op)
    violations = o.fn("violations")
    default = o.fn("default_config")(arch, problem)
    c = config
    if getattr(problem, "chunk_size", None) is not None and "chunk_size" in c.space.by_name:
        c = c.replace(chunk_size=problem.chunk_size)
    src_dtype, dtype = getattr(source, "dtype", None), getattr(problem, "dtype", None)
    if "state_dtype" in c.space.by_name and c["state_dtype"] == src_dtype and src_dtype != dtype \
            and {src_dtype, dtype} <= HALF_DTYPES:
        c = c.replace(state_dtype=dtype)
    if o.caps:
        from ..knobs import shrink
        c = shrink(c, o.fn("caps")(problem))
    why = violations(c, arch, problem)
    while why:
        text = " ".join(why)
        names = [k.name for k in c.space.knobs if c[k.name] != default[k.name]]
        names.sort(key=lambda k: f"{k}=" not in text)   # the knobs a reason names first
        for k in names:
            c2 = c.replace(**{k: default[k]})
            w2 = violations(c2, arch, problem)
            if len(w2) < len(why):
                c, why = c2, w2
                break
        else:
            return None
    return c


def soft_flags(op: str) -> frozenset:
    """The problem fields `op` declares soft (Op.soft_flags): they may differ in the nearest tier."""
    return frozenset(get_op(op).soft_flags)


def distance(a: Problem, b: Problem, op: str | None = None) -> float:
    """The nearest tier's distance for `op`'s records: sum |log2(a/b)| over DISTANCE_DIMS plus
    FLAG_PENALTY per differing soft flag of the op; infinite when any other field differs. `a`
    is the query, `b` the record: a record tuned with the chunk size free (chunk_size None)
    answers any requested chunk size, since every chunk size computes the same function. 0 only
    where every field is equal (the exact tier)."""
    return _compare(a, b, soft_flags(op_of(a, op)))[0]


RANK_DISTANCE = 5   # where _rank's tuple holds the distance


def _rank(rec: Record, d: float, stale: bool, launch_mode: str, devices: dict | None = None) -> tuple:
    # measurements rank by their device's place in `devices` (`device_order`: this GPU's first,
    # then one other card before the next); predictions name no device of their own
    place = devices.get(rec.device, len(devices)) if devices and rec.provenance == "measured" else 0
    return (stale, PROVENANCE_RANK[rec.provenance], ORIGIN_RANK.get(rec.origin, 2), place,
            rec.launch_mode != launch_mode, d, record_time(rec), rec.config.key(), rec.id or 0)


def _passed_over(rec: Record, rest: list[Record]) -> Record | None:
    """The best record of a database that ranks before rec's that lost to rec by provenance
    alone (a user's static record under a shipped measured one): the reason names it."""
    mine = ORIGIN_RANK.get(rec.origin, 2)
    return next((r for r in rest if ORIGIN_RANK.get(r.origin, 2) < mine
                 and PROVENANCE_RANK[r.provenance] > PROVENANCE_RANK[rec.provenance]), None)


def _describe(rec: Record) -> str:
    p = rec.problem
    mode = {"eager": "timed by eager calls", "graph": "timed by CUDA-graph replay"}
    bits = [f"{rec.provenance} record from the {rec.origin or 'given'} db"
            + (f" ({mode[rec.launch_mode]})" if rec.launch_mode in mode else ""),
            " ".join(f"{k}={getattr(p, f)}" for k, f in (("b", "batch"), ("L", "seqlen"), ("t", "tokens"),
                                                        ("h", "nheads"), ("g", "ngroups")) if hasattr(p, f))]
    if rec.time_ms is not None:
        bits.append(f"{rec.time_ms:.4g} ms" + (f" on {rec.device}" if rec.device else ""))
    bits.append(rec.created_at[:10])
    return ", ".join(bits)


def device_name(device=None) -> str | None:
    """The name torch gives a GPU (`torch.cuda.get_device_name`), which `pick`'s `device` takes:
    of a torch.device, a device index, or (None) the current GPU. None where there is no GPU to
    ask: a CPU tensor, a CPU build of torch."""
    import torch
    if isinstance(device, torch.device):
        if device.type != "cuda":
            return None
        device = device.index
    try:
        if not torch.cuda.is_available():
            return None
        return _name_of(torch.cuda.current_device() if device is None else int(device))
    except (AssertionError, RuntimeError, ValueError):
        return None


@functools.lru_cache(maxsize=64)
def _name_of(index: int) -> str:
    # a device's name does not change while a process runs; asking torch takes µs per call. As
    # a record stores it (records.device_text), so that a GPU's name matches its own records
    import torch
    from .records import device_text
    return device_text(torch.cuda.get_device_name(index))


def device_order(records: list[Record], arch: str, op: str, device: str | None) -> dict[str, int]:
    """The order in which devices' measurements rank (device -> place): the caller's first, then
    the others by their number of measured records of the arch and op (most first; ties: by
    name). Times from two GPUs do not compare, so a GPU with few or none of the records (an
    H800, a GH200), or a caller naming none, takes one other card's configs wherever that card
    has a record of the tier, rather than, shape by shape, those of whichever card timed
    faster."""
    counts: dict[str, int] = {}
    for r in records:
        if r.arch == arch and r.op == op and r.provenance == "measured" and r.device:
            counts[r.device] = counts.get(r.device, 0) + 1
    others = sorted((d for d in counts if d != device), key=lambda d: (-counts[d], d))
    return {d: i for i, d in enumerate(([device] if device else []) + others)}


def pick(problem: Problem, records: list[Record], arch: str, max_distance: float = MAX_DISTANCE,
         launch_mode: str = "eager", op: str | None = None, transfer: bool = True,
         device: str | None = None) -> Match:
    """Choose the config for `problem` from `records` (see the module docstring for the rules).
    launch_mode: "eager" or "graph", how the caller launches (the records timed that way first).
    op: the op asked for (its records only; its default config where none applies); default:
    the one the problem's type names (`ProblemFields.default_op`).
    transfer: False leaves out the transfer tier (exact, nearest, else the default).
    device: the GPU's name (torch.cuda.get_device_name): its measured records rank before those
    of another device of the arch, within each tier (`device_order`: then one other card's
    before the next's, the card with the most records first)."""
    if launch_mode not in CALLER_MODES:
        raise ValueError(f"launch_mode: expected one of {CALLER_MODES}, got {launch_mode!r}")
    op = op_of(problem, op)
    devices = device_order(records, arch, op, device)
    triton_v, th = _freshness()
    soft = soft_flags(op)
    violations = get_op(op).fn("violations")
    exact, near = [], []
    differ: dict[int, tuple[str, ...]] = {}   # id(record) -> the soft flags it differs in
    best_d = math.inf
    for rec in records:
        if rec.arch != arch or rec.op != op:
            continue
        d, flags = _compare(problem, rec.problem, soft)
        if d == math.inf:
            continue
        stale = bool(rec.stale_reasons(triton_v, th))
        if d == 0.0 and not flags:   # exact: every field equal (FLAG_PENALTY > 0 keeps d > 0 anyway)
            exact.append((_rank(rec, 0.0, stale, launch_mode, devices), rec))
        # feasibility is judged for the query's problem (its flags too), not the record's
        elif rec.provenance != "default" and not violations(rec.config, arch, problem):
            best_d = min(best_d, d)
            if d <= max_distance:
                near.append((_rank(rec, d, stale, launch_mode, devices), rec))
                differ[id(rec)] = flags
    for kind, cands in (("exact", exact), ("nearest", near)):
        if not cands:
            continue
        cands.sort(key=lambda c: c[0])
        rank, rec = cands[0]
        d = rank[RANK_DISTANCE]
        reason = f"{kind} match: {_describe(rec)}"
        if kind == "nearest":
            flags = differ[id(rec)]
            if flags:
                reason += ("; tuned with " + ", ".join(f"{f}={getattr(rec.problem, f)}" for f in flags)
                           + f" (flags off the main loops: +{FLAG_PENALTY:g} each)")
            reason += f"; distance {d:.2f} <= bound {max_distance:g}"
        rival = _passed_over(rec, [r for _, r in cands[1:]])
        if rival is not None:
            reason += (f"; preferred over a {rival.provenance} record from the {rival.origin} db "
                       f"(a measurement beats a prediction wherever each is stored)"
                       if rec.provenance == "measured" else
                       f"; preferred over a {rival.provenance} record from the {rival.origin} db")
        stale_why = rec.stale_reasons(triton_v, th)
        if stale_why:
            reason += f"; STALE ({', '.join(stale_why)}): no fresh record in this tier"
        if len(cands) > 1:
            reason += f"; best of {len(cands)} candidates"
        if transfer and rec.provenance != "measured":
            # a prediction does not hide the arch's fresh measurements, here or at other sizes (a
            # stale one ranks below a fresh prediction, as within a tier)
            measured = [r for r in records if r.provenance == "measured" and not r.stale_reasons(triton_v, th)]
            moved = _transferred(problem, measured, arch, launch_mode, op, triton_v, th,
                                 f"a measurement beats a prediction: the {kind} record is {rec.provenance}, "
                                 f"{_describe(rec)}", devices) if measured else None
            if moved is not None:
                return moved
        return Match(kind, rec.config, d, reason, rec, bool(stale_why))
    if best_d == math.inf:
        _, keyed = _fields(type(problem))
        why = f"no measured/static record with this {', '.join(f for f in keyed if f not in soft)}"
        if soft:
            why += f" (records that differ in {', '.join(sorted(soft))} serve at +{FLAG_PENALTY:g} each)"
    else:
        why = f"nearest usable record at distance {best_d:.2f} > bound {max_distance:g}"
    moved = _transferred(problem, records, arch, launch_mode, op, triton_v, th, why, devices) if transfer else None
    if moved is not None:
        return moved
    n = sum(r.arch == arch and r.op == op for r in records)
    return Match("default", get_op(op).fn("default_config")(arch, problem), best_d,
                 f"default config for {arch}: {why} ({n} records searched)")


def _transferred(problem, records: list[Record], arch: str, launch_mode: str, op: str,
                 triton_v: str, th: str, why: str, devices: dict | None = None) -> Match | None:
    """The transfer tier (module docstring): the best-ranked record at a finite transfer distance
    whose config `transfer` carries over, or None."""
    cands = []
    for rec in records:
        if rec.arch != arch or rec.op != op or rec.provenance == "default":
            continue
        d = _transfer_distance(problem, rec.problem)
        if d < math.inf:
            cands.append((_rank(rec, d, bool(rec.stale_reasons(triton_v, th)), launch_mode, devices), rec))
    cands.sort(key=lambda c: c[0])
    for rank, rec in cands:
        cfg = transfer(rec.config, arch, problem, op, rec.problem)
        if cfg is None:
            continue
        kept = "its config as it is" if cfg == rec.config else "its config carried over (knobs the query cannot run set back to the default's)"
        return Match("transfer", cfg, rank[RANK_DISTANCE],
                     f"transfer ({why}): {_describe(rec)}, {kept}; "
                     f"transfer distance {rank[RANK_DISTANCE]:.2f}", rec, bool(rec.stale_reasons(triton_v, th)))
    return None


def choose(problem: Problem, arch: str, op: str | None = None, db: str | os.PathLike | None = None,
           max_distance: float = MAX_DISTANCE, launch_mode: str = "eager") -> Match:
    op = op_of(problem, op)
    return pick(problem, load_records(arch, op, db), arch, max_distance, launch_mode, op)
