"""Hugging Face transformers: run autossd's SSD kernels inside transformers' Mamba-2 mixers.

    import autossd.integrations.transformers as hf
    hf.enable()      # every Mamba-2 mixer (and the hybrids that copy it) now runs autossd
    model.generate(...)
    hf.disable()     # transformers' own functions again

How transformers calls the SSD (5.x): each modeling module that holds a Mamba-2 mixer defines
module-level functions, `mamba2_chunk_scan` (prefill: the chunked scan),
`mamba2_selective_state_update` (decode: one token) and `mamba2_split_conv1d_scan_combined` (the
whole layer from the input projection's output: conv1d, SSD, gated norm, output projection; taken
while training without a cache), each wrapped by a decorator that, when the module is imported,
picks mamba_ssm's function of that name if mamba_ssm imports, else its own PyTorch code (for the
whole layer: a function returning None, on which the mixer runs its step-by-step path). The mixer
calls them by their module-global names. So the hook here replaces those globals, in each module,
by adapters that call `autossd.mamba_chunk_scan_combined`, `autossd.selective_state_update` and
`autossd.mamba_split_conv1d_scan_combined`; `disable()` puts back what was there (transformers'
PyTorch code or mamba_ssm's kernels). No mamba_ssm or causal_conv1d is needed: in training the
conv1d and the gated norm run in autossd's Triton kernels; at inference they stay transformers'
own.

Modules patched: mamba2 (Mamba2), bamba (Bamba), granitemoehybrid (GraniteMoeHybrid), nemotron_h
(NemotronH), zamba2 (Zamba2) and falcon_h1 (FalconH1): each holds its own copy of the two
functions with the same signature and call sites (FalconH1 also passes its gate z to the decode
step, which autossd takes).

A call whose tensors autossd cannot run (on the CPU without Triton's interpreter) goes to the
function that was there before, so enabling never breaks a CPU model.
"""
from __future__ import annotations

import importlib
import logging
import threading

log = logging.getLogger("autossd")

MODULES = ("mamba2", "bamba", "granitemoehybrid", "nemotron_h", "zamba2", "falcon_h1")
CHUNK_NAME = "mamba2_chunk_scan"
STEP_NAME = "mamba2_selective_state_update"
FUSED_NAME = "mamba2_split_conv1d_scan_combined"
# module path -> {global name: the function that was there}
_saved: dict[str, dict] = {}
_lock = threading.Lock()


def _runs_here(t) -> bool:
    """Whether autossd's kernels can run on tensor `t`'s device."""
    if t.is_cuda:
        return True
    if t.device.type == "cpu":
        from ..render import interpreting
        return interpreting()
    return False


def _make_chunk_scan(orig):
    # the parameter order of transformers' own function, so that a positional call means the same
    def mamba2_chunk_scan(hidden_states, dt, A, B, C, chunk_size, D=None, dt_bias=None, initial_states=None,
                          dt_softplus=False, dt_limit=(0.0, float("inf")), return_final_states=False, z=None,
                          seq_idx=None, cu_seqlens=None, **kwargs):
        if not _runs_here(hidden_states):
            extra = {k: v for k, v in (("z", z), ("seq_idx", seq_idx), ("cu_seqlens", cu_seqlens)) if v is not None}
            return orig(hidden_states, dt, A, B, C, chunk_size, D=D, dt_bias=dt_bias, initial_states=initial_states,
                        dt_softplus=dt_softplus, dt_limit=dt_limit, return_final_states=return_final_states,
                        **extra, **kwargs)
        from ..runtime import mamba_chunk_scan_combined
        return mamba_chunk_scan_combined(hidden_states, dt, A, B, C, chunk_size, D=D, z=z,
                                         dt_bias=dt_bias, initial_states=initial_states, seq_idx=seq_idx,
                                         cu_seqlens=cu_seqlens, dt_softplus=dt_softplus,
                                         dt_limit=tuple(dt_limit), return_final_states=return_final_states)
    mamba2_chunk_scan.autossd_replaces = orig
    return mamba2_chunk_scan


def _make_state_update(orig):
    def mamba2_selective_state_update(state, hidden_states, dt, A, B, C, D=None, dt_bias=None, dt_softplus=False,
                                      z=None, state_batch_indices=None, **kwargs):
        if not _runs_here(state):
            extra = {"state_batch_indices": state_batch_indices} if state_batch_indices is not None else {}
            return orig(state, hidden_states, dt, A, B, C, D, dt_bias=dt_bias, dt_softplus=dt_softplus, z=z,
                        **extra, **kwargs)
        from ..ops.ssd.decode import PAD_SLOT_ID, selective_state_update
        return selective_state_update(state, hidden_states, dt, A, B, C, D=D, z=z, dt_bias=dt_bias,
                                      dt_softplus=dt_softplus, state_batch_indices=state_batch_indices,
                                      pad_slot_id=kwargs.get("pad_slot_id", PAD_SLOT_ID))
    mamba2_selective_state_update.autossd_replaces = orig
    return mamba2_selective_state_update


def _make_fused(orig):
    # the whole layer, as transformers' training path calls it (keywords after chunk_size)
    def mamba2_split_conv1d_scan_combined(zxbcdt, conv1d_weight, conv1d_bias, dt_bias, A, D, chunk_size,
                                          initial_states=None, dt_limit=(0.0, float("inf")),
                                          return_final_states=False, activation="silu", rmsnorm_weight=None,
                                          rmsnorm_eps=1e-6, outproj_weight=None, outproj_bias=None, headdim=None,
                                          ngroups=1, norm_before_gate=True, seq_idx=None, **kwargs):
        unknown = {k: v for k, v in kwargs.items() if v is not None}
        if unknown or not _runs_here(zxbcdt):   # e.g. cu_seqlens: a form this adapter does not take
            kw = {"seq_idx": seq_idx} if seq_idx is not None else {}
            return orig(zxbcdt, conv1d_weight, conv1d_bias, dt_bias, A, D, chunk_size, initial_states=initial_states,
                        dt_limit=dt_limit, return_final_states=return_final_states, activation=activation,
                        rmsnorm_weight=rmsnorm_weight, rmsnorm_eps=rmsnorm_eps, outproj_weight=outproj_weight,
                        outproj_bias=outproj_bias, headdim=headdim, ngroups=ngroups,
                        norm_before_gate=norm_before_gate, **kw, **kwargs)
        from ..ops.ssd.split_conv1d import mamba_split_conv1d_scan_combined
        return mamba_split_conv1d_scan_combined(zxbcdt, conv1d_weight, conv1d_bias, dt_bias, A, D,
                                                chunk_size, initial_states=initial_states, seq_idx=seq_idx,
                                                dt_limit=tuple(dt_limit), return_final_states=return_final_states,
                                                activation=activation, rmsnorm_weight=rmsnorm_weight,
                                                rmsnorm_eps=rmsnorm_eps, outproj_weight=outproj_weight,
                                                outproj_bias=outproj_bias, headdim=headdim, ngroups=ngroups,
                                                norm_before_gate=norm_before_gate)
    mamba2_split_conv1d_scan_combined.autossd_replaces = orig
    return mamba2_split_conv1d_scan_combined


_MAKERS = {CHUNK_NAME: _make_chunk_scan, STEP_NAME: _make_state_update, FUSED_NAME: _make_fused}


def enable(models: tuple[str, ...] | None = None) -> list[str]:
    """Route the SSD of transformers' Mamba-2 mixers through autossd: in each modeling module of
    `models` (names from MODULES; default all) that imports, the chunked scan, the decode step and
    (where the module has it) the whole-layer training path.
    Returns the modules patched. Idempotent; models built before or after the call are covered
    (the mixers look the functions up at each call)."""
    names = MODULES if models is None else tuple(models)
    unknown = sorted(set(names) - set(MODULES))
    if unknown:
        raise ValueError(f"models: unknown {unknown}; expected names from {MODULES}")
    done = []
    with _lock:
        for name in names:
            path = f"transformers.models.{name}.modeling_{name}"
            try:
                mod = importlib.import_module(path)
            except ImportError as e:   # an older transformers without this model
                log.info("autossd: %s not patched (%s)", path, e)
                continue
            chunk, step = getattr(mod, CHUNK_NAME, None), getattr(mod, STEP_NAME, None)
            if chunk is None or step is None:
                log.warning("autossd: %s has no %s / %s (another transformers layout); not patched",
                            path, CHUNK_NAME, STEP_NAME)
                continue
            if path not in _saved:
                _saved[path] = {n: getattr(mod, n) for n in _MAKERS if getattr(mod, n, None) is not None}
                for n, f in _saved[path].items():
                    setattr(mod, n, _MAKERS[n](f))
            done.append(name)
    if not done:
        raise ImportError("autossd: no transformers Mamba-2 module could be patched (is transformers>=5 installed?)")
    return done


def disable() -> None:
    """Put back the functions `enable` replaced."""
    import sys
    with _lock:
        for path, funcs in _saved.items():
            mod = sys.modules.get(path)
            if mod is not None:
                for n, f in funcs.items():
                    setattr(mod, n, f)
        _saved.clear()


def is_enabled(model: str = "mamba2") -> bool:
    return f"transformers.models.{model}.modeling_{model}" in _saved
