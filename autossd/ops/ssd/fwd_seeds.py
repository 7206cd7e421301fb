"""The SSD forward's seed configs for the tuner: the known-good starting points enqueued before
sampling (the op declares them as `Op.seeds`; autossd/tuner/search_space.py asks for them), and
the limits it puts on the search (tile caps per problem; the state dtypes a tune never offers are
the rule both ops share, `knobs.state_dtype_excluded`)."""
from __future__ import annotations

from ...arch import Arch, get_arch
from ...problem import Problem
from .fwd_knobs import KNOB_BY_NAME, Config, caps, default_config, fit, violations
from .plan import walk_programs


def unvalidated(arch: Arch) -> dict[str, tuple]:
    """What a tune for an arch never run leaves out: the fused depths (three launches and one)
    hand each chunk's state from program to program through a spin-wait on a flag with
    acquire/release fences, whose ordering on that hardware only a run can show (on AMD it has
    only been compiled). The five-launch depth orders its stages by launches alone."""
    return {} if arch.hardware_validated else {"launches": (3, 1)}


def search_caps(problem: Problem) -> dict[str, int]:
    """Largest useful value per tile knob for this problem (a tile beyond the padded size is waste)."""
    return caps(problem)


# The walk's seeds, by its rounds: it runs 2 CTAs per SM with 128-token ring blocks and 3 with
# 64 (walk_block), and a program is one chain through its chunks, so a round takes a program's
# time whatever the round's fill (measured on the H100). Cut only into segments of at least
# this many chunks: 2-4 chunk segments made the walk no faster at 8x2048 while the join's bytes
# grew (H100)
_SPLIT_MIN_CHUNKS = 16


def _walk_rounds(programs: int, chunks: int, slots: int, splits) -> tuple[int, float]:
    """(segments, rounds of the whole walk's length) of the walk at `slots` programs per round: the
    most segments that keep all programs in one round (the batch-1 shapes), else the cut with the
    fewest rounds; a cut only where it takes off at least a fifth of the whole walk's rounds."""
    rounds = {v: -(-programs * v // slots) / v for v in splits if v == 1 or chunks // v >= _SPLIT_MIN_CHUNKS}
    fill = [v for v in rounds if v > 1 and programs * v <= slots]
    cut = max(fill) if fill else min(rounds, key=lambda v: (rounds[v], v))
    return (cut, rounds[cut]) if rounds[cut] <= 0.8 * rounds[1] else (1, rounds[1])


def _walk_seeds(walk3: Config, arch, problem, space) -> list[Config]:
    """The walk family cut into segments (2.7b 1x131072 at 3, 130m at 11, 2.7b 4x16384 at 4:
    320 programs take 2 rounds whole, 1.25 at 4 segments of 16 chunks), and with the 64-token
    ring where its third CTA per SM takes off a fifth of the rounds more (4x16384 whole: one
    round, the shipped pick; 8x2048: 2 rounds against 3, measured no faster: its walk is bound
    by its bytes there)."""
    arch_ = get_arch(arch) if isinstance(arch, str) else arch
    programs = walk_programs(problem)
    chunks = -(-problem.seqlen // walk3.chunk_size)
    splits = (1,) if "walk_split" in space.pinned else KNOB_BY_NAME["walk_split"].values
    per_sm = 3 if walk3.walk_block == 64 else 2   # (a walk_block pinned at 64 sizes the first seed)
    v2, r2 = _walk_rounds(programs, chunks, per_sm * arch_.sm_count, splits)
    out = [walk3.replace(walk_split=v2)] if v2 > 1 else []
    if "walk_block" not in space.pinned and walk3.walk_block == 128:
        v3, r3 = _walk_rounds(programs, chunks, 3 * arch_.sm_count, splits)
        if r3 <= 0.8 * r2:
            out.append(walk3.replace(walk_block=64, walk_split=v3))
    return out


def seed_configs(arch: Arch | str, problem: Problem, space) -> list[Config]:
    """Known-good starting points enqueued before sampling: the arch default (fitted to the
    problem), the default at every other fusion depth, at each chunk size and at each fold of
    the small stages (fold_prep), the Gluon walk and scans, pdl on the default and on the
    fewest launches, and each walk seed with its weights written by the cumsum (walk_weights);
    the shipped records' three families come right after the default. Only those inside the space
    and feasible."""
    base = default_config(arch, problem, launches=space.pinned.get("launches"))
    base = base.replace(**{k: v for k, v in space.pins(base.launches).items() if base[k] != v})
    depths = [base.launches] + [d for d in KNOB_BY_NAME["launches"].values
                                if "launches" not in space.pinned and d != base.launches]
    cands = [base] + [default_config(arch, problem, launches=d).replace(
        **{k: v for k, v in space.pins(d).items() if k != "launches"}) for d in depths[1:]]
    cands += [fit(base.replace(chunk_size=q), problem)
              for q in KNOB_BY_NAME["chunk_size"].values if "chunk_size" not in space.pinned]
    if base.launches in KNOB_BY_NAME["fold_prep"].depths and "fold_prep" not in space.pinned:
        # the folds change the launch count as depths do: too few trials would never draw them
        cands += [base.replace(fold_prep=f) for f in KNOB_BY_NAME["fold_prep"].values if f != base.fold_prep]
    if base.launches in KNOB_BY_NAME["scan_gluon"].depths and "scan_gluon" not in space.pinned:
        # the Gluon scan takes 64 x 64 tiles only: a sampled draw rarely meets that, so seed it
        # (where it is not offered, the filter below drops it)
        cands += [base.replace(scan_gluon=v) for v in KNOB_BY_NAME["scan_gluon"].values if v != base.scan_gluon]
    # the fewest launches (prep | walk | Gluon scan): the small shapes' pick (57 µs at 2.7b 1x2048 with
    # pdl = 3 on the H100)
    three = base.replace(state_walk=1, scan_gluon=1, fold_prep=2)
    if base.launches in KNOB_BY_NAME["state_walk"].depths and "state_walk" not in space.pinned:
        # the walk changes the launch count, as the folds do: seed it, with and without each Gluon scan
        cands += [c.replace(state_walk=1) for c in (base, base.replace(scan_gluon=1), base.replace(scan_gluon=3))
                  if not c.state_walk]
        cands.append(three)
    if base.launches in KNOB_BY_NAME["pdl"].depths and "pdl" not in space.pinned:
        # launch overlap: on the default and on the fewest launches, where it weighs most, and
        # there also with the scan's intra-chunk part before its wait (2) and following the walk (3)
        cands += [c for c in (base.replace(pdl=1), *(three.replace(pdl=v) for v in (1, 2, 3))) if c != base]
    if base.launches in KNOB_BY_NAME["walk_weights"].depths and "walk_weights" not in space.pinned:
        # the walk's weights written by the cumsum: it needs the walk, which a draw seldom has, so
        # seed it on each walk seed above (the filter drops those outside the space)
        cands += [c.replace(walk_weights=1) for c in list(cands) if c.state_walk and not c.walk_weights]
    # right after the default, the shipped records' three families:
    # the walk with its weights and the chunk-walking scan (the large shapes), the fewest launches
    # with the scan following the walk (the small ones), and the chunk-walking scan after the tl
    # state stages (the large shapes with few heads). There are more seeds than the default trial
    # count, so the ones most likely to win go first (the filter below drops them where a pinned
    # knob, the arch or the problem refuses them)
    walk3 = base.replace(state_walk=1, walk_weights=1, scan_gluon=3)
    best = [walk3, three.replace(pdl=3, walk_weights=1),
            base.replace(scan_gluon=3)]   # and the tl state stages with it (few heads: 130m)
    if base.launches in KNOB_BY_NAME["walk_split"].depths:
        best[1:1] = _walk_seeds(walk3, arch, problem, space)
    cands = [cands[0]] + best + cands[1:]
    out: list[Config] = []
    for cand in cands:   # the default first: the study's baseline; then the families above, each depth
        if cand not in out and space.params(cand) is not None and not violations(cand, arch, problem):
            out.append(cand)
    return out
