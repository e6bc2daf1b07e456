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


def test_backward_saves_only_the_inputs():
    """No activation is saved: what autograd keeps for the op is the op's own input tensors."""
    gen = torch.Generator().manual_seed(14)
    x, w13, w2, tw, ids, _, _ = _inputs(6, torch.float32, gen)
    ins = [t.to(torch.bfloat16).requires_grad_() for t in (x, w13, w2)] + [tw.requires_grad_()]
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        torch.ops.moe_aot.fused_moe(*ins, ids)
    assert {t.data_ptr() for t in saved} <= {t.data_ptr() for t in ins + [ids]}


def test_no_gradient_asked_for_ids_or_unused_inputs():
    gen = torch.Generator().manual_seed(15)
    x, w13, w2, tw, ids, _, _ = _inputs(4, torch.float32, gen)
    xb = x.to(torch.bfloat16).requires_grad_()
    out = torch.ops.moe_aot.fused_moe(xb, w13.to(torch.bfloat16), w2.to(torch.bfloat16), tw, ids)
    out.sum().backward()
    assert xb.grad is not None and torch.isfinite(xb.grad.float()).all()
