"""Which arch's records and defaults apply to a device, and how the caller launches."""
from __future__ import annotations

import logging
import os

import torch

from ..arch import ARCHS, get_arch

log = logging.getLogger("autossd")

CPU_ARCH = "sm90"  # what the interpreter emulates when tensors are on the CPU (TRITON_INTERPRET=1)
_device_arch: dict[int, str] = {}


def arch_of_device(device: torch.device | None = None) -> str:
    """The arch whose tuning records apply to a device: the local GPU's (cached per device
    index), CPU_ARCH for the CPU interpreter, or env AUTOSSD_ARCH when set."""
    env = os.environ.get("AUTOSSD_ARCH")
    if env:
        return get_arch(env).name
    if device is None:
        device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    if device.type == "cpu":
        return CPU_ARCH
    idx = device.index if device.index is not None else torch.cuda.current_device()
    arch = _device_arch.get(idx)
    if arch is None:
        arch = _detect(idx)
        _device_arch[idx] = arch
    return arch


def _detect(idx: int) -> str:
    props = torch.cuda.get_device_properties(idx)
    if getattr(torch.version, "hip", None):
        name = props.gcnArchName.split(":")[0]
        if name in ARCHS:
            return name
        log.warning("autossd: GPU arch %s has no tuning; using gfx942's records and defaults", name)
        return "gfx942"
    name = f"sm{props.major}{props.minor}"
    if name in ARCHS:
        return name
    near = "sm90" if props.major >= 9 else "sm80"
    log.warning("autossd: GPU arch %s has no tuning; using %s's records and defaults", name, near)
    return near


def launch_mode_of(x: torch.Tensor) -> str:
    """"graph" while the current CUDA stream captures a graph (the launches will be replayed,
    so only GPU time counts), else "eager"."""
    return "graph" if x.device.type == "cuda" and torch.cuda.is_current_stream_capturing() else "eager"
