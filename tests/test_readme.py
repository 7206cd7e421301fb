"""The user guide's code works as written. Every ```python block of README.md and docs/*.md runs
as pasted, alone, in a fresh process on this machine (on a CPU too: a block must switch on
Triton's interpreter itself, so the variable is not set for it here), with a private cache and
user database, and checks its own results with asserts (against autossd's float64 reference).
Every `autossd <command>` the documents (BENCHMARKS.md too) name is a command of the CLI, and every
option written after it is one of that command's; every `python scripts/X.py --option` names a
script that exists and an option of its --help; every file of the repository they name exists."""
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
# documents whose paths and commands are checked (BENCHMARKS.md cites commands but runs none)
CITING = DOCS + [ROOT / "BENCHMARKS.md"]


def _blocks(text: str, lang: str) -> list[str]:
    """The fenced code blocks of one language in a Markdown text."""
    return re.findall(rf"^```{lang}\n(.*?)^```$", text, flags=re.S | re.M)


PY_BLOCKS = [pytest.param(code, id=f"{path.name}-{i}")
             for path in DOCS for i, code in enumerate(_blocks(path.read_text(), "python"))]


def test_the_readme_has_a_python_example():
    assert _blocks((ROOT / "README.md").read_text(), "python"), "README.md: no ```python block found"


@pytest.mark.parametrize("code", PY_BLOCKS)
def test_python_block_runs_as_pasted(code, tmp_path):
    # A block that asserts nothing would pass with wrong numbers: each one checks its results.
    assert re.search(r"^\s*assert ", code, flags=re.M), "a python block of the docs asserts nothing"
    script = tmp_path / "block.py"
    script.write_text(code)
    env = {k: v for k, v in os.environ.items()
           if k not in ("TRITON_INTERPRET", "AUTOSSD_DB", "AUTOSSD_ARCH", "AUTOSSD_CACHE_DIR")}
    env.update(PYTHONPATH=os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep),
               AUTOSSD_CACHE_DIR=str(tmp_path / "cache"), AUTOSSD_DB=str(tmp_path / "user.sqlite"))
    r = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, f"the block failed:\n{code}\n--- stderr ---\n{r.stderr[-4000:]}"
    assert not (tmp_path / "user.sqlite").exists()   # a lookup never creates the user database


def _code(text: str) -> list[str]:
    """The code of a Markdown text: its bash blocks, then its inline code spans (which may wrap
    over lines), each as one line."""
    fenced = re.compile(r"^```\w*\n.*?^```$", flags=re.S | re.M)
    spans = re.findall(r"`([^`]+)`", fenced.sub("", text))
    return _blocks(text, "bash") + [" ".join(s.split()) for s in spans]


def _uses(text: str, command: str) -> list[tuple[str, list[str]]]:
    """(name, options written after it) for every `<command> <name> ...` in the code of a Markdown
    text (`autossd tune ...`, `python scripts/bench_ssd.py ...`). A use ends at a shell separator."""
    uses = []
    for chunk in _code(text):
        for part in re.split(r"&&|\|\||;|\||\n", chunk):
            m = re.search(rf"(?:^|\s){command}\s+([\w./-]+)(.*)", part)
            if m:
                uses.append((m.group(1), re.findall(r"(?<![\w-])(--?[a-z][\w-]*)", m.group(2))))
    return uses


def _cli_uses(text: str) -> list[tuple[str, list[str]]]:
    return [(c, o) for c, o in _uses(text, "autossd") if re.fullmatch(r"[a-z][\w-]*", c)]


@pytest.mark.parametrize("path", CITING, ids=lambda p: p.name)
def test_every_script_option_named_exists(path, script_help):
    """`python scripts/X.py --opt` in the documents: X exists and its --help names --opt (the
    --help of each script run once a session: conftest.script_help)."""
    for script, opts in _uses(path.read_text(), "python"):
        if not script.startswith("scripts/"):
            continue
        assert (ROOT / script).exists(), f"{path.name}: {script} does not exist"
        r = script_help(Path(script).stem) if Path(script).parent == Path("scripts") and script.endswith(".py") \
            else None
        if r is None:   # anything else under scripts/
            env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
            r = subprocess.run([sys.executable, str(ROOT / script), "--help"], capture_output=True, text=True,
                               env=env, timeout=300)
        assert r.returncode == 0, f"{script} --help failed:\n{r.stderr[-2000:]}"
        text = r.stdout
        missing = [o for o in opts if not re.search(rf"(?<![\w-]){re.escape(o)}(?![\w-])", text)]
        assert not missing, f"{path.name}: `python {script}` has no option {missing}"


@pytest.mark.parametrize("path", CITING, ids=lambda p: p.name)
def test_every_cli_command_and_option_named_exists(path):
    from click.testing import CliRunner

    from autossd.cli import main
    uses = _cli_uses(path.read_text())
    if path.name == "README.md":
        assert {c for c, _ in uses} >= {"tune", "show"}   # the quick start's two commands, at least
    for cmd, opts in uses:
        assert cmd in main.commands, f"{path.name}: `autossd {cmd}` is not a command ({sorted(main.commands)})"
        known = {o for p in main.commands[cmd].params for o in (*p.opts, *p.secondary_opts)}
        known |= {"-h", "--help"}
        missing = [o for o in opts if o not in known]
        assert not missing, f"{path.name}: `autossd {cmd}` has no option {missing}"
    for cmd in sorted({c for c, _ in uses}):
        r = CliRunner().invoke(main, [cmd, "--help"])
        assert r.exit_code == 0 and "Usage:" in r.output, (cmd, r.output)


# a path of the repository, not one with a placeholder in it (`tuning_db/model_<arch>.json`)
REPO_PATH = re.compile(r"(?<![\w./-])((?:scripts|examples|docs|autossd|tests|templates|tuning_db)/[\w./-]*\w)(?![<\w])")


@pytest.mark.parametrize("path", CITING, ids=lambda p: p.name)
def test_every_repository_path_named_exists(path):
    text = path.read_text()
    named = set(REPO_PATH.findall(text))
    missing = sorted(p for p in named if not (ROOT / p).exists())
    assert not missing, f"{path.name} names files that do not exist: {missing}"
    assert "experiments/" not in text, f"{path.name} points to experiments/, which is gone"
