"""Probe: walk_split's join, timed alone against its copy-rate floor (BENCHMARKS §147).

The join reads each segment's final state F_k (fp32) and whole decay g_k and writes the entering
states S_0 = init (or 0), S_k+1 = g_k S_k + F_k in the states' dtype, and the final states: at
130m 1x131072 (11 segments) 13 MB, 4 us at the copy rate, where §145 measured 19 us in place.
The shipped kernel runs the recurrence as `tl.associative_scan` over a (SEGS, BLOCK) tile; the
compiler's layout for that tile puts its segment axis across warps when BLOCK < 128 * num_warps
(the scan then crosses warps through shared memory), and in each thread's registers otherwise,
where the scan is the chain itself with every load issued ahead. The probe times the shipped
kernel at several BLOCK/num_warps and a Gluon form that fixes that layout, against a float64
reference and the floor (bytes / a measured device-to-device copy rate), by graph replay.

    python experiments/probe_walk_join.py [--out DIR] [--shapes 'H:NSEG:B;...']
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as ttgl

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


@gluon.jit
def _step(g1, f1, g2, f2):
    return g1 * g2, g2 * f1 + f2


@gluon.jit
def join_gluon(seg_ptr, gs_ptr, sen_ptr, final_ptr, H, PN, NSEG, s_fin_b, s_fin_h,
               SEGS: ttgl.constexpr, VEC: ttgl.constexpr, WARPS: ttgl.constexpr):
    # every segment of a column in one thread's registers: the scan is a chain in registers,
    # its loads all issued before the first step
    LAY: ttgl.constexpr = ttgl.BlockedLayout([SEGS, VEC], [1, 32], [1, WARPS], [1, 0])
    BLOCK: ttgl.constexpr = VEC * 32 * WARPS
    pid = ttgl.program_id(0)
    h = ttgl.program_id(1)
    b = ttgl.program_id(2)
    offs = pid * BLOCK + ttgl.arange(0, BLOCK, layout=ttgl.SliceLayout(0, LAY))
    ks = ttgl.arange(0, SEGS, layout=ttgl.SliceLayout(1, LAY))
    mask = offs < PN
    live = ks < NSEG
    bh = b * H + h
    at = bh.to(ttgl.int64) * NSEG * PN + ks[:, None] * PN + offs[None, :]
    both = live[:, None] & mask[None, :]
    F = ttgl.load(seg_ptr + at, mask=both, other=0.0)
    g = ttgl.load(gs_ptr + bh * NSEG + ks, mask=live, other=1.0)
    gb = ttgl.zeros([SEGS, BLOCK], ttgl.float32, LAY) + g[:, None]
    _, T = ttgl.associative_scan((gb, F), 0, _step)
    ttgl.store(sen_ptr + at - ks[:, None] * PN, ttgl.zeros([SEGS, BLOCK], sen_ptr.dtype.element_ty, LAY),
               mask=both & (ks == 0)[:, None])
    ttgl.store(sen_ptr + at + PN, T.to(sen_ptr.dtype.element_ty), mask=both & (ks < NSEG - 1)[:, None])
    fin = ttgl.sum(ttgl.where((ks == NSEG - 1)[:, None], T, 0.0), 0)
    ttgl.store(final_ptr + b.to(ttgl.int64) * s_fin_b + h * s_fin_h + offs, fin, mask=mask)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent.parent / "scratch" / "probe_walk_join"),
                    help="output folder (default: scratch/probe_walk_join, git-ignored)")
    ap.add_argument("--shapes", default="24:11:1;80:3:1;128:2:1;80:2:4",
                    help="nheads:segments:batch, headdim 64, dstate 128")
    args = ap.parse_args()
    from triton.testing import do_bench_cudagraph

    from autossd.problem import Problem
    from autossd.render import load
    from autossd.ops.ssd.fwd_knobs import default_config

    prob = Problem(batch=1, seqlen=131072, nheads=24, headdim=64, dstate=128, ngroups=1, dtype="fp16")
    mod = load(default_config("sm90", prob).replace(state_walk=1, scan_gluon=3, walk_split=11,
                                                     walk_weights=1, state_dtype="fp16"))
    big = torch.empty(1 << 28, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(big)
    copy_ms = do_bench_cudagraph(lambda: dst.copy_(big), rep=100, return_mode="median")
    copy_rate = 2 * big.numel() / (copy_ms * 1e-3)   # bytes read + written per second
    print(f"copy rate {copy_rate / 1e12:.2f} TB/s", flush=True)
    rows = []
    for spec in args.shapes.split(";"):
        H, NSEG, B = (int(v) for v in spec.split(":"))
        P, N = 64, 128
        PN, SEGS = P * N, triton.next_power_of_2(NSEG)
        gen = torch.Generator(device="cuda").manual_seed(7)
        F = torch.randn(B, H, NSEG, P, N, device="cuda", generator=gen)
        gs = torch.rand(B, H, NSEG, device="cuda", generator=gen) * 0.9 + 0.05
        S = torch.zeros(B, H, P, N, dtype=torch.float64, device="cuda")
        ref = []
        for k in range(NSEG):
            ref.append(S.clone())
            S = gs[:, :, k, None, None].double() * S + F[:, :, k].double()
        floor_us = (F.numel() * 4 + F.numel() * 2 + S.numel() * 4) / copy_rate * 1e6
        sen = torch.empty(B, H, NSEG, P, N, dtype=torch.float16, device="cuda")
        fin = torch.empty(B, H, P, N, device="cuda")

        def shipped(block, warps):
            return lambda: mod.ssd_walk_join[(triton.cdiv(PN, block), H, B)](
                F, gs, sen, None, fin, H, PN, NSEG, 0, 0, 0, 0, fin.stride(0), fin.stride(1),
                N=N, HAS_INIT=False, HAS_FINAL=True, BLOCK=block, SEGS=SEGS, num_warps=warps, num_stages=1)

        def gluon_(vec, warps):
            return lambda: join_gluon[(triton.cdiv(PN, vec * 32 * warps), H, B)](
                F, gs, sen, fin, H, PN, NSEG, fin.stride(0), fin.stride(1), SEGS=SEGS, VEC=vec, WARPS=warps,
                num_warps=warps)

        variants = {f"tl BLOCK={bl} warps={w}": shipped(bl, w)
                    for bl, w in ((max(32, 4096 // SEGS), 4), (512, 4), (1024, 4), (256, 2), (1024, 8))}
        variants.update({f"gluon VEC={v} warps={w}": gluon_(v, w) for v, w in ((4, 4), (2, 4), (4, 2), (8, 4))})
        for name, fn in variants.items():
            sen.fill_(float("nan"))
            fin.fill_(float("nan"))
            fn()
            torch.cuda.synchronize()
            err = max(((sen[:, :, k].double() - ref[k]).norm() / ref[k].norm().clamp_min(1e-30)).item()
                      if k else sen[:, :, 0].abs().max().item() for k in range(NSEG))
            err_f = ((fin.double() - S).norm() / S.norm()).item()
            us = do_bench_cudagraph(fn, rep=100, return_mode="median") * 1e3
            row = dict(nheads=H, segments=NSEG, batch=B, variant=name, us=us, floor_us=floor_us,
                       share=floor_us / us, err_states=err, err_final=err_f)
            rows.append(row)
            print(f"H={H:4d} nseg={NSEG:3d} b={B}  {name:24s} {us:7.2f} us  floor {floor_us:5.2f} us "
                  f"({100 * floor_us / us:4.1f}%)  err {err:.1e} / {err_f:.1e}", flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "walk_join.json").write_text(json.dumps(dict(device=torch.cuda.get_device_name(),
                                                        copy_rate=copy_rate, rows=rows), indent=1))


if __name__ == "__main__":
    main()
