"""Hugging Face transformers' Mamba2ForCausalLM (or, with --model, its Mamba-1 models) three ways,
in one run: prefill latency, decode tokens/s, and whether the three agree.

    python scripts/bench_hf.py --json OUT.json           # mamba2-2.7b dims, random weights, bf16, on the GPU
    python scripts/bench_hf.py --smoke --json OUT.json   # a tiny model on the CPU (Triton's interpreter)
    python scripts/bench_hf.py --model mamba --json OUT.json          # MambaForCausalLM, mamba-2.8b dims
    python scripts/bench_hf.py --model falcon_mamba --json OUT.json   # FalconMambaForCausalLM, the same dims

The model is built from a Mamba2Config with mamba2-2.7b's dimensions (d_model 2560, 64 layers,
80 heads of 64, d_state 128, one group, conv 4, expand 2, vocab 50288, chunk 256, tied
embedding) and random weights (nothing is downloaded), in bf16 (--dtype fp32: the paths agree to
rounding). The three paths differ only in the two functions transformers' Mamba-2 mixer calls for
its SSD: the chunked scan (prefill) and the one-token state update (decode):

  torch      transformers' own PyTorch code for both (what it runs without mamba_ssm).
  mamba_ssm  mamba_ssm's Triton kernels: transformers resolves them itself when its Mamba-2
             module is imported, through `importlib.import_module("mamba_ssm")` and the path
             `ops.triton.ssd_combined.mamba_chunk_scan_combined` (and
             `ops.triton.selective_state_update.selective_state_update`). mamba_ssm's package
             __init__ imports its CUDA extensions, which this wheel does not have, so that import
             fails and transformers falls back to PyTorch; this script first makes the package
             importable by its name with the __init__ bypassed (autossd.peer.load_mamba_ssm),
             so transformers' own lookup finds the Triton kernels. Which function each name
             resolved to is checked and recorded.
  autossd    autossd.integrations.transformers.enable(): autossd's kernels for both.

--model mamba and --model falcon_mamba build MambaForCausalLM / FalconMambaForCausalLM with
mamba-2.8b's dimensions (d_model 2560, d_inner 5120, d_state 16, dt rank 160, conv 4, vocab 50280;
8 layers and a 2048-token prefill unless --layers / --prefill say otherwise: transformers' own
Mamba-1 scan is a Python loop over the tokens). There the paths differ in the five functions the
Mamba-1 mixer calls: the causal conv1d and the selective scan (prefill), the conv update and the
state update (decode), and mamba_inner_fn (training only, never here); the mamba_ssm path needs
mamba_ssm's CUDA selective scan and causal_conv1d, and is skipped when transformers did not
resolve them.

For Mamba-2, everything else is transformers' PyTorch code in all three: the causal conv1d (causal_conv1d is
not installed, so transformers uses F.conv1d), the norms, the projections, the LM head. The fused
split-conv-scan kernel transformers can take from mamba_ssm is used only when training without a
cache, never here.

Figures, per path:
  prefill   one forward of batch 1 x --prefill tokens with a cache (as generate's first step:
            the final SSM and conv states are kept, logits for the last position only), wall
            time around it, CUDA-synchronized; median of --reps after a warm-up call (the
            warm-up compiles Triton kernels and runs mamba_ssm's autotuning).
  logits    a separate forward without a cache, logits at every position, compared with the
            torch path's: max |a - b| / max |b| (max relative difference), relative L2, and the
            share of positions whose argmax agrees.
  decode    after a --prompt-token prefill, --new greedy steps of one token per sequence
            through the model's cache (eager PyTorch, no CUDA graphs, so batch 1 is bound by
            the host launching ~30 kernels per layer); tokens/s = batch x steps / time of the
            steps; the share of greedy tokens equal to the torch path's (random weights make
            near-ties, so a few differ in bf16).
  floor     for decode only: the bytes one step must move at least (weights read once, SSM and
            conv states read and written) over the copy bandwidth measured in the same run.
            Prefill has no floor here: the SSD layer's is not the model's.
"""
from __future__ import annotations

import argparse
import contextlib
import inspect
import json
import os
import statistics
import sys
import time

CHUNK, STEP, FUSED = "mamba2_chunk_scan", "mamba2_selective_state_update", "mamba2_split_conv1d_scan_combined"
PATHS = ("torch", "mamba_ssm", "autossd")
MODELS = ("mamba2", "mamba", "falcon_mamba")
# the module-level functions each model's mixer calls, and those that must resolve to mamba_ssm
# (or causal_conv1d) for its path to be the packages' kernels
FUNCS = {"mamba2": (CHUNK, STEP, FUSED),
         "mamba": ("causal_conv1d_fn", "causal_conv1d_update", "mamba_selective_scan",
                   "mamba_selective_state_update", "mamba_inner_fn")}
FUNCS["falcon_mamba"] = FUNCS["mamba"]
KERNEL_FUNCS = {"mamba2": (CHUNK, STEP), "mamba": FUNCS["mamba"][:4], "falcon_mamba": FUNCS["mamba"][:4]}


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--paths", default=",".join(PATHS), help="comma-separated, from " + ", ".join(PATHS))
    ap.add_argument("--model", default="mamba2", choices=MODELS,
                    help="mamba2: Mamba2ForCausalLM (mamba2-2.7b dims); mamba / falcon_mamba: MambaForCausalLM / "
                         "FalconMambaForCausalLM (mamba-2.8b dims)")
    ap.add_argument("--layers", type=int, default=None, help="default: 64 (mamba2), 8 (mamba, falcon_mamba)")
    ap.add_argument("--prefill", type=int, default=None,
                    help="prefill tokens (batch 1); default: 8192 (mamba2), 2048 (mamba, falcon_mamba)")
    ap.add_argument("--reps", type=int, default=3, help="timed prefills per path")
    ap.add_argument("--batches", default="1,64", help="decode batch sizes")
    ap.add_argument("--prompt", type=int, default=16, help="prompt tokens before decoding")
    ap.add_argument("--new", type=int, default=64, help="decode steps timed")
    ap.add_argument("--no-logits", action="store_true", help="skip the full-logits comparison")
    ap.add_argument("--device", default=None, help="default: cuda; with --smoke: cpu")
    ap.add_argument("--smoke", action="store_true",
                    help="a tiny model and sizes, to check the script runs (on the CPU: Triton's interpreter; "
                         "mamba_ssm's kernels need a GPU, so only its resolution is checked)")
    ap.add_argument("--dtype", default="bf16", choices=("bf16", "fp16", "fp32"),
                    help="the model's parameters and activations (fp32: the paths' logits agree to rounding)")
    ap.add_argument("--json", default=None, help="where to write the raw results")
    a = ap.parse_args(argv)
    mamba2 = a.model == "mamba2"
    a.layers = a.layers or (64 if mamba2 else 8)
    a.prefill = a.prefill or (8192 if mamba2 else 2048)
    if a.smoke:
        a.device = a.device or "cpu"
        # the Mamba-1 scan walks its chunks one after another: in the interpreter a short prefill
        a.layers, a.prefill, a.reps, a.batches, a.prompt, a.new = 2, 200 if mamba2 else 40, 1, "1,2", 8, 3
    a.device = a.device or "cuda"
    a.paths = [p.strip() for p in a.paths.split(",") if p.strip()]
    bad = sorted(set(a.paths) - set(PATHS))
    if bad:
        ap.error(f"--paths: unknown {bad}")
    a.batches = [int(b) for b in a.batches.split(",")]
    return a


def config(a):
    from transformers import FalconMambaConfig, Mamba2Config, MambaConfig
    if a.model != "mamba2":
        Config = MambaConfig if a.model == "mamba" else FalconMambaConfig
        if a.smoke:
            return Config(vocab_size=256, hidden_size=64, num_hidden_layers=a.layers, state_size=16, expand=2,
                          conv_kernel=4, tie_word_embeddings=True)
        # mamba-2.8b: d_model 2560, n_layer 64, vocab 50277 padded to 50280, d_state 16, expand 2
        # (d_inner 5120), dt rank ceil(2560 / 16) = 160, d_conv 4, RMSNorm eps 1e-5, residual in
        # fp32, tied embedding
        return Config(vocab_size=50280, hidden_size=2560, num_hidden_layers=a.layers, state_size=16, expand=2,
                      conv_kernel=4, time_step_rank=160, layer_norm_epsilon=1e-5, residual_in_fp32=True,
                      tie_word_embeddings=True)
    if a.smoke:
        return Mamba2Config(vocab_size=256, hidden_size=64, num_hidden_layers=a.layers, num_heads=4, head_dim=32,
                            expand=2, n_groups=1, state_size=16, conv_kernel=4, chunk_size=64,
                            tie_word_embeddings=True)
    # mamba2-2.7b: d_model 2560, n_layer 64, vocab 50277 padded to a multiple of 16, d_state 128,
    # headdim 64, expand 2 (so 80 heads), ngroups 1, d_conv 4, chunk 256, RMSNorm eps 1e-5,
    # residual in fp32, tied embedding
    return Mamba2Config(vocab_size=50288, hidden_size=2560, num_hidden_layers=a.layers, num_heads=80, head_dim=64,
                        expand=2, n_groups=1, state_size=128, conv_kernel=4, chunk_size=256, layer_norm_epsilon=1e-5,
                        residual_in_fp32=True, tie_word_embeddings=True)


def resolved_name(fn) -> str:
    """Which implementation a transformers kernel wrapper calls: the function its decorator
    picked when the module was imported (read from the wrapper's closure), as module.name."""
    try:
        impl = inspect.getclosurevars(fn).nonlocals.get("implementation")
    except TypeError:
        impl = None
    impl = impl or fn   # no such closure: the function itself runs (transformers' own, or autossd's adapter)
    return f"{getattr(impl, '__module__', '?')}.{getattr(impl, '__qualname__', '?')}"


class Paths:
    """Switches one of transformers' Mamba modeling modules between the three paths."""

    def __init__(self, mod, model="mamba2"):
        self.mod, self.model = mod, model
        self.resolved = {n: getattr(mod, n) for n in FUNCS[model]}
        # the decorator keeps transformers' own function as __wrapped__ (functools.wraps)
        self.torch_fns = {n: inspect.unwrap(f) for n, f in self.resolved.items()}
        self.names = {n: resolved_name(f) for n, f in self.resolved.items()}

    def mamba_ssm_resolved(self) -> bool:
        return all(self.names[n].startswith(("mamba_ssm.", "causal_conv1d.")) for n in KERNEL_FUNCS[self.model])

    @contextlib.contextmanager
    def use(self, path: str):
        if path == "torch":
            for n, f in self.torch_fns.items():
                setattr(self.mod, n, f)
            try:
                yield
            finally:
                for n, f in self.resolved.items():
                    setattr(self.mod, n, f)
        elif path == "mamba_ssm":
            yield
        else:
            import autossd.integrations.transformers as hf
            hf.enable((self.model,))
            try:
                yield
            finally:
                hf.disable()


def sync(dev):
    import torch
    if dev.type == "cuda":
        torch.cuda.synchronize()


def copy_gbps(dev) -> float | None:
    import torch
    if dev.type != "cuda":
        return None
    n = 1 << 30
    src = torch.empty(n, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    e0.record()
    for _ in range(10):
        dst.copy_(src)
    e1.record()
    torch.cuda.synchronize()
    del src, dst
    return 2 * n * 10 / (e0.elapsed_time(e1) * 1e-3) / 1e9   # read and written


def prefill(model, ids, reps, dev):
    import torch
    with torch.no_grad():
        model(ids, use_cache=True, logits_to_keep=1)   # warm-up: compiles, autotunes
        sync(dev)
        if dev.type == "cuda":
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
        times = []
        for _ in range(reps):
            sync(dev)
            t0 = time.perf_counter()
            out = model(ids, use_cache=True, logits_to_keep=1)
            sync(dev)
            times.append(time.perf_counter() - t0)
            del out
    res = {"s": times, "median_s": statistics.median(times), "tokens_per_s": ids.numel() / statistics.median(times)}
    if dev.type == "cuda":
        res["peak_above_weights_MiB"] = (torch.cuda.max_memory_allocated() - base) / 2**20
    return res


def full_logits(model, ids):
    import torch
    with torch.no_grad():
        return model(ids, use_cache=False).logits.float()


def compare_logits(got, ref) -> dict:
    diff = (got - ref).abs()
    return {"max_abs_diff": float(diff.max()), "max_abs_ref": float(ref.abs().max()),
            "max_rel_diff": float(diff.max() / ref.abs().max()),
            "rel_l2": float((got - ref).norm() / ref.norm()),
            "argmax_agree": float((got.argmax(-1) == ref.argmax(-1)).float().mean())}


def decode(model, prompt, steps, dev):
    """Greedy decoding through the model's cache: (tokens (batch, steps), seconds for the steps,
    the cache's SSM state dtype)."""
    import torch
    with torch.no_grad():
        out = model(prompt, use_cache=True, logits_to_keep=1)
        # transformers before 5.20 returns the Mamba cache as cache_params, and a step takes it
        # under that name with the token's position
        legacy = not hasattr(out, "cache")
        cache = out.cache_params if legacy else out.cache
        tok = out.logits[:, -1].argmax(-1)
        toks = []
        sync(dev)
        t0 = time.perf_counter()
        for i in range(steps):
            if legacy:
                pos = torch.full((1,), prompt.shape[1] + i, dtype=torch.long, device=prompt.device)
                out = model(tok[:, None], cache_params=cache, use_cache=True, cache_position=pos)
            else:
                out = model(tok[:, None], cache=cache, use_cache=True)
            tok = out.logits[:, -1].argmax(-1)
            toks.append(tok)
        sync(dev)
        dt = time.perf_counter() - t0
    return torch.stack(toks, 1), dt, *_layer_states(cache)


def _layer_states(cache):
    """(SSM state, conv state) of the first layer, or (None, None) where this transformers' cache
    does not hand them out (before 5.20: then no decode floor is printed)."""
    if hasattr(cache, "get_recurrent_state"):
        return cache.get_recurrent_state(0), cache.get_conv_state(0)
    return None, None


def decode_floor_s(model, state, conv, layers, gbps):
    """Bytes of one decode step at least: every weight read once (the tied embedding counts
    once: the step reads one row of it and all of it as the LM head), each layer's SSM and
    conv state read and written."""
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    states = layers * 2 * (state.numel() * state.element_size() + conv.numel() * conv.element_size())
    return (weights + states) / (gbps * 1e9), weights, states


def main(argv=None) -> int:
    a = parse_args(argv)
    if a.device == "cpu" and "TRITON_INTERPRET" not in os.environ:
        # before triton is first imported: its language helpers are built interpreted only then
        os.environ["TRITON_INTERPRET"] = "1"
    import torch
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
    dev = torch.device(a.device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        print("no GPU here: run with --smoke (CPU, Triton's interpreter) or on a GPU")
        return 2
    t_start = time.time()

    # mamba_ssm importable by its name before transformers' Mamba-2 module looks for it
    from autossd.peer import load_mamba_ssm
    peer_why = None
    try:
        have_peer = (load_mamba_ssm() is not None
                     and load_mamba_ssm("selective_state_update", "selective_state_update") is not None)
        if not have_peer:
            peer_why = "mamba_ssm is not installed"
    except Exception as e:   # noqa: BLE001 - e.g. built for another torch
        have_peer, peer_why = False, f"{type(e).__name__}: {e}"
    mod_path = f"transformers.models.{a.model}.modeling_{a.model}"
    if mod_path in sys.modules:
        print(f"note: {mod_path} was imported before mamba_ssm was made importable")
    import importlib

    import transformers
    m2 = importlib.import_module(mod_path)
    Model = {"mamba2": transformers.Mamba2ForCausalLM, "mamba": transformers.MambaForCausalLM,
             "falcon_mamba": transformers.FalconMambaForCausalLM}[a.model]
    transformers.logging.set_verbosity_error()   # its fallback warnings would repeat what this script says
    paths = Paths(m2, a.model)
    print(f"transformers {transformers.__version__}; resolved at import: "
          + "; ".join(f"{n} -> {v}" for n, v in paths.names.items()))
    skipped = {}
    if "mamba_ssm" in a.paths:
        if not paths.mamba_ssm_resolved():
            skipped["mamba_ssm"] = ("transformers did not resolve the kernels of mamba_ssm"
                                    + ("" if a.model == "mamba2" else " and causal_conv1d")
                                    + (f" ({peer_why})" if peer_why else ""))
        elif dev.type != "cuda":
            # its launchers select a CUDA device and autotune with GPU timers
            skipped["mamba_ssm"] = "resolved, but mamba_ssm's Triton launchers need a CUDA device"
    run_paths = [p for p in a.paths if p not in skipped]
    for p, why in skipped.items():
        print(f"path {p}: skipped: {why}")

    cfg = config(a)
    torch.manual_seed(0)
    with torch.device(dev):
        model = Model(cfg)
    model = model.to({"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[a.dtype]).eval()
    nparams = sum(p.numel() for p in model.parameters())
    shape = (f"{cfg.num_heads} heads x {cfg.head_dim}, state {cfg.state_size}, groups {cfg.n_groups}, chunk "
             f"{cfg.chunk_size}" if a.model == "mamba2" else
             f"d_inner {cfg.intermediate_size}, state {cfg.state_size}, dt rank {cfg.time_step_rank}")
    print(f"{Model.__name__}: {cfg.num_hidden_layers} layers, hidden {cfg.hidden_size}, {shape}, vocab "
          f"{cfg.vocab_size}; {nparams / 1e9:.2f} B parameters, {a.dtype}, random weights; device {a.device}")
    g = torch.Generator(device="cpu").manual_seed(1)
    ids = torch.randint(0, cfg.vocab_size, (1, a.prefill), generator=g).to(dev)
    prompts = {b: torch.randint(0, cfg.vocab_size, (b, a.prompt), generator=g).to(dev) for b in a.batches}
    gbps = copy_gbps(dev)

    results = {p: {"skipped": why} for p, why in skipped.items()}
    ref_logits, ref_tokens = None, {}
    # every path's logits and tokens, to compare the kernel paths with each other too: a deep
    # random-init model amplifies bf16 rounding from layer to layer, so two correct paths can
    # drift apart, and the torch path computes the SSD in fp32 where the kernels take bf16
    kept_logits, kept_tokens = {}, {}
    for p in run_paths:
        r = results[p] = {}
        with paths.use(p):
            r["ssd_functions"] = {n: resolved_name(getattr(m2, n)) for n in KERNEL_FUNCS[a.model]}
            t0 = time.time()
            r["prefill"] = prefill(model, ids, a.reps, dev)
            if not a.no_logits:
                logits = full_logits(model, ids)
                if ref_logits is None and p == "torch":
                    ref_logits = logits
                elif ref_logits is not None:
                    r["logits_vs_torch"] = compare_logits(logits, ref_logits)
                for q, other in kept_logits.items():
                    if q != "torch":
                        r[f"logits_vs_{q}"] = compare_logits(logits, other)
                kept_logits[p] = logits
                del logits
            r["decode"] = {}
            for b in a.batches:
                decode(model, prompts[b][:, : max(1, a.prompt // 2)], 2, dev)   # warm-up at this batch
                toks, secs, state, conv = decode(model, prompts[b], a.new, dev)
                d = r["decode"][str(b)] = {"s": secs, "ms_per_step": 1e3 * secs / a.new,
                                           "tokens_per_s": b * a.new / secs,
                                           "state_dtype": str(getattr(state, "dtype", None)),
                                           "conv_state_dtype": str(getattr(conv, "dtype", None))}
                if gbps and state is not None:
                    fl, wb, sb = decode_floor_s(model, state, conv, cfg.num_hidden_layers, gbps)
                    d.update(floor_ms_per_step=1e3 * fl, floor_tokens_per_s=b / fl, weight_bytes=wb, state_bytes=sb)
                for q, other in kept_tokens.items():
                    if q != "torch" and b in other:
                        d[f"tokens_agree_vs_{q}"] = float((toks == other[b]).float().mean())
                kept_tokens.setdefault(p, {})[b] = toks
                if p == "torch":
                    ref_tokens[b] = toks
                elif b in ref_tokens:
                    d["tokens_agree_vs_torch"] = float((toks == ref_tokens[b]).float().mean())
                del state, conv
            r["wall_s"] = time.time() - t0
            if dev.type == "cuda":
                torch.cuda.empty_cache()
        print(f"path {p}: done in {r['wall_s']:.0f} s")

    # --- report -----------------------------------------------------------------------------
    print()
    print(f"prefill, batch 1 x {a.prefill} tokens (forward with cache, last logits; median of {a.reps}):")
    for p in run_paths:
        pf = results[p]["prefill"]
        peak = (f", peak {pf['peak_above_weights_MiB']:.0f} MiB above the weights"
                if "peak_above_weights_MiB" in pf else "")
        print(f"  {p:10s} {1e3 * pf['median_s']:9.1f} ms  {pf['tokens_per_s']:9.0f} tokens/s{peak}")
    if not a.no_logits and ref_logits is not None:
        print("logits at every position against the torch path:")
        for p in run_paths:
            c = results[p].get("logits_vs_torch")
            if c:
                print(f"  {p:10s} max rel diff {c['max_rel_diff']:.2e} (max |diff| {c['max_abs_diff']:.3g} of "
                      f"max |logit| {c['max_abs_ref']:.3g}), rel L2 {c['rel_l2']:.2e}, argmax agrees at "
                      f"{100 * c['argmax_agree']:.1f}% of positions")
    for p in run_paths:
        for k, c in results[p].items():
            if k.startswith("logits_vs_") and k != "logits_vs_torch":
                print(f"  {p} against {k[len('logits_vs_'):]}: rel L2 {c['rel_l2']:.2e}, argmax agrees at "
                      f"{100 * c['argmax_agree']:.1f}% of positions")
        for b, d in results[p].get("decode", {}).items():
            for k, v in d.items():
                if k.startswith("tokens_agree_vs_") and k != "tokens_agree_vs_torch":
                    print(f"  decode batch {b}: {p}'s greedy tokens equal {k[len('tokens_agree_vs_'):]}'s at {100 * v:.1f}%")
    print(f"decode, {a.new} greedy steps after a {a.prompt}-token prompt (eager, the model's cache):")
    for b in a.batches:
        for p in run_paths:
            d = results[p]["decode"][str(b)]
            fl = f", floor {d['floor_ms_per_step']:.2f} ms" if "floor_ms_per_step" in d else ""
            agree = (f", tokens = torch's {100 * d['tokens_agree_vs_torch']:.0f}%"
                     if "tokens_agree_vs_torch" in d else "")
            print(f"  batch {b:3d} {p:10s} {d['ms_per_step']:8.2f} ms/step {d['tokens_per_s']:9.0f} tokens/s"
                  f"  (state {d['state_dtype'].replace('torch.', '')}{fl}{agree})")
    if "autossd" in run_paths:
        for other in ("torch", "mamba_ssm"):
            if other in run_paths:
                pf = results[other]["prefill"]["median_s"] / results["autossd"]["prefill"]["median_s"]
                ours, theirs = results["autossd"]["decode"], results[other]["decode"]
                dec = ", ".join(f"batch {b} {ours[str(b)]['tokens_per_s'] / theirs[str(b)]['tokens_per_s']:.2f}x"
                                for b in a.batches)
                print(f"autossd against {other}: prefill {pf:.2f}x, decode {dec}")
    print(f"total {time.time() - t_start:.0f} s")

    if a.json:
        import triton
        meta = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "command": " ".join(sys.argv),
                "torch": torch.__version__, "triton": triton.__version__, "transformers": transformers.__version__,
                "device": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu (Triton interpreter)"}
        cfg_keys = ("vocab_size", "hidden_size", "num_hidden_layers", "num_heads", "head_dim", "expand", "n_groups",
                    "state_size", "conv_kernel", "chunk_size", "intermediate_size", "time_step_rank",
                    "tie_word_embeddings", "residual_in_fp32")
        out = {"meta": meta, "args": vars(a), "model": Model.__name__,
               "config": {k: getattr(cfg, k) for k in cfg_keys if hasattr(cfg, k)},
               "parameters": nparams, "dtype": a.dtype, "copy_GBps": gbps,
               "resolved_at_import": paths.names, "paths": results, "total_s": time.time() - t_start}
        os.makedirs(os.path.dirname(os.path.abspath(a.json)), exist_ok=True)
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
