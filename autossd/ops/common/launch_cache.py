"""The launch cache's use of Triton internals: recording a call's compiled launches and replaying them
on new tensors, behind one feature check that falls back to triton's ordinary launches.

A call's launches depend only on the problem, the config and the inputs' dtypes, strides and
16-byte alignment (what triton specializes on). The first call of such a key goes through triton's
JIT and is recorded here: per launch, the compiled kernel and where each argument comes from.
Later calls fill in the new tensors and launch the compiled kernels directly, skipping the plan and
triton's per-launch binding. That reaches into triton's internals (compiled kernels' launchers,
their calling convention, the TMA descriptor encoder), which change between releases: `missing()`
checks, once per process, that every internal used here is there in the shape this code was
written against (triton 3.6). Where one is not, `enabled()` is False, one warning names what is
missing, and the op launches through `kernel[grid](...)` on every call: slower, still correct.
AUTOSSD_LAUNCH_CACHE=0 (or the older AUTOSSD_FAST_LAUNCH=0) forces that plain path.
Nothing else in autossd touches these internals for launching.
"""
from __future__ import annotations

import functools
import inspect
import logging
import operator
import os
import sys
import threading

import torch

try:   # each guarded: an upgrade that drops one must not break importing autossd
    from triton.runtime.driver import driver as _driver
except ImportError:
    _driver = None
try:
    from triton import knobs as _knobs
except ImportError:
    _knobs = None

try:   # torch's compiled tensor-metadata check (torch.compile's guards), for RecentCalls
    from torch._C._dynamo.guards import TensorGuards as _TensorGuard
except ImportError:
    _TensorGuard = None

_SWITCHES = ("AUTOSSD_LAUNCH_CACHE", "AUTOSSD_FAST_LAUNCH")   # "0" turns the launch cache off


# --- the feature check ------------------------------------------------------------------------
def _assigned_in(cls, method: str, names) -> list[str]:
    """The attributes of `names` that `cls.method` never stores: instance attributes exist only
    after a compile (or on a GPU), so their presence is read from the code that sets them."""
    code = getattr(getattr(cls, method, None), "__code__", None)
    have = set(code.co_names) if code is not None else set()
    return [f"{cls.__module__}.{cls.__name__}.{n} (set in {method})" for n in names if n not in have]


def _params(fn) -> list[str] | None:
    try:
        return [p.name if p.kind is not p.VAR_POSITIONAL else "*" + p.name
                for p in inspect.signature(fn).parameters.values()]
    except (TypeError, ValueError):
        return None


def _check() -> list[str]:
    gone = []
    # the current stream, looked up once per call (GPUDriver sets both in its __init__)
    if _driver is None or not isinstance(getattr(type(_driver), "active", None), property):
        gone.append("triton.runtime.driver.driver.active")
    try:
        from triton.backends.driver import GPUDriver
        gone += _assigned_in(GPUDriver, "__init__", ("get_current_stream", "get_current_device"))
    except ImportError:
        gone.append("triton.backends.driver.GPUDriver")
    # the profiler hooks: with one set, a replay goes through triton's runner, which calls them
    rt = getattr(_knobs, "runtime", None)
    for name in ("launch_enter_hook", "launch_exit_hook"):
        if not hasattr(rt, name):
            gone.append(f"triton.knobs.runtime.{name}")
    # a kernel's parameter order (record) and its compile without a launch (warm_up)
    try:
        from triton.runtime.jit import JITFunction
        gone += _assigned_in(JITFunction, "__init__", ("arg_names",))
        if "grid" not in (_params(getattr(JITFunction, "warmup", None)) or ()):
            gone.append("triton.runtime.jit.JITFunction.warmup(*args, grid, **kwargs)")
    except ImportError:
        gone.append("triton.runtime.jit.JITFunction")
    # the compiled kernel: its loaded handles, its launcher and what a replay passes that launcher
    try:
        from triton.compiler.compiler import CompiledKernel
        if not callable(getattr(CompiledKernel, "_init_handles", None)):
            gone.append("triton.compiler.compiler.CompiledKernel._init_handles()")
        if not isinstance(CompiledKernel.__dict__.get("run"), property):
            gone.append("triton.compiler.compiler.CompiledKernel.run (the launcher)")
        gone += _assigned_in(CompiledKernel, "__init__", ("function", "packed_metadata"))
    except ImportError:
        gone.append("triton.compiler.compiler.CompiledKernel")
    # the CUDA launcher, called as run(gx, gy, gz, stream, function, packed_metadata,
    # launch_metadata, enter_hook, exit_hook, *args); DirectLaunch calls its compiled entry point
    # with the 13 leading arguments it parses, and encodes descriptors with its encoder
    launcher = ["self", "gridX", "gridY", "gridZ", "stream", "function", "*args"]
    try:
        from triton.backends.nvidia import driver as nv
        cls = getattr(nv, "CudaLauncher", None)
        if cls is None or _params(cls.__call__) != launcher:
            gone.append("triton.backends.nvidia.driver.CudaLauncher.__call__(gridX, gridY, gridZ, "
                        "stream, function, *args)")
        else:
            gone += _assigned_in(cls, "__init__", ("launch", "global_scratch_size", "profile_scratch_size",
                                                   "launch_cooperative_grid", "launch_pdl"))
        if getattr(nv, "_BASE_ARGS_FORMAT_LEN", None) != 13:
            gone.append("triton.backends.nvidia.driver._BASE_ARGS_FORMAT_LEN == 13 (the launch entry "
                        "point's leading arguments)")
        if _params(getattr(nv, "make_tensordesc_arg", None)) != ["arg", "metadata"]:
            gone.append("triton.backends.nvidia.driver.make_tensordesc_arg(arg, metadata)")
        wrap = getattr(nv, "wrap_handle_tensordesc", None)
        free = ()
        if _params(wrap) == ["launcher", "signature", "tensordesc_meta"]:
            inner = wrap(lambda *a: None, {0: "tensordesc<fp16[64, 64]>"}, None)
            free = getattr(getattr(inner, "__code__", None), "co_freevars", ())
        if not {"launcher", "tensordesc_indices", "tensordesc_meta"} <= set(free):
            gone.append("triton.backends.nvidia.driver.wrap_handle_tensordesc(launcher, signature, "
                        "tensordesc_meta) closing over launcher, tensordesc_indices, tensordesc_meta")
    except ImportError:
        gone.append("triton.backends.nvidia.driver")
    # the ROCm launcher, called the same way by a replay (it has no DirectLaunch)
    try:
        from triton.backends.amd import driver as amd
    except ImportError:   # a triton built without the AMD backend: nothing of it is launched
        amd = None
    hip = getattr(amd, "HIPLauncher", None)
    if amd is not None and (hip is None or _params(hip.__call__) != launcher):
        gone.append("triton.backends.amd.driver.HIPLauncher.__call__(gridX, gridY, gridZ, stream, "
                    "function, *args)")
    return gone


@functools.lru_cache(maxsize=None)
def missing() -> tuple[str, ...]:
    """The Triton internals the launch cache uses that this Triton lacks or has in another shape;
    empty on the triton this was written against. Checked once per process, without a GPU."""
    try:
        return tuple(_check())
    except Exception as e:   # a check that cannot even run is a failed check
        return (f"the feature check itself ({type(e).__name__}: {e})",)


def supported() -> bool:
    """Whether every Triton internal the launch cache (and warm_up's compile) uses is there."""
    return not missing()


_enabled: bool | None = None
_enabled_lock = threading.Lock()


def enabled() -> bool:
    """Whether calls record and replay their launches: no switch turns it off and `supported()`.
    Decided once per process; where the check fails, one warning names what is missing."""
    global _enabled
    if _enabled is None:
        with _enabled_lock:
            if _enabled is None:
                _enabled = _decide()
    return _enabled


def _decide() -> bool:
    if any(os.environ.get(k, "1") == "0" for k in _SWITCHES):
        return False
    gone = missing()
    if gone:
        import triton
        logging.getLogger("autossd").warning(
            "autossd: the launch cache is off: triton %s lacks %s. Every call launches through "
            "triton's JIT instead (correct, with more host time per call).",
            getattr(triton, "__version__", "?"), "; ".join(gone))
        return False
    return True


_driver_start: threading.Thread | None = None


def start_driver() -> None:
    """Bring up triton's GPU driver in a thread, once per process, so that a first call's
    config lookup overlaps it: with a cold triton cache its first use builds the driver's C
    helpers with gcc (0.4 s on an H200 host), which waits on a subprocess, not on Python.
    `current_stream` (the first thing a launch asks of the driver) waits for it."""
    global _driver_start
    if _driver_start is not None or not supported():
        return

    def bring_up():
        try:
            _driver.active.get_current_device()
        except Exception:  # noqa: BLE001 - the launch that needs the driver raises it again, in its thread
            pass

    _driver_start = threading.Thread(target=bring_up, name="autossd-driver", daemon=True)
    _driver_start.start()


def current_stream():
    """The current device's current stream, as triton's launchers take it."""
    if supported():
        if _driver_start is not None and _driver_start.is_alive():
            _driver_start.join()
        d = _driver.active
        return d.get_current_stream(d.get_current_device())
    return torch.cuda.current_stream().cuda_stream


def replay_stream(device: torch.device):
    """The stream a recorded call replays on, or None where calls are neither recorded nor
    replayed: the CPU's interpreter, or the launch cache off (`enabled`, asked first so that a
    triton lacking an internal warns on any device)."""
    if not enabled() or device.type == "cpu":
        return None
    return current_stream()


def never_compiled(fn, device: int) -> bool:
    """Whether this process has compiled nothing of `fn` for `device` (triton 3.6's JIT keeps
    its compiled kernels per device in device_caches; False where that is not so)."""
    caches = getattr(fn, "device_caches", None)
    if not supported() or caches is None or not hasattr(caches, "get"):
        return False
    entry = caches.get(device)
    return entry is None or not entry[0]


def load_handles(ck) -> None:
    """Load a compiled kernel's module now (its launcher is built on the first load)."""
    ck._init_handles()


# --- recording ----------------------------------------------------------------------------------
def remember(cache: dict, key, value, limit: int) -> None:
    """cache[key] = value, starting the cache over once it holds `limit` entries (a server sees
    every prompt length: the per-call caches must not grow without bound)."""
    if len(cache) >= limit:
        cache.clear()
    cache[key] = value


def input_sig(t: dict, names) -> tuple:
    """What a launch specializes on, per input of `names`: dtype, shape, strides, device, 16-byte
    alignment, and the aliasing pattern (a record made when B is C must not serve a call where
    they differ). Raises AttributeError for a non-tensor input."""
    out = []
    seen = {}
    for k in names:
        v = t.get(k)
        if v is None:
            out.append(None)
            continue
        out.append((v.dtype, v.shape, v.stride(), v.device, v.data_ptr() % 16 == 0,
                    seen.setdefault(id(v), len(out))))
    return tuple(out)


_data_ptr = torch.Tensor.data_ptr


class RecentCalls:
    """The last few keys of an entry point's calls, found without building the key.

    Building a call's key (`input_sig`: per tensor its dtype, shape, strides, device and
    alignment, as a tuple) and hashing it is most of a replayed call's host time, and a decode
    loop calls with one key for thousands of steps. So the last SIZE keys are kept with a check
    of their tensors' metadata that runs in C++ (torch's dynamo tensor guard: type, dtype,
    device, dispatch keys, requires_grad, sizes, strides), and a call that passes one, with
    None in the same places, equal other arguments (`extra`) and its pointers aligned as at the
    record, is that key's call. A key whose tensors alias one another (B is C) is not kept: a
    record maps each pointer to one argument's name, and only the full key tells the patterns
    apart. Where torch lacks the guard, nothing is kept and every call builds its key."""
    SIZE = 4
    __slots__ = ("names", "_entries", "generation", "_lock")

    def __init__(self, names: tuple):
        self.names = names
        self._entries = ()
        self.generation = 0   # counts clears: a value prepared before one is not kept after it
        self._lock = threading.Lock()

    def clear(self) -> None:
        with self._lock:
            self._entries = ()
            self.generation += 1

    def find(self, tensors: tuple, extra):
        """(value, names, data pointers) of the kept key these tensors and `extra` match, or
        None: the names of the tensors given (not None) and their pointers in that order, a list
        the caller may extend. Written for host time (itemgetter and map run in C, no dict is
        built): a few µs for ten tensors."""
        for take, take_absent, nones, guard, names, all_aligned, aligned, ex, value in self._entries:
            if ex != extra:
                continue
            ts = take(tensors)
            if not guard.check(*ts) or (take_absent is not None and take_absent(tensors) != nones):
                continue
            ptrs = list(map(_data_ptr, ts))
            if all_aligned:
                bits = 0
                for p in ptrs:
                    bits |= p
                ok = not bits & 15
            else:
                ok = tuple(p & 15 == 0 for p in ptrs) == aligned
            if ok:
                return value, names, ptrs
        return None

    def add(self, tensors: tuple, extra, value, generation: int | None = None) -> None:
        """Keep `value` for the key of these tensors (the call's own, as the caller passed them)
        and `extra`, evicting the oldest past SIZE; not where `generation` (read before the value
        was looked up) is no longer current: a clear (a database write) came in between."""
        present = tuple(i for i, v in enumerate(tensors) if v is not None)
        ts = [tensors[i] for i in present]
        if _TensorGuard is None or not ts or not all(isinstance(t, torch.Tensor) for t in ts) \
                or len({id(t) for t in ts}) != len(ts):
            return
        try:
            guard = _TensorGuard(*ts, dynamic_dims_sizes=[list(t.shape) for t in ts],
                                 dynamic_dims_strides=[list(t.stride()) for t in ts])
            if not guard.check(*ts):   # a guard that refuses its own tensors is of no use
                return
            aligned = tuple(t.data_ptr() & 15 == 0 for t in ts)
        except Exception:  # noqa: BLE001 - another torch's guard, a tensor without storage: the full key works
            return
        absent = tuple(i for i in range(len(tensors)) if i not in present)
        # itemgetter of one index returns the item, of several a tuple: always a tuple here
        take = operator.itemgetter(*present) if len(present) > 1 else (lambda a, i=present[0]: (a[i],))
        take_absent = None
        if absent:
            take_absent = operator.itemgetter(*absent) if len(absent) > 1 else (lambda a, i=absent[0]: (a[i],))
        entry = (take, take_absent, (None,) * len(absent), guard, tuple(self.names[i] for i in present),
                 all(aligned), aligned, extra, value)
        with self._lock:
            if generation is None or generation == self.generation:
                self._entries = (entry,) + self._entries[:self.SIZE - 1]


def tma_descriptor_types() -> tuple:
    try:
        from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    except ImportError:   # a triton without Gluon: no descriptor is ever planned
        return ()
    return (TensorDescriptor,)


TMA_DESCRIPTORS = tma_descriptor_types()


def record(launches: list, compiled: list, t: dict, buf, module, inputs, buffers) -> list:
    """Per launch: (compiled kernel, grid, argument sources in the kernel's parameter order,
    the argument list with every constant in place and None for each pointer, and the pointers'
    (position, from an input?, name, TMA descriptor or None)), and its DirectLaunch where one can
    be made: a replay copies the list and fills in only the pointers. A pointer comes from
    t[name] for a name of `inputs`, else from buf.<name> for a name of `buffers`."""
    ids = {id(v): ("in", k) for k in inputs if (v := t.get(k)) is not None}
    ids.update({id(v): ("buf", k) for k in buffers if (v := getattr(buf, k)) is not None})
    out = []
    for ln, ck in zip(launches, compiled):
        values = {**ln.args, **ln.constexprs}
        srcs = []
        descs = {}   # position -> the TMA descriptor recorded there (its base is replaced per call)
        for name in getattr(module, ln.kernel).arg_names:
            v = values[name]
            if isinstance(v, torch.Tensor):
                srcs.append(ids[id(v)])
            elif isinstance(v, TMA_DESCRIPTORS):
                descs[len(srcs)] = v
                srcs.append(ids[id(v.base)])
            else:
                srcs.append(("const", v))
        load_handles(ck)  # loads the module once, so the replay can take ck.function directly
        template = [k if kind == "const" else None for kind, k in srcs]
        shapes = {i: DescShape(d) for i, d in descs.items()}
        slots = tuple((i, kind == "in", k, shapes.get(i)) for i, (kind, k) in enumerate(srcs) if kind != "const")
        direct = DirectLaunch.of(ck, template, slots, {i: d.base for i, d in descs.items()})
        out.append((ck, tuple(ln.grid) + (1,) * (3 - len(ln.grid)), tuple(srcs), template, slots, direct))  # 3-D grid
    return out


# --- replay ---------------------------------------------------------------------------------------
class DescShape:
    """What a record keeps of a TMA descriptor: its shape, strides and padding, never its base
    tensor. A record outlives the call it was made in, and holding that call's tensors would keep
    their memory alive: under torch.compile's CUDA graph trees (mode="reduce-overhead") a first
    call made in the warm-up run allocates in the graph's memory pool, and a tensor of that pool
    kept past the run fails torch's check that every live allocation of the pool is an output."""
    __slots__ = ("shape", "strides", "padding")

    def __init__(self, desc):
        self.shape, self.strides, self.padding = tuple(desc.shape), tuple(desc.strides), desc.padding


class DescArg:
    """A recorded TMA descriptor on a new call's tensor: what triton's launcher reads of a
    descriptor argument (base, shape, strides, padding) to encode it at launch. The shapes and
    strides are the recorded call's: the launch-cache key (problem, input strides) fixes them."""
    __slots__ = ("base", "shape", "strides", "padding")

    def __init__(self, base, desc):
        self.base, self.shape, self.strides, self.padding = base, desc.shape, desc.strides, desc.padding


class DirectLaunch:
    """A recorded kernel launched by the launcher's compiled entry point itself. triton's
    launcher (CudaLauncher) wraps that entry point in Python at every launch: the scratch
    allocations' closures (0.6 us a launch on a CPU here), and for a kernel that takes TMA
    descriptors an encoding of each one on the host (a driver call, cuTensorMapEncodeTiled):
    four per Gluon chunk scan, 13 us per eager call at 2.7b 1x2048 on the H100. A recorded
    descriptor's shape, strides and block are fixed by the launch-cache key, so only its base
    address varies: each is encoded once per address (by triton's own encoder). `of` returns
    None where the launcher is not the one this was written against (HIP, another triton,
    scratch memory): the replay then goes through triton's launcher."""
    __slots__ = ("raw", "head", "template", "slots", "encode", "_at")
    KEEP = 8   # encodings kept per descriptor argument: a few caller buffers take turns

    def __init__(self, raw, head, template, slots, encode):
        self.raw, self.head, self.template, self.slots, self.encode = raw, head, template, slots, encode
        self._at = {}   # names of a call's pointers (RecentCalls.find) -> (argument, pointer index) pairs

    @classmethod
    def of(cls, ck, template: list, slots: tuple, bases: dict) -> DirectLaunch | None:
        """`bases`: position -> the recorded call's tensor under each descriptor, used here only
        (to learn an encoding's width), never kept."""
        run = ck.run
        if type(run).__name__ != "CudaLauncher" or getattr(run, "global_scratch_size", 1) \
                or getattr(run, "profile_scratch_size", 1):
            return None
        descs = {i: d for i, _, _, d in slots if d is not None}
        encode = getattr(sys.modules.get(type(run).__module__), "make_tensordesc_arg", None)
        wrapper = run.launch   # the entry point, or triton's wrap_handle_tensordesc closure around it
        code, cells = getattr(wrapper, "__code__", None), getattr(wrapper, "__closure__", None) or ()
        free = dict(zip(code.co_freevars, (c.cell_contents for c in cells))) if code else {}
        if not descs:
            raw = wrapper   # what CudaLauncher.__call__ calls, less its scratch allocations (none)
        elif encode is None or "launcher" not in free or set(free.get("tensordesc_indices", ())) != set(descs):
            raw = None
        else:
            raw = free["launcher"]
        if raw is None:
            return None
        metas = iter(free.get("tensordesc_meta") or [None] * len(descs))
        xtemplate, at = [], {}
        for i, v in enumerate(template):   # descriptor i expands to [encoded, *its constant sizes]
            if i in descs:
                meta = next(metas)
                width = len(encode(DescArg(bases[i], descs[i]), meta))   # the recorded call's
                at[i] = (len(xtemplate), width, meta)
                xtemplate.extend([None] * width)
            else:
                at[i] = (len(xtemplate), 1, None)
                xtemplate.append(v)
        # pointers, then descriptors (each with its encodings by address)
        xslots = (tuple((at[i][0], from_input, k) for i, from_input, k, d in slots if d is None),
                  tuple((at[i][0], at[i][1], from_input, k, d, at[i][2], {})
                        for i, from_input, k, d in slots if d is not None))
        head = (ck.function, run.launch_cooperative_grid, run.launch_pdl, None, None, ck.packed_metadata,
                None, None, None)   # scratch buffers (none), launch metadata and hooks (none)
        return cls(raw, head, xtemplate, xslots, encode)

    def positions(self, names: tuple) -> tuple | None:
        """(argument, index in `names`) of each pointer this launch takes, or None where one of
        them is not named. Worked out once per names tuple: a call then copies the template and
        sets its pointers, with no dict built per call."""
        at = self._at.get(names)
        if at is None:
            index = {k: i for i, k in enumerate(names)}
            if any(k not in index for _, _, k in self.slots[0]):
                return None
            at = tuple((a, index[k]) for a, _, k in self.slots[0])
            if len(self._at) >= self.KEEP:
                self._at.clear()
            self._at[names] = at
        return at

    def with_ptrs(self, grid: tuple, stream, at: tuple, ptrs: list) -> None:
        """The launch with every pointer given as an integer: `ptrs[i]` goes to argument `a` for
        each (a, i) of `at` (`positions`; a record without descriptors or buffers:
        `replay_ptrs` checks)."""
        args = self.template.copy()
        for a, i in at:
            args[a] = ptrs[i]
        self.raw(grid[0], grid[1], grid[2], stream, *self.head, *args)

    def __call__(self, grid: tuple, stream, t: dict, buf) -> None:
        args = self.template.copy()
        ptrs, descs = self.slots
        for at, from_input, k in ptrs:
            args[at] = (t[k] if from_input else getattr(buf, k)).data_ptr()
        for at, width, from_input, k, desc, meta, enc in descs:
            v = t[k] if from_input else getattr(buf, k)
            ptr = v.data_ptr()
            e = enc.get(ptr) if meta is not None else None
            if e is None:
                e = self.encode(DescArg(v, desc), meta)
                if meta is not None:   # an encoding holds the address only (without meta: the tensor)
                    if len(enc) >= self.KEEP:
                        enc.pop(next(iter(enc)), None)
                    enc[ptr] = e
            args[at:at + width] = e
        self.raw(grid[0], grid[1], grid[2], stream, *self.head, *args)


def _active(hook) -> bool:
    # triton 3.6 keeps an (empty) HookChain there, never None; earlier versions keep None
    return hook is not None and bool(getattr(hook, "calls", True))


def _hooked() -> bool:
    """Whether a launch hook (a profiler's) is set: launches then go through triton's runner."""
    return _active(_knobs.runtime.launch_enter_hook) or _active(_knobs.runtime.launch_exit_hook)


def pointers_only(cached: list) -> bool:
    """Whether every launch of a record is a DirectLaunch whose tensors are all inputs (no
    buffers, no TMA descriptors): what `replay_ptrs` can launch."""
    return all(e[5] is not None and not e[5].slots[1] and all(from_input for _, from_input, _ in e[5].slots[0])
               for e in cached)


def replay_ptrs(cached: list, names: tuple, ptrs: list, device: int | None) -> bool:
    """Launch a record that is `pointers_only`, `ptrs[i]` the pointer of the argument named
    `names[i]` (as `RecentCalls.find` gives them), on the current stream, when
    the current device is `device` (the record's), no launch hook is set and every pointer a
    launch takes is named. False, launching nothing, where one of those does not hold: the
    caller takes `replay`'s path."""
    if _hooked():
        return False
    d = _driver.active
    dev = d.get_current_device()
    if device not in (None, dev):
        return False
    at = [entry[5].positions(names) for entry in cached]
    if None in at:   # a pointer the record takes is not among the names: launch nothing
        return False
    stream = d.get_current_stream(dev)
    for entry, where in zip(cached, at):
        entry[5].with_ptrs(entry[1], stream, where, ptrs)
    return True


def replay(cached: list, t: dict, buf, stream=None) -> None:
    """Launch recorded kernels on new inputs and buffers. Each launch calls the compiled kernel's
    launcher directly: the device and stream are looked up once per call instead of per launch,
    and pointers go as integers, which the launcher takes as they are (a tensor costs it a
    data_ptr() call and a driver query per pointer). The inputs were validated to be on one GPU
    (problem.from_args), which is the check that query would make. With a launch hook set (a
    profiler), the launch goes through triton's runner, which calls the hooks; without one, the
    launcher gets None for them and no per-launch metadata is built."""
    hooked = _hooked()
    if stream is None and not hooked:
        stream = current_stream()
    for ck, grid, srcs, template, slots, direct in cached:
        if direct is not None and not hooked:
            direct(grid, stream, t, buf)
            continue
        if hooked:
            args = [t[k] if kind == "in" else getattr(buf, k) if kind == "buf" else k for kind, k in srcs]
            for i, _, _, desc in slots:
                if desc is not None:
                    args[i] = DescArg(args[i], desc)
            ck[grid](*args)
            continue
        args = template.copy()
        for i, from_input, k, desc in slots:
            v = t[k] if from_input else getattr(buf, k)
            args[i] = v.data_ptr() if desc is None else DescArg(v, desc)
        ck.run(grid[0], grid[1], grid[2], stream, ck.function, ck.packed_metadata, None, None, None, *args)


class StubKernel:
    """A stand-in for a compiled kernel with what `record` and `replay` use of one, for tests
    without a GPU (autossd.testing): it keeps each replayed launch's grid and arguments. Its
    launcher is not triton's, so a record makes no direct launch and a replay calls `run` (the
    tests replay on stream 7)."""
    function, packed_metadata = "fn", "meta"

    def __init__(self):
        self.calls = []

    def _init_handles(self):
        pass

    def run(self, gx, gy, gz, stream, function, meta, launch_meta, enter, exit_, *args):
        assert (stream, function, meta, launch_meta, enter, exit_) == (7, "fn", "meta", None, None, None)
        self.calls.append(((gx, gy, gz), args))


class InterpretedKernel:
    """A compiled kernel as the launch cache records and replays one, launching through the
    interpreter: with a launch hook set, a replay calls kernel[grid](*args) with the call's own
    tensors in the kernel's parameter order (the CPU has no compiled kernels or streams). Tests
    put these where an op's launch returns its compiled kernels."""

    run = None   # not triton's launcher: no direct launch is made

    def __init__(self, fn, options):
        self.fn, self.options = fn, options

    def _init_handles(self):
        pass

    def __getitem__(self, grid):
        return lambda *args: self.fn[grid](*args, **self.options)
