"""The decode step's knobs (`ssd_decode`), declared once, and the rules that tie them to an arch
and a problem.

The mode knob is `layout`: how a program walks the state's dstate axis. "whole" holds the
program's (BLOCK_P, dstate) state tile in registers at once (one read, one write, and with several
tokens per step the state stays in registers between them); "tiled" walks dstate in BLOCK_N
slices, each read once and written once, for a dstate too large to hold (one token per step only:
the output of a token sums over every slice); "persistent" launches as many programs as the SMs
hold at once, each walking (row, head, headdim block) tiles of the whole dstate in a
software-pipelined loop, the next tile's state loading while one is updated (one token per step).

`a_dense` is not searched: it follows the problem. 0 (every Mamba-2 model) reads one A per head
and its decay exp(dt A) is one value per headdim row; 1 reads A as a (headdim, dstate) tile per
head and takes an exp per state element (a dense A: Mamba-1's (dim, dstate), or the Mamba-2 form
with a value per channel and state). The knob is a config's rather than only a launch flag's so
that the per-head kernels render as they always have and their records stay fresh.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from ...arch import Arch, get_arch
from ...problem import MODEL_FLAGS
from ...knobs import BaseConfig, ConfigError, Knob, KnobSpace, ProblemFields, ShapeForm, pow2_at_least  # noqa: F401 (ConfigError: re-exported)

STATE_DTYPES = ("fp32", "bf16", "fp16")
DTYPES = ("fp32", "bf16", "fp16")
# fp32 state elements a thread may hold before the whole-dstate tile spills registers (the update,
# the product with C and the loads in flight need a few registers per element)
MAX_ELEMS_PER_THREAD = 128
# the persistent layout's tile index is 32-bit: room left for a last step of as many programs as
# any GPU holds at once
MAX_TILES = 2**31 - 2**22
# a launch grid's y and z extents (the headdim blocks, the head groups)
MAX_GRID_YZ = 65535

KNOBS: tuple[Knob, ...] = (
    Knob("layout", ("whole", "tiled", "persistent"), "whole",
         "the state tile's dstate extent: all of dstate at once, BLOCK_N slices in a loop, or all of "
         "dstate in resident programs that loop over the tiles"),
    Knob("block_p", (1, 2, 4, 8, 16, 32, 64, 128), 8, "headdim rows per program", "decode"),
    Knob("block_n", (16, 32, 64, 128), 64, "dstate columns per slice", "decode", depths=("tiled",)),
    Knob("heads", (1, 2, 4, 8), 1, "heads per program (unrolled one after another: fewer, longer programs)", "decode",
         depths=("whole", "tiled")),
    Knob("warps", (1, 2, 4, 8), 4, "num_warps", "decode"),
    Knob("stages", (1, 2, 3), 1, "num_stages (software pipelining of the token, slice and tile loops)", "decode"),
    # 1: the state, read once and written once, bypasses the caches' keep-resident policy (load
    # evict_first, store .cs, streaming): it is the whole of the step's traffic and is not read
    # again this step, so it should not evict x, B, C and the other rows' data. measured_only: a
    # cache policy is invisible to the static model.
    Knob("stream", (0, 1), 0, "1: the state's loads and stores take the streaming cache policy",
         "decode", measured_only=True, needs=("cuda",)),
    # 1: the step is launched as a programmatic dependent of the kernel before it (sm90): its
    # programs wait (griddepcontrol.wait) for that kernel's completion before any memory access,
    # and release the next launch at once, so a launch's start overlaps its predecessor's last
    # programs rather than following them. measured_only: launch overlap is invisible to the
    # static model.
    Knob("pdl", (0, 1), 0, "1: programmatic dependent launch (overlaps the previous kernel's tail)",
         "decode", measured_only=True, needs=("pdl",)),
    # set by the problem (A_dense), never searched: see the module docstring
    Knob("a_dense", (0, 1), 0, "1: A holds a value per headdim row and state (an exp per state element)",
         "decode"),
)
SPACE = KnobSpace("ssd_decode", KNOBS, mode_knob="layout")
KNOB_BY_NAME: dict[str, Knob] = SPACE.by_name


class DecodeConfig(BaseConfig):
    """A validated decode config: every knob of `KNOBS`, each from its declared set."""
    space = SPACE
    __slots__ = ()


@dataclass(frozen=True)
class DecodeProblem(ProblemFields):
    """One decode call's shape, dtypes and flags: what the records key on. `batch` is the rows of
    the call (not the cache slots of the state); `tokens` is T, the tokens per row of a
    multi-token step (1: the ordinary decode step). `A_dense`: A varies over headdim or dstate
    (Mamba-1's A (dim, dstate), which is this problem with one head of headdim=dim, or a
    Mamba-2-form A (nheads, headdim, dstate) with real values per channel and state); False: one
    A per head. A key leaves `A_dense` out while it is False, so the records of the per-head
    problems keep the keys they were stored under."""
    default_op: ClassVar[str] = "ssd_decode"
    batch: int
    nheads: int
    headdim: int
    dstate: int
    ngroups: int
    dtype: str                 # x, z and out
    state_dtype: str = "fp32"
    has_D: bool = False
    has_z: bool = False
    has_dt_bias: bool = False
    dt_softplus: bool = False
    tokens: int = 1
    A_dense: bool = False

    @classmethod
    def example(cls) -> "DecodeProblem":
        return cls(batch=3, nheads=4, headdim=16, dstate=16, ngroups=1, dtype="fp32", state_dtype="bf16",
                   has_D=True, has_dt_bias=True, dt_softplus=True)

    def __post_init__(self) -> None:
        for f in ("batch", "nheads", "headdim", "dstate", "ngroups", "tokens"):
            v = getattr(self, f)
            if type(v) is not int or v < 1:
                raise ValueError(f"{f}: expected a positive int, got {v!r}")
        if self.nheads % self.ngroups:
            raise ValueError(f"ngroups: nheads={self.nheads} is not divisible by ngroups={self.ngroups}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype: expected one of {DTYPES}, got {self.dtype!r}")
        if self.state_dtype not in STATE_DTYPES:
            raise ValueError(f"state_dtype: expected one of {STATE_DTYPES}, got {self.state_dtype!r}")
        for f in ("has_D", "has_z", "has_dt_bias", "dt_softplus", "A_dense"):
            if type(getattr(self, f)) is not bool:
                raise ValueError(f"{f}: expected a bool, got {getattr(self, f)!r}")

    def key(self) -> dict:
        k = super().key()
        if not k["A_dense"]:
            del k["A_dense"]
        return k

    def min_bytes(self) -> int:
        """Each operand read once, each output written once: the state read and written, x, z and
        out, dt, B and C, and a dense A once (in fp32; every row reads it, from the cache after
        the first: at batch 1 it is as large as an fp32 state). The per-head parameters are a
        rounding error."""
        e = {"fp32": 4, "bf16": 2, "fp16": 2}
        s = e[self.state_dtype]
        bt = self.batch * self.tokens
        state = 2 * self.batch * self.nheads * self.headdim * self.dstate * s
        xo = bt * self.nheads * self.headdim * e[self.dtype] * (3 if self.has_z else 2)
        bc = 2 * bt * self.ngroups * self.dstate * e[self.dtype]
        a = self.nheads * self.headdim * self.dstate * 4 if self.A_dense else 0
        return state + xo + bc + bt * self.nheads * 4 + a

    def flops(self, chunk_size: int = 0) -> int:
        """Per state element and token: decay, update and the product with C (5 FLOPs)."""
        return 5 * self.batch * self.tokens * self.nheads * self.headdim * self.dstate


def caps(problem: DecodeProblem) -> dict[str, int]:
    """Largest useful value per knob: a tile past the padded dimension is masked-off work."""
    return {"block_p": pow2_at_least(problem.headdim),
            "block_n": max(16, pow2_at_least(problem.dstate)),
            "heads": pow2_at_least(problem.nheads)}


def excluded(problem: DecodeProblem, static: bool = False) -> dict[str, tuple]:
    """Values a tune never offers: the A kernel other than the problem's."""
    return {"a_dense": (0,) if problem.A_dense else (1,)}


def violations(config: DecodeConfig, arch: Arch | str, problem: DecodeProblem | None = None) -> list[str]:
    """Reasons a config cannot run on an arch (and problem); empty when it is feasible."""
    arch = get_arch(arch) if isinstance(arch, str) else arch
    why = SPACE.arch_violations(config, arch)
    threads = config.warps * arch.warp_size
    if threads > 1024:
        why.append(f"warps={config.warps} x warp {arch.warp_size} > 1024 threads")
    if problem is not None:
        if config.a_dense != int(problem.A_dense):
            why.append(f"a_dense={config.a_dense} cannot run A_dense={problem.A_dense}: the kernel reads A "
                       + ("per head" if not config.a_dense else "as a (headdim, dstate) tile per head")
                       + ", the problem's A is " + ("dense" if problem.A_dense else "one value per head"))
        for name, cap in caps(problem).items():
            if config[name] > cap and not (name == "block_n" and config.layout != "tiled"):
                why.append(f"{name}={config[name]} exceeds the problem's padded size {cap}")
        if config.layout in ("tiled", "persistent") and problem.tokens > 1:
            why.append(f"layout={config.layout} runs one token per step; the problem has tokens={problem.tokens}")
        tiles = problem.batch * problem.nheads * -(-problem.headdim // config.block_p)
        if config.layout == "persistent" and tiles > MAX_TILES:
            why.append(f"layout=persistent walks {tiles} tiles, past its 32-bit tile index ({MAX_TILES})")
        if config.layout != "persistent" and -(-problem.headdim // config.block_p) > MAX_GRID_YZ:
            why.append(f"block_p={config.block_p}: headdim {problem.headdim} in {config.block_p}-row blocks "
                       f"is past the launch grid's limit {MAX_GRID_YZ}")
        width = config.block_n if config.layout == "tiled" else max(16, pow2_at_least(problem.dstate))
        # a dense A's tile is held beside the state's: twice the registers per state element
        per_thread = config.block_p * width * (2 if config.a_dense else 1) // threads
        if per_thread > MAX_ELEMS_PER_THREAD:
            why.append(f"a {config.block_p} x {width} state tile{' and its A tile' if config.a_dense else ''} "
                       f"is {per_thread} elements per thread (> {MAX_ELEMS_PER_THREAD}: registers spill)")
    return why


def default_config(arch: Arch | str, problem: DecodeProblem | None = None,
                   layout: str | None = None) -> DecodeConfig:
    """The per-arch default, used where no record applies: the whole dstate per program, a tile of
    4 KB of state and 32 state elements per thread, one head per program. Measured on an H200 at
    mamba2-2.7b dimensions (2026-11-26, a sweep of tiles, heads and warps, graph-timed): with fp32
    states 8 rows on one warp reached 89% of the copy bandwidth at batch 64 where 8 rows on four
    warps (8 elements per thread) reached 85%; with bf16 states 16 rows on two warps reached 83%
    where 8 rows on four warps reached 56%: each thread needs that many loads in flight to stream.
    AMD (never run) takes 16 elements per lane of its 64-wide wavefronts, the same per wavefront.
    A dstate too wide for that (over 1024 at one headdim row) walks it in slices. `layout`: the
    default at that layout (the tuner asks for it when the layout is pinned). A dense A takes the
    dense kernel (a_dense=1) and otherwise the same tiles: its A tile is the state tile's size in
    fp32, read from the cache, and was never swept on its own."""
    arch = get_arch(arch) if isinstance(arch, str) else arch
    base = DecodeConfig(warps=2 if arch.is_amd else 4)
    if problem is not None and problem.A_dense:
        base = base.replace(a_dense=1)
    if problem is None:
        return base if layout is None else base.replace(layout=layout)
    n2 = max(16, pow2_at_least(problem.dstate))
    p2 = pow2_at_least(problem.headdim)
    if layout == "tiled" or (layout is None and n2 > 1024 and problem.tokens == 1):
        block_p = max(v for v in KNOB_BY_NAME["block_p"].values if v <= min(p2, 16))
        return base.replace(layout="tiled", block_n=min(128, n2), block_p=block_p)
    state_bytes = 4 if problem.state_dtype == "fp32" else 2
    block_p = max(1, min(p2, 4096 // (n2 * state_bytes), 128))
    per_thread = 32 if not arch.is_amd else 16   # the same elements per warp or wavefront
    warps = block_p * n2 // (per_thread * arch.warp_size)
    warps = max(v for v in KNOB_BY_NAME["warps"].values if v <= max(1, warps))
    return base.replace(layout=layout or "whole", block_p=block_p, warps=warps)


# --- how a decode problem is written on the command line (autossd.tuner.shapes) ----------------
# The decode step's grid: rows per step from one sequence to a served batch, each with its cache
# in fp32 or in the inputs' 16-bit type. The lookup's nearest tier reaches other batches.
GRID_DECODE_BATCHES = (1, 16, 64)


def _build(vals: dict, flags: dict, dtype: str, state_dtype: str | None) -> DecodeProblem:
    return DecodeProblem(dtype=dtype, state_dtype=state_dtype or "fp32", **vals, **flags)


def _mamba1(d_inner: int, d_state: int) -> dict:
    """A Mamba-1 layer's decode call: the state (batch, d_inner, d_state) as one head of headdim
    d_inner, its A (d_inner, d_state) dense, and z applied in the step (Mamba-1 has no gated norm)."""
    return {"nheads": 1, "headdim": d_inner, "dstate": d_state, "ngroups": 1, "A_dense": True, "has_z": True}


# Mamba-2's decode step passes D, dt_bias and softplus; z only when the layer has no gated norm
# (the default layer has one, as the forward's presets assume). b: rows per call; t: tokens per
# row of a multi-token step. Presets: the batches scripts/bench_decode.py measures. A Mamba-1
# model's prefix ("mamba-2.8b:b=64") sets its layer's one head, dense A and z.
FORM = ShapeForm(
    {"b": "batch", "t": "tokens", "h": "nheads", "p": "headdim", "n": "dstate", "g": "ngroups"},
    {"d": "has_D", "z": "has_z", "bias": "has_dt_bias", "softplus": "dt_softplus", "adense": "A_dense"},
    MODEL_FLAGS, {"batch": 1}, ("t",), "b=64,h=80,p=64,n=128,g=1", _build, states=True, defaults={"tokens": 1},
    presets=[{"batch": b} for b in (1, 16, 64)], grid=[{"batch": b} for b in GRID_DECODE_BATCHES],
    grid_states=lambda dtype, state_dtype: (state_dtype,) if state_dtype else ("fp32", dtype),
    mamba1_fields=_mamba1,
    help='"mamba2-2.7b:b=64", "mamba-2.8b:b=64" (Mamba-1) or "b=64,h=80,p=64,n=128,g=1"; keys b (rows per '
         "call), t (tokens per row, default 1), h p n g; flags d z bias softplus adense (A per channel and "
         "state), default d=1,bias=1,softplus=1 (z=0: the gated norm applies z; a Mamba-1 model sets z=1, adense=1)",
    preset_help="batches 1, 16, 64", grid_help="batch 1, 16, 64 x a cache in fp32 and in the inputs' type")
DecodeProblem.shape_form = FORM
