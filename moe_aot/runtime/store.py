"""Read-only access to the kernel database for the runtime: load a kernel library by name for
this GPU, and the tuned picks per token bucket. Fails closed: an artifact built for another arch
or another host CPU (an aarch64 DGX Spark library on an x86-64 machine), an unknown artifact
format or a CUDA flavour newer than the driver is a miss, never a launch.
A SQLite database is read with the standard library (`dbread`), so the runtime does not import
SQLAlchemy; other URLs go through `database.Database`."""
from __future__ import annotations

import ctypes
import json
import warnings

from .. import env
from ..dbread import SqliteReader, sqlite_file
from ..hosts import this_host
from ..spec import LayerSpec
from ..variants import BackwardVariant, backward_workload, parse_variant
from .library import KernelLaunchError, KernelLibrary, cached_library, libcuda, library_dir, other_host

# 1: linked with CUDA's static cudart, 2: with the project's runtime shim. Both load the same way
# and both are self-contained, so a database compiled before the shim keeps working (the newest
# build of a kernel is loaded; `moe-aot build` again gives format 2).
ARTIFACT_FORMATS = {1, 2}



def open_reader(url: str):
    """The runtime's reader of a kernel database: a SQLite file with the standard library alone
    (dbread.SqliteReader), any other URL through SQLAlchemy (database.SqlAlchemyReader, imported
    only then: the runtime on SQLite never imports SQLAlchemy)."""
    path = sqlite_file(url)
    if path is not None:
        return SqliteReader(path)
    from ..database import SqlAlchemyReader

    return SqlAlchemyReader(url)

class KernelMissingError(LookupError):
    """No usable kernel for this name and GPU in the database."""


def parse_toolchain(key: str) -> dict:
    parts = key.split("|")  # dsl|cuXX.Y|arch|host|fmtN[|src<templates hash>]
    if len(parts) not in (5, 6) or not parts[1].startswith("cu") or not parts[4].startswith("fmt"):
        raise ValueError(f"unrecognised toolchain key {key!r}")
    major, minor = parts[1][2:].split(".")
    return {"dsl": parts[0], "cuda": (int(major), int(minor)), "arch": parts[2], "host": parts[3],
            "format": int(parts[4][3:])}


def driver_cuda_version() -> tuple[int, int]:
    v = ctypes.c_int(0)
    lib = libcuda()
    if lib.cuDriverGetVersion(ctypes.byref(v)) != 0:
        raise RuntimeError("cuDriverGetVersion failed")
    return v.value // 1000, (v.value % 1000) // 10


def usable(toolchain: str, target: str, driver: tuple[int, int] | None) -> tuple[bool, str]:
    try:
        tc = parse_toolchain(toolchain)
    except ValueError as exc:
        return False, str(exc)
    if tc["arch"] != target:
        return False, f"built for {tc['arch']}, this GPU needs {target}"
    if tc["format"] not in ARTIFACT_FORMATS:
        return False, f"artifact format {tc['format']} is unknown to this runtime"
    if tc["host"] != this_host():
        return False, other_host(tc["host"])
    if driver is not None and tc["cuda"][0] > driver[0]:
        return False, f"built with CUDA {tc['cuda'][0]}, the driver supports CUDA {driver[0]}.{driver[1]}"
    return True, "ok"


class KernelStore:
    def __init__(self, url: str | None = None, unpack_dir=None):
        self.db = open_reader(url if url is not None else env.default_db_url())
        self.unpack_dir = unpack_dir
        try:
            self._driver = driver_cuda_version()
        except (OSError, RuntimeError):
            self._driver = None

    def load(self, name: str, target: str, device: int | None = None) -> KernelLibrary:
        return self.load_many([name], target, device)[name]

    def load_many(self, names: list[str], target: str, device: int | None = None) -> dict[str, KernelLibrary]:
        """The newest usable build of each kernel (a layer's four: one query for all), loaded
        from the on-disk cache of extracted libraries; the database's blob is read only when the
        cache does not hold the library's exact bytes."""
        names = list(dict.fromkeys(names))
        versions = self.db.kernel_versions(names)
        chosen = {}
        for name in names:
            why = []
            for a in sorted((v for v in versions if v.name == name), key=lambda a: a.created_at, reverse=True):
                ok, reason = usable(a.toolchain, target, self._driver)
                if a.status != "ok":
                    why.append(f"{a.toolchain}: compile failed")
                    continue
                if not ok:
                    why.append(f"{a.toolchain}: {reason}")
                    continue
                chosen[name] = a
                break
            else:
                detail = "; ".join(why) if why else "not in the database"
                raise KernelMissingError(f"kernel {name} for {target}: {detail}. Run `moe-aot compile` or "
                                         f"`moe-aot build` for this model and target first.")
        folder = library_dir(self.unpack_dir)
        libs = {}
        for name, a in chosen.items():
            if a.meta is None:  # a reader that gives metadata only with the blobs
                library, meta = self.db.artifact(name, a.toolchain)
                fetch = lambda library=library: library  # noqa: E731
            else:
                meta = json.loads(a.meta)
                fetch = lambda name=name, a=a: self.db.artifact(name, a.toolchain)[0]  # noqa: E731
            digest = meta["sha256"]["library"]
            if a.sha256 is not None and a.sha256 != digest:
                raise KernelLaunchError(f"{name}: stored library is corrupt (its sha256 and its metadata's "
                                        "disagree); recompile it with `moe-aot compile ...`")
            libs[name] = KernelLibrary(cached_library(folder, name, digest, fetch), meta, device)
        return libs

    def has_kernels(self, names: list[str], target: str) -> bool:
        """Whether every named kernel has a usable build here (one query, nothing loaded)."""
        versions = self.db.kernel_versions(list(dict.fromkeys(names)))
        ok = {v.name for v in versions if v.status == "ok" and usable(v.toolchain, target, self._driver)[0]}
        return all(n in ok for n in names)

    def picks(self, spec: LayerSpec, gpu: str, backward: bool = False) -> dict:
        """Tuned picks per token bucket for this GPU, or {} (defaults) with a warning that says
        what differed when the database holds picks for another GPU or toolchain only: the
        forward's LayerVariants (or DecodeVariants, where the one-launch kernel won its bucket),
        or with ``backward`` the backward's BackwardVariants."""
        parse = BackwardVariant.parse if backward else parse_variant
        rows = self.db.best(backward_workload(spec) if backward else spec.workload_key, spec.target)
        mine = [r for r in rows if r.gpu == gpu and usable(r.toolchain, spec.target, self._driver)[0]]
        if not mine:
            if rows:
                others = sorted({f"{r.gpu} ({r.toolchain})" for r in rows})
                warnings.warn(f"no tuned kernels for {gpu} in the database (it has picks for "
                              f"{', '.join(others)}); using the default variants", RuntimeWarning, stacklevel=3)
            return {}
        newest = max(mine, key=lambda r: r.updated_at).toolchain
        return {r.tokens: parse(r.variant) for r in mine if r.toolchain == newest}
