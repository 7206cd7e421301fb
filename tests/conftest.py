"""Test-session setup. Without a GPU, kernels run in Triton's CPU interpreter: TRITON_INTERPRET
must be set before triton is first imported (triton.language's own @jit helpers, e.g. tl.sigmoid,
are built at import and cannot be called from an interpreted kernel otherwise)."""
import json
import os
import subprocess
import sys
import tempfile
import types
from pathlib import Path

import pytest
import torch

# Tests never read or write the user's tuning database or kernel cache (the README's main job
# fills those on the same machine CI runs on): one private cache per test process.
os.environ["AUTOSSD_CACHE_DIR"] = tempfile.mkdtemp(prefix="autossd-tests-")
os.environ.pop("AUTOSSD_DB", None)

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture
def isolated_db(tmp_path, monkeypatch):
    """A fresh user tuning DB for one test, with the lookup's caches and engines reset."""
    from autossd.db import engine, lookup
    monkeypatch.setenv("AUTOSSD_DB", str(tmp_path / "user.sqlite"))
    lookup.clear_cache()
    yield tmp_path / "user.sqlite"
    lookup.clear_cache()
    engine.dispose_engines()


@pytest.fixture
def no_shipped_db(monkeypatch):
    """Lookups that see no shipped database: a test's expectation must not hang on which shapes
    the shipped one happens to hold."""
    from autossd.db import lookup
    monkeypatch.setattr(lookup, "shipped_db_path", lambda arch: None)
    lookup.clear_cache()
    yield
    lookup.clear_cache()


@pytest.fixture(autouse=True)
def _no_eval_worker_outlives_its_test():
    """The tuner keeps its evaluation subprocess across the shapes of a tune; a test's (spawned
    with that test's environment) ends with the test."""
    yield
    import sys
    measured = sys.modules.get("autossd.tuner.runners.measured")
    if measured is not None:
        measured.close_eval_workers()


@pytest.fixture(scope="session")
def script_help(tmp_path_factory):
    """script_help(name): `python scripts/<name>.py --help` run in a fresh process (without
    TRITON_INTERPRET: several scripts cross-compile at import), as (returncode, stdout, stderr);
    run once a test session, its answer kept in a file that the xdist workers of the session share
    (test_scripts_smoke checks each script's --help, test_readme the options the documents name)."""
    base = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        base = base.parent   # the session's, above each worker's own
    shared = base / "script-help"
    shared.mkdir(exist_ok=True)
    scripts = Path(__file__).resolve().parent.parent / "scripts"

    def run(name: str) -> types.SimpleNamespace:
        env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "AUTOSSD_DB")}
        r = subprocess.run([sys.executable, str(scripts / f"{name}.py"), "--help"], capture_output=True,
                           text=True, env=env, timeout=300)
        return types.SimpleNamespace(returncode=r.returncode, stdout=r.stdout, stderr=r.stderr)

    def get(name: str) -> types.SimpleNamespace:
        try:
            import fcntl
        except ImportError:   # no POSIX locks: each asker runs its own
            return run(name)
        out = shared / f"{name}.json"
        with open(shared / f"{name}.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)   # one process runs it, the others wait for its answer
            if not out.exists():
                tmp = shared / f"{name}.json.part"
                tmp.write_text(json.dumps(vars(run(name))))
                tmp.replace(out)
        return types.SimpleNamespace(**json.loads(out.read_text()))
    return get
