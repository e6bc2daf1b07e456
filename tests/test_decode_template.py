"""CPU tests of the one-launch decode kernel (templates/decode.py): it compiles for the model
shapes with a reusable grid barrier and no local-memory arrays of weights, and refuses what it
cannot do. Numerics are checked on the GPU by tools/check_decode.py."""
import pytest

cute = pytest.importorskip("cutlass.cute")

from moe_aot_templates.decode import MoeDecode  # noqa: E402


@pytest.mark.parametrize("shape", [(128, 2048, 768, 8), (128, 2880, 2880, 4)])
def test_decode_compiles_with_a_grid_barrier(shape, tmp_path):
    e, h, i, k = shape
    obj = MoeDecode(e, h, i, k, max_tokens=4)
    names = [n for n, _ in obj.fake_arguments()]
    assert names == ["x", "w13", "w2", "topk_weights", "topk_ids", "out", "h", "y", "bar", "stream"]
    ptx = cute.compile(obj, *[f for _, f in obj.fake_arguments()],
                       options=f"--gpu-arch sm_90a --keep-ptx --dump-dir {tmp_path}").__ptx__
    body = ptx[ptx.index(".entry"):]
    assert "atom.global.acq_rel.add" in body and "ld.acquire.gpu" in body  # the barrier: arrive, wait
    assert "shfl.sync.bfly" in body and "ld.global.v4" in body  # warp-per-row, 16-byte weight loads
    # 2880 = 11.25 chunks of 256 per row: the tail chunk is predicated, not read past the row
    assert obj.ch1 == -(-h // 256)


def test_decode_refusals():
    ok, why = MoeDecode.can_implement(128, 2048, 768, 8, activation="relu")
    assert not ok and "activation" in why
    ok, why = MoeDecode.can_implement(128, 2048, 768, 8, max_tokens=16, num_threads=64)
    assert not ok and "max_tokens" in why
    ok, why = MoeDecode.can_implement(128, 7168, 2048, 8, max_tokens=8)
    assert not ok and "shared memory" in why
    ok, why = MoeDecode.can_implement(128, 2048, 768, 8, arch="sm_121a")
    assert not ok and "sm_90a" in why
    with pytest.raises(ValueError, match="hidden"):
        MoeDecode(128, 2050, 768, 8)
