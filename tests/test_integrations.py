"""autossd inside Hugging Face transformers' Mamba-2 (Triton's CPU interpreter; a tiny random-init
model, nothing downloaded): logits and greedy generation match transformers' own PyTorch path."""
import pytest
import torch

transformers = pytest.importorskip("transformers", reason="transformers is not installed (pip install 'autossd[hf]')")
if int(transformers.__version__.split(".")[0]) < 5:
    pytest.skip(f"transformers {transformers.__version__}: the hook targets transformers>=5", allow_module_level=True)

import autossd.integrations.transformers as hf  # noqa: E402
from autossd.ops.ssd import decode  # noqa: E402
from autossd import runtime  # noqa: E402


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    cfg = transformers.Mamba2Config(vocab_size=64, hidden_size=64, num_hidden_layers=1, num_heads=2, head_dim=64,
                                    expand=2, n_groups=1, state_size=16, chunk_size=64, conv_kernel=4,
                                    pad_token_id=0, bos_token_id=1, eos_token_id=2)
    return transformers.Mamba2ForCausalLM(cfg).eval()


@pytest.fixture
def counted(monkeypatch):
    """Counts the calls that reach autossd's entry points."""
    calls = {"chunk": 0, "step": 0}
    chunk, step = runtime.mamba_chunk_scan_combined, decode.selective_state_update

    def c(*a, **k):
        calls["chunk"] += 1
        return chunk(*a, **k)

    def s(*a, **k):
        calls["step"] += 1
        return s.inner(*a, **k)
    s.inner = step
    monkeypatch.setattr(runtime, "mamba_chunk_scan_combined", c)
    monkeypatch.setattr(decode, "selective_state_update", s)
    yield calls
    hf.disable()


def test_logits_and_greedy_generation_match_transformers(model, counted):
    ids = torch.randint(3, 64, (1, 6), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = model(ids).logits
        ref_tokens = model.generate(ids, max_new_tokens=32, min_new_tokens=32, do_sample=False)
        assert hf.enable() == list(hf.MODULES) and hf.is_enabled()
        got = model(ids).logits
        assert counted["chunk"] == 1   # the prefill of the one layer
        assert ((got - ref).norm() / ref.norm()).item() < 1e-4
        tokens = model.generate(ids, max_new_tokens=32, min_new_tokens=32, do_sample=False)
    assert counted["step"] == 31   # every decode step ran autossd's kernel
    assert torch.equal(tokens, ref_tokens)


def test_disable_restores_transformers_functions():
    from transformers.models.mamba2 import modeling_mamba2 as m
    before = (m.mamba2_chunk_scan, m.mamba2_selective_state_update)
    hf.enable(("mamba2",))
    assert m.mamba2_chunk_scan is not before[0] and m.mamba2_chunk_scan.autossd_replaces is before[0]
    hf.enable(("mamba2",))   # idempotent: the original is kept, not the adapter
    hf.disable()
    assert (m.mamba2_chunk_scan, m.mamba2_selective_state_update) == before
    with pytest.raises(ValueError, match="models"):
        hf.enable(("mamba3",))


def test_training_runs_the_whole_layer_and_its_gradients_match(model):
    """In training mode without a cache, transformers calls the whole-layer function: enabled, it
    is autossd's (conv1d, SSD, gated norm in Triton), and the loss and every parameter's gradient
    match transformers' own PyTorch path."""
    import copy
    from autossd.ops.ssd import split_conv1d
    from transformers.models.mamba2 import modeling_mamba2 as m
    ids = torch.randint(3, 64, (2, 70), generator=torch.Generator().manual_seed(2))
    ref_model, got_model = copy.deepcopy(model).train(), copy.deepcopy(model).train()
    ref_loss = ref_model(ids, labels=ids).loss
    ref_loss.backward()
    calls = []
    real = split_conv1d.mamba_split_conv1d_scan_combined

    def counting(*a, **k):
        calls.append(1)
        return real(*a, **k)
    try:
        hf.enable(("mamba2",))
        split_conv1d.mamba_split_conv1d_scan_combined = counting
        assert m.mamba2_split_conv1d_scan_combined.autossd_replaces is not None
        loss = got_model(ids, labels=ids).loss
        loss.backward()
    finally:
        split_conv1d.mamba_split_conv1d_scan_combined = real
        hf.disable()
    assert calls == [1]
    assert abs(loss.item() - ref_loss.item()) < 1e-4 * abs(ref_loss.item())
    for (name, p), q in zip(got_model.named_parameters(), ref_model.parameters()):
        assert p.grad is not None and q.grad is not None, name
        assert ((p.grad - q.grad).norm() / q.grad.norm().clamp_min(1e-30)).item() < 1e-3, name


# --- Mamba-1: MambaForCausalLM and FalconMambaForCausalLM -------------------------------------
def _mamba1(kind: str, conv_kernel: int = 4, layers: int = 2):
    torch.manual_seed(0)
    kw = dict(vocab_size=64, hidden_size=64, state_size=16, num_hidden_layers=layers, expand=2,
              conv_kernel=conv_kernel, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    if kind == "mamba":
        return transformers.MambaForCausalLM(transformers.MambaConfig(**kw)).eval()
    return transformers.FalconMambaForCausalLM(transformers.FalconMambaConfig(**kw)).eval()


@pytest.fixture
def counted1(monkeypatch):
    """Counts the calls that reach autossd's Mamba-1 entry points (the adapters look them up at
    each call)."""
    import autossd
    from autossd.ops.mamba1 import inner as mamba_inner
    from autossd.ops.conv1d import causal_conv1d as cc
    calls = {}

    def count(obj, name, key):
        real = getattr(obj, name)

        def f(*a, **k):
            calls[key] = calls.get(key, 0) + 1
            return real(*a, **k)
        monkeypatch.setattr(obj, name, f)
    count(autossd, "selective_scan_fn", "scan")
    count(decode, "selective_state_update", "step")
    count(cc, "causal_conv1d", "conv")
    count(cc, "causal_conv1d_update", "conv_step")
    count(mamba_inner, "mamba_inner_fn", "inner")
    count(mamba_inner, "selective_scan_fn", "scan")   # mamba_inner_fn's own reference to the scan
    yield calls
    hf.disable()


@pytest.mark.parametrize("kind", ["mamba", "falcon_mamba"])
def test_mamba1_greedy_generation_matches_transformers(kind, counted1):
    """Prefill (conv1d and selective scan) and every decode step (conv update and state update)
    run autossd's kernels, and the greedy tokens equal transformers' own PyTorch path's."""
    model = _mamba1(kind)
    ids = torch.randint(3, 64, (2, 6), generator=torch.Generator().manual_seed(1))
    new = 6   # five steps of one token after generate's prefill, each through the cache the last one left
    with torch.no_grad():
        ref = model(ids).logits
        ref_tokens = model.generate(ids, max_new_tokens=new, min_new_tokens=new, do_sample=False)
        assert kind in hf.enable((kind,)) and hf.is_enabled(kind)
        got = model(ids).logits
        assert counted1 == {"scan": 2, "conv": 2}   # the prefill of the two layers
        assert ((got - ref).norm() / ref.norm()).item() < 1e-4
        tokens = model.generate(ids, max_new_tokens=new, min_new_tokens=new, do_sample=False)
    # generate's prefill, then new - 1 steps of one token, in each of the two layers
    assert counted1 == {"scan": 4, "conv": 4, "step": 2 * (new - 1), "conv_step": 2 * (new - 1)}
    assert torch.equal(tokens, ref_tokens)


@pytest.mark.parametrize("kind", ["mamba", "falcon_mamba"])
def test_mamba1_training_step_matches_transformers(kind, counted1):
    """In training mode without a cache, Mamba's mixer takes autossd.mamba_inner_fn; FalconMamba's
    runs its per-step functions (autossd's conv1d and scan: mamba_inner_fn would normalize dt
    after the dt projection, where FalconMamba normalizes it before). The loss and every
    parameter's gradient match transformers' own PyTorch path."""
    import copy
    base = _mamba1(kind)
    ids = torch.randint(3, 64, (2, 20), generator=torch.Generator().manual_seed(2))
    ref_model, got_model = copy.deepcopy(base).train(), copy.deepcopy(base).train()
    ref_loss = ref_model(ids, labels=ids).loss
    ref_loss.backward()
    assert counted1 == {}
    hf.enable((kind,))
    loss = got_model(ids, labels=ids).loss
    loss.backward()
    hf.disable()
    if kind == "mamba":
        assert counted1 == {"inner": 2, "scan": 2, "conv": 2}   # mamba_inner_fn runs the conv1d and the scan
    else:
        assert counted1 == {"scan": 2, "conv": 2}
    assert abs(loss.item() - ref_loss.item()) < 1e-5 * abs(ref_loss.item())
    for (name, p), q in zip(got_model.named_parameters(), ref_model.parameters()):
        assert p.grad is not None and q.grad is not None, name
        assert float(q.grad.norm()) > 0, f"{name}: zero reference gradient, the check would be empty"
        assert ((p.grad - q.grad).norm() / q.grad.norm()).item() < 1e-4, name


def test_mamba1_disable_restores_transformers_functions():
    from transformers.models.falcon_mamba import modeling_falcon_mamba as fm
    from transformers.models.mamba import modeling_mamba as m
    names = (hf.CONV_NAME, hf.CONV_STEP_NAME, hf.SCAN_NAME, hf.SCAN_STEP_NAME, hf.INNER_NAME)
    before = {mod: tuple(getattr(mod, n) for n in names) for mod in (m, fm)}
    assert hf.enable(("mamba", "falcon_mamba")) == ["mamba", "falcon_mamba"]
    for mod, funcs in before.items():
        for n, f in zip(names, funcs):
            assert getattr(mod, n) is not f and getattr(mod, n).autossd_replaces is f, n
    hf.enable(("mamba",))   # idempotent: the original is kept, not the adapter
    assert hf.is_enabled("mamba") and hf.is_enabled("falcon_mamba") and not hf.is_enabled("mamba2")
    hf.disable()
    for mod, funcs in before.items():
        assert tuple(getattr(mod, n) for n in names) == funcs


def test_mamba1_configuration_autossd_cannot_serve_falls_back(counted1, caplog):
    """A conv width autossd's conv1d does not take (5): the conv runs transformers' own function,
    with one warning line, the scan and the decode step still run autossd's, and the tokens equal
    transformers' own path's."""
    model = _mamba1("mamba", conv_kernel=5, layers=1)
    ids = torch.randint(3, 64, (1, 5), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ref = model.generate(ids, max_new_tokens=4, min_new_tokens=4, do_sample=False)
        hf._warned.clear()
        hf.enable(("mamba",))
        with caplog.at_level("WARNING", logger="autossd"):
            got = model.generate(ids, max_new_tokens=4, min_new_tokens=4, do_sample=False)
    assert torch.equal(got, ref)
    assert counted1 == {"scan": 1, "step": 3}
    lines = [r.getMessage() for r in caplog.records if r.name == "autossd"]
    assert len(lines) == 2 and all("conv width 5" in x and "\n" not in x for x in lines), lines
