"""The runtime on a CPU machine: import isolation, argument checks, fail-closed lookups."""
import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from moe_aot import dbread
from moe_aot.compiler import compile_into
from moe_aot.database import Database
from moe_aot.harness.reference import routing_reference
from moe_aot.layout import max_tiles, split_gate_up
from moe_aot.runtime.layer import MoeLayer, prepare_weights
from moe_aot.runtime.library import KernelArgumentError, check_tensor
from moe_aot.runtime.store import KernelMissingError, KernelStore, usable
from moe_aot.spec import make_spec
from moe_aot.variants import GemmTiles, LayerVariant, default_variant


@pytest.mark.parametrize("harness", [False, True], ids=["runtime", "with_harness"])
def test_runtime_imports_neither_dsl_nor_tuner_nor_compiler(small_db, harness):
    # Nor SQLAlchemy when the database is a SQLite file: opening it and reading picks and a
    # kernel's bytes takes the standard library only (most of the cold start was that import).
    # The runtime and the integrations do not import the harness (references, checks, timer);
    # the harness, which the GPU machine's measuring side runs, adds none of the heavy modules.
    url, spec = small_db
    name = default_variant(spec, 16).kernels(spec)[1].name
    code = ("import sys, moe_aot.runtime.layer, moe_aot.runtime.store, moe_aot.runtime.fp8\n"
            "import moe_aot.integrations, moe_aot.integrations.modules, moe_aot.integrations.parallel\n"
            + ("import moe_aot.harness.verify, moe_aot.harness.measure, moe_aot.harness.fp8\n" if harness else "")
            + "from moe_aot.spec import make_spec\n"
            f"store = moe_aot.runtime.store.KernelStore({url!r})\n"
            "store.picks(make_spec(experts=8, top_k=2, hidden=256, intermediate=128), 'NVIDIA H200')\n"
            f"[v] = [v for v in store.db.artifact_versions({name!r})]\n"
            f"assert store.db.artifact({name!r}, v.toolchain)[0][:4] == b'\\x7fELF'\n"
            "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('cutlass', 'optuna', "
            "'moe_aot_templates', 'sqlalchemy') or m in ('moe_aot.compiler', 'moe_aot.kernel_build', "
            "'moe_aot.tuner', 'moe_aot.database')"
            + ("" if harness else " or m.startswith('moe_aot.harness')") + ")\n"
            "print(bad); sys.exit(1 if bad else 0)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


ARG = {"name": "x", "kind": "tensor", "dtype": "BFloat16", "rank": 2, "static_shape": [None, 256],
       "static_stride": [None, 1], "dynamic_shape_modes": [0], "dynamic_stride_modes": [0],
       "shape_divisibility": [1, None], "stride_divisibility": [8, None], "shape_c_type": "int32",
       "stride_c_type": "int64", "assumed_align": 16}


def test_check_tensor_refusals():
    ok = torch.zeros(4, 256, dtype=torch.bfloat16)
    with pytest.raises(KernelArgumentError, match="CUDA tensor"):  # every other check passes first
        check_tensor(ARG, ok, "k")
    cases = [(ok.float(), "dtype torch.bfloat16"), (ok[:, :128], "size 256 in dimension 1"),
             (ok.t(), "dimensions|size 256"), (ok[None], "2 dimensions"),
             (torch.zeros(4, 512, dtype=torch.bfloat16)[:, ::2], "contiguous"),
             (torch.zeros(4 * 256 + 1, dtype=torch.bfloat16)[1:].view(4, 256), "16-byte aligned"),
             ("not a tensor", "torch.Tensor")]
    for t, msg in cases:
        with pytest.raises(KernelArgumentError, match=msg):
            check_tensor(ARG, t, "k")


def test_weight_preparation_round_trip():
    g, u = torch.randn(3, 64, 32), torch.randn(3, 64, 32)
    w = prepare_weights(g, u)
    assert w.shape == (3, 128, 32)
    g2, u2 = split_gate_up(w)
    assert torch.equal(g, g2) and torch.equal(u, u2)
    assert torch.equal(w[0, 16:32], u[0, 0:16])  # blocks of 16 rows alternate gate / up


def test_routing_reference_semantics():
    ids = torch.tensor([[3, 1], [1, 0], [9, 3], [-1, 1]], dtype=torch.int32)
    counts, offsets, sorted_ids, tile_expert = routing_reference(ids, experts=4, tile_m=4)
    assert counts.tolist() == [1, 3, 0, 2]
    assert offsets.tolist() == [0, 4, 8, 8, 12]
    T = max_tiles(4, 2, 4, 4)
    assert sorted_ids.numel() == T * 4 and tile_expert.numel() == T
    assert sorted_ids[:12].tolist() == [3, -1, -1, -1, 1, 2, 7, -1, 0, 5, -1, -1]
    assert (sorted_ids[12:] == -1).all()
    assert tile_expert.tolist()[:3] == [0, 1, 3] and (tile_expert[3:] == -1).all()


@pytest.fixture(scope="module")
def small_db(tmp_path_factory):
    url = f"sqlite:///{tmp_path_factory.mktemp('rt') / 'k.sqlite'}"
    spec = make_spec(experts=8, top_k=2, hidden=256, intermediate=128)
    with Database(url) as db:
        compile_into(db, [(spec, default_variant(spec, 16))], jobs=1)
    return url, spec


def test_layer_input_checks_before_any_launch(small_db):
    url, spec = small_db
    layer = MoeLayer(spec, KernelStore(url), device=torch.device("cpu"), variants={})
    M, bf = 4, torch.bfloat16
    x = torch.zeros(M, 256, dtype=bf)
    w13 = torch.zeros(8, 256, 256, dtype=bf)
    w2 = torch.zeros(8, 256, 128, dtype=bf)
    tw = torch.zeros(M, 2)
    ids = torch.zeros(M, 2, dtype=torch.int32)
    layer.check_inputs(x, w13, w2, tw, ids, None)  # all good
    bad = [((x[:, :128], w13, w2, tw, ids), "x must have shape"),
           ((x, w13[:4], w2, tw, ids), "w13 must have shape"),
           ((x, w13, w2.transpose(1, 2), tw, ids), "w2 must have shape"),
           ((x, w13, w2, tw[:2], ids), "topk_weights must have shape"),
           ((x, w13, w2, tw, ids.long()), "topk_ids must be torch.int32"),
           ((x, w13, w2, tw.half(), ids), "topk_weights must be torch.float32"),
           ((x, w13, w2, tw, ids.t().contiguous().t()), "contiguous"),
           ((x, w13, w2, tw, ids[:, :1]), "topk_ids must have shape")]
    for args, msg in bad:
        with pytest.raises(KernelArgumentError, match=msg):
            layer.check_inputs(*args, None)
    with pytest.raises(KernelArgumentError, match="out must have shape"):
        layer.check_inputs(x, w13, w2, tw, ids, torch.zeros(M + 1, 256, dtype=bf))


def test_store_fails_closed(small_db):
    url, spec = small_db
    store = KernelStore(url)
    with pytest.raises(KernelMissingError, match="built for sm_90a, this GPU needs sm_121a"):
        store.load(default_variant(spec, 16).kernels(spec)[0].name, "sm_121a")
    with pytest.raises(KernelMissingError, match="not in the database"):
        store.load("moe_route_sm90a_e999k1_m64", "sm_90a")
    ok, why = usable("nvidia-cutlass-dsl==4.8.1|cu13.4|sm_90a|x86-64|fmt1", "sm_90a", (12, 8))
    assert not ok and "CUDA 13" in why and "12.8" in why
    assert not usable("nvidia-cutlass-dsl==4.8.1|cu13.4|sm_90a|x86-64|fmt99", "sm_90a", None)[0]
    assert not usable("garbage", "sm_90a", None)[0]


def test_picks_for_other_gpu_warn_and_fall_back(small_db, tmp_path):
    url, spec = small_db
    with Database(url) as db:
        v = default_variant(spec, 4096)
        db.commit_best(workload=spec.workload_key, target="sm_90a", gpu="NVIDIA H100 80GB HBM3",
                       toolchain="nvidia-cutlass-dsl==4.8.1|cu13.4|sm_90a|x86-64|fmt1", tokens=16,
                       variant=v.name(spec), median_us=12.0)
    store = KernelStore(url)
    with pytest.warns(RuntimeWarning, match="no tuned kernels for NVIDIA H200.*H100"):
        assert store.picks(spec, "NVIDIA H200") == {}
    assert store.picks(spec, "NVIDIA H100 80GB HBM3") == {16: v}


def test_runtime_weight_layout_is_the_templates():
    # one function (moe_aot.layout) serves the runtime and the templates, and naming it from
    # the templates keeps torch out of a kernel compile
    from moe_aot_templates.grouped_gemm import interleave_gate_up

    from moe_aot import layout

    assert interleave_gate_up is layout.interleave_gate_up
    g, u = torch.randn(2, 64, 16), torch.randn(2, 64, 16)
    assert torch.equal(prepare_weights(g, u), interleave_gate_up(g, u, 16))
    assert all(torch.equal(a, b) for a, b in zip(split_gate_up(prepare_weights(g, u)), (g, u)))
    code = ("import sys, moe_aot.compiler, moe_aot_templates.grouped_gemm, moe_aot_templates.hopper_gemm\n"
            "sys.exit(1 if 'torch' in sys.modules else 0)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, "importing the templates imported torch\n" + proc.stdout + proc.stderr


@pytest.mark.parametrize("model, target", [("qwen3-30b-a3b", "sm_90a"), ("mixtral-8x7b", "sm_90a"),
                                           ("deepseek-v3", "sm_90a"), ("qwen3-30b-a3b", "sm_100a")])
def test_workspace_holds_every_tile_m(model, target):
    """Every tile_m a variant of the layer may use (sm_100a bf16 adds 256: umma's 2-CTA pairs)."""
    from moe_aot.runtime.layer import Workspace
    from moe_aot.variants import TILE_M, tile_ms

    spec = make_spec(model, target=target)
    assert tile_ms(spec) == (TILE_M + (256,) if target == "sm_100a" else TILE_M)
    for max_tokens in (1, 7, 300, 4096):
        ws = Workspace.allocate(spec, max_tokens, "meta")
        for m in tile_ms(spec):
            T = max_tiles(max_tokens, spec.top_k, spec.experts, m)
            assert ws.sorted_ids.numel() >= T * m and ws.h.shape[0] >= T * m and ws.tile_expert.numel() >= T


def test_forward_refuses_a_workspace_too_small(small_db):
    from moe_aot.runtime.layer import Workspace

    url, spec = small_db
    layer = MoeLayer(spec, KernelStore(url), device=torch.device("cpu"), variants={})
    M = 64
    ws = Workspace.allocate(spec, 8, "cpu")
    ws.max_tokens = M  # a workspace whose buffers do not match its claim
    args = (torch.zeros(M, 256, dtype=torch.bfloat16), torch.zeros(8, 256, 256, dtype=torch.bfloat16),
            torch.zeros(8, 256, 128, dtype=torch.bfloat16), torch.zeros(M, 2), torch.zeros(M, 2, dtype=torch.int32))
    layer.kernels = lambda tokens: (default_variant(spec, tokens), None, None, None, None)
    with pytest.raises(KernelArgumentError, match="workspace too small"):
        layer.forward(*args, workspace=ws)


def test_release_workspaces_frees_every_cached_layers_buffers(small_db, monkeypatch):
    """release_workspaces drops each cached layer's workspace (and the plans pointing into it):
    its buffers are freed, their bytes reported, and the next call allocates again."""
    import gc
    import weakref

    from moe_aot.runtime import layer as rt

    url, spec = small_db
    layers = [MoeLayer(spec, KernelStore(url), device=torch.device("cpu"), variants={}) for _ in range(2)]
    monkeypatch.setattr(rt, "_LAYERS", {("a",): layers[0], ("b",): layers[1], ("c",): MoeLayer(
        spec, KernelStore(url), device=torch.device("cpu"), variants={})})  # one never called: nothing to drop
    held = []
    for layer, tokens in zip(layers, (300, 7)):
        ws = layer.workspace(tokens)
        layer._plans[("stale",)] = (ws,)  # a plan pointing into the workspace keeps it alive unless dropped
        bufs = [t for t in vars(ws).values() if isinstance(t, torch.Tensor)]
        held.append((sum(t.untyped_storage().nbytes() for t in bufs), [weakref.ref(t) for t in bufs]))
    del ws, bufs
    assert rt.release_workspaces() == sum(n for n, _ in held) > 0
    gc.collect()
    assert all(r() is None for _, refs in held for r in refs), "a released workspace's buffer is still alive"
    assert all(la._workspace is None and not la._plans and la._last is None for la in layers)
    assert rt.release_workspaces() == 0  # nothing left to release
    assert layers[0].workspace(16).max_tokens == 16  # allocated again, for the new size


def test_bound_launch_swaps_only_data_pointers():
    import ctypes

    from moe_aot.runtime.library import KernelLibrary, _struct_type

    lib = object.__new__(KernelLibrary)
    lib.name, lib._tensor_args = "k", [dict(ARG, name="x"), dict(ARG, name="y")]
    seen = []

    def fake_run(packed, nargs):  # reads the structs back through the packed pointer array
        assert nargs.value == 4
        for i, arg in enumerate(lib._tensor_args):
            st = ctypes.cast(packed[i], ctypes.POINTER(_struct_type(arg))).contents
            seen.append((st.data, st.shape[0], st.stride[0]))
        seen.append(ctypes.c_void_p.from_address(packed[2]).value)

    lib._run = fake_run
    a, b = torch.zeros(4, 256, dtype=torch.bfloat16), torch.zeros(4, 256, dtype=torch.bfloat16)
    bound = lib.bind(a, b, check=False)
    c = torch.zeros(4, 256, dtype=torch.bfloat16)
    bound.set_data(1, c.data_ptr())
    bound(1234)
    assert seen == [(a.data_ptr(), 4, 256), (c.data_ptr(), 4, 256), 1234]


def test_moe_forward_refuses_cpu_and_malformed_inputs():
    from moe_aot.runtime.layer import moe_forward

    x = torch.zeros(2, 256, dtype=torch.bfloat16)
    w13 = torch.zeros(8, 256, 256, dtype=torch.bfloat16)
    ids = torch.zeros(2, 2, dtype=torch.int32)
    with pytest.raises(KernelArgumentError, match="CUDA tensor"):
        moe_forward(x, w13, None, torch.zeros(2, 2), ids)
    with pytest.raises(KernelArgumentError, match="w13_prepared"):
        moe_forward(x, w13[0], None, torch.zeros(2, 2), ids)
    with pytest.raises(KernelArgumentError, match="topk_ids"):
        moe_forward(x, w13, None, torch.zeros(2, 2), ids[0])


def test_stdlib_reader_agrees_with_the_sqlalchemy_reader(small_db, tmp_path):
    """The runtime's SQLite reader and the SQLAlchemy one give the same answers on one file."""
    from moe_aot.database import SqlAlchemyReader
    from moe_aot.dbread import SqliteReader
    from moe_aot.runtime.store import open_reader

    url, spec = small_db
    path = tmp_path / "copy.sqlite"
    copy_url = f"sqlite:///{path}"
    with Database(url, readonly=True) as src, Database(copy_url) as dst:  # a private copy to add picks to
        dst.put_workload(spec.workload_key, src.workload(spec.workload_key))
        for a in src.list_artifacts():
            art = src.get_artifact(a.name, a.toolchain)
            dst.put_artifact(name=a.name, workload=a.workload, role=a.role, target=a.target,
                             toolchain=a.toolchain, status=a.status, library=art.library,
                             cubin=art.cubin, meta=art.meta, compile_s=art.compile_s)
        names = [a.name for a in src.list_artifacts()]
        tc = src.list_artifacts()[0].toolchain
        for tokens in (1, 16):
            dst.commit_best(workload=spec.workload_key, target="sm_90a", gpu="NVIDIA H200", toolchain=tc,
                            tokens=tokens, variant=default_variant(spec, tokens).name(spec), median_us=9.5)
    lite, full = open_reader(copy_url), SqlAlchemyReader(copy_url)
    assert isinstance(lite, SqliteReader)
    for name in names + ["not_a_kernel"]:
        assert lite.artifact_versions(name) == full.artifact_versions(name)
        for v in lite.artifact_versions(name):
            assert lite.artifact(name, v.toolchain) == full.artifact(name, v.toolchain)
    assert lite.best(spec.workload_key, "sm_90a") == full.best(spec.workload_key, "sm_90a")
    assert len(lite.best(spec.workload_key, "sm_90a")) == 2 and lite.best(spec.workload_key, "sm_121a") == []
    lite.close()
    full.close()
    # a URL the stdlib reader does not take (options, memory) goes to SQLAlchemy
    assert isinstance(open_reader(copy_url + "?timeout=5"), SqlAlchemyReader)


def test_stdlib_reader_fails_closed(small_db, tmp_path):
    import sqlite3 as _sqlite3

    from moe_aot.dbread import DatabaseError, SqliteReader

    url, spec = small_db
    with pytest.raises(DatabaseError, match="no kernel database at .*moe-aot compile"):
        KernelStore(f"sqlite:///{tmp_path / 'missing.sqlite'}")
    garbage = tmp_path / "garbage.sqlite"
    garbage.write_bytes(b"this is not sqlite at all\n" * 200)
    with pytest.raises(DatabaseError, match="corrupt or not a SQLite database"):
        KernelStore(f"sqlite:///{garbage}")
    empty = tmp_path / "empty.sqlite"
    _sqlite3.connect(empty).execute("CREATE TABLE t (x)").connection.commit()
    with pytest.raises(DatabaseError, match="holds no moe-aot schema"):
        SqliteReader(empty)
    # a different schema version, and a library blob altered after it was written
    path = tmp_path / "k.sqlite"
    path.write_bytes(Path(url[len("sqlite:///"):]).read_bytes())
    con = _sqlite3.connect(path)
    con.execute("UPDATE moe_aot_artifacts SET library = ? WHERE role = 'glu'", (b"\x7fELF altered",))
    con.commit()
    store = KernelStore(f"sqlite:///{path}")
    glu = default_variant(spec, 16).kernels(spec)[1].name
    [v] = store.db.artifact_versions(glu)
    with pytest.raises(DatabaseError, match=f"artifact {glu} .*corrupt.*sha256"):
        store.db.artifact(glu, v.toolchain)
    con.execute("UPDATE moe_aot_schema_version SET version = 999")
    con.commit()
    con.close()
    with pytest.raises(DatabaseError, match=f"schema version 999 .*uses schema version {dbread.SCHEMA_VERSION}"):
        KernelStore(f"sqlite:///{path}")
    # truncated: half the file gone
    trunc = tmp_path / "t.sqlite"
    data = Path(url[len("sqlite:///"):]).read_bytes()
    trunc.write_bytes(data[: len(data) // 2])
    with pytest.raises(DatabaseError, match="corrupt"):
        store = KernelStore(f"sqlite:///{trunc}")
        for kv in default_variant(spec, 16).kernels(spec):
            for v in store.db.artifact_versions(kv.name):
                store.db.artifact(kv.name, v.toolchain)


def test_store_sees_kernels_written_after_it_opened(tmp_path):
    """`tune` measures in the process whose store was opened before the compile pool wrote the
    candidates: the runtime's reader must see later commits (WAL, no long read transaction)."""
    url = f"sqlite:///{tmp_path / 'k.sqlite'}"
    with Database(url) as db:
        db.put_workload("w", {"x": 1})
        store = KernelStore(url)
        assert store.db.artifact_versions("late") == []
        db.put_artifact(name="late", workload="w", role="glu", target="sm_90a", toolchain="tc",
                        status="ok", library=b"\x7fELF-late", meta={"k": 1})
        [v] = store.db.artifact_versions("late")
        assert store.db.artifact("late", v.toolchain) == (b"\x7fELF-late", {"k": 1})
        db.commit_best(workload="w", target="sm_90a", gpu="G", toolchain="tc", tokens=16, variant="v",
                       median_us=3.0)
        assert [p.variant for p in store.db.best("w", "sm_90a")] == ["v"]


@pytest.mark.parametrize("model", ["qwen3-30b-a3b", "deepseek-v3", "mixtral-8x7b"])
def test_untuned_layer_only_asks_for_the_buckets_defaults(model, small_db):
    """Without picks, any token count runs its nearest bucket's default: those are exactly the
    kernels `moe-aot compile`/`build` put in the database (a default computed for 300 tokens
    would ask for a 16-CTA routing kernel no bucket has, and fail with KernelMissingError)."""
    from moe_aot.variants import bucket_for, token_buckets

    spec = make_spec(model)
    layer = MoeLayer(spec, KernelStore(small_db[0]), device=torch.device("cpu"), variants={})
    built = {default_variant(spec, b) for b in token_buckets()}
    if model == "qwen3-30b-a3b":
        assert default_variant(spec, 300) not in built  # the case that failed
    for tokens in (1, 2, 7, 37, 255, 300, 1100, 5000, 20000, 100000):
        assert layer.variant_for(tokens) == default_variant(spec, bucket_for(tokens)) in built


class _Loaded:
    """Stands in for KernelLibrary on a CPU machine (its CUDA init needs a GPU)."""

    def __init__(self, so_path, meta, device=None):
        self.path, self.meta, self.name = Path(so_path), meta, meta["name"]


def test_layer_kernels_come_from_one_query_and_a_content_addressed_cache(small_db, tmp_path, monkeypatch):
    import hashlib
    import os

    import moe_aot.runtime.store as store_mod
    from moe_aot.runtime.library import KernelLaunchError

    monkeypatch.setattr(store_mod, "KernelLibrary", _Loaded)
    url, spec = small_db
    folder = tmp_path / "libs"
    names = [kv.name for kv in default_variant(spec, 16).kernels(spec)]

    def counting(store):
        calls = {"kernel_versions": 0, "artifact": 0, "artifact_versions": 0}
        for m in calls:
            def wrap(*a, _m=m, _f=getattr(store.db, m)):
                calls[_m] += 1
                return _f(*a)
            setattr(store.db, m, wrap)
        return calls

    # first process: one query for the four kernels, each blob read once, files named by their sha256
    store = KernelStore(url, unpack_dir=folder)
    calls = counting(store)
    layer = MoeLayer(spec, store, device=torch.device("cpu"), variants={})
    v, *libs = layer.kernels(16)
    assert [lib.name for lib in libs] == names
    assert calls == {"kernel_versions": 1, "artifact": 4, "artifact_versions": 0}
    for lib in libs:
        digest = lib.meta["sha256"]["library"]
        assert lib.path == folder / f"lib{lib.name}_{digest}.so"
        assert hashlib.sha256(lib.path.read_bytes()).hexdigest() == digest
    assert folder.stat().st_mode & 0o777 == 0o700
    # a later process finds them cached: no blob is read
    store = KernelStore(url, unpack_dir=folder)
    calls = counting(store)
    MoeLayer(spec, store, device=torch.device("cpu"), variants={}).kernels(16)
    assert calls == {"kernel_versions": 1, "artifact": 0, "artifact_versions": 0}
    # a cached file altered on disk is never used: its bytes are read back from the database
    glu = libs[1].path
    glu.write_bytes(b"\x7fELF not the kernel")
    store = KernelStore(url, unpack_dir=folder)
    calls = counting(store)
    store.load_many(names, "sm_90a")
    assert calls["artifact"] == 1
    assert hashlib.sha256(glu.read_bytes()).hexdigest() == libs[1].meta["sha256"]["library"]
    # a folder others may write into is refused
    os.chmod(folder, 0o777)
    with pytest.raises(KernelLaunchError, match="writable by no one else"):
        KernelStore(url, unpack_dir=folder).load_many(names, "sm_90a")
    os.chmod(folder, 0o700)
    # the failures of the per-kernel lookup are kept
    with pytest.raises(KernelMissingError, match="not in the database"):
        store.load_many([names[0], "moe_route_sm90a_e999k1_m64"], "sm_90a")


def test_cache_miss_refuses_a_corrupt_blob_or_disagreeing_metadata(small_db, tmp_path, monkeypatch):
    import json
    import sqlite3 as _sqlite3

    import moe_aot.runtime.store as store_mod
    from moe_aot.dbread import DatabaseError
    from moe_aot.runtime.library import KernelLaunchError

    monkeypatch.setattr(store_mod, "KernelLibrary", _Loaded)
    url, spec = small_db
    path = tmp_path / "k.sqlite"
    path.write_bytes(Path(url[len("sqlite:///"):]).read_bytes())
    glu = default_variant(spec, 16).kernels(spec)[1].name
    con = _sqlite3.connect(path)
    con.execute("UPDATE moe_aot_artifacts SET library = ? WHERE name = ?", (b"\x7fELF altered", glu))
    con.commit()
    with pytest.raises(DatabaseError, match=f"artifact {glu} .*corrupt.*sha256"):
        KernelStore(f"sqlite:///{path}", unpack_dir=tmp_path / "a").load(glu, "sm_90a")
    assert not list((tmp_path / "a").glob("*.so"))  # nothing was written
    [(meta,)] = con.execute("SELECT meta FROM moe_aot_artifacts WHERE name = ?", (glu,)).fetchall()
    meta = json.loads(meta)
    meta["sha256"]["library"] = "0" * 64
    con.execute("UPDATE moe_aot_artifacts SET meta = ? WHERE name = ?", (json.dumps(meta), glu))
    con.commit()
    con.close()
    with pytest.raises(KernelLaunchError, match=f"{glu}: stored library is corrupt"):
        KernelStore(f"sqlite:///{path}", unpack_dir=tmp_path / "b").load(glu, "sm_90a")


def test_server_reader_loads_through_the_same_cache(small_db, tmp_path, monkeypatch):
    import moe_aot.runtime.store as store_mod
    from moe_aot.database import SqlAlchemyReader

    monkeypatch.setattr(store_mod, "KernelLibrary", _Loaded)
    monkeypatch.setattr(store_mod, "open_reader", SqlAlchemyReader)  # what a PostgreSQL URL opens
    url, spec = small_db
    names = [kv.name for kv in default_variant(spec, 16).kernels(spec)]
    libs = KernelStore(url, unpack_dir=tmp_path / "libs").load_many(names, "sm_90a")
    assert sorted(libs) == sorted(names)
    assert all(lib.path.name == f"lib{n}_{lib.meta['sha256']['library']}.so" for n, lib in libs.items())


_RECORDING_C = r"""
void *seen[16]; int fail; long calls;
void {init}(void **a) {{ *(int *)a[1] = 0; }}
void {load}(void **a) {{ *(int *)a[2] = 0; }}
void {run}(void **a) {{
    for (int i = 0; i <= {nt}; i++) seen[i] = *(void **)a[i];  /* each struct's data pointer, then the stream */
    calls++;
    if (fail) *(int *)a[{nt} + 1] = fail;
}}
"""


def _recording_layer(url, spec, tmp_path, monkeypatch, variant=None, tokens=16, also=()):
    """A layer on CPU tensors whose kernels are libraries of the same ABI that record the
    pointers they were launched with (gcc), with torch.cuda's answers stubbed; its variant at
    ``tokens`` tokens is ``variant`` (default: the default's at 16); the kernels of the variants in
    ``also`` are recording ones too."""
    import json
    import shutil
    import sqlite3 as _sqlite3

    import moe_aot.runtime.launch as launch
    from moe_aot.dbread import pack, sha

    if shutil.which("gcc") is None:
        pytest.skip("needs gcc to build the stand-in libraries")
    path = tmp_path / "rec.sqlite"
    path.write_bytes(Path(url[len("sqlite:///"):]).read_bytes())
    con = _sqlite3.connect(path)
    for kv in [kv for v in (variant or default_variant(spec, 16), *also) for kv in v.kernels(spec)]:
        [(tc, meta)] = con.execute("SELECT toolchain, meta FROM moe_aot_artifacts WHERE name = ?",
                                   (kv.name,)).fetchall()
        meta = json.loads(meta)
        abi, nt = meta["host_abi"], sum(a["kind"] == "tensor" for a in meta["args"])
        c, so = tmp_path / f"{kv.role}.c", tmp_path / f"{kv.role}.so"
        c.write_text(_RECORDING_C.format(init=abi["init"], load=abi["load_to_device"], run=abi["run"], nt=nt))
        subprocess.run(["gcc", "-O1", "-shared", "-fPIC", "-o", str(so), str(c)], check=True)
        lib = so.read_bytes()
        meta["sha256"]["library"] = sha(lib)
        con.execute("UPDATE moe_aot_artifacts SET library = ?, sha256 = ?, meta = ? WHERE name = ? AND toolchain = ?",
                    (pack(lib), sha(lib), json.dumps(meta), kv.name, tc))
    con.commit()
    con.close()
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))  # CPU tensors stand in
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: type("S", (), {"cuda_stream": 1234})())
    monkeypatch.setattr(launch, "_raw_stream", lambda index: 1234)
    monkeypatch.setattr(launch, "_native_fn", None)
    monkeypatch.setattr(launch, "_building", None)
    return MoeLayer(spec, KernelStore(f"sqlite:///{path}", unpack_dir=tmp_path / "libs"), device=torch.device("cpu"),
                    variants={tokens: variant} if variant else {})


@pytest.fixture
def recording_layer(small_db, tmp_path, monkeypatch):
    """_recording_layer of the small bf16 layer, and its arguments at 16 tokens."""
    layer = _recording_layer(*small_db, tmp_path, monkeypatch)
    M, bf = 16, torch.bfloat16
    args = [torch.zeros(M, 256, dtype=bf), torch.zeros(8, 256, 256, dtype=bf), torch.zeros(8, 256, 128, dtype=bf),
            torch.zeros(M, 2), torch.zeros(M, 2, dtype=torch.int32)]
    return layer, args


def _seen(lib, n):
    import ctypes

    return list((ctypes.c_void_p * 16).in_dll(lib, "seen"))[:n]


@pytest.mark.parametrize("native", [True, False])
def test_repeated_forward_checks_everything_and_launches_with_the_new_pointers(recording_layer, monkeypatch, native):
    import ctypes

    import moe_aot.runtime.launch as launch
    from moe_aot.runtime.library import KernelLaunchError

    if not native:
        monkeypatch.setattr(launch, "_native_fn", False)
    layer, args = recording_layer
    full_checks = []
    check = layer.check_inputs
    layer.check_inputs = lambda *a: (full_checks.append(1), check(*a))[1]
    out = torch.zeros(16, 256, dtype=torch.bfloat16)
    layer.forward(*args, out=out)  # first call: bound with every per-kernel contract check
    [plan] = layer._fast.values()
    # the first process on a machine does not wait for cc: the launcher compiles in the background
    assert not plan.native and len(full_checks) == 1
    if launch._building is not None:
        launch._building.join()
    v, route, glu, down, comb = layer.kernels(16)
    ws = layer._workspace
    # new tensors of the same shapes: no slow-path check, and every kernel sees the new pointers
    new = [a.clone() for a in args]
    out2 = torch.zeros_like(out)
    assert layer.forward(*new, out=out2) is out2 and len(full_checks) == 1
    assert plan.native is native  # attached once compiled
    x, w13, w2, tw, ids = (t.data_ptr() for t in new)
    assert _seen(route._lib, 6) == [ids, ws.counts.data_ptr(), ws.offsets.data_ptr(), ws.sorted_ids.data_ptr(),
                                    ws.tile_expert.data_ptr(), 1234]
    assert _seen(glu._lib, 6) == [x, w13, ws.sorted_ids.data_ptr(), ws.tile_expert.data_ptr(), ws.h.data_ptr(), 1234]
    assert _seen(down._lib, 7) == [ws.h.data_ptr(), w2, ws.sorted_ids.data_ptr(), ws.tile_expert.data_ptr(), tw,
                                   ws.y.data_ptr(), 1234]
    assert _seen(comb._lib, 4) == [ws.y.data_ptr(), ids, out2.data_ptr(), 1234]
    allocated = layer.forward(*new)  # out allocated by the fast path
    assert allocated.shape == (16, 256) and _seen(comb._lib, 3)[2] == allocated.data_ptr()
    # every input the full check refuses is refused on the repeated path too, with its sentence
    x_, w13_, w2_, tw_, ids_ = new
    misaligned = torch.zeros(16 * 256 + 1, dtype=torch.bfloat16)[1:].view(16, 256)
    bad = [((x_.float(), w13_, w2_, tw_, ids_), None, "x must be torch.bfloat16"),
           ((x_, w13_[:, :128], w2_, tw_, ids_), None, "w13 must have shape"),
           ((x_, w13_, w2_.transpose(1, 2).contiguous().transpose(1, 2), tw_, ids_), None, "w2 must be contiguous"),
           ((x_, w13_, w2_, tw_.to("meta"), ids_), None, "topk_weights must be on cpu"),
           ((x_, w13_, w2_, tw_, ids_.t().contiguous().t()), None, "topk_ids must be contiguous"),
           ((misaligned, w13_, w2_, tw_, ids_), None, "x must be 16-byte aligned"),
           ((x_, w13_, w2_, tw_, ids_), misaligned, "out must be 16-byte aligned"),
           ((x_, w13_, w2_, tw_, ids_), torch.zeros(16, 256), "out must be torch.bfloat16"),
           ((x_, w13_, w2_, tw_, ids_), torch.zeros(256, 16, dtype=torch.bfloat16).t(), "out must be contiguous"),
           ((x_, "w13", w2_, tw_, ids_), None, "w13 must be a torch.Tensor")]
    calls = ctypes.c_long.in_dll(glu._lib, "calls")
    for a, o, msg in bad:
        before = calls.value
        with pytest.raises(KernelArgumentError, match=msg):
            layer.forward(*a, out=o)
        assert calls.value == before, msg  # nothing launched
    # a launch error names the kernel and stops before the next one
    ctypes.c_int.in_dll(down._lib, "fail").value = 7
    comb_calls = ctypes.c_long.in_dll(comb._lib, "calls").value
    with pytest.raises(KernelLaunchError, match=f"{down.name}: launch failed \\(cudaError 7\\)"):
        layer.forward(*new, out=out2)
    assert ctypes.c_long.in_dll(comb._lib, "calls").value == comb_calls
    ctypes.c_int.in_dll(down._lib, "fail").value = 0


def test_without_a_c_compiler_or_when_switched_off_layers_launch_from_python(tmp_path, monkeypatch):
    import os
    import shutil

    import moe_aot.runtime.launch as launch

    which = shutil.which
    monkeypatch.setattr(launch, "_native_fn", None)
    monkeypatch.setattr(launch, "_building", None)
    monkeypatch.setattr(shutil, "which", lambda name: None)
    assert launch.native_launcher(tmp_path / "a") is None and launch._native_fn is False
    assert not list((tmp_path / "a").glob("*.so"))
    monkeypatch.setattr(shutil, "which", which)
    monkeypatch.setattr(launch, "_native_fn", None)
    monkeypatch.setenv("MOE_AOT_NATIVE_LAUNCH", "0")
    assert launch.native_launcher(tmp_path / "b") is None and not (tmp_path / "b").exists()
    monkeypatch.delenv("MOE_AOT_NATIVE_LAUNCH")
    monkeypatch.setattr(launch, "_native_fn", None)
    if which(os.environ.get("CC", "cc")) or which("gcc"):
        assert launch.native_launcher(tmp_path / "c") is not None


def test_default_cache_is_the_checkout_or_a_per_user_folder(tmp_path, monkeypatch):
    """A source checkout keeps <checkout>/cache; an installed package (no pyproject beside it)
    uses $XDG_CACHE_HOME/moe-aot, never site-packages; MOE_AOT_CACHE_DIR wins over both."""
    from moe_aot import env

    monkeypatch.delenv("MOE_AOT_CACHE_DIR", raising=False)
    monkeypatch.delenv("MOE_AOT_DB", raising=False)
    assert env.cache_dir() == env.REPO_ROOT / "cache"  # this checkout
    site = tmp_path / "site-packages"
    (site / "moe_aot").mkdir(parents=True)
    monkeypatch.setattr(env, "REPO_ROOT", site)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert env.cache_dir() == (tmp_path / "xdg" / "moe-aot").resolve()
    assert env.default_db_url() == f"sqlite:///{(tmp_path / 'xdg' / 'moe-aot' / 'moe_aot.sqlite').resolve()}"
    monkeypatch.setenv("MOE_AOT_CACHE_DIR", str(tmp_path / "mine"))
    assert env.cache_dir() == (tmp_path / "mine").resolve()


def test_a_missing_database_is_told_apart_from_a_broken_one(tmp_path):
    """The GPU tests skip only when there is no database (nothing compiled for this machine);
    a database that is there but broken raises a plain DatabaseError, and they fail."""
    from moe_aot.dbread import DatabaseError, NoDatabaseError

    with pytest.raises(NoDatabaseError):
        KernelStore(f"sqlite:///{tmp_path / 'absent.sqlite'}")
    broken = tmp_path / "broken.sqlite"
    broken.write_bytes(b"this is not a SQLite file" * 100)
    with pytest.raises(DatabaseError) as err:
        KernelStore(f"sqlite:///{broken}")
    assert not isinstance(err.value, NoDatabaseError)


def test_dbread_imports_nothing_of_the_package_but_env():
    """dbread is the bottom of the reading side: database.py and the runtime import it, it
    imports neither of them (no import cycle) nor SQLAlchemy."""
    import ast

    import moe_aot.dbread as dbread

    tree = ast.parse(Path(dbread.__file__).read_text())
    imported = {(n.module or "") for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.level}
    imported |= {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    ours = {"database", "runtime", "sqlalchemy", "tuner", "picks"}
    assert not {m for m in imported if m.split(".")[0] in ours}, imported


@pytest.fixture(scope="module")
def small_fp8_db(tmp_path_factory):
    url = f"sqlite:///{tmp_path_factory.mktemp('rt8') / 'k.sqlite'}"
    spec = make_spec(experts=8, top_k=2, hidden=256, intermediate=256, precision="fp8-block128")
    with Database(url) as db:
        compile_into(db, [(spec, default_variant(spec, 16))], jobs=1)
    return url, spec


def test_repeated_fp8_forward_launches_with_the_new_pointers(small_fp8_db, tmp_path, monkeypatch):
    """The fp8 layer's four kernels (the routing launch quantizes x), launched in the variant's
    order: the first call binds them,
    a repeated call re-checks the inputs and swaps only the caller's pointers, without choosing
    the variant again."""
    import ctypes

    url, spec = small_fp8_db
    layer = _recording_layer(url, spec, tmp_path, monkeypatch)
    M, e, h, i = 16, 8, 256, 256
    f8 = torch.float8_e4m3fn

    def make():
        return [torch.zeros(M, h, dtype=torch.bfloat16), (torch.zeros(e, 2 * i, h, dtype=f8), torch.ones(e, 4, 2)),
                (torch.zeros(e, h, i, dtype=f8), torch.ones(e, 2, 2)), torch.zeros(M, 2),
                torch.zeros(M, 2, dtype=torch.int32)]

    full_checks, chosen = [], []
    check, role_kernels = layer.check_inputs, layer.role_kernels
    layer.check_inputs = lambda *a: (full_checks.append(1), check(*a))[1]
    layer.role_kernels = lambda t: (chosen.append(t), role_kernels(t))[1]
    out = torch.zeros(M, h, dtype=torch.bfloat16)
    layer.forward(*make(), out=out)
    assert len(full_checks) == len(chosen) == 1
    _, libs = role_kernels(M)
    assert list(libs) == ["routing", "glu", "down", "combine"]
    ws = layer._workspace
    new, out2 = make(), torch.zeros_like(out)
    assert layer.forward(*new, out=out2) is out2
    assert len(full_checks) == 2 and len(chosen) == 1  # checked again, not chosen again
    x, (w13, w13s), (w2, w2s), tw, ids = new
    p = lambda t: t.data_ptr()  # noqa: E731
    routing = _seen(libs["routing"]._lib, 9)
    assert routing[0] == p(ids) and routing[5:] == [p(x), p(ws.xq), p(ws.xs), 1234]
    assert _seen(libs["glu"]._lib, 9) == [p(ws.xq), p(ws.xs), p(w13), p(w13s), p(ws.sorted_ids), p(ws.tile_expert),
                                          p(ws.hq), p(ws.hs), 1234]
    assert _seen(libs["down"]._lib, 9) == [p(ws.hq), p(ws.hs), p(w2), p(w2s), p(ws.sorted_ids), p(ws.tile_expert),
                                           p(tw), p(ws.y), 1234]
    assert _seen(libs["combine"]._lib, 4) == [p(ws.y), p(ids), p(out2), 1234]
    calls = ctypes.c_long.in_dll(libs["glu"]._lib, "calls").value
    with pytest.raises(KernelArgumentError, match="w13 scales must have shape"):
        layer.forward(x, (w13, w13s[:, :1]), (w2, w2s), tw, ids, out=out2)
    assert ctypes.c_long.in_dll(libs["glu"]._lib, "calls").value == calls  # refused before any launch


H128 = LayerVariant(128, GemmTiles(256, 128, 3, "hopws"), GemmTiles(256, 128, 3, "hopws"), h_block=128)


@pytest.fixture(scope="module")
def small_fp8_h128_db(tmp_path_factory):
    url = f"sqlite:///{tmp_path_factory.mktemp('rt8h') / 'k.sqlite'}"
    spec = make_spec(experts=8, top_k=2, hidden=256, intermediate=256, precision="fp8-block128")
    with Database(url) as db:
        compile_into(db, [(spec, H128)], jobs=1)
    return url, spec


def test_fp8_forward_hands_both_gemms_the_variants_h_scale_block(small_fp8_h128_db, tmp_path, monkeypatch):
    """A variant with h scaled per 128 columns: GEMM1 and GEMM2 get the same hs, viewed as
    [R, I/128] at the start of the workspace's buffer (their libraries' own checks refuse the
    [R, I/64] view); a variant whose GEMM1 cannot write that block is refused in one sentence
    before anything is loaded or launched."""
    url, spec = small_fp8_h128_db
    layer = _recording_layer(url, spec, tmp_path, monkeypatch, H128)
    M, e, h, i = 16, 8, 256, 256
    f8 = torch.float8_e4m3fn
    args = [torch.zeros(M, h, dtype=torch.bfloat16), (torch.zeros(e, 2 * i, h, dtype=f8), torch.ones(e, 4, 2)),
            (torch.zeros(e, h, i, dtype=f8), torch.ones(e, 2, 2)), torch.zeros(M, 2),
            torch.zeros(M, 2, dtype=torch.int32)]
    layer.forward(*args, out=torch.zeros(M, h, dtype=torch.bfloat16))
    v, libs = layer.role_kernels(M)
    assert v == H128 and all(kv.name.endswith("_h128") for kv in layer.kernel_variants(v) if kv.role in ("glu", "down"))
    ws = layer._workspace
    R = max_tiles(M, 2, e, 128) * 128
    assert tuple(ws.hs.shape) == (ws.hq.shape[0], i // 64)  # sized for the smallest block
    hs = ws.h_scales(R, 128)
    assert tuple(hs.shape) == (R, i // 128) and hs.is_contiguous() and hs.data_ptr() == ws.hs.data_ptr()
    assert _seen(libs["glu"]._lib, 8)[7] == _seen(libs["down"]._lib, 2)[1] == hs.data_ptr()
    glu_args = (ws.xq[:M], ws.xs[:M], *args[1], ws.sorted_ids[:R], ws.tile_expert[:R // 128], ws.hq[:R])
    libs["glu"](*glu_args, hs)  # the kernel's contract: hs [R, I/128]
    with pytest.raises(KernelArgumentError, match="hs"):
        libs["glu"](*glu_args, ws.hs[:R])
    narrow = dataclasses.replace(H128, glu=GemmTiles(128, 128, 3, "hopws"))
    layer.variants = {16: narrow}
    layer._fast.clear()
    with pytest.raises(KernelArgumentError, match=r"cannot run: h_block 128: GEMM1's tile_n 128 holds 64 h columns"):
        layer.forward(*args)


def test_last_plan_is_used_only_for_its_own_size_workspace_and_picks(recording_layer):
    """The bf16 fast path tries the plan used last first: another token count, another workspace
    or another picks dict must each get (or build) their own plan, never launch with it."""
    from moe_aot.runtime.layer import Workspace

    layer, args = recording_layer
    route = layer.kernels(16)[1]
    def at(M, **kw):
        a = [t[:M] if t.shape[0] == 16 and t.dim() == 2 and t.shape[1] in (2, 256) and i in (0, 3, 4) else t
             for i, t in enumerate(args)]
        out = torch.zeros(M, 256, dtype=torch.bfloat16)
        assert layer.forward(*a, out=out, **kw) is out
        return layer._last
    p16 = at(16)
    p8 = at(8)
    assert (p16.M, p8.M) == (16, 8) and p8 is not p16
    assert at(16) is p16 and at(8) is p8  # found again by size, each time the right plan
    ws2 = Workspace.allocate(layer.spec, 16, torch.device("cpu"))
    p_ws2 = at(16, workspace=ws2)
    assert p_ws2.ws is ws2 and p_ws2 is not p16
    assert _seen(route._lib, 2)[1] == ws2.counts.data_ptr()  # routing counted into the given workspace
    assert at(16) is p16 and _seen(route._lib, 2)[1] == layer._workspace.counts.data_ptr()
    layer.variants = {16: default_variant(layer.spec, 16)}  # other picks: the plan is not tried first
    calls = []
    p16.run = lambda *a: calls.append(a)
    at(16)
    assert not calls


def test_a_bucket_without_a_pick_runs_its_default_where_the_database_has_it(small_db):
    """Picks for some buckets only (a database whose other picks predate a change of the
    defaults): a token count in a bucket without a pick runs that bucket's default when its
    kernels are in the database, not another bucket's pick; else the nearest pick, as before."""
    from moe_aot.variants import bucket_for

    url, spec = small_db  # holds the 16-token bucket's default only
    far = default_variant(spec, 16384)
    assert far != default_variant(spec, 16) != default_variant(spec, 1)
    layer = MoeLayer(spec, KernelStore(url), device=torch.device("cpu"), variants={16384: far})
    assert bucket_for(20) == 16 and layer.variant_for(20) == default_variant(spec, 16)
    assert layer.variant_for(1) == far  # the 1-token default is not in the database
    assert layer.variant_for(30000) == far


def test_first_call_at_a_size_renders_no_variant_name(recording_layer, monkeypatch):
    """Plans are keyed by the variant value, whose name (the database key) a first call no longer
    renders; launchers() finds the plan by the same key."""
    from moe_aot.variants import LayerVariant

    layer, args = recording_layer
    layer.kernels(16)  # the load, as a cold start does it
    monkeypatch.setattr(LayerVariant, "name", lambda self, spec: pytest.fail("a first call rendered a name"))
    out = layer.forward(*args)
    assert out.shape == (16, 256)
    got = layer.launchers(16)
    assert list(got) == ["routing", "glu", "down", "combine"]
    assert _seen(got["routing"]._lib._lib, 1)[0] == args[4].data_ptr()
    with pytest.raises(KeyError, match="no forward at 8 tokens"):
        layer.launchers(8)


def test_library_dir_checks_with_one_stat_what_it_checked_before(tmp_path):
    """library_dir: a missing folder is made private, a file is refused as mkdir refused it, a
    folder others can write into is refused."""
    import os

    from moe_aot.runtime.library import KernelLaunchError, library_dir

    made = library_dir(tmp_path / "a" / "b")
    assert made == tmp_path / "a" / "b" and made.is_dir() and made.stat().st_mode & 0o777 == 0o700
    assert library_dir(made) == made  # there already
    (tmp_path / "f").write_bytes(b"")
    with pytest.raises(FileExistsError):
        library_dir(tmp_path / "f")
    os.chmod(made, 0o770)
    with pytest.raises(KernelLaunchError, match="writable by no one else"):
        library_dir(made)


def test_one_libcuda_handle_per_process(monkeypatch):
    """The store's driver version and the launcher's graph functions come from one CDLL of
    libcuda.so.1; where there is none, the failed dlopen is not searched again."""
    import ctypes

    import moe_aot.runtime.launch as launch
    import moe_aot.runtime.library as library
    import moe_aot.runtime.store as store

    made = []
    proto = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.POINTER(ctypes.c_int))

    def version(p):
        p[0] = 12080
        return 0

    fn = proto(version)

    class Driver:  # every driver function is this one function pointer
        def __getattr__(self, name):
            return fn

    monkeypatch.setattr(library, "_libcuda", None)
    monkeypatch.setattr(launch, "_driver_graph_fns", None)
    monkeypatch.setattr(ctypes, "CDLL", lambda name, *a, **kw: made.append(name) or Driver())
    assert store.driver_cuda_version() == (12, 8)
    assert launch.driver_graph_functions() == (ctypes.cast(fn, ctypes.c_void_p).value,) * 7
    assert made == ["libcuda.so.1"]

    def missing(name, *a, **kw):
        made.append(name)
        raise OSError(f"{name}: cannot open shared object file")

    monkeypatch.setattr(library, "_libcuda", None)
    monkeypatch.setattr(ctypes, "CDLL", missing)
    made.clear()
    for _ in range(2):
        with pytest.raises(OSError):
            store.driver_cuda_version()
    assert made == ["libcuda.so.1"]
