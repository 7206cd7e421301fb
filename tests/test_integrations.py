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
