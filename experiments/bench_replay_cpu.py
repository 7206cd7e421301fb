"""The launch cache's replay, Python overhead only, on the CPU (BENCHMARKS §98): triton's launcher
built without a GPU, its compiled entry point and descriptor encoder replaced by no-ops, so what is
timed is autossd's replay and triton's Python around the entry point, per call of five (or four)
launches. Prints the tl config, the Gluon scan, the Gluon scan with the walk, and a bare loop that
calls the entry point directly (the floor of any replay in Python).

    python experiments/bench_replay_cpu.py
"""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import time, torch
from triton.backends.nvidia import driver as nv
from autossd.ops.ssd import chunk
from autossd.ops.ssd import plan as chunk_plan
from autossd.problem import Problem
from autossd.render import load
from autossd.ops.ssd.fwd_knobs import default_config
from autossd.testing import make_inputs
nv.make_tensordesc_arg = lambda arg, meta: [("tmap", arg.base.data_ptr(), meta), *arg.shape, *arg.strides]
chunk_plan.gluon_scan_gaps = lambda *a, **k: []
chunk_plan.walk_gaps = lambda *a, **k: []
prob = Problem(batch=1, seqlen=2048, nheads=8, headdim=64, dstate=128, ngroups=1, dtype="fp16", has_D=True, has_dt_bias=True, dt_softplus=True)
def rec_for(cfg):
    mod = load(cfg)
    t = make_inputs(prob, seed=1)
    buf = chunk.allocate(prob, cfg, "cpu")
    launches = chunk.plan(prob, cfg, t, buf, "cuda", (0.0, float("inf")))
    class C:
        function, packed_metadata = "fn", "meta"
        def __init__(self, ln):
            values = {**ln.args, **ln.constexprs}
            names = getattr(mod, ln.kernel).arg_names
            sig = {i: "tensordesc<fp16[64, 64]>" if isinstance(values[n], chunk._TMA_DESCRIPTORS) else "i32" for i, n in enumerate(names)}
            nd = sum(v.startswith("tensordesc") for v in sig.values())
            self.run = nv.CudaLauncher.__new__(nv.CudaLauncher)
            self.run.launch = nv.wrap_handle_tensordesc(lambda *a: None, sig, [{"m": i} for i in range(nd)] or None)
            self.run.num_ctas, self.run.launch_cooperative_grid, self.run.launch_pdl = 1, False, False
            self.run.global_scratch_size = self.run.profile_scratch_size = 0
            self.run.global_scratch_align = self.run.profile_scratch_align = 1
        def _init_handles(self): pass
    return chunk._record(launches, [C(ln) for ln in launches], t, buf, mod), t, buf
for name, cfg in [("tl", default_config("sm90", prob)), ("gluon scan", default_config("sm90", prob).replace(scan_gluon=1)),
                  ("gluon scan + walk", default_config("sm90", prob).replace(scan_gluon=1, state_walk=1))]:
    rec, t, buf = rec_for(cfg)
    n = 20000
    for _ in range(2):
        t0 = time.perf_counter()
        for _ in range(n):
            chunk._replay(rec, t, buf, stream=7)
        dt = (time.perf_counter() - t0) / n * 1e6
    print(f"{name:20s} {len(rec)} launches, replay Python overhead {dt:.2f} us (launcher entry stubbed)")
# what a direct call would save for kernels without descriptors: skip CudaLauncher.__call__
rec, t, buf = rec_for(default_config("sm90", prob))
direct = []
for ck, grid, srcs, template, slots, d in rec:
    run = ck.run
    head = (ck.function, False, False, None, None, ck.packed_metadata, None, None, None)
    direct.append((run.launch, grid, head, template, slots))
def replay_direct():
    for raw, grid, head, template, slots in direct:
        args = template.copy()
        for i, from_input, k, _ in slots:
            args[i] = (t[k] if from_input else getattr(buf, k)).data_ptr()
        raw(grid[0], grid[1], grid[2], 7, *head, *args)
n = 20000
for _ in range(2):
    t0 = time.perf_counter()
    for _ in range(n):
        replay_direct()
    dt = (time.perf_counter() - t0) / n * 1e6
print(f"tl, entry point called directly: {dt:.2f} us")
