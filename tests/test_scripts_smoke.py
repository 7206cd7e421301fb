"""The GPU comparison scripts still run: their --smoke mode at tiny sizes, on the paths that need
no Triton kernel (so the test stays fast in the CPU interpreter): train_compare with the float64
reference standing in for mamba_ssm, bench_hf with transformers' own PyTorch path."""
import importlib.util
import json
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parent.parent / "scripts"


def _load(name):
    spec = importlib.util.spec_from_file_location(f"_script_{name}", SCRIPTS / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_train_compare_smoke(tmp_path):
    out = tmp_path / "train.json"
    assert _load("train_compare").main(["--smoke", "--ssd", "mamba_ssm", "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    assert [r["seed"] for r in res["runs"]] == [0, 1]
    for r in res["runs"]:
        assert len(r["losses"]) == res["args"]["steps"]
        assert r["losses"][-1] < r["losses"][0]   # it learns something in 4 steps
    assert set(res["agreement"]["between_seeds"]) == {"mamba_ssm"}
    assert 0 < res["loss_floor"]["0"] < res["loss_chance"]


def test_bench_hf_smoke(tmp_path):
    pytest.importorskip("transformers")
    out = tmp_path / "hf.json"
    assert _load("bench_hf").main(["--smoke", "--paths", "torch", "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    torch_path = res["paths"]["torch"]
    assert torch_path["prefill"]["median_s"] > 0
    assert set(torch_path["decode"]) == {"1", "2"}
    assert torch_path["decode"]["1"]["state_dtype"] == "torch.float32"


def test_bench_unseen_draws_reproducible_shapes_off_the_grid(capsys):
    from autossd.tuner.shapes import GRID_MAX_TOKENS, MODELS, grid_sizes
    mod = _load("bench_unseen")
    a, b = mod.draw(12, 0, "fp16"), mod.draw(12, 0, "fp16")
    assert [(m, p) for m, p in a] == [(m, p) for m, p in b] != mod.draw(12, 1, "fp16")
    assert len({(m, p) for m, p in a}) == 12
    for model, p in a:
        assert (p.batch, p.seqlen) not in grid_sizes() and p.batch * p.seqlen <= GRID_MAX_TOKENS
        assert (p.nheads, p.headdim, p.dstate, p.ngroups) == MODELS[model]
        assert p.has_D and p.has_dt_bias and p.dt_softplus and not p.has_z
    assert mod.main(["--list"]) == 0
    assert len(capsys.readouterr().out.strip().splitlines()) == 12

