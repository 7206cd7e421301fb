"""Test-session setup. Without a GPU, kernels run in Triton's CPU interpreter: TRITON_INTERPRET
must be set before triton is first imported (triton.language's own @jit helpers, e.g. tl.sigmoid,
are built at import and cannot be called from an interpreted kernel otherwise)."""
import os
import tempfile

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
