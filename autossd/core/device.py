"""Which arch's records and defaults apply to a device, and how the caller launches."""
from __future__ import annotations

import logging

import torch

from ..arch import ARCHS, CPU_ARCH, env_arch

log = logging.getLogger("autossd")

_device_arch: dict[int, str] = {}


def arch_of_device(device: torch.device | None = None) -> str:
    """The arch whose tuning records apply to a device: the local GPU's (cached per device
    index), CPU_ARCH for the CPU interpreter, or env AUTOSSD_ARCH when set."""
    env = env_arch()   # an unknown name is refused naming the variable
    if env:
        return env
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
