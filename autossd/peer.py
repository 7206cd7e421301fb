"""Optional benchmark/test peer: mamba_ssm's Triton SSD (never a dependency, never copied).

mamba_ssm's package __init__ imports CUDA extensions; its Triton path does not need them, so we
import `mamba_ssm.ops.triton.ssd_combined` with the package's __init__ bypassed.
"""
from __future__ import annotations

import importlib
import importlib.util
import sys
import types


def load_mamba_ssm(module: str = "ssd_combined", name: str = "mamba_chunk_scan_combined"):
    """A function of mamba_ssm's Triton path (`mamba_ssm.ops.triton.<module>.<name>`; by default
    `mamba_chunk_scan_combined`), or None when mamba_ssm is not installed."""
    spec = importlib.util.find_spec("mamba_ssm") if "mamba_ssm" not in sys.modules else None
    if "mamba_ssm" not in sys.modules:
        if spec is None or not spec.submodule_search_locations:
            return None
        pkg = types.ModuleType("mamba_ssm")
        pkg.__path__ = list(spec.submodule_search_locations)
        sys.modules["mamba_ssm"] = pkg
    try:
        mod = importlib.import_module(f"mamba_ssm.ops.triton.{module}")
    except ImportError:
        return None
    return getattr(mod, name)
