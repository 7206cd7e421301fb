# y of the default five launches against the float64 chunked reference (probe check; even shapes only)
import sys, torch
from autossd.problem import Problem
from autossd.space import default_config
from autossd.ops.ssd.chunk import ssd_forward
from autossd.ops.ssd.naive import ssd_chunked
from autossd.testing import make_inputs, rel_err, tolerance, call_kwargs
dev = sys.argv[1] if len(sys.argv) > 1 else "cpu"
for dtype in ("fp16", "bf16"):
    prob = Problem(batch=2, seqlen=1024, nheads=3, headdim=64, dstate=128, ngroups=1, dtype=dtype, chunk_size=256,
                   has_D=True)
    t = make_inputs(prob, dev, seed=3)
    kw = call_kwargs(prob, t)
    out = ssd_forward(t["x"], t["dt"], t["A"], t["B"], t["C"], 256, config=default_config("sm90", prob),
                      poison=True, state_dtype={"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}[default_config("sm90", prob).state_dtype], **kw)
    y = out[0] if isinstance(out, tuple) else out
    ref = ssd_chunked(t["x"], t["dt"], t["A"], t["B"], t["C"], 256,
                      **{k: v for k, v in kw.items() if not k.startswith("return_")})[0]
    e = rel_err(y, ref)
    print(dtype, "y rel err", f"{e:.2e}", "tol", tolerance(dtype, "fp16"), "OK" if e <= tolerance(dtype, "fp16") else "WRONG")
