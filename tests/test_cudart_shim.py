"""The CUDA runtime shim (moe_aot/cudart_shim.c) on the CPU: every cuda* function it implements
makes the driver call it should with the arguments it should, against a recording stand-in
libcuda.so.1 (tests/cuda_standin.py, a test double: no GPU involved); a real kernel library links
it and nothing of cudart, needs only libc and libcuda.so.1, and its DSL-generated init, load and
launch reach the driver as expected (kernel name, shared memory, PDL and cluster attributes)."""
import json
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import cuda_standin
import pytest

from moe_aot.kernel_build import CUDART_SHIM

pytestmark = pytest.mark.skipif(shutil.which("gcc") is None, reason="needs gcc")
ROOT = Path(__file__).resolve().parents[1]
LIBC_FAMILY = re.compile(r"(libc|libdl|libpthread|librt|libm)\.so\.\d+|ld-linux[-\w.]*\.so\.\d+")

# (call on the shim `S`, regexes the stand-in's log must contain, in order)
CASES = [
    ("S.cudaFree(None)", [r"^cuGetProcAddress_v2 cuInit 13000 0$", r"^cuInit 0$",
                          r"^cuDeviceGet 0x\w+ 0$", r"^cuDevicePrimaryCtxRetain 0x\w+ 7$",
                          r"^cuCtxSetCurrent 0x1\w\w\w$"]),
    ("S.cudaMalloc(byref(P), c_size_t(256))", [r"^cuMemAlloc 0x\w+ 256$"]),
    ("S.cudaFree(c_void_p(0xabc0))", [r"^cuMemFree 0xabc0$"]),
    ("S.cudaMallocAsync(byref(P), c_size_t(64), c_void_p(0x51))", [r"^cuMemAllocAsync 0x\w+ 64 0x51$"]),
    ("S.cudaFreeAsync(c_void_p(0xabc0), c_void_p(0x51))", [r"^cuMemFreeAsync 0xabc0 0x51$"]),
    ("S.cudaMallocHost(byref(P), c_size_t(32))", [r"^cuMemAllocHost 0x\w+ 32$"]),
    ("S.cudaFreeHost(c_void_p(0xabc0))", [r"^cuMemFreeHost 0xabc0$"]),
    ("S.cudaMallocManaged(byref(P), c_size_t(16), 1)", [r"^cuMemAllocManaged 0x\w+ 16 1$"]),
    ("S.cudaMemcpy(c_void_p(0xd0), c_void_p(0x50), c_size_t(8), 1)", [r"^cuMemcpy 0xd0 0x50 8$"]),
    ("S.cudaMemcpyAsync(c_void_p(0xd0), c_void_p(0x50), c_size_t(8), 2, c_void_p(0x51))",
     [r"^cuMemcpyAsync 0xd0 0x50 8 0x51$"]),
    ("S.cudaMemset(c_void_p(0xd0), 0x1ff, c_size_t(4))", [r"^cuMemsetD8 0xd0 255 4$"]),
    ("S.cudaMemsetAsync(c_void_p(0xd0), 3, c_size_t(4), c_void_p(0x51))", [r"^cuMemsetD8Async 0xd0 3 4 0x51$"]),
    ("S.cudaStreamCreate(byref(P))", [r"^cuStreamCreate 0x\w+ 0$"]),
    ("S.cudaStreamDestroy(c_void_p(0x51))", [r"^cuStreamDestroy 0x51$"]),
    ("S.cudaStreamSynchronize(c_void_p(0x51))", [r"^cuStreamSynchronize 0x51$"]),
    ("S.cudaStreamWaitEvent(c_void_p(0x51), c_void_p(0xe1), 0)", [r"^cuStreamWaitEvent 0x51 0xe1 0$"]),
    ("S.cudaStreamAddCallback(c_void_p(0x51), c_void_p(0xcb), c_void_p(0xda), 0)",
     [r"^cuStreamAddCallback 0x51 0xcb 0xda 0$"]),
    ("S.cudaStreamBeginCapture(c_void_p(0x51), 2)", [r"^cuStreamBeginCapture 0x51 2$"]),
    ("S.cudaStreamEndCapture(c_void_p(0x51), byref(P))", [r"^cuStreamEndCapture 0x51 0x\w+$"]),
    ("S.cudaEventCreate(byref(P))", [r"^cuEventCreate 0x\w+ 0$"]),
    ("S.cudaEventDestroy(c_void_p(0xe1))", [r"^cuEventDestroy 0xe1$"]),
    ("S.cudaEventRecord(c_void_p(0xe1), c_void_p(0x51))", [r"^cuEventRecord 0xe1 0x51$"]),
    ("S.cudaEventElapsedTime(byref(F), c_void_p(0xe1), c_void_p(0xe2))", [r"^cuEventElapsedTime 0x\w+ 0xe1 0xe2$"]),
    ("S.cudaGraphInstantiate(byref(P), c_void_p(0x61), c_ulonglong(1))",
     [r"^cuGraphInstantiateWithFlags 0x\w+ 0x61 1$"]),
    ("S.cudaGraphLaunch(c_void_p(0x62), c_void_p(0x51))", [r"^cuGraphLaunch 0x62 0x51$"]),
    ("S.cudaGraphDestroy(c_void_p(0x61))", [r"^cuGraphDestroy 0x61$"]),
    ("S.cudaGraphExecDestroy(c_void_p(0x62))", [r"^cuGraphExecDestroy 0x62$"]),
    ("S.cudaProfilerStart()", [r"^cuProfilerStart$"]),
    ("S.cudaProfilerStop()", [r"^cuProfilerStop$"]),
    ("S.cudaDeviceSynchronize()", [r"^cuCtxSynchronize$"]),
    ("S.cudaGetDeviceCount(byref(I))", [r"^cuDeviceGetCount 0x\w+$"]),
    ("S.cudaGetDevice(byref(I))", [r"^cuCtxGetDevice 0x\w+$"]),
    ("S.cudaDriverGetVersion(byref(I))", [r"^cuDriverGetVersion 0x\w+$"]),
    ("S.cudaDeviceGetAttribute(byref(I), 97, 1)", [r"^cuDeviceGet 0x\w+ 1$", r"^cuDeviceGetAttribute 97 7$"]),
    ("S.cudaKernelSetAttributeForDevice(c_void_p(0x4e), 8, 200000, 1)",
     [r"^cuDeviceGet 0x\w+ 1$", r"^cuKernelSetAttribute 8 200000 0x4e 7$"]),
    ("S.cudaFuncSetAttribute(c_void_p(0x4e), 14, 1)",
     [r"^cuCtxGetDevice", r"^cuDeviceGet 0x\w+ 7$", r"^cuKernelSetAttribute 14 1 0x4e 7$"]),
    ("S.cudaOccupancyMaxActiveBlocksPerMultiprocessor(byref(I), c_void_p(0x4e), 128, c_size_t(1024))",
     [r"^cuKernelGetFunction 0x\w+ 0x4e$", r"^cuOccupancyMaxActiveBlocksPerMultiprocessor 0x\w+ 0x1\w+ 128 1024$"]),
    ("S.cudaLibraryLoadData(byref(P), c_char_p(b'\\x50\\xed\\x55\\xbaFATBIN'), None, None, 0, None, None, 0)",
     [r"^cuLibraryLoadData 0xba55ed50 \(nil\) \(nil\) 0 \(nil\) \(nil\) 0$"]),
    ("S.cudaLibraryLoadFromFile(byref(P), c_char_p(b'/k.cubin'), None, None, 0, None, None, 0)",
     [r"^cuLibraryLoadFromFile 0x\w+ 0x\w+ \(nil\) \(nil\) 0 \(nil\) \(nil\) 0$"]),
    ("S.cudaLibraryUnload(c_void_p(0x1b))", [r"^cuLibraryUnload 0x1b$"]),
    ("S.cudaLibraryGetKernel(byref(P), c_void_p(0x1b), c_char_p(b'kernel_x'))",
     [r"^cuLibraryGetKernel 0x1b kernel_x$"]),
    ("S.cudaLibraryGetKernelCount(byref(I), c_void_p(0x1b))", [r"^cuLibraryGetKernelCount 0x\w+ 0x1b$"]),
    ("S.cudaLibraryGetGlobal(byref(P), byref(P2), c_void_p(0x1b), c_char_p(b'g'))",
     [r"^cuLibraryGetGlobal 0x\w+ 0x\w+ 0x1b 0x\w+$"]),
    ("S.cudaLibraryGetManaged(byref(P), byref(P2), c_void_p(0x1b), c_char_p(b'g'))",
     [r"^cuLibraryGetManaged 0x\w+ 0x\w+ 0x1b 0x\w+$"]),
    ("S.cudaLibraryGetUnifiedFunction(byref(P), c_void_p(0x1b), c_char_p(b'f'))",
     [r"^cuLibraryGetUnifiedFunction 0x\w+ 0x1b 0x\w+$"]),
    ("S.cudaGetDriverEntryPointByVersion(c_char_p(b'cuKernelGetAttribute'), byref(P), 12080, c_ulonglong(0), "
     "byref(I))", [r"^cuGetProcAddress_v2 cuKernelGetAttribute 12080 0$"]),
    ("launch(S)", [r"^cuLaunchKernelEx grid=3,2,1 block=384,1,1 smem=200704 stream=0x51 f=0x4e args=0xa7 "
                   r"extra=\(nil\) n=2 attr6=1,0,0 attr4=2,1,1$"]),
]

SCRIPT = r"""
import ctypes, json, sys
from ctypes import byref, c_char_p, c_size_t, c_ulonglong, c_void_p
standin = ctypes.CDLL(sys.argv[1], mode=ctypes.RTLD_GLOBAL)
standin.standin_log.restype = ctypes.c_char_p
S = ctypes.CDLL(sys.argv[2])
P, P2, I, F = c_void_p(0), c_void_p(0), ctypes.c_int(0), ctypes.c_float(0)
class Attr(ctypes.Structure):
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_int), ("v", ctypes.c_uint * 16)]
class Config(ctypes.Structure):
    _fields_ = [("grid", ctypes.c_uint * 3), ("block", ctypes.c_uint * 3), ("smem", c_size_t),
                ("stream", c_void_p), ("attrs", ctypes.POINTER(Attr)), ("n", ctypes.c_uint)]
def launch(S):
    attrs = (Attr * 2)()
    attrs[0].id, attrs[0].v[0] = 6, 1
    attrs[1].id, attrs[1].v[0], attrs[1].v[1], attrs[1].v[2] = 4, 2, 1, 1
    cfg = Config((3, 2, 1), (384, 1, 1), 200704, 0x51, attrs, 2)
    return S.cudaLaunchKernelExC(byref(cfg), c_void_p(0x4e), c_void_p(0xa7))
out = []
for call in json.loads(sys.argv[3]):
    standin.standin_reset()
    ret = eval(call)
    out.append([ret, standin.standin_log().decode()])
# errors: a failing driver call is the thread's last error, cleared once read; names from the driver
ctypes.c_int.in_dll(standin, "standin_fail").value = 1
standin.standin_reset()
ret = S.cudaLibraryGetKernel(byref(P), c_void_p(0x1b), c_char_p(b"k"))
S.cudaGetErrorName.restype = S.cudaGetErrorString.restype = c_char_p
errors = {"ret": ret, "last": S.cudaGetLastError(), "again": S.cudaGetLastError(),
          "name": S.cudaGetErrorName(1).decode(), "string": S.cudaGetErrorString(1).decode(),
          "name35": S.cudaGetErrorName(35).decode(), "name0": S.cudaGetErrorName(0).decode(),
          "unknown": S.cudaGetErrorString(12345).decode()}
print(json.dumps({"calls": out, "errors": errors}))
"""


@pytest.fixture(scope="module")
def standin(tmp_path_factory):
    return cuda_standin.build(tmp_path_factory.mktemp("standin"))


def test_each_shim_function_makes_its_driver_call(standin, tmp_path):
    shim = tmp_path / "libshim.so"
    subprocess.run(["gcc", "-shared", "-fPIC", "-O2", "-Wall", "-Werror", "-o", str(shim), str(CUDART_SHIM)],
                   check=True)
    res = subprocess.run([sys.executable, "-c", SCRIPT, str(standin), str(shim), json.dumps([c for c, _ in CASES])],
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    got = json.loads(res.stdout)
    for (call, patterns), (ret, log) in zip(CASES, got["calls"]):
        assert ret == 0, (call, ret, log)
        lines = [ln for ln in log.splitlines() if not ln.startswith("cuGetProcAddress_v2") or "cuInit" in ln
                 or "KernelGetAttribute" in ln]
        at = 0
        for pat in patterns:
            hit = next((i for i in range(at, len(lines)) if re.search(pat, lines[i])), None)
            assert hit is not None, f"{call}: no {pat!r} in {lines}"
            at = hit + 1
    # driver functions are resolved once, by their CUDA 13.0 names
    first = got["calls"][0][1]
    assert "cuGetProcAddress_v2 cuDevicePrimaryCtxRetain 13000 0" in first
    assert got["calls"][1][1].count("cuGetProcAddress_v2") == 1  # cudaMalloc: cuMemAlloc only
    assert "cuGetProcAddress_v2" not in got["calls"][2][1]  # cudaFree again: everything known
    assert got["errors"] == {"ret": 1, "last": 1, "again": 0, "name": "CUDA_ERROR_INVALID_VALUE",
                             "string": "invalid argument", "name35": "cudaErrorInsufficientDriver",
                             "name0": "cudaSuccess", "unknown": "unrecognized error code"}


def test_without_a_driver_calls_fail_with_insufficient_driver(tmp_path):
    shim = tmp_path / "libshim.so"
    subprocess.run(["gcc", "-shared", "-fPIC", "-o", str(shim), str(CUDART_SHIM)], check=True)
    code = textwrap.dedent(f"""
        import ctypes
        S = ctypes.CDLL({str(shim)!r})
        v = ctypes.c_int(-1)
        S.cudaGetErrorString.restype = ctypes.c_char_p
        print(S.cudaMalloc(ctypes.byref(ctypes.c_void_p()), 16), S.cudaGetLastError(), S.cudaDriverGetVersion(
            ctypes.byref(v)), v.value, S.cudaGetErrorString(35).decode())
    """)
    env = {"LD_LIBRARY_PATH": str(tmp_path), "PATH": "/usr/bin:/bin"}
    probe = subprocess.run([sys.executable, "-c", "import ctypes; ctypes.CDLL('libcuda.so.1')"], env=env,
                           capture_output=True)
    if probe.returncode == 0:
        pytest.skip("this machine has a CUDA driver")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    assert out.split(" ", 4) == ["35", "35", "0", "0",
                                 "no CUDA driver (libcuda.so.1) could be loaded and initialised\n"]


def _needed(lib: Path) -> list[str]:
    out = subprocess.run(["readelf", "-d", str(lib)], capture_output=True, text=True, check=True).stdout
    return re.findall(r"\(NEEDED\)\s+Shared library: \[([^\]]+)\]", out)


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    """Two real kernels of the tiny layer: GEMM1 in 2-CTA clusters with PDL, and the combine."""
    pytest.importorskip("cutlass")
    from moe_aot.compiler import build_template
    from moe_aot.kernel_build import compile_kernel
    from moe_aot.spec import make_spec
    from moe_aot.variants import GemmTiles, LayerVariant, can_implement

    spec = make_spec(experts=8, top_k=2, hidden=256, intermediate=128)
    v = LayerVariant(128, GemmTiles(128, 64, 3, "hopws", cluster=2), GemmTiles(128, 64, 3, "hopws"), pdl=True)
    assert can_implement(spec, v)[0], can_implement(spec, v)
    folder = tmp_path_factory.mktemp("libs")
    arts = {}
    for kv in v.kernels(spec):
        if kv.role in ("glu", "combine"):
            arts[kv.role] = compile_kernel(build_template(kv), "sm_90a", kv.name)
            arts[kv.role].write_dir(folder / kv.role)
    return folder, arts


def test_kernel_library_needs_only_libc_and_the_driver(compiled):
    folder, arts = compiled
    for role, art in arts.items():
        lib = folder / role / f"lib{art.name}.so"
        needed = _needed(lib)
        assert all(LIBC_FAMILY.fullmatch(n) for n in needed), needed  # the driver is opened at first use
        dyn = subprocess.run(["nm", "-D", str(lib)], capture_output=True, text=True, check=True).stdout
        assert not re.search(r"\b(cudart|__cudaRegister|cudaMalloc|cudaLaunchKernelExC)\b", dyn)
        assert re.search(r" T moe_aot_shim_stats$", dyn, re.M), dyn  # the statistics' reader, visible
        strings = lib.read_bytes()
        assert b"libcudart" not in strings and b"cudart_static" not in strings
        assert len(strings) < 150_000, len(strings)  # was ~720 KB with CUDA's static cudart
        assert art.meta["toolchain"]["artifact_format"] == 2 and len(art.meta["toolchain"]["cudart_shim"]) == 64


LAUNCH = r"""
import ctypes, json, sys
standin = ctypes.CDLL(sys.argv[1], mode=ctypes.RTLD_GLOBAL)
standin.standin_log.restype = ctypes.c_char_p
import torch
from moe_aot.runtime.library import KernelLibrary, KernelLaunchError
out = {}
for role in sys.argv[3].split(","):
    standin.standin_reset()
    lib = KernelLibrary.from_dir(f"{sys.argv[2]}/{role}", device=0)
    out[role + "_load"] = standin.standin_log().decode()
    dt = {"BFloat16": torch.bfloat16, "Int32": torch.int32, "Float32": torch.float32}
    ts = []
    for a in lib._tensor_args:
        shape = [s if s is not None else 16 for s in a["static_shape"]]
        ts.append(torch.zeros(shape, dtype=dt[a["dtype"]]))
    standin.standin_reset()
    lib(*ts, stream=0x5151, check=False)
    out[role + "_launch"] = standin.standin_log().decode()
    ctypes.c_int.in_dll(standin, "standin_fail").value = 719
    try:
        lib(*ts, stream=0x5151, check=False)
    except KernelLaunchError as exc:
        out[role + "_error"] = [exc.code, str(exc)]
    ctypes.c_int.in_dll(standin, "standin_fail").value = 0
print(json.dumps(out))
"""


def test_kernel_library_reaches_the_driver_through_the_shim(compiled, standin):
    folder, arts = compiled
    res = subprocess.run([sys.executable, "-c", LAUNCH, str(standin), str(folder), "glu,combine"],
                         capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert res.returncode == 0, res.stderr
    got = json.loads(res.stdout)
    for role, art in arts.items():
        load = got[f"{role}_load"]
        assert re.search(r"^cuLibraryLoadData 0x\w+ \(nil\) \(nil\) 0", load, re.M), load
        kernel = art.meta["kernels"][0]
        assert re.search(rf"^cuLibraryGetKernel 0x\w+ {re.escape(kernel)}$", load, re.M), load
        # dynamic shared memory on device 0 (the stand-in's cuDeviceGet answers handle 7)
        assert re.search(r"^cuDeviceGet 0x\w+ 0$", load, re.M), load
        assert re.search(r"^cuKernelSetAttribute 8 [1-9]\d* 0x\w+ 7$", load, re.M), load
        launch = got[f"{role}_launch"].splitlines()
        launches = [ln for ln in launch if ln.startswith("cuLaunchKernelEx")]
        assert len(launches) == 1 and "stream=0x5151" in launches[0], launch
        assert " attr6=1," in launches[0], launches  # PDL: programmatic stream serialization
        assert got[f"{role}_error"][0] == 719
    glu = next(ln for ln in got["glu_launch"].splitlines() if ln.startswith("cuLaunchKernelEx"))
    assert " attr4=2,1,1" in glu, glu  # the 2-CTA cluster


STATS = r"""
import ctypes, json, os, sys
from ctypes import byref, c_void_p
standin = ctypes.CDLL(sys.argv[1], mode=ctypes.RTLD_GLOBAL)
standin.standin_log.restype = ctypes.c_char_p
S = ctypes.CDLL(sys.argv[2])
S.moe_aot_shim_stats.argtypes = [ctypes.c_char_p, ctypes.c_size_t, ctypes.c_int]
class Attr(ctypes.Structure):
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_int), ("v", ctypes.c_uint * 16)]
class Config(ctypes.Structure):
    _fields_ = [("grid", ctypes.c_uint * 3), ("block", ctypes.c_uint * 3), ("smem", ctypes.c_size_t),
                ("stream", c_void_p), ("attrs", ctypes.POINTER(Attr)), ("n", ctypes.c_uint)]
def launch(stream):
    attrs = (Attr * 1)()
    attrs[0].id, attrs[0].v[0] = 6, 1
    return S.cudaLaunchKernelExC(byref(Config((1, 1, 1), (128, 1, 1), 0, stream, attrs, 1)), c_void_p(0x4e),
                                 c_void_p(0xa7))
def stats(reset=0):
    buf = ctypes.create_string_buffer(4096)
    n = S.moe_aot_shim_stats(buf, 4096, reset)
    return n, dict(ln.rsplit(" ", 1) for ln in buf.value.decode().splitlines())
queries = ctypes.c_int.in_dll(standin, "standin_ctx_queries")
once = ctypes.c_int.in_dll(standin, "standin_fail_launch_once")
out = {}
def step(name, fn):
    standin.standin_reset()
    q = queries.value
    ret = fn()
    out[name] = {"ret": ret, "log": standin.standin_log().decode().splitlines(), "ctx_queries": queries.value - q}
# no current context: the NULL stream makes the device's primary context current, then launches
step("null_stream", lambda: launch(None))
# a real stream needs no context check; the legacy (1) and per-thread (2) handles do
step("real_stream", lambda: launch(0x51))
step("legacy", lambda: launch(1))
step("per_thread", lambda: launch(2))
# a driver answering CUDA_ERROR_INVALID_CONTEXT for a real stream: context made current, launched again
standin.standin_set_ctx(None)
once.value = 201
step("retry", lambda: launch(0x51))
# any other failure is returned as it is (no retry) and is the last error
once.value = 719
step("fail", lambda: launch(0x51))
out["last_error"] = S.cudaGetLastError()
step("malloc", lambda: S.cudaMalloc(byref(c_void_p()), ctypes.c_size_t(64)))
out["stats"] = stats(reset=1)
out["after_reset"] = stats()
out["small_buffer"] = S.moe_aot_shim_stats(ctypes.create_string_buffer(8), 8, 0)
print(json.dumps(out))
"""


def test_launch_context_checks_and_statistics(standin, tmp_path):
    """cudaLaunchKernelExC asks for the current context only for the NULL / legacy / per-thread
    streams (a CUkernel runs in its stream's context), retries once after CUDA_ERROR_INVALID_CONTEXT,
    and with MOE_AOT_SHIM_STATS=1 counts every entry point and times its launches."""
    shim = tmp_path / "libshim.so"
    subprocess.run(["gcc", "-shared", "-fPIC", "-O2", "-fvisibility=hidden", "-Wall", "-Werror", "-o", str(shim),
                    str(CUDART_SHIM)], check=True)
    dyn = subprocess.run(["nm", "-D", "--defined-only", str(shim)], capture_output=True, text=True).stdout
    assert "moe_aot_shim_stats" in dyn  # visible in a library linked with hidden visibility
    env = dict(__import__("os").environ, MOE_AOT_SHIM_STATS="1")
    # EXPORT is empty: call the hidden build's entry points through a default-visibility build
    plain = tmp_path / "libshim_plain.so"
    subprocess.run(["gcc", "-shared", "-fPIC", "-O2", "-o", str(plain), str(CUDART_SHIM)], check=True)
    res = subprocess.run([sys.executable, "-c", STATS, str(standin), str(plain)], capture_output=True, text=True,
                         timeout=60, env=env)
    assert res.returncode == 0, res.stderr
    got = json.loads(res.stdout)

    def launches(step):
        return [ln for ln in got[step]["log"] if ln.startswith("cuLaunchKernelEx")]

    null = got["null_stream"]
    assert null["ret"] == 0 and null["ctx_queries"] == 1
    at = [i for i, ln in enumerate(null["log"]) if ln.startswith(("cuCtxSetCurrent", "cuLaunchKernelEx"))]
    assert [null["log"][i].split()[0] for i in at] == ["cuCtxSetCurrent", "cuLaunchKernelEx"], null["log"]
    assert got["real_stream"]["ctx_queries"] == 0 and len(launches("real_stream")) == 1
    assert "stream=0x51" in launches("real_stream")[0]
    for step in ("legacy", "per_thread"):
        assert got[step]["ret"] == 0 and got[step]["ctx_queries"] == 1 and len(launches(step)) == 1
    retry = got["retry"]
    assert retry["ret"] == 0 and len(launches("retry")) == 2 and retry["ctx_queries"] == 1, retry
    assert any(ln.startswith("cuCtxSetCurrent") for ln in retry["log"]), retry
    assert got["fail"]["ret"] == 719 and len(launches("fail")) == 1 and got["fail"]["ctx_queries"] == 0
    assert got["last_error"] == 719

    n, stats = got["stats"]
    assert n > 0
    counts = {k: int(v) for k, v in stats.items()}
    assert counts["cudaLaunchKernelExC"] == 6 and counts["cudaMalloc"] == 1 and counts["cudaGetLastError"] == 1
    assert counts["context_checks"] == 4  # NULL, legacy, per-thread, and the retry
    assert 0 < counts["driver_launch_ns"] <= counts["launch_ns"]
    after = {k: int(v) for k, v in got["after_reset"][1].items()}
    assert set(after.values()) == {0} and set(after) == set(counts)
    assert got["small_buffer"] == got["after_reset"][0]  # the length the whole text needs, whatever the buffer


def test_statistics_are_off_by_default(standin, tmp_path):
    shim = tmp_path / "libshim.so"
    subprocess.run(["gcc", "-shared", "-fPIC", "-O2", "-o", str(shim), str(CUDART_SHIM)], check=True)
    code = textwrap.dedent(f"""
        import ctypes
        ctypes.CDLL({str(standin)!r}, mode=ctypes.RTLD_GLOBAL)
        S = ctypes.CDLL({str(shim)!r})
        S.cudaMalloc(ctypes.byref(ctypes.c_void_p()), ctypes.c_size_t(64))
        print(S.moe_aot_shim_stats(None, 0, 0))
    """)
    env = {k: v for k, v in __import__("os").environ.items() if k != "MOE_AOT_SHIM_STATS"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True).stdout
    assert out.strip() == "-1"
