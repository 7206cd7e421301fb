"""The knobs of the kernel stages the SSD ops share, declared once per stage: the forward, its
backward and packed prefill each run a cumsum, a C·Bᵀ product, a chunk state, a state passing
(and the forward and packed prefill a chunk scan), and each op's knob space is composed of
these groups (`knobs.take`), an op setting only a knob's default, the modes it shapes and, where
its kernel cannot take the whole range, a subset of its values."""
from __future__ import annotations

from ...knobs import Knob

TILES = (16, 32, 64, 128)
# per-thread register caps: 65536 registers / (128 threads x cap) = 8, 6, 5, 4, 3 CTAs per SM
MAXNREG = (0, 64, 80, 96, 128, 168)

# the chunk length and the type the chunk states are kept in (the forward and the backward)
CHUNK = (
    Knob("chunk_size", (64, 128, 256), 256, "tokens per chunk"),
    Knob("state_dtype", ("fp32", "bf16", "fp16"), "fp32",
         "storage dtype of the inter-chunk states (local chunk states and passed states)"),
)
CUMSUM = (
    Knob("cumsum_block_h", (1, 2, 4, 8, 16), 8, "heads per program", "cumsum"),
)
BMM = (
    Knob("bmm_block_m", TILES, 64, "C rows (time) per program", "bmm"),
    Knob("bmm_block_n", TILES, 64, "B rows (time) per program", "bmm"),
    Knob("bmm_block_k", TILES, 64, "dstate step", "bmm"),
    Knob("bmm_warps", (2, 4, 8), 4, "num_warps", "bmm"),
    Knob("bmm_stages", (1, 2, 3, 4), 2, "num_stages", "bmm"),
)
CHUNK_STATE = (
    Knob("state_block_m", TILES, 64, "headdim per program", "chunk_state"),
    Knob("state_block_n", TILES, 64, "dstate per program", "chunk_state"),
    Knob("state_block_k", TILES, 64, "time step", "chunk_state"),
    Knob("state_warps", (2, 4, 8), 4, "num_warps", "chunk_state"),
    Knob("state_stages", (1, 2, 3, 4), 2, "num_stages", "chunk_state"),
    # register cap per thread (ptxas -maxnreg), 0 = ptxas's choice. Left alone, ptxas takes up to
    # 255 registers for ILP; these kernels are latency-bound, and the cap buys resident CTAs
    # (the forward's chunk scan compiles to 64 instead of 120 without spilling: 8 CTAs per SM,
    # not 4). measured_only: a cap raises occupancy in the compile report, but what it costs in
    # code (H100: 64 registers made the chunk scan 1.47x slower at twice the CTAs) only a GPU shows
    Knob("state_maxnreg", MAXNREG, 0, "register cap per thread, 0 = compiler's choice", "chunk_state",
         measured_only=True, needs=("maxnreg",)),
)
STATE_PASSING = (
    Knob("pass_block", (64, 128, 256, 512, 1024, 2048), 256, "state elements per program", "state_passing"),
    Knob("pass_warps", (1, 2, 4, 8), 4, "num_warps", "state_passing"),
)
CHUNK_SCAN = (
    Knob("scan_block_m", TILES, 64, "output rows (time) per program", "chunk_scan"),
    Knob("scan_block_n", TILES, 64, "headdim per program", "chunk_scan"),
    Knob("scan_block_k", TILES, 64, "time step of the intra-chunk product", "chunk_scan"),
    Knob("scan_block_d", TILES + (256,), 64, "dstate step of the C·state product", "chunk_scan"),
    Knob("decay_split", (False, True), False,
         "intra-chunk blocks before the diagonal take the decay as row x column factors (M+K exps, "
         "x rows scaled) instead of per element (M x K exps on the CB tile)", "chunk_scan"),
    Knob("scan_warps", (2, 4, 8), 4, "num_warps", "chunk_scan"),
    Knob("scan_stages", (1, 2, 3, 4), 2, "num_stages", "chunk_scan"),
    Knob("scan_maxnreg", MAXNREG, 0, "register cap per thread, 0 = compiler's choice", "chunk_scan",
         measured_only=True, needs=("maxnreg",)),
)
# The sm90 Gluon data paths (templates/ssd/state_walk_gluon.jinja, chunk_scan_gluon.jinja): the
# forward's and packed prefill's. The walk replaces the chunk-state and state-passing stages; the
# chunk-walking scans (2, 3) read the entering states the walk stores.
GLUON_WALK = (
    # 1: the chunk state and the state passing as one Gluon walk over the chunks
    # (state_walk_gluon.jinja): one program per (headdim tile, dstate tile, head, batch) carries
    # its state tile through every chunk in the wgmma's accumulator, x and B by TMA through a
    # ring, the entering states out by TMA store; four launches instead of five, 0.67 GB of local
    # states neither written nor read back. sm90 only. 8-35% faster than the two stages it
    # replaces (H100); a call it cannot take (seq_idx, strides TMA cannot address)
    # runs those two stages. measured_only: the static model cannot rank a data path.
    Knob("state_walk", (0, 1), 0, "1: chunk state + state passing as one Gluon walk (sm90)", "chunk_state",
         measured_only=True, needs=("tma", "wgmma")),
    # tokens per block of the Gluon walk's TMA ring (x and B, two stages): 128 takes 115 KB of
    # shared memory and 175 registers, 2 CTAs per SM; 64 takes 66 KB and 132, 3 CTAs. Where the
    # walk's programs fill more than one round of 2 per SM (batch > 1), a third CTA per SM cuts
    # its rounds (-17% walk time at 2.7b 4x16384 on the H100). measured_only: the static model cannot rank it.
    Knob("walk_block", (128, 64), 128, "tokens per block of the Gluon walk's TMA ring (sm90)",
         "chunk_state", measured_only=True, needs=("tma", "wgmma")),
)
GLUON_SCAN = (
    # 1: the chunk scan in Gluon (chunk_scan_gluon.jinja): every MMA operand by TMA into one 48 KB
    # ring, CB's decay applied to the MMA's register operand; sm90 only (TMA, wgmma). It uses
    # 64 x 64 tiles and one warpgroup; a call it cannot take (seq_idx, strides TMA cannot
    # address) runs the tl kernel of the same config. 9-12% faster than the tl kernel at the
    # large shapes on the H100; measured_only: the static model cannot rank a data path.
    # 2: one program per chunk and head walks the chunk's row tiles with the state tile and the x
    # blocks resident in shared memory, x scaled there once per block so that CB feeds the wgmma
    # as stored, and every dA/dt load issued ahead: 5-7% faster than 1 at the large
    # shapes, 9 µs slower at 2.7b 1x2048 (a quarter of the programs).
    # 3: 2 storing y by TMA through shared memory (the diagonal's ring stage) in place of the
    # accumulator layout's 4-byte stores, whose registers the next row tile waited on (ncu; 10-15% off
    # the scan on the H100).
    Knob("scan_gluon", (0, 1, 2, 3), 0, "1: the Gluon chunk scan with TMA operands (sm90); "
         "2: the Gluon scan with one program per chunk, x resident and pre-scaled; "
         "3: as 2, y stored by TMA", "chunk_scan",
         measured_only=True, needs=("tma", "wgmma")),
)


def gluon_scan_tile_violations(config) -> list[str]:
    """The Gluon chunk scans' one shape, whichever op takes them: 64 x 64 tiles in one warpgroup
    (a config's tl scan tiles and warps must say so, or two configs would run the same code)."""
    tiles = {k: config[k] for k in ("scan_block_m", "scan_block_n", "scan_block_k")}
    if any(v != 64 for v in tiles.values()) or config.scan_warps != 4:
        return [f"scan_gluon={config.scan_gluon} runs 64 x 64 tiles in one warpgroup: needs scan_block_m, "
                f"scan_block_n and scan_block_k = 64 and scan_warps = 4, got {tiles}, "
                f"scan_warps={config.scan_warps}"]
    return []


def gluon_problem_violations(label: str, problem, dstates: tuple = (64, 128)) -> list[str]:
    """What a problem must be for any of the SSD ops' sm90 Gluon kernels (their MMA operands are
    16-bit 64-wide tiles): fp16/bf16 inputs, dstate among `dstates`, headdim in 64-wide tiles, no
    seq_idx (a problem type without one has none). `label` names the knob and value asking, e.g.
    "scan_gluon=3"."""
    why = []
    if problem is None:
        return why
    if problem.dtype not in ("fp16", "bf16"):
        why.append(f"{label} needs fp16/bf16 inputs, got {problem.dtype}")
    if problem.dstate not in dstates:
        allowed = ", ".join(map(str, dstates[:-1])) + f" or {dstates[-1]}"
        why.append(f"{label} needs dstate {allowed}, got {problem.dstate}")
    if problem.headdim % 64:
        why.append(f"{label} needs headdim a multiple of 64, got {problem.headdim}")
    if getattr(problem, "has_seq_idx", False):
        why.append(f"{label} does not take seq_idx")
    return why
