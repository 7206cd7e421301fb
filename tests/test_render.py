"""Rendering: strict templates, only validated configs in, content-hashed cache out."""
from pathlib import Path

import jinja2
import pytest

from autossd import render
from autossd.ops.ssd.fwd_knobs import Config


def test_source_carries_config_values():
    src = render.render(Config(chunk_size=128, scan_block_m=32, state_dtype="bf16"))
    assert "CHUNK = tl.constexpr(128)" in src
    assert "SCAN_BLOCK_M = tl.constexpr(32)" in src
    assert "STATE_DTYPE = tl.bfloat16" in src
    compile(src, "<rendered>", "exec")  # valid Python


def test_amd_options_rendered_only_for_hip():
    cfg = Config(waves_per_eu=2, kpack=2, matrix_instr_nonkdim=16)
    launch = lambda src: src[src.index("LAUNCH = {"):src.index("\n}\n", src.index("LAUNCH = {"))]  # noqa: E731
    assert "waves_per_eu" not in launch(render.render(cfg, "cuda"))
    hip = launch(render.render(cfg, "hip"))
    assert "'waves_per_eu': 2" in hip and "'kpack': 2" in hip and "'matrix_instr_nonkdim': 16" in hip


def test_only_configs_and_known_backends_render():
    with pytest.raises(TypeError, match="config"):
        render.render({"chunk_size": 64})
    with pytest.raises(ValueError, match="backend"):
        render.render(Config(), "opencl")


def test_templates_are_strict():
    with pytest.raises(jinja2.UndefinedError):
        render._env().get_template("module.py.jinja").render(cfg=Config(), backend="cuda")


def test_an_op_sees_its_folder_then_its_familys_library_then_common(tmp_path, monkeypatch):
    """An op's templates are looked up in its own folder, then its family's kernel library
    (templates/ssd/ for ssd_*), then templates/common/: a name in the op's folder wins over the
    library's (an op overrides a shared kernel by writing its own), and another family's folder
    is not searched."""
    # the shipped tree: every SSD op reaches the SSD library and the common templates
    for op in ("ssd_fwd", "ssd_bwd", "ssd_decode", "ssd_varlen"):
        env = render._env(op)
        assert Path(env.get_template("dt_cumsum.jinja").filename) == render.templates_dir() / "ssd" / "dt_cumsum.jinja"
        assert Path(env.get_template("launch_table.jinja").filename).parent == render.templates_dir() / "common"
    # a tree of its own
    files = {"ssd_x/own.jinja": "op", "ssd_x/both.jinja": "op", "ssd/both.jinja": "family",
             "ssd/lib.jinja": "family", "common/lib.jinja": "common", "common/any.jinja": "common",
             "other/far.jinja": "other"}
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(exist_ok=True)
        (tmp_path / name).write_text(text)
    monkeypatch.setattr(render, "templates_dir", lambda: tmp_path)
    render._env.cache_clear()
    try:
        env = render._env("ssd_x")
        assert [env.get_template(n).render() for n in ("own.jinja", "both.jinja", "lib.jinja", "any.jinja")] \
            == ["op", "op", "family", "common"]
        with pytest.raises(jinja2.TemplateNotFound):
            env.get_template("far.jinja")
        assert render.search_path("ssd_x") == [tmp_path / "ssd_x", tmp_path / "ssd", tmp_path / "common"]
        assert render.search_path("solo") == [tmp_path / "solo", tmp_path / "common"]   # no library of its own
    finally:
        render._env.cache_clear()


def test_the_ssd_ops_render_the_librarys_kernels_under_their_own_names():
    """The dt' block (softplus and clamp) is written once, in templates/ssd/dt_cumsum.jinja, and
    rendered into the forward's, the backward's (with d dt'/d dt) and the packed prefill's
    cumsum under each op's names."""
    from autossd.ops.ssd.bwd_knobs import BwdConfig
    from autossd.ops.ssd.varlen_knobs import VarlenConfig
    softplus = "        lp = tl.where(u == 1.0, e, tl.log(u) * e / (u - 1.0))\n"
    fwd, bwd, varlen = (render.render(c) for c in (Config(), BwdConfig(), VarlenConfig()))
    assert fwd.count(softplus) == bwd.count(softplus) == varlen.count(softplus) == 1
    assert "def _dt_cumsum(" in fwd and "def ssd_cumsum(" in fwd
    assert "def _dt_proc(" in bwd and "def ssd_bwd_cumsum(" in bwd and "fac = tl.where(soft" in bwd
    assert "def varlen_cumsum(" in varlen and "fac = " not in varlen
    library = (render.templates_dir() / "ssd" / "dt_cumsum.jinja").read_text()
    assert softplus in library
    for op in ("ssd_fwd", "ssd_bwd", "ssd_varlen"):
        assert not any(softplus in p.read_text() for p in (render.templates_dir() / op).glob("*.jinja")), op



FIVE_LAUNCH = ("cumsum", "bmm", "chunk_state", "state_passing", "chunk_scan")


@pytest.mark.parametrize("cb", ["stage", "inline"])
def test_packed_prefill_renders_the_forwards_five_launch_stage_files_in_their_packed_form(cb):
    """The forward's five-launch stages live once, in the SSD library (templates/ssd/), and
    packed prefill renders those same files with `packed` set: its own folder holds no copy of a
    stage, the forward's module has only the dense kernels, packed prefill's only the packed ones
    (a flag that leaked into the other op would show here as a kernel of the wrong form)."""
    from autossd.ops.ssd.varlen_knobs import VarlenConfig
    for op in ("ssd_fwd", "ssd_varlen"):
        env = render._env(op)
        for stage in FIVE_LAUNCH:
            assert Path(env.get_template(f"{stage}.jinja").filename) == render.templates_dir() / "ssd" / f"{stage}.jinja"
    assert sorted(p.name for p in (render.templates_dir() / "ssd_varlen").glob("*.jinja")) == ["module.py.jinja"]
    fwd, varlen = render.render(Config()), render.render(VarlenConfig(cb=cb))
    launched = [s for s in FIVE_LAUNCH if cb == "stage" or s != "bmm"]
    for stage in FIVE_LAUNCH:
        assert f"def ssd_{stage}(" in fwd and f"def varlen_{stage}(" not in fwd
        assert (f"def varlen_{stage}(" in varlen) == (stage in launched) and f"def ssd_{stage}(" not in varlen
    assert "cu_chunk_ptr" not in fwd and "last_chunk_ptr" in varlen

def test_cache_by_content_hash(tmp_path, monkeypatch):
    monkeypatch.setenv("AUTOSSD_CACHE_DIR", str(tmp_path))
    a = render.source_path(render.render(Config()))
    b = render.source_path(render.render(Config()))
    c = render.source_path(render.render(Config(scan_warps=8)))
    assert a == b != c
    assert a.parent == tmp_path / "kernels" and a.read_text() == render.render(Config())
    mod = render.load(Config(scan_warps=8), interpret=False)
    assert mod.SOURCE_PATH == c and mod.LAUNCH["chunk_scan"]["num_warps"] == 8
    assert render.load(Config(scan_warps=8), interpret=False) is mod


def test_template_hash_is_stable_and_short():
    assert render.template_hash() == render.template_hash() and len(render.template_hash()) == 16


def test_a_module_holds_only_its_depths_kernels():
    from autossd.ops.ssd.fwd import SEQUENCES as STAGES_BY_DEPTH
    kernels = {"cumsum": "ssd_cumsum", "bmm": "ssd_bmm", "chunk_state": "ssd_chunk_state",
               "state_passing": "ssd_state_passing", "chunk_scan": "ssd_chunk_scan",
               "state_fused": "ssd_state_fused", "fused": "ssd_fused"}
    cases = [(Config(launches=d), be) for d in STAGES_BY_DEPTH for be in ("cuda", "hip")]
    cases += [(Config(smem_pad=4), be) for be in ("cuda", "hip")]          # the Gluon chunk state
    for cfg, backend in cases:
        src = render.render(cfg, backend)
        launched = {kernels[s] for s in STAGES_BY_DEPTH[cfg.launches]}
        # cumsum.jinja and chunk_scan.jinja also hold the fused kernels' helpers
        for k in set(kernels.values()) - {"ssd_cumsum", "ssd_chunk_scan"}:
            assert (f"def {k}(" in src) == (k in launched), (cfg, backend, k)
        if backend == "cuda" and not cfg.smem_pad:    # and it imports with every launched kernel
            mod = render.load(cfg, interpret=False)
            assert all(hasattr(mod, k) for k in launched)


def test_kernel_hash_follows_the_code_not_the_config_header(monkeypatch):
    h = render.kernel_hash(Config(), "cuda")
    assert len(h) == 16 and h == render.kernel_hash(Config(), "cuda")
    hashes = {render.kernel_hash(Config(launches=d), be) for d in (5, 3, 1) for be in ("cuda", "hip")}
    assert len(hashes) == 6
    assert h != render.kernel_hash(Config(scan_warps=8), "cuda")   # the launch options are code too
    real = render.render
    try:
        render.kernel_hash.cache_clear()   # the header line alone changes: same hash
        monkeypatch.setattr(render, "render", lambda *a: real(*a).replace('# config: {', '# config: {"new": 1, ', 1))
        assert render.kernel_hash(Config(), "cuda") == h
        render.kernel_hash.cache_clear()   # a line of code changes: another hash
        monkeypatch.setattr(render, "render", lambda *a: real(*a) + "\nX = 1\n")
        assert render.kernel_hash(Config(), "cuda") != h
    finally:
        render.kernel_hash.cache_clear()


def test_gluon_chunk_state_is_refused_by_the_interpreter_not_run_in_its_place():
    # Triton 3.6's gluon.jit ignores TRITON_INTERPRET (it compiles for the active GPU), so a
    # padded config must fail loudly in the interpreter rather than silently run the tl kernel
    with pytest.raises(RuntimeError, match="smem_pad=4 selects the Gluon chunk-state kernel.*needs a GPU"):
        render.load(Config(smem_pad=4), interpret=True)
    # the rendered source switches kernels (tests/test_compile.py imports and compiles it)
    assert "@gluon.jit\ndef ssd_chunk_state(" in render.render(Config(smem_pad=4))
    assert "@triton.jit\ndef ssd_chunk_state(" in render.render(Config())


def test_ssd_forward_with_smem_pad_raises_the_gpu_error_in_the_interpreter():
    import torch

    from autossd.ops.ssd.chunk import ssd_forward
    if not render.interpreting():
        pytest.skip("runs only under the CPU interpreter")
    x = torch.randn(1, 64, 2, 16, dtype=torch.float16)
    B = torch.randn(1, 64, 1, 16, dtype=torch.float16)
    with pytest.raises(RuntimeError, match="needs a GPU"):
        ssd_forward(x, torch.rand(1, 64, 2), -torch.rand(2), B, B, chunk_size=64,
                    config=Config(chunk_size=64, smem_pad=2, state_block_m=16, state_block_n=16,
                                  state_block_k=64))


def test_register_cap_is_a_cuda_launch_option_only_when_set():
    cfg = Config(scan_maxnreg=64, state_maxnreg=128)
    cuda = render.launch_options(cfg, "cuda")
    assert cuda["chunk_scan"]["maxnreg"] == 64 and cuda["fused"]["maxnreg"] == 64
    assert cuda["chunk_state"]["maxnreg"] == 128 and cuda["state_fused"]["maxnreg"] == 128
    assert "maxnreg" not in cuda["bmm"] and "maxnreg" not in cuda["state_passing"]
    assert all("maxnreg" not in o for o in render.launch_options(Config(), "cuda").values())
    assert all("maxnreg" not in o for o in render.launch_options(cfg, "hip").values())


def test_pdl_waits_first_in_every_launched_kernel_and_is_a_launch_option():
    """pdl = 1: every kernel of the depth-5 module calls its wait-then-release helper as its
    first statement (before any memory access; tests/test_compile.py checks the PTX), and every
    stage launches with launch_pdl; pdl = 0 renders none of it."""
    import ast

    def first_calls(src):   # kernel -> (decorator, the name its first statement calls)
        out = {}
        for fn in ast.parse(src).body:
            if isinstance(fn, ast.FunctionDef) and fn.name.startswith("ssd_"):
                stmt = fn.body[0]
                call = stmt.value.func.id if isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Call) \
                    and isinstance(stmt.value.func, ast.Name) else None
                out[fn.name] = (fn.decorator_list[0].value.id, call)
        return out

    for over in ({}, {"fold_prep": 1}, {"fold_prep": 2, "state_walk": 1, "scan_gluon": 1}, {"smem_pad": 4}):
        off = Config(**over)
        on = off.replace(pdl=1)
        src_off = render.render(off)
        assert "gdc" not in src_off and "launch_pdl" not in src_off
        calls = first_calls(render.render(on))
        assert len(calls) >= 3 and "ssd_chunk_scan" in calls, (over, calls)
        for name, (deco, call) in calls.items():
            assert call == ("_gdc_enter_gl" if deco == "gluon" else "_gdc_enter"), (over, name, call)
        if on.scan_gluon:   # pdl = 2 adds the scan that waits later; it releases first
            calls2 = first_calls(render.render(on.replace(pdl=2)))
            assert calls2.pop("ssd_chunk_scan_gluon_early") == ("gluon", "_gdc_release_gl")
            assert calls2 == calls
        if on.state_walk:   # pdl = 3: the walk waits, takes its ticket, then releases
            calls3 = first_calls(render.render(on.replace(pdl=3)))
            assert calls3.pop("ssd_state_walk") == ("gluon", "_gdc_wait_gl")
            assert calls3.pop("ssd_chunk_scan_gluon_early") == ("gluon", "_gdc_release_gl")
            assert calls3 == {k: v for k, v in calls.items() if k != "ssd_state_walk"}
        assert all(o.get("launch_pdl") is True for o in render.launch_options(on, "cuda").values())
        assert not any("launch_pdl" in o for o in render.launch_options(off, "cuda").values())
    assert Config(launches=3, pdl=1) == Config(launches=3)   # never at the fused depths
    with pytest.raises(ValueError, match="pdl=1 is programmatic dependent launch.*'hip'"):
        render.render(Config(pdl=1), "hip")


def test_an_interpreter_switched_on_after_triton_was_imported_is_named(tmp_path):
    # Triton builds tl's helpers at import: TRITON_INTERPRET set later failed deep in Triton
    import os
    import subprocess
    import sys
    code = """
import os, torch, triton
os.environ["TRITON_INTERPRET"] = "1"
import autossd
from autossd.problem import Problem
from autossd.testing import call_kwargs, make_inputs
p = Problem(1, 64, 2, 16, 16, 1, "fp32", 64, has_D=True, dt_softplus=True)
t = make_inputs(p, seed=0)
try:
    autossd.mamba_chunk_scan_combined(t["x"], t["dt"], t["A"], t["B"], t["C"], 64, **call_kwargs(p, t))
except RuntimeError as e:
    print("ERROR:", e)
"""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["AUTOSSD_CACHE_DIR"] = str(tmp_path)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert "ERROR: autossd: TRITON_INTERPRET=1 was set after triton was imported" in out.stdout, out.stderr[-2000:]


def test_scan_gluon_2_renders_the_chunk_walking_kernel_beside_the_gluon_scans_helpers():
    """scan_gluon = 2 adds ssd_chunk_scan_gluon_chunk (one program per chunk and head), which
    stores y through the same lines as scan_gluon = 1's kernel (the _gs_store_y macro); 0 and 1
    render none of it."""
    import ast
    two = render.render(Config(scan_gluon=2))
    kernels = {fn.name for fn in ast.parse(two).body if isinstance(fn, ast.FunctionDef)}
    assert {"ssd_chunk_scan_gluon_chunk", "_gsc_issue", "_gsc_next", "_gsc_step", "ssd_chunk_scan_gluon"} <= kernels
    store = "y_ptrs = y_ptr + b.to(ttgl.int64) * s_y_b + h * s_y_h + tok[:, None] * s_y_l"
    assert two.count(store) == 2
    for v in (0, 1):
        assert "ssd_chunk_scan_gluon_chunk" not in render.render(Config(scan_gluon=v))
    assert "ssd_chunk_scan_gluon_chunk" not in render.render(Config(scan_gluon=2), "hip")


def test_scan_gluon_3_stores_y_by_tma_where_the_row_tile_is_whole():
    """scan_gluon = 3 renders the chunk-walking kernel with a y descriptor: a whole row tile's y
    goes out by TMA from the diagonal's ring stage, waited on before that stage is refilled; a
    ragged last row tile keeps the masked store (the rows past it are the next sequence's)."""
    import ast
    three = render.render(Config(scan_gluon=3))
    fns = {fn.name: fn for fn in ast.parse(three).body if isinstance(fn, ast.FunctionDef)}
    body = ast.get_source_segment(three, fns["ssd_chunk_scan_gluon_chunk"])
    assert [a.arg for a in fns["ssd_chunk_scan_gluon_chunk"].args.args][:6] == \
        ["C_desc", "st_desc", "cb_desc", "x_desc", "y_desc", "z_ptr"]
    tma_store = body.index("tma.async_copy_shared_to_global(y_desc")
    assert body.index("if whole:") < tma_store < body.index("tma.store_wait(0)") < body.rindex("_gsc_next(")
    assert "mask=mask)" in body[tma_store:]   # the ragged end's masked store
    assert "y_desc" not in render.render(Config(scan_gluon=2))


def test_an_unwritable_cache_dir_falls_back_to_a_temporary_one_and_says_so(tmp_path, monkeypatch, caplog):
    # a file where the cache directory should be: as unwritable as a read-only mount, for root too
    blocker = tmp_path / "ro"
    blocker.write_text("")
    monkeypatch.setenv("AUTOSSD_CACHE_DIR", str(blocker))
    monkeypatch.setattr(render, "_fallback_dir", None)
    src = render.render(Config(scan_warps=4))
    with caplog.at_level("WARNING", logger="autossd"):
        path = render.source_path(src)
        again = render.source_path(src)
    assert path == again and path.read_text() == src and not str(path).startswith(str(blocker))
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 1 and "AUTOSSD_CACHE_DIR" in said[0] and str(blocker) in said[0] and str(path.parent) in said[0]


def test_a_kernels_hash_is_of_its_text_without_comments():
    """Freshness hashes the rendered text less comments, trailing blanks and blank lines (not
    tokenize's token stream, whose kinds differ between Python versions, so a record's freshness
    would depend on the Python that reads it)."""
    src = "x = 1  # why\n\n# a whole-line comment\ny = '#not a comment'   \n    z = 2\n"
    assert render._code_tokens(src) == "x = 1\ny = '#not a comment'\n    z = 2"


def _comment_free_by_tokenize(source: str) -> str:
    """_code_tokens as Python's tokenizer would cut it: each COMMENT token removed."""
    import io
    import tokenize
    cut = {t.start[0] - 1: t.start[1] for t in tokenize.generate_tokens(io.StringIO(source).readline)
           if t.type == tokenize.COMMENT}
    lines = (ln[:cut[i]] if i in cut else ln for i, ln in enumerate(source.splitlines()))
    return "\n".join(ln.rstrip() for ln in lines if ln.rstrip())


@pytest.mark.parametrize("op", ["ssd_fwd", "ssd_bwd", "ssd_decode", "ssd_varlen"])
def test_comments_are_found_where_pythons_tokenizer_finds_them(op):
    """A record's freshness hashes the rendered code less its comments; the fast comment scan
    must cut exactly where tokenize does, on every op's rendered modules (every backend) and
    on strings that hold '#' or quotes, else stored records would turn stale."""
    from autossd.arch import get_arch
    from autossd.db import lookup
    tricky = ('x = "a # not a comment"  # a comment\n'
              "y = 'it''s # no'  # yes \"quoted\"\n"
              's = """doc # not\n# still the string\n"""  # after\n'
              "t = f'{a!r}#' + r'\\'#' + '\\\\'  # end\n"
              "u = '''a\n'# in'\n'''\n"
              "# alone\n    \n")
    assert render._code_tokens(tricky) == _comment_free_by_tokenize(tricky)
    checked = 0
    for arch in ("sm90", "gfx942"):   # the shipped records' configs, one rendering each
        configs = {r.config for r in lookup.load_records(arch, op, None)}
        for cfg in sorted(configs, key=lambda c: c.key())[:12]:
            source = render.render(cfg, get_arch(arch).backend)
            assert "#" in source
            assert render._code_tokens(source) == _comment_free_by_tokenize(source)
            checked += 1
    assert checked > 0
