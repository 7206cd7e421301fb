"""autossd against its peer (mamba_ssm, when importable) and the floor, for one shape, on the
local GPU. Times are medians of CUDA-event timings (triton.testing.do_bench). The floor uses the
arch's datasheet ceilings; scripts/bench_ssd.py measures the ceilings in the run instead."""
from __future__ import annotations

from .problem import Problem
from .space import Config


class NoGPU(RuntimeError):
    pass


def bench(problem: Problem, config: Config | None = None, arch: str | None = None) -> dict:
    """{'autossd_ms', 'peer_ms' (or None), 'floor_ms', 'config'}; raises NoGPU without a GPU."""
    import torch
    import triton.testing

    from .arch import local_arch
    from .peer import load_mamba_ssm
    from .space import default_config
    from .testing import call_kwargs, make_inputs
    from .tuner.gate import default_run
    from .tuner.model import floor_ms

    arch = arch or local_arch()
    if arch is None or not torch.cuda.is_available():
        raise NoGPU("bench needs a GPU (CUDA or ROCm); none is visible here")
    config = config or default_config(arch, problem)
    t = make_inputs(problem, "cuda")
    backend = "hip" if getattr(torch.version, "hip", None) else "cuda"
    out = {"arch": arch, "device": torch.cuda.get_device_name(0), "config": config.as_dict(),
           "floor_ms": floor_ms(arch, problem)}
    out["autossd_ms"] = triton.testing.do_bench(lambda: default_run(problem, config, t, backend),
                                                return_mode="median")
    peer = load_mamba_ssm()
    out["peer_ms"] = None
    if peer is not None:
        kw = call_kwargs(problem, t)
        out["peer_ms"] = triton.testing.do_bench(
            lambda: peer(t["x"], t["dt"], t["A"], t["B"], t["C"], config.chunk_size, **kw),
            return_mode="median")
    return out
