"""GPU tests of the weight-only MXFP4 layer ("mxfp4-w"): kernels compiled on a CPU machine, loaded
from the database, checked stage by stage (routing exact; GEMM1 + GLU and the whole layer, every
row, outputs NaN-poisoned) against the fp32 reference of exactly the weights they read, dequantized
(moe_aot/harness/w4.py). Skipped without a GPU, without a database, or where the layer's kernels
were not built into it (`python3 tools/check_w4.py --build --db ...`)."""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("no CUDA GPU visible", allow_module_level=True)

from moe_aot.harness import w4 as w4_ref  # noqa: E402
from moe_aot.harness.reference import rel_err, row_rel_err  # noqa: E402
from moe_aot.harness.verify import ROW_TOLERANCE, TOLERANCE, check_stages, random_routing  # noqa: E402
from moe_aot.runtime import w4  # noqa: E402
from moe_aot.runtime.layer import MoeLayer, moe_forward  # noqa: E402
from moe_aot.runtime.library import KernelArgumentError  # noqa: E402
from moe_aot.runtime.store import KernelMissingError  # noqa: E402
from moe_aot.spec import make_spec  # noqa: E402


def _label(fields):
    return fields.get("model") or f"e{fields['experts']}k{fields['top_k']}h{fields['hidden']}i{fields['intermediate']}"


@pytest.fixture(scope="module", params=w4_ref.CHECK_LAYERS, ids=_label)
def layer_and_weights(request, store):
    spec = make_spec(target="sm_90a", **request.param)
    layer = MoeLayer(spec, store)
    try:
        for t in w4_ref.CHECK_TOKENS:
            layer.role_kernels(t)
    except KernelMissingError as exc:
        pytest.skip(f"mxfp4-w kernels of {spec.label()} not in the database: {exc}")
    gen = torch.Generator(device=layer.device).manual_seed(0)
    w13, w2 = w4_ref.random_w4_weights(spec, layer.device, generator=gen)
    yield layer, w13, w2
    del w13, w2
    torch.cuda.empty_cache()


@pytest.mark.parametrize("tokens", w4_ref.CHECK_TOKENS)
@pytest.mark.parametrize("routing", ["uniform", "skewed"])
def test_w4_stages_match_reference(layer_and_weights, tokens, routing):
    layer, w13, w2 = layer_and_weights
    spec = layer.spec
    x = torch.randn(tokens, spec.hidden, device=layer.device, dtype=torch.bfloat16)
    tw, ids = random_routing(tokens, spec, layer.device, skew=routing == "skewed")
    rows = check_stages(layer, x, w13, w2, tw, ids)
    bad = [row for row in rows if not row["ok"]]
    assert not bad, f"{spec.label()} mxfp4-w tokens={tokens} {routing}: {bad}"


def test_w4_gpt_oss_checkpoint_layout_end_to_end(layer_and_weights):
    """Random bytes in gpt-oss's checkpoint layout, imported by w4.from_gpt_oss, through
    moe_forward (precision and biases read off the W4Weights) and a repeated call with new
    pointers (the cached plan), against the reference of the checkpoint's decode."""
    layer, _, _ = layer_and_weights
    s, dev = layer.spec, layer.device
    E, H, I = s.experts, s.hidden, s.intermediate
    gen = torch.Generator(device=dev).manual_seed(1)

    def rand_bytes(*shape, lo=0, hi=256):
        return torch.randint(lo, hi, shape, device=dev, dtype=torch.uint8, generator=gen)

    # scales near 2^-4..2^-2 keep the sums of random e2m1 weights (|w| <= 6) in bf16's comfort zone
    w13, w2 = w4.from_gpt_oss(rand_bytes(E, 2 * I, H // 32, 16), rand_bytes(E, 2 * I, H // 32, lo=121, hi=124),
                              rand_bytes(E, H, I // 32, 16), rand_bytes(E, H, I // 32, lo=119, hi=122),
                              torch.randn(E, 2 * I, device=dev, generator=gen).to(torch.bfloat16),
                              torch.randn(E, H, device=dev, generator=gen).to(torch.bfloat16))
    for tokens in (16, 16, 256):
        x = torch.randn(tokens, H, device=dev, dtype=torch.bfloat16) * 0.1
        tw, ids = random_routing(tokens, s, dev)
        out = torch.full((tokens, H), float("nan"), device=dev, dtype=torch.bfloat16)
        moe_forward(x, w13, w2, tw, ids, out=out, activation=s.activation, store=layer.store)
        ref = w4_ref.moe_w4_reference(x, w13, w2, tw, ids, s.activation)
        e, er = rel_err(out, ref), row_rel_err(out, ref)
        assert e <= TOLERANCE and er <= ROW_TOLERANCE, (tokens, e, er)


def test_w4_refuses_bad_weights(layer_and_weights):
    layer, w13, w2 = layer_and_weights
    s, dev = layer.spec, layer.device
    x = torch.randn(4, s.hidden, device=dev, dtype=torch.bfloat16)
    tw, ids = random_routing(4, s, dev)
    with pytest.raises(KernelArgumentError, match="triple"):
        layer.forward(x, w13[:2], w2, tw, ids)
    with pytest.raises(KernelArgumentError, match="w13 scales must have shape"):
        layer.forward(x, w4.W4Weight(w13.blocks, w13.scales.transpose(1, 2), w13.bias), w2, tw, ids)
    with pytest.raises(KernelArgumentError, match="w2 blocks must be torch.uint8"):
        layer.forward(x, w13, w4.W4Weight(w2.blocks.view(torch.int8), w2.scales, w2.bias), tw, ids)
    with pytest.raises(KernelArgumentError, match="bias must be a tensor"):
        layer.forward(x, w13, w4.W4Weight(w2.blocks, w2.scales, None), tw, ids)
