"""The backward's fused data path (templates/hopper_bwd.py, moe_aot/integrations/autograd.py
moe_backward_fused) on the CPU: the kernels' names and limits, their sm_90a SASS, and the glue
around them with each kernel emulated in float64 exactly as its docstring specifies (rows it does
not write are NaN), against the torch backward."""
from __future__ import annotations

import dataclasses
import re

import pytest

torch = pytest.importorskip("torch")

from moe_aot.glu import glu_fn  # noqa: E402
from moe_aot.integrations.autograd import moe_backward, moe_backward_fused  # noqa: E402
from moe_aot.spec import make_spec  # noqa: E402
from moe_aot.variants import GemmTiles, backward_gemm_tiles, backward_kernels  # noqa: E402

E, K, H, I, G = 4, 2, 32, 32, 16  # G: the gate/up interleave


class _Emulated:
    """The four kernels of runtime.layer.BackwardGemms as torch loops over their contracts."""

    def __init__(self, tile_m, dh_tile_n, activation):
        self.tile_m, self.dh_tile_n, self.activation = tile_m, dh_tile_n, activation

    def routing(self, ids, counts, offsets, sorted_ids, tile_expert):
        flat = ids.reshape(-1).tolist()
        m = self.tile_m
        rows = [[p for p, e in enumerate(flat) if e == x] for x in range(E)]
        counts.copy_(torch.tensor([len(r) for r in rows]))
        offsets[0] = 0
        sorted_ids.fill_(-1)
        tile_expert.fill_(-1)
        for x, r in enumerate(rows):
            start = int(offsets[x])
            offsets[x + 1] = start + -(-len(r) // m) * m
            sorted_ids[start:start + len(r)] = torch.tensor(r, dtype=torch.int32)
            tile_expert[start // m:int(offsets[x + 1]) // m] = x

    def dh(self, dout, w2, sorted_ids, tile_expert, tw, preact, da, hw, dwp):
        for t in (da, hw, dwp):
            t.fill_(float("nan"))  # what a tile with no expert leaves
        for tile, x in enumerate(tile_expert.tolist()):
            if x < 0:
                continue
            for r in range(tile * self.tile_m, (tile + 1) * self.tile_m):
                p = int(sorted_ids[r])
                if p < 0:
                    da[r], hw[r], dwp[r] = 0, 0, 0
                    continue
                grad = dout[p // K] @ w2[x]  # [I]
                a = preact[p].view(-1, 2, G)
                g = a[:, 0].reshape(-1).clone().requires_grad_()
                u = a[:, 1].reshape(-1).clone().requires_grad_()
                h = glu_fn(self.activation)(g, u)
                w = tw.reshape(-1)[p]
                dg, du = torch.autograd.grad(h, (g, u), w * grad)
                da[r] = torch.stack((dg.view(-1, G), du.view(-1, G)), 1).reshape(-1)
                hw[r] = (w * h).detach()
                dwp[r] = (grad * h.detach()).view(-1, self.dh_tile_n).sum(1)

    def dx(self, da, w13, sorted_ids, tile_expert, ones, y):
        y.fill_(float("nan"))
        for tile, x in enumerate(tile_expert.tolist()):
            for r in range(tile * self.tile_m, (tile + 1) * self.tile_m):
                p = int(sorted_ids[r])
                if x >= 0 and p >= 0:
                    y[p] = ones.reshape(-1)[p] * (da[r] @ w13[x])

    def combine(self, y, ids, out):
        out.zero_()
        for p, x in enumerate(ids.reshape(-1).tolist()):
            if 0 <= x < E:
                out[p // K] += y[p]


@pytest.mark.parametrize("activation, bias", [("swiglu", False), ("geglu", False), ("swigluoai", True)])
@pytest.mark.parametrize("kept", [False, True])
def test_fused_backward_glue_matches_the_torch_backward(activation, bias, kept):
    """Padded rows, the routing weight's partial sums per N tile, the bias terms and the mapping of
    rows back to pairs: every gradient equal to moe_backward's torch path in float64 (up to its fp32 sums)."""
    from moe_aot.integrations.autograd import preact_torch

    gen = torch.Generator().manual_seed(5)
    M = 9
    f64 = dict(dtype=torch.float64)
    x = torch.randn(M, H, generator=gen, **f64)
    w13 = torch.randn(E, 2 * I, H, generator=gen, **f64) * (3.0 / H ** 0.5)
    w2 = torch.randn(E, H, I, generator=gen, **f64) / I ** 0.5
    tw = torch.rand(M, K, generator=gen, **f64)
    ids = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(M)]).to(torch.int32)
    ids[1, 0], ids[2, 1] = -1, E + 3  # ids outside [0, E): no row, no gradient
    ids[ids == 3] = 0  # an expert with no rows
    b13 = torch.randn(E, 2 * I, generator=gen, **f64) if bias else None
    b2 = torch.randn(E, H, generator=gen, **f64) if bias else None
    grad = torch.randn(M, H, generator=gen, **f64)
    preact = preact_torch(x, w13, ids, b13) if kept else None
    kern = _Emulated(tile_m=4, dh_tile_n=16, activation=activation)
    got = moe_backward_fused(kern, grad, x, w13, w2, tw, ids, activation, b13, b2, preact)
    ref = moe_backward(grad, x, w13, w2, tw, ids, activation, G, b13, b2, preact)
    for name, g, r in zip(("dx", "dw13", "dw2", "dtw", "db13", "db2"), got, ref):
        if r is None:
            assert g is None, name
            continue
        assert g.shape == r.shape and g.dtype == r.dtype, name
        # the torch path sums dx and dtw in fp32; everything else agrees to float64 rounding
        assert torch.allclose(g, r, rtol=1e-5, atol=1e-5), (name, (g - r).abs().max())


@pytest.mark.parametrize("tile_m", [64, 128])
def test_fused_backward_glue_at_the_routing_heights_passes_the_tuners_check(tile_m):
    """The glue at the backward's tile heights (gemm_limits.BWD_TILE_MS: most rows padding here),
    biases included, judged by the tuner's fp32 check (harness/backward.py check_backward), and a
    wrong gradient failing it."""
    from types import SimpleNamespace

    from moe_aot.harness.backward import check_backward
    from moe_aot.integrations.autograd import preact_torch

    gen = torch.Generator().manual_seed(tile_m)
    M, f64 = 12, dict(dtype=torch.float64)
    x = torch.randn(M, H, generator=gen, **f64)
    w13 = torch.randn(E, 2 * I, H, generator=gen, **f64) * (3.0 / H ** 0.5)
    w2 = torch.randn(E, H, I, generator=gen, **f64) / I ** 0.5
    tw = torch.rand(M, K, generator=gen, **f64)
    ids = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(M)]).to(torch.int32)
    b13, b2 = torch.randn(E, 2 * I, generator=gen, **f64), torch.randn(E, H, generator=gen, **f64)
    grad = torch.randn(M, H, generator=gen, **f64)
    kern = _Emulated(tile_m=tile_m, dh_tile_n=16, activation="swigluoai")
    got = moe_backward_fused(kern, grad, x, w13, w2, tw, ids, "swigluoai", b13, b2, preact_torch(x, w13, ids, b13))
    spec = SimpleNamespace(activation="swigluoai")  # all check_backward reads of the layer (E, H, I too small)
    errs = check_backward(spec, got, x, w13, w2, tw, ids, grad, b13, b2)
    assert errs.pop("ok") and max(errs.values()) < 1e-6, errs
    got[4][1, 3] += 0.1 * got[4][1].norm()  # one expert's bias gradient off
    assert not check_backward(spec, got, x, w13, w2, tw, ids, grad, b13, b2)["ok"]


def test_backward_kernels_name_every_argument_and_pick_tiles_that_divide():
    spec = make_spec("qwen3-30b-a3b", target="sm_90a")
    kvs = backward_kernels(spec)
    assert [kv.role for kv in kvs] == ["glu_bwd", "routing", "dh", "dx", "combine"]
    dh, dx = kvs[2].kwargs(), kvs[3].kwargs()
    assert dh["tile_m"] == dx["tile_m"] == kvs[1].kwargs()["tile_m"]  # dX reads dH's padded rows
    assert (dh["tile_n"], dh["mma"]) == (128, "hoppp") and (dx["tile_n"], dx["mma"]) == (256, "hopws")
    # gpt-oss: I = H = 2880, no 128- or 256-wide tile divides it; 192 does (cooperative: a
    # ping-pong warpgroup holds 128 rows of at most 128 columns)
    dh_t, dx_t = backward_gemm_tiles(make_spec("gpt-oss-120b", target="sm_90a"))
    assert (dh_t.tile_n, dh_t.mma) == (dx_t.tile_n, dx_t.mma) == (192, "hopws")
    others = [dataclasses.replace(spec, intermediate=1024), dataclasses.replace(spec, activation="geglu"),
              dataclasses.replace(spec, hidden=1024)]
    names = {kv.name for s in [spec, *others] for kv in backward_kernels(s) if kv.role in ("dh", "dx")}
    assert len(names) == 8 - 1  # geglu changes dH's name only
    # no Hopper core, or not bf16: the GLU kernel alone, or nothing
    assert [kv.role for kv in backward_kernels(make_spec("qwen3-30b-a3b", target="sm_100a"))] == ["glu_bwd"]
    assert backward_gemm_tiles(make_spec("qwen3-30b-a3b", target="sm_90a", precision="fp8")) is None


def test_backward_gemm_limits_refuse_in_one_sentence():
    from moe_aot import gemm_limits as limits

    ok, why = limits.check_backward_gemm(768, 2048, 128, 96, 64, 4, "hopws")
    assert not ok and "multiple of 64" in why
    ok, why = limits.check_backward_gemm(768, 2048, 128, 128, 64, 4, "warp")
    assert not ok and "hopws" in why
    ok, why = limits.check_backward_gemm(768, 2048, 128, 128, 64, 4, "hopws", "sm_100a")
    assert not ok and "sm_90a" in why
    assert limits.check_backward_gemm(768, 2048, 128, 256, 64, 4, "hopws", "sm_90a")[0]


@pytest.mark.parametrize("activation, tile_m", [("swiglu", 128), ("swigluoai", 128), ("swiglu", 64)])
def test_backward_gemms_compile_to_transposed_b_wgmma_without_local_memory(activation, tile_m, tmp_path):
    """dH and dX for sm_90a at both routing heights: wgmma with B read N-major (HGMMA ... tnspB),
    4 per 64-deep k-tile, no local memory; the constructors refuse what the limits refuse."""
    pytest.importorskip("cutlass.cute")
    from moe_aot_templates.hopper_bwd import HopperDhGemm, HopperDxGemm
    from sass_tools import sass_of

    from moe_aot.kernel_build import compile_kernel

    for name, obj in (("dh", HopperDhGemm(16, 512, 256, 4, activation, tile_m=tile_m, tile_n=128)),
                      ("dx", HopperDxGemm(16, 512, 256, 4, tile_m=tile_m, tile_n=128))):
        art = compile_kernel(obj, "sm_90a", f"t_{name}")
        mmas = [ln for ln in art.ptx.splitlines() if "wgmma.mma_async" in ln]
        # the last two immediates: A not transposed (K-major), B transposed (N-major)
        assert len(mmas) == 4 and all(re.search(r"p, 1,\s*1, 0, 1;$", ln.strip()) for ln in mmas), name
        assert "ld.local" not in art.ptx and "st.local" not in art.ptx, name
        sass = sass_of(art.cubin, tmp_path / f"{name}.cubin")
        if sass is not None:  # cuobjdump installed: ptxas kept them and spilled nothing
            hgmma = [ln for ln in sass.splitlines() if "HGMMA." in ln]
            assert len(hgmma) == 4 and all(".tnspB" in ln for ln in hgmma), name
            assert "STL" not in sass and "LDL" not in sass, name
    with pytest.raises(ValueError, match="multiple of 64"):
        HopperDhGemm(16, 512, 256, 4, activation, tile_n=96)
    with pytest.raises(ValueError, match="hopws"):
        HopperDxGemm(16, 512, 256, 4, mma="wgmma")


def test_build_backward_compiles_the_data_path(tmp_path):
    from click.testing import CliRunner

    from moe_aot.cli import main
    from moe_aot.compiler import toolchain_key
    from moe_aot.database import Database

    pytest.importorskip("cutlass.cute")
    spec_file = tmp_path / "tiny.toml"
    spec_file.write_text("[[layer]]\nexperts = 8\ntop_k = 2\nhidden = 512\nintermediate = 256\n")
    db = f"sqlite:///{tmp_path / 'b.sqlite'}"
    res = CliRunner().invoke(main, ["build", "--spec", str(spec_file), "--tokens", "16", "--db", db, "-j", "2",
                                    "--backward"])
    assert res.exit_code == 0, res.output
    spec = make_spec(experts=8, top_k=2, hidden=512, intermediate=256, target="sm_90a")
    with Database(db, readonly=True) as d:
        for kv in backward_kernels(spec):
            assert d.has_artifact(kv.name, toolchain_key("sm_90a")), kv.name
    assert GemmTiles(128, 64, 5, "hoppp") == backward_gemm_tiles(spec)[0]
