"""Train a small Mamba-2 language model with autossd's SSD and with mamba_ssm's, in one run.

    python scripts/train_compare.py --json OUT.json                  # defaults below, both libraries, 2 seeds
    python scripts/train_compare.py --ssd autossd --steps 100 --json OUT.json
    python scripts/train_compare.py --smoke --json OUT.json          # tiny sizes on the CPU (Triton's interpreter)

The model is written here in plain PyTorch: token embedding, L blocks of [RMSNorm, in_proj to
(z, x, B, C, dt), depthwise causal conv1d (F.conv1d) + SiLU over (x, B, C), the SSD, gated RMSNorm
norm(y * silu(z)), out_proj] with a residual around each, a final RMSNorm and the LM head (tied to
the embedding unless --untied). Only the SSD call differs between the runs: `--ssd autossd` calls
autossd.mamba_chunk_scan_combined, `--ssd mamba_ssm` mamba_ssm's (its Triton path), `--ssd both`
(default) runs both. Initialisation follows Mamba-2's (A in [1, 16], dt in [1e-3, 0.1], D = 1,
out_proj scaled by 1/sqrt(layers)).

Data: synthetic, made here from fixed seeds, nothing downloaded. A first-order Markov chain over
--vocab tokens in which each token has --fanout possible successors (random, fixed by the task
seed), sampled for --period tokens and then repeated until the sequence is full. The loss falls
from ln(vocab) as the model learns the transitions, and further as it learns to recall the
previous period (which needs the SSD's state: the convolution sees 4 tokens). The floor of the
loss (the true conditional entropy, 0 on the repeated part) is reported.

Precision: --precision autocast (default) keeps the parameters and AdamW's state in fp32 and runs
the forward under torch.autocast(bfloat16): the SSD gets x, B, C, dt in bf16, A, D, dt_bias in
fp32, as in mixed-precision training of Mamba-2. --precision bf16 makes every parameter bf16
(no fp32 master weights).

Seeds: each library trains once per seed (--seeds, default 2); seed s fixes the initial weights
and the data order (the batches drawn from the chain), the same for both libraries. Run-to-run
noise is what changing the seed does to one library's loss curve; the two libraries agree within
it when, at the same seed, their smoothed losses over the last 50 steps differ by no more than
that. Steps are CUDA-synchronized and timed; the median leaves out the first --warmup-steps
(Triton compiles, mamba_ssm's autotuning). Peak memory is torch.cuda.max_memory_allocated over a
whole run (weights, gradients, AdamW state and activations; only the activations differ).

The JSON (--json) holds the arguments, the run's metadata, the task's loss floor, and per run:
library, seed, per-step loss and step time, median step time, tokens/s, peak and end memory;
then the agreement figures.
"""
from __future__ import annotations

import argparse
import gc
import json
import math
import os
import statistics
import sys
import time

SMOOTH = 10       # trailing mean over this many steps before curves are compared
TAIL = 50         # the steps compared at the end of training


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ssd", choices=["autossd", "mamba_ssm", "both"], default="both")
    ap.add_argument("--seeds", type=int, default=2, help="runs per library, seeds 0..N-1")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--warmup-steps", type=int, default=10, help="left out of the median step time")
    ap.add_argument("--d-model", type=int, default=768)
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--expand", type=int, default=2)
    ap.add_argument("--headdim", type=int, default=64)
    ap.add_argument("--d-state", type=int, default=128)
    ap.add_argument("--ngroups", type=int, default=1)
    ap.add_argument("--chunk", type=int, default=256)
    ap.add_argument("--seqlen", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=1024)
    ap.add_argument("--fanout", type=int, default=8, help="successors per token in the Markov chain")
    ap.add_argument("--period", type=int, default=256, help="chain tokens before the sequence repeats (0: no repeat)")
    ap.add_argument("--untied", action="store_true", help="an LM head of its own (default: tied to the embedding)")
    ap.add_argument("--precision", choices=["autocast", "bf16"], default="autocast")
    ap.add_argument("--strided", action="store_true",
                    help="pass x, B, C to the SSD as the conv's transposed views (last dimension strided), "
                         "not as a contiguous copy")
    ap.add_argument("--lr", type=float, default=1.5e-3)
    ap.add_argument("--lr-warmup", type=int, default=20)
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--device", default=None, help="default: cuda; with --smoke: cpu")
    ap.add_argument("--smoke", action="store_true",
                    help="tiny sizes (overriding the size flags), to check the script runs; on the CPU it "
                         "runs Triton's interpreter and stands a float64 PyTorch reference in for mamba_ssm")
    ap.add_argument("--json", default=None, help="where to write the raw results")
    a = ap.parse_args(argv)
    if a.smoke:
        a.device = a.device or "cpu"
        a.seeds = min(a.seeds, 2)
        a.steps, a.warmup_steps = 4, 1
        a.d_model, a.layers, a.headdim, a.d_state, a.chunk = 64, 2, 32, 16, 64
        a.seqlen, a.batch, a.vocab, a.fanout, a.period, a.lr_warmup = 128, 2, 64, 4, 32, 2
    a.device = a.device or "cuda"
    return a


# --- data -------------------------------------------------------------------------------------
TASK_SEED = 1234


def make_task(vocab: int, fanout: int):
    """(successors (vocab, fanout), probabilities (vocab, fanout)) of the Markov chain."""
    import torch
    g = torch.Generator().manual_seed(TASK_SEED)
    succ = torch.randint(0, vocab, (vocab, fanout), generator=g)
    probs = torch.softmax(2.0 * torch.randn(vocab, fanout, generator=g, dtype=torch.float64), -1)
    return succ, probs


def make_data(task, steps: int, batch: int, seqlen: int, period: int, seed: int):
    """Token ids (steps, batch, seqlen + 1) on the CPU, and the loss floor of the targets (mean
    over target positions of -log p(true next token | history))."""
    import torch
    succ, probs = task
    vocab, fanout = succ.shape
    rows = steps * batch
    span = min(period, seqlen + 1) if period else seqlen + 1
    g = torch.Generator().manual_seed(10_000 + seed)
    chain = torch.empty(rows, span, dtype=torch.long)
    chain[:, 0] = torch.randint(0, vocab, (rows,), generator=g)
    cdf = probs.cumsum(-1)
    nll = torch.zeros(rows, dtype=torch.float64)
    u = torch.rand(span, rows, 1, generator=g, dtype=torch.float64)
    for t in range(1, span):
        prev = chain[:, t - 1]
        pick = torch.searchsorted(cdf[prev], u[t]).clamp_(max=fanout - 1).squeeze(1)
        chain[:, t] = succ[prev, pick]
        nll -= probs[prev, pick].log()
    reps = -(-(seqlen + 1) // span)
    seqs = chain.repeat(1, reps)[:, :seqlen + 1]
    # the repeated part is determined by the history (probability 1): only the chain's draws count
    floor = float(nll.mean()) / seqlen
    return seqs.view(steps, batch, seqlen + 1), floor


# --- model ------------------------------------------------------------------------------------
def build_model(a, ssd_fn):
    import torch
    import torch.nn.functional as F
    from torch import nn

    class RMSNorm(nn.Module):
        def __init__(self, d, eps=1e-5):
            super().__init__()
            self.eps = eps
            self.weight = nn.Parameter(torch.ones(d))

        def forward(self, x):
            xf = x.float()
            return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight.float()).to(x.dtype)

    class GatedRMSNorm(nn.Module):
        """norm(y * silu(z)) per group of channels, in fp32 (Mamba-2's gate before the norm)."""

        def __init__(self, d, ngroups, eps=1e-5):
            super().__init__()
            self.eps, self.ngroups = eps, ngroups
            self.weight = nn.Parameter(torch.ones(d))

        def forward(self, y, z):
            dtype = y.dtype
            y = y.float() * F.silu(z.float())
            yg = y.view(*y.shape[:-1], self.ngroups, -1)
            yg = yg * torch.rsqrt(yg.pow(2).mean(-1, keepdim=True) + self.eps)
            return (yg.view_as(y) * self.weight.float()).to(dtype)

    class Mixer(nn.Module):
        def __init__(self):
            super().__init__()
            self.d_inner = a.expand * a.d_model
            self.nheads = self.d_inner // a.headdim
            self.gn = a.ngroups * a.d_state
            self.conv_dim = self.d_inner + 2 * self.gn
            self.in_proj = nn.Linear(a.d_model, 2 * self.d_inner + 2 * self.gn + self.nheads, bias=False)
            self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, 4, groups=self.conv_dim, padding=3, bias=True)
            dt = torch.exp(torch.rand(self.nheads) * (math.log(0.1) - math.log(1e-3)) + math.log(1e-3)).clamp(min=1e-4)
            self.dt_bias = nn.Parameter(dt + torch.log(-torch.expm1(-dt)))   # softplus(dt_bias) = dt
            self.A_log = nn.Parameter(torch.log(torch.empty(self.nheads).uniform_(1, 16)))
            self.D = nn.Parameter(torch.ones(self.nheads))
            self.norm = GatedRMSNorm(self.d_inner, a.ngroups)
            self.out_proj = nn.Linear(self.d_inner, a.d_model, bias=False)
            with torch.no_grad():   # the residual branch's output scaled down with depth, as Mamba-2 does
                self.out_proj.weight /= math.sqrt(a.layers)

        def forward(self, u):
            b, l, _ = u.shape
            z, xbc, dt = self.in_proj(u).split([self.d_inner, self.conv_dim, self.nheads], dim=-1)
            xbc = F.silu(self.conv1d(xbc.transpose(1, 2))[..., :l].transpose(1, 2))
            if not a.strided:
                # the conv's output is a transposed view (its last dimension strided); both
                # libraries copy such an x, B, C before their kernels, so copying here costs
                # them the same, and autossd's differentiable path takes only unit strides
                xbc = xbc.contiguous()
            x, B, C = xbc.split([self.d_inner, self.gn, self.gn], dim=-1)
            A = -torch.exp(self.A_log.float())
            y = ssd_fn(x.reshape(b, l, self.nheads, a.headdim), dt, A, B.reshape(b, l, a.ngroups, a.d_state),
                       C.reshape(b, l, a.ngroups, a.d_state), a.chunk, D=self.D, dt_bias=self.dt_bias,
                       dt_softplus=True)
            return self.out_proj(self.norm(y.reshape(b, l, self.d_inner), z))

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.norm = RMSNorm(a.d_model)
            self.mixer = Mixer()

        def forward(self, x):
            return x + self.mixer(self.norm(x))

    class LM(nn.Module):
        def __init__(self):
            super().__init__()
            self.embedding = nn.Embedding(a.vocab, a.d_model)
            nn.init.normal_(self.embedding.weight, std=0.02)
            self.blocks = nn.ModuleList(Block() for _ in range(a.layers))
            self.norm_f = RMSNorm(a.d_model)
            self.head = nn.Linear(a.d_model, a.vocab, bias=False)
            if not a.untied:
                self.head.weight = self.embedding.weight

        def forward(self, ids):
            x = self.embedding(ids)
            for blk in self.blocks:
                x = blk(x)
            return self.head(self.norm_f(x))

    return LM()


def param_groups(model, weight_decay):
    decay, no_decay = [], []
    for p in model.parameters():
        # matrices decay; vectors (norms, biases, A_log, D, dt_bias) do not
        (no_decay if p.ndim < 2 else decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def lr_at(step, a):
    if step < a.lr_warmup:
        return a.lr * (step + 1) / a.lr_warmup
    frac = (step - a.lr_warmup) / max(1, a.steps - a.lr_warmup)
    return a.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))


def train(a, ssd_fn, seed: int, data):
    import torch
    import torch.nn.functional as F
    dev = torch.device(a.device)
    cuda = dev.type == "cuda"
    gc.collect()   # the previous run's model and optimizer, so that its memory is not counted here
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    torch.manual_seed(seed)
    model = build_model(a, ssd_fn).to(dev)
    if a.precision == "bf16":
        model = model.to(torch.bfloat16)
    opt = torch.optim.AdamW(param_groups(model, a.weight_decay), lr=a.lr, betas=(0.9, 0.95), eps=1e-8,
                            fused=cuda)
    autocast = torch.autocast(dev.type, dtype=torch.bfloat16, enabled=a.precision == "autocast")
    data = data.to(dev)
    losses, times = [], []
    for step in range(a.steps):
        for grp in opt.param_groups:
            grp["lr"] = lr_at(step, a)
        batch = data[step]
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        with autocast:
            logits = model(batch[:, :-1])
        loss = F.cross_entropy(logits.float().reshape(-1, a.vocab), batch[:, 1:].reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        losses.append(loss.item())
        if not math.isfinite(losses[-1]):
            print(f"  step {step}: loss {losses[-1]}; stopping this run")
            break
    timed = times[a.warmup_steps:] or times
    med = statistics.median(timed)
    res = {"losses": losses, "step_s": times, "median_step_s": med,
           "tokens_per_s": a.batch * a.seqlen / med,
           "params": sum(p.numel() for p in model.parameters())}
    if cuda:
        res["peak_MiB"] = torch.cuda.max_memory_allocated() / 2**20
        res["end_MiB"] = torch.cuda.memory_allocated() / 2**20   # weights, gradients (freed), AdamW state
    del model, opt
    return res


def smooth(xs, w=SMOOTH):
    out, acc = [], 0.0
    for i, v in enumerate(xs):
        acc += v
        if i >= w:
            acc -= xs[i - w]
        out.append(acc / min(i + 1, w))
    return out


def max_tail_diff(a_losses, b_losses, tail):
    n = min(len(a_losses), len(b_losses))
    sa, sb = smooth(a_losses[:n]), smooth(b_losses[:n])
    return max(abs(x - y) for x, y in zip(sa[n - tail:], sb[n - tail:])) if n else float("nan")


def load_ssd(name: str, device: str):
    """(callable, label) for the SSD of library `name`."""
    if name == "autossd":
        import autossd
        return autossd.mamba_chunk_scan_combined, "autossd"
    from autossd.peer import load_mamba_ssm
    if device.startswith("cuda"):
        fn = load_mamba_ssm()
        if fn is None:
            raise SystemExit("mamba_ssm is not importable here (install its wheel, or run --ssd autossd)")
        return fn, "mamba_ssm"
    # mamba_ssm's launchers select a CUDA device and autotune with GPU timers: they cannot run in
    # Triton's CPU interpreter, so a CPU smoke run exercises the same call with the float64
    # PyTorch reference in its place (differentiable through autograd)
    from autossd.ops.ssd.naive import ssd_chunked

    def reference(x, dt, A, B, C, chunk_size, D=None, dt_bias=None, dt_softplus=False, **kw):
        y = ssd_chunked(x, dt, A, B, C, chunk_size, D=D, dt_bias=dt_bias, dt_softplus=dt_softplus, **kw)[0]
        return y.to(x.dtype)
    return reference, "reference(cpu stand-in for mamba_ssm)"


def main(argv=None) -> int:
    a = parse_args(argv)
    if a.device == "cpu" and "TRITON_INTERPRET" not in os.environ:
        # before triton is first imported: its language helpers are built interpreted only then
        os.environ["TRITON_INTERPRET"] = "1"
    import torch
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
    if a.device.startswith("cuda") and not torch.cuda.is_available():
        print("no GPU here: run with --smoke (CPU, Triton's interpreter) or on a GPU")
        return 2
    t_start = time.time()
    libs = ["autossd", "mamba_ssm"] if a.ssd == "both" else [a.ssd]
    fns = {lib: load_ssd(lib, a.device) for lib in libs}
    task = make_task(a.vocab, a.fanout)
    data, floors = {}, {}
    for seed in range(a.seeds):
        data[seed], floors[seed] = make_data(task, a.steps, a.batch, a.seqlen, a.period, seed)
    print(f"model: d_model {a.d_model}, {a.layers} layers, {a.expand * a.d_model // a.headdim} heads x {a.headdim}, "
          f"d_state {a.d_state}, ngroups {a.ngroups}, chunk {a.chunk}, vocab {a.vocab}, "
          f"{'untied' if a.untied else 'tied'} head; batch {a.batch} x {a.seqlen}; {a.steps} steps; "
          f"precision {a.precision}; device {a.device}")
    print(f"task: Markov chain, fanout {a.fanout}, period {a.period}; loss at chance {math.log(a.vocab):.3f}, "
          f"floor {statistics.mean(floors.values()):.3f}")
    runs = []
    # seeds outermost: the libraries alternate, so neither gets the warmer machine throughout
    for seed in range(a.seeds):
        for lib in libs:
            fn, label = fns[lib]
            t0 = time.time()
            r = train(a, fn, seed, data[seed])
            r.update(library=lib, implementation=label, seed=seed, wall_s=time.time() - t0)
            runs.append(r)
            print(f"  {label} seed {seed}: loss {r['losses'][0]:.3f} -> {smooth(r['losses'])[-1]:.3f}, "
                  f"median step {1e3 * r['median_step_s']:.1f} ms, {r['wall_s']:.0f} s")

    tail = min(TAIL, max(1, a.steps // 2))
    by = {(r["library"], r["seed"]): r["losses"] for r in runs}
    agreement = {"tail_steps": tail, "smooth_window": SMOOTH, "between_libraries": {}, "between_seeds": {}}
    if len(libs) == 2:
        for seed in range(a.seeds):
            agreement["between_libraries"][str(seed)] = max_tail_diff(by[("autossd", seed)],
                                                                      by[("mamba_ssm", seed)], tail)
    if a.seeds >= 2:
        for lib in libs:
            agreement["between_seeds"][lib] = max_tail_diff(by[(lib, 0)], by[(lib, 1)], tail)
    if agreement["between_libraries"] and agreement["between_seeds"]:
        worst_lib = max(agreement["between_libraries"].values())
        noise = min(agreement["between_seeds"].values())
        agreement.update(max_between_libraries=worst_lib, min_between_seeds=noise,
                         within_noise=worst_lib <= noise)

    print()
    print(f"{'implementation':40s} {'seed':>4s} {'loss@0':>7s} {'loss end':>8s} {'step ms':>8s} "
          f"{'tokens/s':>10s} {'peak MiB':>9s}")
    for r in runs:
        peak = f"{r['peak_MiB']:9.0f}" if "peak_MiB" in r else f"{'-':>9s}"
        print(f"{r['implementation']:40s} {r['seed']:4d} {r['losses'][0]:7.3f} {smooth(r['losses'])[-1]:8.3f} "
              f"{1e3 * r['median_step_s']:8.1f} {r['tokens_per_s']:10.0f} {peak}")
    print(f"(loss end: mean of the last {SMOOTH} steps; step ms: median after {a.warmup_steps} warm-up steps, "
          f"whole training step; peak: weights + gradients + AdamW state + activations)")
    if agreement["between_libraries"]:
        print(f"max |autossd - {fns['mamba_ssm'][1]}| over the last {tail} steps "
              f"(trailing {SMOOTH}-step mean), same seed: "
              + ", ".join(f"seed {s} {v:.4f}" for s, v in agreement["between_libraries"].items()))
    if agreement["between_seeds"]:
        print("max |seed 0 - seed 1| over the same steps, same library (run-to-run noise): "
              + ", ".join(f"{k} {v:.4f}" for k, v in agreement["between_seeds"].items()))
    if "within_noise" in agreement:
        print(f"agree within run-to-run noise: {'yes' if agreement['within_noise'] else 'NO'} "
              f"({agreement['max_between_libraries']:.4f} against {agreement['min_between_seeds']:.4f})")
    print(f"total {time.time() - t_start:.0f} s")

    if a.json:
        import triton
        meta = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "command": " ".join(sys.argv),
                "torch": torch.__version__, "triton": triton.__version__,
                "device": torch.cuda.get_device_name() if a.device.startswith("cuda") else "cpu (Triton interpreter)"}
        out = {"meta": meta, "args": vars(a), "loss_chance": math.log(a.vocab),
               "loss_floor": {str(s): f for s, f in floors.items()}, "runs": runs, "agreement": agreement,
               "total_s": time.time() - t_start}
        os.makedirs(os.path.dirname(os.path.abspath(a.json)), exist_ok=True)
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
