"""Static performance model: predicts the forward's time for a config on an arch that is not
present, from the problem, the launch plan and the cross-compile report. It ranks candidates;
its absolute numbers are estimates (the CLI labels them as predictions).

Per stage s (each launch of the op's plan, as its cost model describes it, `Op.cost_model`):

    bytes_s = unique_s + reread_s
        unique_s: DRAM traffic if every tensor the stage touches were read/written once —
                  its inputs (x, B, C, dt, ...) and the intermediates it reads or writes
                  (dt', dA cumsum: fp32; CB: input dtype; chunk states: state_dtype).
        reread_s: the extra reads a tiling causes (a B tile re-read for every headdim tile,
                  CB re-read per head of a group, ...), served mostly from L2, charged at
                  l2_ratio x the HBM bandwidth.
        Strided dt loads in cumsum waste the rest of each 32-byte sector: bytes / sector_eff.
    flops_s = matmul FLOPs of the tiles actually launched (causal tiles only for CB and scan).

    occupancy: resident blocks per SM/CU from the compile report (NVIDIA: blocks per SM;
               AMD: waves per SIMD x 4 SIMDs / waves per block), capped by threads and smem.
    resident warps  w = min(blocks per SM, ceil(G / SMs)) x warps per block
    latency hiding  mem_eff = min(1, w x pipe / w_mem),  pipe = 1 + pipe_gain (num_stages - 1)
                    comp_eff = mma_eff x min(1, w / w_mma),
                    mma_eff = sqrt(min(bm,128)/128 x min(bn,128)/128) x sqrt(min(bk,mma_k)/mma_k)
    wave quantization over the grid G on S SMs/CUs: the busiest SM runs k = ceil(G/S) blocks;
        one SM draws at most 2/S of the bandwidth and exactly 1/S of the matmul rate, so
        t_mem  = bytes/BW  x k x max(S / (2 G), min(G, S) / G) / mem_eff
        t_comp = flops/peak x (k S / G) / comp_eff
    t_s = max(t_mem, t_comp) x stage_scale[s] + t_launch
    state passing is a dependent chain over chunks: t_s >= waves x nchunks x t_dep.
    predicted time = sum over stages of t_s, x exp(sum of the knob terms of the config's values)

BW and peak come from `autossd.arch.ARCHS` (the reference part's datasheet); fp32 inputs run
their dots as FMA (input_precision="ieee"), at peak / fp32_div. The predicted time is the sum
over stages (GPU time only: host overhead, which dominates shapes of <= 2048 tokens, is not
modelled). The constants (`Constants`) are round numbers unless CONSTANTS holds fitted ones for
the arch (scripts/fit_model.py): the model is a ranking heuristic.

Sanity check against the H100 (BENCHMARKS.md, default config, fp16, sm90 compile reports):
mamba2-2.7b 1x131072 predicted 6.0 ms vs 5.67 measured, 4x16384 3.0 vs 2.83; per stage
cumsum 0.041/0.058, bmm 0.046/0.047, chunk_state 1.86/0.95, state_passing 0.42/0.51,
chunk_scan 3.66/4.13 ms (predicted/measured at 1x131072). Fusion depths (second H100 session,
sm90 defaults with compile reports, 2.7b fp16): 1x131072 predicted 6.01 / 6.81 / 10.9 ms for
5 / 3 / 1 launches vs 4.49 / 5.00 / 5.10 measured; 4x16384 3.01 / 3.41 / 5.46 vs 2.23 / 2.52 / 2.63:
the ranking holds, the single launch is over-predicted ~2x (its in-place C·Bᵀ is charged at the
small tiles' matmul efficiency).

Streaming stages (the decode step: StageCost.inflight set) take a bytes-in-flight bound instead
of the warp-count one: achieved bandwidth = min(peak, SMs x resident programs x bytes each loads
at once / t_stream), see _stream_time. On the H200 decode sweeps (sm90 reports) this lifts the
Spearman of the ranking from -0.50..0.44 to 0.68..0.87. It cannot separate the configs it sees
as saturating the bandwidth (within 0.5% of its best, many exactly tied), which differ among
themselves by more than that when measured: its top-1 ran up to 1.04x the best at batch 64, where
the arch default was within 0.1%. A static tune keeps the default unless a config is predicted
2% faster (tuner.study.STATIC_MIN_GAIN); on those sweeps that keeps it in all 12 cases. At
batch 1 the launch cost dominates and every config predicts alike. Its ceiling is the arch's bandwidth
(sm90: the H100's 3.35 TB/s), below the H200's 4.24, which adds to the ties on H200 data.

Register caps (scan_maxnreg, state_maxnreg) are outside what it can rank: a cap raises the
occupancy the compile report shows, but on the H100 a cap of 64 registers made the chunk scan
1.47x slower at twice the resident CTAs (it spills 480 bytes per thread, which
the compile report once missed). Static tunes therefore keep each depth's default cap
(Knob.measured_only, tuner/space.build_space).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from ..arch import Arch, get_arch
from ..compile import CompileReport, StageReport
from ..core.cost import SECTOR, StageCost  # noqa: F401 (the cost types, offered here as ever)
from ..core.cost import cdiv as _cdiv
from ..knobs import BaseConfig as Config
from ..ops.registry import get_op
from ..problem import Problem



@dataclass(frozen=True)
class Constants:
    """The model's constants. The defaults are round numbers (any arch); an arch with measured
    data gets fitted ones in CONSTANTS (scripts/fit_model.py)."""
    l2_ratio: float = 3.0      # L2 (NVIDIA) / Infinity Cache (MI300) bandwidth over HBM, roughly
    w_mem: float = 32.0        # resident warps (waves) per SM/CU that saturate memory latency hiding
    w_mma: float = 8.0         # resident warps that keep the matrix units busy
    t_launch: float = 3e-6     # s per launch: launch + ramp-up + tail of one kernel
    t_dep: float = 0.8e-6      # s per dependent global round trip (state passing, chunk to chunk)
    t_handoff: float = 3.5e-6  # s per chunk of the ordered hand-off: H100, depth 3 state kernel 1.83 ms for 512 chunks
    fp32_div: float = 15.0     # dense fp16 matmul rate over fp32 FMA rate
    # s: one streaming program's memory round trip under load (issue its loads, wait for the data,
    # update, store, make room for the next program). Set from the decode step on an H200: bf16
    # states, 8 headdim rows x 128 dstate on 4 warps: 16 programs per SM (2048 threads / 128) each
    # loading 2 KB, 32 KB per SM, reached 56% of the 4.24 TB/s copy bandwidth, so
    # 132 x 32 KB / 2.37 TB/s = 1.8 us. Only streaming stages (StageCost.inflight) use it.
    t_stream: float = 1.8e-6
    pipe_gain: float = 0.5     # latency hidden per extra pipeline stage, as resident warps
    mma_k: float = 32.0        # k-tile depth that keeps the matrix unit's pipeline full
    # per-stage time factors (stage name -> factor): what the bytes-and-FLOPs view of a stage
    # misses, uniformly over its configs (fitted; 1 where absent)
    stage_scale: tuple[tuple[str, float], ...] = ()
    # learned knob terms (knob, value as text, weight): the predicted time is multiplied by
    # exp(sum of the weights of the values a config has). What the analytic part leaves out
    # (the factored decay, register pressure of a tile shape, what a pipeline depth costs in
    # shared memory) shows as a value's typical effect on the measured time, fitted by ridge
    # regression of log(measured / predicted) across shapes (scripts/fit_model.py)
    knob_terms: tuple[tuple[str, str, float], ...] = ()
    source: str = ""           # where fitted constants came from (device, data, date)

    def scale(self, stage: str) -> float:
        return dict(self.stage_scale).get(stage, 1.0)

    def correction(self, config: Config) -> float:
        if not self.knob_terms:
            return 1.0
        vals = config.as_dict()
        return math.exp(sum(w for k, v, w in self.knob_terms if k in vals and str(vals[k]) == v))

    @classmethod
    def from_dict(cls, d: dict) -> "Constants":
        d = dict(d)
        d["stage_scale"] = tuple((str(s), float(f)) for s, f in d.get("stage_scale", ()))
        d["knob_terms"] = tuple((str(k), str(v), float(w)) for k, v, w in d.get("knob_terms", ()))
        return cls(**d)


DEFAULT_CONSTANTS = Constants()
# Fitted constants per arch, kept as data beside the shipped databases: tuning_db/model_<arch>.json
# (scripts/fit_model.py --out, from scripts/model_quality.py's measurements). An arch without one
# runs the round defaults. Tests and fits may put Constants here directly.
CONSTANTS: dict[str, Constants] = {}


def _fitted(arch: str) -> Constants | None:
    import json

    from ..db.lookup import shipped_dir   # the package's tuning_db, or a source checkout's
    try:
        text = (shipped_dir() / f"model_{arch}.json").read_text()
    except OSError:
        return None
    return Constants.from_dict(json.loads(text)["constants"])


def constants_for(arch: Arch | str) -> Constants:
    """The model's constants for `arch`: CONSTANTS, else the shipped fitted file, else the defaults."""
    name = arch if isinstance(arch, str) else arch.name
    if name not in CONSTANTS:
        CONSTANTS[name] = _fitted(name) or DEFAULT_CONSTANTS
    return CONSTANTS[name]


@dataclass
class StageTime:
    stage: str
    seconds: float
    t_mem: float
    t_comp: float
    occupancy_blocks: float
    waves: int


def _blocks_per_sm(arch: Arch, rep: StageReport) -> float:
    threads = rep.num_warps * arch.warp_size
    by_threads = arch.max_threads_per_sm // threads
    by_smem = arch.smem_per_sm // rep.shared_bytes if rep.shared_bytes else by_threads
    if arch.is_amd:   # the assembler reports waves per SIMD; a CU has 4 SIMDs
        by_regs = int(rep.occupancy * 4 // rep.num_warps) if rep.occupancy else by_threads
    else:
        by_regs = int(rep.occupancy) if rep.occupancy else by_threads
    return float(max(1, min(by_regs, by_threads, by_smem)))


# NVIDIA: resident blocks per SM (sm80, sm90), whatever their threads and registers allow
MAX_BLOCKS_PER_SM = 32


def _stream_time(arch: Arch, problem: Problem, cost: StageCost, rep: StageReport | None,
                 c: Constants) -> StageTime:
    """A streaming stage: each element is touched once with a few FLOPs, so the stage is bound by
    memory, and how much of the bandwidth it gets depends on how many bytes are loading at once.
    By Little's law the bandwidth a set of loads achieves is the bytes they have in flight over
    the round trip: bytes in flight per SM = resident programs x the bytes each loads at once, so

        achieved = min(peak, SMs x resident x inflight / t_stream)

    Resident programs come from the compile report (registers x threads, threads, shared memory,
    at most 32 blocks on NVIDIA), the launch's own cap, and the grid (ceil(G / SMs) at most). The
    warp-count view (w_mem) misses this: a program of many warps with a few elements each keeps
    fewer bytes loading per thread and per SM than one warp holding a larger tile."""
    sms = arch.sm_count
    g = max(1, cost.grid)
    k = _cdiv(g, sms)                                       # programs on the busiest SM
    bps = _blocks_per_sm(arch, rep) if rep else 1.0
    if not arch.is_amd:
        bps = min(bps, MAX_BLOCKS_PER_SM)
    if cost.resident_cap:
        bps = min(bps, cost.resident_cap)
    resident = min(bps, k)
    bw = arch.hbm_gbps * 1e9
    # one SM draws at most 2/S of the bandwidth (as in stage_time); a grid under S SMs uses G of them
    latency_bw = min(g, sms) * min(resident * cost.inflight / c.t_stream, 2 * bw / sms)
    achieved = min(bw, latency_bw)
    t_bytes = cost.unique_bytes / cost.sector_eff / achieved + cost.reread_bytes / (c.l2_ratio * bw)
    # the busiest SM runs k programs where the average is G / S
    t_mem = t_bytes * (k * sms / g if g >= sms else 1.0)
    # elementwise FLOPs on the CUDA cores: the fp32 FMA rate
    t_comp = cost.flops / (arch.matmul_tflops * 1e12 / c.fp32_div)
    t = max(t_mem, t_comp)
    return StageTime(cost.stage, t * c.scale(cost.stage) + c.t_launch, t_mem, t_comp, bps,
                     _cdiv(g, int(bps * sms)))


def stage_time(arch: Arch, problem: Problem, cost: StageCost, rep: StageReport | None,
               constants: Constants | None = None) -> StageTime:
    c = constants or constants_for(arch)
    if cost.inflight:
        return _stream_time(arch, problem, cost, rep, c)
    sms = arch.sm_count
    warps = rep.num_warps if rep else 4
    bps = _blocks_per_sm(arch, rep) if rep else 1.0
    g = max(1, cost.grid)
    k = _cdiv(g, sms)                                       # blocks on the busiest SM
    resident = min(bps, k) * warps
    pipe = 1.0 + c.pipe_gain * (cost.stages - 1)
    mem_eff = min(1.0, resident * pipe / c.w_mem)
    bm, bn, bk = cost.block
    mma_eff = math.sqrt(min(bm, 128) / 128 * min(bn, 128) / 128) * math.sqrt(min(bk, c.mma_k) / c.mma_k)
    comp_eff = max(1e-3, mma_eff * min(1.0, resident / c.w_mma))
    bw = arch.hbm_gbps * 1e9
    peak = arch.matmul_tflops * 1e12 / (c.fp32_div if problem.dtype == "fp32" else 1.0)
    t_bytes = cost.unique_bytes / cost.sector_eff / bw + cost.reread_bytes / (c.l2_ratio * bw)
    t_mem = t_bytes * k * max(sms / (2 * g), min(g, sms) / g) / mem_eff
    t_comp = cost.flops / peak * (k * sms / g) / comp_eff
    t = max(t_mem, t_comp)
    waves = _cdiv(g, int(bps * sms))
    if cost.ordered:   # chunk after chunk across programs; the sequences of a batch overlap
        t = max(t, cost.chain * c.t_handoff)
    elif cost.chain:
        t = max(t, waves * cost.chain * c.t_dep)
    return StageTime(cost.stage, t * c.scale(cost.stage) + c.t_launch, t_mem, t_comp, bps, waves)


def predict(arch: Arch | str, problem: Problem, config: Config,
            report: CompileReport | None = None, constants: Constants | None = None,
            costs: list[StageCost] | None = None) -> tuple[float, list[StageTime]]:
    """Predicted forward time in ms, and the per-stage breakdown. `constants`: the arch's
    (constants_for) unless given; `costs`: the op's cost model of (problem, config) unless given
    (a fit evaluates many constants on the same costs)."""
    arch = get_arch(arch) if isinstance(arch, str) else arch
    reps = {s.stage: s for s in report.stages} if report else {}
    if costs is None:
        costs = get_op(config.op).fn("cost_model")(problem, config)
    k = constants or constants_for(arch)
    times = [stage_time(arch, problem, c, reps.get(c.stage), k) for c in costs]
    return sum(t.seconds for t in times) * 1e3 * k.correction(config), times


def floor_ms(arch: Arch | str, problem: Problem) -> float:
    """Speed of light: max(min HBM bytes / bandwidth, causal FLOPs / matmul rate)."""
    arch = get_arch(arch) if isinstance(arch, str) else arch
    return max(problem.min_bytes() / (arch.hbm_gbps * 1e9),
               problem.flops() / (arch.matmul_tflops * 1e12)) * 1e3


__all__ = ["predict", "floor_ms", "StageCost", "StageTime", "Constants", "CONSTANTS", "constants_for"]
