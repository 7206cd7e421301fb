"""The selective scan's knobs (`sscan_fwd`, `sscan_bwd`), declared once, and the rules that tie
them to an arch and a problem.

Both kernels give one program a batch row and BLOCK_D channels, and walk the sequence in chunks
of CHUNK time steps; inside a chunk the recurrence is a `tl.associative_scan` along time of
(BLOCK_D, dstate, CHUNK) tiles of (decay, input) pairs, the state carried between chunks in fp32
registers. The mode knob `scan` has one value, "assoc": a sequential walk inside a chunk would
take a time step's column out of a register tile (a reduction over the chunk per step: O(CHUNK²)
per chunk) or load each step from memory along the channel axis (strided, uncoalesced: time is
the contiguous axis), so it is not offered.

The backward's `chunk` is also the spacing of the checkpoints (each chunk's entering state) the
forward stores when gradients are wanted, and `ckpt_dtype` their type: a training forward runs its
own config with the backward's chunk and checkpoint type (a forward tune times inference, which
stores none, so these are the backward's knobs).
"""
from __future__ import annotations

from ...arch import Arch, get_arch
from ...knobs import BaseConfig, Knob, KnobSpace, pow2_at_least, take
from .problem import ScanProblem

# fp32 elements of one (BLOCK_D, dstate, CHUNK) tile per thread past which registers spill: the
# forward holds about four such tiles at once (decay, input, their scans), the backward about ten
MAX_ELEMS_PER_THREAD = {"sscan_fwd": 128, "sscan_bwd": 64}

# the knobs both kernels have, declared once (each op takes them with its own defaults)
SHARED: tuple[Knob, ...] = (
    Knob("scan", ("assoc",), "assoc", "the scan inside a chunk: an associative scan along time"),
    Knob("block_d", (1, 2, 4, 8, 16, 32, 64), 8, "channels per program", "scan"),
    Knob("chunk", (16, 32, 64, 128), 32, "time steps per chunk (the associative scan's length)", "scan"),
    Knob("warps", (1, 2, 4, 8), 4, "num_warps", "scan"),
    Knob("stages", (1, 2, 3), 1, "num_stages (software pipelining of the chunk loop's loads)", "scan"),
)

FWD_SPACE = KnobSpace("sscan_fwd", take(SHARED), mode_knob="scan")
BWD_SPACE = KnobSpace("sscan_bwd", take(SHARED, defaults={"block_d": 4}) + (
    Knob("sub", (1, 2, 4, 8, 16, 32), 8,
         "channel blocks per program, one after another: their time-varying dB / dC partials summed in "
         "registers (fewer partial bytes written and read), their carried gradient and per-channel sums "
         "through the program's own rows of memory", "scan"),
    Knob("ckpt_dtype", ("fp32", "bf16"), "fp32",
         "type of the chunk-start states the forward stores for the backward (bf16: half the bytes, the "
         "states rounded to 8 bits of mantissa before the backward's recompute)", "scan"),
), mode_knob="scan")


class FwdConfig(BaseConfig):
    """A validated selective-scan forward config."""
    space = FWD_SPACE
    __slots__ = ()


class BwdConfig(BaseConfig):
    """A validated selective-scan backward config."""
    space = BWD_SPACE
    __slots__ = ()


def n2(problem: ScanProblem) -> int:
    """dstate padded to the power of two the state tile covers (at least 16: the smallest
    dimension Triton tiles well)."""
    return max(16, pow2_at_least(problem.dstate))


def caps(problem: ScanProblem) -> dict[str, int]:
    """Largest useful value per knob: tiles past the padded channels or length are masked work
    (the backward's sub: block_d x sub channels past the padded dim; bounded by block_d's own cap
    here, and by violations where the product passes it)."""
    return {"block_d": pow2_at_least(problem.dim), "chunk": max(16, pow2_at_least(problem.seqlen))}


def violations(config: BaseConfig, arch: Arch | str, problem: ScanProblem | None = None) -> list[str]:
    """Reasons a config cannot run on an arch (and problem); empty when it is feasible."""
    arch = get_arch(arch) if isinstance(arch, str) else arch
    why = config.space.arch_violations(config, arch)
    threads = config.warps * arch.warp_size
    if threads > 1024:
        why.append(f"warps={config.warps} x warp {arch.warp_size} > 1024 threads")
    if problem is not None:
        per_thread = config.block_d * n2(problem) * config.chunk // threads
        cap = MAX_ELEMS_PER_THREAD[config.op]
        if per_thread > cap:
            why.append(f"a {config.block_d} x {n2(problem)} x {config.chunk} scan tile is {per_thread} elements "
                       f"per thread (> {cap}: registers spill)")
        span = config.block_d * config.get("sub", 1)
        if problem.ngroups > 1 and problem.channels_per_group % span:
            why.append(f"block_d={config.block_d}{f' x sub={config.sub}' if config.get('sub', 1) > 1 else ''} does "
                       f"not divide the {problem.channels_per_group} channels of a group (a program reads one "
                       "group's B and C)")
    return why


def _default(space_config: type, arch: Arch | str, problem: ScanProblem | None) -> BaseConfig:
    """A tile of about 32 (forward) or 16 (backward) state elements per thread at 4 warps (2
    wavefronts of 64 on AMD), 32 time steps a chunk; channels per program halved until the tile
    fits and, with groups, divides a group's channels; then the backward's blocks per program
    halved until they divide a group's channels and stay within the padded dim. Not measured
    yet: a first guess the tuner starts from."""
    arch = get_arch(arch) if isinstance(arch, str) else arch
    cfg = space_config(warps=2 if arch.is_amd else 4)
    if problem is None:
        return cfg
    chunk = min(cfg.chunk, max(16, pow2_at_least(problem.seqlen)))
    sub = cfg.get("sub")
    cfg = cfg.replace(chunk=chunk, **({"sub": 1} if sub else {}))   # the tile first, then its blocks
    block = cfg.block_d
    while block > 1 and (violations(cfg.replace(block_d=block), arch, problem)
                         or block > pow2_at_least(problem.dim)):
        block //= 2
    cfg = cfg.replace(block_d=block)
    while violations(cfg, arch, problem) and cfg.chunk > 16:
        cfg = cfg.replace(chunk=cfg.chunk // 2)
    if sub:
        cfg = cfg.replace(sub=sub)
    while sub and cfg.sub > 1 and (
            violations(cfg, arch, problem) or cfg.block_d * cfg.sub > pow2_at_least(problem.dim)):
        cfg = cfg.replace(sub=cfg.sub // 2)
    return cfg


def fwd_default_config(arch: Arch | str, problem: ScanProblem | None = None, scan: str | None = None) -> FwdConfig:
    """`scan`: the default at that mode (the tuner asks for it when the mode is pinned; one mode)."""
    return _default(FwdConfig, arch, problem)


def bwd_default_config(arch: Arch | str, problem: ScanProblem | None = None, scan: str | None = None) -> BwdConfig:
    return _default(BwdConfig, arch, problem)


def fit(config: BaseConfig, arch: Arch | str, problem: ScanProblem) -> BaseConfig:
    """`config` with its channels per program halved until it runs `problem` (a training forward
    takes the backward's chunk, which may not fit the forward's tile)."""
    while violations(config, arch, problem) and config.block_d > 1:
        config = config.replace(block_d=config.block_d // 2)
    return config
