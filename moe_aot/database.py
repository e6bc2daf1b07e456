"""The kernel database: workloads, compiled artifacts, tuning records and deployed picks.

SQLite in cache/ by default (env.default_db_url()); any SQLAlchemy URL works, so a team can
share one PostgreSQL server. Keys fail closed: a different schema version, a corrupt file or a
library whose sha256 no longer matches raises DatabaseError instead of handing out a kernel.

A tuning record is keyed by what was measured: the measured binaries' content (a digest of the
variant's kernels' cubin sha256s), the GPU, the driver and the toolchain without its templates'
source hash (`measurement_toolchain`), so a cubin-identical template refactor keeps every
measurement. Which variant is fastest is derived from the records when asked (`top_k`); the
best table only holds what `moe-aot build` deployed for the runtime to read, each pick checked
against the default's record first (picks.derive_picks).
"""
from __future__ import annotations

import json
import math
import os
import re
import sqlite3
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable

from sqlalchemy import (
    Column,
    DateTime,
    Float,
    ForeignKey,
    Index,
    Integer,
    LargeBinary,
    MetaData,
    String,
    Table,
    Text,
    create_engine,
    event,
    exc,
    inspect,
    select,
)
from sqlalchemy.engine import Connection, make_url

from . import env
from .dbread import BUSY_TIMEOUT_S as _BUSY_TIMEOUT_S
from .dbread import (
    SCHEMA_VERSION,
    T_ARTIFACTS,
    T_BEST,
    T_RECORDS,
    T_VERSION,
    T_WORKLOADS,
    ArtifactVersion,
    BestRow,
    DatabaseError,
    KernelVersion,
    check_quick_check,
    check_schema_versions,
    corrupt,
    locked,
    no_database,
    no_schema,
    readonly_uri,
    unpack_checked,
)
from .dbread import first_line as _first_line
from .dbread import pack as _pack
from .dbread import sha as _sha
from .dbread import utc as _utc

ARTIFACT_STATUSES = ("ok", "failed")
RECORD_STATUSES = ("ok", "compile_error", "resource_error", "wrong_result", "launch_error")
_RETRIES = 3  # unique-key races between concurrent writers on server databases


_md = MetaData()
_version_t = Table(T_VERSION, _md,
                   Column("id", Integer, primary_key=True, autoincrement=False),
                   Column("version", Integer, nullable=False))
_workloads_t = Table(T_WORKLOADS, _md,
                     Column("key", String(255), primary_key=True),
                     Column("spec", Text, nullable=False),
                     Column("created_at", DateTime(timezone=True), nullable=False))
_artifacts_t = Table(T_ARTIFACTS, _md,
                     Column("name", String(255), primary_key=True),
                     Column("toolchain", String(255), primary_key=True),
                     Column("workload", String(255), ForeignKey("moe_aot_workloads.key"),
                            nullable=False, index=True),
                     Column("role", String(64), nullable=False),
                     Column("target", String(64), nullable=False),
                     Column("status", String(16), nullable=False),
                     Column("library", LargeBinary, nullable=True),
                     Column("cubin", LargeBinary, nullable=True),
                     Column("library_size", Integer, nullable=False),
                     Column("sha256", String(64), nullable=True),
                     Column("cubin_sha256", String(64), nullable=True),
                     Column("meta", Text, nullable=False),
                     Column("error", Text, nullable=True),
                     Column("compile_s", Float, nullable=True),
                     Column("created_at", DateTime(timezone=True), nullable=False))
_records_t = Table(T_RECORDS, _md,
                   Column("id", Integer, primary_key=True, autoincrement=True),
                   Column("workload", String(255), ForeignKey("moe_aot_workloads.key"),
                          nullable=False),
                   Column("target", String(64), nullable=False),
                   Column("toolchain", String(255), nullable=False),
                   Column("gpu", String(255), nullable=False),
                   Column("driver", String(64), nullable=False),
                   Column("tokens", Integer, nullable=False),
                   Column("variant", String(255), nullable=False),
                   Column("content", String(64), nullable=True),
                   Column("status", String(32), nullable=False),
                   Column("median_us", Float, nullable=True),
                   Column("stats", Text, nullable=False),
                   Column("rel_err", Float, nullable=True),
                   Column("error", Text, nullable=True),
                   Column("created_at", DateTime(timezone=True), nullable=False),
                   Index("ix_moe_aot_records_lookup", "workload", "target", "gpu", "tokens"))
_best_t = Table(T_BEST, _md,
                Column("workload", String(255), ForeignKey("moe_aot_workloads.key"),
                       primary_key=True),
                Column("target", String(64), primary_key=True),
                Column("gpu", String(255), primary_key=True),
                Column("toolchain", String(255), primary_key=True),
                Column("tokens", Integer, primary_key=True, autoincrement=False),
                Column("variant", String(255), nullable=False),
                Column("median_us", Float, nullable=False),
                Column("record_id", Integer, ForeignKey("moe_aot_records.id"), nullable=True),
                Column("updated_at", DateTime(timezone=True), nullable=False))


@dataclass(frozen=True)
class ArtifactRow:
    name: str
    workload: str
    role: str
    target: str
    toolchain: str
    status: str
    library: bytes | None
    cubin: bytes | None
    meta: dict
    error: str | None
    compile_s: float | None
    sha256: str | None
    created_at: datetime


@dataclass(frozen=True)
class ArtifactSummary:
    name: str
    workload: str
    role: str
    target: str
    toolchain: str
    status: str
    library_size: int
    compile_s: float | None
    error: str | None  # first line only
    created_at: datetime
    sha256: str | None = None
    cubin_sha256: str | None = None


@dataclass(frozen=True)
class RecordRow:
    id: int
    workload: str
    target: str
    toolchain: str
    gpu: str
    driver: str
    tokens: int
    variant: str
    content: str | None  # digest of the measured binaries; None where not known
    status: str
    median_us: float | None
    stats: dict
    rel_err: float | None
    error: str | None
    created_at: datetime

    @property
    def context(self) -> tuple[str, str, str]:
        """Where it was measured: records of one context are comparable with each other."""
        return self.gpu, self.driver, measurement_toolchain(self.toolchain)


def measurement_toolchain(toolchain: str) -> str:
    """The toolchain as far as it matters to a measurement: without the `|src<hash>` of the
    templates' sources, which the measured content (the cubins) already covers."""
    parts = toolchain.split("|")
    return "|".join(p for p in parts if not p.startswith("src")) if len(parts) > 1 else toolchain


# Untimed replays before each candidate's timed ones (measure_worker.GpuMeasurer): the H200's power
# cap takes hold within 0.25 s of a large layer's replays (NOTES, 2026-12-03, call 7: the benchmark's
# 0.25 s warm-up already timed at 1.41-1.46 GHz); twice that, for margin.
SUSTAINED_WARMUP_S = 0.5


def timing_context(driver: str, warmup_s: float) -> str:
    """The records' `driver` field for timings with `warmup_s` of untimed replays first: the
    driver, and the method where it is not the burst timing the records before it used. Records
    are compared only within one (GPU, driver, toolchain) context (RecordRow.context), so timings
    at the sustained clock are never ranked against timings partly at boost clock."""
    return f"{driver}; sustained {warmup_s:g} s" if warmup_s > 0 else driver


# optuna's RDB storage shares the database with the tuner's studies (tuner.open_storage)
_OPTUNA_TABLES = {"alembic_version", "version_info", "studies", "study_directions", "study_user_attributes",
                  "study_system_attributes", "trials", "trial_user_attributes", "trial_system_attributes",
                  "trial_params", "trial_values", "trial_intermediate_values", "trial_heartbeats"}


def _now() -> datetime:
    return datetime.now(timezone.utc)


def _dumps(obj: dict | None) -> str:
    return json.dumps(obj or {}, sort_keys=True, separators=(",", ":"))


def _filter(query, table: Table, **equal):
    """Adds col == value for every filter given (None means any)."""
    return query.where(*(table.c[k] == v for k, v in equal.items() if v is not None))


def _set_wal(cur) -> None:
    # Switching to WAL takes an exclusive lock that SQLite does not wait for through the busy
    # handler, so two processes creating the same database at once would see "locked" here.
    deadline = time.monotonic() + _BUSY_TIMEOUT_S
    while True:
        try:
            cur.execute("PRAGMA journal_mode = WAL")
            return
        except sqlite3.OperationalError as e:
            if "locked" not in str(e) or time.monotonic() > deadline:
                raise
            time.sleep(0.02)


class Database:
    """One open kernel database; see the module docstring."""

    def __init__(self, url: str | None = None, readonly: bool = False):
        self.url = url if url is not None else env.default_db_url()
        self.readonly = readonly
        self._engine = None
        self._where = f"the kernel database at {self.url!r}"
        try:
            parsed = make_url(self.url)
            self._where = f"the kernel database at {parsed.render_as_string(hide_password=True)}"
            self._sqlite = parsed.get_backend_name() == "sqlite"
            self._path = self._sqlite_path(parsed) if self._sqlite else None
            if self._path is not None:
                self._where = f"the kernel database {self._path}"
            self._engine = self._make_engine(parsed)
        except exc.ArgumentError as e:  # includes NoSuchModuleError: unknown dialect/driver
            shown = re.sub(r"//([^:/@]*):[^@/]*@", r"//\1:***@", self.url)
            raise DatabaseError(f"cannot use database URL {shown!r}: {_first_line(str(e))}; "
                                "use sqlite:///<file> or a SQLAlchemy URL such as "
                                "postgresql://user@host/db (set MOE_AOT_DB)") from None
        except ImportError as e:
            raise DatabaseError(f"cannot open {self._where}: its database driver is not "
                                f"installed ({e}); pip install it") from None
        try:
            if self._sqlite and self._path is not None:
                self._run("check the file", self._quick_check)
            self._run("check the schema", self._ensure_schema, write=not readonly)
        except BaseException:
            self._engine.dispose()
            raise

    # -- connection plumbing -----------------------------------------------------------------

    def _sqlite_path(self, parsed) -> Path | None:
        db = parsed.database or ""
        if db in ("", ":memory:") or parsed.query.get("uri") in ("true", "1"):
            return None
        path = Path(db).expanduser().resolve()
        if self.readonly and not path.is_file():
            raise no_database(path)
        if not self.readonly:
            try:
                path.parent.mkdir(parents=True, exist_ok=True)
            except OSError as e:
                raise DatabaseError(f"cannot create the folder for {self._where}: {e}; "
                                    "choose a writable location (MOE_AOT_DB or "
                                    "MOE_AOT_CACHE_DIR)") from None
        return path

    def _make_engine(self, parsed):
        if not self._sqlite:
            return create_engine(parsed, pool_pre_ping=True)
        kwargs: dict[str, Any] = {"connect_args": {"timeout": _BUSY_TIMEOUT_S}}
        if self.readonly and self._path is not None:
            ro_uri = readonly_uri(self._path)
            kwargs["creator"] = lambda: sqlite3.connect(
                ro_uri, uri=True, timeout=_BUSY_TIMEOUT_S, check_same_thread=False)
        engine = create_engine(parsed, **kwargs)
        readonly = self.readonly

        @event.listens_for(engine, "connect")
        def _on_connect(dbapi_conn, _record):
            # pysqlite's own implicit BEGIN would defeat BEGIN IMMEDIATE; we issue BEGIN below.
            dbapi_conn.isolation_level = None
            cur = dbapi_conn.cursor()
            cur.execute(f"PRAGMA busy_timeout = {_BUSY_TIMEOUT_S * 1000}")
            cur.execute("PRAGMA foreign_keys = ON")
            if not readonly:
                _set_wal(cur)
                # Safe against corruption in WAL mode; only the last commits may be lost on power
                # failure, which for a rebuildable cache is worth the fsync per transaction saved.
                cur.execute("PRAGMA synchronous = NORMAL")
            cur.close()

        @event.listens_for(engine, "begin")
        def _on_begin(conn):
            # Writers take the write lock up front so read-then-write (commit_best) cannot race
            # and never fails half way with a lock upgrade; readers never block in WAL mode.
            write = conn.get_execution_options().get("moe_aot_write", False)
            conn.exec_driver_sql("BEGIN IMMEDIATE" if write else "BEGIN")

        return engine

    def _explain(self, action: str, error: BaseException) -> str:
        orig = getattr(error, "orig", None) or error
        msg = _first_line(str(orig)) or type(orig).__name__
        low = msg.lower()
        if "not a database" in low or "malformed" in low:
            return str(corrupt(self._where, msg))
        if "locked" in low or "busy" in low:
            return str(locked(self._where, action))
        if isinstance(error, exc.IntegrityError):
            return (f"cannot {action} in {self._where}: {msg}; check that the workload and "
                    "record_id it refers to exist")
        if self.readonly and ("readonly" in low or "read-only" in low):
            return (f"cannot read {self._where} read-only ({msg}); SQLite needs to create its "
                    "-shm file next to it: make the folder writable or copy the file elsewhere")
        if "readonly" in low or "read-only" in low:
            return (f"cannot {action}: {self._where} is read-only; open it without "
                    "readonly=True and check the file's permissions")
        if "unable to open" in low:
            where = getattr(self, "_path", None)
            folder = where.parent if where is not None else None
            if not self.readonly and folder is not None and folder.is_dir() and not os.access(folder, os.W_OK):
                return (f"cannot {action}: the location {folder} is not writable (SQLite writes the "
                        "database and its journal there); choose a writable place with --db or MOE_AOT_DB")
            return (f"cannot open {self._where} ({msg}); check that the path exists and is a "
                    "readable file")
        if "disk is full" in low or "disk i/o" in low:
            return f"cannot {action} in {self._where} ({msg}); free disk space and retry"
        return (f"cannot {action} in {self._where}: {msg}; check that the database is "
                "reachable and was written by moe-aot")

    def _run(self, action: str, fn: Callable[[Connection], Any], *, write: bool = False):
        """Runs fn in one transaction, mapping every storage failure to DatabaseError."""
        if self._engine is None:
            raise DatabaseError(f"cannot {action}: {self._where} is closed; open a new Database")
        if write and self.readonly:
            raise DatabaseError(f"cannot {action}: {self._where} was opened read-only; open it "
                                "with readonly=False to write")
        for attempt in range(_RETRIES):
            try:
                with self._engine.connect() as conn:
                    conn.execution_options(moe_aot_write=write)
                    with conn.begin():
                        return fn(conn)
            except exc.IntegrityError as e:
                # A concurrent writer inserted the same key first; the retry sees its row.
                if attempt == _RETRIES - 1:
                    raise DatabaseError(self._explain(action, e)) from None
            except exc.SQLAlchemyError as e:
                raise DatabaseError(self._explain(action, e)) from None
            except sqlite3.Error as e:  # raised by our connect hook before SQLAlchemy wraps it
                raise DatabaseError(self._explain(action, e)) from None

    def _quick_check(self, conn: Connection) -> None:
        check_quick_check([r[0] for r in conn.exec_driver_sql("PRAGMA quick_check(1)")], self._where)

    def _ensure_schema(self, conn: Connection) -> None:
        if inspect(conn).has_table(_version_t.name):
            check_schema_versions(sorted({r[0] for r in conn.execute(select(_version_t.c.version))}),
                                  self._where)
            return
        if self.readonly:
            raise no_schema(self._where)
        foreign = set(inspect(conn).get_table_names()) - set(_md.tables) - _OPTUNA_TABLES
        if foreign:
            raise DatabaseError(f"{self._where} is not a moe-aot database: it holds other tables "
                                f"({', '.join(sorted(foreign)[:5])}) and no moe-aot schema; point MOE_AOT_DB "
                                "or --db at a new file or an empty database")
        _md.create_all(conn)
        conn.execute(_version_t.insert().values(id=1, version=SCHEMA_VERSION))

    def close(self) -> None:
        if self._engine is not None:
            self._engine.dispose()
            self._engine = None

    def __enter__(self) -> "Database":
        return self

    def __exit__(self, *_exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Database({self._where!r}, readonly={self.readonly})"

    @staticmethod
    def _require_workload(conn: Connection, workload: str, what: str) -> None:
        w = _workloads_t
        if conn.execute(select(w.c.key).where(w.c.key == workload)).first() is None:
            raise DatabaseError(f"cannot store {what}: workload {workload!r} is not in the "
                                "database; put_workload() it first")

    # -- workloads ---------------------------------------------------------------------------

    def put_workload(self, key: str, spec: dict) -> None:
        text = _dumps(spec)

        def put(conn: Connection) -> None:
            w = _workloads_t
            old = conn.execute(select(w.c.spec).where(w.c.key == key)).scalar()
            if old is None:
                conn.execute(_workloads_t.insert().values(key=key, spec=text, created_at=_now()))
            elif old != text:
                raise DatabaseError(f"workload {key!r} in {self._where} already has a different "
                                    "spec; give the new layer its own key")
        self._run(f"store workload {key!r}", put, write=True)

    def workload(self, key: str) -> dict | None:
        text = self._run("read a workload", lambda c: c.execute(
            select(_workloads_t.c.spec).where(_workloads_t.c.key == key)).scalar())
        return None if text is None else json.loads(text)

    # -- artifacts ---------------------------------------------------------------------------

    def put_artifact(self, *, name: str, workload: str, role: str, target: str, toolchain: str,
                     status: str, library: bytes | None = None, cubin: bytes | None = None,
                     meta: dict | None = None, error: str | None = None,
                     compile_s: float | None = None) -> None:
        if status not in ARTIFACT_STATUSES:
            raise ValueError(f"artifact status must be one of {ARTIFACT_STATUSES}, not {status!r}")
        if status == "ok" and library is None:
            raise ValueError(f"artifact {name!r} has status 'ok' but no library")
        if status == "failed" and (library is not None or cubin is not None or not error):
            raise ValueError(f"failed artifact {name!r} needs the compiler's error and no blobs")
        row = dict(name=name, toolchain=toolchain, workload=workload, role=role, target=target,
                   status=status, library=_pack(library), cubin=_pack(cubin),
                   library_size=len(library) if library is not None else 0,
                   sha256=_sha(library), cubin_sha256=_sha(cubin), meta=_dumps(meta),
                   error=error, compile_s=compile_s, created_at=_now())

        def put(conn: Connection) -> None:
            self._require_workload(conn, workload, f"artifact {name!r}")
            t = _artifacts_t
            conn.execute(t.delete().where(t.c.name == name, t.c.toolchain == toolchain))
            conn.execute(t.insert().values(**row))
        self._run(f"store artifact {name!r}", put, write=True)

    def get_artifact(self, name: str, toolchain: str) -> ArtifactRow | None:
        t = _artifacts_t
        r = self._run(f"read artifact {name!r}", lambda c: c.execute(
            select(t).where(t.c.name == name, t.c.toolchain == toolchain)).mappings().first())
        if r is None:
            return None
        library, cubin = unpack_checked(r["library"], r["cubin"], r["sha256"], r["cubin_sha256"], name,
                                        toolchain, self._where)
        return ArtifactRow(name=r["name"], workload=r["workload"], role=r["role"],
                           target=r["target"], toolchain=r["toolchain"], status=r["status"],
                           library=library, cubin=cubin, meta=json.loads(r["meta"]),
                           error=r["error"], compile_s=r["compile_s"], sha256=r["sha256"],
                           created_at=_utc(r["created_at"]))

    def has_artifact(self, name: str, toolchain: str, ok_only: bool = True) -> bool:
        t = _artifacts_t
        q = select(t.c.status).where(t.c.name == name, t.c.toolchain == toolchain)
        status = self._run(f"look up artifact {name!r}", lambda c: c.execute(q).scalar())
        return status is not None and (status == "ok" or not ok_only)

    def list_artifacts(self, workload: str | None = None, target: str | None = None,
                       status: str | None = None, name: str | None = None) -> list[ArtifactSummary]:
        t = _artifacts_t
        q = select(t.c.name, t.c.workload, t.c.role, t.c.target, t.c.toolchain, t.c.status,
                   t.c.library_size, t.c.compile_s, t.c.error, t.c.created_at, t.c.sha256,
                   t.c.cubin_sha256)
        q = _filter(q, t, workload=workload, target=target, status=status, name=name)
        rows = self._run("list artifacts", lambda c: c.execute(
            q.order_by(t.c.name, t.c.toolchain)).mappings().all())
        return [ArtifactSummary(**{**r, "error": _first_line(r["error"]),
                                   "created_at": _utc(r["created_at"])}) for r in rows]

    # -- tuning records ----------------------------------------------------------------------

    def add_record(self, *, workload: str, target: str, toolchain: str, gpu: str, driver: str,
                   tokens: int, variant: str, status: str, content: str | None = None,
                   median_us: float | None = None, stats: dict | None = None,
                   rel_err: float | None = None, error: str | None = None) -> int:
        row = dict(workload=workload, target=target, toolchain=toolchain, gpu=gpu, driver=driver,
                   tokens=tokens, variant=variant, content=content, status=status,
                   median_us=median_us, stats=stats, rel_err=rel_err, error=error)
        return self._run("store a tuning record", lambda conn: self._insert_record(conn, **row),
                         write=True)

    def _insert_record(self, conn: Connection, *, status: str, stats: dict | None, tokens: int,
                       **row) -> int:
        if status not in RECORD_STATUSES:
            raise ValueError(f"record status must be one of {RECORD_STATUSES}, not {status!r}")
        self._require_workload(conn, row["workload"], "a tuning record")
        return conn.execute(_records_t.insert().values(
            **row, tokens=int(tokens), status=status, stats=_dumps(stats),
            created_at=_now())).inserted_primary_key[0]

    @staticmethod
    def _record_row(r) -> RecordRow:
        return RecordRow(**{**r, "stats": json.loads(r["stats"]), "created_at": _utc(r["created_at"])})

    def _first_record(self, conn: Connection, key: dict):
        """The first record measured of `key`'s content in its context (see the module doc)."""
        if not key.get("content"):
            raise ValueError("a measurement key needs the measured content (picks.variant_content)")
        t = _records_t
        rows = conn.execute(select(t).where(
            *(t.c[k] == key[k] for k in ("workload", "target", "gpu", "driver", "tokens", "content")))
            .order_by(t.c.id)).mappings().all()
        base = measurement_toolchain(key["toolchain"])
        return next((r for r in rows if measurement_toolchain(r["toolchain"]) == base), None)

    def find_record(self, *, workload: str, target: str, gpu: str, driver: str, toolchain: str,
                    tokens: int, content: str) -> RecordRow | None:
        """The first record of this content at this bucket, GPU, driver and toolchain, if any."""
        key = dict(workload=workload, target=target, gpu=gpu, driver=driver, toolchain=toolchain,
                   tokens=int(tokens), content=content)
        r = self._run("read a tuning record", lambda c: self._first_record(c, key))
        return None if r is None else self._record_row(r)

    def add_record_once(self, **row) -> tuple[int, RecordRow | None]:
        """add_record unless a record of the same content, workload, target, GPU, driver,
        toolchain and token count exists; then that record's (id, row) comes back instead.
        Concurrent tuning workers that both measured one variant thus keep one record: the
        workload's row is locked first (FOR UPDATE on servers; SQLite's write transaction is
        already exclusive)."""
        if row.get("status") not in RECORD_STATUSES:
            raise ValueError(f"record status must be one of {RECORD_STATUSES}, not {row.get('status')!r}")

        def add(conn: Connection):
            w = _workloads_t
            conn.execute(select(w.c.key).where(w.c.key == row["workload"]).with_for_update()).first()
            r = self._first_record(conn, {**row, "tokens": int(row["tokens"])})
            if r is not None:
                return r["id"], self._record_row(r)
            return self._insert_record(conn, **row), None
        return self._run("store a tuning record", add, write=True)

    def records(self, workload: str | None = None, target: str | None = None,
                gpu: str | None = None, tokens: int | None = None) -> list[RecordRow]:
        t = _records_t
        q = _filter(select(t), t, workload=workload, target=target, gpu=gpu, tokens=tokens)
        rows = self._run("read tuning records", lambda c: c.execute(
            q.order_by(t.c.id)).mappings().all())
        return [self._record_row(r) for r in rows]

    def top_k(self, workload: str, target: str, gpu: str, tokens: int, k: int = 1,
              driver: str | None = None, toolchain: str | None = None) -> list[RecordRow]:
        """The k fastest valid ("ok") records of a bucket, fastest first (earlier on ties);
        with driver and toolchain, only those measured in that context."""
        ok = [r for r in self.records(workload, target, gpu, tokens) if r.status == "ok"
              and (driver is None or r.driver == driver) and (toolchain is None or
              measurement_toolchain(r.toolchain) == measurement_toolchain(toolchain))]
        return sorted(ok, key=lambda r: (r.median_us, r.id))[:k]

    # -- deployed picks: what the runtime reads (written by `moe-aot build` and after tuning) --

    def commit_best(self, *, workload: str, target: str, gpu: str, toolchain: str, tokens: int,
                    variant: str, median_us: float, record_id: int | None = None,
                    force: bool = False) -> bool:
        if not (isinstance(median_us, (int, float)) and math.isfinite(median_us)
                and median_us > 0):
            raise ValueError(f"median_us must be a positive finite number, not {median_us!r}")
        t = _best_t
        key = (t.c.workload == workload, t.c.target == target, t.c.gpu == gpu,
               t.c.toolchain == toolchain, t.c.tokens == int(tokens))
        values = dict(variant=variant, median_us=float(median_us), record_id=record_id,
                      updated_at=_now())

        def commit(conn: Connection) -> bool:
            self._require_workload(conn, workload, "a best pick")
            # FOR UPDATE serialises server databases; SQLite already holds BEGIN IMMEDIATE.
            current = conn.execute(select(t.c.median_us).where(*key).with_for_update()).scalar()
            if current is None:
                conn.execute(t.insert().values(workload=workload, target=target, gpu=gpu,
                                               toolchain=toolchain, tokens=int(tokens), **values))
                return True
            if not force and median_us >= current:
                return False
            conn.execute(t.update().where(*key).values(**values))
            return True
        return self._run("commit a best pick", commit, write=True)

    def all_best(self, workload: str | None = None, target: str | None = None,
                 gpu: str | None = None, toolchain: str | None = None) -> list[BestRow]:
        t = _best_t
        q = _filter(select(t), t, workload=workload, target=target, gpu=gpu,
                    toolchain=toolchain)
        q = q.order_by(t.c.workload, t.c.target, t.c.gpu, t.c.toolchain, t.c.tokens)
        rows = self._run("read best picks", lambda c: c.execute(q).mappings().all())
        return [BestRow(**{**r, "updated_at": _utc(r["updated_at"])}) for r in rows]

    def best(self, workload: str, target: str, gpu: str, toolchain: str) -> dict[int, BestRow]:
        return {r.tokens: r for r in self.all_best(workload, target, gpu, toolchain)}


class SqlAlchemyReader:
    """The same reads on any SQLAlchemy URL (a team's PostgreSQL server, say)."""

    def __init__(self, url: str):
        self.db = Database(url, readonly=True)

    def artifact_versions(self, name: str) -> list[ArtifactVersion]:
        return [ArtifactVersion(a.toolchain, a.status, a.created_at)
                for a in self.db.list_artifacts(name=name)]

    def kernel_versions(self, names: list[str]) -> list[KernelVersion]:
        return [KernelVersion(a.name, a.toolchain, a.status, a.created_at, a.sha256, None)
                for n in names for a in self.db.list_artifacts(name=n)]

    def artifact(self, name: str, toolchain: str) -> tuple[bytes, dict]:
        a = self.db.get_artifact(name, toolchain)
        if a is None:
            raise DatabaseError(f"artifact {name} (toolchain {toolchain}) vanished from the kernel "
                                "database while it was being read")
        return a.library, a.meta

    def best(self, workload: str, target: str) -> list[BestRow]:
        return self.db.all_best(workload=workload, target=target)

    def close(self) -> None:
        self.db.close()
