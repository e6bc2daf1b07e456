"""Level 3: the fused MoE layer in JAX, through XLA's typed FFI (`jax.ffi`), on the same AOT
kernel binaries the PyTorch runtime launches.

    from moe_aot.integrations.jax import fused_moe
    out = jax.jit(fused_moe)(x, w13, w2, topk_weights, topk_ids)        # activation="swiglu"

Layouts are the torch path's: x [M, H] bf16; w13 [E, 2I, H] bf16 with gate/up rows interleaved
in blocks of 16 (`interleave_gate_up` below, or `prepare_weights` on the torch side); w2
[E, H, I] bf16; topk_weights [M, K] f32; topk_ids [M, K] int32 (ids outside [0, E) contribute
nothing); returns out [M, H] bf16. Layers built with expert biases (spec field `bias`) also take
b13 [E, 2I] and b2 [E, H], checked against the kernels' own metadata.

How it works, and why:
- The XLA FFI handler is a small C shim (`_SHIM` below) compiled at first use with the system's
  `cc` against the jaxlib headers (`jax.ffi.include_dir()`), cached in the folder of extracted
  kernel libraries under a hash of its source and of the header it was built with, and
  registered for platform CUDA with the command-buffer-compatible trait (both through
  `register_ffi_target(traits=...)` and in the handler's metadata answer). C rather than C++:
  the launcher in runtime/launch.py is C too, the handler needs a dozen lines of XLA's C API, and
  `cc` is all the machine needs.
- Everything that depends on the token count is fixed at trace time from static shapes: the
  variant (the runtime's own choice: `MoeLayer.variant_for`, tuned picks for this GPU from the
  database), its kernels (loaded through `KernelStore`, the same content-addressed library
  cache), the sizes M, R, T, and each kernel's argument structs, filled by the runtime's
  `KernelLibrary.bind` with the dynamic shapes and strides. That is a "plan": an immutable C
  struct holding, per kernel, its run entry point and, per tensor argument, the struct's bytes
  and which XLA buffer feeds it. Buffers are matched to kernel arguments by the arguments' NAMES
  in the kernels' metadata (x, w13, w2, topk_weights, topk_ids, b13, b2, out and the workspace
  names), never by position, so kernels that grow arguments need only a name here.
- The workspace (expert_counts, expert_offsets, sorted_ids, tile_expert, h, y) is extra results
  of the custom call: XLA allocates them from its own buffer assignment and drops them after the
  call, so the handler allocates nothing, owns no memory, and the call is a pure function of its
  operands' addresses -- which is what lets XLA trace it into a command buffer (CUDA graph).
  XLA forms command buffers on the thunk sequence after compilation (the thunk pass
  CommandBufferConversionPass: a typed-FFI call is taken when CUSTOM_CALL is among
  --xla_gpu_enable_command_buffer, its handler's registration carries the trait, and the run of
  convertible thunks holds at least --xla_gpu_graph_min_graph_size of them, 5 by default), so the
  optimized HLO never shows them: the dump's *.thunk_sequence_after_thunk_passes.txt does
  (tools/jax_cmdbuf_probe.py).
- Per call the handler finds the plan, checks each buffer's dtype and dims against it and every
  pointer's alignment against the kernel's assumption (before launching anything), copies the
  bound structs onto its stack, writes the data pointers into them and calls the kernels' host
  launchers on XLA's stream (XLA_FFI_Stream_Get). It calls no CUDA API itself: no
  synchronisation, no allocation, no copy; the launchers only enqueue kernels. Copies on the
  stack make it reentrant (two executions at once share nothing mutable).
- The HLO names the plan by a content key (an i64 attribute: a hash of the layer, M, the
  variant, the libraries' sha256s and the argument set), not by an address. The shim keeps a
  process-wide table of (key, device ordinal) -> plan, filled when fused_moe is traced. So the
  HLO is the same in every process and the persistent compilation cache is safe: a process
  that loads a cached executable has traced the same call first, and so registered the same
  key. An executable deserialized in a process that never traced the call (jax.export, or a
  serialized executable) fails at run time with an error saying to call fused_moe (or
  `prepare`) with the same shapes first -- never with a stale pointer.
- Devices: a plan is for one GPU (its kernels are loaded onto that device). Outside jit the
  device is x's; under jit it is jax's default device unless `device=` is given. Running the
  executable on another GPU is refused by the handler with a sentence (XLA_FFI_DeviceOrdinal_Get).
- torch: the runtime's loader modules import torch (any build), but the JAX path makes no torch
  CUDA call and allocates nothing through torch; JAX and torch may share the GPU (set
  XLA_PYTHON_CLIENT_PREALLOCATE=false if torch allocates too).
- Not supported: fp8 layers (the fp8 kernels' "x" argument is the quantized x: they need a role
  map of their own), autodiff (no JVP rule: jax.grad raises), vmap (no batching rule).

What is cached: the shim (on disk and in process), one MoeLayer per (database, layer, device),
one plan per (layer, M, device, argument set), registered for the life of the process (a few KB
each; at most 4096). What syncs with the host: nothing.
"""
from __future__ import annotations

import ctypes
import hashlib
import importlib
import os
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from ..layout import max_tiles
from ..runtime.library import KernelArgumentError, KernelLaunchError, library_dir
from ..spec import ACTIVATIONS, make_spec
from ..variants import INTERLEAVE
from .shapes import check_layer_shapes

TARGET = "moe_aot_fused_moe"  # the custom call's name (platform CUDA)
HOST_TARGET = "moe_aot_fused_moe_host"  # the same handler without a stream, for CPU tests only

_SHIM = r"""
/* moe-aot XLA FFI handler: a layer's bound kernel launches on XLA's stream
   (see moe_aot/integrations/jax.py). It calls no CUDA API: no sync, no allocation. */
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <pthread.h>
#include "xla/ffi/api/c_api.h"

#define MOE_MAX_KERNELS 8
#define MOE_MAX_ARGS 16
#define MOE_MAX_BUFFERS 32
#define MOE_MAX_RANK 4
#define MOE_STRUCT_BYTES 64
#define MOE_MAX_PLANS 4096
#define MOE_MAGIC 0x316a5f746f615f6dULL

typedef void (*moe_run_fn)(void **);

struct moe_slot { int32_t buffer; int32_t size; int64_t align; char name[32]; unsigned char bytes[MOE_STRUCT_BYTES]; };
struct moe_kernel {
    moe_run_fn run; int32_t nargs; int32_t reserved; char name[160]; struct moe_slot slot[MOE_MAX_ARGS];
};
struct moe_buffer { int32_t dtype; int32_t rank; int64_t dims[MOE_MAX_RANK]; char name[32]; };
struct moe_plan {
    uint64_t magic; int64_t key; int32_t device; int32_t nkernels; int32_t nargs; int32_t nrets;
    struct moe_buffer buffer[MOE_MAX_BUFFERS];
    struct moe_kernel kernel[MOE_MAX_KERNELS];
};

static struct { int64_t key; int32_t device; const struct moe_plan *plan; } table[MOE_MAX_PLANS];
static int32_t ntable;
static pthread_mutex_t table_lock = PTHREAD_MUTEX_INITIALIZER;

size_t moe_aot_jax_plan_size(void) { return sizeof(struct moe_plan); }

/* 0: registered (a plan of the same key and device is replaced; the caller keeps every plan it
   ever registered alive, so a handler still reading the old one is safe), -1: not a plan, -2: full */
int moe_aot_jax_register(const struct moe_plan *p) {
    if (p->magic != MOE_MAGIC) return -1;
    int rc = 0;
    pthread_mutex_lock(&table_lock);
    int32_t n = ntable, i;
    for (i = 0; i < n; i++)
        if (table[i].key == p->key && table[i].device == p->device) break;
    if (i < n) __atomic_store_n(&table[i].plan, p, __ATOMIC_RELEASE);
    else {
        if (n == MOE_MAX_PLANS) rc = -2;
        else {
            table[n].key = p->key; table[n].device = p->device; table[n].plan = p;
            __atomic_store_n(&ntable, n + 1, __ATOMIC_RELEASE);
        }
    }
    pthread_mutex_unlock(&table_lock);
    return rc;
}

static const struct moe_plan *find(int64_t key, int32_t device) {
    int32_t n = __atomic_load_n(&ntable, __ATOMIC_ACQUIRE);
    for (int32_t i = 0; i < n; i++)
        if (table[i].key == key && (device < 0 || table[i].device == device))
            return __atomic_load_n(&table[i].plan, __ATOMIC_ACQUIRE);
    return NULL;
}

static XLA_FFI_Error *fail(const XLA_FFI_Api *api, XLA_FFI_Error_Code code, const char *fmt, ...) {
    char msg[640];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    XLA_FFI_Error_Create_Args a;
    memset(&a, 0, sizeof a);
    a.struct_size = XLA_FFI_Error_Create_Args_STRUCT_SIZE;
    a.message = msg;
    a.errc = code;
    return api->XLA_FFI_Error_Create(&a);
}

static XLA_FFI_Error *metadata(XLA_FFI_CallFrame *f) {
    XLA_FFI_Metadata_Extension *ext = (XLA_FFI_Metadata_Extension *)f->extension_start;
    if (ext->extension_base.struct_size < XLA_FFI_Metadata_Extension_STRUCT_SIZE ||
        ext->metadata->struct_size < XLA_FFI_Metadata_STRUCT_SIZE)
        return fail(f->api, XLA_FFI_Error_Code_INVALID_ARGUMENT, "moe_aot_fused_moe: XLA's FFI metadata is older "
                    "than the headers this handler was built with");
    ext->metadata->api_version.struct_size = XLA_FFI_Api_Version_STRUCT_SIZE;
    ext->metadata->api_version.extension_start = NULL;
    ext->metadata->api_version.major_version = XLA_FFI_API_MAJOR;
    ext->metadata->api_version.minor_version = XLA_FFI_API_MINOR;
    ext->metadata->traits = XLA_FFI_HANDLER_TRAITS_COMMAND_BUFFER_COMPATIBLE;
    return NULL;
}

static XLA_FFI_Error *run(XLA_FFI_CallFrame *f, int host) {
    const XLA_FFI_Api *api = f->api;
    if (f->extension_start != NULL && f->extension_start->type == XLA_FFI_Extension_Metadata) return metadata(f);
    if (f->struct_size < XLA_FFI_CallFrame_STRUCT_SIZE)
        return fail(api, XLA_FFI_Error_Code_INVALID_ARGUMENT, "moe_aot_fused_moe: XLA's call frame is older than "
                    "the headers this handler was built with");
    if (f->stage != XLA_FFI_ExecutionStage_EXECUTE) return NULL;
    int64_t key = 0;
    int found = 0;
    for (int64_t i = 0; i < f->attrs.size; i++) {
        XLA_FFI_ByteSpan *n = f->attrs.names[i];
        if (n->len == 3 && memcmp(n->ptr, "key", 3) == 0 && f->attrs.types[i] == XLA_FFI_AttrType_SCALAR) {
            XLA_FFI_Scalar *s = (XLA_FFI_Scalar *)f->attrs.attrs[i];
            if (s->dtype == XLA_FFI_DataType_S64) { key = *(int64_t *)s->value; found = 1; }
        }
    }
    if (!found)
        return fail(api, XLA_FFI_Error_Code_INVALID_ARGUMENT, "moe_aot_fused_moe needs its int64 attribute 'key' "
                    "(call it through moe_aot.integrations.jax.fused_moe)");
    void *stream = NULL;
    int32_t device = -1;
    if (!host) {
        XLA_FFI_Stream_Get_Args s;
        memset(&s, 0, sizeof s);
        s.struct_size = XLA_FFI_Stream_Get_Args_STRUCT_SIZE;
        s.ctx = f->ctx;
        XLA_FFI_Error *err = api->XLA_FFI_Stream_Get(&s);
        if (err) return err;
        stream = s.stream;
        if (api->struct_size >= offsetof(XLA_FFI_Api, XLA_FFI_DeviceOrdinal_Get) + sizeof(void *) &&
            api->XLA_FFI_DeviceOrdinal_Get != NULL) {
            XLA_FFI_DeviceOrdinal_Get_Args d;
            memset(&d, 0, sizeof d);
            d.struct_size = XLA_FFI_DeviceOrdinal_Get_Args_STRUCT_SIZE;
            d.ctx = f->ctx;
            err = api->XLA_FFI_DeviceOrdinal_Get(&d);
            if (err) return err;
            device = d.device_ordinal;
        }
    }
    const struct moe_plan *p = find(key, device);
    if (p == NULL) {
        if (find(key, -1) != NULL)
            return fail(api, XLA_FFI_Error_Code_FAILED_PRECONDITION, "moe_aot_fused_moe: this call was traced for "
                        "another GPU than device %d; pass device= to fused_moe for the GPU it runs on", device);
        return fail(api, XLA_FFI_Error_Code_FAILED_PRECONDITION, "moe_aot_fused_moe: no plan with key %lld in this "
                    "process (the executable was traced in another process); call "
                    "moe_aot.integrations.jax.fused_moe (or prepare) with the same shapes first", (long long)key);
    }
    if (f->args.size != p->nargs || f->rets.size != p->nrets)
        return fail(api, XLA_FFI_Error_Code_INVALID_ARGUMENT, "moe_aot_fused_moe: %lld operands and %lld results, "
                    "the plan has %d and %d", (long long)f->args.size, (long long)f->rets.size, p->nargs, p->nrets);
    void *ptr[MOE_MAX_BUFFERS];
    for (int32_t b = 0; b < p->nargs + p->nrets; b++) {
        int is_arg = b < p->nargs;
        int type = is_arg ? (int)f->args.types[b] : (int)f->rets.types[b - p->nargs];
        XLA_FFI_Buffer *buf = (XLA_FFI_Buffer *)(is_arg ? f->args.args[b] : f->rets.rets[b - p->nargs]);
        const struct moe_buffer *want = &p->buffer[b];
        int ok = type == (is_arg ? XLA_FFI_ArgType_BUFFER : XLA_FFI_RetType_BUFFER) &&
                 (int32_t)buf->dtype == want->dtype && buf->rank == want->rank;
        for (int64_t d = 0; ok && d < buf->rank; d++) ok = buf->dims[d] == want->dims[d];
        if (!ok)
            return fail(api, XLA_FFI_Error_Code_INVALID_ARGUMENT, "moe_aot_fused_moe: buffer '%s' does not have the "
                        "dtype and shape its plan was made for", want->name);
        ptr[b] = buf->data;
    }
    for (int32_t k = 0; k < p->nkernels; k++)  /* every check before the first launch */
        for (int32_t a = 0; a < p->kernel[k].nargs; a++) {
            const struct moe_slot *s = &p->kernel[k].slot[a];
            if ((uintptr_t)ptr[s->buffer] % (uintptr_t)s->align)
                return fail(api, XLA_FFI_Error_Code_INVALID_ARGUMENT, "moe_aot_fused_moe: %s: argument '%s' must be "
                            "%lld-byte aligned, XLA gave %p", p->kernel[k].name, s->name, (long long)s->align,
                            ptr[s->buffer]);
        }
    for (int32_t k = 0; k < p->nkernels; k++) {
        const struct moe_kernel *K = &p->kernel[k];
        _Alignas(16) unsigned char structs[MOE_MAX_ARGS][MOE_STRUCT_BYTES];
        void *packed[MOE_MAX_ARGS + 2];
        int32_t ret = 0;
        for (int32_t a = 0; a < K->nargs; a++) {
            memcpy(structs[a], K->slot[a].bytes, (size_t)K->slot[a].size);
            memcpy(structs[a], &ptr[K->slot[a].buffer], sizeof(void *));  /* `data` is each struct's first field */
            packed[a] = structs[a];
        }
        packed[K->nargs] = &stream;
        packed[K->nargs + 1] = &ret;
        K->run(packed);
        if (ret != 0)
            return fail(api, XLA_FFI_Error_Code_INTERNAL, "%s: launch failed (cudaError %d)", K->name, (int)ret);
    }
    return NULL;
}

XLA_FFI_Error *moe_aot_jax_fused_moe(XLA_FFI_CallFrame *f) { return run(f, 0); }
XLA_FFI_Error *moe_aot_jax_fused_moe_host(XLA_FFI_CallFrame *f) { return run(f, 1); }
"""

_MAX_KERNELS, _MAX_ARGS, _MAX_BUFFERS, _MAX_RANK, _STRUCT_BYTES = 8, 16, 32, 4, 64
_MAGIC = 0x316A5F746F615F6D


class _Slot(ctypes.Structure):
    _fields_ = [("buffer", ctypes.c_int32), ("size", ctypes.c_int32), ("align", ctypes.c_int64),
                ("name", ctypes.c_char * 32), ("bytes", ctypes.c_ubyte * _STRUCT_BYTES)]


class _Kernel(ctypes.Structure):
    _fields_ = [("run", ctypes.c_void_p), ("nargs", ctypes.c_int32), ("reserved", ctypes.c_int32),
                ("name", ctypes.c_char * 160), ("slot", _Slot * _MAX_ARGS)]


class _Buffer(ctypes.Structure):
    _fields_ = [("dtype", ctypes.c_int32), ("rank", ctypes.c_int32), ("dims", ctypes.c_int64 * _MAX_RANK),
                ("name", ctypes.c_char * 32)]


class _CPlan(ctypes.Structure):
    _fields_ = [("magic", ctypes.c_uint64), ("key", ctypes.c_int64), ("device", ctypes.c_int32),
                ("nkernels", ctypes.c_int32), ("nargs", ctypes.c_int32), ("nrets", ctypes.c_int32),
                ("buffer", _Buffer * _MAX_BUFFERS), ("kernel", _Kernel * _MAX_KERNELS)]


# kernel metadata dtype -> (jnp dtype, XLA_FFI_DataType)
_DTYPES = {"BFloat16": (jnp.bfloat16, 16), "Float16": (jnp.float16, 10), "Float32": (jnp.float32, 11),
           "Int32": (jnp.int32, 4), "Int64": (jnp.int64, 5), "Uint8": (jnp.uint8, 6), "Int8": (jnp.int8, 2),
           "Float8E4M3FN": (jnp.float8_e4m3fn, 20)}
_FFI_DTYPE = {np.dtype(j): code for j, code in _DTYPES.values()}
_INPUTS = ("x", "w13", "w2", "topk_weights", "topk_ids")
_BIASES = ("b13", "b2")
# compute capability -> the kernels' target (what runtime.layer.device_target maps, without torch.cuda)
_TARGETS = {"9.0": "sm_90a", "10.0": "sm_100a", "12.1": "sm_121a"}


# -- the shim: built once per machine, loaded and registered once per process ----------------------
_lock = threading.RLock()
_shim_lib = None
REGISTERED_TRAITS: dict = {}  # target -> whether its registration carried the command-buffer trait
_registered: set[tuple[str, str]] = set()


def shim_path(unpack_dir=None, include_dir: str | None = None) -> Path:
    """Where the compiled handler lives: the extracted-library folder, named by the hash of its
    source and of the XLA FFI header it is compiled against (another jaxlib: another file)."""
    inc = Path(include_dir or jax.ffi.include_dir())
    digest = hashlib.sha256(_SHIM.encode() + (inc / "xla/ffi/api/c_api.h").read_bytes()).hexdigest()[:32]
    return library_dir(unpack_dir) / f"libmoe_aot_jax_{digest}.so"


def build_shim(unpack_dir=None, include_dir: str | None = None) -> Path:
    """Compile the handler with `cc` (or $CC) unless the file is there; atomic, so processes that
    build it at once leave one good file. Raises with the compiler's message if it cannot."""
    inc = include_dir or jax.ffi.include_dir()
    path = shim_path(unpack_dir, inc)
    if path.exists():
        return path
    cc = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    if cc is None:
        raise KernelLaunchError("the JAX path builds its XLA FFI handler with a C compiler at first use, and "
                                "none was found: install gcc (or set CC)")
    with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
        src, so = Path(tmp) / "moe_aot_jax.c", Path(tmp) / "moe_aot_jax.so"
        src.write_text(_SHIM)
        done = subprocess.run([cc, "-std=c11", "-O2", "-shared", "-fPIC", "-Wall", "-I", str(inc), "-o", str(so),
                               str(src), "-lpthread"], capture_output=True, text=True, timeout=120)
        if done.returncode:
            raise KernelLaunchError(f"compiling the JAX FFI handler failed ({cc}): {done.stderr.strip()[-2000:]}")
        os.replace(so, path)
    return path


def _shim(unpack_dir=None):
    global _shim_lib
    with _lock:
        if _shim_lib is None:
            lib = ctypes.CDLL(str(build_shim(unpack_dir)), mode=ctypes.RTLD_LOCAL)
            lib.moe_aot_jax_plan_size.restype = ctypes.c_size_t
            lib.moe_aot_jax_register.argtypes = [ctypes.c_void_p]
            lib.moe_aot_jax_register.restype = ctypes.c_int
            if lib.moe_aot_jax_plan_size() != ctypes.sizeof(_CPlan):
                raise KernelLaunchError("the JAX FFI handler's plan layout differs from this module's; "
                                        "delete the cached libmoe_aot_jax_*.so")
            _shim_lib = lib
        return _shim_lib


def register(platform: str = "CUDA", unpack_dir=None) -> None:
    """Build (at first use), load and register the handler with XLA for `platform` ("CUDA"; "cpu"
    registers the stream-less test twin under HOST_TARGET). fused_moe calls it; call it yourself
    before running an executable deserialized in this process."""
    host = platform.lower() == "cpu"
    target = HOST_TARGET if host else TARGET
    with _lock:
        if (target, platform) in _registered:
            return
        lib = _shim(unpack_dir)
        fn = lib.moe_aot_jax_fused_moe_host if host else lib.moe_aot_jax_fused_moe
        kwargs = {}
        traits = getattr(getattr(_xla_client(), "CustomCallTargetTraits", None), "COMMAND_BUFFER_COMPATIBLE", None)
        if traits is not None and not host:
            kwargs["traits"] = traits
        try:
            jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(fn), platform=platform, api_version=1, **kwargs)
        except Exception as exc:
            # A jaxlib whose registration takes no traits (TypeError), or a CUDA plugin that refuses
            # them ("The plugin does not support custom call traits": jaxlib's gpu_plugin_extension
            # before the plugin's traits-aware entry point). Either way the handler's metadata answer
            # declares the trait: XLA's RegisterHandler ORs the traits it reads from the handler into
            # the registration (xla/ffi/ffi_registry.cc), which the command-buffer conversion pass checks.
            if not kwargs or not (isinstance(exc, TypeError) or "traits" in str(exc)):
                raise
            kwargs = {}
            jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(fn), platform=platform, api_version=1)
        REGISTERED_TRAITS[target] = "traits" in kwargs  # for diagnostics (tools/jax_smoke.py)
        _registered.add((target, platform))


def _xla_client():
    for name in ("jaxlib.xla_client", "jax._src.lib.xla_client"):
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        if hasattr(module, "CustomCallTargetTraits"):
            return module
    return None  # a jaxlib without it: the handler's metadata still declares the trait


# -- plans: one per (layer, tokens, device, argument set), made at trace time -----------------------
class _Shaped:
    """What KernelLibrary.bind reads off a tensor (shape, contiguous strides, a data pointer
    that the handler overwrites per call), so the runtime fills the structs without torch tensors."""

    def __init__(self, shape):
        self.shape = tuple(shape)

    def stride(self):
        out, acc = [], 1
        for n in reversed(self.shape):
            out.append(acc)
            acc *= n
        return tuple(reversed(out))

    def data_ptr(self):
        return 0


def _contract(arg: dict, kernel: str, shape, dtype) -> None:
    """The kernel's compiled assumptions about one argument, checked on the shape XLA will pass
    (what runtime.library.check_tensor checks on a torch tensor); a mismatch is a sentence."""
    where = f"{kernel}: argument '{arg['name']}'"
    want = _DTYPES.get(arg["dtype"], (None,))[0]
    if want is None or np.dtype(want) != np.dtype(dtype):
        raise KernelArgumentError(f"{where} is compiled for {arg['dtype']}, the JAX path has {np.dtype(dtype)}")
    if len(shape) != arg["rank"]:
        raise KernelArgumentError(f"{where} is compiled for rank {arg['rank']}, the JAX path has shape {shape}")
    strides = _Shaped(shape).stride()
    for i, n in enumerate(shape):
        stat, div = arg["static_shape"][i], arg["shape_divisibility"][i]
        if (stat is not None and n != stat) or (stat is None and div and n % div):
            raise KernelArgumentError(f"{where} is compiled for shape {tuple(arg['static_shape'])} "
                                      f"(None = any, dims divisible by {arg['shape_divisibility']}), the JAX "
                                      f"path has {shape}")
        st, sdiv = arg["static_stride"][i], arg["stride_divisibility"][i]
        if n != 1 and ((st is not None and strides[i] != st) or (st is None and sdiv and strides[i] % sdiv)):
            raise KernelArgumentError(f"{where} is compiled for strides {tuple(arg['static_stride'])}, the JAX "
                                      f"path has the row-major strides {strides}")


class Plan:
    """A layer bound for one token count on one GPU: which buffers the custom call takes and
    returns (names, shapes, dtypes), and the C plan the handler runs, registered under `key`."""

    def __init__(self, layer, M: int, device: int, inputs: dict, alias_out: bool, unpack_dir=None):
        spec = layer.spec
        v, libs = layer.role_kernels(M)
        E, K, H, I = spec.experts, spec.top_k, spec.hidden, spec.intermediate
        T = max_tiles(M, K, E, v.tile_m)
        R = T * v.tile_m
        self.variant = v.name(spec)
        self.M, self.device, self.libs = M, device, libs  # the libraries stay loaded with the plan
        # the runtime's Workspace layout, as XLA-allocated results
        workspace = {"expert_counts": ((E,), jnp.int32), "expert_offsets": ((E + 1,), jnp.int32),
                     "sorted_ids": ((R,), jnp.int32), "tile_expert": ((T,), jnp.int32),
                     "h": ((R, I), jnp.bfloat16), "y": ((M * K, H), jnp.bfloat16)}
        args = dict(inputs)  # name -> (shape, dtype), operands in order
        if alias_out:
            args["out_in"] = ((M, H), jnp.bfloat16)  # the caller's out buffer, aliased to result 0
        results = {"out": ((M, H), jnp.bfloat16)}
        names = [a["name"] for lib in libs.values() for a in lib.meta["args"] if a["kind"] == "tensor"]
        for n in dict.fromkeys(names):
            if n in args or n in results:
                continue
            if n not in workspace:
                known = ", ".join(list(args) + list(results) + list(workspace))
                raise KernelArgumentError(f"kernel argument '{n}' of {spec.label()} is none the JAX path provides "
                                          f"({known}); pass it if it is an input (b13, b2), or teach "
                                          "moe_aot.integrations.jax its workspace shape")
            results[n] = workspace[n]
        for n in inputs:
            if n not in names:
                raise KernelArgumentError(f"{n} was given, but no kernel of {spec.label()} ({self.variant}) takes "
                                          f"an argument '{n}'")
        self.operands, self.results = args, results
        index = {n: i for i, n in enumerate(list(args) + list(results))}
        shapes = {**args, **results}
        if len(index) > _MAX_BUFFERS or len(libs) > _MAX_KERNELS:
            raise KernelArgumentError(f"{spec.label()} needs {len(index)} buffers in {len(libs)} kernels; the JAX "
                                      f"handler holds {_MAX_BUFFERS} and {_MAX_KERNELS}")
        self.key = self._key(layer, libs, shapes)
        c = _CPlan(magic=_MAGIC, key=self.key, device=device, nkernels=len(libs), nargs=len(args),
                   nrets=len(results))
        for n, b in index.items():
            shape, dtype = shapes[n]
            c.buffer[b].dtype, c.buffer[b].rank, c.buffer[b].name = _FFI_DTYPE[np.dtype(dtype)], len(shape), n.encode()
            for d, size in enumerate(shape):
                c.buffer[b].dims[d] = size
        for k, lib in enumerate(libs.values()):  # role_kernels gives them in launch order
            targs = [a for a in lib.meta["args"] if a["kind"] == "tensor"]
            if len(targs) > _MAX_ARGS:
                raise KernelArgumentError(f"{lib.name} takes {len(targs)} tensors; the JAX handler holds {_MAX_ARGS}")
            for a in targs:
                _contract(a, lib.name, *shapes[a["name"]])
            bound = lib.bind(*[_Shaped(shapes[a["name"]][0]) for a in targs], check=False)
            kc = c.kernel[k]
            kc.run = ctypes.cast(lib._run, ctypes.c_void_p).value
            kc.nargs, kc.name = len(targs), lib.name.encode()[:159]
            for j, (a, s) in enumerate(zip(targs, bound._structs)):
                raw = ctypes.string_at(ctypes.addressof(s), ctypes.sizeof(s))
                if len(raw) > _STRUCT_BYTES:
                    raise KernelArgumentError(f"{lib.name}: argument '{a['name']}' has a {len(raw)}-byte struct; "
                                              f"the JAX handler holds {_STRUCT_BYTES}")
                slot = kc.slot[j]
                slot.buffer, slot.size, slot.align = index[a["name"]], len(raw), max(1, int(a["assumed_align"]))
                slot.name = a["name"].encode()[:31]
                ctypes.memmove(slot.bytes, raw, len(raw))
        self._c = c
        _KEEP.append(self)  # never freed: the handler's table points at it for the process's life
        rc = _shim(unpack_dir).moe_aot_jax_register(ctypes.addressof(c))
        if rc:
            raise KernelLaunchError("the JAX handler's plan table is full (4096 layer x token-count plans in this "
                                    "process)" if rc == -2 else "the JAX handler refused a plan (rc %d)" % rc)

    def _key(self, layer, libs, shapes) -> int:
        """The plan's identity in the HLO: the same in every process for the same layer, tokens,
        variant, library bytes and buffers (not the device: the handler looks up the device's)."""
        parts = [layer.spec.workload_key, layer.spec.target, str(self.M), self.variant]
        parts += [f"{n}:{lib.meta['sha256']['library']}" for n, lib in libs.items()]
        parts += [f"{n}{tuple(s)}{np.dtype(d)}" for n, (s, d) in shapes.items()]
        digest = hashlib.sha256("|".join(parts).encode()).digest()
        return int.from_bytes(digest[:8], "little") & (2 ** 63 - 1)


_LAYERS: dict[tuple, object] = {}
_PLANS: dict[tuple, Plan] = {}
_KEEP: list[Plan] = []  # every plan ever registered (the C table holds their addresses)


def _device_facts(device) -> tuple[int, str, str]:
    """(CUDA ordinal, kernel target, GPU name as the tuned picks name it) of a jax GPU device."""
    if device.platform != "gpu" or getattr(device, "compute_capability", None) is None:
        raise KernelArgumentError(f"fused_moe runs on an NVIDIA GPU; the device is {device} ({device.platform})")
    cc = str(device.compute_capability)
    if cc not in _TARGETS:
        raise KernelArgumentError(f"GPU compute capability {cc} has no moe-aot target (built for "
                                  f"{', '.join(_TARGETS)})")
    return int(device.local_hardware_id), _TARGETS[cc], device.device_kind


def _pick_device(x, device):
    if device is not None:
        return device
    tracer = getattr(jax.core, "Tracer", ())
    if isinstance(x, jax.Array) and not isinstance(x, tracer):
        try:
            devices = x.devices()
        except Exception:  # an abstract value after all: the default device
            devices = ()
        if len(devices) == 1:
            return next(iter(devices))
    d = getattr(jax.config, "jax_default_device", None)
    if isinstance(d, str):
        return jax.devices(d)[0]
    return d if d is not None else jax.devices()[0]


def _layer(spec, ordinal: int, gpu: str, db: str | None):
    import torch  # only a torch.device value for MoeLayer: no CUDA call

    from ..runtime.layer import MoeLayer
    from ..runtime.store import KernelStore

    key = (db, spec, ordinal)
    layer = _LAYERS.get(key)
    if layer is None:
        store = KernelStore(db)
        layer = MoeLayer(spec, store, device=torch.device("cuda", ordinal), variants=store.picks(spec, gpu))
        _LAYERS[key] = layer
    return layer


def prepare(x_shape, w13_shape, topk_shape, activation: str = "swiglu", *, bias: bool = False, out: bool = False,
            device=None, db: str | None = None) -> Plan:
    """The plan fused_moe makes at trace time for these shapes (x [M, H], w13 [E, 2I, H],
    topk [M, K]), made ahead: for an executable deserialized in this process, or to load the
    kernels before the first trace. Cached."""
    with _lock:
        M, H = x_shape
        E, I2, _ = w13_shape
        K = topk_shape[1]
        dev = _pick_device(None, device)
        ordinal, target, gpu = _device_facts(dev)
        fields = dict(experts=E, top_k=K, hidden=H, intermediate=I2 // 2, activation=activation, target=target)
        if bias:
            fields["bias"] = True
        spec = make_spec(**fields)
        key = (db, spec, M, ordinal, bias, out)
        plan = _PLANS.get(key)
        if plan is None:
            register(unpack_dir=None)
            layer = _layer(spec, ordinal, gpu, db)
            inputs = {"x": ((M, H), jnp.bfloat16), "w13": ((E, I2, H), jnp.bfloat16),
                      "w2": ((E, H, I2 // 2), jnp.bfloat16), "topk_weights": ((M, K), jnp.float32),
                      "topk_ids": ((M, K), jnp.int32)}
            if bias:
                inputs["b13"] = ((E, I2), jnp.bfloat16)
                inputs["b2"] = ((E, H), jnp.bfloat16)
            plan = _PLANS[key] = Plan(layer, M, ordinal, inputs, out, layer.store.unpack_dir)
        return plan


# -- the public function -----------------------------------------------------------------------------
def check_inputs(x, w13, w2, topk_weights, topk_ids, activation="swiglu", b13=None, b2=None, out=None) -> None:
    """fused_moe's contract on shapes and dtypes (abstract values suffice: run at trace time)."""
    given = [("x", x, 2, jnp.bfloat16), ("w13", w13, 3, jnp.bfloat16), ("w2", w2, 3, jnp.bfloat16),
             ("topk_weights", topk_weights, 2, jnp.float32), ("topk_ids", topk_ids, 2, jnp.int32)]
    given += [(n, t, 2, jnp.bfloat16) for n, t in (("b13", b13), ("b2", b2), ("out", out)) if t is not None]
    for name, t, rank, dtype in given:
        if not (hasattr(t, "shape") and hasattr(t, "dtype")):
            raise KernelArgumentError(f"{name} must be an array (jax.Array or numpy), got {type(t).__name__}")
        if len(t.shape) != rank:
            raise KernelArgumentError(f"{name} must be a {rank}-D array, got shape {tuple(t.shape)}")
        if np.dtype(t.dtype) != np.dtype(dtype):
            raise KernelArgumentError(f"{name} must be {np.dtype(dtype).name}, got {np.dtype(t.dtype).name}")
    shapes = (None if t is None else tuple(t.shape) for t in (x, w13, w2, topk_weights, topk_ids, b13, b2, out))
    check_layer_shapes(*shapes, source="gate/up interleaved by interleave_gate_up")
    if activation not in ACTIVATIONS:
        raise KernelArgumentError(f"activation must be one of {', '.join(ACTIVATIONS)}, got {activation!r}")


def fused_moe(x, w13, w2, topk_weights, topk_ids, activation: str = "swiglu", *, b13=None, b2=None, out=None,
              device=None, db: str | None = None):
    """out[m] = sum_k topk_weights[m, k] * FFN_{topk_ids[m, k]}(x[m]) on the AOT kernels, as one
    XLA custom call (works eagerly, under jax.jit and in XLA's command buffers).

    x [M, H] bf16; w13 [E, 2I, H] bf16 gate/up interleaved in blocks of 16 rows
    (interleave_gate_up); w2 [E, H, I] bf16; topk_weights [M, K] f32; topk_ids [M, K] int32;
    activation "swiglu" or "geglu"; b13 [E, 2I] / b2 [E, H] bf16 for layers built with expert
    biases; out: an optional [M, H] bf16 array whose buffer the result takes over (donate it
    under jit to save a copy; its contents are ignored: every element is written). device: the
    GPU (jax Device) the call is bound to (default: x's outside jit, else jax's default device);
    db: the kernel database URL (default MOE_AOT_DB / the runtime's default). Returns [M, H] bf16.
    """
    check_inputs(x, w13, w2, topk_weights, topk_ids, activation, b13, b2, out)
    M, H = x.shape
    if M == 0:
        return jnp.zeros((0, H), jnp.bfloat16)
    plan = prepare(x.shape, w13.shape, topk_ids.shape, activation, bias=b13 is not None, out=out is not None,
                   device=_pick_device(x, device), db=db)
    operands = [x, w13, w2, topk_weights, topk_ids] + ([b13, b2] if b13 is not None else [])
    aliases = None
    if out is not None:
        aliases = {len(operands): 0}
        operands.append(out)
    results = [jax.ShapeDtypeStruct(s, d) for s, d in plan.results.values()]
    call = jax.ffi.ffi_call(_target(), results, input_output_aliases=aliases)
    return call(*operands, key=np.int64(plan.key))[0]


def _target() -> str:
    return TARGET


def interleave_gate_up(w_gate, w_up, block: int = INTERLEAVE):
    """[E, I, H] gate and up -> the kernels' [E, 2I, H] w13 (rows alternate in blocks of 16), in
    jnp: what runtime.layer.prepare_weights does in torch. Once, at weight-load time."""
    E, I, H = w_gate.shape
    if tuple(w_up.shape) != (E, I, H) or I % block:
        raise KernelArgumentError(f"w_gate {tuple(w_gate.shape)} and w_up {tuple(w_up.shape)} must match, with the "
                                  f"intermediate size a multiple of {block}")
    g = w_gate.reshape(E, I // block, block, H)
    u = w_up.reshape(E, I // block, block, H)
    return jnp.stack((g, u), axis=2).reshape(E, 2 * I, H)


def moe_reference(x, w13, w2, topk_weights, topk_ids, activation: str = "swiglu", block: int = INTERLEAVE):
    """The layer in fp32 jnp (dense over experts; for tests and small shapes): ids outside
    [0, E) contribute nothing."""
    E, I2, H = w13.shape
    v = w13.astype(jnp.float32).reshape(E, I2 // (2 * block), 2, block, H)
    gate, up = v[:, :, 0].reshape(E, I2 // 2, H), v[:, :, 1].reshape(E, I2 // 2, H)
    xf = x.astype(jnp.float32)
    hi = jax.lax.Precision.HIGHEST
    g = jnp.einsum("mh,eih->mei", xf, gate, precision=hi)
    u = jnp.einsum("mh,eih->mei", xf, up, precision=hi)
    act = jax.nn.silu(g) if activation == "swiglu" else jax.nn.gelu(g, approximate=True)
    y = jnp.einsum("mei,ehi->meh", act * u, w2.astype(jnp.float32), precision=hi)
    onehot = (topk_ids[:, :, None] == jnp.arange(E, dtype=topk_ids.dtype)[None, None, :])
    combine = jnp.sum(onehot * topk_weights[:, :, None].astype(jnp.float32), axis=1)  # [M, E]
    return jnp.einsum("me,meh->mh", combine, y, precision=hi)
