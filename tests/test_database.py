"""The kernel database: round trips, idempotence, fail-closed opens and concurrent writers."""
from __future__ import annotations

import dataclasses
import multiprocessing as mp
import os
import sqlite3

import pytest

from moe_aot import database as dbmod
from moe_aot import dbread
from moe_aot.database import ArtifactRow, Database, DatabaseError

SPEC = {"E": 8, "top_k": 2, "H": 1024, "I": 512, "activation": "swiglu", "precision": "bf16"}
TC = "cutlass-dsl-4.8.1+cuda13.0"


def _url(path) -> str:
    return f"sqlite:///{path}"


def _ok(db: Database, name: str, library: bytes = b"\x7fELF-lib", **kw) -> None:
    db.put_artifact(name=name, workload="w", role="glu", target="sm_90a", toolchain=TC,
                    status="ok", library=library, cubin=b"cubin-" + name.encode(),
                    meta={"abi": 1, "align": 16}, compile_s=1.5, **kw)


@pytest.fixture
def db(tmp_path):
    with Database(_url(tmp_path / "sub" / "k.sqlite")) as d:
        d.put_workload("w", SPEC)
        yield d


def test_default_url_comes_from_env(tmp_path, monkeypatch):
    monkeypatch.setenv("MOE_AOT_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("MOE_AOT_DB", raising=False)
    with Database() as d:
        d.put_workload("w", SPEC)
    assert (tmp_path / "cache" / "moe_aot.sqlite").is_file()


def test_workload_round_trip_and_idempotence(db):
    db.put_workload("w", dict(reversed(list(SPEC.items()))))  # same spec, other key order
    assert db.workload("w") == SPEC
    assert db.workload("missing") is None
    with pytest.raises(DatabaseError, match="different spec"):
        db.put_workload("w", {**SPEC, "E": 16})


def test_artifact_round_trip(db):
    _ok(db, "moe_glu_a", library=b"L" * 1000)
    row = db.get_artifact("moe_glu_a", TC)
    assert isinstance(row, ArtifactRow)
    assert (row.name, row.workload, row.role, row.target, row.toolchain, row.status) == (
        "moe_glu_a", "w", "glu", "sm_90a", TC, "ok")
    assert row.library == b"L" * 1000 and row.cubin == b"cubin-moe_glu_a"
    assert row.meta == {"abi": 1, "align": 16} and row.compile_s == 1.5 and row.error is None
    assert len(row.sha256) == 64 and row.created_at.tzinfo is not None
    with pytest.raises(dataclasses.FrozenInstanceError):
        row.name = "other"  # frozen
    assert db.get_artifact("moe_glu_a", "other-toolchain") is None
    assert db.has_artifact("moe_glu_a", TC) and not db.has_artifact("nope", TC)


def test_failed_artifact_keeps_message_and_can_be_replaced(db):
    db.put_artifact(name="moe_glu_b", workload="w", role="glu", target="sm_90a", toolchain=TC,
                    status="failed", error="ptxas error: too many resources\nline 2",
                    compile_s=0.2)
    row = db.get_artifact("moe_glu_b", TC)
    assert row.status == "failed" and row.library is None and row.cubin is None
    assert row.error.startswith("ptxas error: too many resources")
    assert not db.has_artifact("moe_glu_b", TC) and db.has_artifact("moe_glu_b", TC, ok_only=False)
    [summary] = db.list_artifacts(status="failed")
    assert summary.error == "ptxas error: too many resources" and summary.library_size == 0
    _ok(db, "moe_glu_b")  # a later successful compile replaces the failed entry
    assert db.get_artifact("moe_glu_b", TC).status == "ok" and db.has_artifact("moe_glu_b", TC)
    assert len(db.list_artifacts()) == 1


def test_idempotent_reput_and_listing(db):
    _ok(db, "b_variant", library=b"x" * 10)
    _ok(db, "a_variant", library=b"y" * 20)
    _ok(db, "a_variant", library=b"z" * 30)  # re-put replaces
    db.put_workload("w2", {**SPEC, "E": 64})
    db.put_artifact(name="c_variant", workload="w2", role="down", target="sm_100a",
                    toolchain=TC, status="ok", library=b"q")
    names = [a.name for a in db.list_artifacts()]
    assert names == ["a_variant", "b_variant", "c_variant"]
    assert [a.library_size for a in db.list_artifacts(workload="w")] == [30, 10]
    assert [a.name for a in db.list_artifacts(target="sm_100a")] == ["c_variant"]
    assert db.list_artifacts(status="failed") == []
    assert db.get_artifact("a_variant", TC).library == b"z" * 30


def test_bad_arguments_are_value_errors(db):
    with pytest.raises(ValueError):
        db.put_artifact(name="x", workload="w", role="glu", target="t", toolchain=TC,
                        status="maybe")
    with pytest.raises(ValueError):
        db.put_artifact(name="x", workload="w", role="glu", target="t", toolchain=TC,
                        status="failed", library=b"x", error="e")
    with pytest.raises(ValueError):
        db.add_record(workload="w", target="t", toolchain=TC, gpu="g", driver="d", tokens=1,
                      variant="v", status="fast")
    with pytest.raises(ValueError):
        db.commit_best(workload="w", target="t", gpu="g", toolchain=TC, tokens=1, variant="v",
                       median_us=float("nan"))


def test_unknown_workload_is_a_database_error(db):
    with pytest.raises(DatabaseError, match="put_workload"):
        db.put_artifact(name="x", workload="nope", role="glu", target="t", toolchain=TC,
                        status="ok", library=b"l")
    with pytest.raises(DatabaseError, match="put_workload"):
        db.add_record(workload="nope", target="t", toolchain=TC, gpu="g", driver="d", tokens=1,
                      variant="v", status="ok")


def _record(db, tokens=16, variant="v1", status="ok", **kw):
    return db.add_record(workload="w", target="sm_90a", toolchain=TC, gpu="H200", driver="580",
                         tokens=tokens, variant=variant, status=status, **kw)


def test_records_round_trip_and_filters(db):
    a = _record(db, median_us=12.5, stats={"p10": 12.0, "n": 100}, rel_err=4e-3)
    b = _record(db, tokens=128, status="wrong_result", rel_err=0.5, error="mismatch")
    c = _record(db, status="compile_error", error="ptxas")
    assert a < b < c
    rows = db.records()
    assert [r.id for r in rows] == [a, b, c]
    assert rows[0].stats == {"p10": 12.0, "n": 100} and rows[0].median_us == 12.5
    assert rows[0].rel_err == 4e-3 and rows[0].gpu == "H200" and rows[0].driver == "580"
    assert rows[1].error == "mismatch" and rows[1].median_us is None
    assert [r.id for r in db.records(tokens=16)] == [a, c]
    assert [r.id for r in db.records(workload="w", target="sm_90a", gpu="H200", tokens=128)] == [b]
    assert db.records(gpu="B200") == []


def test_commit_best(db):
    r1 = _record(db, median_us=10.0)
    key = dict(workload="w", target="sm_90a", gpu="H200", toolchain=TC)
    assert db.commit_best(**key, tokens=16, variant="v1", median_us=10.0, record_id=r1)
    assert not db.commit_best(**key, tokens=16, variant="v2", median_us=11.0)
    assert not db.commit_best(**key, tokens=16, variant="v2", median_us=10.0)
    assert db.commit_best(**key, tokens=16, variant="v3", median_us=9.0)
    assert db.commit_best(**key, tokens=1, variant="v4", median_us=3.0)
    best = db.best(**key)
    assert sorted(best) == [1, 16]
    assert (best[16].variant, best[16].median_us, best[16].record_id) == ("v3", 9.0, None)
    assert db.commit_best(**key, tokens=16, variant="v5", median_us=20.0, force=True)
    assert db.best(**key)[16].variant == "v5"
    assert db.best("w", "sm_90a", "H200", "other-tc") == {}
    db.put_workload("w2", SPEC)
    db.commit_best(workload="w2", target="sm_100a", gpu="B200", toolchain=TC, tokens=8,
                   variant="v", median_us=1.0)
    assert [(b.workload, b.tokens) for b in db.all_best()] == [("w", 1), ("w", 16), ("w2", 8)]
    assert [b.workload for b in db.all_best(gpu="B200")] == ["w2"]


def test_readonly(tmp_path):
    path = tmp_path / "k.sqlite"
    with pytest.raises(DatabaseError, match="no kernel database at .*moe-aot compile"):
        Database(_url(path), readonly=True)
    assert not path.exists()
    with Database(_url(path)) as d:
        d.put_workload("w", SPEC)
        _ok(d, "v")
    with Database(_url(path), readonly=True) as ro:
        assert ro.get_artifact("v", TC).library == b"\x7fELF-lib"
        with pytest.raises(DatabaseError, match="read-only"):
            _ok(ro, "v2")
        with pytest.raises(DatabaseError, match="read-only"):
            ro.put_workload("w3", SPEC)
        with pytest.raises(DatabaseError, match="read-only"):
            ro.commit_best(workload="w", target="t", gpu="g", toolchain=TC, tokens=1,
                           variant="v", median_us=1.0)
        # Even past our own guard, SQLite itself refuses the write.
        ro.readonly = False
        with pytest.raises(DatabaseError, match="read-only"):
            ro.put_workload("w4", SPEC)


def test_an_unwritable_location_is_named_as_such(tmp_path, monkeypatch):
    """SQLite's "unable to open database file" for a new database in a folder we may not write
    says that the location is not writable (root ignores permissions, so os.access is the
    stand-in), and still says "check that the path exists" where the folder is writable."""
    folder = tmp_path / "ro"
    folder.mkdir()
    db = Database(_url(folder / "k.sqlite"))
    err = sqlite3.OperationalError("unable to open database file")
    assert "check that the path exists" in db._explain("create the schema", err)
    monkeypatch.setattr(dbmod.os, "access", lambda p, mode: not (mode == os.W_OK and str(p) == str(folder)))
    why = db._explain("create the schema", err)
    assert f"the location {folder} is not writable" in why and "--db" in why
    db.close()


def test_readonly_in_unwritable_folder(tmp_path, monkeypatch):
    # Root ignores permissions, so the unwritable folder is simulated; the point is that this
    # path opens (immutable) and reads, where plain mode=ro cannot create the -shm file.
    path = tmp_path / "k.sqlite"
    with Database(_url(path)) as d:
        d.put_workload("w", SPEC)
        _ok(d, "v")
    assert not (tmp_path / "k.sqlite-wal").exists()
    monkeypatch.setattr(dbread.os, "access", lambda p, mode: mode != os.W_OK)
    assert dbread.readonly_uri(path).endswith("&immutable=1")
    with Database(_url(path), readonly=True) as ro:
        assert ro.get_artifact("v", TC).status == "ok"
    reader = dbread.SqliteReader(path)  # the runtime's reader takes the same path
    assert reader.artifact("v", TC)[0] == b"\x7fELF-lib"
    reader.close()


def test_closed_database_raises(db):
    db.close()
    with pytest.raises(DatabaseError, match="closed"):
        db.list_artifacts()


def _write_many(url: str, tag: str, n: int) -> None:
    with Database(url) as d:
        d.put_workload("w", SPEC)  # both processes race on this too
        for i in range(n):
            _ok(d, f"{tag}_{i:03d}", library=os.urandom(256))
            _record(d, tokens=i, variant=f"{tag}_{i}", median_us=float(i + 1))


def _commit_many(url: str, seed: int, values: list[float]) -> None:
    with Database(url) as d:
        d.put_workload("w", SPEC)
        for i, v in enumerate(values):
            d.commit_best(workload="w", target="sm_90a", gpu="H200", toolchain=TC,
                          tokens=[1, 16, 256][i % 3], variant=f"p{seed}_{i}", median_us=v)


def _record_once_many(url: str, worker: int, n: int) -> None:
    # Both workers add the same n variants, in opposite orders, as two tuners measuring them would.
    with Database(url) as d:
        d.put_workload("w", SPEC)
        for i in (range(n) if worker == 0 else reversed(range(n))):
            d.add_record_once(workload="w", target="sm_90a", toolchain=TC, gpu="H200", driver="580",
                              tokens=16, variant=f"once_{i}", content=f"c{i}", status="ok", median_us=1.0 + worker,
                              stats={"worker": worker}, rel_err=None, error=None)


def _check_record_once(url: str, n: int) -> None:
    with Database(url, readonly=True) as d:
        once = [r for r in d.records() if r.variant.startswith("once_")]
    assert sorted(r.variant for r in once) == sorted(f"once_{i}" for i in range(n))


def test_add_record_once_keeps_the_first_record(db):
    tc = "nvidia-cutlass-dsl==4.8.1|cu13.0|sm_90a|x86-64|fmt1|srcaaaa"
    kw = dict(workload="w", target="sm_90a", toolchain=tc, gpu="H200", driver="580", tokens=16,
              variant="v", content="c1", rel_err=None, error=None)
    rid, prev = db.add_record_once(**kw, status="ok", median_us=5.0, stats={"n": 1})
    assert prev is None
    rid2, prev2 = db.add_record_once(**kw, status="ok", median_us=9.0, stats={"n": 2})
    assert rid2 == rid and prev2.median_us == 5.0 and prev2.stats == {"n": 1}
    # A template refactor that left the cubins alone: new source hash, same content, same record.
    refactor = {**kw, "toolchain": tc.replace("srcaaaa", "srcbbbb")}
    assert db.add_record_once(**refactor, status="ok", median_us=7.0, stats={})[0] == rid
    assert db.find_record(**{k: refactor[k] for k in ("workload", "target", "gpu", "driver", "toolchain",
                                                       "tokens", "content")}).id == rid
    # Other binaries under the same name, another driver, another DSL: each a measurement of its own.
    ids = {db.add_record_once(**{**kw, **change}, status="ok", median_us=7.0, stats={})[0]
           for change in ({"content": "c2"}, {"driver": "590"}, {"toolchain": tc.replace("4.8.1", "4.9.0")})}
    assert rid not in ids and len(ids) == 3 and len(db.records()) == 4
    assert dbmod.measurement_toolchain(tc) == "nvidia-cutlass-dsl==4.8.1|cu13.0|sm_90a|x86-64|fmt1"
    with pytest.raises(ValueError, match="record status"):
        db.add_record_once(**kw, status="fast", median_us=1.0, stats={})
    with pytest.raises(ValueError, match="content"):
        db.add_record_once(**{**kw, "content": None}, status="ok", median_us=1.0, stats={})


def test_top_k_is_the_fastest_valid_record_not_the_newest(db):
    for i, (us, status) in enumerate([(9.0, "ok"), (4.0, "ok"), (1.0, "wrong_result"), (6.0, "ok")]):
        _record(db, variant=f"v{i}", median_us=us, status=status)
    assert [r.variant for r in db.top_k("w", "sm_90a", "H200", 16, k=2)] == ["v1", "v3"]
    assert db.top_k("w", "sm_90a", "H200", 16, driver="other") == []


def test_two_processes_add_record_once_keep_one_record_each(tmp_path):
    url = _url(tmp_path / "k.sqlite")
    _run_two(_record_once_many, (url, 0, 150), (url, 1, 150))
    _check_record_once(url, 150)


def _run_two(target, args_a, args_b):
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=target, args=a) for a in (args_a, args_b)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=120)
    assert [p.exitcode for p in procs] == [0, 0]


def test_two_processes_write_concurrently_without_loss(tmp_path):
    url = _url(tmp_path / "k.sqlite")
    n = 200
    _run_two(_write_many, (url, "a", n), (url, "b", n))
    with Database(url, readonly=True) as d:
        assert len(d.list_artifacts()) == 2 * n
        assert len(d.records()) == 2 * n
        assert len({r.variant for r in d.records()}) == 2 * n
        assert d.get_artifact("b_199", TC).status == "ok"


def test_two_processes_commit_best_to_the_true_minimum(tmp_path):
    import random
    url = _url(tmp_path / "k.sqlite")
    vals = {s: [random.Random(s).uniform(1.0, 100.0) for _ in range(150)] for s in (1, 2)}
    _run_two(_commit_many, (url, 1, vals[1]), (url, 2, vals[2]))
    expected = {}
    for s, vs in vals.items():
        for i, v in enumerate(vs):
            t = [1, 16, 256][i % 3]
            if t not in expected or v < expected[t][0]:
                expected[t] = (v, f"p{s}_{i}")
    with Database(url, readonly=True) as d:
        best = d.best("w", "sm_90a", "H200", TC)
    assert {t: (b.median_us, b.variant) for t, b in best.items()} == expected


def test_truncated_database_is_a_database_error(tmp_path):
    path = tmp_path / "k.sqlite"
    with Database(_url(path)) as d:
        d.put_workload("w", SPEC)
        for i in range(20):
            _ok(d, f"v{i}", library=os.urandom(20_000))
    assert not (tmp_path / "k.sqlite-wal").exists() or os.path.getsize(str(path) + "-wal") == 0
    os.truncate(path, os.path.getsize(path) // 2)
    for readonly in (True, False):
        with pytest.raises(DatabaseError, match="corrupt"):
            with Database(_url(path), readonly=readonly) as d:
                d.list_artifacts()
                d.get_artifact("v19", TC)


def test_garbage_file_is_a_database_error(tmp_path):
    path = tmp_path / "k.sqlite"
    path.write_bytes(b"this is not sqlite at all\n" * 200)
    for readonly in (True, False):
        with pytest.raises(DatabaseError, match="corrupt or not a SQLite database"):
            Database(_url(path), readonly=readonly)


def test_altered_library_blob_is_refused(tmp_path):
    path = tmp_path / "k.sqlite"
    with Database(_url(path)) as d:
        d.put_workload("w", SPEC)
        _ok(d, "v", library=b"A" * 64)
    con = sqlite3.connect(path)
    con.execute("UPDATE moe_aot_artifacts SET library = ? WHERE name = 'v'", (b"B" * 64,))
    con.commit()
    con.close()
    with Database(_url(path)) as d:
        with pytest.raises(DatabaseError, match="artifact v .*corrupt"):
            d.get_artifact("v", TC)
        assert d.has_artifact("v", TC)  # cheap check loads no blob; get_artifact guards use
        _ok(d, "v", library=b"A" * 64)  # recompiling repairs it
        assert d.get_artifact("v", TC).library == b"A" * 64


def test_schema_version_mismatch_names_both_versions(tmp_path):
    path = tmp_path / "k.sqlite"
    Database(_url(path)).close()
    con = sqlite3.connect(path)
    con.execute("UPDATE moe_aot_schema_version SET version = 999")
    con.commit()
    con.close()
    for readonly in (True, False):
        with pytest.raises(DatabaseError, match=f"version 999.*version {dbmod.SCHEMA_VERSION}"):
            Database(_url(path), readonly=readonly)


def test_non_moe_sqlite_file_opened_readonly(tmp_path):
    path = tmp_path / "other.sqlite"
    con = sqlite3.connect(path)
    con.execute("CREATE TABLE t (x)")
    con.close()
    with pytest.raises(DatabaseError, match="no moe-aot schema"):
        Database(_url(path), readonly=True)


@pytest.mark.parametrize("url", ["nosuchdialect://u@h/db", "not a url", "sqlite+nodriver:///x"])
def test_bad_url_is_a_database_error(url):
    with pytest.raises(DatabaseError, match="cannot use database URL"):
        Database(url)


def test_unreachable_path_is_a_database_error(tmp_path):
    (tmp_path / "adir.sqlite").mkdir()
    with pytest.raises(DatabaseError, match="adir.sqlite"):
        Database(_url(tmp_path / "adir.sqlite"))


# Server databases (PostgreSQL for teams): set MOE_AOT_TEST_DB_URL to an empty scratch database.
_SERVER_URL = os.environ.get("MOE_AOT_TEST_DB_URL")


@pytest.mark.skipif(not _SERVER_URL, reason="MOE_AOT_TEST_DB_URL not set")
def test_server_database_round_trip_and_concurrent_best():
    from sqlalchemy import create_engine
    engine = create_engine(_SERVER_URL)
    dbmod._md.drop_all(engine)
    engine.dispose()
    with Database(_SERVER_URL) as d:
        d.put_workload("w", SPEC)
        d.put_workload("w", SPEC)
        _ok(d, "v", library=b"\x00\xff" * 100)
        _ok(d, "v", library=b"\x01" * 10)
        assert d.get_artifact("v", TC).library == b"\x01" * 10
        rid = _record(d, median_us=5.0, stats={"n": 3})
        assert d.records()[0].stats == {"n": 3}
        assert d.commit_best(workload="w", target="sm_90a", gpu="H200", toolchain=TC, tokens=16,
                             variant="v", median_us=5.0, record_id=rid)
    vals = {s: [float(x) for x in range(200 + s, 0, -3)] for s in (1, 2)}
    _run_two(_commit_many, (_SERVER_URL, 1, vals[1]), (_SERVER_URL, 2, vals[2]))
    _run_two(_write_many, (_SERVER_URL, "a", 50), (_SERVER_URL, "b", 50))
    with Database(_SERVER_URL, readonly=True) as d:
        best = d.best("w", "sm_90a", "H200", TC)
        assert len(d.list_artifacts()) == 101 and len(d.records()) == 101
    _run_two(_record_once_many, (_SERVER_URL, 0, 100), (_SERVER_URL, 1, 100))
    _check_record_once(_SERVER_URL, 100)
    for i, t in enumerate([1, 16, 256]):
        expected = min(v for s in vals for j, v in enumerate(vals[s]) if j % 3 == i)
        assert best[t].median_us == (min(expected, 5.0) if t == 16 else expected)


def test_a_foreign_sqlite_file_is_refused_and_left_alone(tmp_path):
    path = tmp_path / "app.sqlite"
    con = sqlite3.connect(path)
    con.execute("CREATE TABLE users (id INTEGER PRIMARY KEY, name TEXT)")
    con.commit()
    con.close()
    with pytest.raises(DatabaseError, match="is not a moe-aot database.*users"):
        Database(f"sqlite:///{path}")
    con = sqlite3.connect(path)
    assert [r[0] for r in con.execute("SELECT name FROM sqlite_master WHERE type='table'")] == ["users"]
    con.close()
