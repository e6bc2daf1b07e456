"""CPU tests of the backward's weight-gradient GEMMs (templates/hopper_wgrad.py): names, limits,
the compile for sm_90a (wgmma in SASS, zero-filling gathers, no local memory), the torch reference
against the backward's own grouped GEMMs, the launcher's checks and how `moe-aot build --backward`
builds them. The GPU comparison is tests/test_gpu_wgrad.py."""
from __future__ import annotations

import re
import subprocess

import pytest

torch = pytest.importorskip("torch")

from sass_tools import cuobjdump  # noqa: E402

from moe_aot import gemm_limits as limits  # noqa: E402
from moe_aot.harness.reference import routing_reference  # noqa: E402
from moe_aot.runtime.library import KernelArgumentError  # noqa: E402
from moe_aot.runtime.wgrad import weight_gradients, weight_gradients_reference  # noqa: E402
from moe_aot.spec import PRESETS, make_spec  # noqa: E402
from moe_aot.variants import wgrad_kernels  # noqa: E402

_NAME = re.compile(r"moe_wgrad_sm90a_bf16_e(\d+)k(\d+)_r(\d+)c(\d+)_g([ab])_t(\d+)x(\d+)x(\d+)_s(\d+)(pp)?$")


def test_wgrad_names_spell_every_constructor_argument():
    """Each name parses back to its kernel's constructor arguments (so no two kernels built
    differently share a name), for every preset; dW13 gathers x ("b"), dW2 gathers dO ("a")."""
    names = set()
    for model in PRESETS:
        spec = make_spec(model, target="sm_90a")
        kvs = wgrad_kernels(spec)
        assert [kv.role for kv in kvs] == ["wgrad", "wgrad"], model
        for kv, rows, cols, gather in zip(kvs, (2 * spec.intermediate, spec.hidden),
                                          (spec.hidden, spec.intermediate), "ba"):
            e, k, r, c, g, tm, tn, tk, st, pp = _NAME.fullmatch(kv.name).groups()
            assert kv.kwargs() == {"num_experts": int(e), "out_rows": int(r), "out_cols": int(c), "top_k": int(k),
                                   "gather": g, "tile_m": int(tm), "tile_n": int(tn), "tile_k": int(tk),
                                   "stages": int(st), **({"pingpong": True} if pp else {})}
            assert (int(r), int(c), g, int(e), int(k)) == (rows, cols, gather, spec.experts, spec.top_k)
            assert limits.check_wgrad(int(r), int(c), g, int(tm), int(tn), int(tk), int(st), "sm_90a", bool(pp))[0]
            names.add(kv.name)
    assert len(names) == 2 * len(PRESETS)
    # gpt-oss's H = I = 2880: no 128-row tile divides dW2's 2880 rows, so its dW2 runs on 64-row tiles
    assert [kv.kwargs()["tile_m"] for kv in wgrad_kernels(make_spec("gpt-oss-120b", target="sm_90a"))] == [128, 64]
    assert wgrad_kernels(make_spec("qwen3-30b-a3b", target="sm_100a")) == []
    # given tiles (tools/check_wgrad.py --configs): ping-pong spelled "pp", refused tiles in one sentence
    pp = wgrad_kernels(make_spec("deepseek-v3", target="sm_90a"), {"b": (64, 256, 5, True), "a": (128, 128, 6, True)})
    assert [kv.name.split("_t")[-1] for kv in pp] == ["64x256x64_s5pp", "128x128x64_s6pp"]
    assert [kv.kwargs()["pingpong"] for kv in pp] == [True, True]
    with pytest.raises(ValueError, match="ping-pong tile of 128x256"):
        wgrad_kernels(make_spec("deepseek-v3", target="sm_90a"), {"b": (128, 256, 4, True)})
    assert wgrad_kernels(make_spec("qwen3-30b-a3b", target="sm_90a", precision="fp8")) == []


@pytest.mark.parametrize("args, words", [
    ((1024, 512, "c", 128, 128, 64, 4), "gather 'c'"),
    ((1024, 512, "b", 96, 128, 64, 4), "tile_m 96"),
    ((1024, 512, "b", 128, 96, 64, 4), "tile_n 96"),
    ((1024, 512, "b", 128, 320, 64, 4), "tile_n 320"),
    ((1024, 512, "b", 128, 128, 32, 4), "tile_k 32"),
    ((1000, 512, "b", 128, 128, 64, 4), "1000 rows"),
    ((1024, 960, "a", 128, 256, 64, 4), "960 columns"),
    ((1024, 512, "a", 128, 128, 64, 1), "stages 1"),
    ((1024, 512, "b", 128, 256, 64, 5), "shared memory"),
    ((1024, 512, "b", 128, 256, 64, 4, "sm_90a", True), "ping-pong tile of 128x256"),
    ((1024, 512, "b", 256, 256, 64, 2), "256-row tile"),
    ((1024, 512, "b", 256, 128, 64, 4, "sm_90a", True), "256-row tile"),
])
def test_wgrad_limits_refuse_in_one_sentence(args, words):
    ok, why = limits.check_wgrad(*args)
    assert not ok and words in why and why.count(". ") == 0 and not why.endswith(".")
    ok, why = limits.check_wgrad(1024, 512, "b", 128, 128, 64, 4, arch="sm_100a")
    assert not ok and "sm_100a" in why
    assert limits.check_wgrad(1024, 512, "b", 128, 256, 64, 4)[0]
    assert limits.wgrad_smem_bytes(128, 256, 64, 4) <= limits.SMEM_CAPACITY["sm_90a"]
    assert limits.wgrad_default_tiles(1000, 512) is None


def test_default_tiles_put_the_gathered_operand_on_the_narrow_side():
    """dW13 (x gathered: the N side) in 256x128 tiles where 2I divides by 256, dW2 (dO gathered:
    the M side) in 128x256; the compiled weight gradients are preferred only with dW13's 256-row
    tiles and at most WGRAD_MAX_ROWS_PER_EXPERT rows per expert (what the H200 measured)."""
    from moe_aot.variants import WGRAD_MAX_ROWS_PER_EXPERT, wgrad_preferred

    tiles = {m: [(kv.kwargs()["tile_m"], kv.kwargs()["tile_n"]) for kv in wgrad_kernels(make_spec(m, target="sm_90a"))]
             for m in PRESETS}
    assert tiles["qwen3-30b-a3b"] == tiles["deepseek-v3"] == tiles["mixtral-8x7b"] == [(256, 128), (128, 256)]
    assert tiles["gpt-oss-120b"] == [(128, 192), (64, 192)]  # 2I = 5760, H = I = 2880
    assert limits.wgrad_default_tiles(5760, 2880, "b") == (128, 192, 5, False, False)
    ds = make_spec("deepseek-v3", target="sm_90a")
    limit = WGRAD_MAX_ROWS_PER_EXPERT * ds.experts // ds.top_k
    assert wgrad_preferred(ds, limit) and not wgrad_preferred(ds, limit + 1)
    assert not wgrad_preferred(make_spec("gpt-oss-120b", target="sm_90a"), 1)
    assert not wgrad_preferred(make_spec("qwen3-30b-a3b", target="sm_100a"), 1)


def test_wgrad_template_refuses_what_the_limits_refuse():
    pytest.importorskip("cutlass")
    from moe_aot_templates.hopper_wgrad import HopperWgrad

    with pytest.raises(ValueError, match="tile_n 96"):
        HopperWgrad(8, 1024, 512, 2, "b", tile_n=96)
    with pytest.raises(ValueError, match="top_k 0"):
        HopperWgrad(8, 1024, 512, 0, "b")


def _sass(obj, tmp_path):
    import cutlass.cute as cute

    compiled = cute.compile(obj, *[f for _, f in obj.fake_arguments()],
                            options=f"--gpu-arch sm_90a --keep-cubin --keep-ptx --dump-dir {tmp_path}")
    tool = cuobjdump()
    if tool is None:
        pytest.skip("no cuobjdump")
    (tmp_path / "k.cubin").write_bytes(compiled.__cubin__)
    sass = subprocess.run([tool, "-sass", str(tmp_path / "k.cubin")], capture_output=True, text=True, check=True).stdout
    res = subprocess.run([tool, "-res-usage", str(tmp_path / "k.cubin")], capture_output=True, text=True,
                         check=True).stdout
    return compiled.__ptx__, sass, res


@pytest.mark.parametrize("model, which", [("mixtral-8x7b", 0), ("mixtral-8x7b", 1), ("gpt-oss-120b", 0),
                                          ("gpt-oss-120b", 1)])
def test_wgrad_compiles_to_wgmma_without_local_memory(model, which, tmp_path):
    """The shipped tiles of dW13 (x gathered) and dW2 (dO gathered), 128- and 64-row: wgmma
    (HGMMA) on both MN-major operands, the contiguous operand by TMA, the gathered one by
    16-byte cp.async whose source size is a register (0 for padding rows: zero fill), 16-byte
    stores of the tile, no local memory."""
    pytest.importorskip("cutlass")
    from moe_aot.compiler import build_template

    kv = wgrad_kernels(make_spec(model, target="sm_90a"))[which]
    ptx, sass, res = _sass(build_template(kv), tmp_path)
    kw = kv.kwargs()
    hgmma = re.findall(r"HGMMA\.64x(\d+)x16\.F32\.BF16 R\d+, gdesc\[UR\d+\]\.tnspA\.tnspB", sass)
    assert hgmma and {int(n) for n in hgmma} == {kw["tile_n"]}, hgmma  # both operands MN-major
    assert len(hgmma) == sass.count("HGMMA")
    assert "UTMALDG" in sass and "LDGSTS.E.BYPASS.128" in sass
    assert re.search(r"cp\.async\.cg\.shared\.global \[%r\d+\], \[%rd\d+\], 16, %r\d+;", ptx)
    assert "STG.E.128" in sass
    assert not re.search(r"\b(STL|LDL)\b", sass)
    assert "LOCAL:0" in res and "STACK:0" in res


@pytest.mark.parametrize("tiles", [(64, 256, 5, True), (128, 128, 6, True)])
def test_pingpong_wgrad_compiles_to_one_warpgroups_wgmma(tiles, tmp_path):
    """Ping-pong dW13 (each consumer warpgroup on a tile of its own): 384 threads (one producer,
    two consumer warpgroups), the tile's wgmma issued by one warpgroup (a 128-row tile as two
    64-row blocks), no local memory."""
    pytest.importorskip("cutlass")
    from moe_aot.compiler import build_template

    kv = wgrad_kernels(make_spec("deepseek-v3", target="sm_90a"), {"b": tiles, "a": tiles})[0]
    obj = build_template(kv)
    assert obj.mma_threads == 256 and obj.stage_threads == 128
    ptx, sass, res = _sass(obj, tmp_path)
    hgmma = re.findall(r"HGMMA\.64x(\d+)x16\.F32\.BF16 R\d+, gdesc\[UR\d+\]\.tnspA\.tnspB", sass)
    assert hgmma and {int(n) for n in hgmma} == {tiles[1]}, hgmma
    assert len(hgmma) % (4 * tiles[0] // 64) == 0  # 4 k-blocks per k-tile per 64-row block (ptxas may unroll)
    assert "STG.E.128" in sass and "LOCAL:0" in res and "STACK:0" in res


def test_tma_store_wgrad_compiles_to_stmatrix_and_tma_stores(tmp_path):
    """The TMA-store epilogue (dW13 256x128 ts): stmatrix into the subtile buffers and TMA stores
    out, no quad shuffles or 16-byte global stores left, no local memory; refused for ping-pong
    and for tiles under 128 rows in one sentence."""
    pytest.importorskip("cutlass")
    from moe_aot.compiler import build_template

    kv = wgrad_kernels(make_spec("deepseek-v3", target="sm_90a"), {"b": (256, 128, 4, False, True)})[0]
    assert kv.name.endswith("_t256x128x64_s4ts") and kv.kwargs()["tma_store"] is True
    ptx, sass, res = _sass(build_template(kv), tmp_path)
    assert "STSM" in sass and "UTMASTG" in sass
    assert sass.count("SHFL") <= 1  # a warp-uniform broadcast at most, no quad transpose
    assert not re.search(r"\bSTG\.E\.128\b", sass)
    assert "LOCAL:0" in res and "STACK:0" in res
    for args in ((1024, 512, "b", 64, 128, 64, 4, "sm_90a", False, True),
                 (1024, 512, "b", 128, 128, 64, 4, "sm_90a", True, True)):
        ok, why = limits.check_wgrad(*args)
        assert not ok and "TMA-store epilogue" in why and why.count(". ") == 0


def _operands(M, K, E, H, I, tile_m, gen, only_even=False):
    scores = torch.rand(M, E, generator=gen)
    if only_even:
        scores[:, 1::2] = -1.0
    ids = torch.topk(scores, K, dim=1).indices.to(torch.int32)
    counts, offsets, sorted_ids, _ = routing_reference(ids, E, tile_m)
    R = sorted_ids.numel()
    live = (sorted_ids >= 0).unsqueeze(1)
    da = torch.where(live, torch.randn(R, 2 * I, generator=gen), 0.0).bfloat16()
    hw = torch.where(live, torch.randn(R, I, generator=gen), 0.0).bfloat16()
    x = torch.randn(M, H, generator=gen).bfloat16()
    d_out = torch.randn(M, H, generator=gen).bfloat16()
    return ids, counts, offsets, sorted_ids, da, x, d_out, hw


@pytest.mark.parametrize("tile_m, only_even", [(64, False), (128, True)])
def test_reference_is_the_backwards_grouped_gemms(tile_m, only_even):
    """weight_gradients_reference over the padded routing layout equals what moe_backward
    computes today: gmm_k over the unpadded stable sort of pairs (integrations.autograd.route)."""
    from moe_aot.integrations.autograd import gmm_k, route

    M, K, E, H, I = 37, 2, 8, 32, 16
    gen = torch.Generator().manual_seed(11)
    ids, _, offsets, sorted_ids, da, x, d_out, hw = _operands(M, K, E, H, I, tile_m, gen, only_even)
    dw13, dw2 = weight_gradients_reference(da, x, d_out, hw, sorted_ids, offsets, K)
    order, offs, _, _ = route(ids, E)
    rows = (sorted_ids >= 0).nonzero().squeeze(1)  # the padded rows of the sorted pairs, in order
    assert torch.equal(sorted_ids[rows].long(), order)
    tok = order // K
    want13 = gmm_k(da[rows].float().t(), x.index_select(0, tok).float(), offs)
    want2 = gmm_k(d_out.index_select(0, tok).float().t(), hw[rows].float(), offs)
    assert torch.allclose(dw13, want13, rtol=1e-5, atol=1e-5) and torch.allclose(dw2, want2, rtol=1e-5, atol=1e-5)
    if only_even:
        assert dw13[1::2].abs().max() == 0 and dw2[1::2].abs().max() == 0
    assert dw13[0::2].abs().max() > 0


def test_launcher_refuses_what_the_kernels_cannot_read():
    M, K, E, H, I = 9, 2, 4, 16, 8
    gen = torch.Generator().manual_seed(3)
    _, counts, offsets, sorted_ids, da, x, d_out, hw = _operands(M, K, E, H, I, 64, gen)
    with pytest.raises(KernelArgumentError, match="tile_m 32"):
        weight_gradients(da, x, d_out, hw, sorted_ids, offsets, counts, K, 32, kernels=None)
    with pytest.raises(KernelArgumentError, match="da must be"):
        weight_gradients(da[:-1], x, d_out, hw, sorted_ids, offsets, counts, K, 64, kernels=None)
    with pytest.raises(KernelArgumentError, match="expert_counts"):
        weight_gradients(da, x, d_out, hw, sorted_ids, offsets, counts[:-1], K, 64, kernels=None)
    with pytest.raises(KernelArgumentError, match="disagree"):
        weight_gradients(da, x, d_out[:, :-8], hw, sorted_ids, offsets, counts, K, 64, kernels=None)
