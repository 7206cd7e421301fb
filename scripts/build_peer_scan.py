#!/usr/bin/env python
"""Build mamba_ssm's CUDA selective scan (`selective_scan_cuda`), the peer of autossd's Mamba-1
scan, for the local GPU only, from mamba_ssm's source distribution.

mamba_ssm's own build compiles its extensions for every arch from sm_75 to sm_121 (well past ten
minutes); a benchmark needs only this one, for the GPU it runs on. This compiles the extension's
own sources, unchanged, with the flags mamba_ssm's setup.py passes, through torch's JIT extension
loader (nvcc and ninja), for the local compute capability only.

    pip download --no-deps --no-build-isolation --no-binary :all: mamba-ssm==2.3.2.post1 -d peer/
        # (with MAMBA_FORCE_BUILD=TRUE MAMBA_SKIP_CUDA_BUILD=TRUE set, so its metadata builds on a CPU host)
    python scripts/build_peer_scan.py peer/mamba_ssm-2.3.2.post1.tar.gz --out build/peer_scan
    PYTHONPATH=build/peer_scan python scripts/bench_selective_scan.py   # finds `import selective_scan_cuda`

The built module lands in --out as selective_scan_cuda*.so; nothing is installed.
"""
from __future__ import annotations

import argparse
import os
import tarfile
import tempfile
import time
from pathlib import Path

# mamba_ssm's setup.py nvcc flags for its CUDA extensions, less the per-arch -gencode list
NVCC_FLAGS = ["-O3", "-std=c++17", "-U__CUDA_NO_HALF_OPERATORS__", "-U__CUDA_NO_HALF_CONVERSIONS__",
              "-U__CUDA_NO_BFLOAT16_OPERATORS__", "-U__CUDA_NO_BFLOAT16_CONVERSIONS__",
              "-U__CUDA_NO_BFLOAT162_OPERATORS__", "-U__CUDA_NO_BFLOAT162_CONVERSIONS__",
              "--expt-relaxed-constexpr", "--expt-extended-lambda", "--use_fast_math", "-lineinfo"]
SOURCES = ["selective_scan.cpp"] + [f"selective_scan_fwd_{t}.cu" for t in ("fp32", "fp16", "bf16")] + [
    f"selective_scan_bwd_{t}_{k}.cu" for t in ("fp32", "fp16", "bf16") for k in ("real", "complex")]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("sdist", type=Path, help="mamba_ssm's source distribution (.tar.gz)")
    ap.add_argument("--out", type=Path, default=Path("build/peer_scan"), help="where the module is built")
    a = ap.parse_args()
    import torch
    from torch.utils.cpp_extension import load
    if not torch.cuda.is_available():
        raise SystemExit("no GPU: the extension is built for the local GPU's arch")
    major, minor = torch.cuda.get_device_capability()
    a.out.mkdir(parents=True, exist_ok=True)
    src = Path(tempfile.mkdtemp(prefix="peer_scan_"))
    with tarfile.open(a.sdist) as tar:
        members = [m for m in tar.getmembers() if "/csrc/selective_scan/" in m.name]
        if not members:
            raise SystemExit(f"{a.sdist}: holds no csrc/selective_scan/ (not mamba_ssm's source distribution?)")
        tar.extractall(src, members=members, filter="data")
    folder = next(src.glob("*/csrc/selective_scan"))
    os.environ.setdefault("MAX_JOBS", str(os.cpu_count() or 4))
    os.environ["TORCH_CUDA_ARCH_LIST"] = f"{major}.{minor}"
    t0 = time.time()
    mod = load(name="selective_scan_cuda", sources=[str(folder / s) for s in SOURCES],
               extra_cflags=["-O3", "-std=c++17"],
               extra_cuda_cflags=NVCC_FLAGS + [f"-gencode=arch=compute_{major}{minor},code=sm_{major}{minor}"],
               extra_include_paths=[str(folder)], build_directory=str(a.out), verbose=False)
    print(f"built {mod.__file__} for sm_{major}{minor} in {time.time() - t0:.0f} s")


if __name__ == "__main__":
    main()
