"""runtime on a GPU: what the interpreter cannot show (tests/test_runtime.py runs only there)."""
import threading

import pytest
import torch

import autossd
from autossd import runtime
from autossd.ops.ssd.naive import ssd_chunked
from autossd.problem import Problem
from autossd.testing import call_kwargs, make_inputs, rel_err, tolerance

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="needs a GPU (Triton's interpreter is not thread-safe)")


def test_threads_calling_different_shapes_at_once_get_their_own_results():
    """The call cache, the launch cache and the kept workspaces under threads that call the
    drop-in at once with different shapes (each thread on the default stream)."""
    runtime.clear_cache()
    probs = [Problem(1, l, 2, 16, 16, 1, "fp32", 64, has_D=True) for l in (70, 130, 200)]
    results, errors = {}, []

    def worker(p):
        try:
            for seed in range(4):
                t = make_inputs(p, "cuda", seed=seed)
                args, kw = tuple(t[k] for k in ("x", "dt", "A", "B", "C")), call_kwargs(p, t)
                y = autossd.mamba_chunk_scan_combined(*args, 64, **kw)
                ref = ssd_chunked(*args, chunk_size=64,
                                  **{k: v for k, v in kw.items() if not k.startswith("return_")})[0]
                results[(p.seqlen, seed)] = rel_err(y, ref)
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)
    threads = [threading.Thread(target=worker, args=(p,)) for p in probs]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors, errors
    assert len(results) == 12 and all(e < tolerance("fp32") for e in results.values()), results
