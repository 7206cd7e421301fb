"""The SSD forward's knobs, declared once, and the rules that tie them to an arch and a problem.

From these declarations flow the typed `Config` (validation), the template variables (the
renderer passes `Config.as_dict()`), the tuner's Optuna space, the constraints and the tuning
database's config JSON (validated against this space on read). The mode knob is `launches`,
the fusion depth.
"""
from __future__ import annotations

from ...arch import Arch, get_arch
from ...knobs import BaseConfig, ConfigError, Knob, KnobSpace, pow2_at_least, shrink, take  # noqa: F401 (ConfigError: re-exported)
from .stage_knobs import (BMM, CHUNK, CHUNK_SCAN, CHUNK_STATE, CUMSUM, GLUON_SCAN, GLUON_WALK, STATE_PASSING,
                          gluon_problem_violations, gluon_scan_tile_violations)


KNOBS: tuple[Knob, ...] = (
    # 5: cumsum | bmm | chunk state | state passing | chunk scan;
    # 3: bmm | cumsum + chunk state + ordered state passing | chunk scan;
    # 1: everything in one launch, state passing ordered across programs (see fused.jinja)
    Knob("launches", (5, 3, 1), 5, "fusion depth: number of kernel launches for the forward"),
    *take(CHUNK),
    *take(CUMSUM, depths=(5,)),
    *take(BMM, depths=(5, 3)),
    # the state tiles shape every depth's chunk state; its launch options only the depths
    # that launch it alone
    *take(CHUNK_STATE, depths={"state_warps": (5, 3), "state_stages": (5, 3), "state_maxnreg": (5, 3)}),
    # >0: the Gluon chunk-state kernel, its x and B tiles staged in shared memory with this many
    # elements of padding per row (tl cannot choose a shared layout); 0: the tl kernel.
    Knob("smem_pad", (0, 2, 4, 8), 0, "shared-memory pad per row (elements), 0 = compiler's layout",
         "chunk_state", depths=(5,)),
    # 1: the cumsum and C·Bᵀ run inside the chunk-state launch (five launches become three).
    # Each state program computes its own chunk's cumsum; the C·Bᵀ tiles are extra programs of
    # the same grid. At small shapes each launch is a few µs of ramp and one load chain; the
    # folded cumsum lengthens every chunk-state program, which costs at larger shapes. (Folding
    # C·Bᵀ alone, cumsum kept, lost at every shape measured on the H100.)
    # 2: the cumsum and C·Bᵀ in one launch of their own (prep.jinja): four launches, or three
    # with state_walk, which needs the chunk-state launch left as it is.
    Knob("fold_prep", (0, 1, 2), 0,
         "1: cumsum and C·Bᵀ inside the chunk-state launch (3 launches instead of 5); "
         "2: cumsum and C·Bᵀ in one launch (4 instead of 5)",
         "chunk_state", depths=(5,), measured_only=True),
    *take(GLUON_WALK, only=("state_walk",), depths=(5,)),
    # 1: the walk reads each token's weight in its chunk's state, exp(dA_last - dA_t) dt'_t, which
    # the cumsum (or prep) launch writes beside dt and dA, instead of computing it from them: the
    # walk runs one program per state tile through every chunk in order, and the exponentials
    # and loads it drops sat in that serial chain (−13% / −10% walk time fp16 / bf16 at 2.7b
    # 1x131072 in a probe on the H100). 4 bytes per token and head more traffic.
    # measured_only: the static model cannot rank a data path.
    Knob("walk_weights", (0, 1), 0, "1: the Gluon walk reads per-token weights the cumsum wrote (sm90)",
         "chunk_state", depths=(5,), measured_only=True, needs=("tma", "wgmma")),
    # >1: the walk's sequence is cut into this many segments of whole chunks, one program per
    # (state tile, head, segment, batch), each from a zero state: at batch 1 the walk is one
    # latency-bound chain per head (1024 blocks at 131072 tokens, ~1 us each) on 80 of 132 SMs
    # (2.7b), 24 at 130m (ncu: one warp per scheduler, issue slots 15% busy). Each segment stores its
    # chunks' entering states as if it
    # began the sequence, the decay from its start to each chunk, and its final state; a small
    # join launch chains the segments' finals into each segment's true entering state S_k (and
    # the final states); the Gluon chunk scan adds decay * S_k to the state tile it loads. Needs
    # the walk and the chunk-walking Gluon scan (2 or 3), at pdl = 0. measured_only: a data path.
    Knob("walk_split", (1, 2, 3, 4, 6, 8, 11, 16), 1, "segments each sequence's Gluon walk is cut into (sm90)",
         "chunk_state", depths=(5,), measured_only=True, needs=("tma", "wgmma")),
    *take(GLUON_WALK, only=("walk_block",), depths=(5,)),
    *take(STATE_PASSING, depths=(5,)),
    # the state passing's chain waits on each chunk's load with only the next chunk's in flight
    # (2.1x its bytes' time at the copy rate at 130m 1x131072 on the H100); a deeper cp.async ring keeps more
    # bytes in flight per SM. 1: the prefetch of one chunk in registers, as before
    # measured_only: the static model cannot rank a load pipeline's depth against a latency chain
    Knob("pass_stages", (1, 2, 3, 4, 6), 1, "chunks in the state passing's load pipeline (tl.range num_stages)",
         "state_passing", depths=(5,), measured_only=True),
    *take(CHUNK_SCAN, depths={"scan_block_n": (5, 3), "scan_block_d": (5, 3)},
         docs={"scan_maxnreg": "register cap per thread, 0 = compiler's choice (at launches=1: the fused kernel's)"}),
    *take(GLUON_SCAN, depths=(5, 3)),
    # 1: programmatic dependent launch. Every launch of the forward may start while the one before
    # it drains: each kernel first waits for its predecessor (griddepcontrol.wait, before any
    # memory access), then lets its successor launch (griddepcontrol.launch_dependents), so
    # a launch's ramp overlaps its predecessor's tail. Worth a few µs at the small shapes, where
    # three to five launches take ~60 µs on the H100. sm90 only (the instructions);
    # depth 5 only: the fused depths order their programs by tickets in global memory.
    # measured_only: launch overlap is invisible to the static model.
    # 2: as 1, and the Gluon chunk scan does its intra-chunk part before its wait, beside its
    # predecessor (the walk leaves most SMs idle at batch 1); needs scan_gluon (measured the slowest pdl
    # mode at every shape on the H100).
    # 3: as 2, and the scan follows the walk chunk by chunk: each chunk's state is read once the
    # walk's flag publishes it, so the scan runs beside the whole walk; needs the walk too (4-6 µs
    # faster at 2.7b 1x2048 on the H100).
    Knob("pdl", (0, 1, 2, 3), 0, "1: programmatic dependent launch between the forward's kernels (sm90); "
         "2: and the Gluon chunk scan's intra-chunk part before its wait; 3: and the scan follows the "
         "walk chunk by chunk",
         depths=(5,), measured_only=True, needs=("pdl",)),
    # AMD-only compiler knobs (HIPOptions); on NVIDIA they are pinned to their defaults.
    Knob("waves_per_eu", (0, 1, 2, 3, 4), 0, "occupancy hint, 0 = compiler's choice",
         needs=("hip",)),
    Knob("matrix_instr_nonkdim", (0, 16, 32), 0, "MFMA instruction M/N size, 0 = compiler's choice",
         needs=("mfma",)),
    Knob("kpack", (1, 2), 1, "MFMA k-packing", needs=("mfma",)),
)
SPACE = KnobSpace("ssd_fwd", KNOBS, mode_knob="launches")
KNOB_BY_NAME: dict[str, Knob] = SPACE.by_name
STATE_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


class Config(BaseConfig):
    """A validated SSD-forward config: every knob of `KNOBS`, each from its declared set."""
    space = SPACE
    __slots__ = ()


# the tiles along a chunk's tokens: none may exceed the chunk
_CHUNK_TILES = ("bmm_block_m", "bmm_block_n", "state_block_k", "scan_block_m", "scan_block_k")


def caps(problem) -> dict[str, int]:
    """Largest useful tile per knob for a problem: a tile beyond the padded dimension is waste."""
    p = max(16, pow2_at_least(problem.headdim))
    n = max(16, pow2_at_least(problem.dstate))
    return {"bmm_block_k": n, "state_block_m": p, "state_block_n": n,
            "scan_block_n": p, "scan_block_d": n,
            "cumsum_block_h": pow2_at_least(problem.nheads),
            "pass_block": max(64, pow2_at_least(problem.headdim * problem.dstate))}


def violations(config: Config, arch: Arch | str, problem=None) -> list[str]:
    """Reasons a config cannot run on an arch (and problem); empty when it is feasible.
    Cheap checks only: the compile report catches what these miss (registers, exact smem)."""
    arch = get_arch(arch) if isinstance(arch, str) else arch
    why = SPACE.arch_violations(config, arch)
    q = config.chunk_size
    for name in _CHUNK_TILES:
        if config[name] > q:
            why.append(f"{name}={config[name]} exceeds chunk_size={q}")
    if config.launches == 1 and problem is not None and config.state_block_n < caps(problem)["state_block_n"]:
        # the single launch keeps a program's whole state row in registers for the scan
        why.append(f"state_block_n={config.state_block_n} must cover dstate "
                   f"({caps(problem)['state_block_n']}) at launches=1")
    if config.launches == 1 and arch.wgmma_fused_tile_bug and config.state_block_m < 64 and config.scan_block_m >= 64:
        # Triton 3.6's wgmma lowering gets the single launch wrong here: y off by O(1) from row 16
        # of each tile, and an illegal address at 2048 tokens (H100; right with MMA v3 disabled,
        # and in the interpreter). scripts/repro_fused_tiles.py reproduces it.
        why.append(f"state_block_m={config.state_block_m} < 64 with scan_block_m={config.scan_block_m} >= 64 "
                   f"at launches=1 is miscompiled on sm90 by Triton 3.6 (wrong y, faults)")
    if config.smem_pad:
        why += _gluon_state_violations(config, arch, problem)
        if config.fold_prep == 1:
            why.append(f"fold_prep=1 needs the tl chunk-state kernel, not the Gluon one (smem_pad={config.smem_pad})")
    if config.scan_gluon:
        why += gluon_scan_violations(config, problem)   # (other archs: "not offered", Knob.needs)
    if config.state_walk:
        why += walk_violations(config, problem)
    elif config.walk_weights:
        why.append("walk_weights=1 feeds the Gluon walk: needs state_walk=1")
    if config.walk_block != 128 and not config.state_walk:
        why.append(f"walk_block={config.walk_block} sizes the Gluon walk's ring: needs state_walk=1")
    if config.walk_split > 1:
        if not config.state_walk:
            why.append(f"walk_split={config.walk_split} cuts the Gluon walk into segments: needs state_walk=1")
        if config.scan_gluon < 2:
            why.append(f"walk_split={config.walk_split} leaves each segment's states for the chunk-walking Gluon "
                       f"scan to complete: needs scan_gluon=2 or 3, got {config.scan_gluon}")
        if config.pdl:
            why.append(f"walk_split={config.walk_split} adds a join launch with no programmatic dependent "
                       f"launch: needs pdl=0, got {config.pdl}")
    if config.pdl >= 2 and config.scan_gluon != 1:
        why.append(f"pdl={config.pdl} moves the Gluon chunk scan's intra-chunk part before its wait: "
                   f"needs scan_gluon=1, got {config.scan_gluon}")
    if config.pdl == 3 and not config.state_walk:
        why.append("pdl=3 has the chunk scan follow the Gluon walk's published states: needs state_walk=1")
    for stage in ("bmm", "state", "scan", "pass"):
        if config[f"{stage}_warps"] * arch.warp_size > 1024:
            why.append(f"{stage}_warps={config[f'{stage}_warps']} x warp {arch.warp_size} > 1024 threads")
    if problem is not None:
        for name, cap in caps(problem).items():
            if config[name] > cap and config.launches in KNOB_BY_NAME[name].depths:
                why.append(f"{name}={config[name]} exceeds the problem's padded size {cap}")
    return why


def _gluon_state_violations(config: Config, arch: Arch, problem) -> list[str]:
    """What the Gluon chunk-state kernel (smem_pad > 0, chunk_state_gluon.jinja) cannot do."""
    why = []   # (launches != 5 cannot occur: a Config resets smem_pad there, Knob.depths)
    if problem is not None and problem.dtype not in ("fp16", "bf16"):
        why.append(f"smem_pad={config.smem_pad} needs fp16/bf16 inputs (its MMA takes 16-bit operands), "
                   f"got {problem.dtype}")
    if arch.is_amd and config.matrix_instr_nonkdim == 32 and min(config.state_block_m, config.state_block_n) < 32:
        # the kernel's MFMA layout is 32x32 then; tl.dot would not pick it for a smaller tile either
        why.append(f"smem_pad={config.smem_pad} with matrix_instr_nonkdim=32 needs state_block_m and "
                   f"state_block_n >= 32")
    return why


def gluon_scan_violations(config: Config, problem=None) -> list[str]:
    """What the Gluon chunk scans (scan_gluon = 1 or 2, chunk_scan_gluon.jinja) cannot do, for this
    config and problem on sm90. Strides and alignment are the call's: plan() checks those
    (ops.ssd.chunk.gluon_scan_gaps)."""
    # (launches == 1 cannot occur: a Config resets scan_gluon there, Knob.depths)
    why = gluon_scan_tile_violations(config)
    return why + _gluon_problem_violations("scan_gluon", config, problem, (64, 128),
                                           "the state tile is an MMA operand as stored")


def walk_violations(config: Config, problem=None) -> list[str]:
    """What the Gluon walk (state_walk = 1, state_walk_gluon.jinja) cannot do, for this config and
    problem on sm90. Strides and alignment are the call's: plan() checks those
    (ops.ssd.chunk.walk_gaps)."""
    why = []   # (launches != 5 cannot occur: a Config resets state_walk there, Knob.depths)
    if config.fold_prep == 1:
        why.append("state_walk=1 replaces the chunk-state launch that fold_prep=1 folds the cumsum into")
    if config.smem_pad:
        why.append(f"state_walk=1 replaces the Gluon chunk state that smem_pad={config.smem_pad} chooses")
    return why + _gluon_problem_violations("state_walk", config, problem, (64, 128, 256),
                                           "they leave by TMA as the accumulator rounded to it")


def _gluon_problem_violations(knob: str, config: Config, problem, dstates: tuple, why_states: str) -> list[str]:
    """What the sm90 Gluon kernels share (stage_knobs.gluon_problem_violations), and the forward's
    states in the input dtype."""
    label = f"{knob}={config[knob]}"
    why = gluon_problem_violations(label, problem, dstates)
    if problem is not None and problem.dtype in ("fp16", "bf16") and config.state_dtype != problem.dtype:
        why.insert(0, f"{label} needs states in the input dtype ({problem.dtype}): {why_states}, "
                      f"got state_dtype={config.state_dtype}")
    return why


def fit(config: Config, problem) -> Config:
    """Shrink tiles that exceed the problem's padded dims or the chunk (used for defaults)."""
    q = config.chunk_size
    config = shrink(config, {**caps(problem), **{name: q for name in _CHUNK_TILES}})
    if config.launches == 1:   # the whole dstate in one tile, where a tile can hold it
        config = config.replace(state_block_n=min(caps(problem)["state_block_n"],
                                                  max(KNOB_BY_NAME["state_block_n"].values)))
    return config


def default_config(arch: Arch | str, problem=None, launches: int | None = None) -> Config:
    """The per-arch default (five launches unless `launches` names another depth), used when no
    tuned record applies. Hand-picked starting points: 64-wide tiles everywhere suit headdim 64 /
    dstate 128; AMD starts from its compiler's choices."""
    arch = get_arch(arch) if isinstance(arch, str) else arch
    base = Config(launches=launches or KNOB_BY_NAME["launches"].default)
    if arch.is_amd:
        # 64 KB of LDS: keep pipelining shallow.
        base = base.replace(bmm_stages=1, state_stages=1, scan_stages=1)
    elif arch.name == "sm90":
        # H100 sweeps (BENCHMARKS.md): 2 warps won for chunk state at every shape swept and for
        # state passing at mamba2-2.7b sizes; the factored decay with 32-token k blocks took the
        # chunk scan from 4.13 to 3.38 ms at mamba2-2.7b 1x131072 (124 registers instead of 161),
        # and no pipelining there to 3.00 ms; 3 stages took chunk state from 0.94 to 0.86 ms.
        # After the scan's per-element work was cut (CB fed to the MMA as loaded, masks compiled
        # out): 64-token k blocks over 128-wide dstate steps, capped at 128 registers (4 CTAs per
        # SM; uncapped these take ~156), 2.80 -> 2.45 ms (BENCHMARKS.md, 2026-11-22c)
        base = base.replace(state_warps=2, pass_warps=2, decay_split=True, scan_block_k=64,
                            scan_block_d=128, scan_maxnreg=128, scan_stages=1, state_stages=3)
        if base.launches == 5:
            # the whole dstate in one chunk-state tile: x is read once per chunk and head, not
            # once per dstate tile; the chunk state 9-16% and the forward 1.7-3.7% faster at every
            # large shape in both dtypes on the H100. Not at depth 3, whose hand-off
            # would then hold a 64x128 fp32 carry in 2 warps (its registers are its bound).
            base = base.replace(state_block_n=128)
            # the state passing's loads six chunks deep: 0.282 -> 0.155 ms at 130m 1x131072 (its
            # bytes at 87% of the copy rate), no change at 8 chunks per sequence (H100)
            base = base.replace(pass_stages=6)
        if base.launches == 1:
            # the single launch's best in sweep 3: 128-token chunks, 64-token k blocks, 4 warps;
            # a register cap made it slower at every value tried (168: 5.2 -> 7.1 ms)
            base = base.replace(chunk_size=128, scan_block_k=64, state_block_k=128, scan_maxnreg=0)
    if problem is not None:
        # states in the input dtype, as mamba_ssm does: y's error stays that of the input dtype
        # (measured on the H100, BENCHMARKS.md) and the state traffic halves.
        if problem.dtype in ("fp16", "bf16"):
            base = base.replace(state_dtype=problem.dtype)
        if problem.chunk_size is not None:
            base = base.replace(chunk_size=problem.chunk_size)
        base = fit(base, problem)
        if arch.wgmma_fused_tile_bug and base.launches == 1 and base.state_block_m < 64:
            base = base.replace(scan_block_m=32)   # headdim < 64: see violations (a Triton 3.6 bug)
    return base
