"""autossd against its peer (mamba_ssm, when importable) and the speed-of-light floor, for one
shape, on the local GPU. Times are medians of CUDA-event timings (triton.testing.do_bench). The
floor uses ceilings measured in the same run: a device-to-device copy (bytes read + written) and
a bf16 matmul; scripts/bench_ssd.py uses the same two functions."""
from __future__ import annotations

import functools

from .problem import Problem
from .ops.ssd.fwd_knobs import Config


class NoGPU(RuntimeError):
    pass


def measure_ceilings() -> dict:
    """{'copy_GBps', 'bf16_matmul_TFLOPs'} measured on the current GPU."""
    import torch
    from triton.testing import do_bench
    n = 1 << 30
    a = torch.empty(n, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    a.random_(0, 255)
    ms = do_bench(lambda: b.copy_(a), warmup=50, rep=300, return_mode="median")
    copy_gbps = 2 * n / ms / 1e6
    m = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    ms = do_bench(lambda: m @ k, warmup=50, rep=300, return_mode="median")
    tflops = 2 * 8192 ** 3 / ms / 1e9
    a = b = m = k = None   # freed before empty_cache (the lambdas above still name them)
    torch.cuda.empty_cache()
    return {"copy_GBps": copy_gbps, "bf16_matmul_TFLOPs": tflops}


# exp2's throughput (the special-function pipe's: MUFU.EX2 on NVIDIA), the compute ceiling of a
# scan whose decays are exponentials one per element-step (Mamba-1's selective scan at d_state 16
# does too little arithmetic besides for a matmul or the copy rate to bound it): EXP2_CHAINS
# independent chains a thread, x <- exp2(-x / 2), which stays in (0, 1]
EXP2_CHAINS = 8


@functools.cache
def exp2_chains_kernel():
    """The Triton kernel measure_exp2_rate times (built on first use: triton is imported lazily
    here): each element walks EXP2_CHAINS chains of STEPS exponentials from x, x + 1/8, ... and
    stores their sum."""
    import triton
    import triton.language as tl

    @triton.jit
    def exp2_chains(x_ptr, out_ptr, STEPS: tl.constexpr, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + offs)
        c0, c1, c2, c3 = x, x + 0.125, x + 0.25, x + 0.375
        c4, c5, c6, c7 = x + 0.5, x + 0.625, x + 0.75, x + 0.875
        for _ in range(STEPS):
            c0, c1, c2, c3 = tl.exp2(c0 * -0.5), tl.exp2(c1 * -0.5), tl.exp2(c2 * -0.5), tl.exp2(c3 * -0.5)
            c4, c5, c6, c7 = tl.exp2(c4 * -0.5), tl.exp2(c5 * -0.5), tl.exp2(c6 * -0.5), tl.exp2(c7 * -0.5)
        tl.store(out_ptr + offs, ((c0 + c1) + (c2 + c3)) + ((c4 + c5) + (c6 + c7)))
    return exp2_chains


def measure_exp2_rate(steps: int = 4096, blocks_per_sm: int = 16, block: int = 256) -> float:
    """fp32 exp2 per second on the current GPU: every SM's threads busy with independent chains."""
    import torch
    from triton.testing import do_bench
    n = torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count * blocks_per_sm * block
    x = torch.rand(n, device="cuda")
    out = torch.empty_like(x)
    kern = exp2_chains_kernel()
    ms = do_bench(lambda: kern[(n // block,)](x, out, STEPS=steps, BLOCK=block), warmup=25, rep=200,
                  return_mode="median")
    return n * steps * EXP2_CHAINS / ms * 1e3


EAGER_BATCH_MS = 2.0  # eager calls are timed in back-to-back batches of about this long
EAGER_MAX_CALLS = 256


def back_to_back_ms(fn, n_sets: int = 1, warmup_ms: int = 25, rep_ms: int = 100) -> float:
    """ms per call of back-to-back eager calls (fn rotates over n_sets input sets), between CUDA events
    around whole batches: when the host enqueues slower than the GPU runs, the GPU waits and the
    host's time is what a batch takes, as it is for an eager caller. (do_bench clears L2 with a
    memset before each call, and the next call's host work hides behind that memset.)"""
    import time

    import torch
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n_sets):
        fn()
    torch.cuda.synchronize()
    est = max((time.perf_counter() - t0) * 1e3 / n_sets, 1e-3)
    calls = n_sets * max(1, min(EAGER_MAX_CALLS // n_sets, -(-EAGER_BATCH_MS // (est * n_sets))))
    calls = int(calls)
    batches = max(5, min(50, int(rep_ms // (est * calls)) + 1))
    start = [torch.cuda.Event(enable_timing=True) for _ in range(batches)]
    end = [torch.cuda.Event(enable_timing=True) for _ in range(batches)]
    for _ in range(max(1, int(warmup_ms // (est * calls)))):
        for _ in range(calls):
            fn()
    for i in range(batches):
        start[i].record()
        for _ in range(calls):
            fn()
        end[i].record()
    torch.cuda.synchronize()
    per = sorted(s.elapsed_time(e) / calls for s, e in zip(start, end))
    return float(per[len(per) // 2])


class ClockLog:
    """Samples the GPU's SM clock, power and throttle reasons (nvidia-smi, every `period_ms`) in a
    thread, so a benchmark can say what clock each of its timings ran at: `mark()` before a timing,
    `window(t0)` after it gives that span's median SM MHz, peak watts and the throttle reasons seen.
    Without nvidia-smi it records nothing and `window` returns {}."""
    FIELDS = "clocks.sm,power.draw,temperature.gpu,clocks_throttle_reasons.active"

    def __init__(self, period_ms: int = 20):
        import shutil
        import subprocess
        import threading
        self.samples: list[tuple[float, float, float, float, str]] = []
        self.proc = None
        if shutil.which("nvidia-smi") is None:
            return
        self.proc = subprocess.Popen(
            ["nvidia-smi", "-i", "0", f"--query-gpu={self.FIELDS}", "--format=csv,noheader,nounits",
             f"-lms={period_ms}"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self):
        import time
        for line in self.proc.stdout:
            s = self.parse(line)
            if s is not None:
                self.samples.append((time.perf_counter(), *s))

    @staticmethod
    def parse(line: str) -> tuple[float, float, float, str] | None:
        """(SM MHz, watts, deg C, throttle bitmask) from one nvidia-smi line; None for anything else
        (a header, '[N/A]', a short line)."""
        try:
            mhz, watts, temp, reasons = (v.strip() for v in line.split(","))
            return float(mhz), float(watts), float(temp), reasons
        except ValueError:
            return None

    @staticmethod
    def mark() -> float:
        import time
        return time.perf_counter()

    def window(self, t0: float) -> dict:
        import time
        t1 = time.perf_counter()
        got = [s for s in self.samples if t0 <= s[0] <= t1]
        if not got:
            return {}
        mhz = sorted(s[1] for s in got)
        return {"sm_mhz_median": mhz[len(mhz) // 2], "sm_mhz_min": mhz[0], "watts_max": max(s[2] for s in got),
                "temp_c_max": max(s[3] for s in got), "throttle": sorted({s[4] for s in got}),
                "samples": len(got)}

    def close(self):
        if self.proc is not None:
            self.proc.terminate()


def peak_mib(fn) -> float:
    """MiB one call of `fn` allocates at its peak above what was allocated before it
    (torch.cuda.max_memory_allocated)."""
    import torch
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    start = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - start) / 2**20


def kernel_times(fn, reps: int = 10, warmup: int = 3) -> dict:
    """GPU time per call of each kernel `fn` launches (torch.profiler): {kernel name: (us per
    call, launches per call)}, for seeing which stage the time goes to."""
    import torch
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    return {e.key: (e.device_time_total / reps, e.count // reps) for e in prof.key_averages()
            if e.device_type == torch.autograd.DeviceType.CUDA and e.device_time_total > 0}


def run_meta(**extra) -> dict:
    """What every GPU result file records about its run: date, device, versions, command."""
    import sys
    import time

    import torch
    import triton
    return {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "device": torch.cuda.get_device_name(),
            "torch": torch.__version__, "triton": triton.__version__, "command": " ".join(sys.argv),
            **extra}


def stage_times(prob, cfg, tensors) -> dict:
    """Each launch of the config timed alone, after one full run has made its inputs. The fused
    kernels' ticket counter and flags are zeroed before each launch (inside the timing: a memset)."""
    from triton.testing import do_bench

    from .ops.ssd import chunk as ssd_chunk
    from .render import load
    mod = load(cfg, "cuda")
    buf = ssd_chunk.allocate(prob, cfg, "cuda")
    launches = ssd_chunk.plan(prob, cfg, tensors, buf)
    ssd_chunk.run(launches, mod)
    out = {}
    for ln in launches:
        k = getattr(mod, ln.kernel)

        def one(ln=ln, k=k):   # a fused launch needs no reset of its ticket words between runs
            k[ln.grid](**ln.args, **ln.constexprs, **ln.options)
        out[ln.stage] = do_bench(one, warmup=10, rep=100, return_mode="median")
    return out


def floor_ms(problem: Problem, ceilings: dict, chunk_size: int = 256) -> float:
    """max(min HBM bytes / copy rate, causal FLOPs / matmul rate)."""
    return max(problem.min_bytes() / ceilings["copy_GBps"] / 1e6,
               problem.flops(chunk_size) / ceilings["bf16_matmul_TFLOPs"] / 1e9)


def bench(problem: Problem, config: Config | None = None, arch: str | None = None,
          ceilings: dict | None = None) -> dict:
    """{'autossd_ms', 'peer_ms' (or None), 'floor_ms', 'ceilings', 'config'}; raises NoGPU without
    a GPU. Pass `ceilings` to measure them once for several shapes."""
    import torch
    import triton.testing

    from .arch import local_arch
    from .peer import load_mamba_ssm
    from .ops.ssd.fwd_knobs import default_config
    from .testing import call_kwargs, make_inputs
    from .tuner.gate import default_run

    arch = arch or local_arch()
    if arch is None or not torch.cuda.is_available():
        raise NoGPU("bench needs a GPU (CUDA or ROCm); none is visible here")
    config = config or default_config(arch, problem)
    t = make_inputs(problem, "cuda")
    backend = "hip" if getattr(torch.version, "hip", None) else "cuda"
    ceilings = ceilings or measure_ceilings()
    out = {"arch": arch, "device": torch.cuda.get_device_name(0), "config": config.as_dict(),
           "ceilings": ceilings, "floor_ms": floor_ms(problem, ceilings, config.chunk_size)}
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
