"""Target architectures: the limits the tuner prunes with and the compile targets.

Numbers are per block / per SM as documented by the vendors; they bound what a config may use.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Arch:
    name: str
    backend: str          # "cuda" or "hip": triton's GPUTarget backend
    target_arch: object   # GPUTarget.arch: 80 / 90 / "gfx90a" / "gfx942"
    warp_size: int
    smem_per_block: int   # bytes a block may use (opt-in maximum)
    smem_per_sm: int
    regs_per_sm: int      # 32-bit registers per SM (NVIDIA) / VGPRs per SIMD lane budget (AMD)
    max_threads_per_sm: int
    sm_count: int         # of the reference part, for wave quantization in the model
    hbm_gbps: float       # datasheet bandwidth of the reference part, for the static model
    matmul_tflops: float  # dense fp16/bf16 rate of the reference part, for the static model

    @property
    def is_amd(self) -> bool:
        return self.backend == "hip"

    def gpu_target(self):
        from triton.backends.compiler import GPUTarget
        return GPUTarget(self.backend, self.target_arch, self.warp_size)


ARCHS: dict[str, Arch] = {
    "sm80": Arch("sm80", "cuda", 80, 32, 163 * 1024, 164 * 1024, 65536, 2048, 108, 2039.0, 312.0),
    "sm90": Arch("sm90", "cuda", 90, 32, 227 * 1024, 228 * 1024, 65536, 2048, 132, 3350.0, 989.0),
    "gfx90a": Arch("gfx90a", "hip", "gfx90a", 64, 64 * 1024, 64 * 1024, 512, 2048, 104, 1638.0, 181.0),
    "gfx942": Arch("gfx942", "hip", "gfx942", 64, 64 * 1024, 64 * 1024, 512, 2048, 304, 5300.0, 1307.0),
}


def get_arch(name: str) -> Arch:
    try:
        return ARCHS[name]
    except KeyError:
        raise ValueError(f"arch: unknown architecture {name!r}; expected one of {sorted(ARCHS)}") from None


def local_arch() -> str | None:
    """The arch of the local GPU (torch's current device), or None without one."""
    try:
        import torch
    except ImportError:  # pragma: no cover
        return None
    if not torch.cuda.is_available():
        return None
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    if getattr(torch.version, "hip", None):
        gcn = props.gcnArchName.split(":")[0]
        return gcn if gcn in ARCHS else None
    cc = f"sm{props.major}{props.minor}"
    return cc if cc in ARCHS else None
