"""CPU tests of the grouped-GEMM templates: they compile for the targets, refuse with reasons.

Numerics are checked on the GPU by tools/check_gemm_kernels.py (compile here, run there).
"""
import re
import subprocess

import pytest
from sass_tools import cuobjdump

cute = pytest.importorskip("cutlass.cute")
torch = pytest.importorskip("torch")

from moe_aot_templates.grouped_gemm import (  # noqa: E402
    _REGS_MMA,
    GroupedDownGemm,
    GroupedGluGemm,
    glu_gate_block,
    interleave_gate_up,
)

QWEN3_30B = dict(num_experts=128, hidden=2048, intermediate=768, top_k=8)


def _compile(obj, arch):
    named = obj.fake_arguments()
    assert named[-1][0] == "stream"
    return cute.compile(obj, *[f for _, f in named], options=f"--gpu-arch {arch}")


@pytest.mark.parametrize("arch", ["sm_90a", "sm_121a"])
def test_glu_compiles(arch):
    obj = GroupedGluGemm(**QWEN3_30B, activation="swiglu", tile_m=64, tile_n=128, tile_k=64,
                         stages=3)
    # the expert biases' and the pre-activations' slots hold None without biases and outside
    # training (save_preact): no arguments of the compiled kernel
    assert [(n, f is None) for n, f in obj.fake_arguments()] == [
        ("x", False), ("w13", False), ("sorted_ids", False), ("tile_expert", False), ("h", False),
        ("b13", True), ("preact", True), ("stream", False)]
    assert GroupedGluGemm.can_implement(**QWEN3_30B, tile_m=64, stages=3, arch=arch)[0]
    assert _compile(obj, arch) is not None


@pytest.mark.parametrize("arch", ["sm_90a", "sm_121a"])
def test_down_compiles(arch):
    obj = GroupedDownGemm(**QWEN3_30B, tile_m=64, tile_n=128, tile_k=64, stages=3)
    assert [(n, f is None) for n, f in obj.fake_arguments()] == [
        ("h", False), ("w2", False), ("sorted_ids", False), ("tile_expert", False), ("topk_weights", False),
        ("y", False), ("b2", True), ("stream", False)]
    assert _compile(obj, arch) is not None


def test_geglu_small_tile_compiles():
    obj = GroupedGluGemm(**QWEN3_30B, activation="geglu", tile_m=16, tile_n=64, tile_k=128,
                         stages=2)
    assert _compile(obj, "sm_90a") is not None


@pytest.mark.parametrize("kwargs, words", [
    (dict(tile_k=96), "tile_k"),
    (dict(hidden=2000), "not divisible by tile_k"),
    (dict(intermediate=800), "not divisible by tile_n"),
    (dict(interleave=64, tile_n=64), "2*interleave"),
    (dict(activation="relu"), "activation"),
    (dict(mma="tcgen05"), "mma"),
    (dict(tile_m=256, tile_n=256), "accumulator registers"),
    (dict(tile_m=128, tile_n=256, tile_k=64, stages=4, arch="sm_121a"), "shared memory"),
    (dict(stages=1), "stages"),
])
def test_glu_refusals(kwargs, words):
    args = {**QWEN3_30B, **kwargs}
    ok, reason = GroupedGluGemm.can_implement(**args)
    assert not ok and words in reason, reason
    with pytest.raises(ValueError, match=words.split()[0]):
        args.pop("arch", None)
        if GroupedGluGemm.can_implement(**args)[0]:
            raise ValueError(words)  # only an arch refusal: the constructor takes no arch
        GroupedGluGemm(**args)


def test_down_refusals():
    ok, reason = GroupedDownGemm.can_implement(**QWEN3_30B, tile_n=96)
    assert not ok and "tile_n" in reason
    ok, reason = GroupedDownGemm.can_implement(num_experts=128, hidden=2880, intermediate=2880,
                                               top_k=4, tile_n=128)
    assert not ok and "N=2880" in reason
    ok, reason = GroupedDownGemm.can_implement(num_experts=128, hidden=2880, intermediate=2880,
                                               top_k=4, tile_n=64, arch="sm_90a")
    assert ok, reason


def test_interleave_gate_up_layout():
    e, i, h, g = 2, 32, 8, 16
    w_gate = torch.randn(e, i, h)
    w_up = torch.randn(e, i, h)
    w13 = interleave_gate_up(w_gate, w_up, g)
    assert w13.shape == (e, 2 * i, h)
    for j in range(i // g):
        assert torch.equal(w13[:, 2 * j * g:2 * j * g + g], w_gate[:, j * g:(j + 1) * g])
        assert torch.equal(w13[:, 2 * j * g + g:2 * (j + 1) * g], w_up[:, j * g:(j + 1) * g])


def test_the_removed_one_cta_wgmma_mainloop_is_refused_in_one_sentence():
    """mma="wgmma" (one CTA per tile, removed: hopws beat it) is refused by the rules the
    templates and the tuner share, naming the families there are."""
    for cls in (GroupedGluGemm, GroupedDownGemm):
        ok, reason = cls.can_implement(**QWEN3_30B, tile_m=128, tile_n=256, tile_k=64, stages=4, mma="wgmma")
        assert not ok and "'warp'" in reason and "'hopws'" in reason and "'hoppp'" in reason
        with pytest.raises(ValueError, match="must be 'warp'"):
            cls(**QWEN3_30B, tile_m=128, tile_n=256, tile_k=64, stages=4, mma="wgmma")
    ok, reason = GroupedDownGemm.can_implement(**QWEN3_30B, tile_m=16, mma="hopws")
    assert not ok and "tile_m" in reason


@pytest.mark.parametrize("mma", ["warp"])
def test_pdl_waits_before_reading_other_kernels_outputs(mma, tmp_path):
    """pdl=True: each GEMM waits for the previous grid (griddepcontrol.wait) and then lets the
    next one launch; GEMM1 waits before anything else, GEMM2 issues only weight cp.asyncs
    before its wait. pdl=False emits neither instruction."""
    def ptx(obj):
        return cute.compile(obj, *[f for _, f in obj.fake_arguments()],
                            options=f"--gpu-arch sm_90a --keep-ptx --dump-dir {tmp_path}").__ptx__

    kw = dict(**QWEN3_30B, tile_m=64, tile_n=128, tile_k=64, stages=4, mma=mma)
    for cls in (GroupedGluGemm, GroupedDownGemm):
        assert "griddepcontrol" not in ptx(cls(**kw))
        text = ptx(cls(**kw, pdl=True))
        body = text[text.index(".entry"):]
        wait, launch = body.find("griddepcontrol.wait"), body.find("griddepcontrol.launch_dependents")
        assert 0 < wait < launch, cls.__name__
        copies_before = body[:wait].count("cp.async.cg.shared.global")
        if cls is GroupedGluGemm:
            assert copies_before == 0 and body[:wait].count("ld.global") == 0
        else:
            # exactly the weight tiles of the first stages-1 k-tiles: 128 rows of 64 bf16 per
            # k-tile in 16-byte copies over the CTA's 128 threads
            obj = cls(**kw, pdl=True)
            ahead = obj.stages - 1
            assert obj.threads == 128
            assert copies_before == ahead * 128 * 64 // 8 // 128
            assert "ld.global" in body[:wait]  # tile_expert and sorted_ids, from the routing
            assert body[:wait].count("st.global") == 0


@pytest.mark.parametrize("role, tile_m, tile_n, stages", [("glu", 128, 256, 4), ("down", 128, 256, 4),
                                                          ("glu", 64, 128, 4), ("down", 64, 256, 4)])
def test_hopws_core_uses_tma_pipelines_and_never_waits_on_its_own_loads(role, tile_m, tile_n, stages,
                                                                         tmp_path):
    """mma="hopws" (templates/hopper_gemm.py): GEMM2 loads both operands by TMA and issues no
    cp.async; GEMM1 gathers A by cp.async and hands each stage to its full barrier with
    cp.async.mbarrier.arrive.noinc, with no cp.async.wait in the kernel at all; the consumers
    fence the async proxy before wgmma reads cp.async data; no local memory; the epilogue
    stores straight from the accumulators (no fp32 staging in shared memory)."""
    from moe_aot_templates.hopper_gemm import HopperDownGemm, HopperGluGemm

    cls = HopperGluGemm if role == "glu" else HopperDownGemm
    obj = cls(**QWEN3_30B, tile_m=tile_m, tile_n=tile_n, tile_k=64, stages=stages)
    assert obj.mma == "hopws" and obj.persistent and obj.threads == 128 + 2 * tile_m
    assert [n for n, _ in obj.fake_arguments()] == [n for n, _ in (
        GroupedGluGemm if role == "glu" else GroupedDownGemm)(**QWEN3_30B, tile_m=64).fake_arguments()]
    ptx = cute.compile(obj, *[f for _, f in obj.fake_arguments()],
                       options=f"--gpu-arch sm_90a --keep-ptx --dump-dir {tmp_path}").__ptx__
    body = ptx[ptx.index(".entry"):]
    assert "cp.async.bulk.tensor.2d" in body and "wgmma.mma_async" in body
    assert "ld.local" not in body and "st.local" not in body
    assert "st.shared.f32" not in body and "st.shared.v2.f32" not in body
    assert "cp.async.wait_group" not in body and "cp.async.wait_all" not in body
    if role == "down":
        assert "cp.async.cg.shared.global" not in body and "cp.async.mbarrier.arrive" not in body
        assert body.count("cp.async.bulk.tensor.2d") >= 2  # A and B
        # the epilogue stores whole 16-byte row chunks (quad transpose by shuffles), no 4-byte stores
        stores = [ln for ln in body.splitlines() if "st.global" in ln]
        assert stores and all(".v4." in ln for ln in stores), stores[:4]
        assert len(stores) == 2 * tile_n // 32 and "shfl.sync" in body
    else:
        assert "cp.async.cg.shared.global" in body
        assert "cp.async.mbarrier.arrive.noinc.shared" in body
        assert "fence.proxy.async.shared::cta" in body
    assert ("setmaxnreg" in body) == (tile_m == 128)
    with pytest.raises(ValueError, match="hopws"):
        cls(**QWEN3_30B, tile_m=tile_m, tile_n=tile_n, tile_k=64, stages=stages, mma="wgmma")
    base = GroupedGluGemm if role == "glu" else GroupedDownGemm
    with pytest.raises(ValueError, match="hopper_gemm"):  # its mainloop would not be hopws's
        base(**QWEN3_30B, tile_m=tile_m, tile_n=tile_n, tile_k=64, stages=stages, mma="hopws")
    assert cls.smem_bytes(tile_m, tile_n, 64, stages, "hopws") == \
        stages * (tile_m + tile_n) * 64 * 2 + 1024 + 16 * stages + 64 + 16 * tile_m
    ok, reason = GroupedGluGemm.can_implement(**QWEN3_30B, tile_m=tile_m, tile_n=tile_n, stages=stages,
                                              mma="hopws", arch="sm_121a")
    assert not ok and "sm_90a" in reason


def _mbarrier_init_counts(ptx: str) -> list[int]:
    """The arrival count of every mbarrier.init in a kernel's PTX, in order (counts are moved into
    a register first: `mov.b32 %rN, C;` ... `mbarrier.init.shared.b64 [...], %rN;`)."""
    import re

    consts = dict(re.findall(r"mov\.b32\s+(%r\d+),\s*(\d+);", ptx))
    return [int(consts[r]) for r in re.findall(r"mbarrier\.init\.shared\.b64\s+\[[^\]]+\],\s*(%r\d+);", ptx)]


def _turn_parity_flips(body: str) -> bool:
    """Whether the ping-pong turns (hopper_gemm._make_order: the kernel's last two mbarriers) are
    waited on with a parity the loop flips (`xor.b32 %rP, %rP, 1`) rather than one fixed before
    it: the DSL carries loop state only through names the loop rebinds, and a turn state mutated
    by a callee stayed at its first phase (a deadlock at the second tile, 2026-12-06)."""
    import re

    off = re.findall(r"mbarrier\.init\.shared\.b64\s+\[%r\d+(?:\+(\d+))?\]", body)[-2]
    regs = set(re.findall(r"add\.s32\s+(%r\d+),\s*%r\d+,\s*" + off + ";", body))
    parities = [p for a, p in re.findall(r"try_wait\.parity\.shared\.b64\s+P1,\s*\[(%r\d+)\],\s*(%r\d+)", body)
                if a in regs]
    return bool(parities) and all(re.search(r"xor\.b32\s+" + p + r",\s*" + p + r",\s*1;", body) for p in parities)


@pytest.mark.parametrize("role, tile_m, tile_n, stages", [("glu", 64, 256, 5), ("down", 64, 256, 5),
                                                          ("down", 64, 128, 8), ("glu", 128, 128, 6),
                                                          ("down", 128, 128, 6)])
def test_hoppp_pingpong_gives_each_warpgroup_its_own_tiles(role, tile_m, tile_n, stages, tmp_path):
    """mma="hoppp": 64- or 128-row tiles, a producer warpgroup and two consumer warpgroups that each own
    every other tile, so each ring stage and each schedule slot is read by one warpgroup: the
    empty barriers count the 4 warps of one warpgroup (hopws at 128 rows: 8) and the schedule
    slots its 128 threads; registers are moved to the consumers as for hopws's 384 threads;
    the same TMA/cp.async pipeline and register epilogue as hopws; a 128-row warpgroup tile is two
    64-row blocks of wgmma (and of 16-byte epilogue stores) per warpgroup. The two mainloops take
    turns: two more mbarriers of 128 arrivals, waited on with a parity that flips per tile."""
    from moe_aot_templates.hopper_gemm import HopperDownGemm, HopperGluGemm

    cls = HopperGluGemm if role == "glu" else HopperDownGemm
    obj = cls(**QWEN3_30B, tile_m=tile_m, tile_n=tile_n, tile_k=64, stages=stages, mma="hoppp")
    assert obj.pingpong and obj.persistent and obj.threads == 384 and obj.mma_threads == 256
    assert obj.acc_rows == tile_m // 32
    ptx = cute.compile(obj, *[f for _, f in obj.fake_arguments()],
                       options=f"--gpu-arch sm_90a --keep-ptx --dump-dir {tmp_path}").__ptx__
    body = ptx[ptx.index(".entry"):]
    full = 1 + 128 if role == "glu" else 1  # TMA (+ GEMM1's 128 cp.async arrivals)
    assert _mbarrier_init_counts(body) == [full] * stages + [4] * stages + [1, 1] + [128, 128] + [128, 128]
    assert _turn_parity_flips(body)
    assert cls.smem_bytes(tile_m, tile_n, 64, stages, "hoppp") == \
        cls.smem_bytes(tile_m, tile_n, 64, stages, "hopws") + 16  # the turns' two mbarriers
    assert "setmaxnreg" in body and "wgmma.mma_async" in body
    assert "ld.local" not in body and "st.local" not in body
    assert "cp.async.wait_group" not in body
    stores = [ln for ln in body.splitlines() if "st.global" in ln]
    assert stores and all(".v4." in ln for ln in stores)
    assert len(stores) == (tile_m // 32) * (tile_n // (64 if role == "glu" else 32))
    hopws = cls(**QWEN3_30B, tile_m=128, tile_n=tile_n, tile_k=64, stages=4)
    ptx2 = cute.compile(hopws, *[f for _, f in hopws.fake_arguments()],
                        options=f"--gpu-arch sm_90a --keep-ptx --dump-dir {tmp_path}").__ptx__
    body2 = ptx2[ptx2.index(".entry"):]
    assert _mbarrier_init_counts(body2)[4:8] == [8] * 4  # the check can fail
    assert len(_mbarrier_init_counts(body2)) == 4 + 4 + 2 + 2  # stages, schedule slots: no turns
    with pytest.raises(ValueError, match="256 fp32 accumulator registers"):
        cls(**QWEN3_30B, tile_m=128, tile_n=256, tile_k=64, stages=4, mma="hoppp")
    with pytest.raises(ValueError, match="needs mma hopws"):
        cls(**QWEN3_30B, tile_m=tile_m, tile_n=tile_n, tile_k=64, stages=stages, mma="hoppp", cluster_m=2)
    ok, reason = GroupedGluGemm.can_implement(**QWEN3_30B, tile_m=64, tile_n=256, stages=6, mma="hoppp",
                                              arch="sm_90a")
    assert not ok and "shared memory" in reason


@pytest.mark.parametrize("role", ["glu", "down"])
def test_hopws_clusters_pair_the_tiles_of_one_expert(role, tmp_path):
    """cluster_m 2: before its first unit the producer lists the live M tiles in units of two
    (one expert's tiles together, leftovers of two experts together) by warp ballots over
    tile_expert, into a shared-memory list that the budget counts; pair_list=False builds the
    fixed pairs 2j, 2j + 1 without that pass (the pairing measured until 2026-12-02); the
    weights' multicast TMA and the plain TMA (a unit of two experts) are both there either way.
    Every output row of the paired kernel was checked on the H200 (NOTES, fourteenth session)."""
    from moe_aot_templates.hopper_gemm import HopperDownGemm, HopperGluGemm

    from moe_aot import gemm_limits as limits

    cls = HopperGluGemm if role == "glu" else HopperDownGemm
    bodies = {}
    for pair_list in (True, False):
        obj = cls(**QWEN3_30B, tile_m=128, tile_n=256, tile_k=64, stages=4, mma="hopws", cluster_m=2,
                  pair_list=pair_list)
        ptx = cute.compile(obj, *[f for _, f in obj.fake_arguments()],
                           options=f"--gpu-arch sm_90a --keep-ptx --dump-dir {tmp_path}").__ptx__
        bodies[pair_list] = ptx[ptx.index(".entry"):]
    for body in bodies.values():
        assert ".multicast::cluster" in body and "ld.local" not in body and "st.local" not in body
    paired, fixed = bodies[True], bodies[False]
    for op in ("vote.sync.ballot", "popc.b32", "shfl.sync.up", "shfl.sync.down"):
        assert op in paired and op not in fixed, op
    assert ("clz.b32" in paired or "bfind" in paired) and "clz.b32" not in fixed
    need = limits.smem_bytes(128, 256, 64, 4, "hopws", cluster_m=2)
    assert need == limits.smem_bytes(128, 256, 64, 4, "hopws") + 4 * limits.PAIR_LIST_WORDS <= 227 * 1024
    # 128x160 in 6 stages fits alone (224416 B) but not with the list (233632 B > 227 KB)
    assert limits.check_gemm(1920, 2048, 128, 160, 64, 6, "hopws", arch="sm_90a") == (True, "")
    ok, why = limits.check_gemm(1920, 2048, 128, 160, 64, 6, "hopws", arch="sm_90a", cluster_m=2)
    assert not ok and "shared memory" in why


@pytest.mark.parametrize("mma", ["hopws", "hoppp"])
def test_raster_groups_cut_at_expert_boundaries(mma, tmp_path):
    """raster_experts: the producers walk raster groups that end at an expert boundary, found by
    a warp ballot over tile_expert (lanes read the group's tiles, shuffle up to compare with the
    previous tile, the highest boundary by clz/bfind), and publish M tile * N tiles + N tile;
    the fixed groups have none of that. Single CTAs only: with clusters it is refused in one
    sentence. Not yet timed on a GPU (NOTES, thirtieth session)."""
    from moe_aot_templates.hopper_gemm import HopperDownGemm, HopperGluGemm

    tile_m = 128 if mma == "hopws" else 64
    for cls in (HopperGluGemm, HopperDownGemm):
        bodies = {}
        for xa in (True, False):
            obj = cls(**QWEN3_30B, tile_m=tile_m, tile_n=256, tile_k=64, stages=4, mma=mma, raster_experts=xa)
            ptx = cute.compile(obj, *[f for _, f in obj.fake_arguments()],
                               options=f"--gpu-arch sm_90a --keep-ptx --dump-dir {tmp_path}").__ptx__
            bodies[xa] = ptx[ptx.index(".entry"):]
        cut, fixed = bodies[True], bodies[False]
        assert "ld.local" not in cut and "st.local" not in cut
        for op in ("vote.sync.ballot", "shfl.sync.up"):
            assert op in cut and op not in fixed, (cls.__name__, op)
        assert ("clz.b32" in cut or "bfind" in cut) and "clz.b32" not in fixed
    with pytest.raises(ValueError, match=r"raster_experts needs .* \(cluster 1\) .* got hopws with cluster 2"):
        HopperDownGemm(**QWEN3_30B, tile_m=128, tile_n=256, tile_k=64, stages=4, mma="hopws", cluster_m=2,
                       raster_experts=True)


@pytest.mark.parametrize("role", ["glu", "down"])
def test_hopws_pair_warpgroup_of_padding_rows_issues_no_wgmma(role, tmp_path):
    """2-CTA clusters (hopper_gemm._rows_live): a consumer warpgroup whose 64 rows are all padding
    (an expert's last tile with <= 64 rows), or the cluster's duplicate tile, branches past its
    k-tile's wgmmas and their commit, so ptxas closes no empty group with a dummy wgmma
    (HGMMA.64x8x16 on RZ) and the one real group per k-tile stays in flight (DEPBAR.LE 1), as
    without the skip (skip_padding=False, the kernels before 2026-12-03). Single CTAs, 64-row
    tiles and ping-pong never skip (a single CTA's early tile breaks the lockstep its raster's L2
    reuse needs: NOTES, nineteenth session). Rows and numerics: checked on the H200
    (tools/check_gemm_kernels.py --ab xc2nk,xc2)."""
    from moe_aot_templates.hopper_gemm import HopperDownGemm, HopperGluGemm

    cls = HopperGluGemm if role == "glu" else HopperDownGemm
    tool = cuobjdump()
    sass, ptx = {}, {}
    for skip in (True, False):
        obj = cls(**QWEN3_30B, tile_m=128, tile_n=256, tile_k=64, stages=4, mma="hopws", cluster_m=2,
                  skip_padding=skip)
        assert obj.skip_padding is skip
        compiled = cute.compile(obj, *[f for _, f in obj.fake_arguments()],
                                options=f"--gpu-arch sm_90a --keep-ptx --keep-cubin --dump-dir {tmp_path}")
        body = compiled.__ptx__[compiled.__ptx__.index(".entry"):]
        ptx[skip] = body
        assert body.count("wgmma.mma_async") == 4 and body.count("wgmma.commit_group") == 1
        if tool is not None:
            cubin = tmp_path / f"k{skip}.cubin"
            cubin.write_bytes(compiled.__cubin__)
            sass[skip] = subprocess.run([tool, "-sass", str(cubin)], capture_output=True, text=True,
                                        check=True).stdout
    assert not cls(**QWEN3_30B, tile_m=128, tile_n=256, tile_k=64, stages=4).skip_padding
    assert not cls(**QWEN3_30B, tile_m=64, tile_n=256, tile_k=64, stages=5, mma="hoppp").skip_padding
    # the skip tests the warpgroup's first row of the schedule slot and the duplicate code
    assert len(re.findall(r"setp\.\w+\.s32", ptx[True])) > len(re.findall(r"setp\.\w+\.s32", ptx[False]))
    if tool is None:
        return  # the PTX checks above stand; the SASS ones need cuobjdump
    for skip, text in sass.items():
        hgmma = re.findall(r"HGMMA\.(\w+)", text)
        assert hgmma == ["64x256x16"] * 4, (skip, hgmma)  # no dummy 64x8x16 group
        assert re.findall(r"WARPGROUP\.DEPBAR\.LE gsb0, (0x\d)", text) == ["0x1", "0x0"], skip
        assert not re.search(r"\b(STL|LDL)\b", text), skip


@pytest.mark.parametrize("tile_m, tile_n, activation", [(128, 256, "swiglu"), (64, 128, "geglu"),
                                                        (128, 96, "swiglu")])
def test_hopws_glu_epilogue_stores_16_byte_chunks(tile_m, tile_n, activation, tmp_path):
    """GEMM1's register epilogue (hopws): with tile_n % 64 == 0 the quad transposes its h pairs
    by shuffles and each thread stores only 16-byte vectors, one per row and group of four h
    blocks (2 * tile_n / 64), a quarter of the pair-wise stores; other tile_n (here 96) keep
    the 4-byte pair stores (2 * tile_n / 16). Either way no local memory, and no register
    beyond the consumers' setmaxnreg budget."""
    from moe_aot_templates.hopper_gemm import HopperGluGemm

    obj = HopperGluGemm(**QWEN3_30B, activation=activation, tile_m=tile_m, tile_n=tile_n, tile_k=64,
                        stages=4)
    compiled = cute.compile(obj, *[f for _, f in obj.fake_arguments()],
                            options=f"--gpu-arch sm_90a --keep-ptx --keep-cubin --dump-dir {tmp_path}")
    ptx = compiled.__ptx__
    body = ptx[ptx.index(".entry"):]
    stores = [ln.split()[0] for ln in body.splitlines() if "st.global" in ln]
    if tile_n % 64 == 0:
        assert stores == ["st.global.v4.b32"] * (2 * tile_n // 64), stores
        assert body.count("shfl.sync") >= 4 * len(stores)  # four rounds per chunk
    else:
        assert stores == ["st.global.b32"] * (2 * tile_n // 16), stores
    assert "ld.local" not in body and "st.local" not in body
    tool = cuobjdump()
    if tool is None:
        return  # the PTX checks above stand; SASS and resource usage need cuobjdump
    cubin = tmp_path / "kernel.cubin"
    cubin.write_bytes(compiled.__cubin__)
    sass = subprocess.run([tool, "-sass", str(cubin)], capture_output=True, text=True, check=True).stdout
    stg = re.findall(r"\bSTG\.\S+", sass)
    assert stg == [("STG.E.128" if tile_n % 64 == 0 else "STG.E")] * len(stores), stg
    usage = subprocess.run([tool, "--dump-resource-usage", str(cubin)], capture_output=True, text=True,
                           check=True).stdout
    regs, stack, local = (int(re.search(rf"{k}:(\d+)", usage)[1]) for k in ("REG", "STACK", "LOCAL"))
    assert regs <= _REGS_MMA and stack == 0 and local == 0, usage
    assert max(int(r) for r in re.findall(r"\bR(\d+)\b", sass)) < _REGS_MMA


def _emulate_glu_chunks(tile_n, interleave):
    """{(row, h column): (row, gate column, up column)} that one warpgroup's threads store in
    GroupedGluGemm._epilogue_regs_chunks (N tile 0), step by step from the kernel's code. The
    fragment is _acc_coords's: lane l of warp w holds at element v + 2h + 4j row
    16w + l // 4 + 8h and tile column 2(l % 4) + 8j + v."""
    def coord(w, lane, e):
        v, h, j = e % 2, (e // 2) % 2, e // 4
        return 16 * w + lane // 4 + 8 * h, 2 * (lane % 4) + 8 * j + v

    nb, half = interleave // 8, tile_n // 2
    stored = {}
    for w in range(4):
        for hrow in range(2):
            for grp in range(half // 32):
                packed = []  # per lane: 4 pairs of ((row, gate col), (row, up col))
                for lane in range(32):
                    pk = []
                    for i in range(4):
                        gi = 2 * hrow + 4 * glu_gate_block(4 * grp + i, interleave)
                        ui = gi + 4 * nb
                        pk.append([(coord(w, lane, gi + v), coord(w, lane, ui + v)) for v in range(2)])
                    packed.append(pk)
                for lane in range(32):
                    q, quad0 = lane % 4, lane - lane % 4
                    # _quad_transpose: in round r lane s sends packed[s][(s % 4) ^ r] and lane q
                    # reads the value of lane quad0 + (q ^ r); chunk[src] = got[q ^ src]
                    got = [packed[quad0 + (q ^ r)][((q ^ r) % 4) ^ r] for r in range(4)]
                    chunk = [got[q ^ src] for src in range(4)]
                    row = coord(w, lane, 2 * hrow)[0]
                    col0 = coord(w, lane, 2 * hrow)[1] - 2 * q + 8 * q
                    for k in range(8):
                        (grow, gcol), (urow, ucol) = chunk[k // 2][k % 2]
                        key = (row, col0 + 32 * grp + k)
                        assert key not in stored, key
                        assert grow == urow == row
                        stored[key] = (grow, gcol, ucol)
    return stored


@pytest.mark.parametrize("tile_n, interleave", [(64, 16), (128, 16), (192, 16), (256, 16),
                                                (64, 32), (256, 32), (64, 8), (192, 8)])
def test_glu_epilogue_chunk_mapping(tile_n, interleave):
    """The 16-byte GLU epilogue stores every h column of the tile's 64 rows per warpgroup exactly
    once, each from its own gate column c and up column c + g, h column (c // 2g) * g + c % g."""
    g, half = interleave, tile_n // 2
    stored = _emulate_glu_chunks(tile_n, interleave)
    assert sorted(stored) == [(r, c) for r in range(64) for c in range(half)]
    for (row, hcol), (_, gcol, ucol) in stored.items():
        assert (gcol // g) % 2 == 0 and ucol == gcol + g, (row, hcol, gcol, ucol)
        assert hcol == (gcol // (2 * g)) * g + gcol % g


GPT_OSS = dict(num_experts=128, hidden=2880, intermediate=2880, top_k=4)


@pytest.mark.parametrize("mma, tile_m, tile_n, stages", [("warp", 16, 32, 8), ("warp", 64, 64, 3),
                                                         ("hopws", 128, 192, 4), ("hoppp", 64, 192, 6)])
def test_expert_biases_and_clamped_swiglu_compile(mma, tile_m, tile_n, stages):
    """gpt-oss's GEMMs (bias=True, activation "swigluoai"): the biases are the kernels' last tensor
    arguments (b13 [E, 2I] / b2 [E, H] bf16), the staged and the register epilogues compile for
    each core, and no thread spills to local memory; fp8 refuses biases with the reason."""
    from moe_aot_templates.hopper_gemm import HopperDownGemm, HopperGluGemm

    from moe_aot.kernel_build import compile_kernel

    ws = mma in ("hopws", "hoppp")
    kw = dict(tile_m=tile_m, tile_n=tile_n, tile_k=64, stages=stages, mma=mma, bias=True)
    glu = (HopperGluGemm if ws else GroupedGluGemm)(**GPT_OSS, activation="swigluoai", **kw)
    down = (HopperDownGemm if ws else GroupedDownGemm)(**GPT_OSS, **kw)
    for obj, name, args in ((glu, "t_glu", ["x", "w13", "sorted_ids", "tile_expert", "h", "b13", "stream"]),
                            (down, "t_down", ["h", "w2", "sorted_ids", "tile_expert", "topk_weights", "y", "b2",
                                              "stream"])):
        art = compile_kernel(obj, "sm_90a", name)
        assert [a["name"] for a in art.meta["args"]] == args
        bias = {a["name"]: a for a in art.meta["args"]}["b13" if obj is glu else "b2"]
        assert bias["static_shape"] == [128, 2 * 2880 if obj is glu else 2880] and bias["dtype"] == "BFloat16", bias
        body = art.ptx[art.ptx.index(".entry"):]
        assert "ld.local" not in body and "st.local" not in body
    with pytest.raises(ValueError, match="expert biases are built for bf16"):
        GroupedGluGemm(**QWEN3_30B, tile_m=64, tile_n=128, tile_k=128, stages=4, mma="hopws", precision="fp8",
                       bias=True)
