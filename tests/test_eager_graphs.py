"""The native launcher's CUDA-graph path (moe_aot/runtime/launch.py) on the CPU, against the
recording stand-in libcuda.so.1 (tests/cuda_standin.py) and four recording stand-in kernels:
a pointer set seen twice in a row is captured once on the private stream and then launched as
one graph; other pointers launch directly; never a graph into a stream being captured; a failed
capture turns graphs off; a failed graph launch is reported; release destroys the graphs."""
import json
import shutil
import subprocess
import sys
from pathlib import Path

import cuda_standin
import pytest

pytestmark = pytest.mark.skipif(shutil.which("gcc") is None, reason="needs gcc")
ROOT = Path(__file__).resolve().parents[1]

KERNELS = r"""
#include <stdio.h>
static char log_buf[1 << 16];
static size_t log_len;
int fail_kernel = -1; /* the kernel (0-3) whose launch reports cudaError 9 */
const char *kernels_log(void) { log_buf[log_len] = 0; return log_buf; }
void kernels_reset(void) { log_len = 0; }
/* a: {stream slot, ret slot}, as the DSL's packed call ends */
#define RUN(k) void run##k(void **a) { log_len += snprintf(log_buf + log_len, sizeof log_buf - log_len, \
    "run%d %p\n", k, *(void **)a[0]); if (fail_kernel == k) *(int *)a[1] = 9; }
RUN(0) RUN(1) RUN(2) RUN(3)
"""

SCRIPT = r"""
import ctypes, json, sys
standin = ctypes.CDLL(sys.argv[1], mode=ctypes.RTLD_GLOBAL)
standin.standin_log.restype = ctypes.c_char_p
kernels = ctypes.CDLL(sys.argv[2])
kernels.kernels_log.restype = ctypes.c_char_p
import moe_aot.runtime.launch as L
fn = L.native_launcher(sys.argv[3])
names = ("cuStreamIsCapturing", "cuStreamBeginCapture_v2", "cuStreamEndCapture", "cuGraphInstantiateWithFlags",
         "cuGraphLaunch", "cuGraphDestroy", "cuGraphExecDestroy")
assert names == L._GRAPH_FUNCTIONS
p = L._Plan()
streams = [ctypes.c_void_p(0) for _ in range(4)]
rets = [ctypes.c_int(0) for _ in range(4)]
packed = [(ctypes.c_void_p * 2)(ctypes.addressof(s), ctypes.addressof(r)) for s, r in zip(streams, rets)]
for k in range(4):
    p.run[k] = ctypes.cast(getattr(kernels, f"run{k}"), ctypes.c_void_p).value
    p.packed[k], p.stream[k] = ctypes.addressof(packed[k]), ctypes.addressof(streams[k])
    p.ret[k] = ctypes.addressof(rets[k])
p.n = 0
p.nk = int(sys.argv[4])  # four kernels (a layer's), or one (the decode kernel's)
p.cu[:] = [ctypes.cast(getattr(standin, n), ctypes.c_void_p).value for n in names]
p.capture_stream = 0
out = []
def call(ptrs, stream=0x51):
    standin.standin_reset(); kernels.kernels_reset()
    p.args[:] = list(ptrs) + [0, 0, stream]
    ret = fn(ctypes.addressof(p))
    out.append({"ret": ret, "n_graphs": p.n_graphs, "driver": standin.standin_log().decode().splitlines(),
                "kernels": kernels.kernels_log().decode().splitlines()})
A, B = (0x100, 0x200, 0x300, 0x400, 0x500, 0x600), (0x110, 0x200, 0x300, 0x400, 0x500, 0x600)
C = (0x120, 0x200, 0x300, 0x400, 0x500, 0x600)
call(A)          # 0: first sight, direct
call(A)          # twice in a row, but no capture stream yet: nothing runs, the caller is asked for one
needs_stream = out.pop()
p.capture_stream = 0xc5
call(A)          # 1: captured, then launched as a graph
call(A)          # 2: graph
call(B)          # 3: other pointers: direct
call(A)          # 4: graph again
call(A, 0x52)    # 5: another stream: the same graph on it
ctypes.c_int.in_dll(standin, "standin_capturing").value = 1
call(A)          # 6: the stream is being captured: direct
ctypes.c_int.in_dll(standin, "standin_capturing").value = 0
ctypes.c_int.in_dll(standin, "standin_fail").value = 700
call(A)          # 7: a failed graph launch is reported
ctypes.c_int.in_dll(standin, "standin_fail").value = 0
ctypes.c_int.in_dll(kernels, "fail_kernel").value = int(sys.argv[5])
call(C)          # 8: a failed kernel launch, direct
call(C)          # 9: ... and while capturing it: the capture fails, graphs off, direct launch reports it
ctypes.c_int.in_dll(kernels, "fail_kernel").value = -1
call(A)          # 10: graphs off: direct
standin.standin_reset()
fn.release(ctypes.addressof(p))
out.append({"release": standin.standin_log().decode().splitlines(), "n_graphs": p.n_graphs})
print(json.dumps({"calls": out, "graph_error": p.graph_error, "needs_stream": needs_stream}))
"""


@pytest.mark.parametrize("nk", [4, 1], ids=["layer", "decode"])
def test_graph_path_of_the_native_launcher(tmp_path, nk):
    fail = min(2, nk - 1)  # the kernel made to fail in calls 8 and 9
    standin = cuda_standin.build(tmp_path)
    src, kernels = tmp_path / "kernels.c", tmp_path / "libkernels.so"
    src.write_text(KERNELS)
    subprocess.run(["gcc", "-shared", "-fPIC", "-O1", "-o", str(kernels), str(src)], check=True)
    res = subprocess.run([sys.executable, "-c", SCRIPT, str(standin), str(kernels), str(tmp_path / "unpack"), str(nk),
                          str(fail)],
                         capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert res.returncode == 0, res.stderr
    got = json.loads(res.stdout)
    calls = got["calls"]

    def driver(i, prefix):
        return [ln for ln in calls[i]["driver"] if ln.startswith(prefix)]

    direct = [f"run{k} 0x51" for k in range(nk)]
    assert calls[0]["ret"] == 0 and calls[0]["kernels"] == direct and calls[0]["n_graphs"] == 0
    assert driver(0, "cuStreamIsCapturing") == ["cuStreamIsCapturing 0x51"] and not driver(0, "cuGraph")
    needs = got["needs_stream"]
    assert needs["ret"] == 6 and needs["kernels"] == [] and not [ln for ln in needs["driver"] if "Graph" in ln
                                                                 or "Capture(" in ln or "Capture_v2" in ln]
    one = calls[1]
    assert one["ret"] == 0 and one["n_graphs"] == 1
    assert one["kernels"] == [f"run{k} 0xc5" for k in range(nk)]  # captured on the private stream, not run
    order = [ln.split()[0] for ln in one["driver"] if not ln.startswith("cuStreamIsCapturing")]
    assert order == ["cuStreamBeginCapture_v2", "cuStreamEndCapture", "cuGraphInstantiateWithFlags",
                     "cuGraphDestroy", "cuGraphLaunch"], one["driver"]
    assert driver(1, "cuStreamBeginCapture_v2") == ["cuStreamBeginCapture_v2 0xc5 2"]
    launch = driver(1, "cuGraphLaunch")[0]
    assert launch.endswith(" 0x51")
    exec_handle = launch.split()[1]
    assert driver(1, "cuGraphInstantiateWithFlags")[0].split()[1] != exec_handle  # the out-pointer, printed
    for i, stream in ((2, "0x51"), (4, "0x51"), (5, "0x52")):
        assert calls[i]["ret"] == 0 and calls[i]["kernels"] == [], calls[i]
        assert driver(i, "cuGraphLaunch") == [f"cuGraphLaunch {exec_handle} {stream}"]
    assert calls[3]["kernels"] == direct and not driver(3, "cuGraph") and calls[3]["n_graphs"] == 1
    assert calls[6]["kernels"] == direct and not driver(6, "cuGraph")  # never into a capture
    assert calls[7]["ret"] == 5 and got["graph_error"] == 700 and calls[7]["kernels"] == []
    assert calls[8]["ret"] == fail + 1 and calls[8]["kernels"] == direct[:fail + 1] and not driver(8, "cuGraph")
    nine = calls[9]
    assert nine["n_graphs"] == -1 and nine["ret"] == fail + 1
    assert driver(9, "cuStreamEndCapture") and not driver(9, "cuGraphLaunch")  # the capture was ended
    assert driver(9, "cuGraphExecDestroy") == [f"cuGraphExecDestroy {exec_handle}"]  # graphs off: none kept
    assert nine["kernels"] == [f"run{k} 0xc5" for k in range(fail + 1)] + direct[:fail + 1]
    assert calls[10]["ret"] == 0 and calls[10]["kernels"] == direct and not calls[10]["driver"]
    assert calls[11]["n_graphs"] == -1
    assert calls[11]["release"] == []
