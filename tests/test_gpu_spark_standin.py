"""GPU tests of the DGX Spark layers through their sm_90a stand-in (target "sm_121a-standin",
moe_aot/gemm_limits.STANDINS) on an H100/H200: bf16, fp8 and the block-scaled mxfp8 / nvfp4 / w4a8-mx layers
end to end through MoeLayer.forward against fp32 references of exactly what their kernels
consumed (outputs NaN-poisoned, the quantized x and h poisoned, every row checked), CUDA-graph
replays, moe_forward, and the tuning flow (`tune --compile-only` on the CPU, `measure` here).

The database: `python3 tools/spark_standin.py --build DIR` on a CPU machine with the DSL, then
MOE_AOT_DB=sqlite:///DIR/standin.sqlite. Skipped without a GPU, on a GPU other than sm_90
(the stand-ins are sm_90a builds), without a database, or for layers it does not hold."""
from __future__ import annotations

import sqlite3

import pytest

torch = pytest.importorskip("torch")

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("no CUDA GPU visible", allow_module_level=True)
if torch.cuda.get_device_capability() != (9, 0):
    pytest.skip("the Spark stand-ins are sm_90a builds (H100/H200)", allow_module_level=True)

from moe_aot.gemm_limits import BLOCKSCALED  # noqa: E402
from moe_aot.harness import blockscaled as bsref  # noqa: E402
from moe_aot.harness.verify import check_stages, random_routing, random_weights  # noqa: E402
from moe_aot.runtime.blockscaled import from_gpt_oss, gpt_oss_biases, to_gpt_oss, with_input_amax  # noqa: E402
from moe_aot.runtime.layer import MoeLayer, moe_forward  # noqa: E402
from moe_aot.runtime.store import KernelMissingError  # noqa: E402
from moe_aot.spec import LayerSpec, make_spec  # noqa: E402

STANDIN = "sm_121a-standin"
CASES = [(fields, p, tokens) for fields, precisions, tokens in bsref.STANDIN_CHECKS for p in precisions]


def _label(case):
    fields, p, _ = case
    return f"{fields.get('model') or 'e{experts}k{top_k}h{hidden}i{intermediate}'.format(**fields)}-{p}"


@pytest.fixture(scope="module", params=CASES, ids=_label)
def case(request, store):
    fields, precision, tokens = request.param
    spec = make_spec(**fields, precision=precision, target=STANDIN)
    layer = MoeLayer(spec, store, variants={})
    try:
        for t in tokens:
            layer.role_kernels(t)
    except KernelMissingError as exc:
        pytest.skip(f"stand-in kernels of {spec.label()} {precision} not in the database: {exc}")
    w13, w2 = random_weights(spec, layer.device)
    yield layer, w13, w2, tokens
    del w13, w2
    torch.cuda.empty_cache()


@pytest.mark.parametrize("routing", ["uniform", "skewed"])
def test_standin_layer_matches_reference(case, routing):
    """Routing exact; GEMM1 (and for fp8 / block-scaled layers the quantized x and h) against
    torch on what it read; the layer against the fp32 reference, whole output and every row."""
    layer, w13, w2, tokens = case
    spec = layer.spec
    for t in tokens:
        x = torch.randn(t, spec.hidden, device=layer.device, dtype=torch.bfloat16)
        tw, ids = random_routing(t, spec, layer.device, skew=routing == "skewed")
        rows = check_stages(layer, x, w13, w2, tw, ids)
        bad = [row for row in rows if not row["ok"]]
        assert not bad, f"{spec.label()} {spec.precision} tokens={t} {routing}: {bad}"


def _checked_forward(layer, x, w13, w2, tw, ids):
    """One forward on a poisoned workspace into a NaN-filled output, every stage checked against
    what the kernels consumed (blockscaled.check_forward); returns the output."""
    t = x.shape[0]
    ws = layer.workspace(t)
    bsref.poison(ws)
    out = torch.full((t, layer.spec.hidden), float("nan"), device=layer.device, dtype=torch.bfloat16)
    layer.forward(x, w13, w2, tw, ids, out=out, workspace=ws)
    r = bsref.check_forward(layer, x, w13, w2, tw, ids, out, ws)
    assert r["ok"], r
    return out


def test_block_scaled_forward_replays_from_a_cuda_graph(case):
    layer, w13, w2, tokens = case
    if layer.spec.precision not in BLOCKSCALED:
        pytest.skip("the bf16 and fp8 paths' graphs are tested by tests/test_gpu_layer.py and test_gpu_fp8.py")
    for t in (tokens[0], tokens[-1]):
        r = bsref.graph_replay_check(layer, w13, w2, t)
        assert r["ok"], r


def test_nvfp4_takes_a_calibrated_x_amax_and_saturates_like_the_reference(case):
    """w13.input_amax replaces x's own amax (values beyond it saturate, as in the reference);
    a smaller h amax than h's saturates h alike in the kernel and the reference."""
    layer, w13, w2, tokens = case
    if layer.spec.precision != "nvfp4":
        pytest.skip("nvfp4 only")
    spec, t = layer.spec, tokens[-1]
    x = torch.randn(t, spec.hidden, device=layer.device, dtype=torch.bfloat16)
    tw, ids = random_routing(t, spec, layer.device)
    for a, b in ((with_input_amax(w13, 2.0), w2), (w13, with_input_amax(w2, w2.input_amax * 0.5))):
        _checked_forward(layer, x, a, b, tw, ids)


def test_w4a8_mx_runs_gpt_oss_checkpoint_bytes(case, store):
    """w4a8-mx: the weights in gpt-oss's checkpoint layout (blocks [E, 2I, H/32, 16], gate and up
    rows alternating) through blockscaled.from_gpt_oss give the kernels exactly the prepared
    weights' bytes: every stage passes check_forward, the output equals the forward on the
    prepared weights, and moe_forward reads the precision off them."""
    layer, w13, w2, tokens = case
    if layer.spec.precision != "w4a8-mx":
        pytest.skip("w4a8-mx only")
    spec = layer.spec
    biases = gpt_oss_biases(w13, w2) if spec.bias else ()  # gpt-oss's shape (GPT_OSS_CHECK): with its biases
    a, b = from_gpt_oss(*to_gpt_oss(w13, w2), *biases)
    for t in (tokens[0], tokens[-1]):
        x = torch.randn(t, spec.hidden, device=layer.device, dtype=torch.bfloat16)
        tw, ids = random_routing(t, spec, layer.device, skew=True)
        out = _checked_forward(layer, x, a, b, tw, ids)
        assert torch.equal(out, layer.forward(x, w13, w2, tw, ids))
        if not spec.model:
            assert torch.equal(moe_forward(x, a, b, tw, ids, store=store, target=STANDIN,
                                           activation=spec.activation), out)


def test_moe_forward_runs_the_standin_layer(case, store):
    layer, w13, w2, tokens = case
    if layer.spec.precision not in BLOCKSCALED or layer.spec.model:
        pytest.skip("the small block-scaled layers")
    spec, t = layer.spec, tokens[1]
    x = torch.randn(t, spec.hidden, device=layer.device, dtype=torch.bfloat16)
    tw, ids = random_routing(t, spec, layer.device)
    got = moe_forward(x, w13, w2, tw, ids, store=store, target=STANDIN, activation=spec.activation)
    want = layer.forward(x, w13, w2, tw, ids)
    assert torch.equal(got, want)


def test_tune_measure_flow_on_the_standin(store, tmp_path):
    """`moe-aot measure` of the trials `tune --compile-only --target sm_121a-standin` left ready
    (tools/spark_standin.py --build), on a copy of the database: every trial measured and
    recorded as correct, each bucket's default measured, a pick derived per bucket."""
    from moe_aot import env, picks
    from moe_aot.database import Database
    from moe_aot.dbread import sqlite_file
    from moe_aot.measure_worker import GpuMeasurer, find_studies, measure
    from moe_aot.tuner import open_storage, parse_study_name

    path = sqlite_file(env.default_db_url())
    if path is None:
        pytest.skip("the flow test copies a SQLite database")
    copy = tmp_path / "standin.sqlite"
    src, dst = sqlite3.connect(path), sqlite3.connect(copy)
    src.backup(dst)  # with what a write-ahead log holds
    src.close(), dst.close()
    url = f"sqlite:///{copy}"
    measurer = GpuMeasurer(url, replays=10)
    try:
        studies = find_studies(open_storage(url), measurer.gpu, target=STANDIN)
    except LookupError as exc:
        pytest.skip(f"no stand-in studies for {measurer.gpu}: {exc}")
    n = measure(url, measurer, target=STANDIN, confirm=1)
    assert n > 0
    with Database(url) as db:
        for study in studies:
            p = parse_study_name(study.study_name)
            recs = [r for r in db.records(p["workload"], STANDIN, measurer.gpu) if r.tokens == p["tokens"]]
            assert recs and all(r.status == "ok" for r in recs), [(r.variant, r.status, r.error) for r in recs]
            spec = LayerSpec(**db.workload(p["workload"]), target=STANDIN)
            assert [pk.tokens for pk in picks.derive_picks(db, spec, measurer.gpu, [p["tokens"]])] == [p["tokens"]]
