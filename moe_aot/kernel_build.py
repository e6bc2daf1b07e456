"""Compile one CuTe DSL kernel object on a CPU-only machine into a loadable artifact.

An artifact is everything the runtime needs and nothing of the DSL: a self-contained shared
library (the DSL's exported host launcher with its embedded fatbin, linked against the DSL's tiny
static runtime and the project's CUDA runtime shim `cudart_shim.c`, the runtime entry points
those call written over the driver API, so it needs only libc and libcuda.so.1), for the host
CPU beside the target's GPU (hosts.py: x86-64, or aarch64 for the DGX Spark, linked with Debian's
cross compiler and the DSL's aarch64 runtime archive), the cubin and PTX for
inspection, and metadata: the host ABI (entry points, one C struct per tensor argument), the
compile-time assumptions the runtime must check before launching (static modes, divisibility,
alignment) and the toolchain fingerprint.

This module imports `cutlass` lazily, inside the functions that need it, so that importing the
package never pulls in the DSL.
"""
from __future__ import annotations

import ctypes
import fcntl
import hashlib
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

from . import env
from .gemm_limits import gpu_arch
from .hosts import HOSTS, TARGET_HOSTS, Host, this_host

# The DSL's --host-target per host (hosts.py says why these baselines).
HOST_TARGET_X86_64 = HOSTS["x86-64"].llvm_target
HOST_TARGET_AARCH64 = HOSTS["aarch64"].llvm_target
RUNTIME_ARCHIVE = "libcuda_dialect_runtime_static.a"
# 1: libraries linked with CUDA's static cudart; 2: with cudart_shim.c (same cubins, another host
# link). The format is part of every artifact's toolchain key, so a build never reuses a format-1
# library as a format-2 one.
ARTIFACT_FORMAT = 2
CUDART_SHIM = Path(__file__).resolve().parent / "cudart_shim.c"


class KernelCompileError(RuntimeError):
    """The DSL or the linker refused a kernel; the message carries the tool's own words."""


class HostToolchainError(RuntimeError):
    """No linker or no DSL runtime archive for the host a target's libraries run on: nothing of
    the batch can link, so the build stops before compiling (no kernel is recorded as failed)."""


class TemplateBugError(RuntimeError):
    """A template's own Python failed while the DSL traced it (a NameError, TypeError, ...):
    a programming error, which must stop the run, not be recorded as one kernel's failure."""


# Python errors of the template's code that reach us wrapped by the DSL: bugs, not refusals.
# (A compile-time assert, a ValueError refusing a shape, and the DSL's, ptxas' and the linker's
# own failures remain KernelCompileError.)
PROGRAMMING_ERRORS = (NameError, TypeError, AttributeError, IndexError, KeyError, ZeroDivisionError,
                      RecursionError, SyntaxError)


def _template_bug(exc: BaseException) -> BaseException | None:
    """The Python programming error behind a DSL compile failure, if that is what it was."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, PROGRAMMING_ERRORS) and not type(exc).__module__.startswith("cutlass"):
            return exc
        exc = exc.__cause__ or exc.__context__
    return None


@dataclass
class Artifact:
    name: str
    library: bytes
    cubin: bytes
    ptx: str
    meta: dict = field(default_factory=dict)

    def write_dir(self, path) -> Path:
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        (path / f"lib{self.name}.so").write_bytes(self.library)
        (path / f"{self.name}.cubin").write_bytes(self.cubin)
        (path / f"{self.name}.ptx").write_text(self.ptx)
        # Metadata last: its presence marks a complete artifact folder.
        tmp = path / "meta.json.tmp"
        tmp.write_text(json.dumps(self.meta, indent=1, sort_keys=True))
        tmp.replace(path / "meta.json")
        return path


_runtime_loaded = False


def _load_dsl_runtime() -> Path:
    """export_to_c JIT-links the host module, which needs the DSL's _cuda* wrappers in-process."""
    global _runtime_loaded
    from cutlass.cute.runtime import find_runtime_libraries

    libs = find_runtime_libraries(enable_tvm_ffi=False)
    if not _runtime_loaded:
        for lib in libs:
            ctypes.CDLL(lib, mode=ctypes.RTLD_GLOBAL)
        _runtime_loaded = True
    return Path(libs[0]).parent


def toolchain_fingerprint(arch: str, host: str | None = None) -> dict:
    """What an artifact of target `arch` built here depends on; `host` (a hosts.HOSTS name)
    defaults to the target's own (hosts.TARGET_HOSTS). A stand-in target (gemm_limits.STANDINS)
    keeps its own name as "arch", the key runtimes match, and adds the arch its machine code is
    for as "gpu_arch" (absent for every other target, whose fingerprints are unchanged)."""
    import cutlass
    from cutlass.base_dsl.version_info import CUDA_VERSION

    fp = {
        "dsl": f"nvidia-cutlass-dsl=={cutlass.__version__}",
        "cuda_flavour": f"cu{CUDA_VERSION.major}.{CUDA_VERSION.minor}",
        "arch": arch,
        "host_target": HOSTS[host or TARGET_HOSTS[arch]].llvm_target,
        "artifact_format": ARTIFACT_FORMAT,
        "cudart_shim": shim_digest(),
    }
    if gpu_arch(arch) != arch:
        fp["gpu_arch"] = gpu_arch(arch)
    return fp


def _sym(value):
    """A static int, or None for a dynamic (symbolic) mode."""
    return value if isinstance(value, int) else None


def _tensor_abi(name: str, fake) -> dict:
    shape, stride = tuple(fake.shape), tuple(fake.stride)
    dyn_shape = [i for i, d in enumerate(fake.dynamic_shapes_mask) if d]
    dyn_stride = [i for i, d in enumerate(fake.dynamic_strides_mask) if d]
    widths = {getattr(shape[i], "width", 32) for i in dyn_shape}
    return {
        "name": name,
        "kind": "tensor",
        "dtype": str(fake.element_type),
        "rank": len(shape),
        "static_shape": [_sym(s) for s in shape],
        "static_stride": [_sym(s) for s in stride],
        "dynamic_shape_modes": dyn_shape,
        "dynamic_stride_modes": dyn_stride,
        "shape_divisibility": [getattr(s, "divisibility", 1) if _sym(s) is None else None for s in shape],
        "stride_divisibility": [getattr(s, "divisibility", 1) if _sym(s) is None else None for s in stride],
        "shape_c_type": "int64" if widths == {64} else "int32",
        "stride_c_type": "int32" if getattr(fake, "_use_32bit_stride", False) else "int64",
        "assumed_align": int(fake._assumed_align or 1),
    }


def shim_digest() -> str:
    """sha256 of the CUDA runtime shim's source: part of the toolchain fingerprint, so a changed
    shim is a new toolchain and never hides behind libraries linked with the old one."""
    return hashlib.sha256(CUDART_SHIM.read_bytes()).hexdigest()


def link_command(obj: Path, out: Path, runtime_dir: Path, cc: str = "gcc",
                 archive: Path | None = None) -> list[str]:
    """The host link of one kernel library: the DSL's exported object, the DSL's static runtime
    (only the members the object needs are pulled in) and the CUDA runtime shim, compiled with
    hidden visibility. -z defs: a cuda* function the shim lacks fails the link instead of the
    launch. -Bsymbolic: the library's _cuda* calls bind to its own copies even beside other CUDA
    users. libdl/libpthread only where glibc still splits them off (as-needed). For another host
    `cc` is its cross compiler and `archive` that host's build of the DSL's runtime."""
    static_rt = archive or runtime_dir / RUNTIME_ARCHIVE
    return [cc, "-shared", "-fPIC", "-O2", "-fvisibility=hidden", "-o", str(out), str(obj), str(static_rt),
            str(CUDART_SHIM), "-Wl,-z,defs", "-Wl,--as-needed", "-ldl", "-lpthread", "-Wl,--exclude-libs,ALL",
            "-Wl,-Bsymbolic", "-s"]


def _link(obj: Path, out: Path, runtime_dir: Path, cc: str = "gcc", archive: Path | None = None) -> None:
    static_rt = archive or runtime_dir / RUNTIME_ARCHIVE
    for needed in (static_rt, CUDART_SHIM):
        if not needed.exists():
            raise KernelCompileError(f"cannot link the kernel library: {needed} is missing")
    proc = subprocess.run(link_command(obj, out, runtime_dir, cc, archive), capture_output=True, text=True)
    if proc.returncode != 0:
        raise KernelCompileError(f"linking {out.name} failed: {proc.stderr.strip()[-2000:]}")


def elf_machines(archive: bytes) -> set[int]:
    """e_machine of every object in an `ar` archive (empty if it holds none or is no archive)."""
    if not archive.startswith(b"!<arch>\n"):
        return set()
    machines, at = set(), 8
    while at + 60 <= len(archive):
        name, size = archive[at:at + 16].strip(), int(archive[at + 48:at + 58])
        body = archive[at + 60:at + 60 + size]
        if name not in (b"/", b"//", b"/SYM64/"):
            machines.add(int.from_bytes(body[18:20], "little") if body[:4] == b"\x7fELF" else -1)
        at += 60 + size + (size & 1)
    return machines


def _dsl_libs_dist() -> tuple[str, str]:
    """The DSL wheel that holds the static runtime archive (nvidia-cutlass-dsl-libs-cu13 for the
    cu13 flavour) and its installed version: another host's archive is taken from the same
    version's wheel for that host."""
    from importlib.metadata import PackageNotFoundError, version

    from cutlass.base_dsl.version_info import CUDA_VERSION

    dist = f"nvidia-cutlass-dsl-libs-cu{CUDA_VERSION.major}"
    try:
        return dist, version(dist)
    except PackageNotFoundError:
        raise HostToolchainError(f"{dist} is not installed, so its runtime archive for another host "
                                 "cannot be matched to it") from None


def cross_runtime_archive(host: Host) -> Path:
    """`host`'s build of the DSL's static runtime archive, from the installed DSL version's wheel
    for that host: fetched with pip at first use into env.host_runtime_dir() (one download per
    machine and version, under a lock shared by parallel compile workers), checked to hold only
    objects for that host, written atomically."""
    dist, ver = _dsl_libs_dist()
    path = env.host_runtime_dir() / f"{dist}-{ver}" / host.triple / RUNTIME_ARCHIVE
    if path.is_file():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.parent / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if path.is_file():
            return path
        with tempfile.TemporaryDirectory(prefix="moe_aot_wheel_") as tmp:
            cmd = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:",
                   "--platform", host.wheel_platform, "--dest", tmp, f"{dist}=={ver}"]
            proc = subprocess.run(cmd, capture_output=True, text=True)
            wheels = sorted(Path(tmp).glob("*.whl"))
            if proc.returncode != 0 or not wheels:
                raise HostToolchainError(
                    f"could not fetch {dist}=={ver} for {host.wheel_platform} (`{shlex.join(cmd[1:])}`: "
                    f"{proc.stderr.strip()[-500:]}); place its {RUNTIME_ARCHIVE} at {path} to build offline")
            with zipfile.ZipFile(wheels[0]) as whl:
                members = [n for n in whl.namelist() if n.endswith(f"/lib/{RUNTIME_ARCHIVE}")]
                data = whl.read(members[0]) if len(members) == 1 else b""
        if elf_machines(data) != {host.elf_machine}:
            raise HostToolchainError(f"{wheels[0].name} holds no {RUNTIME_ARCHIVE} of {host.name} objects")
        fd, tmp_path = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.chmod(tmp_path, 0o644)
        os.replace(tmp_path, path)
    return path


def host_toolchain(host: Host) -> tuple[str, Path | None]:
    """(C compiler driver, runtime archive or None for the installed DSL's own) that link
    libraries for `host`: this machine's gcc for its own host, else Debian's cross compiler and
    the archive for that host. Raises HostToolchainError saying what to install."""
    if host.name == this_host():
        return "gcc", None
    if shutil.which(host.cross_cc) is None:
        raise HostToolchainError(
            f"linking {host.name} host code on this {this_host()} machine needs the cross compiler "
            f"{host.cross_cc} (Debian: apt-get install {host.cross_package})")
    return host.cross_cc, cross_runtime_archive(host)


def compile_kernel(kernel_obj, arch: str, name: str, host: str | None = None) -> Artifact:
    """Compile `kernel_obj` (a template instance with `fake_arguments()` and a @cute.jit
    `__call__`) for target `arch` (a stand-in: for its gemm_limits.gpu_arch) and return its
    artifact. `name` becomes the C symbol prefix; `host`
    (a hosts.HOSTS name) defaults to the host beside the target's GPU (hosts.TARGET_HOSTS)."""
    if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name):
        raise ValueError(f"artifact name {name!r} must be a C identifier")
    import cutlass.cute as cute

    host = host or TARGET_HOSTS[arch]
    host_target = HOSTS[host].llvm_target
    cc, archive = host_toolchain(HOSTS[host])
    runtime_dir = _load_dsl_runtime()
    named = list(kernel_obj.fake_arguments())
    fakes = [f for _, f in named]
    with tempfile.TemporaryDirectory(prefix="moe_aot_build_") as tmp:
        tmp = Path(tmp)
        (tmp / "dump").mkdir()
        opts = (f"--gpu-arch {gpu_arch(arch)} --keep-cubin --keep-ptx --dump-dir {tmp / 'dump'} "
                f"--host-target {shlex.quote(host_target)}")
        t0 = time.perf_counter()
        try:
            compiled = cute.compile(kernel_obj, *fakes, options=opts)
        except Exception as exc:  # the DSL raises many types; keep its message, minus colour codes
            text = re.sub(r"\x1b\[[0-9;]*m", "", str(exc)).strip()
            bug = _template_bug(exc)
            if bug is not None:
                raise TemplateBugError(f"{name}: {type(bug).__name__} in the template's code: {bug}") from exc
            raise KernelCompileError(f"{type(exc).__name__}: {text}") from exc
        t_compile = time.perf_counter() - t0
        cubin, ptx = compiled.__cubin__, compiled.__ptx__
        if not isinstance(cubin, bytes) or not isinstance(ptx, str):
            raise KernelCompileError("the DSL kept no cubin/PTX (keep options ignored)")
        t0 = time.perf_counter()
        compiled.export_to_c(str(tmp), name, name)
        obj = tmp / f"{name}.o"
        lib_path = tmp / f"lib{name}.so"
        _link(obj, lib_path, runtime_dir, cc, archive)
        t_link = time.perf_counter() - t0
        library = lib_path.read_bytes()

    args = []
    for arg_name, fake in named:
        if fake is None:  # an optional tensor left out (e.g. no expert biases): no argument of the kernel
            continue
        if hasattr(fake, "dynamic_shapes_mask"):
            args.append(_tensor_abi(arg_name, fake))
        else:
            args.append({"name": arg_name, "kind": "stream"})
    if args[-1]["kind"] != "stream" or any(a["kind"] == "stream" for a in args[:-1]):
        raise KernelCompileError("a kernel must take tensors and one final stream argument")

    fn = compiled.function_name
    meta = {
        "name": name,
        "host_abi": {
            "init": f"_mlir_{name}_cuda_init",
            "load_to_device": f"_mlir_{name}_cuda_load_to_device",
            "run": f"_mlir_{name}__mlir_ciface_{fn}",
        },
        "kernels": sorted(compiled.kernel_info.keys()),
        "args": args,
        "toolchain": toolchain_fingerprint(arch, host),
        "ptx_isa": (re.search(r"\.version\s+([\d.]+)", ptx) or [None, None])[1],
        "sizes": {"library": len(library), "cubin": len(cubin), "ptx": len(ptx)},
        "sha256": {"library": hashlib.sha256(library).hexdigest(), "cubin": hashlib.sha256(cubin).hexdigest()},
        "timing_s": {"compile": round(t_compile, 3), "export_and_link": round(t_link, 3)},
    }
    return Artifact(name=name, library=library, cubin=cubin, ptx=ptx, meta=meta)
