"""Hugging Face transformers: run autossd's kernels inside transformers' Mamba-2 mixers (and the
hybrids that copy them) and its Mamba-1 mixers (Mamba, FalconMamba).

    import autossd.integrations.transformers as hf
    hf.enable()      # every Mamba-2 and Mamba-1 mixer now runs autossd
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

The Mamba-1 modules (mamba, falcon_mamba) hold five such functions, resolved the same way from
mamba_ssm, causal_conv1d or the `kernels` hub package when one is there: `causal_conv1d_fn`
(prefill conv, (batch, dim, seqlen)), `causal_conv1d_update` (decode conv, the cache's conv state
updated in place), `mamba_selective_scan` (prefill scan, returning the last state for the cache),
`mamba_selective_state_update` (decode step) and `mamba_inner_fn` (the whole mixer after its input
projection, taken while training without a cache; transformers' own returns None, on which the
mixer runs the four functions above one by one). The adapters call autossd's Triton conv1d and
its update, `autossd.selective_scan_fn`, `autossd.selective_state_update` and
`autossd.mamba_inner_fn`. FalconMamba's training call is the one exception: it asks mamba_inner_fn
to RMS-normalize delta after the dt projection (mamba_ssm's placement), while FalconMamba's own
forward, the one its inference runs, normalizes the dt projection's input; the adapter answers
None there, so the mixer trains through the per-step functions, all autossd's, and computes what
the model defines.

Modules patched: mamba2 (Mamba2), bamba (Bamba), granitemoehybrid (GraniteMoeHybrid), nemotron_h
(NemotronH), zamba2 (Zamba2) and falcon_h1 (FalconH1): each holds its own copy of the two
functions with the same signature and call sites (FalconH1 also passes its gate z to the decode
step, which autossd takes); mamba (Mamba) and falcon_mamba (FalconMamba).

A call whose tensors autossd cannot run (on the CPU without Triton's interpreter), or in a form
an adapter does not take (packed sequences through seq_idx or cu_seqlens, a conv's initial or
final states), goes to the function that was there before, so enabling never breaks a model. A
configuration autossd's kernels do not cover (a conv width outside 2 to 4, an activation other
than SiLU or none) goes there too, with a one-line warning the first time.
"""
from __future__ import annotations

import importlib
import logging
import threading

log = logging.getLogger("autossd")

MAMBA2_MODULES = ("mamba2", "bamba", "granitemoehybrid", "nemotron_h", "zamba2", "falcon_h1")
MAMBA1_MODULES = ("mamba", "falcon_mamba")
MODULES = MAMBA2_MODULES + MAMBA1_MODULES
CHUNK_NAME = "mamba2_chunk_scan"
STEP_NAME = "mamba2_selective_state_update"
FUSED_NAME = "mamba2_split_conv1d_scan_combined"
# the Mamba-1 modules' functions
CONV_NAME = "causal_conv1d_fn"
CONV_STEP_NAME = "causal_conv1d_update"
SCAN_NAME = "mamba_selective_scan"
SCAN_STEP_NAME = "mamba_selective_state_update"
INNER_NAME = "mamba_inner_fn"
# module path -> {global name: the function that was there}
_saved: dict[str, dict] = {}
_lock = threading.Lock()
_warned: set = set()


def _decline(what: str, why: str) -> None:
    """One warning line per function and reason, the first time a call goes back to transformers."""
    if (what, why) not in _warned:
        _warned.add((what, why))
        log.warning("autossd: %s runs transformers' function instead: %s", what, why)


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


def _conv_unsupported(weight, activation) -> str | None:
    from ..ops.conv1d.causal_conv1d import ACTIVATIONS, WIDTHS
    if weight.shape[-1] not in WIDTHS:
        return f"conv width {weight.shape[-1]} (autossd's conv1d takes {WIDTHS})"
    if activation not in ACTIVATIONS:
        return f"activation {activation!r} (autossd's conv1d takes {ACTIVATIONS})"
    return None


def _make_conv(orig):
    # causal_conv1d's parameter order (transformers passes the first four, and the mixer's kwargs)
    def causal_conv1d_fn(hidden_states, weight, bias=None, activation=None, seq_idx=None, initial_states=None,
                         return_final_states=False, final_states_out=None, **kwargs):
        extra = {k: v for k, v in (("seq_idx", seq_idx), ("initial_states", initial_states),
                                   ("final_states_out", final_states_out)) if v is not None}
        if return_final_states:
            extra["return_final_states"] = True
        why = _conv_unsupported(weight, activation)
        if extra or kwargs.get("cu_seqlens") is not None or not _runs_here(hidden_states) or why:
            if why and _runs_here(hidden_states):
                _decline("causal_conv1d_fn", why)
            return orig(hidden_states, weight, bias, activation=activation, **extra, **kwargs)
        from ..ops.conv1d.causal_conv1d import causal_conv1d
        # Mamba's (batch, dim, seqlen) is the kernel's (batch, seqlen, channels) transposed: any strides
        return causal_conv1d(hidden_states.transpose(1, 2), weight, bias, activation=activation).transpose(1, 2)
    causal_conv1d_fn.autossd_replaces = orig
    return causal_conv1d_fn


def _make_conv_step(orig):
    def causal_conv1d_update(hidden_states, conv_state, weight, bias=None, activation=None, cache_seqlens=None,
                             conv_state_indices=None, **kwargs):
        extra = {k: v for k, v in (("cache_seqlens", cache_seqlens), ("conv_state_indices", conv_state_indices))
                 if v is not None}
        why = _conv_unsupported(weight, activation)
        if extra or not _runs_here(hidden_states) or why:
            if why and _runs_here(hidden_states):
                _decline("causal_conv1d_update", why)
            return orig(hidden_states, conv_state, weight, bias, activation=activation, **extra, **kwargs)
        from ..ops.conv1d.causal_conv1d import causal_conv1d_update as update
        return update(hidden_states, conv_state, weight, bias, activation=activation)
    causal_conv1d_update.autossd_replaces = orig
    return causal_conv1d_update


def _make_scan(orig):
    # transformers' own parameter order (mamba_ssm's selective_scan_fn, then its two PyTorch choices)
    def mamba_selective_scan(hidden_states, dt, A, B, C, D=None, z=None, delta_bias=None, delta_softplus=False,
                             return_last_state=False, use_mambapy=False, use_associative_scan=False, **kwargs):
        unknown = {k: v for k, v in kwargs.items() if v is not None}
        if unknown or not _runs_here(hidden_states):
            return orig(hidden_states, dt, A, B, C, D=D, z=z, delta_bias=delta_bias, delta_softplus=delta_softplus,
                        return_last_state=return_last_state, use_mambapy=use_mambapy,
                        use_associative_scan=use_associative_scan, **kwargs)
        from .. import selective_scan_fn
        return selective_scan_fn(hidden_states, dt, A, B, C, D=D, z=z, delta_bias=delta_bias,
                                 delta_softplus=delta_softplus, return_last_state=return_last_state)
    mamba_selective_scan.autossd_replaces = orig
    return mamba_selective_scan


def _make_inner(orig):
    # transformers' own parameter order: mamba_ssm's, less B_proj_bias, C_proj_bias and checkpoint_lvl
    def mamba_inner_fn(xz, conv1d_weight, conv1d_bias, x_proj_weight, delta_proj_weight, out_proj_weight,
                       out_proj_bias, A, B=None, C=None, D=None, delta_bias=None, delta_softplus=True,
                       b_rms_weight=None, c_rms_weight=None, dt_rms_weight=None, b_c_dt_rms_eps=1e-6, **kwargs):
        if dt_rms_weight is not None and _runs_here(xz):
            # FalconMamba: its own forward normalizes dt before the dt projection, mamba_inner_fn
            # after it; None makes the mixer run its per-step functions (autossd's), as it defines
            return None
        unknown = {k: v for k, v in kwargs.items() if v is not None}
        why = _conv_unsupported(conv1d_weight, "silu")
        if unknown or not _runs_here(xz) or why:
            if why and _runs_here(xz):
                _decline("mamba_inner_fn", why)
            return orig(xz, conv1d_weight, conv1d_bias, x_proj_weight, delta_proj_weight, out_proj_weight,
                        out_proj_bias, A, B, C, D, delta_bias=delta_bias, delta_softplus=delta_softplus,
                        b_rms_weight=b_rms_weight, c_rms_weight=c_rms_weight, dt_rms_weight=dt_rms_weight,
                        b_c_dt_rms_eps=b_c_dt_rms_eps, **kwargs)
        from ..ops.mamba1.inner import mamba_inner_fn as inner
        return inner(xz, conv1d_weight, conv1d_bias, x_proj_weight, delta_proj_weight, out_proj_weight,
                     out_proj_bias, A, B, C, D, delta_bias=delta_bias, delta_softplus=delta_softplus,
                     b_rms_weight=b_rms_weight, c_rms_weight=c_rms_weight, b_c_dt_rms_eps=b_c_dt_rms_eps)
    mamba_inner_fn.autossd_replaces = orig
    return mamba_inner_fn


def _make_scan_step(orig):
    # the Mamba-1 decode step has the Mamba-2 one's parameters, and autossd's op takes both forms
    step = _make_state_update(orig)
    step.__name__ = step.__qualname__ = SCAN_STEP_NAME
    return step


_MAKERS = {CHUNK_NAME: _make_chunk_scan, STEP_NAME: _make_state_update, FUSED_NAME: _make_fused}
_MAMBA1_MAKERS = {CONV_NAME: _make_conv, CONV_STEP_NAME: _make_conv_step, SCAN_NAME: _make_scan,
                  SCAN_STEP_NAME: _make_scan_step, INNER_NAME: _make_inner}


def enable(models: tuple[str, ...] | None = None) -> list[str]:
    """Route transformers' Mamba-2 and Mamba-1 mixers through autossd: in each modeling module of
    `models` (names from MODULES; default all) that imports, for Mamba-2 the chunked scan, the
    decode step and (where the module has it) the whole-layer training path; for Mamba-1 the
    prefill and decode conv1d, the selective scan, the decode step and the training path.
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
            if name in MAMBA1_MODULES:
                makers, needed = _MAMBA1_MAKERS, tuple(_MAMBA1_MAKERS)
            else:
                makers, needed = _MAKERS, (CHUNK_NAME, STEP_NAME)
            missing = [n for n in needed if getattr(mod, n, None) is None]
            if missing:
                log.warning("autossd: %s has no %s (another transformers layout); not patched",
                            path, " / ".join(missing))
                continue
            if path not in _saved:
                _saved[path] = {n: getattr(mod, n) for n in makers if getattr(mod, n, None) is not None}
                for n, f in _saved[path].items():
                    setattr(mod, n, makers[n](f))
            done.append(name)
    if not done:
        raise ImportError("autossd: no transformers Mamba module could be patched (is transformers>=5 installed?)")
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
