"""A non-editable install ships the migrations and the per-arch database inside the package, and
the installed package finds and uses them (away from the source checkout)."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_non_editable_install_finds_shipped_db_and_migrations(tmp_path):
    src = tmp_path / "src"   # build from a copy: no build/ or egg-info in the shared tree
    shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns(".venv", ".git", "__pycache__", "build",
                                                            "*.egg-info", "results", ".whl", ".peer"))
    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--no-build-isolation", "-q",
                    "--target", str(target), str(src)], check=True, capture_output=True)
    for rel in ("autossd/templates/ssd_fwd/module.py.jinja", "autossd/templates/ssd/chunk_scan.jinja",
                "autossd/tuning_db/sm90.sqlite", "autossd/tuning_db/sm80.sqlite",
                "autossd/tuning_db/gfx90a.sqlite", "autossd/tuning_db/gfx942.sqlite",
                "autossd/db/migrations/env.py",
                "autossd/db/migrations/versions/0001_initial.py",
                "autossd/db/migrations/versions/0002_derived_figures.py"):
        assert (target / rel).is_file(), rel
    code = textwrap.dedent(f"""
        import autossd, autossd.db as db
        from autossd.db import engine, lookup
        assert autossd.__file__.startswith({str(target)!r}), autossd.__file__
        assert str(lookup.shipped_db_path("sm90")).startswith({str(target)!r})
        assert str(engine.MIGRATIONS_DIR).startswith({str(target)!r})
        assert db.migrate(db.to_url({str(tmp_path / "fresh.sqlite")!r})) == db.HEAD
        shipped = [r for r in db.load_records("sm90", "ssd_fwd") if r.origin == "shipped"]
        k = autossd.get_kernel(shipped[0].problem, "sm90")
        assert k.source == "exact" and k.record.origin == "shipped", k.reason
        for arch in ("sm80", "gfx90a", "gfx942"):   # the static grid databases, read from the install
            assert str(lookup.shipped_db_path(arch)).startswith({str(target)!r})
            rec = [r for r in db.load_records(arch, "ssd_fwd") if r.origin == "shipped"][0]
            k = autossd.get_kernel(rec.problem, arch)
            assert k.source == "exact" and k.record.provenance == "static", k.reason
        from autossd import render
        assert str(render.templates_dir()).startswith({str(target)!r}), render.templates_dir()
        assert "def ssd_chunk_scan" in render.render(autossd.Config())
        print("OK", len(shipped))
    """)
    env = {**os.environ, "PYTHONPATH": str(target), "AUTOSSD_CACHE_DIR": str(tmp_path / "cache")}
    env.pop("AUTOSSD_DB", None)
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.startswith("OK")
