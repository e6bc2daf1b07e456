"""Real compilation on this CPU machine: every template, for every target, into a real database."""
import cross_tools
import pytest

from moe_aot.compiler import compile_into, toolchain_key
from moe_aot.database import Database
from moe_aot.hosts import host_for
from moe_aot.spec import make_spec
from moe_aot.variants import GemmTiles, LayerVariant, can_implement, default_variant

SMALL = dict(experts=8, top_k=2, hidden=256, intermediate=128)


@pytest.fixture(scope="module")
def db(tmp_path_factory):
    d = Database(f"sqlite:///{tmp_path_factory.mktemp('db') / 'k.sqlite'}")
    yield d
    d.close()


@pytest.mark.parametrize("target", ["sm_90a", "sm_100a", "sm_121a"])
def test_every_template_compiles_for_target(db, target):
    if target == "sm_121a":  # the DGX Spark's libraries are aarch64 code
        cross_tools.require(cross_tools.CROSS_CC)
    spec = make_spec(**SMALL, target=target)
    variant = default_variant(spec, 16)
    results = compile_into(db, [(spec, variant)], jobs=1)
    assert {r.kernel.role for r in results} == {"routing", "glu", "down", "combine"}
    failed = [(r.kernel.name, r.error) for r in results if r.artifact is None]
    assert not failed, failed
    tool = toolchain_key(target)
    for kv in variant.kernels(spec):
        art = db.get_artifact(kv.name, tool)
        assert art.status == "ok" and art.target == target
        assert art.library[:4] == b"\x7fELF" and art.cubin[:4] == b"\x7fELF"
        assert int.from_bytes(art.library[18:20], "little") == host_for(target).elf_machine
        meta = art.meta
        assert meta["toolchain"]["arch"] == target and meta["toolchain"]["dsl"] == "nvidia-cutlass-dsl==4.8.1"
        assert meta["args"][-1]["kind"] == "stream"
        assert all(a["assumed_align"] >= 4 for a in meta["args"][:-1])
        # the cubin's ELF e_flags carry the SM number the driver checks at load (bits 8..15)
        assert (int.from_bytes(art.cubin[48:52], "little") >> 8) & 0xFF == int(target[3:-1])


def test_second_compile_is_a_no_op_and_abi_is_recorded(db):
    spec = make_spec(**SMALL)
    variant = default_variant(spec, 16)
    assert compile_into(db, [(spec, variant)], jobs=1) == []
    glu = next(kv for kv in variant.kernels(spec) if kv.role == "glu")
    meta = db.get_artifact(glu.name, toolchain_key("sm_90a")).meta
    x = meta["args"][0]
    assert x["name"] == "x" and x["static_shape"] == [None, SMALL["hidden"]] and x["dtype"] == "BFloat16"


def test_failing_variant_is_recorded_and_batch_goes_on(db, monkeypatch):
    import moe_aot.compiler as comp

    spec = make_spec(**SMALL, activation="geglu")
    variant = LayerVariant(64, GemmTiles(64, 64, 3), GemmTiles(256, 32, 3))  # kernels not built yet
    real = comp.build_template

    def broken(kv):
        if kv.role == "down":
            raise comp.KernelCompileError("ptxas: out of registers (injected)")
        return real(kv)

    monkeypatch.setattr(comp, "build_template", broken)
    results = compile_into(db, [(spec, variant)], jobs=1)
    by_role = {r.kernel.role: r for r in results}
    assert by_role["down"].artifact is None and "injected" in by_role["down"].error
    assert by_role["glu"].artifact is not None
    down = next(kv for kv in variant.kernels(spec) if kv.role == "down")
    row = db.get_artifact(down.name, toolchain_key("sm_90a"))
    assert row.status == "failed" and "out of registers" in row.error and row.library is None


def test_a_programming_error_stops_the_batch_instead_of_becoming_a_failed_kernel(db, monkeypatch):
    """Only KernelCompileError (the DSL, ptxas, the linker) is a kernel's own failure; any other
    exception in a compile job propagates, and what finished before it stays in the database."""
    import moe_aot.compiler as comp
    from moe_aot.kernel_build import TemplateBugError

    spec = make_spec(**SMALL)
    variant = LayerVariant(64, GemmTiles(64, 64, 3), GemmTiles(128, 64, 3))
    real = comp.build_template

    def buggy(kv):
        if kv.role == "down":
            raise TemplateBugError(f"{kv.name}: NameError in the template's code: name 'x' is not defined")
        return real(kv)

    monkeypatch.setattr(comp, "build_template", buggy)
    with pytest.raises(TemplateBugError, match="NameError"):
        compile_into(db, [(spec, variant)], jobs=1)
    down = next(kv for kv in variant.kernels(spec) if kv.role == "down")
    assert db.get_artifact(down.name, toolchain_key("sm_90a")) is None  # not recorded as failed
    done = [kv for kv in variant.kernels(spec) if db.get_artifact(kv.name, toolchain_key("sm_90a"))]
    assert done and all(db.get_artifact(kv.name, toolchain_key("sm_90a")).status == "ok" for kv in done)


def test_compile_kernel_tells_a_template_bug_from_a_refusal():
    """A Python error in a template's traced code (wrapped by the DSL) is a TemplateBugError; a
    compile-time assert stays a KernelCompileError (the tuner's "infinitely slow")."""
    import cutlass.cute as cute
    from moe_aot_templates.grouped_gemm import GroupedDownGemm

    from moe_aot.kernel_build import KernelCompileError, TemplateBugError, compile_kernel

    class Bug(GroupedDownGemm):
        @cute.jit
        def _epilogue(self, etid, sC, epi, row0, bn, expert):
            undefined_in_template(etid)  # noqa: F821

    class Refusal(GroupedDownGemm):
        @cute.jit
        def _epilogue(self, etid, sC, epi, row0, bn, expert):
            assert self.tile_n > 4096, "this shape is refused at compile time"

    kw = dict(tile_m=64, tile_n=64, tile_k=64, stages=3)
    with pytest.raises(TemplateBugError, match="NameError in the template's code"):
        compile_kernel(Bug(8, 256, 256, 2, **kw), "sm_90a", "bug")
    with pytest.raises(KernelCompileError, match="refused at compile time") as refused:
        compile_kernel(Refusal(8, 256, 256, 2, **kw), "sm_90a", "refusal")
    assert not isinstance(refused.value, TemplateBugError)


def test_parallel_compile_in_process_pool(tmp_path):
    with Database(f"sqlite:///{tmp_path / 'p.sqlite'}") as db:
        spec = make_spec(**SMALL)
        pairs = [(spec, LayerVariant(64, GemmTiles(64, 64, 3), GemmTiles(64, 64, 3))),
                 (spec, LayerVariant(64, GemmTiles(128, 64, 3), GemmTiles(128, 32, 4)))]
        results = compile_into(db, pairs, jobs=2)
        assert len(results) == 6 and all(r.artifact is not None for r in results)
        assert len(db.list_artifacts(status="ok")) == 6


def test_an_interrupt_stops_at_once_and_keeps_what_finished(tmp_path):
    """Ctrl-C in `moe-aot compile` (here: KeyboardInterrupt from the progress callback after the
    first kernel) returns without waiting for the queued compiles, and the finished kernel is in
    the database."""
    import time

    with Database(f"sqlite:///{tmp_path / 'i.sqlite'}") as db:
        spec = make_spec(**SMALL)
        pairs = [(spec, LayerVariant(64, GemmTiles(n, k, st), GemmTiles(n, 32, st)))
                 for n in (64, 128) for k in (32, 64) for st in (2, 3, 4)]  # 20 distinct kernels
        assert all(can_implement(spec, v)[0] for _, v in pairs)

        seconds = []

        def stop(res, done, total):
            seconds.append(res.seconds)
            raise KeyboardInterrupt

        t0 = time.perf_counter()
        with pytest.raises(KeyboardInterrupt):
            compile_into(db, pairs, jobs=2, progress=stop)
        waited = time.perf_counter() - t0
        assert len(db.list_artifacts(status="ok")) == 1
        # 20 kernels on 2 workers: a pool that waits for the queued ones takes ~9 compiles more
        assert waited < 2 * seconds[0] + 3, (waited, seconds)
