"""Cross-compile a rendered config for any target arch on a machine without a GPU, and report
what the compiler allocated: registers (NVIDIA) or VGPRs+AGPRs (AMD), spills, shared memory / LDS
and occupancy. A config over the arch's limits is rejected with the reason.

The launches compiled are exactly the ones `ops.ssd.chunk.plan` makes for a problem, built from
meta tensors, so the compiled and the launched signatures agree.
"""
from __future__ import annotations

import atexit
import contextlib
import hashlib
import os
import re
import subprocess
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from .arch import Arch, get_arch
from .problem import TORCH_DTYPES, Problem
from .render import load
from .knobs import BaseConfig as Config

_PTR = {torch.float16: "*fp16", torch.bfloat16: "*bf16", torch.float32: "*fp32",
        torch.int32: "*i32", torch.int64: "*i64"}


@dataclass
class StageReport:
    stage: str
    num_warps: int
    registers: int = 0        # per thread: NVIDIA REG, AMD VGPRs (arch VGPRs + AGPRs)
    agprs: int = 0
    spill_bytes: int = 0      # NVIDIA stack frame + local memory / AMD scratch per thread
    shared_bytes: int = 0
    occupancy: float = 0.0    # NVIDIA: blocks per SM; AMD: waves per SIMD (from the assembler)
    artifact_sha: str = ""
    pdl: bool = False         # launched with programmatic dependent launch (knob pdl)
    reasons: list[str] = field(default_factory=list)


@dataclass
class CompileReport:
    arch: str
    config: Config
    stages: list[StageReport]
    reasons: list[str]

    @property
    def ok(self) -> bool:
        return not self.reasons and all(not s.reasons for s in self.stages)

    def spills(self) -> list[str]:
        """Stages that spill registers. Not a reason to refuse a config (`ok`): a capped kernel
        that spills a little can still be the fastest, which only a measurement can tell."""
        return [f"{s.stage}: spills {s.spill_bytes} bytes per thread" for s in self.stages if s.spill_bytes]

    def why(self) -> list[str]:
        return self.reasons + [f"{s.stage}: {r}" for s in self.stages for r in s.reasons]

    def as_dict(self) -> dict:
        return {"arch": self.arch, "ok": self.ok, "why": self.why(), "config": self.config.as_dict(),
                "stages": [asdict(s) for s in self.stages]}


def meta_inputs(problem: Problem, device="meta") -> dict:
    """Inputs shaped and typed like a call, without data (meta tensors by default)."""
    b, l, h, p, n, g = (problem.batch, problem.seqlen, problem.nheads, problem.headdim,
                        problem.dstate, problem.ngroups)
    dt_ = TORCH_DTYPES[problem.dtype]
    f32 = torch.float32
    e = lambda *s, dtype=dt_: torch.empty(*s, dtype=dtype, device=device)  # noqa: E731
    return dict(x=e(b, l, h, p), dt=e(b, l, h, dtype=f32), A=e(h, dtype=f32), B=e(b, l, g, n),
                C=e(b, l, g, n),
                D=(e(h, p, dtype=f32) if problem.D_has_hdim else e(h, dtype=f32)) if problem.has_D else None,
                z=e(b, l, h, p) if problem.has_z else None,
                dt_bias=e(h, dtype=f32) if problem.has_dt_bias else None,
                initial_states=e(b, h, p, n, dtype=f32) if problem.has_initial_states else None,
                seq_idx=e(b, l, dtype=torch.int32) if problem.has_seq_idx else None)


def _signature(launch):
    sig, consts, attrs = {}, {}, {}
    for i, (name, v) in enumerate(launch.args.items()):
        if v is None:
            sig[name] = "constexpr"
            consts[name] = None
        elif isinstance(v, torch.Tensor):
            sig[name] = _PTR[v.dtype]
            attrs[(i,)] = [["tt.divisibility", 16]]  # allocations are 16-byte aligned
        elif hasattr(v, "block_shape") and hasattr(v, "layout"):   # a Gluon TMA descriptor
            sig[name] = f"tensordesc<{_PTR[v.base.dtype][1:]}{list(v.block_shape)},{v.layout}>"
        elif isinstance(v, bool):
            raise TypeError(f"{name}: bools are passed as constexprs")
        elif isinstance(v, int):
            if v == 1:  # triton specializes ints equal to 1 at launch; so do we
                sig[name] = "constexpr"
                consts[name] = 1
            else:
                sig[name] = "i32" if -2**31 <= v < 2**31 else "i64"
                if v % 16 == 0:
                    attrs[(i,)] = [["tt.divisibility", 16]]
        else:
            sig[name] = "fp32"
    for name, v in launch.constexprs.items():
        sig[name] = "constexpr"
        consts[name] = v
    return sig, consts, attrs


def _cuobjdump() -> str:
    import triton
    return str(Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump")


# (registers, spilled bytes) by the cubin's digest: a tune compiles the same configs at many
# shapes, and where the specializations match the cubin is the same (Triton's cache hands it back
# in milliseconds, while cuobjdump is a process of its own per stage)
_RESOURCES: dict[bytes, tuple[int, int]] = {}


def _nvidia_resources(cubin: bytes) -> tuple[int, int]:
    key = hashlib.sha256(cubin).digest()
    hit = _RESOURCES.get(key)
    if hit is None:
        if len(_RESOURCES) >= 8192:
            _RESOURCES.clear()
        hit = _RESOURCES[key] = _cuobjdump_resources(cubin)
    return hit


def _cuobjdump_resources(cubin: bytes) -> tuple[int, int]:
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(cubin)
    try:
        out = subprocess.run([_cuobjdump(), "--dump-resource-usage", f.name], capture_output=True,
                             text=True, check=True).stdout
    finally:
        os.unlink(f.name)
    # spilled registers land in the stack frame (STACK, with a register cap) or in LOCAL:
    # a Triton kernel makes no calls and has no local arrays, so either means spills
    reg = re.search(r"REG:(\d+)", out)
    spill = sum(int(m) for m in re.findall(r"(?:STACK|LOCAL):(\d+)", out))
    return int(reg.group(1)) if reg else 0, spill


def _amd_field(asm: str, key: str) -> int:
    m = re.search(rf";\s*{key}:\s*(\d+)", asm)
    return int(m.group(1)) if m else 0


# state spaces an access may have that the previous launch cannot have written
_PRIVATE_SPACES = ("shared", "param", "local", "const")


def pdl_order_reasons(ptx: str, loads_first: bool = False) -> list[str]:
    """Under programmatic dependent launch a kernel may start before its predecessor ends: every
    access to global memory must come after its griddepcontrol.wait. Checked on the PTX (the
    wait is inline assembly, which the compiler could in principle reorder loads around): [] when
    the wait comes first, else why not. loads_first: a kernel that reads what earlier launches
    wrote before its wait (pdl = 2's chunk scan): only writes are checked."""
    wait = first = None
    for n, line in enumerate(ptx.splitlines()):
        words = line.split()
        if words and words[0].startswith("@"):   # a predicated instruction
            words = words[1:]
        if not words:
            continue
        op = words[0]
        if op.startswith("griddepcontrol.wait"):
            wait = n
            break
        parts = op.split(".")
        if parts[0] == "cp":   # async copies (TMA included): global when a side of them is
            touches = ".global" in op or ".tensor" in op
            if loads_first and ".shared" in op:   # the destination's space comes first:
                touches = touches and op.index(".global") < op.index(".shared")   # into shared = a read
        else:                  # ld/st/atom/red/prefetch: the state space follows the opcode
            touches = parts[0] in (("st", "atom", "red") if loads_first else ("ld", "st", "atom", "red", "prefetch")) \
                and not (len(parts) > 1 and parts[1].split("::")[0] in _PRIVATE_SPACES)
        if touches and first is None:
            first = (n, op)
    if wait is None:
        return ["launched with pdl, but its PTX has no griddepcontrol.wait"]
    if first is not None:
        return [f"launched with pdl, but accesses memory ({first[1]}, PTX line {first[0] + 1}) "
                f"before its griddepcontrol.wait (line {wait + 1})"]
    return []


def _report_stage(arch: Arch, launch, compiled) -> StageReport:
    md = compiled.metadata
    rep = StageReport(stage=launch.stage, num_warps=launch.options["num_warps"],
                      shared_bytes=int(md.shared))
    threads = rep.num_warps * arch.warp_size
    if arch.is_amd:
        asm = compiled.asm["amdgcn"]
        rep.artifact_sha = hashlib.sha256(asm.encode()).hexdigest()[:16]
        rep.registers = _amd_field(asm, "NumVgprs")
        rep.agprs = _amd_field(asm, "NumAgprs")
        rep.spill_bytes = _amd_field(asm, "ScratchSize")
        rep.occupancy = float(_amd_field(asm, "Occupancy"))
        if rep.occupancy == 0:
            rep.reasons.append("occupancy 0: does not fit on a SIMD")
    else:
        cubin = compiled.asm["cubin"]
        rep.artifact_sha = hashlib.sha256(cubin).hexdigest()[:16]
        rep.registers, rep.spill_bytes = _nvidia_resources(cubin)
        by_regs = arch.regs_per_sm // max(1, rep.registers * threads)
        by_threads = arch.max_threads_per_sm // threads
        by_smem = arch.smem_per_sm // rep.shared_bytes if rep.shared_bytes else by_threads
        rep.occupancy = float(min(by_regs, by_threads, by_smem))
        if rep.occupancy < 1:
            rep.reasons.append(f"occupancy 0: {rep.registers} registers x {threads} threads")
        rep.pdl = bool(getattr(md, "launch_pdl", False))
        if rep.pdl:
            rep.reasons += pdl_order_reasons(compiled.asm["ptx"], loads_first=launch.kernel.endswith("_early"))
    if rep.shared_bytes > arch.smem_per_block:
        rep.reasons.append(f"shared memory {rep.shared_bytes} B exceeds {arch.name}'s "
                           f"{arch.smem_per_block} B per block")
    return rep


_pool = None


@contextlib.contextmanager
def _interpreter_off():
    """TRITON_INTERPRET=0 while the compile worker starts: it inherits the environment, and
    Triton decides at import whether its own helpers are interpreted."""
    old = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "0"
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("TRITON_INTERPRET")
        else:
            os.environ["TRITON_INTERPRET"] = old


def _compile_elsewhere(*args) -> "CompileReport":
    """compile_config(*args) in one spawned worker with the interpreter off: a process running
    kernels under TRITON_INTERPRET=1 cannot also compile. A process pool executor rather than
    multiprocessing's Pool: where the worker dies or a result cannot be read back, the executor
    says so (BrokenProcessPool) instead of leaving the caller waiting forever for a lost task;
    a broken worker is replaced once, then its error is raised."""
    global _pool
    import multiprocessing as mp
    from concurrent.futures import ProcessPoolExecutor
    from concurrent.futures.process import BrokenProcessPool

    from .lifeline import die_with_parent, initargs   # the worker dies with this process
    for attempt in (0, 1):
        try:
            with _interpreter_off():   # the executor starts its worker at the first submit
                if _pool is None:
                    _pool = ProcessPoolExecutor(1, mp_context=mp.get_context("spawn"),
                                                initializer=die_with_parent, initargs=initargs())
                    # shut down before interpreter teardown, where the executor's own clean-up
                    # finds its modules gone and prints an ignored exception
                    atexit.register(_pool.shutdown, wait=False, cancel_futures=True)
                future = _pool.submit(compile_config, *args)
            return future.result()
        except BrokenProcessPool:
            _pool.shutdown(wait=False, cancel_futures=True)
            _pool = None
            if attempt:
                raise


def compile_config(config: Config, arch: Arch | str, problem: Problem,
                   stages: tuple[str, ...] | None = None) -> CompileReport:
    """Compile the stages of `config` (every launch of its op's plan by default) for `arch` at
    `problem`'s signature, with meta tensors (no device), and report."""
    from .render import interpreting
    if interpreting():
        return _compile_elsewhere(config, arch, problem, stages)
    import triton
    from triton.compiler import ASTSource
    from triton.experimental.gluon._runtime import GluonASTSource

    from .ops.registry import get_op

    arch = get_arch(arch) if isinstance(arch, str) else arch
    op = get_op(config.op)
    why = op.fn("violations")(config, arch, problem)
    if why:
        return CompileReport(arch.name, config, [], why)
    launches = op.fn("meta_launches")(problem, config, arch.backend)
    module = load(config, arch.backend, interpret=False)
    reports = []
    for ln in launches:
        if stages is not None and ln.stage not in stages:
            continue
        sig, consts, attrs = _signature(ln)
        fn = getattr(module, ln.kernel)
        # a Gluon kernel (smem_pad > 0) is lowered from its own source object, as its JIT does
        src = (GluonASTSource if fn.is_gluon() else ASTSource)(fn, sig, consts, attrs)
        try:
            compiled = triton.compile(src, target=arch.gpu_target(), options=dict(ln.options))
        except Exception as e:  # a compiler error is a verdict on the config, not a crash
            msg = str(e).strip().splitlines()
            reports.append(StageReport(ln.stage, ln.options["num_warps"],
                                      reasons=[f"compile error: {msg[-1] if msg else type(e).__name__}"]))
            continue
        reports.append(_report_stage(arch, ln, compiled))
    return CompileReport(arch.name, config, reports, [])
