"""The eager forward's launch path: a plan per (token count, workspace) holding the four kernels'
bound arguments (or the one-launch decode kernel's, where that serves the token count), the exact
input checks in as few Python steps as possible, and the launches in one call into a small native
launcher when one can be built.

The native launcher is a few lines of C (below), compiled at first use with the system's `cc`
into the folder of extracted kernel libraries and reused by later processes. It writes the
caller's data pointers and the stream into the bound argument structs and calls routing ->
GEMM1 -> GEMM2 -> combine, stopping at the first error. Without a C compiler (or with
MOE_AOT_NATIVE_LAUNCH=0) the same steps run in Python.

Each cuLaunchKernelEx costs the driver about 4 us of host time on the H200 (measured through the
shim's counters), so four launches alone exceed the 15 us budget of an eager forward. A plan
therefore keeps CUDA graphs of its four launches: when the caller passes the same pointers twice
in a row (steady-state loops, the caching allocator handing back the same blocks), the launcher
captures the four launches once into a graph on a private stream and from then on launches that
graph (one driver submission, about 4 us in all) whenever those pointers come back. The graph
holds exactly what the four launches would have been given (pointers, shapes, the TMA
descriptors built from them), so replaying it is the same work. At most 8 graphs per plan; never
into a stream that is being captured (the caller's own graph then records the four launches);
a failed capture turns graphs off for the plan; MOE_AOT_EAGER_GRAPHS=0 turns them off.
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import struct
import subprocess
import tempfile
import threading
from pathlib import Path

import torch

from .. import env
from .library import BoundLaunch, KernelLaunchError, libcuda, library_dir

_SOURCE = r"""
/* moe-aot eager launcher: four bound kernel launches in one call (see moe_aot/runtime/launch.py) */
#include <string.h>
typedef void (*run_fn)(void **);
typedef int (*is_capturing_fn)(void *, int *);
typedef int (*begin_capture_fn)(void *, int);
typedef int (*end_capture_fn)(void *, void **);
typedef int (*instantiate_fn)(void **, void *, unsigned long long);
typedef int (*graph_launch_fn)(void *, void *);
typedef int (*destroy_fn)(void *);
enum { IS_CAPTURING, BEGIN_CAPTURE, END_CAPTURE, INSTANTIATE, GRAPH_LAUNCH, GRAPH_DESTROY, EXEC_DESTROY, N_CU };
#define MAX_GRAPHS 8
struct plan {
    run_fn run[4];
    void **packed[4];
    void **stream[4];
    int *ret[4];
    int nk;  /* kernels: 4 (routing, GEMM1, GEMM2, combine) or 1 (the one-launch decode kernel) */
    int n;
    void **dst[10];
    int src[10];
    void *args[9]; /* x, w13, w2, tw, ids, out, b13, b2, stream: written by the caller before each call */
    /* CUDA graphs of the four launches, one per set of caller pointers seen twice in a row: a
       graph launch costs the driver one submission where four launches cost four */
    void *cu[N_CU];        /* driver functions; cu[0] NULL: no graphs */
    void *capture_stream;  /* a stream of the layer's device, for capturing */
    int n_graphs;          /* -1: graphs off (a capture failed, or released) */
    int graph_error;       /* the CUresult of a failed graph launch */
    void *last[8];
    void *keys[MAX_GRAPHS][8];
    void *exec[MAX_GRAPHS];
};
static int direct(struct plan *p, void *stream) {
    for (int k = 0; k < p->nk; k++) {
        *p->stream[k] = stream;
        *p->ret[k] = 0;
        p->run[k](p->packed[k]);
        if (*p->ret[k]) return k + 1;
    }
    return 0;
}
static int capture(struct plan *p, void **exec) {
    void *graph = 0;
    if (((begin_capture_fn)p->cu[BEGIN_CAPTURE])(p->capture_stream, 2 /* relaxed */)) return -1;
    int failed = direct(p, p->capture_stream);
    int err = ((end_capture_fn)p->cu[END_CAPTURE])(p->capture_stream, &graph);
    if (!failed && !err && graph) err = ((instantiate_fn)p->cu[INSTANTIATE])(exec, graph, 0);
    if (graph) ((destroy_fn)p->cu[GRAPH_DESTROY])(graph);
    return failed || err || !graph ? -1 : 0;
}
void moe_aot_release(struct plan *p) {
    for (int g = 0; g < p->n_graphs; g++) ((destroy_fn)p->cu[EXEC_DESTROY])(p->exec[g]);
    p->n_graphs = -1;
}
/* 0, or k (1-nk) when kernel k's launch failed (its cudaError in *ret[k-1]), 5 when a graph
   launch failed (its CUresult in graph_error), 6 when a capture needs capture_stream first */
int moe_aot_launch(struct plan *p) {
    for (int i = 0; i < p->n; i++) *p->dst[i] = p->args[p->src[i]];
    void *stream = p->args[8];
    int status = 1;
    /* never into a stream being captured (the caller's own graph records the four launches) */
    if (p->n_graphs >= 0 && p->cu[0] && ((is_capturing_fn)p->cu[IS_CAPTURING])(stream, &status) == 0
            && status == 0) {
        int g = 0;
        while (g < p->n_graphs && memcmp(p->keys[g], p->args, sizeof p->keys[g])) g++;
        if (g == p->n_graphs && g < MAX_GRAPHS && !memcmp(p->last, p->args, sizeof p->last)) {
            if (!p->capture_stream) return 6; /* the caller makes one and calls again: nothing ran */
            if (capture(p, &p->exec[g]) == 0) {
                memcpy(p->keys[g], p->args, sizeof p->keys[g]);
                p->n_graphs++;
            } else {  /* graphs off for this plan: it holds none from here on */
                moe_aot_release(p);
                g = 0;
            }
        }
        if (g < p->n_graphs) {
            p->graph_error = ((graph_launch_fn)p->cu[GRAPH_LAUNCH])(p->exec[g], stream);
            return p->graph_error ? 5 : 0;
        }
        memcpy(p->last, p->args, sizeof p->last);
    }
    return direct(p, stream);
}
"""

# the driver functions the graph path takes, in the launcher's order
_GRAPH_FUNCTIONS = ("cuStreamIsCapturing", "cuStreamBeginCapture_v2", "cuStreamEndCapture",
                    "cuGraphInstantiateWithFlags", "cuGraphLaunch", "cuGraphDestroy", "cuGraphExecDestroy")
_MAX_GRAPHS = 8


class _Plan(ctypes.Structure):
    _fields_ = [("run", ctypes.c_void_p * 4), ("packed", ctypes.c_void_p * 4), ("stream", ctypes.c_void_p * 4),
                ("ret", ctypes.c_void_p * 4), ("nk", ctypes.c_int), ("n", ctypes.c_int), ("dst", ctypes.c_void_p * 10),
                ("src", ctypes.c_int * 10), ("args", ctypes.c_void_p * 9),
                ("cu", ctypes.c_void_p * len(_GRAPH_FUNCTIONS)), ("capture_stream", ctypes.c_void_p),
                ("n_graphs", ctypes.c_int), ("graph_error", ctypes.c_int), ("last", ctypes.c_void_p * 8),
                ("keys", ctypes.c_void_p * 8 * _MAX_GRAPHS), ("exec", ctypes.c_void_p * _MAX_GRAPHS)]


# The call's nine pointers go into the plan's `args` with one pack_into, and the launcher takes
# the plan alone: converting nine ctypes arguments cost more than the four launches' Python did.
_pack_args = struct.Struct("@9P").pack_into
_ARGS_OFFSET = _Plan.args.offset


# Which kernel arguments each caller tensor feeds, by the kernels' own argument names: per caller
# tensor in the order x, w13, w2, topk_weights, topk_ids, out, b13, b2 (the expert biases feed only
# the kernels that take them), the (kernel 0-3: routing, GEMM1, GEMM2, combine, argument name) pairs.
_FEEDS = (((1, "x"),), ((1, "w13"),), ((2, "w2"),), ((2, "topk_weights"),), ((0, "topk_ids"), (3, "topk_ids")),
          ((3, "out"),), ((1, "b13"),), ((2, "b2"),))
# a plan of one kernel: the one-launch decode kernel, which takes every caller tensor itself
_DECODE_FEEDS = tuple(((0, name),) for name in ("x", "w13", "w2", "topk_weights", "topk_ids", "out", "b13", "b2"))


def feeds(bound) -> list[tuple[int, int, int]]:
    """(caller tensor, kernel, tensor argument index) of every kernel argument a caller tensor
    feeds, for these bound kernels (the four of a layer, or the one decode kernel; an argument a
    kernel does not take is skipped)."""
    out = []
    for i, pairs in enumerate(_DECODE_FEEDS if len(bound) == 1 else _FEEDS):
        for k, name in pairs:
            names = bound[k]._lib.arg_names
            if name in names:
                out.append((i, k, names.index(name)))
    return out

_native_fn = None  # the loaded launcher; False once it is known to be unavailable here
_building = None  # the thread compiling it, while it runs


def native_launcher(unpack_dir=None, wait: bool = True):
    """The compiled launcher's entry point, or None where it cannot be had (no C compiler, a
    compile error, MOE_AOT_NATIVE_LAUNCH=0): callers then launch from Python. With wait=False a
    launcher not compiled yet is compiled in a background thread and None is returned meanwhile,
    so the first process on a machine does not wait for the compiler in its first forward."""
    global _native_fn, _building
    if _native_fn is None and _building is None:
        if not env.native_launch():
            _native_fn = False
        else:
            try:
                path = _path(library_dir(unpack_dir))
            except (OSError, KernelLaunchError):
                _native_fn = False
                return None
            if wait or os.path.exists(path):
                _native_fn = _build(path)
            else:
                def build():
                    global _native_fn, _building
                    _native_fn = _build(path)
                    _building = None
                _building = threading.Thread(target=build, name="moe_aot-launcher-cc", daemon=True)
                _building.start()
    if wait and _building is not None:
        _building.join()
    return _native_fn or None


def _path(folder: Path) -> Path:
    return folder / f"libmoe_aot_launch_{hashlib.sha256(_SOURCE.encode()).hexdigest()[:32]}.so"


def _build(path: Path):
    try:
        if not os.path.exists(path):
            cc = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
            if cc is None:
                return False
            with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
                src, so = Path(tmp) / "launch.c", Path(tmp) / "launch.so"
                src.write_text(_SOURCE)
                subprocess.run([cc, "-O2", "-shared", "-fPIC", "-o", str(so), str(src)], check=True,
                               capture_output=True, timeout=60)
                os.replace(so, path)
        lib = ctypes.CDLL(str(path), mode=ctypes.RTLD_LOCAL)
        fn = lib.moe_aot_launch
    except (OSError, subprocess.SubprocessError):
        return False
    fn.argtypes = [ctypes.c_void_p]
    fn.restype = ctypes.c_int
    fn.release = lib.moe_aot_release
    fn.release.argtypes, fn.release.restype = [ctypes.c_void_p], None
    return fn


_driver_graph_fns = None  # addresses of _GRAPH_FUNCTIONS in libcuda.so.1; () where it has none


def driver_graph_functions() -> tuple:
    """The driver functions of the launcher's graph path, by address ((), no graphs: no driver,
    or MOE_AOT_EAGER_GRAPHS=0)."""
    global _driver_graph_fns
    if _driver_graph_fns is None:
        try:
            cuda = libcuda()
            _driver_graph_fns = tuple(ctypes.cast(getattr(cuda, n), ctypes.c_void_p).value
                                      for n in _GRAPH_FUNCTIONS)
        except (OSError, AttributeError):
            _driver_graph_fns = ()
    return _driver_graph_fns if env.eager_graphs() else ()


_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)


def current_stream(index: int) -> int:
    """The current CUDA stream of device `index` as an integer, without building a Stream object."""
    return _raw_stream(index) if _raw_stream is not None else torch.cuda.current_stream(index).cuda_stream


class LayerPlan:
    """The four kernels (or the one decode kernel) bound for one token count and workspace. `run`
    checks the caller's tensors exactly as MoeLayer.check_inputs does (type, shape, dtype, device,
    contiguity, 16-byte alignment) and launches only if every one passes; otherwise it returns None and the
    caller takes the checked slow path, which names what is wrong."""

    def __init__(self, ws, bound: tuple[BoundLaunch, ...], spec, M: int, device: torch.device, unpack_dir=None,
                 variants=None):
        self.ws, self.bound, self.device, self.M = ws, bound, device, M
        self.variants = variants  # the picks it was made from (MoeLayer checks it is still the same dict)
        self.index = device.index
        self.shapes = ((M, spec.hidden), (spec.experts, 2 * spec.intermediate, spec.hidden),
                       (spec.experts, spec.hidden, spec.intermediate), (M, spec.top_k), (M, spec.top_k),
                       (M, spec.hidden))
        self._in_shapes = self.shapes[:5]
        self._in_dtypes = (torch.bfloat16,) * 3 + (torch.float32, torch.int32)
        self._devices = (device,) * 5
        self.out_shape = torch.Size(self.shapes[5])
        self.bias = spec.bias
        self.bias_shapes = ((spec.experts, 2 * spec.intermediate), (spec.experts, spec.hidden))
        self._feeds = feeds(bound)
        self._plan = None
        self._attach(native_launcher(unpack_dir, wait=False))

    def _attach(self, fn) -> None:
        """Point the native launcher at the bound structs (fn None: launch from Python)."""
        self._fn = fn
        if fn is not None:
            bound = self.bound
            p = _Plan()
            p.nk = len(bound)
            for k, b in enumerate(bound):
                p.run[k] = ctypes.cast(b._lib._run, ctypes.c_void_p).value
                p.packed[k] = ctypes.addressof(b._packed)
                p.stream[k] = ctypes.addressof(b._stream)
                p.ret[k] = ctypes.addressof(b._ret)
            slots = self._feeds
            p.n = len(slots)
            for j, (i, k, a) in enumerate(slots):
                p.dst[j] = ctypes.addressof(bound[k]._structs[a])  # `data` is each struct's first field
                p.src[j] = i
            cu = driver_graph_functions() if self.index is not None else ()
            if cu:  # the capture stream comes at the first capture (torch's first stream of a device
                p.cu[:] = cu  # costs 3-5 ms: not in a first forward)
            self._plan = p
            self._plan_ptr = ctypes.addressof(p)

    @property
    def native(self) -> bool:
        return self._plan is not None

    def _make_capture_stream(self) -> bool:
        """A stream of the layer's device for the launcher's captures (held: its graphs use it);
        False, with graphs off for this plan, where none can be had."""
        try:
            self._capture_stream = torch.cuda.Stream(device=self.device)
            self._plan.capture_stream = self._capture_stream.cuda_stream
            return True
        except (RuntimeError, AssertionError):
            self._plan.n_graphs = -1
            return False

    @property
    def graphs(self) -> int:
        """How many CUDA graphs of its four launches this plan holds (-1: graphs off for it)."""
        return -1 if self._plan is None or not self._plan.cu[0] else self._plan.n_graphs

    def __del__(self):
        plan = getattr(self, "_plan", None)
        if plan is not None and plan.n_graphs > 0:
            try:
                self._fn.release(ctypes.addressof(plan))
            except Exception:  # interpreter shutdown: the driver may be gone already
                pass

    def run(self, x, w13, w2, tw, ids, out, b13=None, b2=None):
        # Each group of checks is one tuple comparison (dtypes compare by identity, devices by
        # type and index, shapes element-wise): the same checks in fewer Python steps.
        T, dev, bf = torch.Tensor, self.device, torch.bfloat16
        if not (isinstance(x, T) and isinstance(w13, T) and isinstance(w2, T) and isinstance(tw, T)
                and isinstance(ids, T)
                and (x.shape, w13.shape, w2.shape, tw.shape, ids.shape) == self._in_shapes
                and (x.dtype, w13.dtype, w2.dtype, tw.dtype, ids.dtype) == self._in_dtypes
                and (x.device, w13.device, w2.device, tw.device, ids.device) == self._devices
                and x.is_contiguous() and w13.is_contiguous() and w2.is_contiguous() and tw.is_contiguous()
                and ids.is_contiguous()):
            return None
        if out is None:
            # x.new_empty is torch.empty with x's dtype and device (both checked to be the
            # layer's), parsed in half the time; a subclass of Tensor could answer it differently
            out = x.new_empty(self.out_shape) if type(x) is T else torch.empty(self.out_shape, dtype=bf, device=dev)
        elif not (isinstance(out, T) and out.shape == self.shapes[5] and out.dtype is bf and out.device == dev
                  and out.is_contiguous()):
            return None
        if self.bias:
            if not (isinstance(b13, T) and isinstance(b2, T) and (b13.shape, b2.shape) == self.bias_shapes
                    and b13.dtype is bf and b2.dtype is bf and b13.device == dev and b2.device == dev
                    and b13.is_contiguous() and b2.is_contiguous()):
                return None
            p6, p7 = b13.data_ptr(), b2.data_ptr()
        elif b13 is not None or b2 is not None:
            return None
        else:
            p6 = p7 = 0
        p0, p1, p2, p3, p4, p5 = x.data_ptr(), w13.data_ptr(), w2.data_ptr(), tw.data_ptr(), ids.data_ptr(), \
            out.data_ptr()
        if (p0 | p1 | p2 | p3 | p4 | p5 | p6 | p7) & 15:
            return None
        index = self.index if self.index is not None else torch.cuda.current_device()
        stream = _raw_stream(index) if _raw_stream is not None else torch.cuda.current_stream(index).cuda_stream
        if self._plan is None and _native_fn:  # compiled in the background since this plan was made
            self._attach(_native_fn)
        if self._plan is not None:
            _pack_args(self._plan, _ARGS_OFFSET, p0, p1, p2, p3, p4, p5, p6, p7, stream)
            failed = self._fn(self._plan_ptr)
            if failed == 6:  # the first capture of this plan: it needs a stream (else graphs go off)
                self._make_capture_stream()
                failed = self._fn(self._plan_ptr)
            if failed:
                if failed == 5:
                    err = self._plan.graph_error
                    names = ", ".join(b._lib.name for b in self.bound)
                    raise KernelLaunchError(f"{names}: launching their CUDA graph failed (CUresult {err})", err)
                b = self.bound[failed - 1]
                raise KernelLaunchError(f"{b._lib.name}: launch failed (cudaError {b._ret.value})", b._ret.value)
            return out
        p = (p0, p1, p2, p3, p4, p5, p6, p7)
        for i, k, a in self._feeds:
            self.bound[k]._structs[a].data = p[i]
        for launch in self.bound:
            launch(stream)
        return out


if __name__ == "__main__":  # prebuild the launcher (e.g. in a container build): python -m moe_aot.runtime.launch
    fn = native_launcher()
    print("native launcher ready" if fn else "no native launcher (no C compiler, or MOE_AOT_NATIVE_LAUNCH=0): "
          "layers launch from Python")
