"""The block-scaled layer ("mxfp8", "nvfp4") for DGX Spark on the CPU: its GEMMs compiled for
sm_121a through the project's own path (the compiler's template registry, compile_kernel, the
`moe-aot build` command) with the block-scaled mma.sync in their PTX and SASS, their argument
lists as templates/blockscaled_warp.py documents them, the launch's shared memory within GB10's,
the validity rules' refusals, and the weight preparation against moe_aot/blockscale.py.

Nothing here runs a kernel: no sm_120-family GPU was available, so these kernels have only been
compiled (the module docstring of templates/blockscaled_warp.py says so too)."""
from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from sass_tools import cuobjdump

torch = pytest.importorskip("torch")

import cross_tools  # noqa: E402
import cuda_standin  # noqa: E402

from moe_aot import gemm_limits as limits  # noqa: E402
from moe_aot import variants as V  # noqa: E402
from moe_aot.spec import make_spec  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SPARK = "sm_121a"
GB10_SMEM = limits.SMEM_CAPACITY[SPARK]
# the instructions each precision must compile to: PTX and the SASS ptxas makes of it
PTX_MMA = {"mxfp8": "mma.sync.aligned.kind::mxf8f6f4.block_scale.scale_vec::1X.m16n8k32.row.col"
                    ".f32.e4m3.e4m3.f32.ue8m0",
           "nvfp4": "mma.sync.aligned.kind::mxf4nvf4.block_scale.scale_vec::4X.m16n8k64.row.col"
                    ".f32.e2m1.e2m1.f32.ue4m3",
           # MXFP4 weights: B e2m1 (in byte containers), A e4m3
           "w4a8-mx": "mma.sync.aligned.kind::mxf8f6f4.block_scale.scale_vec::1X.m16n8k32.row.col"
                      ".f32.e4m3.e2m1.f32.ue8m0"}
SASS_MMA = {"mxfp8": "QMMA.SF.16832.F32.E4M3.E4M3.E8", "nvfp4": "OMMA.SF.16864.F32.E2M1.E2M1.UE4M3.4X",
            "w4a8-mx": "QMMA.SF.16832.F32.E4M3.E2M1.E8"}
# the quantizer GEMM1's epilogue runs on its GLU output: e4m3 elements, or e2m1 elements and e4m3 scales
PTX_QUANT = {"mxfp8": ["cvt.rn.satfinite.e4m3x2.f32"], "w4a8-mx": ["cvt.rn.satfinite.e4m3x2.f32"],
             "nvfp4": ["cvt.rn.satfinite.e2m1x2.f32", "cvt.rn.satfinite.e4m3x2.f32"]}
ARGS = {  # the argument lists of the module docstring, in order (None gamax: no argument)
    ("glu", "mxfp8"): ["xq", "xs", "w13q", "w13s", "sorted_ids", "tile_expert", "hq", "hs", "stream"],
    ("glu", "nvfp4"): ["xq", "xs", "w13q", "w13s", "sorted_ids", "tile_expert", "hq", "hs", "x_gamax", "w13_gamax",
                       "h_gamax", "stream"],
    ("down", "mxfp8"): ["hq", "hs", "w2q", "w2s", "sorted_ids", "tile_expert", "topk_weights", "y", "stream"],
    ("down", "nvfp4"): ["hq", "hs", "w2q", "w2s", "sorted_ids", "tile_expert", "topk_weights", "y", "h_gamax",
                        "w2_gamax", "stream"],
}
ARGS[("glu", "w4a8-mx")], ARGS[("down", "w4a8-mx")] = ARGS[("glu", "mxfp8")], ARGS[("down", "mxfp8")]


@pytest.fixture(scope="module")
def spark_gemms():
    """GEMM1 and GEMM2 of the decode default of Qwen3-30B-A3B in each precision, built from their
    kernel variants by the compiler's registry and compiled for sm_121a (aarch64 host library)."""
    pytest.importorskip("cutlass")
    cross_tools.require(cross_tools.CROSS_CC)
    from moe_aot.compiler import build_template
    from moe_aot.kernel_build import compile_kernel

    arts = {}
    for precision in limits.BLOCKSCALED:
        spec = make_spec("qwen3-30b-a3b", precision=precision, target=SPARK)
        for kv in V.default_variant(spec, 1).kernels(spec):
            if kv.role in ("glu", "down"):
                arts[(kv.role, precision)] = (kv, compile_kernel(build_template(kv), SPARK, kv.name))
    return arts


@pytest.mark.parametrize("role", ["glu", "down"])
@pytest.mark.parametrize("precision", limits.BLOCKSCALED)
def test_gemms_compile_to_the_block_scaled_mma(spark_gemms, role, precision, tmp_path):
    kv, art = spark_gemms[(role, precision)]
    assert f"_{precision.replace('-', '')}_" in kv.name and "_t16x" in kv.name  # decode: 16-row tiles
    body = art.ptx[art.ptx.index(".entry"):]
    mmas = set(re.findall(r"mma\.sync\S*", body))
    assert mmas == {PTX_MMA[precision]}, mmas  # every MMA is the block-scaled one
    assert "ldmatrix.sync.aligned.m8n8.x4.shared.b16" in body  # w4a8-mx: A's (B's e2m1 by byte loads)
    assert "cp.async.cg.shared.global" in body and "cp.async.ca.shared.global" in body  # values, scale bytes
    assert "ld.local" not in body and "st.local" not in body
    if role == "glu":  # the GLU output quantized in the epilogue: its conversions and scale-byte stores
        for cvt in PTX_QUANT[precision]:
            assert cvt in body, cvt
        assert "st.global.b8" in body
    else:  # bf16 rows out, as GroupedDownGemm writes them
        assert "st.global.v4.b32" in body and "cvt.rn.satfinite" not in body
    assert [a["name"] for a in art.meta["args"]] == ARGS[(role, precision)]
    assert int.from_bytes(art.library[18:20], "little") == 183  # EM_AARCH64: the Spark's host CPU
    tool = cuobjdump()
    if tool is None:
        return  # the PTX checks stand; SASS needs cuobjdump
    cubin = tmp_path / "k.cubin"
    cubin.write_bytes(art.cubin)
    sass = subprocess.run([tool, "-sass", str(cubin)], capture_output=True, text=True, check=True).stdout
    assert "sm_121a" in sass or "SM121" in sass.upper()
    ops = set(re.findall(r"\b[A-Z]MMA\S*", sass))
    assert ops == {SASS_MMA[precision]}, ops


def _mode_coords(shape, stride) -> list[tuple[int, int]]:
    """The (row, column) offsets of one mode of a static coordinate layout (strides ints or the
    DSL's ScaledBasis e_mode * value), index by index in colexicographic order: the layout
    evaluated in plain Python (indexing the traced tensor element by element takes minutes)."""
    from cutlass.cute import flatten

    shapes = flatten(shape) if isinstance(shape, tuple) else (shape,)
    strides = flatten(stride) if isinstance(stride, tuple) else (stride,)
    out = [(0, 0)]
    for n, d in zip(shapes, strides):
        assert not isinstance(d, int) or d == 0, d  # coordinates (or a broadcast), not offsets
        mode = d.mode[0] if not isinstance(d, int) and isinstance(d.mode, (list, tuple)) else getattr(d, "mode", 0)
        step = (0, 0) if isinstance(d, int) else tuple(d.value if m == mode else 0 for m in (0, 1))
        out = [(r + k * step[0], c + k * step[1]) for k in range(n) for r, c in out]
    return out


@pytest.mark.parametrize("precision, tile_m, tile_n", [("mxfp8", 32, 64), ("nvfp4", 32, 64), ("mxfp8", 16, 128),
                                                       ("nvfp4", 64, 128), ("w4a8-mx", 32, 64)])
def test_scale_fragments_follow_the_ptx_lane_layout(precision, tile_m, tile_n):
    """The scale bytes each lane loads for each m16n8kK instruction, traced through the kernel's
    own tiled MMA and scale copies (blackwell_helpers' SM120 thread-value layouts) over tile
    coordinates, are those the PTX ISA's block-scaled mma.sync takes from that lane with
    byte/thread selectors 0 (what the kernels emit): A row 16 (wm + warps_m i) + l/4 + 8 (l % 2),
    B columns l/4 of both n8 atoms of the warp's 16 columns of each 16 * warps_n, and the K blocks
    of the instruction's K (one for mxfp8's k32, four for nvfp4's k64: byte j = block 4 kb + j)."""
    pytest.importorskip("cutlass")
    import cutlass.cute as cute
    import cutlass.utils.blackwell_helpers as bw
    from moe_aot_templates.blockscaled_warp import BlockScaledDownGemm

    obj = BlockScaledDownGemm(8, 2048, 768, 2, precision=precision, tile_m=tile_m, tile_n=tile_n, tile_k=256,
                              stages=3)
    per_mma = limits.BS_MMA_K[precision] // obj.vec  # scale blocks per instruction
    threads = range(obj.threads)
    got = {}

    def collect(tiled_mma):  # plain Python at trace time: the jit below does not rewrite its loops
        perm = tiled_mma.permutation_mnk
        atom = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), obj.sf_dtype)
        for name, tv, rows, p in (("a", bw.get_layoutSFA_TV(tiled_mma), obj.tile_m, perm[0]),
                                  ("b", bw.get_layoutSFB_TV(tiled_mma), obj.tile_n, perm[1])):
            copy = cute.make_tiled_copy(atom, tv, (cute.size(p), cute.size(perm[2])))
            for tidx in threads:
                src = copy.get_slice(tidx).partition_S(cute.make_identity_tensor((rows, obj.tile_k)))
                vals, inst, kbs = (_mode_coords(src.layout.shape[m], src.layout.stride[m]) for m in range(3))
                for i, ci in enumerate(inst):
                    for kb, ck in enumerate(kbs):
                        got[(name, tidx, i, kb)] = {(src.iterator[0] + cv[0] + ci[0] + ck[0],
                                                     (src.iterator[1] + cv[1] + ci[1] + ck[1]) // obj.vec)
                                                    for cv in vals}

    @cute.jit
    def trace():
        collect(obj._make_tiled_mma())

    cute.compile(trace, options=f"--gpu-arch {SPARK}")
    wm_n, wn_n = obj.warps_m, obj.warps_n
    num_kb = obj.tile_k // limits.BS_MMA_K[precision]
    want = {}
    for tidx in threads:
        lane, w = tidx % 32, tidx // 32
        wm, wn = w % wm_n, w // wm_n
        for kb in range(num_kb):
            blocks = range(kb * per_mma, (kb + 1) * per_mma)
            for i in range(tile_m // (16 * wm_n)):
                row = 16 * (wm + wm_n * i) + lane // 4 + 8 * (lane % 2)
                want[("a", tidx, i, kb)] = {(row, b) for b in blocks}
            for j in range(tile_n // (16 * wn_n)):
                cols = [16 * (wn + wn_n * j) + 8 * a + lane // 4 for a in (0, 1)]
                want[("b", tidx, j, kb)] = {(c, b) for c in cols for b in blocks}
    assert got == want


@pytest.mark.parametrize("precision, tile_m, tile_n", [("mxfp8", 32, 64), ("nvfp4", 64, 128), ("w4a8-mx", 16, 128)])
def test_value_fragments_follow_the_ptx_lane_layout(precision, tile_m, tile_n):
    """The values each lane feeds each k-block's instructions, from the kernel's own tiled MMA over
    tile coordinates, are the PTX ISA's m16n8k32 (e4m3) / m16n8k64 (e2m1) fragments: A rows g and
    g + 8 of each 16-row atom (g = l/4), K columns 4t..4t+3 (e4m3) or 8t..8t+7 (e2m1) of each half
    of the instruction's K (t = l % 4); B columns g of the warp's two n8 atoms of every 16 * warps_n,
    the same K. So each lane holds values of exactly the rows and columns whose scales
    test_scale_fragments_follow_the_ptx_lane_layout shows it (or its quad) supplying."""
    pytest.importorskip("cutlass")
    import cutlass.cute as cute
    from moe_aot_templates.blockscaled_warp import BlockScaledDownGemm

    obj = BlockScaledDownGemm(8, 2048, 768, 2, precision=precision, tile_m=tile_m, tile_n=tile_n, tile_k=256,
                              stages=3)
    got = {}

    def collect(tiled_mma):  # plain Python at trace time
        for tidx in range(obj.threads):
            thr = tiled_mma.get_slice(tidx)
            for name, part in (("a", thr.partition_A(cute.make_identity_tensor((obj.tile_m, obj.tile_k)))),
                               ("b", thr.partition_B(cute.make_identity_tensor((obj.tile_n, obj.tile_k))))):
                vals, inst, kbs = (_mode_coords(part.layout.shape[m], part.layout.stride[m]) for m in range(3))
                for kb, ck in enumerate(kbs):
                    got[(name, tidx, kb)] = {(part.iterator[0] + cv[0] + ci[0] + ck[0],
                                              part.iterator[1] + cv[1] + ci[1] + ck[1]) for ci in inst for cv in vals}

    @cute.jit
    def trace():
        collect(obj._make_tiled_mma())

    cute.compile(trace, options=f"--gpu-arch {SPARK}")
    kk = limits.BS_MMA_K[precision]
    per_reg = 32 // obj.bits  # values per 32-bit register
    reps_m, reps_n = tile_m // (16 * obj.warps_m), tile_n // (16 * obj.warps_n)
    want = {}
    for tidx in range(obj.threads):
        lane, w = tidx % 32, tidx // 32
        wm, wn = w % obj.warps_m, w // obj.warps_m
        g, t = lane // 4, lane % 4
        for kb in range(obj.tile_k // kk):
            ks = {kb * kk + half * kk // 2 + t * per_reg + j for half in (0, 1) for j in range(per_reg)}
            rows = {16 * (wm + obj.warps_m * i) + g + 8 * h for i in range(reps_m) for h in (0, 1)}
            cols = {16 * (wn + obj.warps_n * j) + 8 * a + g for j in range(reps_n) for a in (0, 1)}
            want[("a", tidx, kb)] = {(r, k) for r in rows for k in ks}
            want[("b", tidx, kb)] = {(c, k) for c in cols for k in ks}
    assert got == want


LAUNCH = r"""
import ctypes, json, sys
standin = ctypes.CDLL(sys.argv[1], mode=ctypes.RTLD_GLOBAL)
standin.standin_log.restype = ctypes.c_char_p
import torch
from moe_aot.runtime.library import KernelLibrary
lib = KernelLibrary.from_dir(sys.argv[2], device=0)
dt = {"Uint8": torch.uint8, "Int32": torch.int32, "Float32": torch.float32, "BFloat16": torch.bfloat16}
ts = [torch.zeros([s if s is not None else 16 for s in a["static_shape"]], dtype=dt[a["dtype"]])
      for a in lib._tensor_args]
standin.standin_reset()
lib(*ts, stream=0x5151, check=False)
print(json.dumps(standin.standin_log().decode()))
"""


@pytest.fixture(scope="module")
def standin(tmp_path_factory):
    return cuda_standin.build(tmp_path_factory.mktemp("standin"))


@pytest.mark.parametrize("role, precision, tiles", [
    ("glu", "nvfp4", dict(tile_m=16, tile_n=64, tile_k=256, stages=4)),
    ("down", "mxfp8", dict(tile_m=32, tile_n=64, tile_k=256, stages=3)),
    ("glu", "mxfp8", dict(tile_m=64, tile_n=128, tile_k=128, stages=3)),
    ("down", "w4a8-mx", dict(tile_m=16, tile_n=64, tile_k=256, stages=4)),  # B rows half of A's bytes
])
def test_launch_asks_for_the_budgeted_shared_memory(role, precision, tiles, standin, tmp_path):
    """The sm_121a kernel's own host launcher (linked for this x86 machine, run against the stand-in
    driver of tests/cuda_standin.py: no GPU) asks for exactly the pipeline or staging bytes that
    gemm_limits.bs_smem_bytes budgets, less its alignment slack, within GB10's 101,376 B."""
    pytest.importorskip("cutlass")
    from moe_aot_templates.blockscaled_warp import BlockScaledDownGemm, BlockScaledGluGemm

    from moe_aot.kernel_build import compile_kernel

    cls = BlockScaledGluGemm if role == "glu" else BlockScaledDownGemm
    obj = cls(128, 2048, 768, 8, precision=precision, **tiles)  # Qwen3-30B-A3B: E, H, I, top_k
    compile_kernel(obj, SPARK, f"k_{role}_{precision.replace('-', '_')}", host="x86-64").write_dir(tmp_path / "lib")
    res = subprocess.run([sys.executable, "-c", LAUNCH, str(standin), str(tmp_path / "lib")],
                         capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert res.returncode == 0, res.stderr
    launches = [ln for ln in json.loads(res.stdout).splitlines() if ln.startswith("cuLaunchKernelEx")]
    assert len(launches) == 1, launches
    smem = int(re.search(r" smem=(\d+) ", launches[0])[1])
    threads = int(re.search(r" block=(\d+),", launches[0])[1])
    budget = limits.bs_smem_bytes(precision, tiles["tile_m"], tiles["tile_n"], tiles["tile_k"], tiles["stages"])
    assert smem == budget - 1024 and budget <= GB10_SMEM, (smem, budget)
    wm, wn = limits.default_warps(tiles["tile_m"], tiles["tile_n"])
    assert threads == 32 * wm * wn


def test_moe_aot_build_compiles_a_spark_layer(tmp_path):
    """`moe-aot build --target sm_121a --precision P` compiles the layer's five kernels (routing,
    x's block-scaled quantization, GEMM1, GEMM2, combine) without a failure, per precision."""
    pytest.importorskip("cutlass")
    cross_tools.require(cross_tools.CROSS_CC)
    from click.testing import CliRunner

    from moe_aot.cli import main

    runner = CliRunner()
    for precision in limits.BLOCKSCALED:
        url = f"sqlite:///{tmp_path / (precision + '.sqlite')}"
        res = runner.invoke(main, ["build", "--experts", "8", "--top-k", "2", "--hidden", "256", "--intermediate",
                                   "256", "--precision", precision, "--target", SPARK, "--tokens", "1", "--db", url,
                                   "-j", "1"])
        assert res.exit_code == 0, res.output
        assert "5 compiled, 0 failed" in res.output, res.output
        listed = runner.invoke(main, ["ls", "--db", url, "--target", SPARK]).output
        tag, act = precision.replace("-", ""), limits.BS_FORMATS[precision][0]  # w4a8-mx: x quantized to mxfp8
        for role in ("route", f"bsquant_sm121a_{act}", f"glu_sm121a_{tag}", f"down_sm121a_{tag}",
                     f"combine_sm121a_{tag}"):
            assert f"moe_{role}" in listed, listed


@pytest.mark.parametrize("role, precision", [("glu", "nvfp4"), ("down", "mxfp8"), ("down", "w4a8-mx")])
def test_sm90a_standin_compiles_without_the_block_scaled_mma(role, precision):
    """The stand-in (standin=True) is the same kernel for sm_90a with the MMA emulated: no mma.sync
    at all, the same ldmatrix / cp.async data path, the same argument list as the sm_121a kernel
    (so an H200 check calls it exactly as a Spark would call the real one), e2m1 rounded in software
    (sm_90a has no e2m1 conversion), no local memory."""
    pytest.importorskip("cutlass")
    from moe_aot_templates.blockscaled_warp import BlockScaledDownGemm, BlockScaledGluGemm

    from moe_aot.kernel_build import compile_kernel

    cls = BlockScaledGluGemm if role == "glu" else BlockScaledDownGemm
    tiles = dict(tile_m=16, tile_n=64, tile_k=256, stages=2)  # K = 512: two k-tiles
    art = compile_kernel(cls(8, 512, 512, 2, precision=precision, standin=True, **tiles), "sm_90a",
                         f"s_{role}_{precision.replace('-', '_')}")
    body = art.ptx[art.ptx.index(".entry"):]
    assert "mma.sync" not in body and "ldmatrix.sync.aligned.m8n8.x4.shared.b16" in body
    assert "cp.async.cg.shared.global" in body and "cp.async.ca.shared.global" in body
    assert "e2m1" not in body and "ld.local" not in body
    if role == "glu":
        assert "cvt.rn.satfinite.e4m3x2.f32" in body and "st.global.b8" in body  # nvfp4's e4m3 scale bytes
    assert [a["name"] for a in art.meta["args"]] == ARGS[(role, precision)]
    with pytest.raises(Exception, match="sm_120a"):  # the real kernel: the instruction is not there
        compile_kernel(cls(8, 512, 512, 2, precision=precision, **tiles), "sm_90a",
                       f"r_{role}_{precision.replace('-', '_')}")


@pytest.mark.parametrize("cls_name, kwargs, words", [
    ("glu", dict(precision="mxfp8", arch="sm_90a"), ["sm_120 family", "sm_90a"]),
    ("down", dict(precision="nvfp4", arch="sm_100a"), ["sm_120 family", "sm_100a"]),
    ("glu", dict(precision="mxfp8", tile_k=64), ["tile_k 64", "(128, 256)"]),
    ("down", dict(precision="mxfp8", mma="wgmma"), ["mma.sync", "'wgmma'"]),
    ("glu", dict(precision="mxfp8", tile_n=32), ["tile_n 32", "32-column scale blocks"]),
    ("glu", dict(precision="nvfp4", tile_k=128), ["32 rows", "cp.async"]),  # 64-byte rows: 32 per pass
    ("down", dict(precision="mxfp8", tile_m=64, tile_n=256, stages=4, arch=SPARK), ["shared memory", "101376"]),
    ("glu", dict(precision="mxfp8", tile_m=256, tile_n=256), ["256 fp32 accumulators"]),
    ("down", dict(precision="mxfp8", stages=9), ["stages 9"]),
    ("glu", dict(precision="fp8"), ["precision 'fp8'", "mxfp8, nvfp4, w4a8-mx"]),
    ("glu", dict(precision="w4a8-mx", arch="sm_90a"), ["sm_120 family", "sm_90a"]),
    ("glu", dict(precision="w4a8-mx", tile_m=64, tile_n=256, stages=4, arch=SPARK), ["shared memory", "101376"]),
])
def test_can_implement_refuses_bad_tiles_in_one_sentence(cls_name, kwargs, words):
    pytest.importorskip("cutlass")
    from moe_aot_templates.blockscaled_warp import BlockScaledDownGemm, BlockScaledGluGemm

    cls = BlockScaledGluGemm if cls_name == "glu" else BlockScaledDownGemm
    kwargs = dict(kwargs)
    precision = kwargs.pop("precision")
    ok, reason = cls.can_implement(128, 2048, 768, 8, precision=precision, **kwargs)
    assert not ok and "\n" not in reason and reason.count(". ") == 0, reason
    for w in words:
        assert w in reason, (w, reason)
    if "arch" not in kwargs:  # the constructor refuses with the same sentence (it knows no target)
        with pytest.raises(ValueError, match=re.escape(reason)):
            cls(128, 2048, 768, 8, precision=precision, **kwargs)


@pytest.mark.parametrize("precision", limits.BLOCKSCALED)
@pytest.mark.parametrize("model", ["qwen3-30b-a3b", "deepseek-v3", "mixtral-8x7b"])
def test_no_spark_variant_exceeds_gb10(model, precision):
    """Every variant the tuner may try, and every bucket's default, fits GB10's shared memory with
    mma.sync only, one-CTA routing and the block-scaled k-tiles; decode gets 16-row tiles."""
    spec = make_spec(model, precision=precision, target=SPARK)
    space = V.candidate_space(spec)
    assert space
    for v in space + [V.default_variant(spec, t) for t in V.token_buckets()]:
        assert V.can_implement(spec, v)[0] and v.route_cluster == 1
        for role, t in (("glu", v.glu), ("down", v.down)):
            assert t.mma == "warp" and t.tile_k in limits.BS_TILE_K
            assert limits.bs_smem_bytes(precision, v.tile_m, t.tile_n, t.tile_k, t.stages) <= GB10_SMEM
    assert V.default_variant(spec, 1).tile_m == 16
    # the shared-memory rule is what prunes: the same shapes at 8 stages of 256-wide k-tiles do not fit
    big = V.LayerVariant(64, V.GemmTiles(128, 256, 8), V.GemmTiles(128, 256, 8))
    ok, why = V.can_implement(spec, big)
    assert not ok and "shared memory" in why and str(GB10_SMEM) in why


def test_kernels_of_a_block_scaled_layer():
    """x is quantized by the bsquant kernel (e2m1 by the hardware cvt on sm_121a) between the
    routing and GEMM1; the layer's GEMMs get the block-scaled family; sm_90a refuses them (sm_100a
    builds them on tcgen05: tests/test_blackwell_blockscaled.py)."""
    from moe_aot.compiler import template_family
    from moe_aot.spec import SpecError

    for precision in limits.BLOCKSCALED:
        spec = make_spec("qwen3-30b-a3b", precision=precision, target=SPARK)
        kvs = V.default_variant(spec, 16).kernels(spec)
        assert [kv.role for kv in kvs] == ["routing", "bsquant", "glu", "down", "combine"]
        assert kvs[1].kwargs() == {"fmt": limits.BS_FORMATS[precision][0], "k": 2048, "e2m1": "hw"}
        assert {template_family(kv) for kv in kvs[2:4]} == {"blockscaled"}
        for target in ("sm_90a",) + (("sm_100a",) if precision not in limits.BS_UMMA_PRECISIONS else ()):
            with pytest.raises(SpecError, match="not yet supported"):
                make_spec("qwen3-30b-a3b", precision=precision, target=target)
    # gpt-oss (H = I = 2880) builds for sm_121a, K padded to 2944 (tests/test_gpt_oss_spark.py);
    # sm_100a's tcgen05 kernels read K unpadded
    make_spec("gpt-oss-120b", precision="mxfp8", target=SPARK)
    with pytest.raises(SpecError, match="multiple of 128 for precision mxfp8 on sm_100a"):
        make_spec("gpt-oss-120b", precision="mxfp8", target="sm_100a", bias=False)


# -- weight preparation (pure torch) ----------------------------------------------------------------
@pytest.mark.parametrize("fmt", limits.BLOCKSCALED)
def test_prepared_weights_are_the_reference_quantization_in_kernel_order(fmt):
    """prepare_w13 / prepare_w2 against moe_aot/blockscale.py: w13's rows are the reference's
    quantized gate and up rows interleaved in blocks of 16 (values and scales alike, the bytes the
    kernel reads at row r: values r * K*b/8.., scales r * K/vec + block), NVFP4's global amax is one
    per expert over gate and up, and the dequantized weights are the reference's dequantization."""
    from moe_aot import blockscale as bs
    from moe_aot.layout import interleave_gate_up
    from moe_aot.runtime import blockscaled as bw

    g = torch.Generator().manual_seed(7)
    E, I, H = 3, 128, 128  # no K padding here (tests/test_gpt_oss_spark.py: K = 2880)
    gate, up = (torch.randn(E, I, H, generator=g) * s for s in (0.02, 0.5))
    gate[1, 5, 64:96] = 0.0  # whole blocks of zeros: scale byte 0
    w2 = torch.randn(E, H, I, generator=g) * 0.1
    w13 = bw.prepare_w13(gate, up, fmt)
    prec, fmt = fmt, limits.BS_FORMATS[fmt][1]  # the weights' format (w4a8-mx: mxfp4)
    vec, qk = bs.BLOCK[fmt], (H if fmt == "mxfp8" else H // 2)
    assert w13.values.shape == (E, 2 * I, qk) and w13.scales.shape == (E, 2 * I, H // vec)
    assert w13.values.dtype == w13.scales.dtype == torch.uint8 and w13.values.is_contiguous()
    for e in range(E):
        amax = None
        if fmt == "nvfp4":
            amax = torch.maximum(gate[e].abs().amax(), up[e].abs().amax())
            assert torch.equal(w13.global_amax[e], amax)
        qg, qu = bs.quantize(gate[e], fmt, amax), bs.quantize(up[e], fmt, amax)
        for r in range(2 * I):
            src = qg if (r // 16) % 2 == 0 else qu  # interleave 16: blocks of gate rows, then up rows
            row = (r // 32) * 16 + r % 16
            assert torch.equal(w13.values[e, r], src.values[row]) and torch.equal(w13.scales[e, r], src.scales[row])
        # the whole-matrix view: quantizing the interleaved bf16 rows gives the same bytes
        joint = bs.quantize(interleave_gate_up(gate[e:e + 1], up[e:e + 1])[0], fmt, amax)
        assert torch.equal(joint.values, w13.values[e]) and torch.equal(joint.scales, w13.scales[e])
        ref = interleave_gate_up(bs.dequantize(qg, fmt)[None], bs.dequantize(qu, fmt)[None])[0]
        assert torch.equal(bw.dequantize(w13, prec)[e], ref)
    assert not w13.scales[1, 5, 64 // vec].item()  # gate row 5 (interleaved row 5): its zero block
    gw, uw = bw.split_w13(w13)
    assert torch.equal(bw.dequantize(gw, prec), torch.stack([bs.dequantize(bs.quantize(
        gate[e], fmt, None if w13.global_amax is None else w13.global_amax[e]), fmt) for e in range(E)]))
    w2p = bw.prepare_w2(w2, prec)
    for e in range(E):
        ref = bs.quantize(w2[e], fmt, None if fmt != "nvfp4" else w2[e].abs().amax())
        assert torch.equal(w2p.values[e], ref.values) and torch.equal(w2p.scales[e], ref.scales)
    err = (bw.dequantize(w2p, prec) - w2).norm() / w2.norm()
    assert err < (0.05 if fmt == "mxfp8" else 0.15), err
    with pytest.raises(ValueError, match="block-scaled"):
        bw.prepare_w2(w2, "mxfp4")


# -- the stand-in's GPU check, its references and criteria (pure torch) ------------------------------
def _load_tool():
    import importlib.util

    spec = importlib.util.spec_from_file_location("check_blockscaled", ROOT / "tools" / "check_blockscaled.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("fmt", limits.BLOCKSCALED)
def test_reference_chain_is_the_quantized_layer(fmt):
    """harness.blockscaled's GEMM1 -> h bytes -> GEMM2 chain, summed over top-k, is the fp32 layer
    of the unquantized weights up to the formats' rounding, and each GEMM2 row is its pair's."""
    from moe_aot import blockscale as bs
    from moe_aot.harness import blockscaled as ref
    from moe_aot.harness.reference import moe_reference, routing_reference
    from moe_aot.runtime import blockscaled as bw

    g = torch.Generator().manual_seed(3)
    E, K, H, I, M, tile_m = 4, 2, 256, 128, 9, 16
    x, ids, tw, w13, w2 = ref.random_layer(E, K, H, I, M, fmt, "cpu", g)
    _, _, sorted_ids, tile_expert = routing_reference(ids, E, tile_m)
    gx = x.float().abs().amax() if fmt == "nvfp4" else None
    xq = bs.quantize(x, limits.BS_FORMATS[fmt][0], gx)  # w4a8-mx: x and h in mxfp8
    h = ref.h_padded(ref.glu_pairs(xq, w13, ids, "swiglu", fmt), sorted_ids)
    assert not h[sorted_ids < 0].any() and h[sorted_ids >= 0].abs().amax() > 0
    hq = ref.quantize_h(h, fmt, h.abs().amax() if fmt == "nvfp4" else None)
    y = ref.down_rows(hq, w2, sorted_ids, tile_expert, tw, fmt, tile_m)
    want = moe_reference(x.float(), bw.dequantize(w13, fmt), bw.dequantize(w2, fmt), tw, ids)
    err = ((y.reshape(M, K, H).sum(1) - want).norm() / want.norm()).item()
    # x's and h's quantization only (e4m3: ~3.6% RMS per rounding, e2m1 several times that); a
    # wrong row, expert or gate/up pairing would be of order one
    assert err < (0.3 if fmt == "nvfp4" else 0.1), err  # measured 0.063 and 0.16


@pytest.mark.parametrize("fmt", ["mxfp8", "nvfp4"])  # tools/check_blockscaled.py's GEMM checks
def test_gpu_check_passes_a_right_kernel_and_fails_wrong_ones(fmt):
    """tools/check_blockscaled.py's criteria, on the CPU with stand-in 'kernels' written in torch: one
    that writes exactly the reference's bytes passes; one with two h rows swapped, one that leaves
    padding rows unwritten and one that drops GEMM2's routing weight each fail."""
    tool = _load_tool()
    from moe_aot import blockscale as bs
    from moe_aot.harness import blockscaled as ref

    tiles = dict(tile_m=16, tile_n=64, tile_k=256, stages=3)

    def make(fault=None):
        def glu(xq, xs, wq, ws, sorted_ids, tile_expert, hq, hs, *g):
            gx, gw, gh = g if g else (None, None, None)
            from moe_aot.runtime.blockscaled import BlockScaledWeight

            pairs = ref.glu_pairs(bs.Quantized(xq, xs, gx), BlockScaledWeight(wq, ws, gw), ids_box[0],
                                  tool.LAYER["activation"], fmt)
            q = ref.quantize_h(ref.h_padded(pairs, sorted_ids), fmt, gh)
            rows = torch.arange(q.values.shape[0])
            if fault == "swap":
                rows[[0, 1]] = rows[[1, 0]]
            keep = sorted_ids >= 0 if fault == "padding" else torch.ones_like(sorted_ids, dtype=torch.bool)
            hq[keep], hs[keep] = q.values[rows][keep], q.scales[rows][keep]

        def down(hq, hs, wq, ws, sorted_ids, tile_expert, tw, y, *g):
            from moe_aot.runtime.blockscaled import BlockScaledWeight

            gh, gw = g if g else (None, None)
            w = tw if fault != "weight" else torch.ones_like(tw)
            y.copy_(ref.down_rows(bs.Quantized(hq, hs, gh), BlockScaledWeight(wq, ws, gw), sorted_ids, tile_expert,
                                  w, fmt, tiles["tile_m"]).to(y.dtype))
        return {"glu": glu, "down": down}

    ids_box = [None]
    orig = ref.random_layer

    def keep_ids(*a, **kw):  # the fake GEMM1 needs the routing the check drew
        out = orig(*a, **kw)
        ids_box[0] = out[1]
        return out

    ref.random_layer = keep_ids
    try:
        dev = torch.device("cpu")
        assert tool.check(make(), fmt, tiles, 7, 0, dev)["ok"]
        for fault in ("swap", "padding", "weight"):
            assert not tool.check(make(fault), fmt, tiles, 7, 0, dev)["ok"], fault
    finally:
        ref.random_layer = orig


def test_w4a8_mx_takes_gpt_oss_checkpoint_bytes():
    """blockscaled.from_gpt_oss: gpt-oss's MXFP4 experts as shipped (blocks [E, 2I, H/32, 16], gate
    and up rows alternating, even rows gate) become w4a8-mx weights that dequantize to what
    gpt-oss's own decode gives (low nibble first, value * 2^(scale - 127), as transformers'
    convert_moe_packed_tensors), nothing requantized; to_gpt_oss gives the bytes back; a wrong
    layout is refused in one sentence. K is stored padded to whole 128-element k-tiles (zero codes
    and scale bytes: values 0), which to_gpt_oss drops."""
    from moe_aot.runtime import blockscaled as bw

    g = torch.Generator().manual_seed(5)
    E, I, H = 2, 32, 64
    blocks = torch.randint(0, 256, (E, 2 * I, H // 32, 16), dtype=torch.uint8, generator=g)
    scales = torch.randint(118, 130, (E, 2 * I, H // 32), dtype=torch.uint8, generator=g)
    dblocks = torch.randint(0, 256, (E, H, I // 32, 16), dtype=torch.uint8, generator=g)
    dscales = torch.randint(118, 130, (E, H, I // 32), dtype=torch.uint8, generator=g)
    lut = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])

    def gpt_oss_decode(b, s):  # [E, N, G, 16], [E, N, G] -> [E, N, 32 G]
        vals = torch.stack((lut[(b & 0xF).long()], lut[(b >> 4).long()]), dim=-1).flatten(-2)
        return (vals * torch.exp2(s.float() - 127).unsqueeze(-1)).flatten(-2)

    w13, w2 = bw.from_gpt_oss(blocks, scales, dblocks, dscales)
    assert w13.values.shape == (E, 2 * I, 128 // 2) and w13.scales.shape == (E, 2 * I, 128 // 32)
    assert w2.values.shape == (E, H, 128 // 2) and w2.scales.shape == (E, H, 128 // 32)
    want = torch.nn.functional.pad(gpt_oss_decode(blocks, scales), (0, 128 - H))
    gate, up = bw.split_w13(w13)
    assert torch.equal(bw.dequantize(gate, "w4a8-mx"), want[:, 0::2])
    assert torch.equal(bw.dequantize(up, "w4a8-mx"), want[:, 1::2])
    assert torch.equal(bw.dequantize(w2, "w4a8-mx"), torch.nn.functional.pad(gpt_oss_decode(dblocks, dscales),
                                                                              (0, 128 - I)))
    for got, orig in zip(bw.to_gpt_oss(w13, w2), (blocks, scales, dblocks, dscales)):
        assert torch.equal(got, orig)
    with pytest.raises(ValueError, match=r"^gate_up_proj_blocks and gate_up_proj_scales must be uint8") as exc:
        bw.from_gpt_oss(blocks[..., :8], scales, dblocks, dscales)
    assert "\n" not in str(exc.value)
