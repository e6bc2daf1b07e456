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
    assert [n for n, _ in args] == ["x", "w13", "w13s", "w2", "w2s", "topk_weights", "topk_ids", "out", "h", "bar",
                                    "b13", "b2", "tl", "stream"]
    assert all((f is None) != bias for n, f in args if n in ("b13", "b2"))
    assert all(f is None for n, f in args if n in ("w13s", "w2s"))  # bf16: no scales
    ptx = cute.compile(obj, *[f for _, f in args],
                       options=f"--gpu-arch sm_90a --keep-ptx --dump-dir {tmp_path}").__ptx__
    body = ptx[ptx.index(".entry"):]
    # the grid barrier: one 64-bit release add per CTA to a count that only grows, acquire polls
    assert "atom.global.release.add.u64" in body and "ld.acquire.gpu.global.b64" in body
    assert "atom.global.acq_rel.add" not in body  # no reset / generation round trips
    assert "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes" in body  # the weight stream
    assert "mbarrier.try_wait" in body and "shfl.sync.bfly" in body
    assert "fence.proxy.async.global" in body  # h: written by threads, read by other CTAs' bulk copies
    # every row segment is one bulk copy of at most 2 KB that divides the row
    assert h % obj.seg1 == 0 and i % obj.seg2 == 0 and max(obj.seg1, obj.seg2) * 2 <= 2048
    assert obj.seg1 == (1024 if h == 2048 else 960)  # 2880 = 3 x 960: the tail chunk of a lane is predicated
    assert obj.stages >= 2


@pytest.mark.parametrize("max_tokens", [1, 4])
def test_decode_slots_compile_without_local_memory(max_tokens, tmp_path):
    """One slot keeps its accumulators in registers, more use shared memory: no local memory
    either way; one producer warp of bulk copies with transaction counts."""
    obj = MoeDecode(128, 2048, 768, 8, max_tokens=max_tokens)
    assert obj.threads == (8 + 1) * 32
    ptx = cute.compile(obj, *[f for _, f in obj.fake_arguments()],
                       options=f"--gpu-arch sm_90a --keep-ptx --dump-dir {tmp_path}").__ptx__
    body = ptx[ptx.index(".entry"):]
    assert "cp.async.bulk" in body and "expect_tx" in body and "cp.async.cg.shared.global" not in body
    assert ".local" not in body


@pytest.mark.parametrize("precision", ["fp8", "fp8-block128"])
def test_decode_fp8_weights_compile(precision, tmp_path):
    """e4m3 weights with the fp8 layer's scales: 16 weights per 16-byte load and segment step,
    converted by cvt e4m3x2 -> f16x2, x and h kept unquantized; block scales read from global
    memory (per expert and matrix: three scalars), no local memory."""
    import re

    obj = MoeDecode(256, 7168, 2048, 8, max_tokens=1, precision=precision)
    assert obj.wvec == 16 and obj.seg1 % 16 == 0 and 7168 % obj.seg1 == 0 and obj.seg1 <= 2048
    args = dict(obj.fake_arguments())
    assert args["w13"].element_type.width == 8 and args["h"].element_type.width == 16
    want = {"fp8": ((256, 2), (256,)), "fp8-block128": ((256, 32, 56), (256, 56, 16))}[precision]
    assert (tuple(args["w13s"].shape), tuple(args["w2s"].shape)) == want
    # a phase-2 stage: 8 rows of 2048 e4m3 plus one h row of 2048 bf16
    assert obj.stage_bytes == 8 * 2048 + 2048 * 2 and obj.stages >= 3
    ptx = cute.compile(obj, *[f for f in args.values()],
                       options=f"--gpu-arch sm_90a --keep-ptx --dump-dir {tmp_path}").__ptx__
    body = ptx[ptx.index(".entry"):]
    assert "cvt.rn.f16x2.e4m3x2" in body and "cp.async.bulk.shared::cluster.global" in body
    assert ".local" not in body
    assert len(re.findall(r"ld\.global\.b32", body)) >= 2  # the scales


def test_decode_grid_barrier_wait_is_bounded(tmp_path):
    """The producer's wait for the grid barrier's count polls a bounded number of times and then
    traps: a count that never completes is a kernel error, not a hung process."""
    obj = MoeDecode(128, 2048, 768, 8, max_tokens=1)
    args = dict(obj.fake_arguments())
    assert tuple(args["bar"].shape) == (2,)
    ptx = cute.compile(obj, *args.values(), options=f"--gpu-arch sm_90a --keep-ptx --dump-dir {tmp_path}").__ptx__
    body = ptx[ptx.index(".entry"):]
    assert "trap;" in body and "ld.acquire.gpu.global.b64" in body


def test_decode_timeline_build_records_every_event(tmp_path):
    """timeline=True adds tl [ctas, 16] int64 (last) and a %globaltimer read per event; a build
    without it has no tl argument and reads no timer."""
    from moe_aot_templates.decode import TIMELINE, TIMELINE_COLS

    for timeline in (False, True):
        obj = MoeDecode(128, 2048, 768, 8, max_tokens=1, timeline=timeline)
        args = obj.fake_arguments()
        assert [n for n, _ in args][-2:] == ["tl", "stream"]
        tl = dict(args)["tl"]
        assert (tl is None) != timeline
        (tmp_path / str(timeline)).mkdir()
        ptx = cute.compile(obj, *[f for _, f in args],
                           options=f"--gpu-arch sm_90a --keep-ptx --dump-dir {tmp_path / str(timeline)}").__ptx__
        body = ptx[ptx.index(".entry"):]
        if timeline:
            assert tuple(tl.shape) == (obj.ctas, TIMELINE_COLS) and len(TIMELINE) <= TIMELINE_COLS
            assert body.count("%globaltimer") >= len(TIMELINE)
        else:
            assert "globaltimer" not in body


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
    ok, why = MoeDecode.can_implement(128, 2048, 768, 8, precision="nvfp4")
    assert not ok and "precision" in why
    ok, why = MoeDecode.can_implement(128, 2056, 768, 8, precision="fp8")  # 2056 = 8 * 257: not whole 16-B loads
    assert not ok and "multiples of 16" in why
    # measured and removed (NOTES, twenty-third session): the names keep the one value each field has
    ok, why = MoeDecode.can_implement(128, 2048, 768, 8, producer="cpasync")
    assert not ok and "producer 'cpasync' must be one of ('bulk',)" in why
    ok, why = MoeDecode.can_implement(128, 2048, 768, 8, sync="group")
    assert not ok and "sync 'group' must be one of ('grid',)" in why
    ok, why = MoeDecode.can_implement(128, 2880, 2880, 4, precision="fp8-block128")
    assert not ok and "128" in why
    assert MoeDecode.can_implement(128, 2880, 2880, 4, precision="fp8")[0]  # per-expert scales: any 16-multiple


@pytest.mark.parametrize("precision, intermediate, lanes", [("bf16", 768, True), ("fp8", 768, True),
                                                           ("fp8", 2048, True), ("fp8", 2048, False)])
def test_h_is_read_where_phase_1_writes_it(precision, intermediate, lanes):
    """Phase 1 stores h column c at _h_pos(c); phase 2 reads elements 8j .. 8j+7 of a lane's chunk
    k at _h_at(k, j) within each segment. With lanes, for e4m3 weights (16-element chunks) the
    halves of a chunk lie half a segment apart, so that a warp's 16-byte loads are consecutive (no
    bank conflict); for bf16, or without lanes, the order is h's own. Every column has one place,
    inside its segment."""
    obj = MoeDecode(128, 2048, intermediate, 8, max_tokens=1, precision=precision, lanes=lanes)
    seg, V = obj.seg2, obj.wvec
    pos = [obj._h_pos(c) for c in range(intermediate)]
    assert sorted(pos) == list(range(intermediate)) and all(p // seg == c // seg for c, p in enumerate(pos))
    assert (pos == list(range(intermediate))) == (precision == "bf16" or not lanes)
    for col in range(intermediate):
        e = col % seg
        k, j, r = e // V, (e % V) // 8, e % 8
        assert (col // seg) * seg + obj._h_at(k, j) + r == pos[col]
    if precision == "fp8" and lanes:  # lanes k, k+1 read 16-byte words next to each other
        assert obj._h_at(1, 0) - obj._h_at(0, 0) == 8 and obj._h_at(0, 1) == seg // 2


def test_decode_rotate_compiles(tmp_path):
    """rotate (an experiment): each CTA starts its phase-2 groups at its own offset."""
    obj = MoeDecode(256, 7168, 2048, 8, max_tokens=1, warps=16, precision="fp8", rotate=True)
    args = dict(obj.fake_arguments())
    ptx = cute.compile(obj, *args.values(), options=f"--gpu-arch sm_90a --keep-ptx --dump-dir {tmp_path}").__ptx__
    assert ".local" not in ptx[ptx.index(".entry"):]
