"""GPU tests of the backward's weight-gradient GEMMs (templates/hopper_wgrad.py through
moe_aot.runtime.wgrad, no DSL): every expert of dW13 and dW2 against an fp32 torch reference on
fresh random operands and routings (experts with no rows included), outputs poisoned with NaN,
bitwise repeatable. Skipped without a GPU or without the kernels (`moe-aot build --backward`, or
`tools/check_wgrad.py --compile DIR` and MOE_AOT_DB=sqlite:///DIR/wgrad.sqlite)."""
from __future__ import annotations

import os

import pytest

torch = pytest.importorskip("torch")

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("no CUDA GPU visible", allow_module_level=True)

from moe_aot.harness.reference import routing_reference  # noqa: E402
from moe_aot.runtime.wgrad import weight_gradients, wgrad_kernels_for  # noqa: E402
from moe_aot.spec import PRESETS, make_spec  # noqa: E402

MODELS = os.environ.get("MOE_AOT_TEST_MODELS", ",".join(PRESETS)).split(",")
DEV = torch.device("cuda")
TOL = 1e-2


def _routing(tokens, spec, kind, gen):
    E, K = spec.experts, spec.top_k
    scores = torch.rand(tokens, E, device=DEV, generator=gen)
    if kind == "skew":  # a few experts take most rows, many take none
        scores += torch.linspace(2.0, 0.0, E, device=DEV) ** 4
    elif kind == "even":  # the odd experts get no rows at all
        scores[:, 1::2] = -1.0
    return torch.topk(scores, K, dim=1).indices.to(torch.int32)


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("tokens, tile_m, kind", [(1, 64, "random"), (1000, 128, "skew"), (4096, 64, "even")])
def test_weight_gradients_match_fp32_every_expert(store, model, tokens, tile_m, kind):
    spec = make_spec(model, target="sm_90a")
    E, K, H, I = spec.experts, spec.top_k, spec.hidden, spec.intermediate
    kernels = wgrad_kernels_for(E, K, H, I, DEV, store)
    if kernels is None:
        pytest.skip(f"no weight-gradient kernels for {model} in the database (moe-aot build --backward)")
    gen = torch.Generator(device=DEV).manual_seed(tokens * 7 + tile_m)
    ids = _routing(tokens, spec, kind, gen)
    counts, offsets, sorted_ids, _ = routing_reference(ids, E, tile_m)
    R = sorted_ids.numel()
    live = (sorted_ids >= 0).unsqueeze(1)
    da = torch.where(live, torch.randn(R, 2 * I, device=DEV, generator=gen), 0.0).bfloat16()
    hw = torch.where(live, torch.randn(R, I, device=DEV, generator=gen), 0.0).bfloat16()
    x = torch.randn(tokens, H, device=DEV, generator=gen).bfloat16()
    d_out = torch.randn(tokens, H, device=DEV, generator=gen).bfloat16()
    dw13 = torch.full((E, 2 * I, H), float("nan"), dtype=torch.bfloat16, device=DEV)
    dw2 = torch.full((E, H, I), float("nan"), dtype=torch.bfloat16, device=DEV)
    weight_gradients(da, x, d_out, hw, sorted_ids, offsets, counts, K, tile_m, kernels, dw13, dw2)
    torch.cuda.synchronize()
    if kind == "even" or tokens == 1:  # experts without rows: a tile of zeros each
        assert (counts == 0).any()
    ids_l, offs = sorted_ids.long(), offsets.tolist()
    tok = torch.where(ids_l >= 0, ids_l // K, 0)
    worst = 0.0
    for e in range(E):  # every expert; the fp32 reference one expert at a time (DeepSeek-V3's: 45 GB whole)
        lo, hi = offs[e], offs[e + 1]
        if hi == lo:
            assert not dw13[e].any() and not dw2[e].any(), e  # zeros (NaN is nonzero)
            continue
        xs = torch.where(live[lo:hi], x.index_select(0, tok[lo:hi]).float(), 0.0)
        ds = torch.where(live[lo:hi], d_out.index_select(0, tok[lo:hi]).float(), 0.0)
        for got, ref, name in ((dw13[e], da[lo:hi].float().t() @ xs, "dW13"),
                               (dw2[e], ds.t() @ hw[lo:hi].float(), "dW2")):
            assert not torch.isnan(got).any(), (name, e)
            err = ((got.float() - ref).norm() / ref.norm()).item()
            worst = max(worst, err)
            assert err <= TOL, (name, e, err)
    again13, again2 = torch.full_like(dw13, float("nan")), torch.full_like(dw2, float("nan"))
    weight_gradients(da, x, d_out, hw, sorted_ids, offsets, counts, K, tile_m, kernels, again13, again2)
    assert torch.equal(again13, dw13) and torch.equal(again2, dw2)  # bitwise repeatable
    print(f"{model} {tokens} tokens tile_m {tile_m} {kind}: worst expert rel err {worst:.2e}")


def test_weight_gradients_in_a_cuda_graph(store):
    """No host sync: the two launches capture in a CUDA graph and replay on new routing and values."""
    spec = make_spec(MODELS[0], target="sm_90a")
    E, K, H, I = spec.experts, spec.top_k, spec.hidden, spec.intermediate
    kernels = wgrad_kernels_for(E, K, H, I, DEV, store)
    if kernels is None:
        pytest.skip(f"no weight-gradient kernels for {spec.label()}")
    gen = torch.Generator(device=DEV).manual_seed(5)
    tokens, tile_m = 256, 128

    def fresh():
        ids = _routing(tokens, spec, "random", gen)
        counts, offsets, sorted_ids, _ = routing_reference(ids, E, tile_m)
        live = (sorted_ids >= 0).unsqueeze(1)
        R = sorted_ids.numel()
        return (torch.where(live, torch.randn(R, 2 * I, device=DEV, generator=gen), 0.0).bfloat16(),
                torch.randn(tokens, H, device=DEV, generator=gen).bfloat16(),
                torch.randn(tokens, H, device=DEV, generator=gen).bfloat16(),
                torch.where(live, torch.randn(R, I, device=DEV, generator=gen), 0.0).bfloat16(), sorted_ids, offsets,
                counts)

    bufs = fresh()
    out = (torch.empty(E, 2 * I, H, dtype=torch.bfloat16, device=DEV),
           torch.empty(E, H, I, dtype=torch.bfloat16, device=DEV))
    weight_gradients(*bufs, K, tile_m, kernels, *out)  # warm-up outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        weight_gradients(*bufs, K, tile_m, kernels, *out)
    new = fresh()
    if new[4].numel() != bufs[4].numel():
        pytest.skip("the routing's padded size changed")  # max_tiles depends on tokens only: never
    for b, n in zip(bufs, new):
        b.copy_(n)
    out[0].fill_(float("nan"))
    out[1].fill_(float("nan"))
    graph.replay()
    want = weight_gradients(*new, K, tile_m, kernels)
    torch.cuda.synchronize()
    assert torch.equal(out[0], want[0]) and torch.equal(out[1], want[1])
