"""GPU correctness at production shapes: the generated kernels of every fusion depth against the
float64 chunked reference (itself checked against the token recurrence in the tests).

    python scripts/gpu_validate.py --out DIR [--quick] [--smem-pad 2,4,8] [--depths 5,3,1] [--no-scan-gluon]
        [--walk-only] [--pdl-only] [--walk-weights-only] [--scan-chunk-only [--scan-chunk-value 3]]
        [--walk-split-only] [--walk-block-only] [--stored-only]

Every case: fresh random inputs, outputs poisoned with NaN before the run, relative error
‖out−ref‖/‖ref‖ against a dtype-aware tolerance, final states too. The long case (>= 524288
tokens) checks the whole output for NaN/Inf and a head subset against the reference (heads are
independent, so a subset is an exact check of those heads). The smem_pad cases run the Gluon
chunk-state kernel and the scan_gluon cases the Gluon chunk scan, which the CPU interpreter
cannot run: this is where they are checked; so are the state_walk cases (the Gluon walk in place of
the chunk state and the state passing) and the pdl cases (launch overlap: each also replayed
from a CUDA graph and run back to back, unsynchronized, on the kept workspace). Each result names the chunk-scan and state kernels its
plan launched (a call a Gluon kernel cannot take runs the tl ones: the seq_idx cases check that).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from autossd.ops.ssd.chunk import allocate, execute, gluon_scan_gaps, walk_gaps, walk_segments  # noqa: E402
from autossd.ops.ssd.naive import ssd_chunked  # noqa: E402
from autossd.problem import Problem  # noqa: E402
from autossd.ops.ssd.fwd_knobs import KNOB_BY_NAME, default_config, fit  # noqa: E402
from autossd.testing import call_kwargs, make_inputs, rel_err, tolerance  # noqa: E402

M27 = dict(nheads=80, headdim=64, dstate=128, ngroups=1)
CODESTRAL = dict(nheads=128, headdim=64, dstate=128, ngroups=8)
FULL = dict(has_D=True, has_dt_bias=True, dt_softplus=True, return_final_states=True)


def cases(quick: bool):
    out = []
    for dtype in ("fp16", "bf16"):
        for b, l in ((1, 2048), (8, 2048), (4, 16384), (1, 131072)):
            if quick and l > 16384:
                continue
            out.append((Problem(batch=b, seqlen=l, dtype=dtype, **M27, **FULL), "fp32"))
        out.append((Problem(batch=1, seqlen=32768, dtype=dtype, **CODESTRAL, **FULL), "fp32"))
        for sd in ("bf16", "fp16"):
            out.append((Problem(batch=1, seqlen=16384, dtype=dtype, **M27, **FULL), sd))
        # every contract feature at once, at a length that is not a multiple of the chunk
        out.append((Problem(batch=2, seqlen=16383, dtype=dtype, **M27, has_D=True, D_has_hdim=True,
                            has_z=True, has_dt_bias=True, dt_softplus=True, has_dt_limit=True,
                            has_initial_states=True, has_seq_idx=True, return_final_states=True), "fp32"))
        out.append((Problem(batch=1, seqlen=20000, dtype=dtype, **M27, has_seq_idx=True,
                            return_varlen_states=True, dt_softplus=True), "fp32"))
    out.append((Problem(batch=2, seqlen=4099, dtype="fp32", **M27, **FULL, has_z=True), "fp32"))
    return out


def smem_pad_cases(pads):
    """The Gluon chunk state at production shapes: both input dtypes, the 2.7b shape with many
    chunks, ngroups > 1 (codestral), and every contract feature at a ragged length (a partial last
    chunk, seq_idx) with the tiles and warps that split the MMA differently."""
    out = []
    for pad in pads:
        for dtype in ("fp16", "bf16"):
            out.append((Problem(batch=4, seqlen=16384, dtype=dtype, **M27, **FULL), "fp32",
                        {"smem_pad": pad}))
        out.append((Problem(batch=1, seqlen=32768, dtype="bf16", **CODESTRAL, **FULL), "bf16",
                    {"smem_pad": pad}))
        for tiles in ({}, {"state_block_m": 32, "state_block_n": 128, "state_block_k": 32, "state_warps": 8},
                      {"state_block_m": 16, "state_block_n": 32, "state_block_k": 128, "state_warps": 2}):
            out.append((Problem(batch=2, seqlen=16383, dtype="fp16", **M27, has_D=True, has_z=True,
                                has_dt_bias=True, dt_softplus=True, has_initial_states=True,
                                has_seq_idx=True, return_final_states=True), "fp32",
                        {"smem_pad": pad, **tiles}))
    return out


def scan_gluon_cases():
    """The Gluon chunk scan (states in the input dtype, which it needs): both dtypes at a
    many-chunk shape, ngroups > 1, the small shape, a ragged length in batch 2 with z, D per
    channel and initial states, 128-token chunks, dstate 64; and seq_idx, which it does not take
    (the plan runs the tl scan there)."""
    g1 = {"scan_gluon": 1}
    out = [(Problem(batch=4, seqlen=16384, dtype=dt, **M27, **FULL), dt, g1) for dt in ("fp16", "bf16")]
    out.append((Problem(batch=1, seqlen=32768, dtype="bf16", **CODESTRAL, **FULL), "bf16", g1))
    out.append((Problem(batch=1, seqlen=2048, dtype="fp16", **M27, **FULL), "fp16", g1))
    ragged = dict(has_D=True, D_has_hdim=True, has_z=True, has_dt_bias=True, dt_softplus=True,
                  has_initial_states=True, return_final_states=True)
    for dt in ("fp16", "bf16"):
        out.append((Problem(batch=2, seqlen=16383, dtype=dt, **M27, **ragged), dt, g1))
    out.append((Problem(batch=3, seqlen=5000, dtype="bf16", **M27, **FULL), "bf16", {**g1, "chunk_size": 128}))
    out.append((Problem(batch=2, seqlen=4100, dtype="fp16", nheads=24, headdim=128, dstate=64, ngroups=2,
                        **FULL), "fp16", g1))
    out.append((Problem(batch=1, seqlen=20000, dtype="bf16", **M27, has_seq_idx=True,
                        return_varlen_states=True, dt_softplus=True), "bf16", g1))
    return out


def walk_cases():
    """The Gluon walk (state_walk = 1) on the scan_gluon cases' problems, alone and with the Gluon
    scan, plus dstate 256 (two state tiles per head) and 64-token chunks (one ring block per
    chunk); the seq_idx case runs the tl stages. Then the prep launch (fold_prep = 2), which the
    interpreter checks too, on the GPU with and without the walk."""
    out = []
    for prob, sd, over in scan_gluon_cases():
        out.append((prob, sd, {**over, "scan_gluon": 0, "state_walk": 1}))
        out.append((prob, sd, {**over, "state_walk": 1}))
    out.append((Problem(batch=2, seqlen=3000, dtype="bf16", nheads=8, headdim=64, dstate=256, ngroups=1,
                        **FULL), "bf16", {"state_walk": 1}))
    out.append((Problem(batch=2, seqlen=1000, dtype="fp16", nheads=8, headdim=64, dstate=128, ngroups=1,
                        **FULL), "fp16", {"state_walk": 1, "chunk_size": 64}))   # one block per chunk
    # the prep launch (fold_prep = 2: cumsum and C·Bᵀ in one), with the walk and without it
    for prob, sd, _ in scan_gluon_cases()[3:5]:   # 2.7b 1x2048 fp16; ragged, batch 2, every feature
        out.append((prob, sd, {"fold_prep": 2, "state_walk": 1, "scan_gluon": 1}))
        out.append((prob, sd, {"fold_prep": 2}))
    return out


def pdl_cases():
    """Programmatic dependent launch (pdl = 1) on each depth-5 family: the five tl launches, the
    fold into the chunk state, the Gluon chunk state, and the fewest launches (prep | walk |
    Gluon scan); at the small shape it is for, a many-chunk bf16 shape, and every feature at a
    ragged length with seq_idx (the tl stages). Then pdl = 2 and 3. Each also runs the checks of
    `pdl_checks`."""
    three = {"fold_prep": 2, "state_walk": 1, "scan_gluon": 1, "pdl": 1}
    small = Problem(batch=1, seqlen=2048, dtype="fp16", **M27, **FULL)
    out = [(small, "fp32", {"pdl": 1}), (small, "fp16", three), (small, "fp16", {**three, "fold_prep": 0}),
           (small, "fp32", {"fold_prep": 1, "pdl": 1}), (small, "fp32", {"smem_pad": 4, "pdl": 1}),
           (Problem(batch=4, seqlen=16384, dtype="bf16", **M27, **FULL), "bf16", three),
           (Problem(batch=1, seqlen=32768, dtype="bf16", **CODESTRAL, **FULL), "bf16", three),
           (Problem(batch=2, seqlen=16383, dtype="fp16", **M27, has_D=True, D_has_hdim=True, has_z=True,
                    has_dt_bias=True, dt_softplus=True, has_dt_limit=True, has_initial_states=True,
                    has_seq_idx=True, return_final_states=True), "fp32", {"pdl": 1}),
           (Problem(batch=2, seqlen=16383, dtype="bf16", **M27, has_D=True, D_has_hdim=True, has_z=True,
                    has_dt_bias=True, dt_softplus=True, has_initial_states=True, return_final_states=True),
            "bf16", three)]
    # pdl = 2: the Gluon scan's intra-chunk part before its wait, after the walk and after the
    # two tl state stages; ragged with initial states (chunk 0's state term is theirs)
    early = {**three, "pdl": 2}
    out += [(small, "fp16", early), (small, "fp16", {**early, "state_walk": 0, "fold_prep": 0}),
            (Problem(batch=4, seqlen=16384, dtype="bf16", **M27, **FULL), "bf16", early),
            (Problem(batch=1, seqlen=32768, dtype="bf16", **CODESTRAL, **FULL), "bf16", early),
            (out[-1][0], "bf16", early)]
    # pdl = 3: the scan follows the walk's published states (the same problems as pdl = 2's with
    # the walk; the tl-state case has no walk, so pdl = 3 is not offered there)
    out += [(p, sd, {**o, "pdl": 3}) for p, sd, o in out[-5:] if o.get("state_walk")]
    # and where it is for: batch 1, a long sequence, 80 walk programs beside the scan for ~0.6 ms
    out.append((Problem(batch=1, seqlen=65536, dtype="fp16", **M27, **FULL), "fp16", {**early, "pdl": 3}))
    return out


def scan_chunk_cases(value: int = 2):
    """scan_gluon = 2 or 3 (one program per chunk and head, x resident and pre-scaled) on the
    scan_gluon cases' problems (ragged ends, batches, ngroups > 1, z, D per channel, initial
    states, 128-token chunks, dstate 64, and seq_idx, which runs the tl scan), then 64-token
    chunks (one row tile: no block before the diagonal), after the walk with its weights, and
    under pdl = 1 (with its graph and back-to-back checks)."""
    out = [(p, sd, {**o, "scan_gluon": value}) for p, sd, o in scan_gluon_cases()]
    out.append((Problem(batch=2, seqlen=1000, dtype="fp16", nheads=8, headdim=64, dstate=128, ngroups=1,
                        **FULL), "fp16", {"scan_gluon": value, "chunk_size": 64}))
    walk = {"scan_gluon": value, "state_walk": 1, "walk_weights": 1}
    out += [(Problem(batch=4, seqlen=16384, dtype="fp16", **M27, **FULL), "fp16", walk),
            (Problem(batch=2, seqlen=16383, dtype="bf16", **M27, has_D=True, D_has_hdim=True, has_z=True,
                     has_dt_bias=True, dt_softplus=True, has_initial_states=True, return_final_states=True),
             "bf16", {**walk, "fold_prep": 2, "pdl": 1})]
    return out


def walk_split_cases():
    """walk_split > 1 (the walk cut into segments, a join, the chunk-walking scan adding each
    segment's entering state) on the scan_gluon = 3 cases without pdl, with the walk and its
    weights, at 2, 3, 4 and 8 segments in turn: ragged ends (a short last segment), batches,
    initial and final states (the join takes the initial state; segment 0 is then corrected too),
    ngroups > 1, dstate 64, 64-token chunks, as many segments as chunks (1x2048 at 8), and seq_idx,
    where neither the walk nor the Gluon scan runs. Then 130m's dims at 1x65536 in 6 segments."""
    base = [(p, sd, o) for p, sd, o in scan_chunk_cases(3) if not o.get("pdl")]
    out = [(p, sd, {**o, "state_walk": 1, "walk_weights": 1, "walk_split": (2, 3, 4, 8)[i % 4]})
           for i, (p, sd, o) in enumerate(base)]
    out.append((Problem(batch=1, seqlen=65536, dtype="fp16", nheads=24, headdim=64, dstate=128, ngroups=1,
                        has_D=True, has_dt_bias=True, dt_softplus=True, return_final_states=True), "fp16",
                {"scan_gluon": 3, "state_walk": 1, "walk_weights": 1, "walk_split": 6}))
    return out


def walk_block_cases():
    """walk_block = 64 (the walk's ring in 64-token blocks, three CTAs per SM) on the walk_split
    cases (ragged ends, batches, initial and final states, ngroups > 1, dstate 64, 64-token chunks,
    seq_idx), and the first four of them walked whole."""
    split = walk_split_cases()
    return [(p, sd, {**o, "walk_block": 64}) for p, sd, o in split] + \
        [(p, sd, {**o, "walk_block": 64, "walk_split": 1}) for p, sd, o in split[:4]]


def stored_cases():
    """Without final states the walk stops at the last chunk's entering state,
    and where the chunk-walking scan skips chunk 0's state term (no initial state) the walk does
    not store that state. Each walk family, none returning final states: the shape this is for
    (8x2048), ragged ends with and without initial states, one chunk (nothing stored), two
    chunks, ngroups > 1, dstate 256, 64-token chunks (one ring block per chunk); the walk before
    the tl scan, before scan_gluon = 1 under pdl = 3, and a walk_split config (its segments
    keep their final states for the join; whole where the call is short)."""
    plain = dict(has_D=True, has_dt_bias=True, dt_softplus=True)
    small = dict(nheads=8, headdim=64, dstate=128, ngroups=1)
    probs = [(Problem(batch=8, seqlen=2048, dtype="fp16", **M27, **plain), "fp16"),
             (Problem(batch=2, seqlen=16383, dtype="bf16", **M27, has_D=True, D_has_hdim=True, has_z=True,
                      has_dt_bias=True, dt_softplus=True, has_initial_states=True), "bf16"),
             (Problem(batch=2, seqlen=16383, dtype="fp16", **M27, has_z=True, has_dt_bias=True,
                      dt_softplus=True), "fp32"),
             (Problem(batch=3, seqlen=200, dtype="fp16", **small, **plain), "fp16"),
             (Problem(batch=2, seqlen=300, dtype="bf16", **small, **plain, has_initial_states=True), "bf16"),
             (Problem(batch=1, seqlen=32768, dtype="bf16", **CODESTRAL, **plain), "bf16"),
             (Problem(batch=2, seqlen=3000, dtype="bf16", nheads=8, headdim=64, dstate=256, ngroups=1,
                      **plain), "bf16")]
    fams = [{"state_walk": 1, "scan_gluon": 3}, {"state_walk": 1, "scan_gluon": 2, "walk_weights": 1},
            {"state_walk": 1, "scan_gluon": 3, "walk_weights": 1, "walk_block": 64},
            {"state_walk": 1, "scan_gluon": 0},
            {"state_walk": 1, "scan_gluon": 1, "fold_prep": 2, "pdl": 3},
            {"state_walk": 1, "scan_gluon": 3, "walk_weights": 1, "walk_split": 3}]
    out = [(p, sd, f) for f in fams for p, sd in probs]
    out.append((Problem(batch=2, seqlen=1000, dtype="fp16", **small, **plain), "fp16",
                {"state_walk": 1, "scan_gluon": 3, "chunk_size": 64}))
    return out


def walk_weights_cases():
    """walk_weights = 1 (the cumsum or prep writes each token's weight, the walk loads it) on the
    cases above with the walk: its ring's block widths, ragged ends, batches, dstate 256, the seq_idx
    call the walk does not take, and under pdl 1 and 3, where the weights are one more write a later
    launch reads. Not with the tl scan, nor pdl = 2 (the weights meet neither)."""
    return [(p, sd, {**o, "walk_weights": 1}) for p, sd, o in walk_cases() + pdl_cases()
            if o.get("state_walk") and o.get("scan_gluon", 1) and o.get("pdl") != 2]


def pdl_checks(prob: Problem, cfg, tensors: dict, cu, lim, want: tuple, seed: int) -> dict:
    """What launch overlap could break: a launch that reads before its predecessor's writes land,
    or writes what its predecessor still reads. (1) A CUDA graph of the call (PDL edges in the
    graph), replayed: bitwise equal to the eager call. (2) Back to back on the kept workspace:
    calls on two input sets alternating, nothing synchronized between them, so each call's
    first launch overwrites what the previous call's last launch reads: every output bitwise
    equal to its set's synchronized call."""
    def as_tuple(o):
        return o if isinstance(o, tuple) else (o,)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        execute(prob, cfg, tensors, cu_seqlens=cu, dt_limit=lim)   # recorded outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        got = as_tuple(execute(prob, cfg, tensors, cu_seqlens=cu, dt_limit=lim))
    graph.replay()
    torch.cuda.synchronize()
    graph_ok = all(torch.equal(a, b) for a, b in zip(got, want))
    del graph, got
    t2 = make_inputs(prob, "cuda", seed=seed + 7919)
    other = {k: t2[k] for k in tensors}
    sets = [(tensors, want), (other, as_tuple(execute(prob, cfg, other, cu_seqlens=t2["cu_seqlens"], dt_limit=lim)))]
    torch.cuda.synchronize()
    outs = []
    for i in range(12):
        ins, _ = sets[i % 2]
        outs.append(as_tuple(execute(prob, cfg, ins, cu_seqlens=cu if i % 2 == 0 else t2["cu_seqlens"],
                                     dt_limit=lim, keep=True)))
    torch.cuda.synchronize()
    b2b_ok = all(torch.equal(a, b) for i, o in enumerate(outs) for a, b in zip(o, sets[i % 2][1]))
    return {"graph_bitwise": graph_ok, "back_to_back_bitwise": b2b_ok}


def run_case(prob: Problem, state_dtype: str, seed: int, heads_ref: int | None = None,
             overrides: dict | None = None, depths=(5,)) -> list[dict]:
    """One case at each fusion depth, on the same inputs against one float64 reference."""
    t = make_inputs(prob, "cuda", seed=seed)
    kw = call_kwargs(prob, t)
    tensors = {k: t[k] for k in ("x", "dt", "A", "B", "C", "D", "z", "dt_bias", "initial_states", "seq_idx")}
    lim = kw.get("dt_limit", (0.0, float("inf")))
    h_sl = slice(0, heads_ref) if heads_ref else slice(None)
    ref_kw = dict(kw)
    ref_kw.pop("return_final_states"), ref_kw.pop("return_varlen_states")
    if heads_ref:
        g = prob.ngroups
        assert g == 1
        for k in ("D", "dt_bias"):
            if ref_kw.get(k) is not None:
                ref_kw[k] = ref_kw[k][h_sl]
        if ref_kw.get("z") is not None:
            ref_kw["z"] = ref_kw["z"][:, :, h_sl]
        if ref_kw.get("initial_states") is not None:
            ref_kw["initial_states"] = ref_kw["initial_states"][:, h_sl]
        args = (t["x"][:, :, h_sl], t["dt"][:, :, h_sl], t["A"][h_sl], t["B"], t["C"])
    else:
        args = (t["x"], t["dt"], t["A"], t["B"], t["C"])
    yr, fr, vr = ssd_chunked(*args, chunk_size=256, **ref_kw)
    results = []
    for depth in depths:
        cfg = fit(default_config("sm90", prob).replace(state_dtype=state_dtype, launches=depth,
                                                       **(overrides or {})), prob)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        first = execute(prob, cfg, tensors, cu_seqlens=t["cu_seqlens"], dt_limit=lim, poison=True)
        torch.cuda.synchronize()
        run_s = time.perf_counter() - t0
        # the second call replays the recorded launches (chunk.py's launch cache): it is the one checked
        out = execute(prob, cfg, tensors, cu_seqlens=t["cu_seqlens"], dt_limit=lim, poison=True)
        first = first if isinstance(first, tuple) else (first,)
        out = out if isinstance(out, tuple) else (out,)
        y = out[0]
        meta_buf = allocate(prob, cfg, "meta")
        gaps = gluon_scan_gaps(prob, cfg, tensors, meta_buf) if cfg.scan_gluon else ["off"]
        wgaps = walk_gaps(prob, cfg, tensors, meta_buf) if cfg.state_walk else ["off"]
        res = {"problem": prob.key(), "state_dtype": state_dtype, "launches": depth, "config": cfg.as_dict(),
               "scan_kernel": "tl" if gaps else {2: "gluon_chunk", 3: "gluon_chunk_tma_y"}.get(cfg.scan_gluon, "gluon"), "scan_gluon_gaps": gaps if cfg.scan_gluon else [],
               "state_kernel": "tl" if wgaps else (f"walk in {walk_segments(prob, cfg)[1]} segments"
                                                    if cfg.walk_split > 1 and not gaps else "walk"),
               "walk_gaps": wgaps if cfg.state_walk else [],
               "tol": tolerance(prob.dtype, state_dtype), "finite": bool(torch.isfinite(y).all()),
               "first_call_s": round(run_s, 3), "y_err": rel_err(y[:, :, h_sl], yr)}
        i = 1
        if prob.return_final_states:
            res["final_err"] = rel_err(out[i][:, h_sl], fr)
            i += 1
        if prob.return_varlen_states:
            res["varlen_err"] = rel_err(out[i][:, h_sl], vr)
        errs = [v for k, v in res.items() if k.endswith("_err")]
        res["replay_bitwise"] = all(torch.equal(a, b) for a, b in zip(first, out))
        if cfg.pdl:
            res.update(pdl_checks(prob, cfg, tensors, t["cu_seqlens"], lim, out, seed))
        res["pass"] = res["finite"] and res["replay_bitwise"] and all(e <= res["tol"] for e in errs) \
            and res.get("graph_bitwise", True) and res.get("back_to_back_bitwise", True)
        results.append(res)
        del out, first
    del yr, fr, vr, t
    torch.cuda.empty_cache()
    return results


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=".")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--long", type=int, default=524288, help="tokens of the long case (0: skip)")
    ap.add_argument("--smem-pad", default=",".join(str(v) for v in KNOB_BY_NAME["smem_pad"].values if v),
                    help="smem_pad values to validate the Gluon chunk state with ('': none)")
    ap.add_argument("--depths", default="5,3,1", help="fusion depths to run every case at")
    ap.add_argument("--no-scan-gluon", action="store_true", help="skip the Gluon chunk-scan cases")
    ap.add_argument("--walk-only", action="store_true", help="only the state_walk cases")
    ap.add_argument("--pdl-only", action="store_true", help="only the pdl cases")
    ap.add_argument("--walk-weights-only", action="store_true", help="only the walk_weights cases")
    ap.add_argument("--scan-chunk-only", action="store_true", help="only the scan_gluon = 2 (or 3) cases")
    ap.add_argument("--scan-chunk-value", type=int, default=2, choices=(2, 3),
                    help="the scan_gluon value the chunk-walking cases run")
    ap.add_argument("--walk-split-only", action="store_true", help="only the walk_split cases")
    ap.add_argument("--walk-block-only", action="store_true", help="only the walk_block cases")
    ap.add_argument("--stored-only", action="store_true",
                    help="only the cases of the states the walk leaves out without final states")
    a = ap.parse_args()
    results = []
    todo = [(p, sd, None, None) for p, sd in cases(a.quick)]
    if a.long:
        todo.append((Problem(batch=1, seqlen=a.long, dtype="bf16", **M27, **FULL), "fp32", 8, None))
    todo += [(p, sd, None, over) for p, sd, over in
             smem_pad_cases([int(v) for v in a.smem_pad.split(",") if v])]
    if not a.no_scan_gluon:
        todo += [(p, sd, None, over) for p, sd, over in scan_gluon_cases()]
    todo += [(p, sd, None, over) for p, sd, over in walk_cases()]
    todo += [(p, sd, None, over) for p, sd, over in pdl_cases()]
    todo += [(p, sd, None, over) for p, sd, over in walk_weights_cases()]
    todo += [(p, sd, None, over) for p, sd, over in scan_chunk_cases(a.scan_chunk_value)]
    todo += [(p, sd, None, over) for p, sd, over in walk_split_cases()]
    todo += [(p, sd, None, over) for p, sd, over in walk_block_cases()]
    if a.stored_only:
        todo = [(p, sd, None, over) for p, sd, over in stored_cases()]
    if a.walk_only:   # (and the prep launch's cases, listed with them)
        todo = [case for case in todo if case[3] and not case[3].get("pdl") and not case[3].get("walk_weights")
                and case[3].get("scan_gluon", 0) < 2 and (case[3].get("state_walk") or case[3].get("fold_prep") == 2)]
    if a.pdl_only:
        todo = [case for case in todo if case[3] and case[3].get("pdl") and not case[3].get("walk_weights")
                and case[3].get("scan_gluon", 0) < 2]
    if a.walk_weights_only:
        todo = [case for case in todo if case[3] and case[3].get("walk_weights") and case[3].get("scan_gluon", 0) < 2]
    if a.scan_chunk_only:
        todo = [case for case in todo if case[3] and case[3].get("scan_gluon", 0) >= 2
                and case[3].get("walk_split", 1) == 1 and case[3].get("walk_block", 128) == 128]
    if a.walk_split_only:
        todo = [case for case in todo if case[3] and case[3].get("walk_split", 1) > 1
                and case[3].get("walk_block", 128) == 128]
    if a.walk_block_only:
        todo = [case for case in todo if case[3] and case[3].get("walk_block", 128) != 128]
    depths = [int(d) for d in a.depths.split(",")]
    meta = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "device": torch.cuda.get_device_name(),
            "torch": torch.__version__, "triton": __import__("triton").__version__,
            "command": " ".join(sys.argv)}
    os.makedirs(a.out, exist_ok=True)
    for i, (prob, sd, heads, over) in enumerate(todo):
        # the Gluon chunk state exists only in the five-launch family
        ds = [5] if over and (over.get("smem_pad") or over.get("state_walk") or over.get("fold_prep")
                              or over.get("pdl")) else \
            [d for d in depths if d != 1] if over else depths
        try:
            rs = run_case(prob, sd, seed=1000 + i, heads_ref=heads, overrides=over, depths=ds)
        except Exception as e:  # record and go on: one failure must not hide the others
            rs = [{"problem": prob.key(), "state_dtype": sd, "overrides": over, "pass": False,
                   "error": repr(e)[:500]}]
        for r in rs:
            results.append(r)
            errs = " ".join(f"{k}={v:.2e}" for k, v in r.items() if k.endswith("_err"))
            pdl_words = " ".join(f"{k}={r[k]} " for k in ("graph_bitwise", "back_to_back_bitwise") if k in r)
            print(f"{'PASS' if r['pass'] else 'FAIL'} launches={r.get('launches')} {prob.dtype} b={prob.batch} "
                  f"L={prob.seqlen} h={prob.nheads} g={prob.ngroups} state={sd} {over or ''} "
                  f"scan={r.get('scan_kernel')} states={r.get('state_kernel')} {errs} "
                  f"{pdl_words}"
                  f"tol={r.get('tol')} {r.get('error', '')}", flush=True)
        # rewritten after every case: a run cut by its time limit keeps what it checked
        with open(os.path.join(a.out, "gpu_validate.json"), "w") as f:
            json.dump({"meta": meta, "results": results, "cases_done": i + 1, "cases": len(todo)}, f,
                      indent=1)
    n_pass = sum(r["pass"] for r in results)
    print(f"{n_pass} passed, {len(results) - n_pass} failed")


if __name__ == "__main__":
    main()
