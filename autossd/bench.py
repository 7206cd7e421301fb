"""autossd against its peer (mamba_ssm, when importable) and the floor, for one shape, on the
local GPU. Times are medians of CUDA-event timings (triton.testing.do_bench)."""
from __future__ import annotations

from .problem import Problem
from .space import Config


class NoGPU(RuntimeError):
    pass


def _peer():
    try:
        from mamba_ssm.ops.triton.ssd_combined import mamba_chunk_scan_combined
    except Exception:  # noqa: BLE001 - absent or broken install: no peer column
        return None
    return mamba_chunk_scan_combined


def bench(problem: Problem, config: Config | None = None, arch: str | None = None) -> dict:
    """{'autossd_ms', 'peer_ms' (or None), 'floor_ms', 'config'}; raises NoGPU without a GPU."""
    import torch
    import triton.testing

    from .arch import local_arch
    from .ops.ssd.chunk import execute
    from .space import default_config
    from .tuner.gate import make_inputs
    from .tuner.model import floor_ms

    arch = arch or local_arch()
    if arch is None or not torch.cuda.is_available():
        raise NoGPU("bench needs a GPU (CUDA or ROCm); none is visible here")
    config = config or default_config(arch, problem)
    t = make_inputs(problem, "cuda")
    backend = "hip" if getattr(torch.version, "hip", None) else "cuda"
    out = {"arch": arch, "device": torch.cuda.get_device_name(0), "config": config.as_dict(),
           "floor_ms": floor_ms(arch, problem)}
    out["autossd_ms"] = triton.testing.do_bench(lambda: execute(problem, config, t, backend=backend),
                                                return_mode="median")
    peer = _peer()
    out["peer_ms"] = None
    if peer is not None:
        kw = dict(D=t["D"], z=t["z"], dt_bias=t["dt_bias"], dt_softplus=problem.dt_softplus)
        out["peer_ms"] = triton.testing.do_bench(
            lambda: peer(t["x"], t["dt"], t["A"], t["B"], t["C"], config.chunk_size, **kw),
            return_mode="median")
    return out
