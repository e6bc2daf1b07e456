"""GPU tests of the one-launch decode kernel served by the runtime (a DecodeVariant pick of the
1-token bucket): against the fp32 reference of what it computes, every row, on a NaN-poisoned
output, in eager calls and CUDA-graph replays with new inputs, with its grid barrier's 64-bit
counter one CTA count further per launch (never reset); two tokens run the bucket's four
kernels. Skipped without a GPU, or per layer where the database lacks its decode kernels
(`moe-aot compile --variant moe_decode_...`, tools/gpu_run.py builds them)."""
from __future__ import annotations

import os

import pytest

torch = pytest.importorskip("torch")

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("no CUDA GPU visible", allow_module_level=True)

from moe_aot.harness.reference import rel_err, row_rel_err  # noqa: E402
from moe_aot.harness.verify import (  # noqa: E402
    ROW_TOLERANCE,
    TOLERANCE,
    random_routing,
    random_weights,
    served_reference,
)
from moe_aot.runtime.layer import MoeLayer  # noqa: E402
from moe_aot.runtime.store import KernelMissingError  # noqa: E402
from moe_aot.spec import PRESETS, SpecError, make_spec  # noqa: E402
from moe_aot.variants import DecodeVariant, decode_candidates, default_variant  # noqa: E402

MODELS = os.environ.get("MOE_AOT_TEST_MODELS", ",".join(PRESETS)).split(",")
CASES = []
for _m in MODELS:
    for _p in ("bf16", "fp8", "fp8-block128"):
        try:
            _s = make_spec(_m, precision=_p, target="sm_90a")
        except SpecError:
            continue
        CASES += [(_m, _p, f"w{v.warps}b{v.seg_bytes}") for v in decode_candidates(_s, 1)]


def _layer(store, model, precision, shape):
    spec = make_spec(model, precision=precision, target="sm_90a")
    [dec] = [v for v in decode_candidates(spec, 1) if f"w{v.warps}b{v.seg_bytes}" == shape]
    layer = MoeLayer(spec, store, variants={1: dec})
    if layer.decode_for(1) is None:
        pytest.skip(f"this GPU has fewer SMs than the decode kernel's {dec.ctas} CTAs")
    try:
        layer._lib(dec.kernels(spec)[0])
    except KernelMissingError as exc:
        pytest.skip(f"decode kernel of {model} {precision} not in the database: {exc}")
    return layer, dec


@pytest.mark.parametrize("model, precision, shape", CASES)
def test_decode_pick_matches_its_reference_eager_and_in_graphs(store, model, precision, shape):
    layer, dec = _layer(store, model, precision, shape)
    spec, dev = layer.spec, layer.device
    w13, w2 = random_weights(spec, dev)
    x = torch.randn(1, spec.hidden, device=dev, dtype=torch.bfloat16)
    tw, ids = random_routing(1, spec, dev)
    out = torch.full((1, spec.hidden), float("nan"), device=dev, dtype=torch.bfloat16)
    assert dec.sync == "grid"
    count = lambda: next(iter(layer._workspace.decode.values()))[1].view(torch.int64).item()  # noqa: E731
    for _ in range(2):  # twice: the barrier words are reused without a reset
        out.fill_(float("nan"))
        layer.forward(x, w13, w2, tw, ids, out=out)
        torch.cuda.synchronize()
        ref = served_reference(layer, x, w13, w2, tw, ids)
        assert rel_err(out, ref) <= TOLERANCE and row_rel_err(out, ref) <= ROW_TOLERANCE
    assert isinstance(layer.served(1), DecodeVariant) and list(layer.launchers(1)) == ["decode"]
    assert count() == 2 * dec.ctas  # zeroed once with the workspace, then ctas arrivals per launch
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        layer.forward(x, w13, w2, tw, ids, out=out)
    for seed in range(3):
        x.copy_(torch.randn_like(x))
        tw2, ids2 = random_routing(1, spec, dev, skew=seed == 1)
        if seed == 2:
            ids2[0, 0] = -1  # an invalid id contributes nothing
        tw.copy_(tw2)
        ids.copy_(ids2)
        out.fill_(float("nan"))
        g.replay()
        torch.cuda.synchronize()
        ref = served_reference(layer, x, w13, w2, tw, ids)
        assert rel_err(out, ref) <= TOLERANCE and row_rel_err(out, ref) <= ROW_TOLERANCE, seed
    assert count() == 5 * dec.ctas


@pytest.mark.parametrize("model, precision, shape", CASES[:2])
def test_two_tokens_of_the_bucket_run_its_default(store, model, precision, shape):
    layer, dec = _layer(store, model, precision, shape)
    spec, dev = layer.spec, layer.device
    assert layer.served(2) == default_variant(spec, 1)
    w13, w2 = random_weights(spec, dev)
    x = torch.randn(2, spec.hidden, device=dev, dtype=torch.bfloat16)
    tw, ids = random_routing(2, spec, dev)
    try:
        out = layer.forward(x, w13, w2, tw, ids)
    except KernelMissingError as exc:
        pytest.skip(f"the bucket's default is not in the database: {exc}")
    ref = served_reference(layer, x, w13, w2, tw, ids)
    assert rel_err(out, ref) <= TOLERANCE and row_rel_err(out, ref) <= ROW_TOLERANCE
