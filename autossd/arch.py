"""Target architectures: the limits the tuner prunes with and the compile targets.

Numbers are per block / per SM as documented by the vendors; they bound what a config may use.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from functools import cached_property


@dataclass(frozen=True)
class Arch:
    """One target: its compile target, its limits and its capabilities. Knobs and templates test
    capabilities (`has`), never names, so adding an arch is one entry here plus what it truly
    needs (a default config, a device name for the static model)."""
    name: str
    backend: str          # "cuda" or "hip": triton's GPUTarget backend
    target_arch: object   # GPUTarget.arch: 80 / 90 / "gfx90a" / "gfx942"
    warp_size: int        # threads per warp (NVIDIA) / wavefront (AMD)
    smem_per_block: int   # bytes of shared memory (LDS on AMD) a block may use (opt-in maximum)
    smem_per_sm: int
    regs_per_sm: int      # 32-bit registers per SM (NVIDIA) / VGPRs per SIMD lane budget (AMD)
    max_threads_per_sm: int
    sm_count: int         # of the reference part, for wave quantization in the model
    hbm_gbps: float       # datasheet bandwidth of the reference part, for the static model
    matmul_tflops: float  # dense fp16/bf16 rate of the reference part, for the static model
    reference_part: str = ""   # the GPU whose datasheet figures these are (names static records' device)
    # capabilities (what a knob or a template may need):
    tma: bool = False     # bulk tensor copies (TMA descriptors): the Gluon data paths
    wgmma: bool = False   # warpgroup MMA: the Gluon data paths
    pdl: bool = False     # programmatic dependent launch (griddepcontrol)
    mfma: bool = False    # AMD matrix cores (the MFMA knobs)
    maxnreg: bool = False  # a per-kernel register cap the compiler honours (ptxas -maxnreg)
    # Triton 3.6's wgmma lowering miscompiles the single launch with state tiles under 64 rows
    wgmma_fused_tile_bug: bool = False
    # whether autossd's kernels have been run and validated on this arch's hardware; where not,
    # a tune offers only configs whose correctness rests on nothing particular to the arch
    # (Op.unvalidated names the rest) unless the user opts in
    hardware_validated: bool = False

    @property
    def is_amd(self) -> bool:
        return self.backend == "hip"

    @cached_property   # asked for each knob of each record a lookup reads
    def capabilities(self) -> frozenset[str]:
        """The capability names `has` accepts: the backend ("cuda" or "hip") and each flag set."""
        flags = ("tma", "wgmma", "pdl", "mfma", "maxnreg")
        return frozenset((self.backend, *(f for f in flags if getattr(self, f))))

    def has(self, *needs: str) -> bool:
        caps = self.capabilities
        return all(n in caps for n in needs)

    def gpu_target(self):
        from triton.backends.compiler import GPUTarget
        return GPUTarget(self.backend, self.target_arch, self.warp_size)


ARCHS: dict[str, Arch] = {
    "sm80": Arch("sm80", "cuda", 80, 32, 163 * 1024, 164 * 1024, 65536, 2048, 108, 2039.0, 312.0, "A100",
                 maxnreg=True),
    "sm90": Arch("sm90", "cuda", 90, 32, 227 * 1024, 228 * 1024, 65536, 2048, 132, 3350.0, 989.0, "H100",
                 tma=True, wgmma=True, pdl=True, maxnreg=True, wgmma_fused_tile_bug=True,
                 hardware_validated=True),
    "gfx90a": Arch("gfx90a", "hip", "gfx90a", 64, 64 * 1024, 64 * 1024, 512, 2048, 104, 1638.0, 181.0, "MI250X",
                   mfma=True),
    "gfx942": Arch("gfx942", "hip", "gfx942", 64, 64 * 1024, 64 * 1024, 512, 2048, 304, 5300.0, 1307.0, "MI300X",
                   mfma=True),
}


def get_arch(name: str) -> Arch:
    try:
        return ARCHS[name]
    except KeyError:
        raise ValueError(f"arch: unknown architecture {name!r}; expected one of {sorted(ARCHS)}") from None


# the arch a machine without a GPU runs as: the CPU interpreter runs the kernels as rendered for
# it, so its records are the ones whose configs run there as tuned
CPU_ARCH = "sm90"


def env_arch() -> str | None:
    """The arch env AUTOSSD_ARCH names, or None when it is unset or empty. An unknown name is
    refused with the variable's name (a ValueError from deep inside a call would not say where
    the name came from)."""
    name = os.environ.get("AUTOSSD_ARCH")
    if not name:
        return None
    if name not in ARCHS:
        raise ValueError(f"AUTOSSD_ARCH={name!r}: unknown architecture; expected one of {sorted(ARCHS)} "
                         "(or unset it, to use the GPU's own)")
    return name


def implicit_arch(gpu_arch: str | None = None) -> tuple[str, str]:
    """(arch, why): the arch whose records and kernels the runtime uses when a caller names none,
    and why, in words: AUTOSSD_ARCH when set, else the GPU's (`gpu_arch`), else, on a machine
    without a GPU, CPU_ARCH. get_kernel's reason and `autossd doctor` both say it from here."""
    env = env_arch()
    if env:
        return env, f"{env}'s records (AUTOSSD_ARCH)"
    if gpu_arch:
        return gpu_arch, f"{gpu_arch}'s records (this GPU's arch)"
    return CPU_ARCH, (f"{CPU_ARCH}'s records (no GPU: the CPU interpreter runs the kernels as built for "
                      f"{CPU_ARCH}; AUTOSSD_ARCH picks another arch)")


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
