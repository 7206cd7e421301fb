"""Packed prefill's knobs (`ssd_varlen`), declared once, its problem, and the rules that tie them
to an arch and a problem.

The mode knob is `cb`, where the chunk scan gets C·Bᵀ: "stage" computes it once per chunk and
group in a launch of its own (five launches), "inline" inside the chunk scan (four launches, and
C·Bᵀ computed once per head instead of once per group: fewer launches for a prefill of a few
tokens, more FLOPs for a long one).

The chunk length is not a knob: the caller's chunk table (cu_chunk_seqlens) was cut with the
model's chunk_size, and prefix caching stores a state per chunk of that length.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from ...arch import Arch, get_arch
from ...problem import MODEL_FLAGS
from .stage_knobs import (BMM, CHUNK_SCAN, CHUNK_STATE, CUMSUM, GLUON_SCAN, GLUON_WALK, STATE_PASSING,
                          gluon_problem_violations, gluon_scan_tile_violations)
from ...knobs import BaseConfig, ConfigError, Knob, KnobSpace, ProblemFields, ShapeForm, pow2_at_least, shrink, take  # noqa: F401 (ConfigError: re-exported)

DTYPES = ("fp32", "bf16", "fp16")
CHUNK_SIZES = (16, 32, 64, 128, 256, 512)

KNOBS: tuple[Knob, ...] = (
    # "staged" was this mode's name before the backward's "stage" became the one name: stored
    # records read on
    Knob("cb", ("stage", "inline"), "stage",
         "where the chunk scan gets C·Bᵀ: a launch of its own, or computed in the scan",
         aliases=(("staged", "stage"),)),
    *take(CUMSUM),
    *take(BMM, depths=("stage",)),
    *take(CHUNK_STATE),
    *take(STATE_PASSING),
    # scan_stages 1: at 2.7b, 8192 tokens in 16 sequences (bf16, H200) the scan took 0.457 ms of
    # graph-timed call time at 1 stage against 0.625 at 2 (the other knobs at their defaults)
    *take(CHUNK_SCAN, defaults={"scan_stages": 1},
         docs={"scan_block_d": "dstate step of the C·state (and inline C·Bᵀ) products"}),
    # The forward's Gluon data paths on sm90, over the chunk table: the walk (one program per state
    # tile, head and sequence through that sequence's chunks, each from its initial state) in
    # place of the chunk-state and state-passing launches, and the chunk-walking scan (2, 3) in
    # place of the tl scan. Both read C·Bᵀ from its own launch (cb = "stage"); the scan reads the
    # entering states the walk stores, in the inputs' 16-bit type.
    *take(GLUON_WALK, depths=("stage",)),
    *take(GLUON_SCAN, depths=("stage",), values={"scan_gluon": (0, 2, 3)}),
    # The walk's dstate tile. A long sequence's walk is one program per (state tile, head) through
    # all of its chunks, the call's long pole (2.7b, one sequence of 8192 tokens: 80 programs for
    # 132 SMs); 64-wide tiles at dstate 128 run twice the programs, each with half the accumulator,
    # x read by both tiles of a head. measured_only: only a GPU can weigh the two. On the H200 64
    # lost at six of bench_varlen's seven cases (2.7b 64 x 64 tokens: 0.305 against 0.267 ms) and
    # won 1% at one long sequence beside 63 short ones
    Knob("walk_bn", (128, 64), 128, "dstate tile of the Gluon walk (sm90): 64 runs twice the programs at dstate 128",
         "chunk_state", depths=("stage",), measured_only=True, needs=("tma", "wgmma")),
)
SPACE = KnobSpace("ssd_varlen", KNOBS, mode_knob="cb")
KNOB_BY_NAME: dict[str, Knob] = SPACE.by_name


class VarlenConfig(BaseConfig):
    """A validated packed-prefill config: every knob of `KNOBS`, each from its declared set."""
    space = SPACE
    __slots__ = ()


@dataclass(frozen=True)
class VarlenProblem(ProblemFields):
    """One packed prefill's shape, dtypes and flags: what the records key on. `tokens` is the
    packed length (every sequence's tokens), `seqs` the number of sequences, `chunks` the rows of
    the chunk table (at least tokens / chunk_size, at most that plus one per sequence)."""
    default_op: ClassVar[str] = "ssd_varlen"
    # the lookup's size distance (autossd.db.lookup): packed batches change length every call, so
    # a record serves nearby token counts (and, at half the weight, sequence counts); the chunk
    # count follows from those, and every other field must match
    DISTANCE_WEIGHTS: ClassVar[dict[str, float]] = {"tokens": 1.0, "seqs": 0.5, "chunks": 0.0}

    tokens: int
    seqs: int
    chunks: int
    nheads: int
    headdim: int
    dstate: int
    ngroups: int
    chunk_size: int
    dtype: str                 # x, z and out
    state_dtype: str = "fp32"  # the chunk states kept (and returned per chunk)
    has_D: bool = False
    D_has_hdim: bool = False
    has_z: bool = False
    has_dt_bias: bool = False
    dt_softplus: bool = False
    has_init: bool = False

    @classmethod
    def example(cls) -> "VarlenProblem":
        return problem_for(60, 3, 4, 16, 16, 1, 16, "fp32", has_D=True, has_dt_bias=True, dt_softplus=True,
                           has_init=True)

    def __post_init__(self) -> None:
        for f in ("tokens", "seqs", "chunks", "nheads", "headdim", "dstate", "ngroups"):
            v = getattr(self, f)
            if type(v) is not int or v < (0 if f == "chunks" else 1):
                raise ValueError(f"{f}: expected a positive int, got {v!r}")
        if self.chunk_size not in CHUNK_SIZES:
            raise ValueError(f"chunk_size: expected one of {CHUNK_SIZES}, got {self.chunk_size!r}")
        if self.nheads % self.ngroups:
            raise ValueError(f"ngroups: nheads={self.nheads} is not divisible by ngroups={self.ngroups}")
        for f in ("dtype", "state_dtype"):
            if getattr(self, f) not in DTYPES:
                raise ValueError(f"{f}: expected one of {DTYPES}, got {getattr(self, f)!r}")
        for f in ("has_D", "D_has_hdim", "has_z", "has_dt_bias", "dt_softplus", "has_init"):
            if type(getattr(self, f)) is not bool:
                raise ValueError(f"{f}: expected a bool, got {getattr(self, f)!r}")


    # the names the tuner's reports use for a problem's size
    @property
    def batch(self) -> int:
        return self.seqs

    @property
    def seqlen(self) -> int:
        return self.tokens

    def min_bytes(self) -> int:
        """Each operand read once, each output written once: x, z, y, dt, B, C, the initial states
        read and the final states written (the chunk states are intermediates)."""
        e = {"fp32": 4, "bf16": 2, "fp16": 2}[self.dtype]
        t, h, p, n, g = self.tokens, self.nheads, self.headdim, self.dstate, self.ngroups
        states = self.seqs * h * p * n * ((4 if self.has_init else 0) + 4)
        return t * h * p * e * (3 if self.has_z else 2) + t * h * e + 2 * t * g * n * e + states

    def flops(self, chunk_size: int | None = None) -> int:
        """The causal intra-chunk products (C·Bᵀ per group, its product with x per head), the chunk
        states and the C·state products: 2 FLOPs per multiply-add. `chunk_size` is ignored: the
        chunk length is the problem's own (callers that price the forward pass its config's)."""
        q, t, h, p, n, g = self.chunk_size, self.tokens, self.nheads, self.headdim, self.dstate, self.ngroups
        return 2 * t * (q // 2) * (g * n + h * p) + 2 * 2 * t * h * p * n


def caps(problem: VarlenProblem) -> dict[str, int]:
    """Largest useful value per knob: a tile past the padded dimension (or the chunk) is
    masked-off work."""
    q = problem.chunk_size
    p2, n2 = pow2_at_least(problem.headdim), pow2_at_least(problem.dstate)
    return {"bmm_block_m": q, "bmm_block_n": q, "bmm_block_k": max(16, n2),
            "state_block_m": max(16, p2), "state_block_n": max(16, n2), "state_block_k": q,
            "scan_block_m": q, "scan_block_n": max(16, p2), "scan_block_k": q, "scan_block_d": max(16, n2),
            "cumsum_block_h": pow2_at_least(problem.nheads),
            "pass_block": max(64, pow2_at_least(problem.headdim * problem.dstate))}


# shared memory a tl.dot loop stages per pipeline stage, bytes per element of its operand tiles
def _smem(config: VarlenConfig, elem: int) -> dict[str, int]:
    c = config
    out = {"chunk_state": c.state_stages * (c.state_block_m + c.state_block_n) * c.state_block_k * elem,
           "chunk_scan": c.scan_stages * (c.scan_block_m * c.scan_block_d + c.scan_block_d * c.scan_block_n
                                          + c.scan_block_m * c.scan_block_k * 4 + c.scan_block_k * c.scan_block_n) * elem}
    if c.cb == "stage":
        out["bmm"] = c.bmm_stages * (c.bmm_block_m + c.bmm_block_n) * c.bmm_block_k * elem
    return out


def violations(config: VarlenConfig, arch: Arch | str, problem: VarlenProblem | None = None) -> list[str]:
    """Reasons a config cannot run on an arch (and problem); empty when it is feasible."""
    arch = get_arch(arch) if isinstance(arch, str) else arch
    why = SPACE.arch_violations(config, arch)
    for name in ("bmm_warps", "state_warps", "pass_warps", "scan_warps"):
        if config[name] * arch.warp_size > 1024:
            why.append(f"{name}={config[name]} x warp {arch.warp_size} > 1024 threads")
    elem = 2 if problem is None or problem.dtype != "fp32" else 4
    for stage, b in _smem(config, elem).items():
        if b > arch.smem_per_block:
            why.append(f"{stage}: {b} bytes of pipelined tiles > {arch.smem_per_block} of shared memory")
    if problem is not None:
        for name, cap in caps(problem).items():
            if config[name] > cap and KNOB_BY_NAME[name].shapes(config.cb):
                why.append(f"{name}={config[name]} exceeds the problem's padded size {cap}")
    return why + gluon_violations(config, problem)


def gluon_violations(config: VarlenConfig, problem: VarlenProblem | None = None) -> list[str]:
    """What the Gluon walk and scan (state_walk, scan_gluon) cannot do, for this config and
    problem; the call's strides and device are plan()'s to check (varlen_gluon.gluon_gaps). The two
    run together: the walk stores each chunk's entering state in the inputs' type for the scan,
    where the tl scan reads the end states of the tl chain."""
    why = []
    if config.state_walk and not config.scan_gluon:
        why.append("state_walk=1 stores the entering states the Gluon scan reads: needs scan_gluon 2 or 3")
    if config.scan_gluon and not config.state_walk:
        why.append(f"scan_gluon={config.scan_gluon} reads the entering states the Gluon walk stores: needs state_walk=1")
    if config.walk_block != 128 and not config.state_walk:
        why.append(f"walk_block={config.walk_block} sizes the Gluon walk's ring: needs state_walk=1")
    if config.walk_bn != 128 and not config.state_walk:
        why.append(f"walk_bn={config.walk_bn} tiles the Gluon walk's dstate: needs state_walk=1")
    if config.walk_bn != 128 and problem is not None and problem.dstate <= config.walk_bn:
        why.append(f"walk_bn={config.walk_bn}: at dstate {problem.dstate} the walk runs walk_bn=128's tiles")
    if not config.scan_gluon:
        return why
    why += gluon_scan_tile_violations(config)
    if problem is None:
        return why
    why += gluon_problem_violations(f"scan_gluon={config.scan_gluon}", problem)
    if problem.chunk_size not in (64, 128, 256):
        why.append(f"scan_gluon={config.scan_gluon} needs chunk_size 64, 128 or 256 (whole 64-token tiles, x "
                   f"resident in shared memory), got {problem.chunk_size}")
    return why


def fit(config: VarlenConfig, problem: VarlenProblem) -> VarlenConfig:
    """`config` with every tile cut to the problem's padded sizes and chunk length."""
    return shrink(config, caps(problem))


def default_config(arch: Arch | str, problem: VarlenProblem | None = None, cb: str | None = None) -> VarlenConfig:
    """The per-arch default where no record applies, cut to the problem's sizes. From a sweep of
    66 configs at 2.7b, 8192 tokens in 16 sequences (bf16, H200, graph-timed): the row x column
    decay before the diagonal and a 64 x 128 chunk-state tile on two warps with three stages took
    0.389 ms per call against 0.457 for 64-wide tiles throughout. (A 128-register cap on the scan
    took 0.372, but spills 16 bytes on sm90 and 80 on sm80, 72 with C·Bᵀ inline: a tune may pick
    it; the default does not.) On AMD two warps per program take the threads of four on NVIDIA,
    and pipeline stages are cut until the tiles fit its 64 KB of shared memory. Short prefills
    (under two chunks per sequence on average) compute C·Bᵀ inline: the launch it saves is most
    of such a call's time. On sm90 the Gluon walk and scan, where the problem fits them."""
    arch = get_arch(arch) if isinstance(arch, str) else arch
    cfg = VarlenConfig(decay_split=True, state_block_n=128, state_warps=2, state_stages=3)
    if arch.is_amd:
        cfg = cfg.replace(bmm_warps=2, state_warps=2, scan_warps=2, pass_warps=2)
    if cb is not None:
        cfg = cfg.replace(cb=cb)
    if problem is None:
        return cfg
    if cb is None and problem.tokens < 2 * problem.chunk_size * problem.seqs:
        cfg = cfg.replace(cb="inline")
    if cb in (None, "stage") and arch.has("tma", "wgmma"):
        # the forward's Gluon walk and chunk-walking scan storing y by TMA, where they take the
        # problem: 1.5-1.7x the tl stages at every packed batch of the H200 benchmark (2026-11-28,
        # bf16: 0.255 against 0.385 ms at 2.7b's 8192 tokens in one sequence, 0.374 against 0.562
        # in 64 drawn, where the tl default computes C·Bᵀ inline)
        gluon = cfg.replace(cb="stage", state_walk=1, scan_gluon=3)
        if not gluon_violations(gluon, problem):
            cfg = gluon
    cfg = fit(cfg, problem)
    while violations(cfg, arch, problem) and max(cfg.scan_stages, cfg.state_stages, cfg.bmm_stages) > 1:
        cfg = cfg.replace(scan_stages=max(1, cfg.scan_stages - 1), state_stages=max(1, cfg.state_stages - 1),
                          bmm_stages=max(1, cfg.bmm_stages - 1))
    return cfg


# --- a packed batch's problem, and how one is written on the command line (autossd.tuner.shapes)
def lengths_for(problem: VarlenProblem, seed: int = 0) -> list[int]:
    """Sequence lengths summing to problem.tokens over problem.seqs sequences, drawn at random
    (seeded): a serving batch's mix, every sequence at least one token."""
    g = torch.Generator().manual_seed(seed)
    w = torch.rand(problem.seqs, generator=g) + 0.05
    extra = problem.tokens - problem.seqs
    lens = (w / w.sum() * extra).floor().long() + 1
    lens[0] += problem.tokens - int(lens.sum())
    return [int(v) for v in lens]


def chunks_for(tokens_per_seq: list[int], chunk_size: int) -> int:
    """Rows of the chunk table `varlen_chunks` cuts these lengths into."""
    return sum(-(-n // chunk_size) for n in tokens_per_seq)


def problem_for(tokens: int, seqs: int, nheads: int, headdim: int, dstate: int, ngroups: int = 1,
                chunk_size: int = 256, dtype: str = "bf16", seed: int = 0, **flags) -> VarlenProblem:
    """The problem of a packed batch of `seqs` sequences and `tokens` tokens as `tune_inputs`
    draws it (its chunk count follows from the drawn lengths)."""
    base = VarlenProblem(tokens=tokens, seqs=seqs, chunks=max(1, -(-tokens // chunk_size)), nheads=nheads,
                         headdim=headdim, dstate=dstate, ngroups=ngroups, chunk_size=chunk_size, dtype=dtype,
                         **flags)
    return base.replace(chunks=chunks_for(lengths_for(base, seed), chunk_size))


# Packed prefill's grid: (tokens, sequences) of an engine's prefill step, many short sequences
# and few long ones; states in fp32 (the engines' default cache).
GRID_VARLEN = ((8192, 16), (65536, 64))


def _build(vals: dict, flags: dict, dtype: str, state_dtype: str | None) -> VarlenProblem:
    if vals["tokens"] < vals["seqs"]:
        raise ValueError(f"t={vals['tokens']} tokens cannot hold s={vals['seqs']} sequences "
                         "(each sequence has at least one token)")
    # the chunk count follows from the sequence lengths the tuner draws (tune_inputs)
    return problem_for(dtype=dtype, state_dtype=state_dtype or "fp32", **vals, **flags)


# An engine's packed prefill passes D, dt_bias, softplus and each sequence's initial state (zeros
# for a fresh one). t: tokens of every sequence together; s: sequences; q: the model's chunk
# length (256 for Mamba-2). Presets: packed batches scripts/bench_varlen.py times.
FORM = ShapeForm(
    {"t": "tokens", "s": "seqs", "q": "chunk_size", "h": "nheads", "p": "headdim", "n": "dstate", "g": "ngroups"},
    {"d": "has_D", "z": "has_z", "bias": "has_dt_bias", "softplus": "dt_softplus", "init": "has_init"},
    {**MODEL_FLAGS, "has_init": True}, {"tokens": 2048, "seqs": 1}, ("q",), "t=8192,s=16,h=80,p=64,n=128,g=1",
    _build, states=True, defaults={"chunk_size": 256},
    presets=[{"tokens": t, "seqs": n} for t, n in ((8192, 1), (8192, 16), (8192, 64), (65536, 64))],
    grid=[{"tokens": t, "seqs": n} for t, n in GRID_VARLEN],
    grid_states=lambda dtype, state_dtype: (state_dtype or "fp32",),
    help='"mamba2-2.7b:t=8192,s=16"; keys t (tokens of all sequences), s (sequences), q (chunk length, '
         "default 256), h p n g; flags d z bias softplus init, default d=1,bias=1,softplus=1,init=1 (an "
         "engine passes each sequence's initial state)",
    preset_help="packed batches", grid_help="8192 tokens in 16 sequences and 64k in 64")
VarlenProblem.shape_form = FORM


def seed_configs(arch: Arch | str, problem: VarlenProblem, space) -> list[VarlenConfig]:
    """Starting points enqueued before sampling: the arch default, then each data path a draw
    would seldom meet (the Gluon pair needs the walk, the scan and 64-wide scan tiles at once):
    the Gluon scan storing y by registers (2), the walk's 64-token ring, the tl stages with C·Bᵀ
    staged and inline. Only those inside the space and feasible."""
    arch = get_arch(arch) if isinstance(arch, str) else arch
    base = default_config(arch, problem)
    tl = default_config(arch, problem, cb="stage").replace(state_walk=0, scan_gluon=0)
    gluon = tl.replace(state_walk=1, scan_gluon=3)
    cands = [base, gluon.replace(scan_gluon=2), gluon.replace(walk_block=64), gluon, tl,
             default_config(arch, problem, cb="inline")]   # (each default is fitted to the problem)
    out: list[VarlenConfig] = []
    for cand in cands:
        if cand not in out and space.params(cand) is not None and not violations(cand, arch, problem):
            out.append(cand)
    return out
