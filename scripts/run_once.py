"""Run one forward of a config at one shape, a few times: a target for `ncu` / `nsys`.

    ncu --set full --import-source yes -k regex:ssd_chunk_scan -c 1 -o REPORT \\
        python scripts/run_once.py --shape mamba2-2.7b:1x131072 --dtype fp16 [--config JSON]
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from autossd.ops.ssd.chunk import execute  # noqa: E402
from autossd.problem import Problem  # noqa: E402
from autossd.space import default_config, fit  # noqa: E402
from autossd.testing import make_inputs  # noqa: E402
from autossd.tuner.shapes import MODELS  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="mamba2-2.7b:1x131072", help="model:BxL")
    ap.add_argument("--dtype", default="fp16")
    ap.add_argument("--config", default="{}", help="JSON overrides of the sm90 default")
    ap.add_argument("--repeat", type=int, default=3)
    a = ap.parse_args()
    model, bl = a.shape.split(":")
    b, l = (int(v) for v in bl.split("x"))
    h, p, n, g = MODELS[model]
    prob = Problem(batch=b, seqlen=l, nheads=h, headdim=p, dstate=n, ngroups=g, dtype=a.dtype,
                   chunk_size=256, has_D=True, has_dt_bias=True, dt_softplus=True)
    cfg = fit(default_config("sm90", prob).replace(**json.loads(a.config)), prob)
    t = make_inputs(prob, "cuda", seed=5)
    tensors = {k: t[k] for k in ("x", "dt", "A", "B", "C", "D", "z", "dt_bias", "initial_states", "seq_idx")}
    for _ in range(a.repeat):
        execute(prob, cfg, tensors)
    torch.cuda.synchronize()
    print(f"{a.shape} {a.dtype} {cfg!r}")


if __name__ == "__main__":
    main()
