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
