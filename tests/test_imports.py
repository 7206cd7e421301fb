"""`import autossd` and the drop-in's call path stay free of the heavy optional imports: optuna
(the tuner), matplotlib (the plots) and alembic (database migrations). Each case runs in a fresh
interpreter, since the test process itself has imported all of them by now."""
import os
import subprocess
import sys
import textwrap

import torch

HEAVY = "sorted(m for m in ('optuna', 'matplotlib', 'alembic') if m in sys.modules)"


def _run(code: str, tmp_path, **env) -> list[str]:
    """Run `code` in a new interpreter with a private cache dir; return its printed lines."""
    full = {k: v for k, v in os.environ.items() if k != "AUTOSSD_DB"}
    full.update(AUTOSSD_CACHE_DIR=str(tmp_path / "cache"), **env)
    if not torch.cuda.is_available():
        full["TRITON_INTERPRET"] = "1"
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=full, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip().splitlines()


def test_import_autossd_imports_no_tuner_plots_or_migrations(tmp_path):
    assert _run(f"import autossd, sys; print({HEAVY})", tmp_path) == ["[]"]


def test_drop_in_call_path_imports_none_of_them(tmp_path):
    """A lookup that reads the shipped database (an exact record) and a small drop-in call."""
    lines = _run(f"""
        import sys, torch, autossd
        from autossd.db import lookup
        rec = lookup.load_records("sm90", "ssd_fwd")[0]
        k = autossd.get_kernel(rec.problem, "sm90")
        print(k.source, k.provenance)
        g = torch.Generator().manual_seed(0)
        x = torch.randn(1, 130, 2, 16, generator=g)
        dt = torch.rand(1, 130, 2, generator=g) * 0.1
        A = -torch.rand(2, generator=g)
        B, C = (torch.randn(1, 130, 1, 16, generator=g) for _ in range(2))
        y = autossd.mamba_chunk_scan_combined(x, dt, A, B, C, 64, D=torch.ones(2))
        print(bool(torch.isfinite(y).all()))
        print({HEAVY})
        """, tmp_path)
    assert lines[0] == "exact measured" and lines[1] == "True"
    assert lines[-1] == "[]"


def test_lookup_in_a_current_user_db_does_not_import_alembic(tmp_path):
    """Only a database on an older schema needs alembic (to migrate it). The older one is the
    control: it shows the check sees alembic when it is imported."""
    from autossd import Problem, default_config
    from autossd.db import add_records, make_record, migrate, to_url
    from autossd.db.engine import REVISIONS

    p = Problem(1, 130, 2, 16, 16, 1, "fp32", 64)
    current, older = tmp_path / "current.sqlite", tmp_path / "older.sqlite"
    add_records(str(current), [make_record(p, default_config("sm90", p), "sm90", provenance="measured",
                                           time_ms=0.02)])
    migrate(to_url(older), revision=REVISIONS[-2])
    code = f"""
        import sys, autossd
        k = autossd.get_kernel(autossd.Problem(1, 130, 2, 16, 16, 1, "fp32", 64), "sm90")
        print(k.source, k.provenance)
        print({HEAVY})
        """
    assert _run(code, tmp_path, AUTOSSD_DB=str(current)) == ["exact measured", "[]"]
    assert _run(code, tmp_path, AUTOSSD_DB=str(older))[-1] == "['alembic']"
