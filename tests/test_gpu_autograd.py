"""GPU tests of the fused op's backward (moe_aot/integrations/autograd.py) with the AOT forward:
gradients against fp32 autograd of the reference, bitwise repeatable, no host sync, a whole
training step (forward, backward, optimizer) captured in a CUDA graph and replayed on new inputs,
torch.compile, and the compiled GLU backward against fp32 autograd.
Skipped without a GPU or without compiled kernels (set MOE_AOT_DB)."""
from __future__ import annotations

import os

import pytest

torch = pytest.importorskip("torch")

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("no CUDA GPU visible", allow_module_level=True)

from moe_aot.harness.reference import moe_reference, rel_err  # noqa: E402
from moe_aot.harness.verify import random_routing  # noqa: E402
from moe_aot.integrations import op  # noqa: E402, F401
from moe_aot.spec import PRESETS, make_spec  # noqa: E402

MODELS = os.environ.get("MOE_AOT_TEST_MODELS", ",".join(PRESETS)).split(",")
DEV = torch.device("cuda")
GRAD_TOL = 1e-2


def _layer(spec, gen):
    H, I, E = spec.hidden, spec.intermediate, spec.experts
    w13 = (torch.randn(E, 2 * I, H, device=DEV, generator=gen) * H ** -0.5).bfloat16()
    w2 = (torch.randn(E, H, I, device=DEV, generator=gen) * I ** -0.5).bfloat16()
    biases = ()
    if spec.bias:
        biases = (torch.randn(E, 2 * I, device=DEV, generator=gen).bfloat16() * 0.5,
                  torch.randn(E, H, device=DEV, generator=gen).bfloat16() * 0.5)
    return w13, w2, biases


def _fused_moe_train_out(*args):
    return torch.ops.moe_aot.fused_moe_train(*args)[0]


@pytest.mark.parametrize("model", [m for m in MODELS if m != "deepseek-v3"])  # its fp32 copies: 45 GB
@pytest.mark.parametrize("tokens", [1, 37, 1000])
@pytest.mark.parametrize("op_name", ["fused_moe", "fused_moe_train"])
def test_gradients_match_fp32_autograd_of_the_reference(store, model, tokens, op_name):
    """Both forwards: fused_moe (the backward recomputes GEMM1) and fused_moe_train (it reads the
    pre-activations the forward kept)."""
    fwd = torch.ops.moe_aot.fused_moe if op_name == "fused_moe" else _fused_moe_train_out
    spec = make_spec(model, target="sm_90a")
    gen = torch.Generator(device=DEV).manual_seed(tokens)
    w13, w2, biases = _layer(spec, gen)
    x = torch.randn(tokens, spec.hidden, device=DEV, generator=gen).bfloat16()
    tw, ids = random_routing(tokens, spec, DEV, skew=tokens > 1, generator=gen)
    ids[0, 0] = -1  # an id outside [0, E) contributes nothing, and gets no gradient
    ours = [t.clone().requires_grad_() for t in (x, w13, w2, tw, *biases)]
    out = fwd(*ours[:4], ids, spec.activation, *ours[4:])
    grad = torch.randn(out.shape, device=DEV, generator=gen).bfloat16()
    got = torch.autograd.grad(out, ours, grad)
    ref_in = [t.detach().float().requires_grad_() for t in ours]
    ref = torch.autograd.grad(moe_reference(*ref_in[:4], ids, spec.activation, 16, *ref_in[4:]), ref_in,
                              grad.float())
    for name, g, r, t in zip(("x", "w13", "w2", "topk_weights", "w13_bias", "w2_bias"), got, ref, ours):
        assert g.dtype == t.dtype and g.shape == t.shape, name
        assert rel_err(g, r) <= GRAD_TOL, (name, rel_err(g, r))
    again = torch.autograd.grad(fwd(*ours[:4], ids, spec.activation, *ours[4:]), ours, grad)
    for g, a in zip(got, again):
        assert torch.equal(g, a)  # deterministic: no atomics anywhere in the backward


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("tokens", [1000, 4096])
def test_gemm1_writes_the_preactivation_of_every_routed_pair(store, model, tokens):
    """The training twin of GEMM1 (variants.training_kernels, `moe-aot build --backward`): into a
    NaN-poisoned buffer, every routed pair's row equals x_m W13_e^T (+ b13_e) of torch's grouped
    GEMM within 1e-2 per row, rows of ids outside [0, E) stay untouched, the last row is zeros,
    and out is the forward's."""
    from moe_aot.harness.reference import row_rel_err
    from moe_aot.integrations.autograd import preact_torch
    from moe_aot.runtime.layer import MoeLayer

    spec = make_spec(model, target="sm_90a")
    layer = MoeLayer(spec, store=store)
    if layer.training_kernel(tokens) is None:
        from moe_aot.variants import training_kernels

        if training_kernels(spec, layer.variant_for(tokens)):
            pytest.skip(f"the database has no training GEMM1 for {model} at {tokens} tokens (moe-aot build --backward)")
        pytest.skip(f"{model} at {tokens} tokens runs a GEMM1 without a pre-activation output")
    gen = torch.Generator(device=DEV).manual_seed(tokens + 1)
    w13, w2, biases = _layer(spec, gen)
    x = torch.randn(tokens, spec.hidden, device=DEV, generator=gen).bfloat16()
    tw, ids = random_routing(tokens, spec, DEV, skew=True, generator=gen)
    ids[0, 0], ids[5, 1] = -1, spec.experts
    preact = torch.full((tokens * spec.top_k + 1, 2 * spec.intermediate), float("nan"), device=DEV,
                        dtype=torch.bfloat16)
    out, got = layer.forward_train(x, w13, w2, tw, ids, *biases, preact=preact)
    assert got is preact
    ref = preact_torch(x, w13, ids, biases[0] if biases else None)
    valid = ((ids >= 0) & (ids < spec.experts)).reshape(-1)
    rows = valid.nonzero().squeeze(1)
    assert row_rel_err(preact[rows], ref[rows]) <= 1e-2
    assert torch.isnan(preact[:-1][~valid].float()).all()
    assert torch.equal(preact[-1], torch.zeros_like(preact[-1]))
    args = (x, (w13, biases[0]), (w2, biases[1])) if biases else (x, w13, w2)
    assert torch.equal(out, layer.forward(*args, tw, ids))


def test_backward_does_not_sync_with_the_host(store):
    """Behind 100 ms of queued matmuls, forward + backward return to the host before they finish."""
    spec = make_spec(MODELS[0], target="sm_90a")
    gen = torch.Generator(device=DEV).manual_seed(3)
    w13, w2, _ = _layer(spec, gen)
    x = torch.randn(256, spec.hidden, device=DEV, generator=gen).bfloat16().requires_grad_()
    tw, ids = random_routing(256, spec, DEV, generator=gen)
    ws = [w13.requires_grad_(), w2.requires_grad_(), tw.requires_grad_()]
    torch.autograd.grad(torch.ops.moe_aot.fused_moe(x, *ws, ids), [x, *ws], torch.ones(256, spec.hidden, device=DEV,
                                                                                       dtype=torch.bfloat16))
    torch.cuda.synchronize()
    a = torch.randn(8192, 8192, device=DEV, dtype=torch.bfloat16)
    end = torch.cuda.Event()
    for _ in range(60):
        a @ a
    torch.autograd.grad(torch.ops.moe_aot.fused_moe(x, *ws, ids).sum(), [x, *ws])
    end.record()
    assert not end.query(), "the host waited for the GPU during forward + backward"
    torch.cuda.synchronize()


def test_training_step_captures_in_a_cuda_graph(store):
    """Forward, backward and an SGD step captured once, replayed on new inputs: the parameters
    move exactly as the same steps run eagerly."""
    spec = make_spec(MODELS[0], target="sm_90a")
    gen = torch.Generator(device=DEV).manual_seed(4)
    w13, w2, _ = _layer(spec, gen)
    M = 128
    params = [w13.clone().requires_grad_(), w2.clone().requires_grad_()]
    eager = [w13.clone().requires_grad_(), w2.clone().requires_grad_()]
    x = torch.zeros(M, spec.hidden, device=DEV, dtype=torch.bfloat16)
    tw, ids = random_routing(M, spec, DEV, generator=gen)
    target = torch.zeros(M, spec.hidden, device=DEV, dtype=torch.bfloat16)

    def step(ps, lr=0.5):
        out = torch.ops.moe_aot.fused_moe_train(x, ps[0], ps[1], tw, ids)[0]
        loss = ((out.float() - target.float()) ** 2).mean()
        grads = torch.autograd.grad(loss, ps)
        with torch.no_grad():
            for p, g in zip(ps, grads):
                p.sub_(lr * g)

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        step([p.detach().clone().requires_grad_() for p in params])  # warm-up: kernels loaded, workspace sized
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step(params)
    for i in range(3):
        x.copy_(torch.randn(M, spec.hidden, device=DEV, generator=gen))
        target.copy_(torch.randn(M, spec.hidden, device=DEV, generator=gen))
        new_tw, new_ids = random_routing(M, spec, DEV, generator=gen)
        tw.copy_(new_tw)
        ids.copy_(new_ids)
        graph.replay()
        step(eager)
        torch.cuda.synchronize()
        for p, q in zip(params, eager):
            assert torch.equal(p, q), i
        assert not torch.equal(params[0], w13)


@pytest.mark.parametrize("model, activation", [("qwen3-30b-a3b", "swiglu"), ("qwen3-30b-a3b", "geglu"),
                                               ("gpt-oss-120b", "swigluoai")])
def test_glu_backward_kernel_matches_fp32_every_row(store, model, activation):
    """The compiled GLU backward (moe-aot build --backward) against fp32 autograd of the GLU on
    fresh random rows, outputs poisoned with NaN; a tenth of the rows with weight 0 (as the
    backward's rows of ids outside [0, E) have)."""
    from moe_aot.glu import glu_fn
    from moe_aot.harness.reference import row_rel_err
    from moe_aot.runtime.layer import glu_backward_kernel

    spec = make_spec(model, target="sm_90a")
    kernel = glu_backward_kernel(spec.experts, spec.top_k, spec.hidden, spec.intermediate, activation, spec.bias,
                                 DEV, store)
    if kernel is None:
        pytest.skip(f"no GLU backward for {activation} in the database (moe-aot build --backward)")
    P, I = 1000, spec.intermediate
    gen = torch.Generator(device=DEV).manual_seed(7)
    a = (torch.randn(P, 2 * I, device=DEV, generator=gen) * 4).bfloat16()  # swigluoai: clamps bind
    G = torch.randn(P, I, device=DEV, generator=gen).bfloat16()
    w = torch.rand(P, device=DEV, generator=gen)
    w[::10] = 0
    da = torch.full_like(a, float("nan"))
    hw = torch.full_like(G, float("nan"))
    dw = torch.full((P,), float("nan"), device=DEV)
    kernel(a, G, w, da, hw, dw)
    av = a.float().view(P, -1, 2, 16)
    g, u = (av[:, :, j].reshape(P, I).requires_grad_() for j in (0, 1))
    h = glu_fn(activation)(g, u)
    dg, du = torch.autograd.grad(h, (g, u), G.float() * w[:, None])
    da_ref = torch.stack((dg.view(P, -1, 16), du.view(P, -1, 16)), dim=2).view(P, 2 * I)
    assert row_rel_err(da, da_ref) <= 1e-2 and row_rel_err(hw, h.detach() * w[:, None]) <= 1e-2
    dw_ref = (G.float() * h.detach()).sum(1)
    assert ((dw - dw_ref).abs() <= 1e-3 * dw_ref.abs() + 1e-2).all()


def test_training_step_under_torch_compile_matches_eager(store):
    """torch.compile(fullgraph=True) (inductor) of a loss through the op on the GPU: the same
    gradients as eager, the backward kept whole as moe_aot::fused_moe_backward."""
    spec = make_spec(MODELS[0], target="sm_90a")
    gen = torch.Generator(device=DEV).manual_seed(5)
    w13, w2, _ = _layer(spec, gen)
    x = torch.randn(300, spec.hidden, device=DEV, generator=gen).bfloat16()
    tw, ids = random_routing(300, spec, DEV, generator=gen)
    params = [w13.requires_grad_(), w2.requires_grad_(), tw.requires_grad_()]

    def loss(w13, w2, tw):
        return torch.ops.moe_aot.fused_moe(x, w13, w2, tw, ids).float().square().mean()

    torch._dynamo.reset()
    got = torch.autograd.grad(torch.compile(loss, fullgraph=True)(*params), params)
    want = torch.autograd.grad(loss(*params), params)
    for g, w in zip(got, want):
        assert rel_err(g, w.float()) <= 1e-3


def _chunked_rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    """rel_err over the leading dimension's slices (DeepSeek-V3's weight gradients are 15 GB in
    bf16: no fp32 copy of them whole)."""
    num = den = 0.0
    for g, r in zip(got.reshape(got.shape[0], -1), ref.reshape(ref.shape[0], -1)):
        num += (g.float() - r.float()).square().sum().item()
        den += r.float().square().sum().item()
    return (num / max(den, 1e-30)) ** 0.5


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("tokens", [1, 37, 1000, 4096])
def test_fused_backward_gemms_match_the_torch_gemm_backward(store, model, tokens, monkeypatch):
    """The compiled data path (routing, dH with the GLU's backward in its epilogue, dX, combine, the
    weight-gradient GEMMs, used here wherever built: `moe-aot build --backward`) against the same
    backward multiplying with
    torch's grouped GEMMs, on the same inputs and kept pre-activations, with the caching
    allocator's free memory filled with NaN first (so a row a kernel leaves unwritten, or a padding
    row read where it must not be, shows): every gradient within 1e-2, dx per row, the gradient of
    an id outside [0, E) zero; bitwise repeatable. (Both are bf16 paths: dtopk_weights, a dot product
    over I terms with cancellation, is compared as a whole; its per-element accuracy against fp32
    is test_gradients_match_fp32_autograd_of_the_reference's.)"""
    from moe_aot.harness.reference import row_rel_err
    from moe_aot.integrations import autograd as ag

    spec = make_spec(model, target="sm_90a")
    gen = torch.Generator(device=DEV).manual_seed(tokens + 7)
    w13, w2, biases = _layer(spec, gen)
    b13, b2 = biases if biases else (None, None)
    x = torch.randn(tokens, spec.hidden, device=DEV, generator=gen).bfloat16()
    grad = torch.randn(tokens, spec.hidden, device=DEV, generator=gen).bfloat16()
    tw, ids = random_routing(tokens, spec, DEV, skew=tokens > 1, generator=gen)
    ids[0, 0] = -1
    monkeypatch.setattr(ag, "USE_WGRAD_KERNELS", True)  # not only where the bucket's variant has them
    if ag._plan(x, ids, w13, w2, spec.activation, 16, spec.bias) is None:
        pytest.fail(f"no compiled backward data path for {model} on this GPU (moe-aot build --backward)")
    preact = ag.preact_torch(x, w13, ids, b13)

    def fused():
        free, _ = torch.cuda.mem_get_info()
        poison = torch.empty(int(free * 0.3) // 4, device=DEV)
        poison.fill_(float("nan"))
        del poison
        return ag.moe_backward(grad, x, w13, w2, tw, ids, spec.activation, 16, b13, b2, preact)

    try:
        got = fused()
        again = fused()
        assert all(torch.equal(a, b) for a, b in zip(got, again) if a is not None)
        del again
        with monkeypatch.context() as mp:
            mp.setattr(ag, "_plan", lambda *a: None)
            ref = ag.moe_backward(grad, x, w13, w2, tw, ids, spec.activation, 16, b13, b2, preact)
        for name, g, r in zip(("dx", "dw13", "dw2", "dtopk_weights", "db13", "db2"), got, ref):
            if r is None:
                assert g is None, name
                continue
            assert g.shape == r.shape and g.dtype == r.dtype, name
            err = _chunked_rel_err(g, r)
            assert err <= GRAD_TOL, (name, err)
        assert row_rel_err(got[0], ref[0]) <= GRAD_TOL
        assert got[3][0, 0] == 0
    finally:  # a failing case's frames must not keep DeepSeek-V3's gradients alive for the next
        got = ref = None
        torch.cuda.empty_cache()


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("tokens", [1000, 4096])
def test_the_backward_serves_its_buckets_pick_and_it_matches_fp32(store, model, tokens):
    """The op's backward runs the bucket's tuned backward variant where the database has one
    deployed for this GPU (`moe-aot build --backward` of the committed picks), else the bucket's
    default; that variant, checked by the tuner's own check (harness/backward.py: every expert's
    weight gradients, dx and its worst row, the routing weights' gradient, against fp32 on
    NaN-poisoned memory) and replayed from CUDA graphs."""
    from moe_aot.harness.backward import measure_backward
    from moe_aot.integrations import autograd as ag
    from moe_aot.variants import bucket_for, default_backward

    spec = make_spec(model, target="sm_90a")
    gen = torch.Generator(device=DEV).manual_seed(tokens + 11)
    w13, w2, biases = _layer(spec, gen)
    x = torch.randn(tokens, spec.hidden, device=DEV, generator=gen).bfloat16()
    _, ids = random_routing(tokens, spec, DEV, generator=gen)
    plan = ag._plan(x, ids, w13, w2, spec.activation, 16, spec.bias)
    if plan is None:
        pytest.fail(f"no compiled backward for {model} on this GPU (moe-aot build --backward)")
    picks = store.picks(spec, torch.cuda.get_device_name(DEV), backward=True)
    assert plan[0] == picks.get(bucket_for(tokens), default_backward(spec, tokens))
    try:
        r = measure_backward(spec, plan[0], tokens, (w13, biases[0]) if biases else w13,
                             (w2, biases[1]) if biases else w2, store, DEV, replays=4)
        assert r["ok"], r["errors"]
        assert r["median_us"] > 0
    finally:
        w13 = w2 = biases = None
        torch.cuda.empty_cache()


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("tile_m", [64, 128])
def test_the_backward_at_each_routing_tile_height_matches_fp32(store, model, tile_m):
    """The 4096-token bucket's tuning candidates with tile_m-row routing tiles and the default's
    weight gradients (variants.backward_candidates: at 128 rows the default, at 64 its two 64-row
    twins), each checked by the tuner's own check (harness/backward.py) against fp32 on
    NaN-poisoned memory. Skipped where the database lacks their kernels (`moe-aot tune --backward
    --compile-only` compiles them)."""
    from moe_aot.harness.backward import measure_backward
    from moe_aot.runtime.store import KernelMissingError
    from moe_aot.variants import backward_candidates

    spec = make_spec(model, target="sm_90a")
    tokens = 4096
    cands = backward_candidates(spec, tokens)
    todo = [v for v in cands if v.tile_m == tile_m and v.wgrad == cands[0].wgrad and not v.torch_data]
    assert todo
    gen = torch.Generator(device=DEV).manual_seed(tokens + tile_m)
    w13, w2, biases = _layer(spec, gen)
    try:
        for v in todo:
            try:
                r = measure_backward(spec, v, tokens, (w13, biases[0]) if biases else w13,
                                     (w2, biases[1]) if biases else w2, store, DEV, replays=4)
            except KernelMissingError as exc:
                pytest.skip(str(exc))
            assert r["ok"], (v.name(spec), r["errors"])
            print(f"{v.name(spec)}: {r['median_us']:.0f} us, errors {r['errors']}")
    finally:
        w13 = w2 = biases = None
        torch.cuda.empty_cache()


@pytest.mark.parametrize("model", MODELS)
def test_torch_data_gemms_as_the_backward_variant_match_fp32(store, model):
    """variants.TORCH_DATA (torch's grouped GEMMs around the compiled GLU backward), as the tuner
    measures it: the runtime's plan for it carries no compiled data path, and its gradients pass
    the tuner's own check (harness/backward.py) against fp32 on NaN-poisoned memory at 4096 tokens."""
    from moe_aot.harness.backward import measure_backward
    from moe_aot.runtime.layer import backward_plan
    from moe_aot.variants import TORCH_DATA

    spec = make_spec(model, target="sm_90a")
    assert backward_plan(spec.experts, spec.top_k, spec.hidden, spec.intermediate, spec.activation, spec.bias, DEV,
                         4096, store, TORCH_DATA) == (TORCH_DATA, None, None)
    gen = torch.Generator(device=DEV).manual_seed(29)
    w13, w2, biases = _layer(spec, gen)
    try:
        r = measure_backward(spec, TORCH_DATA, 4096, (w13, biases[0]) if biases else w13,
                             (w2, biases[1]) if biases else w2, store, DEV, replays=4)
        assert r["ok"], r["errors"]
        assert r["median_us"] > 0
        print(f"{TORCH_DATA.name(spec)}: {r['median_us']:.0f} us, errors {r['errors']}")
    finally:
        w13 = w2 = biases = None
        torch.cuda.empty_cache()
