"""The one config selector: (op, problem, arch, device, launch mode) -> the config that runs,
through the tuning databases' lookup (`autossd.db.lookup`: exact, nearest, transfer, default;
within a tier fresh before stale, measured before predicted, this GPU's measurements first).

Every op's entry asks here, so every op gets the same tiers and ranking, and one bounded cache
holds the answers. `clear()` forgets them, the loaded records, and every per-call cache an op
registered with `on_clear` (its validated calls, launch records, workspaces): a write to a
tuning database in this process, or a changed AUTOSSD_DB, voids them all at once."""
from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable
from dataclasses import replace

import torch

from ..arch import env_arch, implicit_arch
from ..db import lookup
from ..db.lookup import Match
from ..db.records import on_write, rejected_rows

log = logging.getLogger("autossd")

CACHE_MAX = 4096   # cached answers (one per op, problem, arch, database, mode and GPU); then start over
# key -> (the records list the answer was picked from, the Match): an answer holds while the
# lookup still holds that list, so `lookup.clear_cache()` (a write, a test's reset) voids it too
_cache: dict[tuple, tuple[list, Match]] = {}
_lock = threading.Lock()
_clearers: list[Callable[[], None]] = []


def on_clear(fn: Callable[[], None]) -> Callable[[], None]:
    """Register a cache of an op's (keyed by what the selector chose) for `clear()`."""
    _clearers.append(fn)
    return fn


def clear() -> None:
    """Forget every selected config, the loaded records, and every cache registered with
    `on_clear`."""
    with _lock:
        _cache.clear()
    lookup.clear_cache()
    for fn in _clearers:
        fn()


on_write(lambda url: clear())  # a write in this process may change what the lookup picks


def select(op: str, problem, arch: str, device: str | None = None, launch_mode: str = "eager",
           db: str | os.PathLike | None = None, safe: bool = False) -> Match:
    """The Match (config, tier, distance, reason) for `problem` of `op` on `arch`. device: the
    GPU's name (`lookup.device_name`), whose own measurements rank first; launch_mode: how the
    caller launches ("eager" or "graph": the records timed that way first); db: the user
    database (default env AUTOSSD_DB, else the cache file). safe: a database that cannot be read
    at all (e.g. a user database in WAL mode in a read-only folder) is logged and passed over,
    down to the default; otherwise its error reaches the caller. Cached per process."""
    url = lookup.user_db_url(db)
    key = (op, problem, arch, url, launch_mode, device)
    hit = _cache.get(key)
    if hit is not None and (hit[0] is None or lookup.loaded(arch, op, url) is hit[0]):
        return hit[1]   # (None: no store could be read; kept until clear())
    try:
        records = lookup.load_records(arch, op, url)
    except Exception as e:   # noqa: BLE001 - only where the caller asked: its program goes on
        if not safe:
            raise
        log.warning("autossd: %s records unreadable (%s); using defaults", op, e)
        records = None
    match = _arch_said(_with_rejections(lookup.pick(problem, records or [], arch, launch_mode=launch_mode, op=op,
                                                    device=device), url, arch, op), arch)
    with _lock:
        if len(_cache) >= CACHE_MAX:
            _cache.clear()
        _cache[key] = (records, match)
    return match


def _with_rejections(match: Match, url: str, arch: str, op: str) -> Match:
    """`match`, its reason also saying how many records of the user and shipped databases were
    refused by validation (and so never searched), with the first one's reason."""
    shipped = lookup.shipped_db_path(arch)
    bad = rejected_rows(url, arch, op) + (rejected_rows(str(shipped), arch, op) if shipped else [])
    if not bad:
        return match
    return replace(match, reason=f"{match.reason}; {len(bad)} record{'s' * (len(bad) != 1)} rejected "
                                 f"({bad[0]}{'; ...' if len(bad) > 1 else ''})")


def _arch_said(match: Match, arch: str) -> Match:
    """`match`, its reason ending by saying why these records where the arch is the one a call naming
    none gets without a GPU to tell it: AUTOSSD_ARCH's, or on a machine without a GPU the
    interpreter's (arch.implicit_arch, whose words `autossd doctor` shows too). Said whether or
    not the caller named it, as one answer serves both."""
    try:
        if (env_arch() is None and torch.cuda.is_available()) or implicit_arch()[0] != arch:
            return match   # the GPU's own arch, or another one named: nothing to explain
        why = implicit_arch()[1]
    except ValueError:   # an unknown AUTOSSD_ARCH: refused where it is used, not here
        return match
    return replace(match, reason=f"{match.reason}; {why}")
