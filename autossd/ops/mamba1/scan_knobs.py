"""The selective scan's knobs (`sscan_fwd`, `sscan_bwd`), declared once, and the rules that tie
them to an arch and a problem.

Both kernels give one program a batch row and BLOCK_D channels, and walk the sequence in chunks
of CHUNK time steps, the state carried between chunks in fp32 registers; inside a chunk the
recurrence is a `tl.associative_scan` along time of (decay, input) pairs. The mode knob `scan`
picks how a chunk's tiles lie on the threads:
  assoc   (BLOCK_D, dstate, CHUNK) tiles in Triton's default layout, which spreads time across
          the lanes: the scan is all shuffles, a chunk's last state a reduction across lanes;
  serial  (CHUNK / lanes_t, dstate / lanes_n, BLOCK_D, lanes_t, lanes_n) tiles, so each thread
          holds a run of time steps and walks them in registers (lanes_t > 1: a short scan of the
          runs across lanes joins them), and the sum over the states is mostly in the thread.
          On the H200 its tuned records run the forward 1.5-3.2x and forward + backward
          1.3-3.9x faster than assoc's (1x2048, 8x2048, 1x65536 at Mamba 2.8b's width). The
          backward's walk from the chunk's end flips the thread's steps (tl.flip of an axis
          held in registers compiles to nothing), not the scan's reverse mode.
The static model sees bytes and tiles, not lanes: the layout and its lanes are measured_only (a
static tune keeps the default's serial layout and lanes).

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
    Knob("scan", ("assoc", "serial"), "serial",
         "the scan inside a chunk: assoc, an associative scan along time across threads; serial, tiles "
         "ordered so each thread holds a chunk's time steps and walks them in registers",
         measured_only=True),
    Knob("block_d", (1, 2, 4, 8, 16, 32, 64, 128, 256), 32, "channels per program", "scan"),
    Knob("chunk", (8, 16, 32, 64, 128), 16, "time steps per chunk (the scan's length; the checkpoints' spacing)",
         "scan"),
    Knob("warps", (1, 2, 4, 8), 4, "num_warps", "scan"),
    Knob("lanes_n", (1, 2, 4, 8, 16), 4,
         "serial: threads across the state axis (the rest of dstate in each thread's registers); the "
         "output's sum over the states takes log2 of it shuffles", "scan", depths=("serial",),
         measured_only=True),
    Knob("lanes_t", (1, 2, 4, 8), 1,
         "serial: threads along time within a chunk, each walking chunk / lanes_t steps (more threads "
         "at small batch; an exclusive scan of the segments across lanes and a fix-up per step)", "scan",
         depths=("serial",), measured_only=True),
    Knob("stages", (1, 2, 3), 1, "num_stages (software pipelining of the chunk loop's loads)", "scan"),
    # register cap per thread (ptxas -maxnreg), 0 = ptxas's choice. Cross-compiled for sm90 at
    # Mamba 2.8b's 8x2048, the H200's backward pick (8 channels, one warp, 4 state lanes, 8 steps)
    # takes 249 registers (8 warps an SM, the chunk loop latency-bound); a cap buys resident warps
    # at the cost of spills, which only a GPU can weigh
    Knob("maxnreg", (0, 96, 128, 168), 0, "register cap per thread, 0 = the compiler's choice", "scan",
         measured_only=True, needs=("maxnreg",)),
)

# A batch of one fills the GPU with channel blocks alone only thinly (Mamba 2.8b: 160 programs of
# 32 channels for 132 SMs), each walking the whole sequence. seq_split cuts the sequence into
# segments of whole chunks, a program each, at the price of walking all but one segment twice: a
# first launch finds each segment's end state (the forward) or its start gradient (the backward)
# from zero, and its decay; a second chains them. Both ops take it (the forward's and the
# backward's configs are tuned apart). On the H200 (Mamba 2.8b's width, bf16) the 8x2048 pick's
# layout (128 channels a program, a thread per channel, 8 steps) in 16 segments runs the batch-1
# forward 1.2-1.3x faster than the unsplit time-lane pick: 7.87 -> 6.04 ms at 1x65536, 0.250 ->
# 0.205 at 1x2048 (as many programs as 8x2048 has at 16 segments); the backward at 1x2048 took
# 8 segments of 8-channel single-warp programs, 1.225 -> 1.190 ms a training step.
# Cross-compiled for sm90 at 1x2048, 32 channels x 16 steps x 4 state lanes: the forward's main
# launch takes 158 registers against 122 unsplit (3 blocks per SM against 4: the entering state,
# loaded, costs what a zero state does not). 32 and 64 segments: for the backward in windows of
# whole segments at long batch-1 sequences (below, window).
SEQ_SPLIT = Knob("seq_split", (1, 2, 4, 8, 16, 32, 64), 1,
                 "serial: segments the sequence is cut into, one program each (two small launches first "
                 "summarize the segments and chain them)", "scan", depths=("serial",), measured_only=True)

# A time-varying B or C in a 16-bit type is converted to fp32 by every thread that reads a value
# of it, once per channel it serves: cross-compiled for sm90 at Mamba 2.8b's width, the forward's
# chunk loop spends 280 of its 1547 SASS instructions a thread at 8x2048 (a thread per channel, 16
# states in registers) and 171 of 1505 at the 1x2048 pick on those shifts. bc_f32 = 1 converts B
# and C to fp32 once before the launch (b x dstate x seqlen each: a small fraction of u's bytes at
# Mamba's widths): loops of 1195 and 1340 instructions, at 254 and 190 registers (two blocks an SM
# where there were three; at maxnreg 168, three blocks, 1316 and 1349 instructions, 104 and 32
# bytes spilled). The backward reads them the same way: its picks' loops 1754 -> 1680 (8x2048)
# and 1123 -> 1093 (1x2048) instructions at the same registers. measured_only: only a GPU can
# weigh instructions against occupancy. On the H200 the forward's records ran slower with it
# (8x2048 bf16: 0.871 -> 1.111 ms, 0.930 at a 168 cap; 1x2048: 0.252 -> 0.448, 0.263 capped)
BC_F32 = Knob("bc_f32", (0, 1), 0,
              "serial: 1, a time-varying B and C converted to fp32 before the launch, not by each thread "
              "at each read", "scan", depths=("serial",), measured_only=True)

# The training forward's checkpoints for a backward that walks windows and recomputes (the
# backward's window = 2): 1 renders the forward with strided checkpoints (each window's entering
# state, fp32) and a mode that walks one window from its checkpoint storing each chunk's entering
# state into a window-long buffer, no output. Inference stores nothing: the forward's tune never
# offers it (`excluded`), the backward's window = 2 sets it on the training forward's config.
CKPT_STRIDE = Knob("ckpt_stride", (0, 1), 0,
                   "serial: 1, a training forward storing one checkpoint a window, and its window recompute "
                   "(set by the backward's window = 2)", "scan", depths=("serial",), measured_only=True)

# A segment's entering state (seq_split's main launch) is read before the chunk loop, which
# carries it. Loaded as a plain (NA, BLOCK_D, NB) tile it takes a layout of its own, and Triton
# then converts the carried state through shared memory at every chunk: cross-compiled for sm90
# at the H200's batch-1 pick (128 channels, 8 steps, 16 segments) the main launch takes 254
# registers (two blocks an SM) and a 1578-instruction chunk loop with 20 barriers, where a zero
# entering state gives 166 (three blocks), 1550 and 4. state_in = 1 walks the segment's first
# chunk before the loop, from the loaded state, so that the loop carries the state the scan gives
# (a second copy of the chunk's code): the loop's 20 barriers drop to 4 and its shared-memory
# conversions go, at 246 registers; at a 168 cap three blocks fit an SM with 7 spill loads a
# chunk in the loop, where the plain load spills 53 loads and 40 stores there.
# window = 2's recompute launch walks its window's first chunk the same way, always.
STATE_IN = Knob("state_in", (0, 1), 0,
                "serial, seq_split > 1: 1, each segment's first chunk walked before the chunk loop, so that the "
                "loop carries the state in the scan's layout (0: the loaded state carried, converted at every "
                "chunk)", "scan", depths=("serial",),
                measured_only=True)

# delta' = softplus(delta + bias), once per channel and step, costs the serial forward's chunk loop
# about 30 instructions a step (an exp with range checks, then a ~20-instruction log): at a thread
# per channel (16 states, 8 steps) about 250 of its 1547 SASS instructions, cross-compiled for sm90
# at Mamba 2.8b's 8x2048. softplus_poly = 1 computes max(x, 0) + log1p(exp(-|x|)) with log1p as a
# degree-7 polynomial (relative error under 4e-7 in fp32, and right below -16, where
# log(1 + exp(x)) gives 0). Cross-compiled, loops of 1547 -> 1401 instructions at 8x2048 (168
# registers where 166), 1562 -> 1410 at the batch-1 pick, and 1790 -> 1617 at the backward's
# 1x2048 pick (the backward reads delta' again, so both ops take it); measured_only, as only a GPU
# weighs instruction counts.
SOFTPLUS_POLY = Knob("softplus_poly", (0, 1), 0,
                     "serial: 1, softplus as max(x, 0) + log1p(exp(-|x|)) with log1p a degree-7 polynomial "
                     "(0: log(1 + exp(x)))", "scan", depths=("serial",), measured_only=True)

# The serial forward's walk as a Gluon kernel (templates/mamba1_sscan_fwd/gluon.jinja): the same
# tiles with their layouts given, a group of lanes_n threads per channel holding its states and a
# chunk's steps, B and C staged a chunk at a time in shared memory as fp32 and read as broadcast
# rows. Cross-compiled for sm90 at Mamba 2.8b's width (a thread per channel, 8 steps): a chunk loop
# of about 8.6 SASS instructions an element-step with two barriers a chunk at 96 registers, where
# the tl kernel of the batch-1 pick takes 12.5 with 24 barriers at 168 and spills. H200 (bf16,
# graph replay, a standalone version of the kernel against the records, one run): 8x2048 0.838 ->
# 0.702 ms (2 warps, 16 steps), 1x2048 0.171 -> 0.149, 1x65536 4.81 -> 4.16 (16 segments). Its
# tiles are a fixed function of the serial knobs (block_d = 32 x warps / lanes_n, one time lane,
# no pipelining: violations), so a config with it names the serial kernel run where Gluon cannot
# (the interpreter; a backend other than CUDA never offers it).
# The backward takes it too (templates/mamba1_sscan_bwd/gluon.jinja): per chunk the states again
# from the checkpoint, kept in registers, then the walk back with every gradient; a time-varying dB
# and dC summed over the program's channels through shared memory, a thread per (step, state).
# Cross-compiled for sm90 at 2.8b's width (two state lanes a channel, one warp, 8 steps): about 31
# SASS instructions an element-step where the tl backward's pick takes 61. H200, measured tunes
# of the training step (graph ms, bf16): 1x2048 1.167 -> 1.009, 8x2048 6.04 -> 5.35, 4x8192
# 14.43 -> 11.71, 1x65536 35.75 -> 30.71 (16 segments). Beyond the forward's rules it keeps a
# chunk's states in registers (violations: at most 64 a thread); it walks windows (window = 1
# or 2) as the tl kernel does.
GLUON = Knob("gluon", (0, 1), 0,
             "serial: 1, the walk as a Gluon kernel with explicit layouts (B and C staged in shared memory "
             "as fp32), on NVIDIA GPUs; the serial tl kernel of the same config runs elsewhere", "scan",
             depths=("serial",), measured_only=True, needs=("cuda",))

FWD_SPACE = KnobSpace("sscan_fwd", take(SHARED) + (SEQ_SPLIT, BC_F32, CKPT_STRIDE, STATE_IN, SOFTPLUS_POLY, GLUON),
                      mode_knob="scan")
# The backward's time-varying dB / dC partials are (batch, channel blocks, dstate, seqlen) fp32 each:
# at Mamba 2.8b's 1 x 65536 with the H200 record's 4 channels a program, 5.4 GB each. window = 1
# walks the sequence in windows of whole chunks, one launch each from the last, the partials
# covering one window (at most WINDOW_BYTES each) and summed over the channel blocks before the
# next window's launch; the gradient carried between windows and the per-channel sums pass through
# memory. The backward switches a config to it where its partials would pass WINDOW_BYTES (a
# bound on memory, whatever the record says). H200, 2.8b 1x65536 bf16: 21 windows, the backward's
# launches 24.0 ms of GPU time against one launch's 22.5, a forward + backward's peak 5.8 GB against 15.4.
# window = 2: the same windows, and the checkpoints too: the training forward stores one a window
# (each window's entering state, fp32: b x windows x dim x dstate) where window = 1 keeps one a
# chunk (2.8b 1x65536 at chunk 8: 1.3 GB a layer in bf16); before each window's launch the
# forward's kernel walks that window again from its checkpoint, storing each chunk's entering
# state into a buffer one window long. The price: the forward's scan once more, without its output
# (H200, 2.8b bf16 forward + backward: 1x65536 52.4 ms against 43.1, peak 2.7 GB against 5.2).
# With seq_split, window = 1 walks windows of whole segments: the segments' start gradients first
# (their two small launches, over the whole sequence), then a main launch per window of segments
# from the last, each segment a program as without windows, its partials one window long. A
# window holds as many segments as keep a partial within WINDOW_BYTES, at least one (so the bound
# holds where a segment's partial fits it: at 1x65536 with 8-channel programs, segments of 4096
# steps or fewer). Without windows the H200's batch-1 records in 8 segments hold 2.7 GB a partial
# at 1x65536 (a 10.3 GB peak against CUDA's 3.2). The switch to windows whatever the record says
# stays with unsplit configs: a split one in windows has fewer programs a launch, which only a GPU
# can weigh.
WINDOW = Knob("window", (0, 1, 2), 0,
              "serial: 1, the sequence in windows (a launch each, from the last), the dB / dC partials "
              "bounded to one window; 2, and one checkpoint a window, each window's chunk states "
              "recomputed before its launch; 0, one launch with partials over the whole sequence", "scan",
              depths=("serial",), measured_only=True)
WINDOW_BYTES = 256 << 20

BWD_SPACE = KnobSpace("sscan_bwd", take(SHARED, defaults={"chunk": 8, "lanes_n": 8}) + (
    Knob("sub", (1, 2, 4, 8, 16, 32), 8,
         "channel blocks per program, one after another: their time-varying dB / dC partials summed in "
         "registers (fewer partial bytes written and read), their carried gradient and per-channel sums "
         "through the program's own rows of memory", "scan", depths=("assoc",)),
    Knob("ckpt_dtype", ("fp32", "bf16"), "fp32",
         "type of the chunk-start states the forward stores for the backward (bf16: half the bytes, the "
         "states rounded to 8 bits of mantissa before the backward's recompute)", "scan"),
    SEQ_SPLIT, WINDOW, BC_F32, SOFTPLUS_POLY, GLUON,
), mode_knob="scan")


class FwdConfig(BaseConfig):
    """A validated selective-scan forward config."""
    space = FWD_SPACE
    __slots__ = ()


class BwdConfig(BaseConfig):
    """A validated selective-scan backward config."""
    space = BWD_SPACE
    __slots__ = ()


def sub_blocks(config: BaseConfig) -> int:
    """Channel blocks a program runs one after another: the backward's `sub` in the assoc layout;
    one in the serial layout (its blocks are wide already) and in the forward."""
    return config.get("sub", 1) if config.scan == "assoc" else 1


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
    if config.scan == "serial":
        if config.block_d * config.lanes_n * config.lanes_t < threads:
            why.append(f"serial: block_d={config.block_d} x lanes_n={config.lanes_n} x lanes_t={config.lanes_t} < "
                       f"{threads} threads (the rest would spread a thread's own time steps across threads)")
        if config.lanes_t > config.chunk:
            why.append(f"serial: lanes_t={config.lanes_t} > chunk={config.chunk}")
        if config.get("window", 0) == 2 and config.get("seq_split", 1) > 1:
            why.append(f"window=2 recomputes each window's chunk states from one checkpoint a window; "
                       f"seq_split={config.seq_split} walks segments from their own start gradients: one or the other")
        if config.get("state_in", 0) and config.get("seq_split", 1) == 1:
            why.append("state_in=1 reads a segment's entering state: seq_split=1 has no segments")
        if config.get("ckpt_stride", 0) and config.get("seq_split", 1) > 1:
            why.append(f"ckpt_stride=1 walks the sequence in one program a channel block (its window recompute "
                       f"one window): seq_split={config.seq_split} cuts it into segments")
    if config.get("gluon", 0):
        why += gluon_violations(config, arch, problem)
    if problem is not None:
        per_thread = config.block_d * n2(problem) * config.chunk // threads
        cap = MAX_ELEMS_PER_THREAD[config.op]
        if per_thread > cap and not config.get("gluon", 0):
            why.append(f"a {config.block_d} x {n2(problem)} x {config.chunk} scan tile is {per_thread} elements "
                       f"per thread (> {cap}: registers spill)")
        span = config.block_d * sub_blocks(config)
        if problem.ngroups > 1 and problem.channels_per_group % span:
            why.append(f"block_d={config.block_d}{f' x sub={config.sub}' if config.get('sub', 1) > 1 else ''} does "
                       f"not divide the {problem.channels_per_group} channels of a group (a program reads one "
                       "group's B and C)")
    return why


def gluon_violations(config: BaseConfig, arch: Arch, problem: ScanProblem | None = None) -> list[str]:
    """Why a config cannot take gluon = 1: its tiles are one channel per group of lanes_n
    threads, one time lane, chunk steps in registers (at most 32), no pipelining, B and C staged
    by the kernel itself, the state carried in its own layout, no strided checkpoints."""
    why = []
    threads = config.warps * arch.warp_size
    if config.block_d * config.lanes_n != threads:
        why.append(f"gluon=1: block_d={config.block_d} x lanes_n={config.lanes_n} must be the {threads} threads "
                   "(one channel per group of lanes_n threads)")
    for name, want in (("lanes_t", 1), ("stages", 1), ("bc_f32", 0), ("state_in", 0), ("ckpt_stride", 0)):
        if config.get(name, want) != want:
            why.append(f"gluon=1 takes {name}={want} (got {config.get(name)})")
    if config.chunk > 32:
        why.append(f"gluon=1: chunk={config.chunk} > 32 steps in each thread's registers")
    states = n2(problem) if problem is not None else 16
    if config.lanes_n > states:
        why.append(f"gluon=1: lanes_n={config.lanes_n} > the {states} padded states")
    if config.op == "sscan_bwd":
        # the backward keeps a chunk's states in registers (chunk x states / lanes_n a thread);
        # its dB / dC channel sums give each thread a (step, state) pair, min(states, 32) threads
        # across the states, the warps along the steps; the products of a chunk in shared memory
        held = config.chunk * states // config.lanes_n
        if held > 64:
            why.append(f"gluon=1: chunk={config.chunk} x {states} states / lanes_n={config.lanes_n} = {held} "
                       "states a thread kept in registers (> 64)")
        rows = config.warps * arch.warp_size // min(states, 32)
        if config.chunk < rows:
            why.append(f"gluon=1: chunk={config.chunk} < {rows} steps (warps={config.warps} x "
                       f"{arch.warp_size // min(states, 32)} for the channel sums)")
        smem = 4 * states * config.chunk * (2 * config.block_d + 2)
        if smem > arch.smem_per_block:
            why.append(f"gluon=1: {smem} bytes of shared memory > {arch.smem_per_block}")
    return why


# the assoc layout's first guess (its tile of about 32 (forward) or 16 (backward) state elements
# per thread): channels per program and chunk
ASSOC_GUESS = {"sscan_fwd": dict(block_d=8, chunk=32), "sscan_bwd": dict(block_d=4, chunk=32)}


def _assoc_default(space_config: type, arch: Arch, problem: ScanProblem | None) -> BaseConfig:
    """The assoc layout: a tile of about 32 (forward) or 16 (backward) state elements per thread
    at 4 warps (2 wavefronts of 64 on AMD), 32 time steps a chunk; channels per program halved
    until the tile fits and, with groups, divides a group's channels; then the backward's blocks
    per program halved until they divide a group's channels and stay within the padded dim."""
    cfg = space_config(scan="assoc", warps=2 if arch.is_amd else 4, **ASSOC_GUESS[space_config.space.op])
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


def _halves(v: int, low: int = 1) -> list[int]:
    out = []
    while v >= low:
        out.append(v)
        v //= 2
    return out


def _serial_fit(cfg: BaseConfig, arch: Arch, problem: ScanProblem, keep_chunk: bool = False) -> BaseConfig:
    """The first config near `cfg` that runs `problem` in the serial layout: channels per program
    capped at the padded dim, then (most preferred first) other threads across the states, more
    threads along time, fewer warps, a shorter chunk (unless keep_chunk), fewer channels."""
    block0 = min(cfg.block_d, pow2_at_least(problem.dim))
    chunks = [cfg.chunk] if keep_chunk else _halves(min(cfg.chunk, max(8, pow2_at_least(problem.seqlen))), 8)
    lanes_n = [cfg.lanes_n] + [v for v in (8, 16, 2, 1) if v != cfg.lanes_n]
    for block in _halves(block0):
        for chunk in chunks:
            for warps in _halves(cfg.warps):
                for lt in [v for v in (1, 2, 4, 8) if v >= cfg.lanes_t]:
                    for ln in lanes_n:
                        c = cfg.replace(block_d=block, chunk=chunk, warps=warps, lanes_t=lt, lanes_n=ln)
                        if not violations(c, arch, problem):
                            return c
    return cfg


def _default(space_config: type, arch: Arch | str, problem: ScanProblem | None, scan: str | None = None) -> BaseConfig:
    """The serial layout, fitted to the problem by _serial_fit; scan="assoc": that layout's own
    first guess. Measured on the H200 (2026-11-28, Mamba 2.8b's width, bf16): the forward's 32
    channels x 16 steps x 4 state lanes runs 1.31-1.34x the tuned records' time at 1x2048,
    8x2048 and 1x65536; the backward's 32 x 8 x 8 lanes takes 1.4-1.6x the tuned single-warp
    programs' step at 1x2048 and 8x2048. Not measured on other arches: a first guess the tuner
    starts from."""
    arch = get_arch(arch) if isinstance(arch, str) else arch
    if scan == "assoc":
        return _assoc_default(space_config, arch, problem)
    cfg = space_config(warps=2 if arch.is_amd else 4)
    return cfg if problem is None else _serial_fit(cfg, arch, problem)


def fwd_default_config(arch: Arch | str, problem: ScanProblem | None = None, scan: str | None = None) -> FwdConfig:
    """`scan`: the default at that mode (the tuner asks for it when the mode is pinned)."""
    return _default(FwdConfig, arch, problem, scan)


def bwd_default_config(arch: Arch | str, problem: ScanProblem | None = None, scan: str | None = None) -> BwdConfig:
    return _default(BwdConfig, arch, problem, scan)


def fit(config: BaseConfig, arch: Arch | str, problem: ScanProblem) -> BaseConfig:
    """`config` made to run `problem` at its own chunk (a training forward takes the backward's
    chunk, which may not fit the forward's tile): assoc, its channels per program halved; serial,
    the nearest config _serial_fit finds."""
    arch = get_arch(arch) if isinstance(arch, str) else arch
    if config.scan == "serial":
        if config.get("gluon", 0) and violations(config, arch, problem):
            config = config.replace(gluon=0)   # its tiles follow from the serial knobs: the tl kernel's fit instead
        return config if not violations(config, arch, problem) else _serial_fit(config, arch, problem, keep_chunk=True)
    while violations(config, arch, problem) and config.block_d > 1:
        config = config.replace(block_d=config.block_d // 2)
    return config


# Starting points the tuner tries right after the default, measured on the H200 (2026-11-28, Mamba
# 2.8b's width, bf16): the forward's best at batch 1 (time lanes), at 8x2048 (a thread per channel
# and state, or two state lanes), and single-warp programs; the backward's single-warp programs
# (the tuned pick at 1x2048 and 1x8192: no reduction across warps, whose barriers stall the
# chunk loop), the sweep's best at 8x2048, and the default with its loads pipelined; register caps
# (where the arch offers them) on the batch-1 picks; the sequence in segments at batch 1 (the
# H200's batch-1 picks since 2026-11-29).
SEED_FAMILIES = {
    "sscan_fwd": (dict(block_d=16, chunk=32, lanes_n=4, lanes_t=2), dict(block_d=128, chunk=8, lanes_n=1),
                  dict(block_d=128, chunk=8, lanes_n=1, seq_split=16),
                  # two channels a thread, two state lanes: each B and C value converted from 16
                  # bits once for both channels. Cross-compiled for sm90 at 2.8b 8x2048 bf16: a
                  # chunk loop of 10.9 instructions an element-step against the pick's 12.1 (230
                  # conversion shifts and permutes a chunk against 422), 168 registers, three blocks
                  # an SM; in 16 segments with state_in, the same loop at 168 registers where the
                  # one-lane layout takes 246
                  dict(block_d=128, chunk=8, lanes_n=2),
                  dict(block_d=128, chunk=8, lanes_n=2, seq_split=16, state_in=1),
                  dict(block_d=64, chunk=8, lanes_n=2, warps=2, seq_split=16, state_in=1),
                  dict(block_d=64, chunk=8, lanes_n=2), dict(block_d=8, chunk=16, lanes_n=4, warps=1),
                  dict(block_d=16, chunk=32, lanes_n=2, lanes_t=4), dict(stages=2),
                  dict(block_d=16, chunk=32, lanes_n=4, lanes_t=2, maxnreg=128),
                  # cross-compiled: 246 registers uncapped; at 168, three blocks an SM, the chunk
                  # loop's spills 7 loads a chunk (the plain state load's: 53 loads and 40 stores)
                  dict(block_d=128, chunk=8, lanes_n=1, seq_split=16, state_in=1),
                  dict(block_d=128, chunk=8, lanes_n=1, seq_split=16, state_in=1, maxnreg=168),
                  dict(block_d=64, chunk=8, lanes_n=2, seq_split=8),
                  # the H200's picks with softplus_poly (cross-compiled: 9-10% shorter loops)
                  dict(block_d=128, chunk=8, lanes_n=1, softplus_poly=1),
                  dict(block_d=128, chunk=8, lanes_n=1, seq_split=16, state_in=1, maxnreg=168, softplus_poly=1),
                  # the Gluon walk (gluon = 1): the standalone kernel's best on the H200 at 8x2048
                  # (2 warps, 16 steps), 1x2048 (2 warps, 8 steps, 16 segments) and 1x65536 (4
                  # warps, 16 steps, 16 segments); two state lanes a channel (twice the threads)
                  dict(block_d=64, warps=2, chunk=16, lanes_n=1, gluon=1, softplus_poly=1),
                  dict(block_d=64, warps=2, chunk=8, lanes_n=1, seq_split=16, gluon=1, softplus_poly=1),
                  dict(block_d=128, warps=4, chunk=16, lanes_n=1, seq_split=16, gluon=1, softplus_poly=1),
                  dict(block_d=64, warps=4, chunk=16, lanes_n=2, gluon=1, softplus_poly=1),
                  dict(block_d=64, warps=4, chunk=16, lanes_n=2, seq_split=8, gluon=1, softplus_poly=1)),
    "sscan_bwd": (dict(block_d=4, chunk=8, lanes_n=8, warps=1),
                  dict(block_d=4, chunk=8, lanes_n=8, warps=1, ckpt_dtype="bf16"),
                  dict(block_d=8, chunk=8, lanes_n=4, warps=1), dict(block_d=4, chunk=16, lanes_n=8, warps=1),
                  dict(block_d=64, chunk=8, lanes_n=4), dict(stages=2),
                  # cross-compiled: 128 registers, 40 bytes of spills, 16 warps an SM where 12 fit
                  dict(block_d=4, chunk=8, lanes_n=8, warps=1, maxnreg=128),
                  dict(block_d=8, chunk=8, lanes_n=4, warps=1, seq_split=8),
                  # batch 1 past 2048 tokens, where the unsplit records run 1280 single-warp
                  # programs (about 10 warps an SM): the 4-channel layout in segments,
                  # cross-compiled for sm90 at 1x65536 at 168 registers and 12 blocks an SM (the
                  # 8-channel one at 252 and 8), its checkpoints in either type
                  dict(block_d=4, chunk=8, lanes_n=8, warps=1, seq_split=8),
                  dict(block_d=4, chunk=8, lanes_n=8, warps=1, seq_split=16, ckpt_dtype="bf16"),
                  dict(block_d=4, chunk=8, lanes_n=8, warps=1, seq_split=4),
                  dict(block_d=8, chunk=8, lanes_n=4, warps=1, softplus_poly=1),
                  dict(block_d=8, chunk=8, lanes_n=4, warps=1, seq_split=8, softplus_poly=1),
                  # long batch-1 sequences: the H200's pick above in windows of whole segments,
                  # its partials within WINDOW_BYTES (at 1x65536: 11 windows of 6 or 3 segments)
                  dict(block_d=8, chunk=8, lanes_n=4, warps=1, seq_split=64, window=1, softplus_poly=1),
                  dict(block_d=8, chunk=8, lanes_n=4, warps=1, seq_split=32, window=1, softplus_poly=1),
                  # the Gluon walk (gluon = 1): a standalone version's best on the H200 (two state
                  # lanes a channel, one warp, 8 steps; 16 segments at batch 1), and two warps
                  dict(block_d=16, warps=1, chunk=8, lanes_n=2, gluon=1, softplus_poly=1),
                  dict(block_d=16, warps=1, chunk=8, lanes_n=2, seq_split=16, gluon=1, softplus_poly=1),
                  dict(block_d=16, warps=1, chunk=8, lanes_n=2, seq_split=8, gluon=1, softplus_poly=1),
                  dict(block_d=32, warps=2, chunk=8, lanes_n=2, gluon=1, softplus_poly=1),
                  # long batch-1 sequences within the memory bound: its segments in windows
                  dict(block_d=16, warps=1, chunk=8, lanes_n=2, seq_split=64, window=1, gluon=1, softplus_poly=1)),
}


def seed_configs(arch: Arch | str, problem: ScanProblem, space) -> list[BaseConfig]:
    """The default first (fitted to the problem), then SEED_FAMILIES fitted by _serial_fit: only
    those inside the space (a pinned knob refuses the others) and feasible, each once."""
    arch = get_arch(arch) if isinstance(arch, str) else arch
    cls = FwdConfig if space.op == "sscan_fwd" else BwdConfig
    base = _default(cls, arch, problem, space.pinned.get("scan"))
    cands = [base]
    if base.scan == "serial":
        cands += [_serial_fit(base.replace(**fam), arch, problem) for fam in SEED_FAMILIES[space.op]]
    out: list[BaseConfig] = []
    for cand in cands:
        if cand not in out and space.params(cand) is not None and not violations(cand, arch, problem):
            out.append(cand)
    return out
