"""The JAX integration (moe_aot.integrations.jax) on a CPU machine: the handler compiles against
jaxlib's headers and calls no CUDA API; fused_moe's refusals, abstract shapes and its lowering
for CUDA; and the handler itself run inside XLA:CPU on a real small layer's metadata, with
stand-in kernel libraries of the same ABI that record what they were launched with."""
from __future__ import annotations

import ctypes
import json
import shutil
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

jax = pytest.importorskip("jax")
jnp = jax.numpy
np = pytest.importorskip("numpy")

import moe_aot.integrations.jax as mj  # noqa: E402
from moe_aot.runtime.library import KernelArgumentError  # noqa: E402

E, K, H, I = 8, 2, 256, 128


def _args(M, E=E, K=K, H=H, I=I):
    bf = jnp.bfloat16
    return (jax.ShapeDtypeStruct((M, H), bf), jax.ShapeDtypeStruct((E, 2 * I, H), bf),
            jax.ShapeDtypeStruct((E, H, I), bf), jax.ShapeDtypeStruct((M, K), jnp.float32),
            jax.ShapeDtypeStruct((M, K), jnp.int32))


def test_the_rest_of_the_package_does_not_import_jax():
    code = ("import sys, moe_aot.integrations, moe_aot.runtime.layer, moe_aot.runtime.launch\n"
            "sys.exit(1 if any(m.split('.')[0] in ('jax', 'jaxlib') for m in sys.modules) else 0)")
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


def test_shim_compiles_against_jaxlib_headers_and_calls_no_cuda(tmp_path):
    if shutil.which("cc") is None and shutil.which("gcc") is None:
        pytest.skip("no C compiler")
    path = mj.build_shim(unpack_dir=tmp_path)
    assert path.parent == tmp_path and path.name.startswith("libmoe_aot_jax_")
    assert mj.build_shim(unpack_dir=tmp_path) == path  # cached by source and header hash
    lib = ctypes.CDLL(str(path))
    lib.moe_aot_jax_plan_size.restype = ctypes.c_size_t
    assert lib.moe_aot_jax_plan_size() == ctypes.sizeof(mj._CPlan)  # the ctypes mirror matches the C layout
    if shutil.which("nm"):
        undefined = subprocess.run(["nm", "-D", "--undefined-only", str(path)], capture_output=True, text=True,
                                   check=True).stdout
        names = {line.split()[-1].split("@")[0] for line in undefined.splitlines() if line.strip()}
        # no CUDA runtime or driver call (so no sync, no allocation): only libc and the table's mutex
        assert not [n for n in names if n.startswith(("cu", "cuda"))], names
        assert names - {"_ITM_deregisterTMCloneTable", "_ITM_registerTMCloneTable", "__cxa_finalize",
                        "__gmon_start__", "__stack_chk_fail"} <= {"memcpy", "pthread_mutex_lock",
                                                                  "pthread_mutex_unlock", "vsnprintf"}, names


def test_refusals_name_the_input_and_what_is_allowed():
    M = 4
    x, w13, w2, tw, ids = _args(M)
    bf = jnp.bfloat16
    bad = [((jax.ShapeDtypeStruct((M, H), jnp.float32), w13, w2, tw, ids), {}, "x must be bfloat16, got float32"),
           (([[0.0]], w13, w2, tw, ids), {}, "x must be an array"),
           ((jax.ShapeDtypeStruct((M, H, 1), bf), w13, w2, tw, ids), {}, "x must be a 2-D array"),
           ((x, jax.ShapeDtypeStruct((E, 2 * I, H + 16), bf), w2, tw, ids), {}, "w13 must have shape"),
           ((x, jax.ShapeDtypeStruct((E, 2 * I - 16, H), bf), w2, tw, ids), {}, "multiple of 16"),
           ((x, w13, jax.ShapeDtypeStruct((E, I, H), bf), tw, ids), {}, "w2 must have shape"),
           ((x, w13, w2, jax.ShapeDtypeStruct((M, K), jnp.bfloat16), ids), {}, "topk_weights must be float32"),
           ((x, w13, w2, tw, jax.ShapeDtypeStruct((M, K), jnp.int64 if jax.config.x64_enabled else jnp.int16)), {},
            "topk_ids must be int32"),
           ((x, w13, w2, tw, jax.ShapeDtypeStruct((M + 1, K), jnp.int32)), {}, "must both have shape"),
           ((x, w13, w2, tw, ids), {"activation": "relu"}, "activation must be one of"),
           ((x, w13, w2, tw, ids), {"b13": jax.ShapeDtypeStruct((E, 2 * I), bf)},
            "expert biases come in pairs: give both b13"),
           ((x, w13, w2, tw, ids), {"b13": jax.ShapeDtypeStruct((E, I), bf), "b2": jax.ShapeDtypeStruct((E, H), bf)},
            rf"b13 must have shape \({E}, {2 * I}\)"),
           ((x, w13, w2, tw, ids), {"out": jax.ShapeDtypeStruct((M, H + 1), bf)}, "out must have shape")]
    for args, kw, msg in bad:
        with pytest.raises(KernelArgumentError, match=msg):
            mj.check_inputs(*args, **kw)
        with pytest.raises(KernelArgumentError, match=msg):  # refused at trace time, before any kernel is loaded
            jax.eval_shape(lambda *a, kw=kw: mj.fused_moe(*a, **kw), *args)


def test_zero_tokens_need_no_kernels():
    out = jax.jit(mj.fused_moe)(*(jnp.zeros(a.shape, a.dtype) for a in _args(0)))
    assert out.shape == (0, H) and out.dtype == jnp.bfloat16


def test_no_gpu_is_refused_with_a_sentence():
    with pytest.raises(KernelArgumentError, match="runs on an NVIDIA GPU"):
        mj._device_facts(jax.devices("cpu")[0])


def test_jnp_reference_and_interleave_agree_with_the_torch_ones():
    torch = pytest.importorskip("torch")
    from moe_aot.harness.reference import moe_reference
    from moe_aot.layout import interleave_gate_up

    g = torch.Generator().manual_seed(0)
    M, E_, K_, H_, I_ = 5, 4, 2, 32, 32
    wg, wu = torch.randn(E_, I_, H_, generator=g), torch.randn(E_, I_, H_, generator=g)
    w13 = interleave_gate_up(wg, wu).bfloat16()
    assert np.array_equal(np.asarray(mj.interleave_gate_up(jnp.asarray(wg.numpy()), jnp.asarray(wu.numpy()))),
                          interleave_gate_up(wg, wu).numpy())
    w2 = torch.randn(E_, H_, I_, generator=g).bfloat16()
    x = torch.randn(M, H_, generator=g).bfloat16()
    tw = torch.rand(M, K_, generator=g)
    ids = torch.tensor([[0, 3], [1, -1], [2, 2], [E_, 1], [3, 0]], dtype=torch.int32)  # invalid ids dropped
    ref = moe_reference(x, w13, w2, tw, ids).numpy()

    def j(t):
        return jnp.asarray(t.float().numpy()).astype(jnp.bfloat16) if t.dtype == torch.bfloat16 else jnp.asarray(
            t.numpy())

    got = np.asarray(mj.moe_reference(j(x), j(w13), j(w2), j(tw), j(ids)))
    assert np.allclose(got, ref, rtol=1e-4, atol=1e-4)


# -- a real small layer's kernels, with stand-in libraries that record their launches -------------
_RECORDING_C = r"""
#include <string.h>
#include <time.h>
void *seen[18]; unsigned char structs[16][64]; long calls, last_ns; int fail, fill_arg; long fill_bytes;
void {init}(void **a) {{ *(int *)a[1] = 0; }}
void {load}(void **a) {{ *(int *)a[2] = 0; }}
void {run}(void **a) {{
    struct timespec ts;
    for (int i = 0; i <= {nt}; i++) seen[i] = *(void **)a[i];  /* each struct's data pointer, then the stream */
    for (int i = 0; i < {nt}; i++) memcpy(structs[i], a[i], 64);
    if (fill_bytes) memset(*(void **)a[fill_arg], 0x3f, fill_bytes);
    clock_gettime(CLOCK_MONOTONIC, &ts);
    last_ns = ts.tv_sec * 1000000000L + ts.tv_nsec;
    calls++;
    if (fail) *(int *)a[{nt} + 1] = fail;
}}
"""


@pytest.fixture(scope="module")
def small_db(tmp_path_factory):
    pytest.importorskip("cutlass")
    from moe_aot.compiler import compile_into
    from moe_aot.database import Database
    from moe_aot.spec import make_spec
    from moe_aot.variants import default_variant

    url = f"sqlite:///{tmp_path_factory.mktemp('jaxrt') / 'k.sqlite'}"
    spec = make_spec(experts=E, top_k=K, hidden=H, intermediate=I, target="sm_90a")
    with Database(url) as db:
        compile_into(db, [(spec, default_variant(spec, 16))], jobs=1)
    return url, spec


def _stub_db(url, spec, tmp_path, edit_meta=None):
    """A copy of the database whose libraries are recording stand-ins (same names, same metadata
    but for edit_meta(role, meta)), and {role: kernel name}."""
    from moe_aot.dbread import pack, sha
    from moe_aot.variants import default_variant

    if shutil.which("gcc") is None:
        pytest.skip("needs gcc to build the stand-in libraries")
    path = tmp_path / "rec.sqlite"
    path.write_bytes(Path(url[len("sqlite:///"):]).read_bytes())
    con = sqlite3.connect(path)
    names = {}
    for kv in default_variant(spec, 16).kernels(spec):
        [(tc, meta)] = con.execute("SELECT toolchain, meta FROM moe_aot_artifacts WHERE name = ?",
                                   (kv.name,)).fetchall()
        meta = json.loads(meta)
        if edit_meta:
            edit_meta(kv.role, meta)
        abi, nt = meta["host_abi"], sum(a["kind"] == "tensor" for a in meta["args"])
        c, so = tmp_path / f"{kv.role}.c", tmp_path / f"{kv.role}.so"
        c.write_text(_RECORDING_C.format(init=abi["init"], load=abi["load_to_device"], run=abi["run"], nt=nt))
        subprocess.run(["gcc", "-O1", "-shared", "-fPIC", "-o", str(so), str(c)], check=True)
        lib = so.read_bytes()
        meta["sha256"]["library"] = sha(lib)
        con.execute("UPDATE moe_aot_artifacts SET library = ?, sha256 = ?, meta = ? WHERE name = ? AND toolchain = ?",
                    (pack(lib), sha(lib), json.dumps(meta), kv.name, tc))
        names[kv.role] = kv.name
    con.commit()
    con.close()
    return f"sqlite:///{path}", names


@pytest.fixture
def host_jax(monkeypatch, tmp_path):
    """fused_moe bound to the CPU: the stream-less twin of the handler registered for XLA:CPU, the
    device's facts those of an H200, the plan caches empty."""
    monkeypatch.setattr(mj, "_device_facts", lambda device: (0, "sm_90a", "NVIDIA H200"))
    monkeypatch.setattr(mj, "_target", lambda: mj.HOST_TARGET)
    monkeypatch.setattr(mj, "_PLANS", {})
    monkeypatch.setattr(mj, "_LAYERS", {})
    mj.register("cpu")


def _libs(db):
    [layer] = [la for (d, *_), la in mj._LAYERS.items() if d == db]
    return layer


def _arrays(M, seed=0):
    rng = np.random.default_rng(seed)
    bf = jnp.bfloat16
    x = jnp.asarray(rng.standard_normal((M, H)), bf)
    w13 = jnp.asarray(rng.standard_normal((E, 2 * I, H)), bf)
    w2 = jnp.asarray(rng.standard_normal((E, H, I)), bf)
    tw = jnp.asarray(rng.random((M, K)), jnp.float32)
    ids = jnp.asarray(rng.integers(0, E, (M, K)), jnp.int32)
    return x, w13, w2, tw, ids


def _kernel_libs(db):
    """{role: KernelLibrary} of the layer traced on `db`, the stand-ins' switches reset (a
    library of the same bytes is the same loaded file across tests)."""
    by_role = {name.split("_")[1]: lib for name, lib in _libs(db)._libs.items()}
    for lib in by_role.values():
        ctypes.c_long.in_dll(lib._lib, "fill_bytes").value = 0
        ctypes.c_int.in_dll(lib._lib, "fail").value = 0
    return by_role


def _seen(lib, n):
    return list((ctypes.c_void_p * 18).in_dll(lib._lib, "seen"))[:n]


def _names(lib):
    return [a["name"] for a in lib.meta["args"] if a["kind"] == "tensor"]


def _ptrs(lib):
    """{argument name: data pointer it was launched with}, and the stream."""
    names = _names(lib)
    seen = _seen(lib, len(names) + 1)
    return dict(zip(names, seen)), seen[-1]


def test_lowering_for_cuda_names_the_target_and_the_plan(small_db, host_jax, tmp_path, monkeypatch):
    db, _ = _stub_db(*small_db, tmp_path)
    monkeypatch.setattr(mj, "_target", lambda: mj.TARGET)
    f = jax.jit(lambda *a: mj.fused_moe(*a, db=db))
    lowered = f.trace(*_args(16)).lower(lowering_platforms=("cuda",))
    text = lowered.as_text()
    [plan] = mj._PLANS.values()
    assert f"stablehlo.custom_call @{mj.TARGET}" in text
    assert f"key = {plan.key} : i64" in text
    R, T = plan.results["sorted_ids"][0][0], plan.results["tile_expert"][0][0]
    # out, then the workspace as XLA-allocated results (dropped after the call)
    for shape in (f"tensor<16x{H}xbf16>", f"tensor<{E}xi32>", f"tensor<{E + 1}xi32>", f"tensor<{R}xi32>",
                  f"tensor<{T}xi32>", f"tensor<{R}x{I}xbf16>", f"tensor<{16 * K}x{H}xbf16>"):
        assert shape in text, shape
    assert list(plan.results) == ["out", "expert_counts", "expert_offsets", "sorted_ids", "tile_expert", "h", "y"]
    assert jax.eval_shape(f, *_args(16)) == jax.ShapeDtypeStruct((16, H), jnp.bfloat16)
    # the key is content, not an address: the same trace in a fresh plan cache gives the same HLO
    monkeypatch.setattr(mj, "_PLANS", {})
    assert f.trace(*_args(16)).lower(lowering_platforms=("cuda",)).as_text() == text
    # another token count of the same bucket: another plan, another key
    text5 = jax.jit(lambda *a: mj.fused_moe(*a, db=db)).trace(*_args(5)).lower(lowering_platforms=("cuda",)).as_text()
    assert f"key = {plan.key} : i64" not in text5


def test_handler_runs_in_xla_and_launches_with_xlas_buffers(small_db, host_jax, tmp_path):
    db, names = _stub_db(*small_db, tmp_path)
    M = 16
    x, w13, w2, tw, ids = _arrays(M)
    f = jax.jit(lambda *a: mj.fused_moe(*a, db=db))
    jax.eval_shape(f, x, w13, w2, tw, ids)  # traces: loads the stand-ins
    libs = _kernel_libs(db)
    comb = libs["combine"]
    # the combine stand-in fills `out` with bytes 0x3f: what the caller gets is what it wrote
    ctypes.c_int.in_dll(comb._lib, "fill_arg").value = _names(comb).index("out")
    ctypes.c_long.in_dll(comb._lib, "fill_bytes").value = M * H * 2
    before = {r: ctypes.c_long.in_dll(lib._lib, "calls").value for r, lib in libs.items()}
    for _ in range(2):  # compiled once, run twice
        out = np.asarray(jax.block_until_ready(f(x, w13, w2, tw, ids)).astype(jnp.float32))
        assert out.shape == (M, H) and np.all(out == np.float32(jnp.asarray(0x3F3F, jnp.uint16).view(jnp.bfloat16)))
    glu = libs["glu"]
    calls = {r: ctypes.c_long.in_dll(lib._lib, "calls").value - before[r] for r, lib in libs.items()}
    assert calls == {"route": 2, "glu": 2, "down": 2, "combine": 2}
    order = [ctypes.c_long.in_dll(libs[r]._lib, "last_ns").value for r in ("route", "glu", "down", "combine")]
    assert order == sorted(order)  # routing -> GEMM1 -> GEMM2 -> combine
    p = {r: _ptrs(lib) for r, lib in libs.items()}
    assert all(stream is None for _, stream in p.values())  # the host twin passes no stream
    # each workspace buffer is one XLA buffer shared by the kernels that name it, inputs likewise
    assert p["route"][0]["sorted_ids"] == p["glu"][0]["sorted_ids"] == p["down"][0]["sorted_ids"]
    assert p["route"][0]["tile_expert"] == p["glu"][0]["tile_expert"] == p["down"][0]["tile_expert"]
    assert p["glu"][0]["h"] == p["down"][0]["h"] and p["down"][0]["y"] == p["combine"][0]["y"]
    assert p["route"][0]["topk_ids"] == p["combine"][0]["topk_ids"]
    every = [v for d, _ in p.values() for v in d.values()]
    assert None not in every and len(set(every)) == len({n for d, _ in p.values() for n in d})
    # the dynamic sizes in the structs are the plan's (x: M rows)
    structs = (ctypes.c_ubyte * (16 * 64)).in_dll(glu._lib, "structs")
    gx = bytes(structs[64 * _names(glu).index("x"): 64 * _names(glu).index("x") + 64])
    arg = next(a for a in glu.meta["args"] if a["name"] == "x")
    if arg["dynamic_shape_modes"] == [0]:
        ct = ctypes.c_int32 if arg["shape_c_type"] == "int32" else ctypes.c_int64
        assert ct.from_buffer_copy(gx, 8).value == M


def test_kernel_arguments_are_matched_by_name_not_position(small_db, host_jax, tmp_path):
    def reverse_down(role, meta):
        if role == "down":
            tensors = [a for a in meta["args"] if a["kind"] == "tensor"]
            meta["args"] = tensors[::-1] + [a for a in meta["args"] if a["kind"] != "tensor"]

    db, _ = _stub_db(*small_db, tmp_path, reverse_down)
    f = jax.jit(lambda *a: mj.fused_moe(*a, db=db))
    jax.block_until_ready(f(*_arrays(16)))
    libs = _kernel_libs(db)
    assert _names(libs["down"])[0] == "y"
    p = {r: _ptrs(lib)[0] for r, lib in libs.items()}
    assert p["down"]["sorted_ids"] == p["route"]["sorted_ids"] and p["down"]["h"] == p["glu"]["h"]
    assert p["down"]["y"] == p["combine"]["y"]


def test_an_argument_the_jax_path_cannot_provide_is_refused_at_trace_time(small_db, host_jax, tmp_path):
    def add_arg(role, meta):
        if role == "glu":
            extra = dict(next(a for a in meta["args"] if a["name"] == "tile_expert"), name="scratch")
            meta["args"].insert(-1, extra)

    db, _ = _stub_db(*small_db, tmp_path, add_arg)
    with pytest.raises(KernelArgumentError, match="kernel argument 'scratch' .* none the JAX path provides"):
        jax.eval_shape(lambda *a: mj.fused_moe(*a, db=db), *_args(16))


def test_handler_errors_reach_the_caller(small_db, host_jax, tmp_path):
    db, names = _stub_db(*small_db, tmp_path)
    args = _arrays(16)
    f = jax.jit(lambda *a: mj.fused_moe(*a, db=db))
    jax.block_until_ready(f(*args))
    libs = _kernel_libs(db)
    ctypes.c_int.in_dll(libs["down"]._lib, "fail").value = 7
    before = ctypes.c_long.in_dll(libs["combine"]._lib, "calls").value
    with pytest.raises(Exception, match=f"{names['down']}: launch failed \\(cudaError 7\\)"):
        jax.block_until_ready(f(*args))
    assert ctypes.c_long.in_dll(libs["combine"]._lib, "calls").value == before  # stopped at the failing kernel
    ctypes.c_int.in_dll(libs["down"]._lib, "fail").value = 0
    [plan] = mj._PLANS.values()
    results = [jax.ShapeDtypeStruct(s, d) for s, d in plan.results.values()]
    # an executable from another process: its key is not in this process's table
    stale = jax.ffi.ffi_call(mj.HOST_TARGET, results)
    with pytest.raises(Exception, match="no plan with key 12345 in this process"):
        jax.block_until_ready(jax.jit(lambda *a: stale(*a, key=np.int64(12345)))(*args))
    # buffers that are not the plan's are refused before any launch
    calls = ctypes.c_long.in_dll(libs["route"]._lib, "calls").value
    wrong = jax.ffi.ffi_call(mj.HOST_TARGET, [jax.ShapeDtypeStruct((17, H), jnp.bfloat16)] + results[1:])
    with pytest.raises(Exception, match="buffer 'out' does not have the dtype and shape"):
        jax.block_until_ready(jax.jit(lambda *a: wrong(*a, key=np.int64(plan.key)))(*args))
    assert ctypes.c_long.in_dll(libs["route"]._lib, "calls").value == calls


def test_out_is_aliased_to_the_result(small_db, host_jax, tmp_path):
    db, _ = _stub_db(*small_db, tmp_path)
    args = _arrays(16)
    out = jnp.full((16, H), jnp.nan, jnp.bfloat16)
    f = jax.jit(lambda o, *a: mj.fused_moe(*a, out=o, db=db))
    text = f.trace(out, *args).lower().as_text()
    assert "output_operand_aliases" in text
    _kernel_libs(db)  # the stand-ins write nothing: the caller's (NaN) contents must come through
    got = np.asarray(jax.block_until_ready(f(out, *args)).astype(jnp.float32))
    assert got.shape == (16, H) and np.isnan(got).all()


def test_readme_example_runs_up_to_the_gpu():
    import re

    text = (Path(__file__).parent.parent / "README.md").read_text()
    m = re.search(r"<!-- example: level3 \(GPU\) -->\n```python\n(.*?)```", text, re.S)
    assert m, "README has no level 3 example"
    with pytest.raises(KernelArgumentError, match="fused_moe runs on an NVIDIA GPU"):
        exec(compile(m.group(1), "README:level3", "exec"), {})
