"""Greedy generation with a Hugging Face transformers Mamba-1 model (Mamba or FalconMamba), with
and without autossd.

    python examples/hf_mamba1.py                       # a tiny random-init Mamba on the GPU (fp32)
    python examples/hf_mamba1.py --falcon              # the same with FalconMamba's B/C/dt norms
    python examples/hf_mamba1.py --big --dtype bf16    # mamba-2.8b-like dims (random weights)
    TRITON_INTERPRET=1 python examples/hf_mamba1.py --device cpu --new 8   # no GPU: Triton's interpreter (slow)

Nothing is downloaded: the model is built from a MambaConfig (or FalconMambaConfig) with random
weights, so the tokens mean nothing; the point is that both runs produce the same tokens, and how
long each took. Without autossd (and without mamba_ssm or causal_conv1d installed) transformers
runs its PyTorch reference code; with `autossd.integrations.transformers.enable()` the prefill's
conv1d and selective scan and every decode step's conv update and state update run autossd's
kernels.
"""
from __future__ import annotations

import argparse
import time

import torch


def build(big: bool, falcon: bool, layers: int | None, dtype, device):
    from transformers import FalconMambaConfig, FalconMambaForCausalLM, MambaConfig, MambaForCausalLM
    Config, Model = (FalconMambaConfig, FalconMambaForCausalLM) if falcon else (MambaConfig, MambaForCausalLM)
    if big:   # mamba-2.8b: 64 layers, d_model 2560, d_inner 5120, dstate 16, dt rank 160, conv 4
        cfg = Config(vocab_size=50280, hidden_size=2560, num_hidden_layers=layers or 64, state_size=16, expand=2,
                     conv_kernel=4, time_step_rank=160)
    else:
        cfg = Config(vocab_size=256, hidden_size=64, num_hidden_layers=layers or 2, state_size=16, expand=2,
                     conv_kernel=4)
    torch.manual_seed(0)
    return Model(cfg).to(device=device, dtype=dtype).eval(), cfg


def generate(model, ids, new: int):
    if ids.is_cuda:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=new, min_new_tokens=new, do_sample=False)
    if ids.is_cuda:
        torch.cuda.synchronize()
    return out, time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--big", action="store_true", help="mamba-2.8b-like dims")
    ap.add_argument("--falcon", action="store_true", help="FalconMambaForCausalLM instead of MambaForCausalLM")
    ap.add_argument("--layers", type=int, help="override the number of layers")
    ap.add_argument("--dtype", default="fp32", choices=["fp32", "bf16", "fp16"])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--prompt", type=int, default=64, help="prompt tokens")
    ap.add_argument("--new", type=int, default=32, help="tokens to generate")
    a = ap.parse_args()
    import autossd.integrations.transformers as hf
    from autossd.render import interpreting
    if a.device == "cpu" and not interpreting():
        raise SystemExit("autossd's kernels need a GPU; on the CPU set TRITON_INTERPRET=1 (slow) to try them")
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[a.dtype]
    model, cfg = build(a.big, a.falcon, a.layers, dtype, a.device)
    ids = torch.randint(3, cfg.vocab_size, (a.batch, a.prompt), device=a.device)
    generate(model, ids[:, :8], 2)   # warm-up: allocations, the first kernels
    ref, t_ref = generate(model, ids, a.new)
    hf.enable(("falcon_mamba",) if a.falcon else ("mamba",))
    generate(model, ids[:, :8], 2)   # warm-up: autossd compiles its kernels on first use
    got, t_got = generate(model, ids, a.new)
    hf.disable()
    same = torch.equal(ref, got)
    agree = (ref[:, a.prompt:] == got[:, a.prompt:]).float().mean().item()
    print(f"{type(model).__name__}: {cfg.num_hidden_layers} layers, hidden {cfg.hidden_size}, d_inner "
          f"{cfg.intermediate_size}, dstate {cfg.state_size}, {a.dtype} on {a.device}; batch {a.batch}, "
          f"prompt {a.prompt}, {a.new} new tokens")
    print(f"transformers: {t_ref:.3f} s   autossd: {t_got:.3f} s   ({t_ref / t_got:.2f}x)")
    print(f"same tokens: {same}" + ("" if same else f" ({100 * agree:.0f}% of the new tokens agree; "
                                                   "low precision and random weights make near-ties)"))


if __name__ == "__main__":
    main()
