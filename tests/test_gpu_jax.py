"""GPU tests of the JAX path (moe_aot.integrations.jax): the AOT kernels through jax.ffi under
jax.jit, against the fp32 jnp reference on fresh random inputs, every row, with the output
poisoned with NaN beforehand (passed as `out`, donated); repeated calls with new buffers, token
counts of several buckets, uniform / skewed / invalid-id routings, an eager call, XLA's command
buffers (in a subprocess, since XLA reads its flags once per process: tools/jax_smoke.py), and
dispatch without a host sync. Skipped without jax, without a GPU visible to jax, or without a
kernel database (set MOE_AOT_DB; tools/gpu_run.py does); a broken database fails.

    MOE_AOT_DB=sqlite:///$PWD/deploy.sqlite python3 -m pytest -m gpu -q tests/test_gpu_jax.py
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # torch tests may share the GPU
jax = pytest.importorskip("jax")
np = pytest.importorskip("numpy")

pytestmark = pytest.mark.gpu
try:
    GPU = jax.devices("gpu")[0]
except RuntimeError:
    pytest.skip("no CUDA GPU visible to jax", allow_module_level=True)

import jax.numpy as jnp  # noqa: E402

import moe_aot.integrations.jax as mj  # noqa: E402
from moe_aot.harness.verify import ROW_TOLERANCE, TOLERANCE  # noqa: E402
from moe_aot.spec import make_spec  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))
import jax_smoke  # noqa: E402

MODELS = os.environ.get("MOE_AOT_JAX_TEST_MODELS", "qwen3-30b-a3b,mixtral-8x7b").split(",")
# (tokens, routing): buckets 1, 16, 64, 256 and 1024 of the deployed picks
CASES = [(1, "uniform"), (12, "invalid"), (37, "uniform"), (256, "skew"), (1000, "invalid")]


@pytest.fixture(scope="module", params=MODELS)
def layer(request, store):
    spec = make_spec(request.param, target="sm_90a")
    w13, w2 = jax_smoke.weights(jax.random.PRNGKey(1), spec)
    return spec, w13, w2


_ref = jax.jit(mj.moe_reference)


def _inputs(spec, M, kind, seed):
    kx, kr = jax.random.split(jax.random.PRNGKey(seed))
    x = jax.random.normal(kx, (M, spec.hidden), jnp.float32).astype(jnp.bfloat16)
    tw, ids = jax_smoke.routing(kr, M, spec.experts, spec.top_k, kind)
    return x, tw, ids


def _check(out, ref, what):
    r = jax_smoke.row_report(out, ref)
    msg = (f"{what}: rel_err {r['rel_err']:.3e} (<= {TOLERANCE}), worst row {r['worst_row']} rel "
           f"{r['row_rel_err']:.3e} (<= {ROW_TOLERANCE}), its max-abs error {r['worst_row_maxabs']:.3e} against "
           f"|ref| <= {r['worst_row_ref_max']:.3e}; {r['n_nonfinite_rows']} rows not finite (unwritten?) "
           f"{r['nonfinite_rows']}; rows of only invalid ids not zero: {r['zero_rows_nonzero']}")
    assert (r["n_nonfinite_rows"] == 0 and not r["zero_rows_nonzero"] and r["rel_err"] <= TOLERANCE
            and r["row_rel_err"] <= ROW_TOLERANCE), msg


@pytest.mark.parametrize("tokens,routing", CASES)
def test_jit_matches_the_jnp_reference_every_row(layer, tokens, routing):
    spec, w13, w2 = layer
    f = jax.jit(lambda out, *a: mj.fused_moe(*a, out=out), donate_argnums=0)
    for call in range(2):  # the second call: the same executable, new input and output buffers
        x, tw, ids = _inputs(spec, tokens, routing, seed=100 * tokens + call)
        poison = jnp.full((tokens, spec.hidden), jnp.nan, jnp.bfloat16)
        out = f(poison, x, w13, w2, tw, ids)
        assert out.shape == (tokens, spec.hidden) and out.dtype == jnp.bfloat16
        plan = mj.prepare(x.shape, w13.shape, ids.shape, out=True)
        _check(out, _ref(x, w13, w2, tw, ids),
               f"{spec.label()} {tokens} tokens ({routing}), call {call}, variant {plan.variant}")


def test_eager_call_and_jit_without_out_agree(layer):
    spec, w13, w2 = layer
    x, tw, ids = _inputs(spec, 5, "uniform", seed=7)
    eager = mj.fused_moe(x, w13, w2, tw, ids)  # no jit: one custom call dispatched op by op
    jitted = jax.jit(mj.fused_moe)(x, w13, w2, tw, ids)
    _check(eager, _ref(x, w13, w2, tw, ids), f"{spec.label()} eager, 5 tokens")
    assert np.array_equal(np.asarray(eager.astype(jnp.float32)), np.asarray(jitted.astype(jnp.float32))), \
        "the same inputs gave different outputs eagerly and under jit (routing and combine are deterministic)"


def test_the_call_is_inside_xla_graphs_with_other_work(layer):
    spec, w13, w2 = layer
    x, tw, ids = _inputs(spec, 64, "uniform", seed=11)

    @jax.jit
    def block(x, w13, w2, tw, ids):  # the op between ordinary XLA ops, the way a model uses it
        h = (x.astype(jnp.float32) * 0.5).astype(jnp.bfloat16)
        return mj.fused_moe(h, w13, w2, tw, ids).astype(jnp.float32) * 2.0

    h = (x.astype(jnp.float32) * 0.5).astype(jnp.bfloat16)
    _check(block(x, w13, w2, tw, ids) / 2.0, _ref(h, w13, w2, tw, ids), f"{spec.label()} inside a jit block")


def test_command_buffers_trace_the_call_and_replay_it_with_new_inputs(store, tmp_path):
    """XLA's command buffers for custom calls (CUDA graphs traced from the handler) in a fresh
    process with --xla_gpu_enable_command_buffer=FUSION,CUSTOM_CALL and min graph size 1: the
    custom call must sit in a command buffer computation, and each token count's output (new
    buffers each) must match the reference. A host sync inside would fail the stream capture."""
    out = tmp_path / "jax_smoke.json"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT)] + [p for p in os.environ.get("PYTHONPATH", "")
                                                                     .split(os.pathsep) if p]))
    proc = subprocess.run([sys.executable, str(ROOT / "tools" / "jax_smoke.py"), "--model", MODELS[0],
                           "--tokens", "1,37,1000", "--command-buffers", "--json", str(out)],
                          capture_output=True, text=True, timeout=300, env=env)
    report = json.loads(out.read_text()) if out.exists() else {}
    tail = (proc.stdout + proc.stderr)[-5000:]
    assert report, f"the smoke run wrote no report (rc {proc.returncode}):\n{tail}"
    # XLA forms command buffers on the thunk sequence after compilation (CommandBufferConversionPass),
    # so jax_smoke reads where the call sits in the dumped thunk sequence; measured on the H200
    # (jax 0.11.2, 2026-12-01): inside a kCommandBuffer thunk with these flags, outputs bit-equal
    # to eager (tools/jax_cmdbuf_probe.py).
    numerics_bad = [c for c in report["cases"] if not c["ok"] and not (c.get("rel_err", 1) <= 1e-2 and
                                                                        c.get("row_rel_err", 1) <= 3e-2)]
    assert not numerics_bad and "error" not in report, f"cases wrong under the flags: {json.dumps(numerics_bad)[:3000]}"
    outside = [c for c in report["cases"] if not c["in_command_buffer"]]
    assert report["cases"] and not outside, \
        f"the custom call is not in a command buffer (jax {report.get('jax')}, traits " \
        f"{report.get('traits_registered')}): {json.dumps(outside)[:2000]}\n{tail}"
    bad = [c for c in report["cases"] if not c["ok"]]
    assert proc.returncode == 0 and not bad and "error" not in report, \
        f"command-buffer run failed (XLA_FLAGS {report.get('xla_flags')!r}, jax {report.get('jax')}): " \
        f"{report.get('error')}; cases not ok: {json.dumps(bad)[:3000]}\n{tail}"


def test_dispatch_does_not_wait_for_the_gpu(layer):
    """No host sync: with ~100 ms of matmuls queued on the GPU, the call returns while they are
    still running, and its own output is not ready yet (a sync in the handler, or in anything it
    calls, would have waited for the queue to drain)."""
    spec, w13, w2 = layer
    x, tw, ids = _inputs(spec, 256, "uniform", seed=3)
    r = jax_smoke.dispatch_is_async(jax.jit(mj.fused_moe), (x, w13, w2, tw, ids))
    assert r["heavy_ms"] > 20, f"the queued work took only {r['heavy_ms']:.1f} ms: the check proves nothing ({r})"
    assert r["async"], f"dispatching the call waited for the GPU: {r}"
