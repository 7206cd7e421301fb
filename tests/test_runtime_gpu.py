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


def test_a_malformed_cu_seqlens_gives_nan_states_not_a_device_assert():
    """On a GPU an out-of-bounds index is a device-side assert that leaves the process's CUDA
    context unusable; a malformed cu_seqlens must instead give NaN states, and the next call
    must still run."""
    runtime.clear_cache()
    p = Problem(1, 150, 2, 16, 16, 1, "fp32", 64, has_seq_idx=True, return_varlen_states=True)
    t = make_inputs(p, "cuda", seed=5)
    args, kw = tuple(t[k] for k in ("x", "dt", "A", "B", "C")), call_kwargs(p, t)
    for bad in ([0, 400], [0, 90, 40, 150], [-7, 150]):
        _, states = autossd.mamba_chunk_scan_combined(
            *args, 64, **{**kw, "cu_seqlens": torch.tensor(bad, dtype=torch.int32, device="cuda")})
        torch.cuda.synchronize()
        assert torch.isnan(states).all()
    y, states = autossd.mamba_chunk_scan_combined(*args, 64, **kw)
    ref = ssd_chunked(*args, chunk_size=64, **{k: v for k, v in kw.items() if not k.startswith("return_")})
    assert rel_err(y, ref[0]) < tolerance("fp32") and rel_err(states, ref[2]) < tolerance("fp32")


def test_state_dtype_sets_the_states_precision_on_the_gpu():
    from autossd.ops.ssd.chunk import ssd_forward
    runtime.clear_cache()
    p = Problem(1, 300, 4, 32, 32, 1, "bf16", 64, has_D=True, return_final_states=True)
    t = make_inputs(p, "cuda", seed=4)
    args, kw = tuple(t[k] for k in ("x", "dt", "A", "B", "C")), call_kwargs(p, t)
    kw.pop("return_final_states")
    cfg = runtime.get_kernel(p).config
    assert cfg.state_dtype != "fp32"
    y32, f32 = autossd.mamba_chunk_scan_combined(*args, 64, **kw, return_final_states=True,
                                                 state_dtype=torch.float32)
    ye, fe = ssd_forward(*args, 64, **kw, return_final_states=True, config=cfg.replace(state_dtype="fp32"))
    assert torch.equal(y32, ye) and torch.equal(f32, fe)
    _, f16 = autossd.mamba_chunk_scan_combined(*args, 64, **kw, return_final_states=True)
    assert not torch.equal(f16, f32)
