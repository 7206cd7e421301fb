"""The SSD backward's knobs (`ssd_bwd`), declared once, and the rules that tie them to an arch and a
problem. The mode knob is `cb`: whether C·Bᵀ is computed once per (chunk, group) by a stage of
its own and read by the dx kernel ("stage"), or recomputed by the dx kernel from B and C tiles
("inline": one launch and one (b, c, g, Q, Q) fp32 buffer fewer, more matmul work per head).
"""
from __future__ import annotations

from ...arch import Arch, get_arch
from ...knobs import (BaseConfig, ConfigError, Knob, KnobSpace, pow2_at_least, shrink,  # noqa: F401 (ConfigError: re-exported)
                      state_dtype_excluded, take)
from .stage_knobs import BMM, CHUNK, CHUNK_STATE, CUMSUM, STATE_PASSING, TILES, gluon_problem_violations

# the dx and dCB kernels' register caps. 168 fits three 4-warp CTAs per SM: the four-head dCB
# (dcb_heads = 4, 32 x 32 tiles) takes 248 registers uncapped (two CTAs) and spills 80 bytes at
# 168 (cross-compiled for sm90 at mamba2-2.7b), which only a GPU can weigh
MAXNREG = (0, 96, 128, 168)

KNOBS: tuple[Knob, ...] = (
    Knob("cb", ("stage", "inline"), "stage",
         "C·Bᵀ for the dx kernel: a stage of its own (stored once per chunk and group) or recomputed inline"),
    *take(CHUNK, ("chunk_size",), defaults={"chunk_size": 128}),
    # the entering state of every chunk: recomputed by the backward (two launches, nothing kept
    # between forward and backward) or kept from the forward's own state passing (memory held from
    # forward to backward: b x chunks x h x p x n in state_dtype)
    Knob("save_states", (0, 1), 0, "1: the forward keeps its chunk states for the backward; 0: recompute them"),
    *take(CHUNK, ("state_dtype",), docs={
        "state_dtype": "storage dtype of the chunk states the backward reads (recomputed or saved)"}),
    *take(CUMSUM, defaults={"cumsum_block_h": 4}, docs={
        "cumsum_block_h": "heads per program (dt cumsum and the ddt reduction)"}),
    # the tiles serve the chunk states and their gradients; the state passings' blocks both of
    # them (forward and reverse); the backward's kernels take no 4-stage pipeline nor 2048-element
    # passing blocks
    *take(CHUNK_STATE, ("state_block_m", "state_block_n", "state_block_k", "state_warps", "state_stages"),
          values={"state_stages": (1, 2, 3)}),
    *take(STATE_PASSING, defaults={"pass_block": 1024}, values={"pass_block": (64, 128, 256, 512, 1024)}),
    *take(BMM, ("bmm_block_m", "bmm_block_n", "bmm_warps"), depths=("stage",)),
    # the staged C·Bᵀ in the inputs' 16-bit type: half the buffer and half the dx program's
    # registers for its tile (the fp32 tile held dx at 173 registers and 2 blocks per SM on the
    # H100), at one more rounding of C·Bᵀ before the decay (dx's causal product rounds the
    # decayed weights to 16 bits anyway); dx is the only reader, so no other gradient sees it
    # measured_only: the static model sees the smaller buffer, not the accuracy it costs nor dx's
    # registers, so a static tune would always take it
    Knob("cb_dtype", ("fp32", "input"), "fp32", "the staged C·Bᵀ's storage type: fp32, or the inputs' type",
         "bmm", depths=("stage",), measured_only=True),
    Knob("dx_block_m", TILES, 64, "rows (time) per dx program", "dx"),
    Knob("dx_block_n", TILES, 64, "headdim per dx program", "dx"),
    Knob("dx_block_k", TILES, 32, "time step of the dx program's causal product", "dx"),
    Knob("dx_block_d", TILES, 64, "dstate step of the dx program's state product", "dx"),
    # the state's part of dx at 16-bit inputs: G (fp32) as one 16-bit operand, or as two (G's
    # rounding and its remainder: ~16 significant bits, twice the products). The dt / dA
    # gradients sum the state's x·dx over a chunk's tokens, where G's rounding, shared by every
    # token, adds up rather than averaging out.
    # (H200, mamba2-2.7b 8 x 2048 bf16: one operand took dx 838 -> 800 us, while the worst bf16
    # dA error of the GPU check went 2.3e-4 -> 3.6e-3, past mamba_ssm's typical 3e-3; the
    # tuner's gate, which holds every gradient to its bound, passed one operand at each training
    # shape, worst 2.9e-3 in bf16 as with two, and the shipped sm90 records use it)
    Knob("dx_g_split", (1, 2), 2, "16-bit operands G is carried in, in dx's state product", "dx"),
    Knob("dx_warps", (2, 4, 8), 4, "num_warps", "dx"),
    # register cap per thread (ptxas -maxnreg), 0 = ptxas's choice. ncu of the shipped record's dx
    # and dCB (H200, mamba2-2.7b 8 x 2048 bf16): 168 registers, 3 blocks of 4 warps per SM, 17-19%
    # achieved occupancy, latency-bound (7.4 cycles per issued instruction); a cap buys resident
    # blocks at the cost of spills, which only a GPU can weigh (measured_only). Cross-compiled
    # for sm90 at that shape: dx at 128 takes 4 blocks per SM, spilling nothing at the arch
    # default and 16 bytes at the record's knobs; at 96, 5 blocks and 152 bytes; dCB at 128, 4
    # blocks and 8 bytes; at 96, 5 and 128 (scripts/compile_report.py --op ssd_bwd --set dx_maxnreg=128).
    # Measured on an H200 from the record's config: both at 128 took dx 796 -> 718 us and dCB
    # 523 -> 466 (step 2852 -> 2720) with bitwise the same gradients, and the H200's training
    # records carry them; 0 stays the default, the caps being measured at the records' tiles only.
    # The Gluon dx (dx_gluon = 1) takes the cap as well. ncu on an H200 at 2.7b 4 x 16384 bf16:
    # 216 registers, 2 blocks of one warpgroup per SM (its 75 KB of shared memory would fit 3),
    # 12% achieved occupancy; capped at 168 it fits 3 (56 bytes spilled, cross-compiled), and dx took
    # 1731 -> 1583 us (at 128, 1922)
    Knob("dx_maxnreg", MAXNREG, 0, "register cap per thread of the dx kernel, 0 = compiler's choice", "dx",
         measured_only=True, needs=("maxnreg",)),
    Knob("dx_stages", (1, 2, 3), 2, "num_stages", "dx"),
    # 1: dx in Gluon for sm90 (templates/ssd_bwd/dx_gluon.jinja), the forward's chunk-walking
    # scan run in reverse time: one program per (headdim tile, head, chunk) walks the chunk's row
    # tiles from the last, its dy blocks resident in shared memory and scaled there, the staged
    # C·Bᵀ (16-bit) and B by TMA through a ring, every MMA a wgmma. It reads the bmm stage's C·Bᵀ
    # in the inputs' type: needs cb = "stage", cb_dtype = "input". A call it cannot take (seq_idx,
    # strides TMA cannot address) runs the tl kernel of the same config. measured_only: the
    # static model cannot rank a data path.
    # 2: the same products with each row tile's global loads (x, dA, dt) issued ahead of the ring's
    # waits, x held in 16 bits while live, and the blocks' boundary dA loaded once a program (H200,
    # 2.7b 4x16384 bf16 no z, capped at 168: dx 1592 -> 1548 us; the H200's records but codestral
    # bf16's take it)
    # 3: as 2, the state's part B_s Grᵀ in the accumulator the blocks after the diagonal share (its
    # row factor exp(A_last - dA_s) split into a scalar applied before them and the rows' own
    # scaling after), so one 64 x 64 fp32 tile is live across the row tile's MMAs where 2 holds two
    # (H200, 2.7b 4x16384 bf16 no z: dx 1553 -> 1515 us; every H200 record takes it)
    Knob("dx_gluon", (0, 1, 2, 3), 0, "1: dx in Gluon, the forward's chunk-walking scan in reverse time (sm90); "
         "2: with its loads issued ahead of the MMAs; 3: and one accumulator", "dx",
         measured_only=True, needs=("tma", "wgmma")),
    # 1: the dstates stage and the reverse state passing as one Gluon launch for sm90
    # (templates/ssd_bwd/state_walk_rev_gluon.jinja), the forward's state walk run backwards
    # over the chunks: one program per (headdim tile, dstate tile, head, batch) carries the
    # gradient wrt the state leaving a chunk in the wgmma's accumulator, dy and C by TMA through a
    # ring; the per-chunk gradients from the chunks' own outputs (b x chunks x h x p x n in fp32)
    # are neither written nor read back. A call it cannot take runs the two tl stages.
    # measured_only: the static model cannot rank a data path.
    # 2: the same walk on 64-wide dstate tiles: at dstate 128 twice the programs (2.7b 4x16384: 640
    # of one warpgroup where 320 ran), each with half the accumulator. At 240-245 registers two CTAs
    # fit an SM, so 320 programs on 132 SMs run as a full wave and a fifth of one, each program
    # walking all 64 chunks: the walk took 622 us where the forward's, at three CTAs an SM (one
    # wave), takes about half. dy is read by both dstate tiles of a head (from L2 where they run
    # side by side). On the H200 the 64-wide walk (159 registers, three CTAs an SM) took 626 ->
    # 560 us at 2.7b 4x16384 bf16 and 1062 -> 992 at 1x65536; the H200's records take it but at
    # 8x2048, where it did not win
    Knob("rev_walk", (0, 1, 2), 0, "1: dstates + the reverse state passing as one Gluon walk (sm90); "
         "2: on 64-wide dstate tiles",
         "state_passing_rev", measured_only=True, needs=("tma", "wgmma")),
    # register cap of the reverse Gluon walk (rev_walk 1 or 2 only; 0 = ptxas's choice). ncu on an
    # H200 (2.7b 4 x 16384 bf16): about 245 registers, so two CTAs of one warpgroup an SM where its
    # 66 KB of shared memory would fit three, 11% achieved occupancy; at 168 three fit. As for dx,
    # whose cap at 168 took it 1731 -> 1583 us there, only a GPU can weigh the spills
    Knob("rev_walk_maxnreg", MAXNREG, 0, "register cap per thread of the reverse Gluon walk, 0 = compiler's "
         "choice", "state_passing_rev", measured_only=True, needs=("maxnreg",)),
    # 1: the recomputed chunk states (save_states = 0) by the forward's Gluon walk for sm90
    # (templates/ssd/state_walk_gluon.jinja, the same kernel the forward runs), in place of the
    # chunk-state and state-passing stages: one launch, no local states written and read back.
    # The walk stores its accumulator rounded to the states' type, so 16-bit inputs need states
    # in that type. A call it cannot take runs the two tl stages. measured_only: the static model
    # cannot rank a data path
    # 2: the same with the walk's 64-token ring: cross-compiled for sm90 at the H200 record (2.7b
    # bf16), its shared memory leaves room for more CTAs than the 128-token ring's 115 KB (two);
    # on the H200 there the walk took 711 -> 612 us, and the records take it
    # 3: the 64-token ring on 64-wide dstate tiles, twice the programs (a batch of one at 2.7b: 160
    # programs where 80 leave most of 132 SMs idle, each walking every chunk of the sequence). On
    # the H200 slower at every training shape (2.7b 1x65536 bf16: 1092 -> 1117 us; 4x16384: 614 ->
    # 756): no record takes it
    Knob("recompute_walk", (0, 1, 2, 3), 0, "1: the recomputed chunk states by the forward's Gluon walk (sm90); "
         "2: with its 64-token ring; 3: and 64-wide dstate tiles",
         "chunk_state", measured_only=True, needs=("tma", "wgmma")),
    Knob("dbc_block_m", TILES, 64, "rows (time) per dB / dC program", "dbc"),
    Knob("dbc_block_n", TILES, 64, "dstate per dB / dC program", "dbc"),
    Knob("dbc_block_k", TILES, 32, "time step of the dB / dC programs' causal products", "dbc"),
    # 1: dB's per-row weights (the decay to the chunk's end times dt') folded into x before its
    # product with the state gradient, rounded to x's type (one 16-bit rounding more per element
    # at 16-bit inputs), so that each head's product accumulates into dB's tile in place instead
    # of into a second fp32 tile scaled and added after. measured_only: the static model cannot
    # see the accumulator it saves nor the rounding it costs
    Knob("db_fold", (0, 1), 0, "1: dB's row weights folded into x before its product (accumulates in place)",
         "dbc", measured_only=True),
    Knob("dcb_block_m", TILES, 64, "rows (time t) per dCB program", "dcb"),
    Knob("dcb_block_k", TILES, 32, "columns (time s) per dCB program", "dcb"),
    Knob("dcb_warps", (2, 4, 8), 4, "num_warps of the dCB stage", "dcb"),
    # the dCB stage's loop over heads holds no accumulator of dB's or dC's size, so it has the
    # registers for the next heads' tiles in flight (H200, mamba2-2.7b 8 x 2048 bf16: dCB 641
    # us at one stage, 608 at two, 536 at three)
    Knob("dcb_stages", (1, 2, 3), 3, "num_stages of the dCB stage", "dcb"),
    # heads per step of the dCB stage's loop, as one batched product with the heads' axis
    # leading (a warp per head): each head's row and column sums (the dt and dA terms) stay
    # within the warp that holds its tile instead of crossing warps once per head, and the sum
    # over the heads is taken once per program. Cross-compiled for sm90 at mamba2-2.7b, the
    # loop's SASS per head and tile element: 30 instructions at the record's 32 x 64 tiles, one
    # head a step; 18 at 32 x 32, four heads (248 registers, no spill). Measured on an H200
    # (4 x 16384 bf16, the record's config otherwise): dCB 1592 -> 1343 us at 32 x 32 tiles,
    # four heads, three stages, no register cap (8 x 2048: 468 -> 352); wider tiles spill and
    # lose (32 x 64: 2009 us), and two heads a step loses at four warps (2480). measured_only:
    # the static model prices the stage's bytes and products, not where its sums run
    Knob("dcb_heads", (1, 2, 4), 1, "heads per step of the dCB stage's loop (one batched product)", "dcb",
         measured_only=True),
    Knob("dcb_maxnreg", MAXNREG, 0, "register cap per thread of the dCB kernel, 0 = compiler's choice", "dcb",
         measured_only=True, needs=("maxnreg",)),
    # 1: off the diagonal (a tile whose every s precedes every t) the dCB stage's decay
    # exp(dA_t - dA_s) as exp(dA_t - dA_r) exp(dA_r - dA_s), r the tile's last column: each factor
    # <= 1 as dA falls along the chunk, two exponentials a row and a column where a pair took one.
    # At 256-token chunks in 32 x 32 tiles 28 of the 36 causal tiles are off the diagonal.
    # Cross-compiled, the H200 record's dCB (four heads a step) issues one exponential per head
    # and tile element: 32 a warp in a 565-instruction loop, whose special-function units (a
    # quarter of the issue rate) need about 45% of the loop's issue time for them.
    # measured_only: the static model does not price exponentials
    Knob("dcb_decay", (0, 1), 0, "1: off the diagonal, dCB's decay as a row factor times a column factor", "dcb",
         measured_only=True),
    # 1: dCB in Gluon for sm90 (templates/ssd_bwd/dcb_gluon.jinja): the tl stage's contract on
    # 64 x 64 tiles of causal pairs only, C·Bᵀ once a pair from C's and B's tiles resident in
    # shared memory, each head's dy·xᵀ a wgmma on TMA-fed tiles through a ring two heads deep. The
    # tl stage at the H200's records (32 x 32 tiles, four heads a step, 248 registers) takes 1.36
    # ms of a 6.0 ms step at 2.7b 4 x 16384 bf16, about four times its MMAs and exponentials at
    # the card's rates, and ncu finds it waiting on shared memory and barriers (12% occupancy).
    # Its register cap is dcb_maxnreg. A call it cannot take (seq_idx, strides TMA cannot
    # address) runs the tl stage of the same config. measured_only: the static model cannot rank
    # a data path
    Knob("dcb_gluon", (0, 1), 0, "1: dCB in Gluon on 64 x 64 tiles, its products wgmmas fed by TMA (sm90)", "dcb",
         measured_only=True, needs=("tma", "wgmma")),
    # register cap of the dB kernel (0 = ptxas's choice): about 190 registers at the H200's
    # records (2.7b, 64 x 128 tiles, db_fold = 1), two CTAs an SM where its 75 KB of shared memory
    # would fit three, which 168 allows (dC, the stage's twin, is held at two by its 82 KB)
    Knob("db_maxnreg", MAXNREG, 0, "register cap per thread of the dB kernel, 0 = compiler's choice", "dbc",
         measured_only=True, needs=("maxnreg",)),
    # the same for dC (about 255 registers at the records, and 82 KB of shared memory at three
    # stages): with dc_cs_dot = 2 and two stages its 66 KB would fit three CTAs at 168
    Knob("dc_maxnreg", MAXNREG, 0, "register cap per thread of the dC kernel, 0 = compiler's choice", "dbc",
         measured_only=True, needs=("maxnreg",)),
    # 1: dC's part of the dA gradient from the state (C_t·dC_t,h, summed over dstate) as w_in_t
    # dy_t·(C_t Sᵀ), a second product per head with C's tile loaded once as its operand, in place
    # of the state part times C reloaded per head and summed over dstate. Cross-compiled for sm90
    # at the H200 record's dC (2.7b, 64 x 128 tiles): the head loop's SASS 671 -> 357
    # instructions, 14 -> 2 barriers, 32 -> 4 shuffles, 72 -> 16 bytes spilled (still 255
    # registers), at twice the loop's wgmma instructions. 2: also dy's rows scaled by the decay
    # and rounded to dy's type (one 16-bit rounding more, as db_fold's), so that the state
    # product accumulates into dC's tile in place: no second (rows, dstate) fp32 tile per head.
    # On the H200 (2.7b 4x16384 bf16, no z): dC 838 -> 533 us with 1, 620 with 2; the records take 1.
    # measured_only: the static model cannot rank it
    Knob("dc_cs_dot", (0, 1, 2), 0, "1: dC's dA partial as a product C·Sᵀ dotted with dy (C loaded once); "
         "2: and dy's rows scaled before the state product (accumulates in place)", "dbc", measured_only=True),
    Knob("dbc_warps", (2, 4, 8), 4, "num_warps", "dbc"),
    Knob("dbc_stages", (1, 2, 3), 2, "num_stages", "dbc"),
    # dCB, dB and dC sum over the heads of a group: each program loops over heads / group_split of
    # them in a fixed order and writes its partial sum; the partials are summed in a fixed order
    # after (deterministic, no atomics). More splits: more programs, more partial traffic.
    Knob("group_split", (1, 2, 4, 8, 16), 1, "programs sharing the heads of a group in dCB / dB / dC", "dbc"),
)
SPACE = KnobSpace("ssd_bwd", KNOBS, mode_knob="cb")
KNOB_BY_NAME: dict[str, Knob] = SPACE.by_name
STATE_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
_CHUNK_TILES = ("state_block_k", "bmm_block_m", "bmm_block_n", "dx_block_m", "dx_block_k",
                "dbc_block_m", "dbc_block_k", "dcb_block_m", "dcb_block_k")


class BwdConfig(BaseConfig):
    """A validated SSD-backward config: every knob of `KNOBS`, each from its declared set."""
    space = SPACE
    __slots__ = ()


def excluded(problem, static: bool = False) -> dict[str, tuple]:
    """Values a tune never offers: the tuner times the backward alone, from inputs, with no
    forward to keep the chunk states; whether the forward keeps them is memory held from forward
    to backward, the caller's choice (a record may still pin save_states = 1). At fp32 inputs
    the staged C·Bᵀ is fp32 whatever cb_dtype says: "input" would be the same kernel again. The
    chunk states' types: as the forward's (knobs.state_dtype_excluded)."""
    out = {"save_states": (1,), **state_dtype_excluded(problem, static)}
    if problem.dtype == "fp32":
        out["cb_dtype"] = ("input",)
    return out


def caps(problem) -> dict[str, int]:
    """Largest useful tile per knob for a problem: a tile beyond the padded dimension is waste."""
    p = max(16, pow2_at_least(problem.headdim))
    n = max(16, pow2_at_least(problem.dstate))
    return {"state_block_m": p, "state_block_n": n, "dx_block_n": p, "dx_block_d": n, "dbc_block_n": n,
            "cumsum_block_h": pow2_at_least(problem.nheads),
            "pass_block": max(64, pow2_at_least(problem.headdim * problem.dstate))}


def violations(config: BwdConfig, arch: Arch | str, problem=None) -> list[str]:
    """Reasons a config cannot run on an arch (and problem); empty when it is feasible."""
    arch = get_arch(arch) if isinstance(arch, str) else arch
    why = SPACE.arch_violations(config, arch)
    q = config.chunk_size
    for name in _CHUNK_TILES:
        if config[name] > q:
            why.append(f"{name}={config[name]} exceeds chunk_size={q}")
    for stage in ("state", "pass", "bmm", "dx", "dcb", "dbc"):
        if config[f"{stage}_warps"] * arch.warp_size > 1024:
            why.append(f"{stage}_warps={config[f'{stage}_warps']} x warp {arch.warp_size} > 1024 threads")
    # the tl dx with 64 x 64 rows x time steps and dstate steps over a headdim tile of 32 or less
    # faulted on an H200 (illegal address, Triton 3.6: bf16, chunk 64, headdim 32, dstate 64,
    # whichever cb); 32 in any one of the three ran. A record carried to a narrower headdim
    # (lookup.transfer shrinks dx_block_n) must not land there
    if not config.dx_gluon and config.dx_block_n <= 32 and config.dx_block_m == config.dx_block_k \
            == config.dx_block_d == 64 and not arch.is_amd:
        why.append(f"dx_block_n={config.dx_block_n} with dx_block_m, dx_block_k and dx_block_d all 64 faults in "
                   f"the tl dx on sm90 (Triton 3.6): take 32 for one of the three")
    if config.dx_gluon:
        why += dx_gluon_violations(config, problem)
    if config.dcb_gluon:
        why += dcb_gluon_violations(config, problem)
    if config.rev_walk:
        why += gluon_problem_violations("rev_walk=1", problem)
        if config.rev_walk == 2 and problem is not None and problem.dstate <= 64:
            why.append(f"rev_walk=2 tiles dstate by 64: at dstate {problem.dstate} it runs rev_walk=1's tiles")
    elif config.rev_walk_maxnreg:   # the tl stages it would replace take no cap: the same code twice
        why.append(f"rev_walk_maxnreg={config.rev_walk_maxnreg} caps the reverse Gluon walk: needs rev_walk=1")
    if config.recompute_walk:
        why += recompute_walk_violations(config, problem)
        if config.recompute_walk == 3 and problem is not None and problem.dstate <= 64:
            why.append(f"recompute_walk=3 tiles dstate by 64: at dstate {problem.dstate} it runs recompute_walk=2's "
                       "tiles")
    if problem is not None:
        for name, cap in caps(problem).items():
            if config[name] > cap:
                why.append(f"{name}={config[name]} exceeds the problem's padded size {cap}")
        r = problem.nheads // problem.ngroups
        if config.group_split > r:
            why.append(f"group_split={config.group_split} exceeds the heads per group ({r})")
        per = -(-r // config.group_split)
        if config.dcb_heads > pow2_at_least(per):
            why.append(f"dcb_heads={config.dcb_heads} exceeds the {per} heads a dCB program takes")
    return why


# The knobs the Gluon dx takes at one value each: the staged C·Bᵀ it reads, and the tl dx's tiles,
# warps and stages set to what it runs (64 x 64 tiles in one warpgroup, its ring in the template),
# so that no two configs run the same code. Its register cap is dx_maxnreg, as for the tl dx.
DX_GLUON_FIXED = dict(cb="stage", cb_dtype="input", dx_block_m=64, dx_block_n=64, dx_block_k=64, dx_block_d=64,
                      dx_warps=4, dx_stages=1)


def dx_gluon_violations(config: BwdConfig, problem=None) -> list[str]:
    """What the Gluon dx (dx_gluon = 1) cannot do, for this config and problem on sm90: the knobs
    of DX_GLUON_FIXED at other values, inputs other than 16-bit, dstate other than 64 or 128,
    headdim not in 64-wide tiles, seq_idx. Strides and alignment are the call's
    (bwd_gluon.dx_gluon_gaps)."""
    why = []
    if config.cb != "stage" or config.cb_dtype != "input":
        why.append(f"dx_gluon=1 reads the staged C·Bᵀ in the inputs' 16-bit type: needs cb=stage and "
                   f"cb_dtype=input, got cb={config.cb}, cb_dtype={config.cb_dtype}")
    tiles = {k: config[k] for k in ("dx_block_m", "dx_block_n", "dx_block_k", "dx_block_d")}
    if any(config[k] != v for k, v in DX_GLUON_FIXED.items() if k.startswith("dx_")):
        why.append(f"dx_gluon=1 runs 64 x 64 tiles in one warpgroup, its ring in the template: needs dx_block_m, "
                   f"dx_block_n, dx_block_k and dx_block_d = 64, dx_warps = 4 and dx_stages = 1, got {tiles}, "
                   f"dx_warps={config.dx_warps}, dx_stages={config.dx_stages}")
    return why + gluon_problem_violations("dx_gluon=1", problem)


# The knobs the Gluon dCB takes at one value each: the tl stage's tiles, warps, stages and heads a
# step set to what it runs (64 x 64 tiles, one warpgroup, its ring in the template, one head a
# step, the decay split off the diagonal as it always does), so that no two configs run the same
# code. Its register cap is dcb_maxnreg.
DCB_GLUON_FIXED = dict(dcb_block_m=64, dcb_block_k=64, dcb_warps=4, dcb_stages=1, dcb_heads=1, dcb_decay=1)


def dcb_gluon_violations(config: BwdConfig, problem=None) -> list[str]:
    """What the Gluon dCB (dcb_gluon = 1) cannot do, for this config and problem on sm90: the knobs
    of DCB_GLUON_FIXED at other values, inputs other than 16-bit, dstate other than 64 or 128,
    headdim not in 64-wide tiles, seq_idx. Strides and alignment are the call's
    (bwd_gluon.dcb_gluon_gaps)."""
    why = []
    if any(config[k] != v for k, v in DCB_GLUON_FIXED.items()):
        got = {k: config[k] for k in DCB_GLUON_FIXED}
        why.append(f"dcb_gluon=1 runs 64 x 64 tiles in one warpgroup, one head a step, its ring in the template: "
                   f"needs {DCB_GLUON_FIXED}, got {got}")
    # a head's dy and x tiles, its whole headdim, in each of the ring's two stages: 32 KB per 64
    # of headdim beside C's and B's tiles, within sm90's 227 KB of shared memory up to 384
    if problem is not None and problem.headdim > 384:
        why.append(f"dcb_gluon=1 holds a head's whole headdim in shared memory: needs headdim <= 384, "
                   f"got {problem.headdim}")
    return why + gluon_problem_violations("dcb_gluon=1", problem)


# the forward walk's own modes, fixed where the backward runs it (recompute_walk = 1): its
# 128-token ring (the forward's default), dstate tiles of up to 128, one segment, dt' from the
# cumsum, no dependent launch
RECOMPUTE_WALK = dict(walk_block=128, walk_bn=128, walk_split=1, walk_weights=0, pdl=0)


def recompute_walk_modes(config: BwdConfig) -> dict:
    """The walk's modes for a config's recompute_walk: RECOMPUTE_WALK, with a 64-token ring at 2
    and 3, and at 3 64-wide dstate tiles (walk_bn)."""
    return {**RECOMPUTE_WALK, "walk_block": 64 if config.recompute_walk >= 2 else 128,
            "walk_bn": 64 if config.recompute_walk == 3 else 128}


def recompute_walk_violations(config: BwdConfig, problem=None) -> list[str]:
    """What recompute_walk = 1 needs: states recomputed (save_states = 0), in the inputs' type at
    16-bit inputs (the walk stores its accumulator rounded to it), and a problem the sm90 Gluon
    kernels take (dstate 64, 128 or 256)."""
    why, knob = [], f"recompute_walk={config.recompute_walk}"
    if config.save_states:
        why.append(f"{knob} recomputes the chunk states: needs save_states=0")
    if problem is not None and problem.dtype in ("fp16", "bf16") and config.state_dtype != problem.dtype:
        why.append(f"{knob} needs states in the input dtype ({problem.dtype}): the walk stores its "
                   f"accumulator rounded to it, got state_dtype={config.state_dtype}")
    return why + gluon_problem_violations(knob, problem, (64, 128, 256))


def fit(config: BwdConfig, problem) -> BwdConfig:
    """Shrink tiles that exceed the problem's padded dims or the chunk (used for defaults), and
    the head split past the heads of a group."""
    q = config.chunk_size
    return shrink(config, {**caps(problem), **{name: q for name in _CHUNK_TILES},
                           "group_split": problem.nheads // problem.ngroups})


def default_config(arch: Arch | str, problem=None, cb: str | None = None) -> BwdConfig:
    """The per-arch default, used where no tuned record applies: untuned starting points (64-wide
    tiles suit headdim 64 / dstate 128), the caller's chunk size, states in fp32 (the backward's
    gradients through the state chain are the most sensitive to rounding) except on sm90, whose
    measured records all keep them in the inputs' 16-bit type."""
    arch = get_arch(arch) if isinstance(arch, str) else arch
    base = BwdConfig()
    # dx, dB and dC hold an fp32 (rows x headdim / dstate) accumulator across a causal loop with
    # two more fp32 (rows x time step) products per step; a second pipeline stage (async copies of
    # the next step's tiles) costs ~55 more registers per thread there. Cross-compiled at
    # mamba2-2.7b (8 x 2048, bf16, chunk 256), one stage each: sm90 dx 166 registers (3 blocks
    # per SM; 222 and 2 blocks with two stages), db 153 (3; 190 and 2), dc 230 (2; 255 and 2),
    # nothing spilled anywhere; sm80 likewise spill-free.
    base = base.replace(dx_stages=1, dbc_stages=1)
    if arch.is_amd:   # 64 KB of LDS: keep pipelining shallow
        base = base.replace(state_stages=1)
    elif arch.name.startswith("sm9"):
        # C·Bᵀ recomputed in the dx kernel (wgmma) rather than read from the bmm stage's fp32
        # buffer: H100, mamba2-2.7b 8 x 2048 bf16, dx 1232 -> 836 us (168 registers and 3 blocks
        # per SM against 173 and 2), and one launch fewer
        base = base.replace(cb="inline")
        # dC's heads loop holds a (rows x dstate tile) accumulator and reads dy once per
        # program: the whole dstate (128) in one tile halves the programs and the dy reads,
        # H100 same shape: dC 483 -> 362 us, dB 241 -> 261
        base = base.replace(dbc_block_n=128)
        # dCB tiles of 32 rows x 64 columns: H200, same shape, dCB 511 -> 473 us (559 against 608
        # in an earlier sweep at two stages)
        base = base.replace(dcb_block_m=32, dcb_block_k=64)
    elif arch.name.startswith("sm8"):
        # mma.sync holds both operands in registers: the 64 x 64 C·Bᵀ tile over dstate 128
        # spilled (96 registers, 8 bytes) and so did the dstates product at two stages (128,
        # 8 bytes); a 32-wide bmm tile (50 registers, 6 blocks per SM) and one stage for the
        # chunk-state products (96-127, 4-5 blocks) spill nothing.
        base = base.replace(bmm_block_n=32, state_stages=1)
    if problem is not None:
        if problem.chunk_size is not None:
            base = base.replace(chunk_size=problem.chunk_size)
        r = problem.nheads // problem.ngroups
        # heads of a group split so that a dCB / dB / dC program loops over ~16-20 heads: fewer
        # splits, fewer dCB partials to write and read (H200, mamba2-2.7b 8 x 2048 bf16, 80 heads:
        # 4 splits against 8 took dCB 608 -> 580 us, dB 242 -> 208, dC 359 -> 327; 16 was slower)
        split = max((v for v in KNOB_BY_NAME["group_split"].values if v <= max(1, r // 16)), default=1)
        base = base.replace(group_split=split)
        base = fit(base, problem)
        if arch.name.startswith("sm9"):
            # dx in Gluon where the problem fits it (H200, mamba2-2.7b bf16, from the shipped
            # record's config: dx 2821 -> 1801 us at 4 x 16384, 713 -> 471 at 8 x 2048; the
            # step 10.41 -> 9.39 ms), reading C·Bᵀ staged in 16 bits as the forward's scan does
            gl = base.replace(dx_gluon=1, **DX_GLUON_FIXED)
            if not dx_gluon_violations(gl, problem):
                base = gl
            # the dstates stage and the reverse state passing as one Gluon walk where the problem
            # fits it (same shape and card: 882 -> 711 us at 2.7b 4 x 16384; even at 1 x 65536,
            # whose 80 chains leave most SMs idle)
            if not gluon_problem_violations("rev_walk=1", problem):
                base = base.replace(rev_walk=1)
            # the recomputed chunk states in the inputs' 16-bit type, as every measured sm90
            # record keeps them (each passed the tuner's gate at its training shape): H200, 2.7b
            # 4 x 16384 bf16, both Gluon stages, one run: the step 9997 -> 9277 us (chunk state
            # 475 -> 418, state passing 340 -> 175, dC 1206 -> 848)
            if problem.dtype in ("fp16", "bf16"):
                base = base.replace(state_dtype=problem.dtype)
    if cb is not None:   # the default at that mode (the tuner asks for it when the mode is pinned)
        base = base.replace(cb=cb, **({"dx_gluon": 0} if cb != "stage" else {}))
    return base
