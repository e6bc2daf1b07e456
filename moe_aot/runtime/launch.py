"""The eager forward's launch path: a plan per (token count, workspace) holding the four kernels'
bound arguments, the exact input checks in as few Python steps as possible, and the four
launches in one call into a small native launcher when one can be built.

The native launcher is a few lines of C (below), compiled at first use with the system's `cc`
into the folder of extracted kernel libraries and reused by later processes. It writes the
caller's data pointers and the stream into the bound argument structs and calls routing ->
GEMM1 -> GEMM2 -> combine, stopping at the first error. Without a C compiler (or with
MOE_AOT_NATIVE_LAUNCH=0) the same steps run in Python.
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import torch

from .. import env
from .library import BoundLaunch, KernelLaunchError, library_dir

_SOURCE = r"""
/* moe-aot eager launcher: four bound kernel launches in one call (see moe_aot/runtime/launch.py) */
typedef void (*run_fn)(void **);
struct plan {
    run_fn run[4];
    void **packed[4];
    void **stream[4];
    int *ret[4];
    int n;
    void **dst[10];
    int src[10];
};
int moe_aot_launch(struct plan *p, void *x, void *w13, void *w2, void *tw, void *ids, void *out, void *b13,
                   void *b2, void *stream) {
    void *src[8] = {x, w13, w2, tw, ids, out, b13, b2};
    for (int i = 0; i < p->n; i++) *p->dst[i] = src[p->src[i]];
    for (int k = 0; k < 4; k++) {
        *p->stream[k] = stream;
        *p->ret[k] = 0;
        p->run[k](p->packed[k]);
        if (*p->ret[k]) return k + 1;
    }
    return 0;
}
"""


class _Plan(ctypes.Structure):
    _fields_ = [("run", ctypes.c_void_p * 4), ("packed", ctypes.c_void_p * 4), ("stream", ctypes.c_void_p * 4),
                ("ret", ctypes.c_void_p * 4), ("n", ctypes.c_int), ("dst", ctypes.c_void_p * 10),
                ("src", ctypes.c_int * 10)]


# Which kernel arguments each caller tensor feeds, by the kernels' own argument names: per caller
# tensor in the order x, w13, w2, topk_weights, topk_ids, out, b13, b2 (the expert biases feed only
# the kernels that take them), the (kernel 0-3: routing, GEMM1, GEMM2, combine, argument name) pairs.
_FEEDS = (((1, "x"),), ((1, "w13"),), ((2, "w2"),), ((2, "topk_weights"),), ((0, "topk_ids"), (3, "topk_ids")),
          ((3, "out"),), ((1, "b13"),), ((2, "b2"),))


def feeds(bound) -> list[tuple[int, int, int]]:
    """(caller tensor, kernel, tensor argument index) of every kernel argument a caller tensor
    feeds, for these bound kernels (an argument a kernel does not take is skipped)."""
    out = []
    for i, pairs in enumerate(_FEEDS):
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
            if path.exists() or wait:
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
        if not path.exists():
            cc = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
            if cc is None:
                return False
            with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
                src, so = Path(tmp) / "launch.c", Path(tmp) / "launch.so"
                src.write_text(_SOURCE)
                subprocess.run([cc, "-O2", "-shared", "-fPIC", "-o", str(so), str(src)], check=True,
                               capture_output=True, timeout=60)
                os.replace(so, path)
        fn = ctypes.CDLL(str(path), mode=ctypes.RTLD_LOCAL).moe_aot_launch
    except (OSError, subprocess.SubprocessError):
        return False
    fn.argtypes = [ctypes.c_void_p] * 10
    fn.restype = ctypes.c_int
    return fn


_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)


def current_stream(index: int) -> int:
    """The current CUDA stream of device `index` as an integer, without building a Stream object."""
    return _raw_stream(index) if _raw_stream is not None else torch.cuda.current_stream(index).cuda_stream


class LayerPlan:
    """The four kernels bound for one token count and workspace. `run` checks the caller's
    tensors exactly as MoeLayer.check_inputs does (type, shape, dtype, device, contiguity,
    16-byte alignment) and launches only if every one passes; otherwise it returns None and the
    caller takes the checked slow path, which names what is wrong."""

    def __init__(self, ws, bound: tuple[BoundLaunch, ...], spec, M: int, device: torch.device, unpack_dir=None):
        self.ws, self.bound, self.device, self.M = ws, bound, device, M
        self.index = device.index
        self.shapes = ((M, spec.hidden), (spec.experts, 2 * spec.intermediate, spec.hidden),
                       (spec.experts, spec.hidden, spec.intermediate), (M, spec.top_k), (M, spec.top_k),
                       (M, spec.hidden))
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
            self._plan = p
            self._plan_ptr = ctypes.addressof(p)

    @property
    def native(self) -> bool:
        return self._plan is not None

    def run(self, x, w13, w2, tw, ids, out, b13=None, b2=None):
        T, dev, (sx, s13, s2, stw, sids, sout) = torch.Tensor, self.device, self.shapes
        bf = torch.bfloat16
        if not (isinstance(x, T) and isinstance(w13, T) and isinstance(w2, T) and isinstance(tw, T)
                and isinstance(ids, T)
                and x.shape == sx and w13.shape == s13 and w2.shape == s2 and tw.shape == stw and ids.shape == sids
                and x.dtype is bf and w13.dtype is bf and w2.dtype is bf and tw.dtype is torch.float32
                and ids.dtype is torch.int32
                and x.device == dev and w13.device == dev and w2.device == dev and tw.device == dev
                and ids.device == dev
                and x.is_contiguous() and w13.is_contiguous() and w2.is_contiguous() and tw.is_contiguous()
                and ids.is_contiguous()):
            return None
        if out is None:
            out = torch.empty(self.out_shape, dtype=bf, device=dev)
        elif not (isinstance(out, T) and out.shape == sout and out.dtype is bf and out.device == dev
                  and out.is_contiguous()):
            return None
        if self.bias:
            sb13, sb2 = self.bias_shapes
            if not (isinstance(b13, T) and isinstance(b2, T) and b13.shape == sb13 and b2.shape == sb2
                    and b13.dtype is bf and b2.dtype is bf and b13.device == dev and b2.device == dev
                    and b13.is_contiguous() and b2.is_contiguous()):
                return None
            p = (x.data_ptr(), w13.data_ptr(), w2.data_ptr(), tw.data_ptr(), ids.data_ptr(), out.data_ptr(),
                 b13.data_ptr(), b2.data_ptr())
        elif b13 is not None or b2 is not None:
            return None
        else:
            p = (x.data_ptr(), w13.data_ptr(), w2.data_ptr(), tw.data_ptr(), ids.data_ptr(), out.data_ptr(), 0, 0)
        if (p[0] | p[1] | p[2] | p[3] | p[4] | p[5] | p[6] | p[7]) & 15:
            return None
        stream = current_stream(self.index if self.index is not None else torch.cuda.current_device())
        if self._plan is None and _native_fn:  # compiled in the background since this plan was made
            self._attach(_native_fn)
        if self._plan is not None:
            failed = self._fn(self._plan_ptr, *p, stream)
            if failed:
                b = self.bound[failed - 1]
                raise KernelLaunchError(f"{b._lib.name}: launch failed (cudaError {b._ret.value})", b._ret.value)
            return out
        route, glu, down, comb = self.bound
        for i, k, a in self._feeds:
            self.bound[k]._structs[a].data = p[i]
        route(stream)
        glu(stream)
        down(stream)
        comb(stream)
        return out


if __name__ == "__main__":  # prebuild the launcher (e.g. in a container build): python -m moe_aot.runtime.launch
    fn = native_launcher()
    print("native launcher ready" if fn else "no native launcher (no C compiler, or MOE_AOT_NATIVE_LAUNCH=0): "
          "layers launch from Python")
