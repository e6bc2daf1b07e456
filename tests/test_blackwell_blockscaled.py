"""CPU tests of the sm_100a block-scaled tcgen05 GEMMs (templates/blackwell_blockscaled.py, mma "umma").

Compiled only: no Blackwell GPU was available, so nothing here (nor anywhere) has run these
kernels. What the CPU can check: `moe-aot build --target sm_100a --precision mxfp8 / nvfp4 /
w4a8-mx` compiles a layer into a database; each GEMM's PTX and SASS hold the block-scaled tcgen05 MMA
(SASS UTCQMMA for kind::mxf8f6f4, e4m3 x e4m3 or, w4a8-mx, e4m3 x e2m1 by its instruction
descriptor; UTCOMMA.4X for kind::mxf4nvf4), w4a8-mx's weights loaded by an unpacking TMA (16 e2m1
per 16 bytes of shared memory), the scale factor copies into
TMEM (UTCCP), TMEM loads, TMA loads and no local memory; the scale layouts the kernels read and
write are the DSL's tcgen05 atoms and the host's permutation of them; the launcher asks for the
shared memory the rule budgets; the rules and the runtime refuse what does not fit, in one sentence.
"""
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from sass_tools import cuobjdump

cute = pytest.importorskip("cutlass.cute")

from moe_aot import blockscale  # noqa: E402
from moe_aot import gemm_limits as limits  # noqa: E402
from moe_aot.cli import main  # noqa: E402
from moe_aot.compiler import TEMPLATES, build_template, template_family, toolchain_key  # noqa: E402
from moe_aot.database import Database  # noqa: E402
from moe_aot.runtime import blockscaled as bw  # noqa: E402
from moe_aot.runtime import layer as layer_mod  # noqa: E402
from moe_aot.runtime.library import KernelArgumentError, check_tensor  # noqa: E402
from moe_aot.spec import make_spec  # noqa: E402
from moe_aot.variants import GemmTiles, LayerVariant, can_implement, default_variant  # noqa: E402

QWEN3_30B = dict(num_experts=128, hidden=2048, intermediate=768, top_k=8)
PRECISIONS = ("mxfp8", "nvfp4", "w4a8-mx")
MMA_SASS = {"mxfp8": "UTCQMMA", "nvfp4": "UTCOMMA", "w4a8-mx": "UTCQMMA"}
MMA_PTX = {"mxfp8": "tcgen05.mma.cta_group::1.kind::mxf8f6f4.block_scale",
           "nvfp4": "tcgen05.mma.cta_group::1.kind::mxf4nvf4.block_scale",
           "w4a8-mx": "tcgen05.mma.cta_group::1.kind::mxf8f6f4.block_scale"}
# h's format: GEMM1's quantizer (w4a8-mx's activations are mxfp8)
H_CVT = {"mxfp8": "F2FP.SATFINITE.E4M3.F32", "nvfp4": "F2FP.SATFINITE.E2M1.F32", "w4a8-mx": "F2FP.SATFINITE.E4M3.F32"}
# kind::mxf8f6f4's instruction descriptor: (A type, B type) at bits 7-9 and 10-12 (PTX ISA: E4M3 0, E2M1 5)
MXF8F6F4_TYPES = {"mxfp8": (0, 0), "w4a8-mx": (0, 5)}


def _sass(cubin: bytes, tmp_path) -> str:
    tool = cuobjdump()
    if tool is None:
        pytest.skip("no cuobjdump")
    path = tmp_path / "k.cubin"
    path.write_bytes(cubin)
    out = subprocess.run([tool, "-sass", str(path)], capture_output=True, text=True, check=True).stdout
    res = subprocess.run([tool, "-res-usage", str(path)], capture_output=True, text=True, check=True).stdout
    return out + "\n" + res


def _ops(sass: str) -> dict[str, int]:
    """Opcode (without modifiers) -> count in a SASS listing."""
    out: dict[str, int] = {}
    for op in re.findall(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)", sass):
        out[op] = out.get(op, 0) + 1
    return out


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """`moe-aot build --model qwen3-30b-a3b --target sm_100a --precision P` for the three
    precisions into one fresh database."""
    url = f"sqlite:///{tmp_path_factory.mktemp('bwbs') / 'bs.sqlite'}"
    for precision in PRECISIONS:
        res = CliRunner().invoke(main, ["build", "--model", "qwen3-30b-a3b", "--target", "sm_100a",
                                        "--precision", precision, "--jobs", "2", "--db", url])
        assert res.exit_code == 0, res.output
        assert " 0 failed" in res.output, res.output
    db = Database(url)
    yield db
    db.close()


@pytest.mark.parametrize("precision", PRECISIONS)
def test_build_compiles_the_tcgen05_block_scaled_layer(built, precision, tmp_path):
    spec = make_spec("qwen3-30b-a3b", target="sm_100a", precision=precision)
    tool = toolchain_key("sm_100a")
    for tokens in (1, 4096):  # decode too: sm_100a has no block-scaled mma.sync
        variant = default_variant(spec, tokens)
        assert variant.tile_m == 128 and variant.glu.mma == variant.down.mma == "umma"
    for kv in default_variant(spec, 4096).kernels(spec):
        art = built.get_artifact(kv.name, tool)
        assert art is not None and art.status == "ok", kv.name
        if kv.role not in ("glu", "down"):
            continue
        assert template_family(kv) == "blockscaled_umma"
        assert TEMPLATES[(kv.role, "blockscaled_umma")][0] == "blackwell_blockscaled"
        assert (int.from_bytes(art.cubin[48:52], "little") >> 8) & 0xFF == 100  # sm_100a
        names = [a["name"] for a in art.meta["args"]]  # the sm_121a kernels' argument lists
        nv = ["x_gamax", "w13_gamax", "h_gamax"] if precision == "nvfp4" else []
        if kv.role == "glu":
            assert names == ["xq", "xs", "w13q", "w13s", "sorted_ids", "tile_expert", "hq", "hs"] + nv + ["stream"]
        else:
            assert names == (["hq", "hs", "w2q", "w2s", "sorted_ids", "tile_expert", "topk_weights", "y"]
                             + (["h_gamax", "w2_gamax"] if precision == "nvfp4" else []) + ["stream"])
        # w4a8-mx's unpacking TMA wants a 32-byte aligned weight base: recorded, so the runtime checks it
        align = {a["name"]: a.get("assumed_align") for a in art.meta["args"]}
        assert align["w13q" if kv.role == "glu" else "w2q"] == (limits.BS_UMMA_UNPACK_ALIGN
                                                                if precision == "w4a8-mx" else 16), align
        if precision == "w4a8-mx" and kv.role == "down":
            arg = next(a for a in art.meta["args"] if a["name"] == "w2q")
            n = 128 * 2048 * 384  # [E, H, I/2], uninitialised: only the checks look at it
            base = torch.empty(n + 64, dtype=torch.uint8)
            at = (-base.data_ptr()) % 32
            with pytest.raises(KernelArgumentError, match="'w2q' must be 32-byte aligned"):
                check_tensor(arg, base[at + 16:at + 16 + n].view(128, 2048, 384), kv.name)
            with pytest.raises(KernelArgumentError, match="CUDA tensor"):  # every other check passes
                check_tensor(arg, base[at:at + n].view(128, 2048, 384), kv.name)
        sass = _sass(art.cubin, tmp_path)
        ops = _ops(sass)
        mma = MMA_SASS[precision]
        assert ops.get(mma, 0) >= 4, (kv.name, ops)  # the k-tile's four block-scaled MMAs (loop unrolled)
        if precision == "nvfp4":
            assert "UTCOMMA.4X" in sass  # scale_vec::4X: an e4m3 scale per 16
        assert ops.get("UTCCP", 0) >= 2, kv.name  # tcgen05.cp of A's and B's scale factors into TMEM
        assert {"LDTM", "UTCBAR", "UTMALDG", "UTCATOMSWS"} <= set(ops), kv.name
        other = {"UTCHMMA", "UTCQMMA", "UTCOMMA"} - {mma}
        assert not ({"HMMA", "QMMA", "OMMA", "HGMMA", "LDL", "STL"} | other) & set(ops), kv.name
        assert "LOCAL:0" in sass and "STACK:0" in sass, kv.name  # no spills
        gather = {"LDGSTS", "FENCE"} <= set(ops)  # the cp.async gather of x's rows, the proxy fence
        assert gather == (kv.role == "glu"), kv.name
        assert (H_CVT[precision] in sass) == (kv.role == "glu"), kv.name  # h quantized in GEMM1's epilogue


@pytest.mark.parametrize("precision, role, tile_n, stages", [
    ("mxfp8", "glu", 256, 4), ("nvfp4", "down", 128, 3), ("nvfp4", "glu", 128, 6), ("w4a8-mx", "glu", 256, 4),
    ("w4a8-mx", "down", 128, 6)])
def test_ptx_block_scaled_mma_scale_copies_and_waits(precision, role, tile_n, stages, tmp_path):
    """Other tiles compile; the PTX has only the block-scaled tcgen05 MMA of the precision (for
    kind::mxf8f6f4 with the operand types of its instruction descriptor: e4m3 x e2m1 for
    w4a8-mx), the 32x128b scale copies, one wait per TMEM load, the accumulators the TMEM rule
    gives, and GEMM1's full barriers count the 128 loader threads beside the TMA warp."""
    from moe_aot_templates.blackwell_blockscaled import BlackwellBlockScaledDownGemm, BlackwellBlockScaledGluGemm

    cls = BlackwellBlockScaledGluGemm if role == "glu" else BlackwellBlockScaledDownGemm
    obj = cls(**QWEN3_30B, tile_m=128, tile_n=tile_n, tile_k=limits.bs_umma_tile_k(precision), stages=stages,
              precision=precision, pdl=True)
    assert obj.acc_stages == (1 if tile_n == 256 else 2) and obj.tmem_cols == 512
    ptx = cute.compile(obj, *[f for _, f in obj.fake_arguments()],
                       options=f"--gpu-arch sm_100a --keep-ptx --dump-dir {tmp_path}").__ptx__
    body = ptx[ptx.index(".entry"):]
    mmas = re.findall(r"tcgen05\.mma\.[\w:.]+", body)
    assert mmas and all(m.startswith(MMA_PTX[precision]) for m in mmas), set(mmas)
    if precision in MXF8F6F4_TYPES:
        # the descriptor register of every MMA (its 4th operand), an or/mov of a constant
        regs = set(re.findall(r"tcgen05\.mma\.[\w:.]+\s+\[[^\]]+\],\s*%rd\d+,\s*%rd\d+,\s*(%r\d+),", body))
        descs = set()
        for reg in regs:
            m = re.search(rf"(?:or|mov)\.b32\s+{reg},\s*(?:%r\d+,\s*)?(\d+);", body)
            assert m, reg
            descs.add(((int(m[1]) >> 7) & 7, (int(m[1]) >> 10) & 7, (int(m[1]) >> 17) & 63))
        assert descs == {(*MXF8F6F4_TYPES[precision], tile_n // 8)}, descs
    assert "tcgen05.cp.cta_group::1.32x128b.warpx4" in body
    lds = body.count("tcgen05.ld.sync")
    assert lds == tile_n // obj.epi_n and body.count("tcgen05.wait::ld") == lds
    assert "griddepcontrol.wait" in body and "tcgen05.dealloc" in body
    if role == "glu":
        assert "cp.async.cg.shared.global" in body and "fence.proxy.async.shared::cta" in body
        consts = dict(re.findall(r"mov\.b32\s+(%r\d+),\s*(\d+);", body))
        inits = [int(c) for c in re.findall(r"mbarrier\.init\.shared(?:::cta)?\.b64\s+\[[^\]]+\],\s*(\d+);", body)]
        inits += [int(consts[r]) for r in re.findall(r"mbarrier\.init\.shared(?:::cta)?\.b64\s+\[[^\]]+\],\s*(%r\d+);",
                                                     body) if r in consts]
        assert 1 + limits.LOAD_THREADS in inits
    else:
        assert "cp.async.cg" not in body and "cp.async.ca" not in body


@pytest.mark.parametrize("role", ["glu", "down"])
def test_w4a8_device_code_is_mxfp8s_but_for_the_b_type_and_byte_count(role, tmp_path):
    """w4a8-mx's kernels differ from mxfp8's (same tiles) on the device only where they must: line
    for line, the PTX is the same but for the kernel's name, the bytes each stage's barrier expects
    (the weights' k-tile counted packed: tile_n * 64 instead of tile_n * 128) and the instruction
    descriptors' B type (E2M1, 5, instead of E4M3, 0, at bits 10-12). So shared memory, the
    descriptors of the A and B stages, the scale copies and the pipelines are mxfp8's; only the
    weights' TMA (host-encoded, format U4_UNPACK_U8) reads other global bytes."""
    from moe_aot_templates.blackwell_blockscaled import BlackwellBlockScaledDownGemm, BlackwellBlockScaledGluGemm

    cls = BlackwellBlockScaledGluGemm if role == "glu" else BlackwellBlockScaledDownGemm
    ptx = {}
    for precision in ("mxfp8", "w4a8-mx"):
        obj = cls(**QWEN3_30B, tile_m=128, tile_n=128, tile_k=128, stages=6, precision=precision)
        out = cute.compile(obj, *[f for _, f in obj.fake_arguments()],
                           options=f"--gpu-arch sm_100a --keep-ptx --dump-dir {tmp_path}").__ptx__
        ptx[precision] = re.sub(r"kernel_cutlass_\w+", "KERNEL", out[out.index(".entry"):]).splitlines()
    a_b, b_b, sfa_b, sfb_b = limits.bs_umma_stage_bytes("mxfp8", 128, 128)
    tx = b_b + sfb_b + (0 if role == "glu" else a_b + sfa_b)
    assert len(ptx["mxfp8"]) == len(ptx["w4a8-mx"])
    seen = set()
    for old, new in zip(ptx["mxfp8"], ptx["w4a8-mx"]):
        if old == new:
            continue
        mo = re.fullmatch(r"\s*(mov\.b32|or\.b32)\s+%r\d+,\s*(?:%r\d+,\s*)?(\d+);", old)
        mn = re.fullmatch(r"\s*(mov\.b32|or\.b32)\s+%r\d+,\s*(?:%r\d+,\s*)?(\d+);", new)
        assert mo and mn and old.rsplit(",", 1)[0] == new.rsplit(",", 1)[0], (old, new)
        seen.add((mo[1], mo[2], mn[2]))
        if mo[1] == "or.b32":  # an instruction descriptor: only B's type moved, E4M3 -> E2M1
            assert int(mn[2]) ^ int(mo[2]) == 5 << 10 and (int(mo[2]) >> 10) & 7 == 0, (old, new)
    movs = {d for d in seen if d[0] == "mov.b32"}
    assert movs == {("mov.b32", str(tx), str(tx - b_b // 2))} and len(seen) > len(movs), seen


def test_scale_layouts_are_the_tcgen05_atoms():
    """Traced with the DSL's own layouts: (1) the tcgen05 scale layout in global memory
    (tile_atom_to_shape_SF, what the TMA loads of w13s / w2s / hs read) puts row r, K block j where
    blockscale.to_tcgen05_scales and the kernel's sf_atom_offset (GEMM1's writes of hs) put it;
    (2) GEMM1's cp.async view of the A scale stages and of the A value stages are the MMA's
    shared-memory layouts, offset for offset; (3) the TMEM column rule covers the DSL's scale
    factor and accumulator tensors."""
    import cutlass.utils.blockscaled_layout as bsl
    import cutlass.utils.hopper_helpers as sm90_utils
    from cutlass import Uint8
    from cutlass.cute.nvgpu import tcgen05
    from cutlass.tensor_utils import LayoutEnum
    from moe_aot_templates.blackwell_blockscaled import BlackwellBlockScaledGluGemm, sf_atom_offset

    seen = {}
    rows, blocks = 256, 8
    coords = [(r, j) for r in (0, 1, 31, 32, 33, 97, 127, 128, 160, 255) for j in range(blocks)]
    for precision, tile_n in (("mxfp8", 128), ("nvfp4", 256)):
        obj = BlackwellBlockScaledGluGemm(**QWEN3_30B, tile_m=128, tile_n=tile_n,
                                          tile_k=limits.bs_umma_tile_k(precision), stages=3, precision=precision)
        vec = obj.vec

        @cute.jit
        def trace():
            g = bsl.tile_atom_to_shape_SF((rows, blocks * vec, 1), vec)
            seen[(precision, "global")] = [cute.crd2idx((r, j * vec, 0), g) for r, j in coords]
            tiled_mma = obj._make_umma()
            a_l, _, sfa_l, sfb_l = obj._layouts(tiled_mma)
            # (2) scales: the MMA's (((M atom), (K in inst)), MMA_M, MMA_K, STAGE) against the gather's
            # ((32, 4), group, byte, stage) view
            inst_k = cute.size(tiled_mma.shape_mnk, mode=[2])
            sfa_b = limits.bs_umma_stage_bytes(precision, 128, tile_n)[2]
            cp = cute.make_layout(((32, 4), obj.row_scales // 4, 4, 3), stride=((16, 4), 512, 1, sfa_b))
            seen[(precision, "sfa")] = _sfa_pairs(sfa_l, cp, inst_k, vec, obj.row_scales)
            # values: the UMMA view (elements) against the byte view GEMM1's cp.async writes
            cpv = sm90_utils.make_smem_layout_a(LayoutEnum.ROW_MAJOR, (128, tile_n, 128), Uint8, 3)
            seen[(precision, "swizzle")] = (str(a_l.inner), str(cpv.inner))
            per = 8 // obj.bits  # elements per byte
            inst_bytes = inst_k * obj.bits // 8
            seen[(precision, "values")] = [
                (cute.crd2idx(((m, (b * 8 // obj.bits) % inst_k), 0, b // inst_bytes, s), a_l.outer) // per,
                 cute.crd2idx((m, b, s), cpv.outer))
                for m in (0, 1, 7, 8, 64, 127) for b in (0, 1, 15, 16, 31, 32, 100, 127) for s in (0, 2)]
            # (3) TMEM columns of the scale factors (DSL) and the accumulators
            tsfa = cute.make_tensor(cute.make_ptr(obj.sf_dtype, 0, cute.AddressSpace.tmem),
                                    bsl.make_tmem_layout_sfa(tiled_mma, obj._mma_tiler(), vec,
                                                             cute.slice_(sfa_l, (None, None, None, 0))))
            tsfb = cute.make_tensor(cute.make_ptr(obj.sf_dtype, 0, cute.AddressSpace.tmem),
                                    bsl.make_tmem_layout_sfb(tiled_mma, obj._mma_tiler(), vec,
                                                             cute.slice_(sfb_l, (None, None, None, 0))))
            acc = tiled_mma.make_fragment_C(cute.append(tiled_mma.partition_shape_C((128, tile_n)), obj.acc_stages))
            seen[(precision, "tmem")] = (tcgen05.find_tmem_tensor_col_offset(tsfa),
                                         tcgen05.find_tmem_tensor_col_offset(tsfb),
                                         tcgen05.find_tmem_tensor_col_offset(acc))

        cute.compile(trace, options="--gpu-arch sm_100a")
        # (1) the DSL's global layout, the host permutation and the kernel's own offsets agree
        perm = blockscale.to_tcgen05_scales(torch.arange(rows * blocks).reshape(rows, blocks)).flatten()
        where = {int(v): i for i, v in enumerate(perm.tolist())}
        for (r, j), off in zip(coords, seen[(precision, "global")]):
            assert off == where[r * blocks + j] == sf_atom_offset(r // 128, blocks, r % 128, j), (precision, r, j)
        assert all(a == b for a, b in seen[(precision, "sfa")]), (precision, seen[(precision, "sfa")][:8])
        assert len({a for a, _ in seen[(precision, "sfa")]}) == len(seen[(precision, "sfa")])  # distinct bytes
        assert seen[(precision, "swizzle")][0] == seen[(precision, "swizzle")][1]
        assert all(a == b for a, b in seen[(precision, "values")]), seen[(precision, "values")]
        sfa_cols, sfb_cols, acc_cols = seen[(precision, "tmem")]
        want_a, want_b = limits.bs_umma_sf_columns(128, tile_n)
        assert sfa_cols <= want_a and sfb_cols <= want_b and acc_cols == obj.acc_stages * tile_n, seen
        assert obj.acc_stages * tile_n + want_a + want_b <= obj.tmem_cols <= limits.TMEM_COLUMNS


@pytest.mark.parametrize("precision, tile_n", [("w4a8-mx", 128), ("w4a8-mx", 256), ("mxfp8", 128), ("nvfp4", 256)])
def test_weight_tma_unpacks_e2m1_to_bytes(precision, tile_n):
    """The weights' TMA atom, traced with the kernel's own objects: w4a8-mx's reads the packed e2m1
    bytes of w13q / w2q (half a byte per weight, as the host prepares them) with the DSL's
    U4_UNPACK_U8 format, so shared memory holds 16 weights per 16 bytes in the same 128-byte-swizzled
    K-major stage layout as the e4m3 activations (what kind::mxf8f6f4 reads for both operands), and
    its transfer is the packed size gemm_limits.bs_umma_tx_bytes puts on the stage's barrier;
    mxfp8 and nvfp4 load their values unchanged (U8, U4)."""
    from moe_aot_templates.blackwell_blockscaled import BlackwellBlockScaledDownGemm

    obj = BlackwellBlockScaledDownGemm(**QWEN3_30B, tile_m=128, tile_n=tile_n, tile_k=limits.bs_umma_tile_k(precision),
                                       stages=3, precision=precision)
    args = dict(obj.fake_arguments())
    seen = {}

    @cute.jit
    def trace(wq: cute.Tensor, ws: cute.Tensor):
        tma_b, _, _, _ = obj._make_tma_w(wq, ws)
        seen["atom"] = str(tma_b._trait.value.type)
        a_l, b_l, _, _ = obj._layouts(obj._make_umma())
        seen["a"], seen["b"] = (str(a_l.inner), cute.cosize(a_l.outer)), (str(b_l.inner), cute.cosize(b_l.outer))
        seen["offsets"] = [(cute.crd2idx(((n, k), 0, kb, st), b_l.outer), cute.crd2idx(((n, k), 0, kb, st), a_l.outer))
                           for n in (0, 1, 9, 127) for k in (0, 1, 31) for kb in (0, 3) for st in (0, 2)]

    cute.compile(trace, args["w2q"], args["w2s"], options="--gpu-arch sm_100a")
    fmt = re.search(r"tma_format = (\w+)", seen["atom"])[1]
    bits = int(re.search(r"copy_bits = (\d+)", seen["atom"])[1])
    assert fmt == {"w4a8-mx": "U4_UNPACK_U8", "mxfp8": "U8", "nvfp4": "U4"}[precision], seen["atom"]
    assert bits == 8 * limits.bs_umma_tx_bytes(precision, tile_n), seen["atom"]
    a_b, b_b, _, _ = limits.bs_umma_stage_bytes(precision, 128, tile_n)
    if precision == "w4a8-mx":
        assert "f4E2M1FN" in seen["atom"] and bits == 8 * b_b // 2  # half the shared-memory bytes cross
        assert limits.bs_umma_stage_bytes(precision, 128, tile_n) == limits.bs_umma_stage_bytes("mxfp8", 128, tile_n)
        # B's stages are bytes: A's swizzle and, with tile_n = tile_m, A's offsets element for element
        assert seen["b"][0] == seen["a"][0] and seen["b"][1] == 3 * b_b
        if tile_n == 128:
            assert all(b == a for b, a in seen["offsets"]), seen["offsets"]
    else:
        assert bits == 8 * b_b


def _sfa_pairs(sfa_l, cp, inst_k, vec, blocks):
    """(offset in the MMA's SFA stage layout, offset in GEMM1's gather view) of row r, K block j,
    stage s (plain Python, called while tracing: the DSL would turn its loops into device loops)."""
    pairs = []
    for r in (0, 5, 31, 32, 77, 127):
        for j in range(blocks):
            for s in (0, 2):
                kin = j * vec % inst_k  # the K element within its MMA instruction
                kc = (kin % vec, kin // vec) if inst_k > vec else (kin, 0)
                mma_c = ((((r % 32, r // 32), 0), kc), 0, j * vec // inst_k, s)
                pairs.append((cute.crd2idx(mma_c, sfa_l), cute.crd2idx(((r % 32, r // 32), j // 4, j % 4, s), cp)))
    return pairs


def test_tcgen05_scale_layout_is_a_permutation_that_round_trips():
    s = torch.randint(0, 256, (3, 256, 24), dtype=torch.uint8)
    t = blockscale.to_tcgen05_scales(s)
    assert t.shape == s.shape and t.is_contiguous() and not torch.equal(t, s)
    assert torch.equal(t.flatten().sort().values, s.flatten().sort().values)
    assert torch.equal(blockscale.from_tcgen05_scales(t), s)
    idx = torch.arange(256 * 24).reshape(256, 24)
    assert torch.equal(blockscale.from_tcgen05_scales(blockscale.to_tcgen05_scales(idx)), idx)
    assert sorted(blockscale.to_tcgen05_scales(idx).flatten().tolist()) == list(range(256 * 24))
    # each expert on its own: the first expert's bytes stay in its own [256, 24] slab
    assert torch.equal(t[0], blockscale.to_tcgen05_scales(s[0]))
    assert torch.equal(blockscale.to_scale_layout(s, "rows"), s)
    for bad in (torch.zeros(96, 8, dtype=torch.uint8), torch.zeros(128, 6, dtype=torch.uint8)):
        with pytest.raises(ValueError, match="tcgen05 scale atom") as err:
            blockscale.to_tcgen05_scales(bad)
        assert str(err.value).count(". ") == 0
    with pytest.raises(ValueError, match="scale layout 'swizzled'"):
        blockscale.to_scale_layout(s, "swizzled")


@pytest.mark.parametrize("fmt", PRECISIONS)
def test_weights_prepared_for_sm100a(fmt):
    torch.manual_seed(0)
    g, u, d = torch.randn(2, 128, 256), torch.randn(2, 128, 256), torch.randn(2, 256, 128)
    rows13, rows2 = bw.prepare_w13(g, u, fmt), bw.prepare_w2(d, fmt)
    w13, w2 = bw.prepare_w13(g, u, fmt, target="sm_100a"), bw.prepare_w2(d, fmt, target="sm_100a")
    assert rows13.scale_layout == rows2.scale_layout == "rows"
    assert w13.scale_layout == w2.scale_layout == "tcgen05"
    assert torch.equal(w13.values, rows13.values) and torch.equal(w2.values, rows2.values)
    # the values as the TMA reads them: a byte per e4m3, two e2m1 per byte (w4a8-mx's too: the TMA unpacks them)
    assert w13.values.shape == (2, 256, 256 * limits.BS_ELEM_BITS[limits.BS_FORMATS[fmt][1]] // 8)
    assert torch.equal(w13.scales, blockscale.to_tcgen05_scales(rows13.scales))
    assert not torch.equal(w13.scales, rows13.scales)
    assert torch.equal(bw.dequantize(w13, fmt), bw.dequantize(rows13, fmt))  # the same numbers
    assert torch.equal(bw.for_target(w13, "sm_121a").scales, rows13.scales)
    assert bw.for_target(w13, "sm_100a") is w13
    gate, up = bw.split_w13(w13)
    assert torch.equal(gate.scales, bw.split_w13(rows13)[0].scales) and up.scale_layout == "rows"
    assert bw.with_input_amax(w2, 3.0).scale_layout == "tcgen05"


def test_gpt_oss_weights_for_sm100a():
    """w4a8-mx on sm_100a takes gpt-oss's checkpoint bytes: the e2m1 codes stay packed row-major
    (what the unpacking TMA reads), only the scales move into the tcgen05 atoms; to_gpt_oss gives
    the checkpoint's bytes back."""
    torch.manual_seed(1)
    e, i, h = 2, 128, 256
    gu_blocks = torch.randint(0, 256, (e, 2 * i, h // 32, 16), dtype=torch.uint8)
    gu_scales = torch.randint(100, 140, (e, 2 * i, h // 32), dtype=torch.uint8)
    d_blocks = torch.randint(0, 256, (e, h, i // 32, 16), dtype=torch.uint8)
    d_scales = torch.randint(100, 140, (e, h, i // 32), dtype=torch.uint8)
    rows13, rows2 = bw.from_gpt_oss(gu_blocks, gu_scales, d_blocks, d_scales)
    w13, w2 = bw.from_gpt_oss(gu_blocks, gu_scales, d_blocks, d_scales, target="sm_100a")
    assert w13.scale_layout == w2.scale_layout == "tcgen05"
    assert w13.values.shape == (e, 2 * i, h // 2) and w2.values.shape == (e, h, i // 2)
    assert torch.equal(w13.values, rows13.values) and torch.equal(w2.values, rows2.values)
    assert torch.equal(w13.scales, blockscale.to_tcgen05_scales(rows13.scales))
    assert torch.equal(w2.scales, blockscale.to_tcgen05_scales(rows2.scales))
    back = bw.to_gpt_oss(w13, w2)
    for got, want in zip(back, (gu_blocks, gu_scales, d_blocks, d_scales)):
        assert torch.equal(got, want)
    # the sm_100a w4a8-mx layer takes them, and refuses the sm_121a layout in one sentence
    spec = make_spec(experts=e, top_k=1, hidden=h, intermediate=i, precision="w4a8-mx", target="sm_100a")
    layer = layer_mod.MoeLayer(spec, store=object(), device=torch.device("cpu"), variants={})
    x, tw, ids = torch.zeros(4, h, dtype=torch.bfloat16), torch.zeros(4, 1), torch.zeros(4, 1, dtype=torch.int32)
    layer.check_inputs(x, w13, w2, tw, ids, None)
    with pytest.raises(KernelArgumentError, match="w2's scales are in the 'rows' layout and sm_100a's kernels read "
                                                  "'tcgen05'") as err:
        layer.check_inputs(x, w13, rows2, tw, ids, None)
    assert str(err.value).count(". ") == 0


def test_the_layer_refuses_another_targets_scale_layout_and_gpu(monkeypatch):
    spec = make_spec(experts=2, top_k=1, hidden=256, intermediate=128, precision="mxfp8", target="sm_100a")
    g, u, d = torch.randn(2, 128, 256), torch.randn(2, 128, 256), torch.randn(2, 256, 128)
    layer = layer_mod.MoeLayer(spec, store=object(), device=torch.device("cpu"), variants={})
    x, tw, ids = torch.zeros(4, 256, dtype=torch.bfloat16), torch.zeros(4, 1), torch.zeros(4, 1, dtype=torch.int32)
    with pytest.raises(KernelArgumentError, match="w13's scales are in the 'rows' layout and sm_100a's kernels read "
                                                  "'tcgen05'") as err:
        layer.check_inputs(x, bw.prepare_w13(g, u, "mxfp8"), bw.prepare_w2(d, "mxfp8", target="sm_100a"), tw, ids,
                           None)
    assert str(err.value).count(". ") == 0
    layer.check_inputs(x, bw.prepare_w13(g, u, "mxfp8", target="sm_100a"), bw.prepare_w2(d, "mxfp8", target="sm_100a"),
                       tw, ids, None)
    # sm_121a's layer refuses sm_100a's weights the same way
    spark = layer_mod.MoeLayer(dataclass_replace(spec, target="sm_121a"), store=object(), device=torch.device("cpu"),
                               variants={})
    with pytest.raises(KernelArgumentError, match="'tcgen05' layout and sm_121a's kernels read 'rows'"):
        spark.check_inputs(x, bw.prepare_w13(g, u, "mxfp8", target="sm_100a"), bw.prepare_w2(d, "mxfp8"), tw, ids,
                           None)
    # on a GPU: an sm_100a layer only on compute capability 10.0 (an H200 or a Spark refuses it)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    for cc, name in (((9, 0), "sm_90a"), ((12, 1), "sm_121a")):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None, cc=cc: cc)
        with pytest.raises(KernelArgumentError, match=f"sm_100a kernels run only on GPUs of compute capability 10.0; "
                                                      f"this GPU is {name}") as err:
            layer_mod.MoeLayer(spec, store=object(), device=torch.device("cuda", 0), variants={})
        assert str(err.value).count(". ") == 0
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (10, 0))
    assert layer_mod.MoeLayer(spec, store=object(), device=torch.device("cuda", 0), variants={}).spec is spec


def dataclass_replace(spec, **kw):
    import dataclasses

    return dataclasses.replace(spec, **kw)


@pytest.mark.parametrize("role, kwargs, words", [
    ("glu", dict(tile_m=64), "tile_m 64"),
    ("glu", dict(tile_n=192), "tile_n 192 must be one of (128, 256)"),
    ("down", dict(tile_n=64), "tile_n 64"),
    ("glu", dict(tile_k=256), "tile_k 256 must be 128"),
    ("down", dict(precision="nvfp4", tile_k=128), "tile_k 128 must be 256"),
    ("glu", dict(stages=2), "stages 2"),
    ("down", dict(stages=9), "stages 9"),
    ("glu", dict(precision="w4a8-mx", tile_k=256), "tile_k 256 must be 128"),
    ("down", dict(precision="w4a8-mx", arch="sm_90a"), "sm_100a only, not sm_90a"),
    ("glu", dict(precision="w4a8-mx", tile_n=256, stages=5, arch="sm_100a"), "shared memory"),
    ("down", dict(arch="sm_90a"), "sm_100a only, not sm_90a"),
    ("glu", dict(arch="sm_121a"), "sm_100a only, not sm_121a"),
    ("glu", dict(tile_n=256, stages=5, arch="sm_100a"), "shared memory"),
    ("down", dict(precision="nvfp4", tile_k=256, tile_n=256, stages=5, arch="sm_100a"), "shared memory"),
    ("down", dict(hidden=2048 + 128, tile_n=256), "N=2176 of tile_n 256"),
])
def test_refusals_in_one_sentence(role, kwargs, words):
    from moe_aot_templates.blockscaled_warp import BlockScaledDownGemm, BlockScaledGluGemm

    args = {**QWEN3_30B, "tile_m": 128, "tile_n": 128, "tile_k": 128, "stages": 4, "mma": "umma",
            "precision": "mxfp8", **kwargs}
    cls = BlockScaledGluGemm if role == "glu" else BlockScaledDownGemm
    ok, reason = cls.can_implement(**args)
    assert not ok and words in reason, reason
    assert reason.count(". ") == 0


def test_rules_registry_and_constructor():
    assert limits.check_bs_umma("glu", "mxfp8", 1536, 2048, 128, 256, 128, 4, "sm_100a") == (True, "")
    assert limits.check_bs_umma("down", "nvfp4", 2048, 768, 128, 256, 256, 4, "sm_100a") == (True, "")
    assert limits.bs_umma_sf_columns(128, 128) == (16, 16) and limits.bs_umma_sf_columns(128, 256) == (16, 32)
    assert limits.bs_umma_acc_stages(128) == 2 and limits.bs_umma_acc_stages(256) == 1
    assert limits.bs_umma_tile_k("mxfp8") == 128 and limits.bs_umma_tile_k("nvfp4") == 256
    assert limits.bs_umma_tile_k("w4a8-mx") == 128  # one 128-byte row of e4m3 (and of unpacked e2m1)
    assert limits.bs_umma_tx_bytes("w4a8-mx", 128) == 128 * 64 and limits.bs_umma_tx_bytes("mxfp8", 128) == 128 * 128
    assert limits.check_bs_umma("glu", "w4a8-mx", 1536, 2048, 128, 128, 128, 6, "sm_100a") == (True, "")
    ok, why = limits.check_bs_umma("glu", "fp8", 1536, 2048, 128, 128, 128, 6, "sm_100a")
    assert not ok and why == "umma: block-scaled GEMMs are built for mxfp8, nvfp4, w4a8-mx, not fp8"
    assert limits.bs_scale_layout("sm_100a") == "tcgen05" and limits.bs_scale_layout("sm_121a") == "rows"
    # sm_100a has no block-scaled mma.sync, sm_121a no tcgen05
    spec = make_spec("qwen3-30b-a3b", target="sm_100a", precision="nvfp4")
    ok, why = can_implement(spec, LayerVariant(16, GemmTiles(64, 256, 4, "warp"), GemmTiles(64, 256, 4, "warp")))
    assert not ok and "sm_120 family" in why
    spark = make_spec("qwen3-30b-a3b", target="sm_121a", precision="nvfp4")
    ok, why = can_implement(spark, LayerVariant(128, GemmTiles(128, 256, 4, "umma"), GemmTiles(128, 256, 4, "umma")))
    assert not ok and "umma MMA is not available on sm_121a" in why
    kv = next(k for k in default_variant(spec, 64).kernels(spec) if k.role == "glu")
    assert type(build_template(kv)).__name__ == "BlackwellBlockScaledGluGemm"
    from moe_aot_templates.blackwell_blockscaled import BlackwellBlockScaledGluGemm

    with pytest.raises(ValueError, match="umma"):
        BlackwellBlockScaledGluGemm(**QWEN3_30B, mma="warp")
    with pytest.raises(ValueError, match="no expert biases"):
        BlackwellBlockScaledGluGemm(**QWEN3_30B, bias=True)
    with pytest.raises(ValueError, match="interleave 32 must divide the scale block"):
        BlackwellBlockScaledGluGemm(**QWEN3_30B, precision="nvfp4", tile_k=256, interleave=32)


LAUNCH = r"""
import ctypes, json, sys
standin = ctypes.CDLL(sys.argv[1], mode=ctypes.RTLD_GLOBAL)
standin.standin_log.restype = ctypes.c_char_p
import torch
from moe_aot.runtime.library import KernelLibrary
lib = KernelLibrary.from_dir(sys.argv[2], device=0)
dt = {"Int32": torch.int32, "Float32": torch.float32, "BFloat16": torch.bfloat16, "Uint8": torch.uint8}
ts = [torch.zeros([s if s is not None else 256 for s in a["static_shape"]], dtype=dt[a["dtype"]])
      for a in lib._tensor_args]
standin.standin_reset()
lib(*ts, stream=0x5151, check=False)
print(json.dumps(standin.standin_log().decode()))
"""


@pytest.mark.parametrize("precision, role, tile_n, stages", [("mxfp8", "glu", 128, 6), ("nvfp4", "down", 256, 4),
                                                           ("w4a8-mx", "down", 128, 6)])
def test_launcher_asks_for_the_budgeted_shared_memory(precision, role, tile_n, stages, tmp_path):
    """The kernel's own host launcher (it encodes the TMA descriptors of values and scale atoms),
    run against the stand-in driver of tests/cuda_standin.py: one launch of 320 / 192 threads on
    min(tiles, 148) CTAs with exactly gemm_limits.bs_umma_smem_bytes of shared memory."""
    import cuda_standin
    from moe_aot_templates.blackwell_blockscaled import BlackwellBlockScaledDownGemm, BlackwellBlockScaledGluGemm

    from moe_aot.kernel_build import compile_kernel

    cls = BlackwellBlockScaledGluGemm if role == "glu" else BlackwellBlockScaledDownGemm
    obj = cls(**QWEN3_30B, tile_m=128, tile_n=tile_n, tile_k=limits.bs_umma_tile_k(precision), stages=stages,
              precision=precision)
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
    budget = limits.bs_umma_smem_bytes(precision, 128, tile_n, stages)
    assert smem == budget, (smem, budget)
    assert budget <= limits.SMEM_CAPACITY["sm_100a"]
    assert threads == (320 if role == "glu" else 192)
    assert grid == min(256 * obj.n // tile_n, 148)
