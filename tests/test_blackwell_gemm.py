"""CPU tests of the sm_100a tcgen05 grouped GEMMs (templates/blackwell_gemm.py, mma "umma").

Compiled only: no Blackwell GPU was available, so nothing here (nor anywhere) has run these
kernels. What the CPU can check: they compile for sm_100a through the compiler's registry and the
CLI into a database; their SASS holds the tcgen05 MMA, the TMEM allocation, TMEM loads and TMA
loads (GEMM1 also the cp.async gather and the async-proxy fence) and no local memory; the layouts
the kernel relies on (each epilogue thread's TMEM row and columns, GEMM1's cp.async view of the A
stages) are the ones it assumes; the validity rules refuse what cannot be built.
"""
import re
import subprocess
from pathlib import Path

import pytest
from click.testing import CliRunner
from sass_tools import cuobjdump

cute = pytest.importorskip("cutlass.cute")

from moe_aot import gemm_limits as limits  # noqa: E402
from moe_aot.cli import main  # noqa: E402
from moe_aot.compiler import TEMPLATES, build_template, template_family, toolchain_key  # noqa: E402
from moe_aot.database import Database  # noqa: E402
from moe_aot.spec import make_spec  # noqa: E402
from moe_aot.variants import GemmTiles, LayerVariant, can_implement, default_variant  # noqa: E402

QWEN3_30B = dict(num_experts=128, hidden=2048, intermediate=768, top_k=8)


def _sass(cubin: bytes, tmp_path) -> str:
    tool = cuobjdump()
    if tool is None:
        pytest.skip("no cuobjdump")
    path = tmp_path / "k.cubin"
    path.write_bytes(cubin)
    return subprocess.run([tool, "-sass", str(path)], capture_output=True, text=True, check=True).stdout


def _ops(sass: str) -> set[str]:
    """The opcodes of a SASS listing (without modifiers)."""
    return set(re.findall(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)", sass))


@pytest.fixture(scope="module")
def preset_db(tmp_path_factory):
    """`moe-aot compile --model qwen3-30b-a3b --target sm_100a --tokens 4096` into a fresh
    database: the default at 4096 tokens (64 routed rows per expert and more) is the tcgen05 pair."""
    url = f"sqlite:///{tmp_path_factory.mktemp('bw') / 'bw.sqlite'}"
    res = CliRunner().invoke(main, ["compile", "--model", "qwen3-30b-a3b", "--target", "sm_100a",
                                    "--tokens", "4096", "--jobs", "1", "--db", url])
    assert res.exit_code == 0, res.output
    assert "4 compiled, 0 failed" in res.output
    db = Database(url)
    yield db
    db.close()


def test_preset_compiles_for_sm100a_with_tcgen05_gemms(preset_db, tmp_path):
    spec = make_spec("qwen3-30b-a3b", target="sm_100a")
    variant = default_variant(spec, 4096)
    assert variant.tile_m == 128 and variant.glu.mma == variant.down.mma == "umma"
    tool = toolchain_key("sm_100a")
    for kv in variant.kernels(spec):
        art = preset_db.get_artifact(kv.name, tool)
        assert art.status == "ok" and art.target == "sm_100a"
        if kv.role not in ("glu", "down"):
            continue
        assert template_family(kv) == "umma" and TEMPLATES[(kv.role, "umma")][0] == "blackwell_gemm"
        assert (int.from_bytes(art.cubin[48:52], "little") >> 8) & 0xFF == 100
        # the same arguments as every other family's GEMM of this role
        assert [a["name"] for a in art.meta["args"]] == (
            ["x", "w13", "sorted_ids", "tile_expert", "h", "stream"] if kv.role == "glu"
            else ["h", "w2", "sorted_ids", "tile_expert", "topk_weights", "y", "stream"])
        sass = _sass(art.cubin, tmp_path)
        ops = _ops(sass)
        assert "UTCHMMA" in ops, kv.name  # tcgen05.mma (bf16, 1-CTA)
        assert "UTCATOMSWS" in ops and "FIND_AND_SET" in sass  # TMEM allocation (and its release)
        assert "LDTM" in ops and "UTCBAR" in ops  # TMEM loads; tcgen05.commit to mbarriers
        assert "UTMALDG" in ops  # TMA loads of the weights (and of h)
        assert not {"HMMA", "HGMMA", "LDL", "STL"} & ops, kv.name  # no mma.sync, no wgmma, no local memory
        gather = {"LDGSTS", "FENCE"} <= ops  # cp.async of the gathered rows, fence.proxy.async
        assert gather == (kv.role == "glu"), kv.name


@pytest.mark.parametrize("role, kwargs", [
    ("glu", dict(activation="swigluoai", bias=True, tile_n=192, stages=4)),
    ("glu", dict(activation="geglu", tile_n=64, stages=3, pdl=True)),
    ("down", dict(bias=True, tile_n=256, stages=4, pdl=True)),
])
def test_variants_compile_with_waits_and_fences(role, kwargs, tmp_path):
    """Biases, the other activations, PDL and other tiles compile; every TMEM load is waited for
    (tcgen05.wait::ld) before its registers are read and the accumulator released; GEMM1's loaders
    fence the async proxy before each arrival; the full barriers count the loaders' arrivals."""
    from moe_aot_templates.blackwell_gemm import BlackwellDownGemm, BlackwellGluGemm

    cls = BlackwellGluGemm if role == "glu" else BlackwellDownGemm
    obj = cls(**QWEN3_30B, tile_m=128, tile_k=64, mma="umma", **kwargs)
    assert obj.threads == (320 if role == "glu" else 192) and obj.persistent
    ptx = cute.compile(obj, *[f for _, f in obj.fake_arguments()],
                       options=f"--gpu-arch sm_100a --keep-ptx --dump-dir {tmp_path}").__ptx__
    body = ptx[ptx.index(".entry"):]
    lds = body.count("tcgen05.ld.sync")
    assert lds == obj.tile_n // obj.epi_n and body.count("tcgen05.wait::ld") == lds
    assert "tcgen05.mma.cta_group::1.kind::f16" in body and "tcgen05.alloc" in body and "tcgen05.dealloc" in body
    assert ("griddepcontrol.wait" in body) == bool(kwargs.get("pdl"))
    inits = [int(c) for c in re.findall(r"mbarrier\.init\.shared(?:::cta)?\.b64\s+\[[^\]]+\],\s*(\d+);", body)] or \
        _mbarrier_init_counts(body)
    if role == "glu":
        assert "cp.async.cg.shared.global" in body and "fence.proxy.async.shared::cta" in body
        assert 1 + limits.LOAD_THREADS in inits  # each full barrier: the TMA bytes and 128 loaders
    else:
        assert "cp.async.cg.shared.global" not in body


def _mbarrier_init_counts(ptx: str) -> list[int]:
    consts = dict(re.findall(r"mov\.b32\s+(%r\d+),\s*(\d+);", ptx))
    return [int(consts[r]) for r in re.findall(r"mbarrier\.init\.shared(?:::cta)?\.b64\s+\[[^\]]+\],\s*(%r\d+);", ptx)
            if r in consts]


def test_layouts_the_kernel_assumes():
    """Traced on the CPU with the kernel's own objects: (1) the epilogue's tcgen05.ld.32x32b gives
    thread t of warps 0-3 tile row t and element i of a chunk its column i (GEMM1's GLU pairs a
    chunk's first `interleave` elements with the next); (2) the (tile_m, tile_k, stages) view that
    GEMM1's cp.async writes is the UMMA view of the same A stages, offset for offset."""
    import cutlass.utils.hopper_helpers as sm90_utils
    from cutlass import BFloat16, Float32
    from cutlass.cute.nvgpu import tcgen05
    from cutlass.memory import get_num_tmem_alloc_cols
    from cutlass.tensor_utils import LayoutEnum
    from moe_aot_templates.blackwell_gemm import BlackwellGluGemm

    obj = BlackwellGluGemm(**QWEN3_30B, tile_m=128, tile_n=128, tile_k=64, stages=3, mma="umma")
    seen = {}

    @cute.jit
    def trace():
        tiled_mma = obj._make_umma()
        acc = tiled_mma.make_fragment_C(tiled_mma.partition_shape_C((128, 128)))
        acc_epi = cute.flat_divide(acc[((None, None), 0, 0)], (128, obj.epi_n))
        t2r = tcgen05.make_tmem_copy(
            cute.make_copy_atom(tcgen05.copy.Ld32x32bOp(tcgen05.copy.Repetition(obj.epi_n)), Float32),
            acc_epi[(None, None, 0, 0)])
        for tid in (0, 5, 37, 127):
            coords = t2r.get_slice(tid).partition_D(
                cute.flat_divide(cute.make_identity_tensor((128, 128)), (128, obj.epi_n)))
            seen[tid] = [coords[(None, None, None, 0, c)][i] for c in (0, 3) for i in (0, 1, 15, 16, 31)]
        a_umma, _ = obj._smem_layouts(tiled_mma)
        a_cp = sm90_utils.make_smem_layout_a(LayoutEnum.ROW_MAJOR, obj._mma_tiler(), BFloat16, obj.stages)
        seen["swizzle"] = (str(a_umma.inner), str(a_cp.inner))
        seen["offsets"] = [(cute.crd2idx(((m, k % 16), 0, k // 16, s), a_umma.outer),
                            cute.crd2idx((m, k, s), a_cp.outer))
                           for m in (0, 1, 7, 8, 63, 64, 127) for k in (0, 1, 15, 16, 40, 63) for s in (0, 2)]
        for n in (32, 96, 192, 256):  # the DSL-free TMEM rule against the DSL's own count
            mma_n = obj._make_umma() if n == 128 else _umma(n)
            two = mma_n.make_fragment_C(cute.append(mma_n.partition_shape_C((128, n)), 2))
            seen[("tmem", n)] = get_num_tmem_alloc_cols(two)

    cute.compile(trace, options="--gpu-arch sm_100a")
    for tid in (0, 5, 37, 127):
        assert seen[tid] == [(tid, 32 * c + i) for c in (0, 3) for i in (0, 1, 15, 16, 31)]
    assert seen["swizzle"][0] == seen["swizzle"][1]
    assert all(u == v for u, v in seen["offsets"]), seen["offsets"]
    for n in (32, 96, 192, 256):
        assert seen[("tmem", n)] == limits.umma_tmem_columns(n), n


def _umma(tile_n):
    import cutlass.utils.blackwell_helpers as sm100_utils
    from cutlass import BFloat16, Float32
    from cutlass.cute.nvgpu import OperandMajorMode, tcgen05

    k = OperandMajorMode.K
    return sm100_utils.make_trivial_tiled_mma(BFloat16, BFloat16, k, k, Float32, tcgen05.CtaGroup.ONE, (128, tile_n))


@pytest.mark.parametrize("kwargs, words", [
    (dict(tile_m=64), "tile_m 64"),
    (dict(tile_n=48), "tile_n 48"),
    (dict(tile_n=512), "multiple of 32 in 32..256"),
    (dict(tile_k=128), "tile_k 128 must be 64"),
    (dict(stages=2), "stages 2"),
    (dict(precision="fp8"), "fp8"),
    (dict(arch="sm_90a"), "sm_100a only"),
    (dict(arch="sm_121a"), "sm_100a only"),
    (dict(tile_n=256, stages=5, arch="sm_100a"), "shared memory"),
])
def test_umma_refusals(kwargs, words):
    from moe_aot_templates.grouped_gemm import GroupedGluGemm

    args = {**QWEN3_30B, "tile_m": 128, "tile_n": 128, "tile_k": 64, "stages": 4, "mma": "umma", **kwargs}
    ok, reason = GroupedGluGemm.can_implement(**args)
    assert not ok and words in reason, reason
    assert reason.count(". ") == 0  # one sentence


def test_umma_rules_and_registry():
    assert limits.check_gemm(1536, 2048, 128, 256, 64, 4, "umma", arch="sm_100a") == (True, "")
    assert limits.umma_tmem_columns(256) == 512 and limits.umma_tmem_columns(96) == 256
    assert limits.umma_tmem_columns(32) == 64
    # what a bad build would need, refused in one sentence before anything compiles
    spec = make_spec("qwen3-30b-a3b", target="sm_100a")
    ok, why = can_implement(spec, LayerVariant(64, GemmTiles(128, 64, 4, "umma"), GemmTiles(128, 64, 4, "umma")))
    assert not ok and "tile_m 64" in why
    ok, why = can_implement(make_spec("qwen3-30b-a3b", target="sm_90a"),
                            LayerVariant(128, GemmTiles(128, 64, 4, "umma"), GemmTiles(128, 64, 4, "umma")))
    assert not ok and "umma MMA is not available on sm_90a" in why
    # decode keeps mma.sync on sm_100a; from 64 routed rows per expert the tcgen05 pair
    assert default_variant(spec, 16).glu.mma == "warp" and default_variant(spec, 256).glu.mma == "warp"
    assert default_variant(spec, 1024).glu.mma == "umma"
    # the constructor takes what the variant names, and refuses what the family does not build
    kv = next(k for k in default_variant(spec, 4096).kernels(spec) if k.role == "glu")
    assert type(build_template(kv)).__name__ == "BlackwellGluGemm"
    from moe_aot_templates.blackwell_gemm import BlackwellGluGemm

    with pytest.raises(ValueError, match="save_preact"):
        BlackwellGluGemm(**QWEN3_30B, tile_m=128, mma="umma", save_preact=True)
    with pytest.raises(ValueError, match="umma"):
        BlackwellGluGemm(**QWEN3_30B, tile_m=128, mma="hopws")


LAUNCH = r"""
import ctypes, json, sys
standin = ctypes.CDLL(sys.argv[1], mode=ctypes.RTLD_GLOBAL)
standin.standin_log.restype = ctypes.c_char_p
import torch
from moe_aot.runtime.library import KernelLibrary
lib = KernelLibrary.from_dir(sys.argv[2], device=0)
dt = {"Int32": torch.int32, "Float32": torch.float32, "BFloat16": torch.bfloat16}
ts = [torch.zeros([s if s is not None else 256 for s in a["static_shape"]], dtype=dt[a["dtype"]])
      for a in lib._tensor_args]
standin.standin_reset()
lib(*ts, stream=0x5151, check=False)
print(json.dumps(standin.standin_log().decode()))
"""


@pytest.mark.parametrize("role, tile_n, stages", [("glu", 256, 4), ("down", 128, 6)])
def test_launcher_asks_for_the_budgeted_shared_memory(role, tile_n, stages, tmp_path):
    """The kernel's own host launcher (which encodes the TMA descriptors itself), run against the
    stand-in driver of tests/cuda_standin.py (no GPU): one launch of 320 (GEMM1) or 192 (GEMM2)
    threads on min(tiles, 148) CTAs, asking for exactly the shared memory that
    gemm_limits.umma_smem_bytes budgets."""
    import json
    import sys

    import cuda_standin
    from moe_aot_templates.blackwell_gemm import BlackwellDownGemm, BlackwellGluGemm

    from moe_aot.kernel_build import compile_kernel

    cls = BlackwellGluGemm if role == "glu" else BlackwellDownGemm
    obj = cls(**QWEN3_30B, tile_m=128, tile_n=tile_n, tile_k=64, stages=stages, mma="umma")
    compile_kernel(obj, "sm_100a", f"k_{role}").write_dir(tmp_path / "lib")
    (tmp_path / "standin").mkdir()
    standin = cuda_standin.build(tmp_path / "standin")
    res = subprocess.run([sys.executable, "-c", LAUNCH, str(standin), str(tmp_path / "lib")],
                         capture_output=True, text=True, timeout=120, cwd=Path(__file__).resolve().parents[1])
    assert res.returncode == 0, res.stderr
    launches = [ln for ln in json.loads(res.stdout).splitlines() if ln.startswith("cuLaunchKernelEx")]
    assert len(launches) == 1, launches
    smem = int(re.search(r" smem=(\d+) ", launches[0])[1])
    grid = int(re.search(r" grid=(\d+),", launches[0])[1])
    threads = int(re.search(r" block=(\d+),", launches[0])[1])
    budget = limits.umma_smem_bytes(128, tile_n, 64, stages)
    assert smem == budget, (smem, budget)
    assert budget <= limits.SMEM_CAPACITY["sm_100a"]
    assert threads == (320 if role == "glu" else 192)
    assert grid == min(256 * obj.n // tile_n, 148)  # 256 M tiles in the stand-in's tile_expert


# ---------------------------------------------------------------- 2-CTA pairs (cluster 2)
PAIR = LayerVariant(256, GemmTiles(256, 64, 4, "umma", 2), GemmTiles(256, 64, 4, "umma", 2), 16)


def _usage(cubin: bytes, tmp_path) -> str:
    path = tmp_path / "u.cubin"
    path.write_bytes(cubin)
    return subprocess.run([cuobjdump(), "-res-usage", str(path)], capture_output=True, text=True, check=True).stdout


@pytest.fixture(scope="module")
def pair_db(tmp_path_factory):
    """`moe-aot compile --variant <the 2-CTA twin of the 4096-token default>` into a fresh database."""
    spec = make_spec("qwen3-30b-a3b", target="sm_100a")
    assert default_variant(spec, 4096).cluster_twins() == [PAIR]
    url = f"sqlite:///{tmp_path_factory.mktemp('bw2') / 'bw2.sqlite'}"
    res = CliRunner().invoke(main, ["compile", "--model", "qwen3-30b-a3b", "--target", "sm_100a",
                                    "--variant", PAIR.name(spec), "--jobs", "1", "--db", url])
    assert res.exit_code == 0, res.output
    assert "4 compiled, 0 failed" in res.output
    db = Database(url)
    yield db
    db.close()


def test_pair_layer_compiles_with_2cta_tcgen05(pair_db, tmp_path):
    """The 2-CTA layer through `moe-aot compile`: the routing pads to 256 rows; each GEMM's SASS
    has only the 2-CTA MMA (tcgen05.mma.cta_group::2 is UTCHMMA.2CTA), its commits multicast to
    both CTAs' barriers (UTCBAR.2CTA.MULTICAST), the pair's TMEM allocation, the 2-CTA TMA loads
    (each CTA's share completing on the leader's barrier) and the cluster barrier, and no local
    memory."""
    if cuobjdump() is None:
        pytest.skip("no cuobjdump")
    spec = make_spec("qwen3-30b-a3b", target="sm_100a")
    tool = toolchain_key("sm_100a")
    names = [kv.name for kv in PAIR.kernels(spec)]
    assert names[0] == "moe_route_sm100a_e128k8_m256_c16"
    assert names[1] == "moe_glu_sm100a_bf16_e128k8h2048i768_swiglu_t256x256x64_s4_umma_c2_g16"
    assert names[2] == "moe_down_sm100a_bf16_e128k8h2048i768_t256x256x64_s4_umma_c2"
    for kv in PAIR.kernels(spec):
        art = pair_db.get_artifact(kv.name, tool)
        assert art.status == "ok" and art.target == "sm_100a"
        if kv.role not in ("glu", "down"):
            continue
        assert template_family(kv) == "umma" and dict(kv.params)["cluster_m"] == 2
        sass = _sass(art.cubin, tmp_path)
        mmas = set(re.findall(r"\bUTC\w*MMA[\w.]*", sass))
        assert mmas == {"UTCHMMA.2CTA"}, (kv.name, mmas)  # no 1-CTA MMA beside it
        assert "UTCBAR.2CTA.MULTICAST" in sass and "UTCATOMSWS.2CTA.FIND_AND_SET" in sass
        assert set(re.findall(r"\bUTMALDG[\w.]*", sass)) == {"UTMALDG.2D.2CTA"}
        assert "UCGABAR_ARV" in sass and "UCGABAR_WAIT" in sass  # the cluster barrier after the inits
        ops = _ops(sass)
        assert "LDTM" in ops and not {"HMMA", "HGMMA", "LDL", "STL"} & ops, kv.name
        assert ({"LDGSTS", "FENCE"} <= ops) == (kv.role == "glu"), kv.name
        usage = _usage(art.cubin, tmp_path)
        assert "LOCAL:0" in usage and "STACK:0" in usage, usage


GPT_OSS = dict(num_experts=128, hidden=2880, intermediate=2880, top_k=4, bias=True)


@pytest.mark.parametrize("role, tile_n, kwargs", [
    ("glu", 128, dict(QWEN3_30B)),
    ("down", 64, dict(QWEN3_30B)),
    ("glu", 192, dict(GPT_OSS, activation="swigluoai", pdl=True)),
    ("down", 32, dict(QWEN3_30B, pdl=True)),
])
def test_pair_ptx_barriers_and_arrivals(role, tile_n, kwargs, tmp_path):
    """The pair's protocol in the PTX: cta_group::2 MMAs, commits and TMEM allocation; the leader
    expects both CTAs' bytes, so each full barrier counts the TMA warp and (GEMM1) the 128 loaders
    of each CTA, the other CTA's loaders arriving on the leader's barrier at cluster scope; each
    accumulator's empty barrier counts both CTAs' 128 epilogue threads. Biases, gpt-oss's
    activation, PDL and the narrowest tile (16 weight rows per CTA) compile too."""
    from moe_aot_templates.blackwell_gemm import BlackwellDownGemm, BlackwellGluGemm

    cls = BlackwellGluGemm if role == "glu" else BlackwellDownGemm
    obj = cls(**kwargs, tile_m=256, tile_n=tile_n, tile_k=64, stages=3, mma="umma", cluster_m=2)
    assert (obj.tile_m, obj.route_m, obj.cluster_m) == (128, 256, 2)
    ptx = cute.compile(obj, *[f for _, f in obj.fake_arguments()],
                       options=f"--gpu-arch sm_100a --keep-ptx --dump-dir {tmp_path}").__ptx__
    if "\n" not in ptx:
        ptx = Path(ptx).read_text()
    body = ptx[ptx.index(".entry"):]
    assert "tcgen05.mma.cta_group::2.kind::f16" in body and "cta_group::1" not in body
    assert "tcgen05.commit.cta_group::2.mbarrier::arrive::one.shared::cluster.multicast::cluster" in body
    assert "tcgen05.alloc.cta_group::2" in body and "tcgen05.dealloc.cta_group::2" in body
    assert re.search(r"cp\.async\.bulk\.tensor\.2d\.shared::cluster\.global\S*cta_group::2", body)
    lds = body.count("tcgen05.ld.sync")
    assert lds == tile_n // obj.epi_n and body.count("tcgen05.wait::ld") == lds
    inits = [int(c) for c in re.findall(r"mbarrier\.init\.shared(?:::cta)?\.b64\s+\[[^\]]+\],\s*(\d+);", body)] or \
        _mbarrier_init_counts(body)
    assert 2 * 128 in inits  # the accumulators' empty barriers: both CTAs' epilogue threads
    assert ("griddepcontrol.wait" in body) == bool(kwargs.get("pdl"))
    if role == "glu":
        assert 1 + 2 * limits.LOAD_THREADS in inits
        assert "mbarrier.arrive.release.cluster.shared::cluster.b64" in body and "mapa.shared::cluster" in body
    else:
        assert "cp.async.cg.shared.global" not in body


def test_pair_layouts_the_kernel_assumes():
    """Traced with the 2-CTA MMA's own layouts: each CTA's stage holds 128 rows of A and half the
    weight tile's rows of B; GEMM1's cp.async view of the 128 A rows is the UMMA view, offset for
    offset; each CTA's accumulators are its 128 rows by tile_n, within the TMEM column rule."""
    import cutlass.utils.hopper_helpers as sm90_utils
    from cutlass import BFloat16
    from cutlass.memory import get_num_tmem_alloc_cols
    from cutlass.tensor_utils import LayoutEnum
    from moe_aot_templates.blackwell_gemm import BlackwellGluGemm

    seen = {}
    for n in (64, 192, 256):
        obj = BlackwellGluGemm(**QWEN3_30B, tile_m=256, tile_n=n, tile_k=64, stages=3, mma="umma", cluster_m=2)

        @cute.jit
        def trace():
            tiled_mma = obj._make_umma()
            a, b = obj._smem_layouts(tiled_mma)
            seen[("a", n)] = cute.cosize(cute.slice_(a.outer, (None, None, None, 0)))
            seen[("b", n)] = cute.cosize(cute.slice_(b.outer, (None, None, None, 0)))
            seen[("v", n)] = cute.size(tiled_mma.thr_id.shape)
            acc = tiled_mma.make_fragment_C(cute.append(tiled_mma.partition_shape_C((256, n)), 2))
            seen[("acc", n)] = (cute.size(acc, mode=[0, 0]), cute.size(acc, mode=[0, 1]))
            seen[("tmem", n)] = get_num_tmem_alloc_cols(acc)
            a_cp = sm90_utils.make_smem_layout_a(LayoutEnum.ROW_MAJOR, (128, n, 64), BFloat16, obj.stages)
            seen[("swizzle", n)] = str(a.inner) == str(a_cp.inner)
            seen[("offsets", n)] = [(cute.crd2idx(((m, k % 16), 0, k // 16, s), a.outer),
                                     cute.crd2idx((m, k, s), a_cp.outer))
                                    for m in (0, 1, 7, 8, 63, 64, 127) for k in (0, 1, 15, 16, 40, 63) for s in (0, 2)]

        cute.compile(trace, options="--gpu-arch sm_100a")
        assert seen[("v", n)] == 2
        assert seen[("a", n)] == 128 * 64 and seen[("b", n)] == n // 2 * 64, n
        assert seen[("acc", n)] == (128, n)
        assert seen[("tmem", n)] == limits.umma_tmem_columns(n)
        assert seen[("swizzle", n)] and all(u == v for u, v in seen[("offsets", n)])


@pytest.mark.parametrize("role, tile_n, stages", [("glu", 256, 6), ("down", 128, 4)])
def test_pair_launcher_asks_for_a_cluster_of_2(role, tile_n, stages, tmp_path):
    """The pair kernels' own launcher against the stand-in driver: a cluster of 2 CTAs along x,
    an even grid of min(tiles, 74) pairs, and exactly the shared memory umma_smem_bytes budgets
    for a CTA of a pair (its 128 rows of A, half the weight tile)."""
    import json
    import sys

    import cuda_standin
    from moe_aot_templates.blackwell_gemm import BlackwellDownGemm, BlackwellGluGemm

    from moe_aot.kernel_build import compile_kernel

    cls = BlackwellGluGemm if role == "glu" else BlackwellDownGemm
    obj = cls(**QWEN3_30B, tile_m=256, tile_n=tile_n, tile_k=64, stages=stages, mma="umma", cluster_m=2)
    compile_kernel(obj, "sm_100a", f"k_{role}").write_dir(tmp_path / "lib")
    (tmp_path / "standin").mkdir()
    standin = cuda_standin.build(tmp_path / "standin")
    res = subprocess.run([sys.executable, "-c", LAUNCH, str(standin), str(tmp_path / "lib")],
                         capture_output=True, text=True, timeout=120, cwd=Path(__file__).resolve().parents[1])
    assert res.returncode == 0, res.stderr
    launches = [ln for ln in json.loads(res.stdout).splitlines() if ln.startswith("cuLaunchKernelEx")]
    assert len(launches) == 1, launches
    smem = int(re.search(r" smem=(\d+) ", launches[0])[1])
    grid = int(re.search(r" grid=(\d+),", launches[0])[1])
    threads = int(re.search(r" block=(\d+),", launches[0])[1])
    budget = limits.umma_smem_bytes(256, tile_n, 64, stages, cluster_m=2)
    assert smem == budget == stages * (128 + tile_n // 2) * 128 + 1024, (smem, budget)
    assert budget <= limits.SMEM_CAPACITY["sm_100a"]
    assert " attr4=2,1,1" in launches[0], launches[0]  # the 2-CTA cluster
    assert threads == (320 if role == "glu" else 192)
    assert grid == 2 * min(256 * obj.n // tile_n, 74)  # 256 M tiles in the stand-in's tile_expert


@pytest.mark.parametrize("kwargs, words", [
    (dict(tile_m=128, cluster_m=2), "tile_m must be 256"),
    (dict(tile_m=256), "needs cluster 2"),
    (dict(tile_m=256, cluster_m=4), "cluster 4 not in"),
    (dict(tile_m=256, cluster_m=2, ctas=147), "multiple of cluster_m"),
    (dict(tile_m=256, cluster_m=2, mma="hopws"), "umma"),
])
def test_pair_constructor_refusals(kwargs, words):
    from moe_aot_templates.blackwell_gemm import BlackwellDownGemm

    args = {**QWEN3_30B, "tile_n": 128, "tile_k": 64, "stages": 4, "mma": "umma", **kwargs}
    with pytest.raises(ValueError, match=words) as err:
        BlackwellDownGemm(**args)
    assert str(err.value).count(". ") == 0  # one sentence


def test_pair_rules_and_variants():
    """The pair's rules, DSL-free (gemm_limits; the tuner's and the template's one copy), and the
    variant seams: tile_m 256 is offered on sm_100a bf16 only, for both GEMMs as pairs."""
    assert limits.check_gemm(1536, 2048, 256, 256, 64, 6, "umma", arch="sm_100a", cluster_m=2) == (True, "")
    assert limits.umma_smem_bytes(256, 256, 64, 6, 2) == 6 * 256 * 128 + 1024
    ok, why = limits.check_gemm(1536, 2048, 256, 256, 64, 8, "umma", arch="sm_100a", cluster_m=2)
    assert not ok and "shared memory" in why
    sm100 = make_spec("qwen3-30b-a3b", target="sm_100a")
    pair = GemmTiles(128, 64, 4, "umma", 2)
    for variant, words in [
        (LayerVariant(128, pair, pair), "tile_m must be 256 (the routing padding every expert to 256 rows)"),
        (LayerVariant(256, GemmTiles(128, 64, 4, "umma"), GemmTiles(128, 64, 4, "umma")), "both GEMMs need"),
        (LayerVariant(256, pair, GemmTiles(128, 64, 4, "umma")), "both GEMMs need"),
        (LayerVariant(256, GemmTiles(128, 64, 4, "warp"), GemmTiles(128, 64, 4, "warp")), "both GEMMs need"),
    ]:
        ok, why = can_implement(sm100, variant)
        assert not ok and words in why and why.count(". ") == 0, why
    assert can_implement(sm100, LayerVariant(256, pair, pair)) == (True, "ok")
    for spec in (make_spec("qwen3-30b-a3b", target="sm_90a"), make_spec("qwen3-30b-a3b", target="sm_100a",
                                                                       precision="fp8")):
        ok, why = can_implement(spec, LayerVariant(256, pair, pair))
        assert not ok and "tile_m 256 not in" in why, why
    from moe_aot.variants import candidate_space, tile_ms

    assert tile_ms(sm100)[-1] == 256 and 256 not in tile_ms(make_spec("qwen3-30b-a3b", target="sm_90a"))
    pairs = [v for v in candidate_space(sm100) if v.tile_m == 256]
    assert pairs and all(v.glu.cluster == v.down.cluster == 2 and v.glu.mma == "umma" for v in pairs)
    # the tuner's sampler asks for a GEMM's cluster where it applies: umma at tile_m 256
    from moe_aot.tuner import _option_applies, search_space

    assert 256 in search_space(sm100)["tile_m"].choices and 2 in search_space(sm100)["glu_cluster"].choices
    assert _option_applies({"tile_m": 256, "glu_mma": "umma"}, "glu_cluster")
    assert not _option_applies({"tile_m": 128, "glu_mma": "umma"}, "glu_cluster")
    # the defaults stay 1-CTA (nothing was measured); the pair is the tuner's seed beside them
    for tokens in (1024, 4096, 16384):
        base = default_variant(sm100, tokens)
        assert base.tile_m == 128 and base.glu.cluster == base.down.cluster == 1
        twin = base.cluster_twins()
        assert [(v.tile_m, v.glu.cluster, v.down.cluster) for v in twin] == [(256, 2, 2)]
        assert can_implement(sm100, twin[0])[0] and LayerVariant.parse(twin[0].name(sm100)) == twin[0]
