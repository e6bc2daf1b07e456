"""The fused MoE op's backward (moe_aot/integrations/autograd.py) on the CPU: gradcheck of the
formula in float64 against finite differences of the same layer, and the op's gradients in bf16
against fp32 autograd through the independent reference (harness.reference.moe_reference)."""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from moe_aot.harness.reference import moe_reference, rel_err  # noqa: E402
from moe_aot.integrations import op  # noqa: E402, F401  (registers the op and its autograd)
from moe_aot.integrations.autograd import moe_backward, moe_forward_torch, route  # noqa: E402

E, K, H, I = 4, 2, 32, 32


def _inputs(M, dtype, gen, bias=False, scale=1.0):
    x = torch.randn(M, H, generator=gen, dtype=dtype)
    w13 = torch.randn(E, 2 * I, H, generator=gen, dtype=dtype) * (scale / H ** 0.5)
    w2 = torch.randn(E, H, I, generator=gen, dtype=dtype) / I ** 0.5
    tw = torch.rand(M, K, generator=gen, dtype=dtype)
    ids = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(M)]).to(torch.int32)
    ids[1, 0], ids[2, 1] = -1, E + 3  # ids outside [0, E) contribute nothing
    b13 = torch.randn(E, 2 * I, generator=gen, dtype=dtype) if bias else None
    b2 = torch.randn(E, H, generator=gen, dtype=dtype) if bias else None
    return x, w13, w2, tw, ids, b13, b2


class _Layer(torch.autograd.Function):
    """moe_forward_torch with moe_backward as its derivative, for gradcheck."""

    @staticmethod
    def forward(ctx, x, w13, w2, tw, b13, b2, ids, act):
        ctx.save_for_backward(x, w13, w2, tw, b13, b2, ids)
        ctx.act = act
        return moe_forward_torch(x, w13, w2, tw, ids, act, 16, b13, b2)

    @staticmethod
    def backward(ctx, g):
        x, w13, w2, tw, b13, b2, ids = ctx.saved_tensors
        return (*moe_backward(g, x, w13, w2, tw, ids, ctx.act, 16, b13, b2), None, None)


@pytest.mark.parametrize("activation, bias", [("swiglu", False), ("geglu", False), ("swigluoai", True)])
def test_backward_formula_passes_gradcheck_in_float64(activation, bias):
    gen = torch.Generator().manual_seed(11)
    # swigluoai: weights 4x larger so that both clamps are engaged on some of the sums
    x, w13, w2, tw, ids, b13, b2 = _inputs(5, torch.float64, gen, bias, scale=4.0 if bias else 1.0)
    if bias:
        a = x @ w13[0].t()
        assert (a > 7).any() and (a < -7).any()
    args = tuple(t.clone().requires_grad_() if t is not None else None for t in (x, w13, w2, tw, b13, b2))
    assert torch.autograd.gradcheck(lambda *a: _Layer.apply(*a, ids, activation), args, eps=1e-6, atol=1e-5)


def test_forward_formula_matches_the_reference():
    gen = torch.Generator().manual_seed(12)
    x, w13, w2, tw, ids, b13, b2 = _inputs(7, torch.float32, gen, bias=True)
    got = moe_forward_torch(x, w13, w2, tw, ids, "swigluoai", 16, b13, b2)
    ref = moe_reference(x, w13, w2, tw, ids, "swigluoai", 16, b13, b2)
    assert rel_err(got, ref) < 1e-6


def test_route_sorts_pairs_by_expert_with_invalid_ids_last():
    ids = torch.tensor([[2, 0], [-1, 2], [1, 9]], dtype=torch.int32)
    order, offs, valid, expert = route(ids, 3)
    assert order.tolist() == [1, 4, 0, 3, 2, 5]
    assert offs.tolist() == [1, 2, 4] and offs.dtype == torch.int32
    assert valid.tolist() == [True] * 4 + [False] * 2
    assert expert.tolist() == [0, 1, 2, 2, 0, 0]


@pytest.mark.parametrize("activation, bias", [("swiglu", False), ("swigluoai", True)])
def test_op_gradients_match_fp32_autograd_of_the_reference(activation, bias):
    """torch.ops.moe_aot.fused_moe (CPU: bf16 in, the fp32 reference forward) backward against
    autograd through moe_reference in fp32 on the same bf16 values: every gradient within 1e-2."""
    gen = torch.Generator().manual_seed(13)
    x, w13, w2, tw, ids, b13, b2 = _inputs(9, torch.float32, gen, bias)
    bf = [t.to(torch.bfloat16) if t is not None else None for t in (x, w13, w2, b13, b2)]
    ours = [bf[0], bf[1], bf[2], tw] + ([bf[3], bf[4]] if bias else [])
    ours = [t.clone().requires_grad_() for t in ours]
    out = torch.ops.moe_aot.fused_moe(*ours[:4], ids, activation, *ours[4:])
    grad = torch.randn(out.shape, generator=gen).to(torch.bfloat16)
    out.backward(grad)
    ref = [t.detach().float().requires_grad_() for t in ours]
    moe_reference(*ref[:4], ids, activation, 16, *ref[4:]).backward(grad.float())
    names = ["x", "w13", "w2", "topk_weights", "w13_bias", "w2_bias"]
    for name, a, b in zip(names, ours, ref):
        assert a.grad is not None and a.grad.dtype == a.dtype and a.grad.shape == a.shape, name
        assert rel_err(a.grad, b.grad) <= 1e-2, name


def _saved_by(fn, seed):
    """(data pointers autograd saves for fn(x, w13, w2, tw, ids) on fresh bf16 inputs that need
    grad, the op's inputs, its outputs)."""
    gen = torch.Generator().manual_seed(seed)
    x, w13, w2, tw, ids, _, _ = _inputs(6, torch.float32, gen)
    ins = [t.to(torch.bfloat16).requires_grad_() for t in (x, w13, w2)] + [tw.requires_grad_()] + [ids]
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        outs = fn(*ins)
    return {t.data_ptr() for t in saved}, ins, outs


def test_backward_saves_only_the_inputs():
    """No activation is saved: what autograd keeps for the op is the op's own input tensors."""
    saved, ins, _ = _saved_by(torch.ops.moe_aot.fused_moe, 14)
    assert saved <= {t.data_ptr() for t in ins}


def test_no_gradient_asked_for_ids_or_unused_inputs():
    gen = torch.Generator().manual_seed(15)
    x, w13, w2, tw, ids, _, _ = _inputs(4, torch.float32, gen)
    xb = x.to(torch.bfloat16).requires_grad_()
    out = torch.ops.moe_aot.fused_moe(xb, w13.to(torch.bfloat16), w2.to(torch.bfloat16), tw, ids)
    out.sum().backward()
    assert xb.grad is not None and torch.isfinite(xb.grad.float()).all()


# -- the compiled GLU backward (templates/glu_backward.py) and how it is built -------------------------
def test_backward_kernel_names_cover_every_argument():
    import dataclasses

    from moe_aot.spec import make_spec
    from moe_aot.variants import backward_kernels

    spec = make_spec("qwen3-30b-a3b", target="sm_90a")
    kv = backward_kernels(spec)[0]  # then the fused data path's (tests/test_backward_gemms.py)
    assert kv.role == "glu_bwd" and kv.kwargs() == {"intermediate": 768, "activation": "swiglu", "interleave": 16}
    others = [dataclasses.replace(spec, intermediate=1024), dataclasses.replace(spec, activation="geglu"),
              dataclasses.replace(spec, target="sm_100a")]
    names = {kv.name} | {backward_kernels(s)[0].name for s in others}
    assert len(names) == 4
    assert backward_kernels(make_spec("qwen3-30b-a3b", target="sm_90a", precision="fp8")) == []


@pytest.mark.parametrize("activation", ["swiglu", "geglu", "swigluoai"])
def test_glu_backward_template_compiles_to_16_byte_accesses(activation, tmp_path):
    """One pass per row: gate, up and grad_h each one 16-byte load per chunk, da (twice) and hw one
    16-byte store each; no local memory."""
    cute = pytest.importorskip("cutlass.cute")
    from moe_aot_templates.glu_backward import GluBackward

    obj = GluBackward(768, activation, 16)
    ptx = cute.compile(obj, *[f for _, f in obj.fake_arguments()],
                       options=f"--gpu-arch sm_90a --keep-ptx --dump-dir {tmp_path}").__ptx__
    body = ptx[ptx.index(".entry"):]
    assert body.count("ld.global.v4") == 3 and body.count("st.global.v4") == 3
    assert "ld.local" not in body and "st.local" not in body
    ok, why = GluBackward.can_implement(768, "relu")
    assert not ok and "activation" in why
    ok, why = GluBackward.can_implement(760, "swiglu", 16)
    assert not ok and "760" in why
    with pytest.raises(ValueError, match="interleave"):
        GluBackward(768, "swiglu", 12)


def test_build_backward_puts_the_glu_backward_into_the_database(tmp_path):
    from click.testing import CliRunner

    from moe_aot.cli import main
    from moe_aot.compiler import toolchain_key
    from moe_aot.database import Database
    from moe_aot.spec import make_spec
    from moe_aot.variants import backward_kernels, default_variant, training_kernels, wgrad_kernels

    spec_file = tmp_path / "tiny.toml"
    spec_file.write_text("[[layer]]\nexperts = 8\ntop_k = 2\nhidden = 512\nintermediate = 256\n")
    db = f"sqlite:///{tmp_path / 'b.sqlite'}"
    args = ["build", "--spec", str(spec_file), "--tokens", "16,1024", "--db", db, "-j", "2"]
    res = CliRunner().invoke(main, args)
    assert res.exit_code == 0, res.output
    res = CliRunner().invoke(main, args + ["--backward"])
    # the GLU backward, dH, dX, the two weight-gradient GEMMs, and the 1024-token variant's GEMM1
    # (hopws) with its pre-activation output (the 16-token one, mma.sync, has none); the backward's
    # routing and combine are the 1024-token forward's
    assert res.exit_code == 0 and "6 compiled" in res.output, res.output
    spec = make_spec(experts=8, top_k=2, hidden=512, intermediate=256, target="sm_90a")
    kv = backward_kernels(spec)[0]
    wgrad = wgrad_kernels(spec)
    assert len(wgrad) == 2
    (train,) = training_kernels(spec, default_variant(spec, 1024))
    assert training_kernels(spec, default_variant(spec, 16)) == []
    with Database(db, readonly=True) as d:
        assert d.has_artifact(kv.name, toolchain_key("sm_90a"))
        assert d.has_artifact(train.name, toolchain_key("sm_90a"))
        assert all(d.has_artifact(w.name, toolchain_key("sm_90a")) for w in wgrad)


def test_trainable_experts_hold_parameters_with_gradients():
    from torch import nn

    from moe_aot.integrations import MoeExperts

    gen = torch.Generator().manual_seed(16)
    x, w13, w2, tw, ids, _, _ = _inputs(6, torch.float32, gen)
    frozen = MoeExperts(w13, w2)
    assert list(frozen.parameters()) == [] and {"w13", "w2"} <= set(dict(frozen.named_buffers()))
    m = MoeExperts(w13, w2, trainable=True)
    assert {n for n, _ in m.named_parameters()} == {"w13", "w2"}
    assert set(m.state_dict()) == set(frozen.state_dict())
    out = m(x.to(torch.bfloat16), tw, ids)
    out.float().square().sum().backward()
    ref = [t.detach().float().requires_grad_() for t in (m.w13, m.w2)]
    moe_reference(x.to(torch.bfloat16), *ref, tw, ids).square().sum().backward()
    for p, r in zip((m.w13, m.w2), ref):
        assert isinstance(p, nn.Parameter) and rel_err(p.grad, r.grad) <= 2e-2
    with pytest.raises(ValueError, match="fp8 experts cannot be trained"):
        MoeExperts(w13.to(torch.float8_e4m3fn), w2.to(torch.float8_e4m3fn), w13_scale=torch.ones(E, 2),
                   w2_scale=torch.ones(E), trainable=True)


def test_training_step_compiles_fullgraph_and_matches_eager():
    """torch.compile(fullgraph=True) of a loss through the op: the backward is one op in the graph
    (moe_aot::fused_moe_backward), and the gradients equal eager's."""
    gen = torch.Generator().manual_seed(17)
    x, w13, w2, tw, ids, _, _ = _inputs(6, torch.float32, gen)
    params = [w13.to(torch.bfloat16).requires_grad_(), w2.to(torch.bfloat16).requires_grad_(), tw.requires_grad_()]
    xb = x.to(torch.bfloat16)

    def loss(w13, w2, tw):
        return torch.ops.moe_aot.fused_moe(xb, w13, w2, tw, ids).float().square().mean()

    torch._dynamo.reset()
    compiled = torch.compile(loss, fullgraph=True, backend="aot_eager")
    got = torch.autograd.grad(compiled(*params), params)
    want = torch.autograd.grad(loss(*params), params)
    for g, w in zip(got, want):
        assert rel_err(g, w.float()) <= 1e-3


def test_opcheck_of_the_backward_op_and_of_the_op_with_gradients():
    gen = torch.Generator().manual_seed(18)
    x, w13, w2, tw, ids, b13, b2 = _inputs(5, torch.float32, gen, bias=True)
    bf = [t.to(torch.bfloat16) for t in (x, w13, w2, b13, b2)]
    grad = torch.randn(5, H, generator=gen).to(torch.bfloat16)
    torch.library.opcheck(torch.ops.moe_aot.fused_moe_backward.default,
                          (grad, bf[0], bf[1], bf[2], tw, ids, "swigluoai", bf[3], bf[4]))
    torch.library.opcheck(torch.ops.moe_aot.fused_moe_backward.default, (grad, *bf[:3], tw, ids, "swiglu"))
    args = [t.clone().requires_grad_() for t in bf[:3]] + [tw.clone().requires_grad_(), ids]
    torch.library.opcheck(torch.ops.moe_aot.fused_moe.default, tuple(args))


# -- fused_moe_train: the forward keeps GEMM1's pre-activations for the backward ----------------------
def test_train_op_returns_the_preactivation_of_every_routed_pair():
    """Row m * top_k + k of preact is x_m W13_e^T + b13_e of that pair (e = ids[m, k]); the last row
    is zeros; out is fused_moe's."""
    gen = torch.Generator().manual_seed(19)
    x, w13, w2, tw, ids, b13, b2 = (t.to(torch.bfloat16) if t is not None and t.is_floating_point() else t
                                    for t in _inputs(7, torch.float32, gen, bias=True))
    tw = tw.float()
    out, preact = torch.ops.moe_aot.fused_moe_train(x, w13, w2, tw, ids, "swigluoai", b13, b2)
    assert torch.equal(out, torch.ops.moe_aot.fused_moe(x, w13, w2, tw, ids, "swigluoai", b13, b2))
    assert preact.shape == (7 * K + 1, 2 * I) and preact.dtype == torch.bfloat16
    assert torch.equal(preact[-1], torch.zeros(2 * I, dtype=torch.bfloat16))
    checked = 0
    for m in range(7):
        for k in range(K):
            e = int(ids[m, k])
            if 0 <= e < E:
                want = x[m].float() @ w13[e].float().t() + b13[e].float()
                assert rel_err(preact[m * K + k].float(), want) <= 1e-2, (m, k)
                checked += 1
    assert checked == 7 * K - 2


@pytest.mark.parametrize("activation, bias", [("swiglu", False), ("swigluoai", True)])
def test_backward_from_saved_preactivations_equals_the_recomputing_one(activation, bias):
    """moe_backward reading preact_torch's rows gives the gradients of the recomputing backward
    (float64: equal to rounding), and fused_moe_train's gradients match fp32 autograd of the
    reference within 1e-2."""
    from moe_aot.integrations.autograd import preact_torch

    gen = torch.Generator().manual_seed(20)
    x, w13, w2, tw, ids, b13, b2 = _inputs(9, torch.float64, gen, bias)
    g = torch.randn(9, H, generator=gen, dtype=torch.float64)
    want = moe_backward(g, x, w13, w2, tw, ids, activation, 16, b13, b2)
    got = moe_backward(g, x, w13, w2, tw, ids, activation, 16, b13, b2, preact_torch(x, w13, ids, b13))
    for a, b in zip(got, want):
        assert (a is None and b is None) or torch.allclose(a, b, rtol=1e-12, atol=1e-12)
    bf = [t.to(torch.bfloat16) if t is not None else None for t in (x, w13, w2, b13, b2)]
    ours = [bf[0], bf[1], bf[2], tw.float()] + ([bf[3], bf[4]] if bias else [])
    ours = [t.clone().requires_grad_() for t in ours]
    out, preact = torch.ops.moe_aot.fused_moe_train(*ours[:4], ids, activation, *ours[4:])
    assert not preact.requires_grad
    grads = torch.autograd.grad(out, ours, g.to(torch.bfloat16))
    ref = [t.detach().float().requires_grad_() for t in ours]
    ref_grads = torch.autograd.grad(moe_reference(*ref[:4], ids, activation, 16, *ref[4:]), ref, g.float())
    for name, a, b in zip(["x", "w13", "w2", "topk_weights", "w13_bias", "w2_bias"], grads, ref_grads):
        assert rel_err(a, b) <= 1e-2, name


def test_train_op_saves_its_inputs_and_the_preactivations_only():
    saved, ins, (_, preact) = _saved_by(torch.ops.moe_aot.fused_moe_train, 21)
    assert saved <= {t.data_ptr() for t in ins + [preact]}


def test_opcheck_of_the_train_op_with_gradients():
    gen = torch.Generator().manual_seed(22)
    x, w13, w2, tw, ids, b13, b2 = _inputs(5, torch.float32, gen, bias=True)
    bf = [t.to(torch.bfloat16).requires_grad_() for t in (x, w13, w2)] + [tw.requires_grad_()]
    torch.library.opcheck(torch.ops.moe_aot.fused_moe_train.default, (*bf, ids))
    biases = [t.to(torch.bfloat16).requires_grad_() for t in (b13, b2)]
    torch.library.opcheck(torch.ops.moe_aot.fused_moe_train.default, (*bf, ids, "swigluoai", *biases))


def test_training_kernels_are_the_persistent_gemm1s_with_the_preactivation_output(tmp_path):
    """variants.training_kernels: the variant's GEMM1 plus save_preact, for hopws / hoppp only;
    its compiled kernel takes the preact tensor (and the forward's kernel does not)."""
    from moe_aot.compiler import build_template
    from moe_aot.kernel_build import compile_kernel
    from moe_aot.spec import make_spec
    from moe_aot.variants import GemmTiles, LayerVariant, training_kernels

    spec = make_spec(experts=8, top_k=2, hidden=256, intermediate=128, activation="swigluoai", bias=True,
                     target="sm_90a")
    assert training_kernels(spec, LayerVariant(64, GemmTiles(128, 64, 4, "warp"), GemmTiles(128, 64, 4, "warp"))) == []
    v = LayerVariant(64, GemmTiles(256, 64, 4, "hoppp"), GemmTiles(256, 64, 4, "hoppp"), pdl=True)
    (kv,) = training_kernels(spec, v)
    glu = v.kernels(spec)[1]
    assert kv.role == "glu_train" and kv.name == glu.name + "_preact"
    assert kv.params == glu.params + (("save_preact", True),)
    art = compile_kernel(build_template(kv), "sm_90a", kv.name)
    assert [a["name"] for a in art.meta["args"]] == ["x", "w13", "sorted_ids", "tile_expert", "h", "b13", "preact",
                                                     "stream"]
    # per accumulator row (two per thread) four 16-byte stores of h and eight of preact
    assert art.ptx.count("st.global.v4") == 2 * (4 + 8)
    assert ".local" not in art.ptx
    with pytest.raises(ValueError, match="pre-activation output is built for"):
        build_template(dataclasses_replace_params(kv, mma="warp"))


def dataclasses_replace_params(kv, **kw):
    from moe_aot.variants import KernelVariant

    return KernelVariant(kv.role, kv.name, tuple((k, kw.get(k, v)) for k, v in kv.params))
