"""Load one compiled kernel library and launch it on torch tensors, without the DSL.

The library is the DSL's exported host launcher linked into a self-contained .so. Its entry
points use MLIR's packed calling convention: `void fn(void** args)`, one pointer per argument and
a last slot pointing to an int32 CUDA error code. A tensor argument is the C struct
`{T* data; int32|int64 dynamic_shape[k]; int64 dynamic_stride[m];}` holding only the modes that
were dynamic at compile time; everything else was baked into the machine code, so `check_tensor`
verifies those assumptions before every launch: violating them would be undefined behaviour.
"""
from __future__ import annotations

import ctypes
import hashlib
import json
import os
import tempfile
import time
from pathlib import Path
from stat import S_ISDIR

import torch

from ..hosts import host_of_llvm_target, this_host

_C_TYPES = {"int32": ctypes.c_int32, "int64": ctypes.c_int64}
_DTYPES = {
    "BFloat16": torch.bfloat16, "Float16": torch.float16, "Float32": torch.float32,
    "Int32": torch.int32, "Int64": torch.int64, "Uint8": torch.uint8, "Int8": torch.int8,
    "Float8E4M3FN": torch.float8_e4m3fn,
}


_libcuda = None  # the driver library, opened once per process (False: there is none)


def libcuda():
    """ctypes' handle of libcuda.so.1, shared by the store (the driver's CUDA version) and the
    launcher (its graph functions): one CDLL per process instead of one each. OSError where the
    driver cannot be loaded (asked once: a failed dlopen searches every library folder)."""
    global _libcuda
    if _libcuda is None:
        try:
            _libcuda = ctypes.CDLL("libcuda.so.1")
        except OSError:
            _libcuda = False
    if _libcuda is False:
        raise OSError("libcuda.so.1 cannot be loaded")
    return _libcuda


class KernelArgumentError(ValueError):
    """A tensor does not satisfy what the kernel was compiled for."""


class KernelLaunchError(RuntimeError):
    """The CUDA runtime refused to load or launch a kernel; ``code`` is its cudaError_t value
    where the runtime returned one (None for refusals of our own, e.g. a corrupt library)."""

    def __init__(self, message: str, code: int | None = None):
        super().__init__(message)
        self.code = code


def other_host(built_for: str) -> str:
    """The one sentence that refuses a library whose host code is for another CPU."""
    return (f"its host code was built for an {built_for} host and this host is {this_host()}, so it "
            "cannot be loaded here (sm_121a libraries are for the DGX Spark's aarch64 host)")


_STRUCT_TYPES: dict[tuple, type] = {}  # (shape C type, dynamic extents, stride C type, dynamic strides) -> type


def _struct_type(arg: dict):
    """The ctypes struct of a tensor argument. One type per layout, shared by every argument and
    library that has it: making a ctypes type costs ~15 us, and a layer's ~20 arguments have a
    handful of layouts (before, a bind made every argument's type again after its load had)."""
    ns, nt = len(arg["dynamic_shape_modes"]), len(arg["dynamic_stride_modes"])
    key = (arg["shape_c_type"] if ns else None, ns, arg["stride_c_type"] if nt else None, nt)
    t = _STRUCT_TYPES.get(key)
    if t is None:
        fields = [("data", ctypes.c_void_p)]
        if ns:
            fields.append(("shape", _C_TYPES[key[0]] * ns))
        if nt:
            fields.append(("stride", _C_TYPES[key[2]] * nt))
        t = _STRUCT_TYPES[key] = type(f"TensorArg_{key[0]}x{ns}_{key[2]}x{nt}", (ctypes.Structure,),
                                      {"_fields_": fields})
    return t


def check_tensor(arg: dict, t: torch.Tensor, kernel: str = "") -> None:
    """Raise KernelArgumentError unless `t` matches the compiled contract of `arg`."""
    where = f"{kernel}: argument '{arg['name']}'"
    if not isinstance(t, torch.Tensor):
        raise KernelArgumentError(f"{where} must be a torch.Tensor, got {type(t).__name__}")
    want = _DTYPES.get(arg["dtype"])
    if t.dtype != want:
        raise KernelArgumentError(f"{where} must have dtype {want}, got {t.dtype}")
    if t.dim() != arg["rank"]:
        raise KernelArgumentError(f"{where} must have {arg['rank']} dimensions, got shape {tuple(t.shape)}")
    for i, (size, stat) in enumerate(zip(t.shape, arg["static_shape"])):
        if stat is not None and size != stat:
            raise KernelArgumentError(
                f"{where} must have size {stat} in dimension {i} (shape {tuple(arg['static_shape'])}, "
                f"None = any), got shape {tuple(t.shape)}")
        div = arg["shape_divisibility"][i]
        if stat is None and div and size % div:
            raise KernelArgumentError(f"{where}: dimension {i} ({size}) must be a multiple of {div}")
    shape = t.shape
    for i, (st, stat) in enumerate(zip(t.stride(), arg["static_stride"]) if t.numel() else ()):
        # (an empty tensor's strides are never used)
        if shape[i] == 1 and stat is not None:
            continue  # the stride of a size-1 mode is never used
        if stat is not None and st != stat:
            raise KernelArgumentError(
                f"{where} must be contiguous in the compiled layout (strides {tuple(arg['static_stride'])}), "
                f"got strides {tuple(t.stride())}")
        div = arg["stride_divisibility"][i]
        if stat is None and div and st % div:
            raise KernelArgumentError(f"{where}: stride {i} ({st}) must be a multiple of {div}")
    if t.data_ptr() % arg["assumed_align"]:
        raise KernelArgumentError(f"{where} must be {arg['assumed_align']}-byte aligned (data_ptr {t.data_ptr():#x})")
    if not t.is_cuda:
        raise KernelArgumentError(f"{where} must be a CUDA tensor, got device {t.device}")


def library_dir(unpack_dir: os.PathLike | None = None) -> Path:
    """The folder of extracted kernel libraries (created private). Refused when another user
    could write into it: a library there is loaded into this process after its hash check."""
    folder = Path(unpack_dir) if unpack_dir else Path(tempfile.gettempdir()) / f"moe_aot_{os.getuid()}"
    try:  # one stat where the folder exists (pathlib's mkdir(exist_ok=True) costs an exception and two)
        st = os.stat(folder)
    except FileNotFoundError:
        os.makedirs(folder, mode=0o700, exist_ok=True)
        st = os.stat(folder)
    if not S_ISDIR(st.st_mode):  # as mkdir(exist_ok=True) refused it
        raise FileExistsError(f"{folder} exists and is not a directory")
    if st.st_uid != os.getuid() or st.st_mode & 0o022:
        raise KernelLaunchError(f"refusing to load kernel libraries from {folder}: it must belong to this "
                                "user and be writable by no one else (pass another unpack_dir)")
    return folder


def cached_library(folder: Path, name: str, digest: str, fetch) -> Path:
    """The path of kernel library `name` whose bytes have sha256 `digest`, in a content-addressed
    cache shared by every process of this user: a file there is used only after its bytes are
    hashed again; otherwise (absent or altered) `fetch()` gives the bytes, which are checked and
    written atomically. So a process whose libraries are cached reads no blob from the database
    and decompresses nothing."""
    path = folder / f"lib{name}_{digest}.so"
    try:
        if hashlib.sha256(path.read_bytes()).hexdigest() == digest:
            return path
    except FileNotFoundError:
        pass
    library = fetch()
    if hashlib.sha256(library).hexdigest() != digest:
        raise KernelLaunchError(f"{name}: stored library is corrupt (sha256 mismatch)")
    fd, tmp = tempfile.mkstemp(dir=folder, suffix=".so.tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(library)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


class KernelLibrary:
    """One kernel library loaded into this process and onto the current CUDA device."""

    def __init__(self, so_path: os.PathLike, meta: dict, device: int | None = None):
        self.meta = meta
        self.name = meta["name"]
        if "toolchain" in meta:  # dlopen of another CPU's library fails with a cryptic ELF error
            built_for = host_of_llvm_target(meta["toolchain"].get("host_target", ""))
            if built_for != this_host():
                raise KernelLaunchError(f"{self.name}: {other_host(built_for or 'unknown')}")
        t0 = time.perf_counter()
        self._lib = ctypes.CDLL(str(so_path), mode=ctypes.RTLD_LOCAL)
        t1 = time.perf_counter()
        abi = meta["host_abi"]
        self._handle = ctypes.c_void_p(0)
        self._handle_ptr = ctypes.c_void_p(ctypes.addressof(self._handle))
        ret = ctypes.c_int32(-1)
        getattr(self._lib, abi["init"])((ctypes.c_void_p * 2)(ctypes.addressof(self._handle_ptr),
                                                                ctypes.addressof(ret)))
        if ret.value != 0:
            raise KernelLaunchError(f"{self.name}: loading the kernel module failed (cudaError {ret.value})",
                                    ret.value)
        t2 = time.perf_counter()
        dev = ctypes.c_int32(torch.cuda.current_device() if device is None else device)
        getattr(self._lib, abi["load_to_device"])((ctypes.c_void_p * 3)(
            ctypes.addressof(self._handle_ptr), ctypes.addressof(dev), ctypes.addressof(ret)))
        if ret.value != 0:
            raise KernelLaunchError(f"{self.name}: loading onto device {dev.value} failed (cudaError {ret.value}); "
                                    "a cubin runs only on the exact arch it was built for", ret.value)
        # where a cold start goes, for tools/gpu_run.py --coldstart
        self.load_ms = {"dlopen": 1e3 * (t1 - t0), "init": 1e3 * (t2 - t1),
                        "load_to_device": 1e3 * (time.perf_counter() - t2)}
        self._run = getattr(self._lib, abi["run"])
        self._tensor_args = [a for a in meta["args"] if a["kind"] == "tensor"]
        # Argument structs are built once and refilled per call: fewer Python steps per launch.
        self._structs = [_struct_type(a)() for a in self._tensor_args]
        self._stream = ctypes.c_void_p(0)
        self._ret = ctypes.c_int32(0)
        ptrs = [ctypes.addressof(s) for s in self._structs]
        ptrs += [ctypes.addressof(self._stream), ctypes.addressof(self._ret)]
        self._packed = (ctypes.c_void_p * len(ptrs))(*ptrs)
        self._nargs = ctypes.c_int32(len(ptrs))

    @classmethod
    def from_dir(cls, path, device: int | None = None) -> "KernelLibrary":
        path = Path(path)
        meta = json.loads((path / "meta.json").read_text())
        return cls(path / f"lib{meta['name']}.so", meta, device)

    @classmethod
    def from_bytes(cls, library: bytes, meta: dict, device: int | None = None,
                   unpack_dir: os.PathLike | None = None) -> "KernelLibrary":
        """dlopen needs a file: the blob (after checking its hash) goes to the on-disk cache."""
        digest = meta["sha256"]["library"]
        return cls(cached_library(library_dir(unpack_dir), meta["name"], digest, lambda: library), meta, device)

    def shim_stats(self, reset: bool = False) -> dict[str, int] | None:
        """What this library's host code asked of the CUDA runtime shim so far: calls per cuda*
        entry point, and for its launches launch_ns (time in cudaLaunchKernelExC), driver_ns (of
        which in cuLaunchKernelEx) and context_checks. Counted only in a process started with
        MOE_AOT_SHIM_STATS=1; None otherwise, or for a library without the counters (linked with
        CUDA's cudart or an older shim). `reset` zeroes them after reading."""
        fn = getattr(self._lib, "moe_aot_shim_stats", None)  # ctypes: AttributeError when absent
        if fn is None:
            return None
        fn.argtypes, fn.restype = [ctypes.c_char_p, ctypes.c_size_t, ctypes.c_int], ctypes.c_int
        buf = ctypes.create_string_buffer(1 << 14)
        if fn(buf, len(buf), int(reset)) < 0:
            return None
        pairs = (line.rsplit(" ", 1) for line in buf.value.decode().splitlines())
        stats = {k: int(v) for k, v in pairs}
        stats["driver_ns"] = stats.pop("driver_launch_ns", 0)
        return stats

    @property
    def arg_names(self) -> list[str]:
        return [a["name"] for a in self._tensor_args]

    def _fill(self, structs, tensors, check: bool) -> None:
        if len(tensors) != len(self._tensor_args):
            raise KernelArgumentError(
                f"{self.name} takes {len(self._tensor_args)} tensors ({', '.join(self.arg_names)}), got {len(tensors)}")
        for arg, t, s in zip(self._tensor_args, tensors, structs):
            if check:
                check_tensor(arg, t, self.name)
            s.data = t.data_ptr()
            shape, stride = t.shape, t.stride()
            for j, m in enumerate(arg["dynamic_shape_modes"]):
                s.shape[j] = shape[m]
            for j, m in enumerate(arg["dynamic_stride_modes"]):
                s.stride[j] = stride[m]

    def __call__(self, *tensors: torch.Tensor, stream: int | None = None, check: bool = True) -> None:
        self._fill(self._structs, tensors, check)
        self._stream.value = torch.cuda.current_stream().cuda_stream if stream is None else stream
        self._ret.value = 0
        self._run(self._packed, self._nargs)
        if self._ret.value != 0:
            raise KernelLaunchError(f"{self.name}: launch failed (cudaError {self._ret.value})", self._ret.value)

    def bind(self, *tensors: torch.Tensor, check: bool = True) -> "BoundLaunch":
        """Argument structs filled once for these tensors' shapes; later launches only swap data
        pointers (BoundLaunch.set_data) -- the eager runtime's per-call host cost."""
        return BoundLaunch(self, tensors, check)


class BoundLaunch:
    """One kernel's packed arguments for fixed shapes. Only pointers change between calls, so a
    caller must pass tensors of the bound shapes and strides (MoeLayer checks that before)."""

    def __init__(self, lib: KernelLibrary, tensors, check: bool):
        self._lib = lib
        self._structs = [_struct_type(a)() for a in lib._tensor_args]
        lib._fill(self._structs, tensors, check)
        self._stream = ctypes.c_void_p(0)
        self._ret = ctypes.c_int32(0)
        ptrs = [ctypes.addressof(s) for s in self._structs]
        ptrs += [ctypes.addressof(self._stream), ctypes.addressof(self._ret)]
        self._packed = (ctypes.c_void_p * len(ptrs))(*ptrs)
        self._nargs = ctypes.c_int32(len(ptrs))

    def set_data(self, index: int, ptr: int) -> None:
        self._structs[index].data = ptr

    def __call__(self, stream: int) -> None:
        self._stream.value = stream
        self._ret.value = 0
        self._lib._run(self._packed, self._nargs)
        if self._ret.value != 0:
            raise KernelLaunchError(f"{self._lib.name}: launch failed (cudaError {self._ret.value})",
                                    self._ret.value)
