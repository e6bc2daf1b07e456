"""CPU tests of the routing and combine templates: they compile for the targets, refuse with
reasons, and the pure-torch references agree with a plain-Python reading of the semantics.

Numerics on the GPU: tools/check_routing_kernels.py (compile here, run there).
"""
import importlib.util
import random
import re
from pathlib import Path

import pytest

cute = pytest.importorskip("cutlass.cute")
torch = pytest.importorskip("torch")

from moe_aot_templates.routing import MoeCombine, MoeRouting, MoeRoutingQuant  # noqa: E402

_CHECK = Path(__file__).resolve().parents[1] / "tools" / "check_routing_kernels.py"
_spec = importlib.util.spec_from_file_location("check_routing_kernels", _CHECK)
check = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(check)


def _compile(obj, arch):
    named = obj.fake_arguments()
    assert named[-1][0] == "stream"
    return cute.compile(obj, *[f for _, f in named], options=f"--gpu-arch {arch}")


@pytest.mark.parametrize("arch", ["sm_90a", "sm_121a"])
@pytest.mark.parametrize("e,k,tm,cluster", [(128, 8, 64, 1), (256, 8, 128, 8), (8, 2, 128, 1)])
def test_routing_compiles(arch, e, k, tm, cluster):
    obj = MoeRouting(e, k, tm, cluster_size=cluster)
    assert obj.can_implement(arch) == (True, "")
    assert [n for n, _ in obj.fake_arguments()] == [
        "topk_ids", "expert_counts", "expert_offsets", "sorted_ids", "tile_expert", "stream"]
    assert _compile(obj, arch) is not None


def test_routing_cluster16_compiles_for_hopper():
    obj = MoeRouting(256, 8, 128, cluster_size=16)
    assert obj.can_implement("sm_90a")[0]
    assert _compile(obj, "sm_90a") is not None


@pytest.mark.parametrize("arch,cluster", [("sm_90a", 1), ("sm_90a", 16), ("sm_121a", 1)])
@pytest.mark.parametrize("precision", ["fp8", "fp8-block128"])
def test_routing_that_quantizes_x_compiles(arch, cluster, precision, tmp_path):
    """The fp8 layers' routing launch: the routing's arguments then x, xq, xs; its quant CTAs
    read x by 16-byte loads, write e4m3 by cvt, and reduce a token's amax (fp8) through one named
    barrier per 128-thread group (bar.sync 1..8 of 128 threads; never the whole CTA's)."""
    obj = MoeRoutingQuant(256, 8, 128, quant=(7168, precision), cluster_size=cluster, pdl=True)
    assert obj.can_implement(arch) == (True, "")
    assert [n for n, _ in obj.fake_arguments()] == [
        "topk_ids", "expert_counts", "expert_offsets", "sorted_ids", "tile_expert", "x", "xq", "xs", "stream"]
    ptx = cute.compile(obj, *[f for _, f in obj.fake_arguments()],
                       options=f"--gpu-arch {arch} --keep-ptx --dump-dir {tmp_path}").__ptx__
    assert "ld.global.v4" in ptx and "cvt.rn.satfinite.e4m3x2.f32" in ptx
    assert "griddepcontrol.launch_dependents" in ptx and "griddepcontrol.wait" not in ptx
    named = re.findall(r"bar\.sync\s+(%r\d+),\s*128;", ptx)  # the group's id, a register
    assert (len(named) == 2) == (precision == "fp8") and (len(named) == 0) == (precision != "fp8"), named


@pytest.mark.parametrize("kwargs,word", [
    (dict(quant=(7168, "bf16")), "precision"),
    (dict(quant=(2880, "fp8")), "multiple of 128"),
    (dict(quant=(2048, "fp8"), num_threads=96), "num_threads must be a multiple of 128"),
    (dict(quant=(2048,)), "(hidden, precision)"),
])
def test_routing_that_quantizes_x_refusals(kwargs, word):
    ok, why = MoeRoutingQuant(128, 8, 64, **kwargs).can_implement()
    assert not ok and word in why, why


@pytest.mark.parametrize("arch", ["sm_90a", "sm_121a"])
@pytest.mark.parametrize("e,h,k", [(128, 2048, 8), (128, 2880, 4), (8, 4096, 2)])
def test_combine_compiles(arch, e, h, k):
    obj = MoeCombine(e, h, k)
    assert obj.can_implement() == (True, "")
    assert [n for n, _ in obj.fake_arguments()] == ["y", "topk_ids", "out", "stream"]
    assert _compile(obj, arch) is not None


@pytest.mark.parametrize("kwargs,word", [
    (dict(num_experts=0, top_k=8, tile_m=128), "num_experts"),
    (dict(num_experts=128, top_k=0, tile_m=128), "top_k"),
    (dict(num_experts=128, top_k=8, tile_m=96), "tile_m"),
    (dict(num_experts=128, top_k=8, tile_m=2048), "tile_m"),
    (dict(num_experts=128, top_k=8, tile_m=64, num_threads=100), "num_threads"),
    (dict(num_experts=128, top_k=8, tile_m=64, unroll=0), "unroll"),
    (dict(num_experts=128, top_k=8, tile_m=64, cluster_size=3), "cluster_size"),
    (dict(num_experts=1024, top_k=8, tile_m=64), "shared memory"),
])
def test_routing_refusals(kwargs, word):
    ok, why = MoeRouting(**kwargs).can_implement()
    assert not ok and word in why


def test_routing_cluster16_refused_off_hopper():
    ok, why = MoeRouting(128, 8, 64, cluster_size=16).can_implement("sm_121a")
    assert not ok and "non-portable" in why


def test_routing_largest_accepted_experts():
    assert MoeRouting(512, 8, 128).can_implement() == (True, "")
    assert MoeRouting(1024, 8, 128, num_threads=256).can_implement() == (True, "")


@pytest.mark.parametrize("kwargs,word", [
    (dict(num_experts=0, hidden=2048, top_k=8), "num_experts"),
    (dict(num_experts=128, hidden=2049, top_k=8), "hidden"),
    (dict(num_experts=128, hidden=4, top_k=8), "hidden"),
    (dict(num_experts=128, hidden=2048, top_k=0), "top_k"),
    (dict(num_experts=128, hidden=2048, top_k=8, num_threads=48), "num_threads"),
])
def test_combine_refusals(kwargs, word):
    ok, why = MoeCombine(**kwargs).can_implement()
    assert not ok and word in why


def _naive_routing(ids, e_count, tm, t_count, r_count):
    flat = ids.reshape(-1).tolist()
    counts = [0] * e_count
    for v in flat:
        if 0 <= v < e_count:
            counts[v] += 1
    off = [0]
    for e in range(e_count):
        off.append(off[-1] + -(-counts[e] // tm) * tm)
    rows, fill = [-1] * r_count, off[:-1].copy()
    for p, v in enumerate(flat):
        if 0 <= v < e_count:
            rows[fill[v]] = p
            fill[v] += 1
    tiles = [-1] * t_count
    for e in range(e_count):
        for t in range(off[e] // tm, off[e + 1] // tm):
            tiles[t] = e
    return counts, off, rows, tiles


def test_routing_reference_matches_plain_python():
    rng = random.Random(0)
    for _ in range(100):
        e, k, tm, m = rng.choice([1, 3, 8, 128]), rng.choice([1, 2, 8]), rng.choice([1, 4, 64]), \
            rng.choice([0, 1, 2, 5, 40])
        ids = torch.randint(-2, e + 2, (m, k), dtype=torch.int32)
        t, r = check.routing_sizes(m, e, k, tm)
        got = check.routing_reference(ids, e, tm, t, r)
        want = _naive_routing(ids, e, tm, t, r)
        assert [g.tolist() for g in got] == list(want)
        assert want[1][-1] <= r  # the worst-case sizes hold every padded segment


def test_combine_reference_skips_invalid_pairs():
    ids = torch.tensor([[0, 5], [-1, 9]], dtype=torch.int32)  # E=8: -1 and 9 are dropped
    nan = float("nan")
    y = torch.tensor([[1.0, 2.0], [3.0, 4.0], [nan, nan], [nan, nan]])
    assert check.combine_reference(y, ids, 8).tolist() == [[4.0, 6.0], [0.0, 0.0]]


@pytest.mark.parametrize("cluster", [1, 16])
def test_pdl_routing_signals_and_combine_waits(cluster, tmp_path):
    """pdl=True: the routing kernel (the layer's first, launched normally) lets its dependent
    launch at once and never waits; the combine waits for GEMM2's grid before it reads y."""
    def ptx(obj):
        body = cute.compile(obj, *[f for _, f in obj.fake_arguments()],
                            options=f"--gpu-arch sm_90a --keep-ptx --dump-dir {tmp_path}").__ptx__
        return body[body.index(".entry"):]

    route = ptx(MoeRouting(num_experts=128, top_k=8, tile_m=64, cluster_size=cluster, pdl=True))
    assert "griddepcontrol.launch_dependents" in route and "griddepcontrol.wait" not in route
    assert "griddepcontrol" not in ptx(MoeRouting(num_experts=128, top_k=8, tile_m=64, cluster_size=cluster))
    comb = ptx(MoeCombine(num_experts=128, hidden=2048, top_k=8, pdl=True))
    wait = comb.index("griddepcontrol.wait")
    assert "ld.global" not in comb[:wait] and "ld.global" in comb[wait:]
    assert "griddepcontrol" not in ptx(MoeCombine(num_experts=128, hidden=2048, top_k=8))
