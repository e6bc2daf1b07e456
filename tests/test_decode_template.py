"""CPU tests of the one-launch decode kernel (templates/decode.py): it compiles for the model
shapes with bulk-copy weight streaming, a reusable grid barrier and the combine in registers, and
refuses what it cannot do. Numerics are checked on the GPU by tools/check_decode.py."""
import pytest

cute = pytest.importorskip("cutlass.cute")

from moe_aot_templates.decode import MoeDecode  # noqa: E402


@pytest.mark.parametrize("shape", [(128, 2048, 768, 8, False), (128, 2880, 2880, 4, True)])
def test_decode_compiles_with_bulk_copies_and_a_grid_barrier(shape, tmp_path):
    e, h, i, k, bias = shape
    obj = MoeDecode(e, h, i, k, activation="swigluoai" if bias else "swiglu", max_tokens=4, bias=bias)
    args = obj.fake_arguments()
    assert [n for n, _ in args] == ["x", "w13", "w2", "topk_weights", "topk_ids", "out", "h", "bar", "b13", "b2",
                                    "stream"]
    assert all((f is None) != bias for n, f in args if n in ("b13", "b2"))
    ptx = cute.compile(obj, *[f for _, f in args],
                       options=f"--gpu-arch sm_90a --keep-ptx --dump-dir {tmp_path}").__ptx__
    body = ptx[ptx.index(".entry"):]
    assert "atom.global.acq_rel.add" in body and "ld.acquire.gpu" in body  # the grid barrier: arrive, wait
    assert "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes" in body  # the weight stream
    assert "mbarrier.try_wait" in body and "shfl.sync.bfly" in body
    assert "fence.proxy.async.global" in body  # h: written by threads, read by other CTAs' bulk copies
    # every row segment is one bulk copy of at most 2 KB that divides the row
    assert h % obj.seg1 == 0 and i % obj.seg2 == 0 and max(obj.seg1, obj.seg2) * 2 <= 2048
    assert obj.seg1 == (1024 if h == 2048 else 960)  # 2880 = 3 x 960: the tail chunk of a lane is predicated
    assert obj.stages >= 2


@pytest.mark.parametrize("max_tokens", [1, 4])
def test_decode_cpasync_producer_compiles(max_tokens, tmp_path):
    """The four-warp cp.async producer: 16-byte copies that arrive on the full barrier when they
    land (no transaction counts, no bulk copies); one slot keeps its accumulators in registers,
    more use shared memory (no local memory either way)."""
    obj = MoeDecode(128, 2048, 768, 8, max_tokens=max_tokens, producer="cpasync")
    assert obj.threads == (8 + 4) * 32
    ptx = cute.compile(obj, *[f for _, f in obj.fake_arguments()],
                       options=f"--gpu-arch sm_90a --keep-ptx --dump-dir {tmp_path}").__ptx__
    body = ptx[ptx.index(".entry"):]
    assert "cp.async.cg.shared.global" in body and "cp.async.mbarrier.arrive.noinc" in body
    assert "cp.async.bulk" not in body and "expect_tx" not in body
    assert "bar.sync" in body or "barrier.sync" in body  # the producer warps meet after the grid barrier
    assert ".local" not in body


def test_decode_refusals():
    ok, why = MoeDecode.can_implement(128, 2048, 768, 8, activation="relu")
    assert not ok and "activation" in why
    ok, why = MoeDecode.can_implement(128, 2048, 768, 8, max_tokens=16)
    assert not ok and "max_tokens" in why
    ok, why = MoeDecode.can_implement(128, 2048, 768, 8, warps=5)
    assert not ok and "warps" in why
    ok, why = MoeDecode.can_implement(128, 7168, 2048, 8, max_tokens=8)  # x alone: 229 KB of fp32
    assert not ok and "shared memory" in why
    ok, why = MoeDecode.can_implement(128, 2048, 768, 8, arch="sm_121a")
    assert not ok and "sm_90a" in why
    with pytest.raises(ValueError, match="hidden"):
        MoeDecode(128, 2050, 768, 8)
    with pytest.raises(ValueError, match="producer"):
        MoeDecode(128, 2048, 768, 8, producer="tma")
