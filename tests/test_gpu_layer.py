"""GPU tests: kernels compiled on a CPU machine, loaded by the runtime from the database (no DSL
needed here), against the fp32 PyTorch reference. Skipped without a GPU or without compiled
kernels (set MOE_AOT_DB; tools/gpu_run.py does the whole run)."""
from __future__ import annotations

import dataclasses
import os

import pytest

torch = pytest.importorskip("torch")

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("no CUDA GPU visible", allow_module_level=True)

from moe_aot.harness.reference import rel_err  # noqa: E402
from moe_aot.harness.verify import (  # noqa: E402
    TOLERANCE,
    check_stages,
    layer_reference,
    random_routing,
    random_weights,
)
from moe_aot.runtime.layer import MoeLayer, moe_forward  # noqa: E402
from moe_aot.runtime.library import KernelArgumentError  # noqa: E402
from moe_aot.runtime.store import KernelMissingError  # noqa: E402
from moe_aot.spec import PRESETS, make_spec  # noqa: E402
from moe_aot.variants import default_variant  # noqa: E402

MODELS = os.environ.get("MOE_AOT_TEST_MODELS", ",".join(PRESETS)).split(",")


@pytest.fixture(scope="module", params=MODELS)
def layer_and_weights(request, store):
    spec = make_spec(request.param, target="sm_90a")
    layer = MoeLayer(spec, store)
    w13, w2 = random_weights(spec, layer.device)
    return layer, w13, w2


@pytest.mark.parametrize("tokens", [1, 16, 256, 4096])
@pytest.mark.parametrize("routing", ["uniform", "skewed", "half_experts_empty"])
def test_stages_match_reference(layer_and_weights, tokens, routing):
    layer, w13, w2 = layer_and_weights
    spec = layer.spec
    x = torch.randn(tokens, spec.hidden, device=layer.device, dtype=torch.bfloat16)
    tw, ids = random_routing(tokens, spec, layer.device, skew=routing == "skewed",
                             only_even=routing == "half_experts_empty")
    if routing == "half_experts_empty":
        assert not (ids % 2).any()
    rows = check_stages(layer, x, w13, w2, tw, ids)
    bad = [row for row in rows if not row["ok"]]
    assert not bad, f"{spec.label()} tokens={tokens} {routing}: {bad}"


@pytest.mark.parametrize("tokens", [1, 64, 1024, 4096, 16384])
def test_default_variants_match_reference(layer_and_weights, tokens):
    """The documented default of each bucket (what a GPU without tuned picks runs; at >64 rows
    per expert the persistent TMA core "hopws"), whole output and every row, two routings."""
    layer, w13, w2 = layer_and_weights
    spec = layer.spec
    dl = MoeLayer(spec, layer.store, device=layer.device.index,
                  variants={tokens: default_variant(spec, tokens)})
    for routing in ("uniform", "skewed"):
        x = torch.randn(tokens, spec.hidden, device=layer.device, dtype=torch.bfloat16)
        tw, ids = random_routing(tokens, spec, layer.device, skew=routing == "skewed")
        bad = [row for row in check_stages(dl, x, w13, w2, tw, ids) if not row["ok"]]
        assert not bad, f"{spec.label()} tokens={tokens} {routing}: {bad}"


def test_invalid_ids_are_dropped(store):
    spec = make_spec(MODELS[0], target="sm_90a")
    layer = MoeLayer(spec, store)
    w13, w2 = random_weights(spec, layer.device)
    x = torch.randn(64, spec.hidden, device=layer.device, dtype=torch.bfloat16)
    tw, ids = random_routing(64, spec, layer.device)
    ids[::3, 0] = spec.experts + 5
    ids[1::5, -1] = -7
    out = layer.forward(x, w13, w2, tw, ids)
    e = rel_err(out, layer_reference(spec, x, w13, w2, tw, ids))
    assert e <= TOLERANCE, e


def test_cuda_graph_replay_with_new_inputs(store):
    spec = make_spec(MODELS[0], target="sm_90a")
    dev = torch.device("cuda")
    w13, w2 = random_weights(spec, dev)
    M = 96
    x = torch.randn(M, spec.hidden, device=dev, dtype=torch.bfloat16)
    tw, ids = random_routing(M, spec, dev)
    out = torch.empty(M, spec.hidden, device=dev, dtype=torch.bfloat16)
    moe_forward(x, w13, w2, tw, ids, out=out, store=store)  # warm: loads kernels, allocates workspace
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        moe_forward(x, w13, w2, tw, ids, out=out, store=store)
    for _ in range(3):
        x.copy_(torch.randn_like(x))
        tw2, ids2 = random_routing(M, spec, dev)
        tw.copy_(tw2)
        ids.copy_(ids2)
        out.fill_(float("nan"))
        g.replay()
        torch.cuda.synchronize()
        e = rel_err(out, layer_reference(spec, x, w13, w2, tw, ids))
        assert e <= TOLERANCE, e


def test_bad_inputs_are_refused(store):
    spec = make_spec(MODELS[0], target="sm_90a")
    layer = MoeLayer(spec, store)
    dev = layer.device
    w13, w2 = random_weights(spec, dev)
    x = torch.randn(8, spec.hidden, device=dev, dtype=torch.bfloat16)
    tw, ids = random_routing(8, spec, dev)
    with pytest.raises(KernelArgumentError, match="dtype|must be torch.bfloat16"):
        layer.forward(x.float(), w13, w2, tw, ids)
    with pytest.raises(KernelArgumentError, match="shape"):
        layer.forward(x[:, :-64].contiguous(), w13, w2, tw, ids)
    with pytest.raises(KernelArgumentError, match="contiguous"):
        layer.forward(x.t().contiguous().t(), w13, w2, tw, ids)
    with pytest.raises(KernelArgumentError, match="on cuda"):
        layer.forward(x.cpu(), w13, w2, tw, ids)
    with pytest.raises(KernelArgumentError, match="topk_ids"):
        layer.forward(x, w13, w2, tw, ids.long())
    with pytest.raises(KernelArgumentError, match="aligned"):
        buf = torch.empty(8 * spec.hidden + 1, device=dev, dtype=torch.bfloat16)
        layer.forward(buf[1:].view(8, spec.hidden), w13, w2, tw, ids)


def test_repeated_eager_calls_with_new_buffers(store):
    """After the first call at a size, forward only swaps data pointers: new tensors each call."""
    spec = make_spec(MODELS[0], target="sm_90a")
    layer = MoeLayer(spec, store)
    w13, w2 = random_weights(spec, layer.device)
    for _ in range(3):
        x = torch.randn(33, spec.hidden, device=layer.device, dtype=torch.bfloat16)
        tw, ids = random_routing(33, spec, layer.device)
        out = torch.full((33, spec.hidden), float("nan"), device=layer.device, dtype=torch.bfloat16)
        layer.forward(x, w13, w2, tw, ids, out=out)
        e = rel_err(out, layer_reference(spec, x, w13, w2, tw, ids))
        assert e <= TOLERANCE, e


@pytest.mark.parametrize("tokens", [16, 1024])
def test_repeated_eager_calls_on_the_same_buffers_replay_a_graph(store, tokens):
    """The same buffers with new contents every call: from the second call the launcher replays a
    CUDA graph of the four launches, and each result is the reference of that call's contents and
    what direct launches give (MOE_AOT_EAGER_GRAPHS=0, in a layer of its own)."""
    import moe_aot.runtime.launch as launch

    spec = make_spec(MODELS[0], target="sm_90a")
    layer = MoeLayer(spec, store)
    w13, w2 = random_weights(spec, layer.device)
    x = torch.empty(tokens, spec.hidden, device=layer.device, dtype=torch.bfloat16)
    tw, ids = random_routing(tokens, spec, layer.device)
    out = torch.empty(tokens, spec.hidden, device=layer.device, dtype=torch.bfloat16)
    launch.native_launcher(store.unpack_dir)  # compiled now, not in the background
    results = []
    for i in range(5):
        x.copy_(torch.randn_like(x))
        t2, i2 = random_routing(tokens, spec, layer.device)
        tw.copy_(t2)
        ids.copy_(i2)
        out.fill_(float("nan"))
        layer.forward(x, w13, w2, tw, ids, out=out)
        e = rel_err(out, layer_reference(spec, x, w13, w2, tw, ids))
        assert e <= TOLERANCE, (i, e)
        results.append((x.clone(), tw.clone(), ids.clone(), out.clone()))
    plan = layer._last
    assert plan.native and plan.graphs == 1, plan.graphs
    os.environ["MOE_AOT_EAGER_GRAPHS"] = "0"
    try:
        direct = MoeLayer(spec, store)
        for xi, twi, idi, oi in results:
            d = direct.forward(xi, w13, w2, twi, idi)
            assert direct._last.graphs == -1
            assert rel_err(d, oi) <= 1e-3
    finally:
        del os.environ["MOE_AOT_EAGER_GRAPHS"]


@pytest.mark.parametrize("tokens", [1, 256, 4096])
def test_pdl_twin_in_a_graph_back_to_back(layer_and_weights, tokens):
    """The programmatic-dependent-launch twin of the bucket's variant (`moe-aot build
    --pdl-twins`): two layers captured back to back in one graph (the second reads the first's
    output, so a kernel that ran ahead of its wait would read stale data), replayed with new
    values in the same buffers, each output against the reference."""
    layer, w13, w2 = layer_and_weights
    spec = layer.spec
    v = dataclasses.replace(layer.variant_for(tokens), pdl=True)
    pdl_layer = MoeLayer(spec, layer.store, device=layer.device.index, variants={tokens: v})
    try:
        pdl_layer.kernels(tokens)
    except KernelMissingError as exc:
        pytest.skip(f"PDL twins not in the database (build with --pdl-twins): {exc}")
    dev = layer.device
    x = torch.randn(tokens, spec.hidden, device=dev, dtype=torch.bfloat16)
    tw, ids = random_routing(tokens, spec, dev)
    tw2, ids2 = random_routing(tokens, spec, dev)
    mid = torch.empty(tokens, spec.hidden, device=dev, dtype=torch.bfloat16)
    out = torch.empty_like(mid)
    ws = pdl_layer.workspace(tokens)

    def two_layers():
        pdl_layer.forward(x, w13, w2, tw, ids, out=mid, workspace=ws)
        pdl_layer.forward(mid, w13, w2, tw2, ids2, out=out, workspace=ws)

    two_layers()  # eager first: loads kernels, plans the launches
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        two_layers()
    for _ in range(3):
        x.copy_(torch.randn_like(x))
        for weights, chosen in ((tw, ids), (tw2, ids2)):
            new_w, new_ids = random_routing(tokens, spec, dev)
            weights.copy_(new_w)
            chosen.copy_(new_ids)
        mid.fill_(float("nan"))
        out.fill_(float("nan"))
        g.replay()
        torch.cuda.synchronize()
        ref_mid = layer_reference(spec, x, w13, w2, tw, ids)
        assert rel_err(mid, ref_mid) <= TOLERANCE
        # the second layer against the reference on the first layer's actual (bf16) output
        e = rel_err(out, layer_reference(spec, mid, w13, w2, tw2, ids2))
        assert e <= TOLERANCE, e


def test_gpu_measurer_measures_the_default_on_this_gpu(store):
    """The tuner's measuring half with real CUDA: the default at 16 tokens, checked against the
    reference and timed, with this machine's GPU and a parsed driver version in its key."""
    import re

    from moe_aot import env
    from moe_aot.measure_worker import GpuMeasurer
    from moe_aot.variants import default_variant

    spec = make_spec(MODELS[0], target="sm_90a")
    m = GpuMeasurer(env.default_db_url(), replays=20)
    assert m.gpu == torch.cuda.get_device_name()
    # the driver, and the timing method: each candidate timed after SUSTAINED_WARMUP_S of replays
    assert re.match(r"^\d+\.\d+(\.\d+)? \(CUDA \d+\.\d+\); sustained 0\.5 s$", m.driver), m.driver
    out = m(spec, default_variant(spec, 16), 16)
    assert out.status == "ok", out.error
    assert out.median_us > 0 and out.rel_err < TOLERANCE
    assert out.stats["warmup_s"] == 0.5
    state = out.stats["gpu_state"]  # NVML's readings of the timed replays (the driver ships libnvidia-ml)
    assert 100 <= state["sm_mhz"] <= 3000 and state["window_s"] > 0 and isinstance(state["reasons"], list)


@pytest.mark.parametrize("tokens", [1, 256, 4096])
def test_gpt_oss_clamps_and_biases(store, tokens):
    """gpt-oss's layer (clamped SwiGLU, expert biases in both GEMMs) with weights six times the
    usual scale, so that both clamps engage on many gate/up sums: every stage against the fp32
    reference (GEMM1's padding rows zero despite the biases), the bucket's variant and its default."""
    if "gpt-oss-120b" not in MODELS:
        pytest.skip("gpt-oss-120b not among MOE_AOT_TEST_MODELS")
    from moe_aot.layout import split_gate_up

    spec = make_spec("gpt-oss-120b", target="sm_90a")
    layer = MoeLayer(spec, store)
    (w13, b13), (w2, b2) = random_weights(spec, layer.device, scale=6.0)
    x = torch.randn(tokens, spec.hidden, device=layer.device, dtype=torch.bfloat16)
    tw, ids = random_routing(tokens, spec, layer.device)
    e = int(ids[0, 0])
    gate, up = (w[0].float() for w in split_gate_up(w13[e:e + 1]))
    g = x[:1].float() @ gate.t()
    u = x[:1].float() @ up.t()
    assert (g > 7).float().mean() > 0.05 and (u.abs() > 7).float().mean() > 0.05  # both clamps bite
    for lay in (layer, MoeLayer(spec, store, device=layer.device.index,
                                variants={tokens: default_variant(spec, tokens)})):
        bad = [row for row in check_stages(lay, x, (w13, b13), (w2, b2), tw, ids) if not row["ok"]]
        assert not bad, f"gpt-oss tokens={tokens}: {bad}"
