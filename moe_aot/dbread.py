"""Read-only access to the kernel database with the Python standard library alone.

The runtime only ever reads a few things: which builds of a layer's kernels are stored (with
their metadata and sha256, all four kernels in one query), one kernel's library when the on-disk
cache does not hold it, and the deployed picks of a layer. For a SQLite file (the default)
this module reads them with `sqlite3`, so a serving process never imports SQLAlchemy (its
import was most of the runtime's cold start). Any other URL goes through
`database.SqlAlchemyReader` (runtime.store.open_reader picks one).

This module also owns what both readers must agree on: the schema version, the table names,
how blobs are packed and checked, the error type and its sentences. It imports neither
SQLAlchemy nor `database.py` (which imports it: no cycle).
"""
# No `from __future__ import annotations`: typing.NamedTuple compiles every string annotation
# (ForwardRef), twice the cost of the three row types' evaluated ones at import.
import hashlib
import json
import os
import zlib
from datetime import datetime, timezone
from pathlib import Path
from typing import NamedTuple
from urllib.parse import quote, unquote

# 2: tuning records carry the measured content (a digest of the kernels' cubins), the key that
# measurements are found by; picks are derived from records, the best table holds deployed picks.
SCHEMA_VERSION = 2
BUSY_TIMEOUT_S = 30
# Table names carry a prefix because optuna's RDB storage may live in the same database.
T_VERSION, T_WORKLOADS = "moe_aot_schema_version", "moe_aot_workloads"
T_ARTIFACTS, T_RECORDS, T_BEST = "moe_aot_artifacts", "moe_aot_records", "moe_aot_best"


class DatabaseError(RuntimeError):
    """A storage failure, phrased as one sentence a user can act on."""


class NoDatabaseError(DatabaseError):
    """There is no kernel database yet (no file, or a file without our schema): nothing was
    compiled for this machine. Every other DatabaseError means a database that is there is broken."""


# -- what both readers share -----------------------------------------------------------------

def pack(blob: bytes | None) -> bytes | None:
    """Kernel libraries (45-90 KB with the CUDA runtime shim) compress well: a database of many
    tuning candidates then still travels to the GPU machine. The sha256 covers the raw bytes."""
    return None if blob is None else zlib.compress(blob, 6)


def unpack(blob: bytes | None) -> bytes | None:
    if blob is None or blob[:4] == b"\x7fELF":  # stored raw (older rows)
        return blob
    return zlib.decompress(blob)


def sha(blob: bytes | None) -> str | None:
    return None if blob is None else hashlib.sha256(blob).hexdigest()


def unpack_checked(library, cubin, library_sha, cubin_sha, name: str, toolchain: str, where: str):
    """(library, cubin) unpacked, or DatabaseError when either no longer matches its sha256."""
    try:
        lib, cub = unpack(library), unpack(cubin)
    except zlib.error:
        lib = cub = None
    if lib is None and library is not None or sha(lib) != library_sha or sha(cub) != cubin_sha:
        raise DatabaseError(f"artifact {name} (toolchain {toolchain}) in {where} is corrupt: its "
                            "stored binary no longer matches its sha256; recompile it with "
                            "`moe-aot compile ...` to replace it")
    return lib, cub


def utc(value: datetime) -> datetime:
    # SQLite hands back naive datetimes; everything stored here was UTC.
    return value.replace(tzinfo=timezone.utc) if value.tzinfo is None else value


def first_line(text: str | None) -> str | None:
    return None if text is None else (text.strip().splitlines() or [""])[0]


def no_database(path: Path) -> DatabaseError:
    return NoDatabaseError(f"no kernel database at {path}; run `moe-aot compile ...` first")


def corrupt(where: str, msg: str) -> DatabaseError:
    return DatabaseError(f"{where} is corrupt or not a SQLite database ({msg}); move it aside "
                         "and rebuild it with `moe-aot build`")


def check_quick_check(rows: list, where: str) -> None:
    """Raise unless SQLite's `PRAGMA quick_check(1)` answered "ok"."""
    if rows != ["ok"]:
        raise DatabaseError(f"{where} is corrupt (quick_check: {rows[0] if rows else '?'}); move it "
                            "aside and rebuild it with `moe-aot build`")


def locked(where: str, action: str) -> DatabaseError:
    return DatabaseError(f"{where} stayed locked by another process for {BUSY_TIMEOUT_S} s while "
                         f"trying to {action}; retry once the other writer has finished")


def check_schema_versions(found: list[int], where: str) -> None:
    if found == [SCHEMA_VERSION]:
        return
    shown = ", ".join(map(str, found)) or "none"
    raise DatabaseError(f"{where} has schema version {shown} but this moe-aot uses schema "
                        f"version {SCHEMA_VERSION}; rebuild it with this version (`moe-aot build`) "
                        "or use a matching moe-aot")


def no_schema(where: str) -> DatabaseError:
    return NoDatabaseError(f"{where} holds no moe-aot schema; run `moe-aot compile ...` first")


def readonly_uri(path: Path) -> str:
    """SQLite URI opening `path` read-only. A WAL database baked into a read-only folder (a
    container image) cannot get its -shm file, so plain mode=ro fails; with no -wal pending the
    main file holds every commit, and the sha256 check still guards blobs against a late writer."""
    uri = f"file:{quote(str(path))}?mode=ro"
    if not os.access(path.parent, os.W_OK) and not Path(f"{path}-wal").exists():
        uri += "&immutable=1"
    return uri


def sqlite_file(url: str) -> Path | None:
    """The file of a plain `sqlite:///<path>` URL (resolved), or None for anything else (other
    databases, in-memory, URLs with options), which the SQLAlchemy reader handles."""
    for prefix in ("sqlite:///", "sqlite+pysqlite:///"):
        if url.startswith(prefix):
            rest = url[len(prefix):]
            if not rest or "?" in rest or rest == ":memory:":
                return None
            # os.path, not Path.expanduser().resolve(): the same realpath, less pathlib
            return Path(os.path.realpath(os.path.expanduser(unquote(rest))))
    return None


# -- the runtime's view ----------------------------------------------------------------------

# Row types are NamedTuples rather than frozen dataclasses: the same immutable values with
# equality, at a third of the import cost (the runtime's import is part of every cold start).
class ArtifactVersion(NamedTuple):
    toolchain: str
    status: str
    created_at: datetime


class KernelVersion(NamedTuple):
    """One stored build of a kernel without its binaries: what the store needs to choose a
    version and to find its library in the on-disk cache. `meta` is the metadata's JSON text, or
    None where the reader does not give it without the blobs (then `artifact` is read)."""
    name: str
    toolchain: str
    status: str
    created_at: datetime
    sha256: str | None
    meta: str | None


class BestRow(NamedTuple):
    """The deployed pick of one (workload, target, GPU, toolchain, token bucket): written only
    after it was derived from the records (or a text export) and checked against the default."""
    workload: str
    target: str
    gpu: str
    toolchain: str
    tokens: int
    variant: str
    median_us: float
    record_id: int | None
    updated_at: datetime


def _when(value) -> datetime:
    return utc(value if isinstance(value, datetime) else datetime.fromisoformat(value))


def _sqlite_module():
    """The SQLite binding: CPython's `_sqlite3` extension itself, which the `sqlite3` package
    re-exports unchanged (`sqlite3.dbapi2`: `from _sqlite3 import *`, plus datetime adapters and
    converters the reader never uses: it binds only text and reads no declared types). Importing
    the package first cost ~0.8 ms of every open (two more modules found and run) on the CPU
    machine. Imported here, not at import time: importing the runtime opens no database."""
    try:
        import _sqlite3
    except ImportError:  # an implementation without it
        import sqlite3 as _sqlite3
    return _sqlite3


class SqliteReader:
    """The runtime's reads on a SQLite file, standard library only."""

    def __init__(self, path: Path):
        self.path = path
        self._where = f"the kernel database {path}"
        if not path.is_file():
            raise no_database(path)
        sqlite3 = _sqlite_module()
        self._sqlite_error = sqlite3.Error
        try:
            self._con = sqlite3.connect(readonly_uri(path), uri=True, timeout=BUSY_TIMEOUT_S,
                                        check_same_thread=False)
        except sqlite3.Error as e:
            raise self._error("open the file", e) from None
        # No PRAGMA quick_check here: it reads the whole file (most of the time to open a
        # deployment's database) yet vouches for no blob's content. What the runtime uses is
        # guarded where it is read: SQLite reports a damaged page it touches (-> corrupt()), and
        # every library is checked against its sha256.
        # One query: a file without our schema answers "no such table" (asked first in a query
        # of its own before, which cost a second statement in every process's open).
        try:
            try:
                rows = self._con.execute(f"SELECT version FROM {T_VERSION}").fetchall()
            except sqlite3.OperationalError as e:
                if str(e) == f"no such table: {T_VERSION}":
                    raise no_schema(self._where) from None
                raise self._error("check the schema", e) from None
            except sqlite3.Error as e:
                raise self._error("check the schema", e) from None
            check_schema_versions(sorted({r[0] for r in rows}), self._where)
        except BaseException:
            self._con.close()
            raise

    def _error(self, action: str, e: BaseException) -> DatabaseError:
        msg = first_line(str(e)) or type(e).__name__
        low = msg.lower()
        if "not a database" in low or "malformed" in low:
            return corrupt(self._where, msg)
        if "locked" in low or "busy" in low:
            return locked(self._where, action)
        if "readonly" in low or "read-only" in low or "unable to open" in low:
            return DatabaseError(f"cannot read {self._where} read-only ({msg}); SQLite needs to "
                                 "create its -shm file next to it: make the folder writable or copy "
                                 "the file elsewhere")
        return DatabaseError(f"cannot {action} in {self._where}: {msg}; check that the database "
                             "was written by moe-aot")

    def _query(self, action: str, sql: str, args: tuple = ()) -> list:
        if self._con is None:
            raise DatabaseError(f"cannot {action}: {self._where} is closed; open a new store")
        try:
            return self._con.execute(sql, args).fetchall()
        except self._sqlite_error as e:
            raise self._error(action, e) from None

    def artifact_versions(self, name: str) -> list[ArtifactVersion]:
        rows = self._query(f"look up kernel {name!r}", f"SELECT toolchain, status, created_at FROM "
                           f"{T_ARTIFACTS} WHERE name = ? ORDER BY toolchain", (name,))
        return [ArtifactVersion(t, s, _when(c)) for t, s, c in rows]

    def kernel_versions(self, names: list[str]) -> list[KernelVersion]:
        """Every stored build of these kernels (a layer's four at once), in one query, no blobs."""
        rows = self._query("look up kernels " + ", ".join(names), "SELECT name, toolchain, status, created_at, "
                           f"sha256, meta FROM {T_ARTIFACTS} WHERE name IN ({', '.join('?' * len(names))}) "
                           "ORDER BY name, toolchain", tuple(names))
        return [KernelVersion(n, t, s, _when(c), h, m) for n, t, s, c, h, m in rows]

    def artifact(self, name: str, toolchain: str) -> tuple[bytes, dict]:
        rows = self._query(f"read artifact {name!r}", f"SELECT library, cubin, sha256, cubin_sha256, "
                           f"meta FROM {T_ARTIFACTS} WHERE name = ? AND toolchain = ?", (name, toolchain))
        if not rows:
            raise DatabaseError(f"artifact {name} (toolchain {toolchain}) vanished from {self._where}")
        library, cubin, lib_sha, cub_sha, meta = rows[0]
        lib, _ = unpack_checked(library, cubin, lib_sha, cub_sha, name, toolchain, self._where)
        return lib, json.loads(meta)

    def best(self, workload: str, target: str) -> list[BestRow]:
        rows = self._query("read best picks", f"SELECT workload, target, gpu, toolchain, tokens, variant, "
                           f"median_us, record_id, updated_at FROM {T_BEST} WHERE workload = ? AND "
                           "target = ? ORDER BY gpu, toolchain, tokens", (workload, target))
        return [BestRow(*r[:8], _when(r[8])) for r in rows]

    def close(self) -> None:
        if self._con is not None:
            self._con.close()
            self._con = None
