"""autossd.bench's pieces that need no GPU: the floor, the clock log, the exp2 rate's kernel."""
import time

import torch

from autossd.bench import EXP2_CHAINS, ClockLog, exp2_chains_kernel, floor_ms
from autossd.problem import Problem


def test_clock_log_parses_samples_and_skips_other_lines():
    assert ClockLog.parse("1980, 512.33, 61, 0x0000000000000000\n") == (1980.0, 512.33, 61.0, "0x0000000000000000")
    assert ClockLog.parse("clocks.current.sm [MHz], power.draw [W], temperature.gpu, x") is None
    assert ClockLog.parse("[N/A], 300, 50, 0x0") is None
    assert ClockLog.parse("1980, 500") is None


def test_clock_log_window_summarises_only_its_span():
    log = ClockLog.__new__(ClockLog)   # no nvidia-smi here: feed samples by hand
    t0 = time.perf_counter()
    log.samples = [(t0 - 1.0, 1000.0, 100.0, 40.0, "0x0"),      # before the window: left out
                   (t0 + 1e-6, 1980.0, 600.0, 60.0, "0x0"),
                   (t0 + 2e-6, 1700.0, 690.0, 65.0, "0x4"),
                   (t0 + 3e-6, 1755.0, 650.0, 63.0, "0x4")]
    while time.perf_counter() < t0 + 1e-5:
        pass
    w = log.window(t0)
    assert w == {"sm_mhz_median": 1755.0, "sm_mhz_min": 1700.0, "watts_max": 690.0, "temp_c_max": 65.0,
                 "throttle": ["0x0", "0x4"], "samples": 3}
    assert log.window(time.perf_counter() + 10) == {}


def test_floor_is_the_larger_of_bytes_and_flops():
    p = Problem(batch=1, seqlen=2048, nheads=80, headdim=64, dstate=128, ngroups=1, dtype="fp16", chunk_size=256)
    by_bytes = floor_ms(p, {"copy_GBps": 1.0, "bf16_matmul_TFLOPs": 1e9})
    by_flops = floor_ms(p, {"copy_GBps": 1e9, "bf16_matmul_TFLOPs": 1.0})
    assert by_bytes == p.min_bytes() / 1e6 and by_flops == p.flops(256) / 1e9
    assert floor_ms(p, {"copy_GBps": 1.0, "bf16_matmul_TFLOPs": 1.0}) == max(by_bytes, by_flops)


def test_the_exp2_rate_kernel_walks_every_chain_it_counts():
    """measure_exp2_rate's kernel (in the interpreter without a GPU): each element's EXP2_CHAINS
    chains of x <- exp2(-x / 2), summed, as float64 walks them."""
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    x = torch.rand(64, device=dev)
    out = torch.full_like(x, float("nan"))
    exp2_chains_kernel()[(2,)](x, out, STEPS=5, BLOCK=32)
    want = torch.zeros(64, dtype=torch.float64)
    for k in range(EXP2_CHAINS):
        c = x.double().cpu() + k / 8
        for _ in range(5):
            c = torch.exp2(-c / 2)
        want += c
    assert torch.allclose(out.double().cpu(), want, rtol=1e-5)
