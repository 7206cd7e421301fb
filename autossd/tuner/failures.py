"""Why candidates failed, by cause, and where the full texts go.

A runner's failure text can be a compiler's whole MLIR dump ending in "PassManager::run failed",
a one-line shared-memory verdict, a gate's error figures, or a dead worker's exit code. The
tune summary prints one line per cause (`classify`); the full texts go to a log file per study
(`append`, `log_path`) that the summary names, and the compile workers' own stderr (where
MLIR/LLVM print their dumps) goes to `compiler_log()` rather than to the console.
"""
from __future__ import annotations

import datetime as _dt
import os
import re
from pathlib import Path

# (cause, pattern), tried in order: the first that matches a text names its cause. A compiler
# crash comes before the resource causes because its dump may mention shared memory anywhere;
# resource errors come before the gate, which reports a candidate's exception as its verdict.
CAUSES = (
    ("timeout", re.compile(r"timed out|^hang:|no result within", re.M)),
    ("compiler crash", re.compile(r"PassManager::run failed|LLVM ERROR|compile crashed|compile error|"
                                  r"CompilationError|BrokenProcessPool|Segmentation fault|core dumped")),
    ("out of shared memory", re.compile(r"shared memory \d+ B exceeds|out of resource: shared memory|"
                                        r"OutOfResources: .*shared")),
    ("registers / spills", re.compile(r"occupancy 0|out of resource: (?:registers|threads)|spill")),
    ("correctness gate failed", re.compile(r"^gate:", re.M)),
    ("runtime error", re.compile(r"^(?:\w+ )?timing:|^crash:|evaluation process died|illegal|"
                                 r"CUDA error|HIP error", re.M)),
    ("refused by the config checks", re.compile(r"is not offered on|exceeds chunk_size|must cover|needs ")),
)
OTHER = "other"


def classify(text: str) -> str:
    """The cause of one failure text (a CAUSES name, or OTHER)."""
    for cause, pat in CAUSES:
        if pat.search(text):
            return cause
    return OTHER


def reason_line(text: str, cause: str | None = None, width: int = 160) -> str:
    """One line that says why: the last line where the cause's pattern matches (a dump's
    verdict comes after its IR), else the text's first non-empty line."""
    pat = dict(CAUSES).get(cause or classify(text))
    m = None
    for m in (pat.finditer(text) if pat is not None else ()):
        pass
    if m is not None:
        start = text.rfind("\n", 0, m.start()) + 1
        end = text.find("\n", m.start())
        line = text[start:end if end >= 0 else len(text)]
    else:
        line = next((ln for ln in text.splitlines() if ln.strip()), "")
    line = line.strip()
    return line if len(line) <= width else line[:width - 3] + "..."


def log_dir() -> Path:
    """Where failure logs go: the data directory the studies' journal lives in by default."""
    env = os.environ.get("AUTOSSD_DATA_DIR")
    if env:
        return Path(env) / "logs"
    import platformdirs
    return Path(platformdirs.user_data_dir("autossd")) / "logs"


def log_path(study_name: str) -> Path:
    return log_dir() / (re.sub(r"[^A-Za-z0-9._-]+", "_", study_name) + ".failures.log")


def compiler_log() -> Path:
    """What the compile workers print (MLIR/LLVM dumps, warnings)."""
    return log_dir() / "compiler-output.log"


def append(study_name: str, config: dict, text: str) -> Path | None:
    """Add one failure's full text to its study's log; the path, or None when it cannot be
    written (a failure log is no reason to stop a tune)."""
    path = log_path(study_name)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "a") as f:
            f.write(f"=== {_dt.datetime.now().isoformat(timespec='seconds')} [{classify(text)}] "
                    f"config {config}\n{text.rstrip()}\n\n")
    except OSError:
        return None
    return path


def summary(failures: list[tuple[str, str]]) -> list[tuple[str, int, str]]:
    """(cause, count, one-line reason of its first failure) per cause, most frequent first, from
    (cause, text) pairs."""
    count: dict[str, int] = {}
    example: dict[str, str] = {}
    for cause, text in failures:
        count[cause] = count.get(cause, 0) + 1
        example.setdefault(cause, reason_line(text, cause))
    return [(c, n, example[c]) for c, n in sorted(count.items(), key=lambda kv: -kv[1])]
