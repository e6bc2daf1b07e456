"""The integration levels on the CPU: the custom op (registration, fake tensors, opcheck,
torch.compile), fused_experts and its cache, the routing conventions, shared experts and
expert_map against straightforward references, MoeExperts loading, and the transformers patch
(on stand-in blocks; on real tiny transformers models where transformers is installed)."""
from __future__ import annotations

import gc
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from moe_aot.harness.reference import moe_reference, rel_err, row_rel_err
from moe_aot.integrations import (
    PREPARED,
    GatedMLP,
    MoeBlock,
    MoeExperts,
    Router,
    fused_experts,
    grouped_topk,
    map_experts,
    softmax_topk,
    topk_softmax,
)
from moe_aot.integrations.transformers import PatchError, patch
from moe_aot.runtime.layer import prepare_biases, prepare_weights
from moe_aot.runtime.library import KernelArgumentError

sys.path.insert(0, str(Path(__file__).parent))
import moe_fakes  # noqa: E402

E, K, H, I = 8, 2, 64, 32


def weights(E=E, H=H, I=I, seed=0):
    g = torch.Generator().manual_seed(seed)
    gate, up = (torch.randn(E, I, H, generator=g) * H ** -0.5 for _ in range(2))
    down = torch.randn(E, H, I, generator=g) * I ** -0.5
    return gate.bfloat16(), up.bfloat16(), down.bfloat16()


def inputs(M=6, E=E, K=K, seed=1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, H, generator=g).bfloat16()
    tw, ids = softmax_topk(torch.randn(M, E, generator=g), K, renormalize=True)
    return x, tw, ids


def ffn_loop(x, gate, up, down, tw, ids):
    """The layer one pair at a time in fp32 (ids outside [0, E) skipped)."""
    out = torch.zeros(x.shape[0], down.shape[1])
    for m in range(x.shape[0]):
        for k in range(ids.shape[1]):
            e = int(ids[m, k])
            if 0 <= e < gate.shape[0]:
                xm = x[m].float()
                h = F.silu(gate[e].float() @ xm) * (up[e].float() @ xm)
                out[m] += tw[m, k].float() * (down[e].float() @ h)
    return out


# -- level 1: the op ---------------------------------------------------------------------------
def test_op_is_registered_and_matches_a_plain_loop():
    gate, up, down = weights()
    x, tw, ids = inputs()
    ids[0, 1] = -1  # dropped
    ids[3, 0] = E + 2  # dropped
    out = torch.ops.moe_aot.fused_moe(x, prepare_weights(gate, up), down, tw, ids)
    assert out.dtype == torch.bfloat16 and out.shape == (6, H)
    assert row_rel_err(out, ffn_loop(x, gate, up, down, tw, ids)) < 1e-2


@pytest.mark.parametrize("M", [1, 7])
def test_opcheck_on_cpu(M):
    gate, up, down = weights()
    x, tw, ids = inputs(M)
    torch.library.opcheck(torch.ops.moe_aot.fused_moe.default, (x, prepare_weights(gate, up), down, tw, ids))
    torch.library.opcheck(torch.ops.moe_aot.fused_moe.default, (x, prepare_weights(gate, up), down, tw, ids),
                          {"activation": "geglu"})


def test_fake_and_meta_tensors_give_the_output_shape():
    from torch._subclasses.fake_tensor import FakeTensorMode

    gate, up, down = weights()
    x, tw, ids = inputs(5)
    w13 = prepare_weights(gate, up)
    with FakeTensorMode() as mode:
        fx, fw13, fdown, ftw, fids = (mode.from_tensor(t) for t in (x, w13, down, tw, ids))
        out = torch.ops.moe_aot.fused_moe(fx, fw13, fdown, ftw, fids)
        assert out.shape == (5, H) and out.dtype == torch.bfloat16
        with pytest.raises(KernelArgumentError, match="topk_ids must be torch.int32"):
            torch.ops.moe_aot.fused_moe(fx, fw13, fdown, ftw, fids.long())
    meta = [t.to("meta") for t in (x, w13, down, tw, ids)]
    out = torch.ops.moe_aot.fused_moe(*meta)
    assert out.device.type == "meta" and out.shape == (5, H)


def test_bad_inputs_are_refused_with_one_sentence():
    gate, up, down = weights()
    x, tw, ids = inputs()
    w13 = prepare_weights(gate, up)
    op = torch.ops.moe_aot.fused_moe
    cases = [
        ((x.float(), w13, down, tw, ids), "x must be torch.bfloat16, got torch.float32"),
        ((x, w13, down, tw.bfloat16(), ids), "topk_weights must be torch.float32"),
        ((x, w13, down, tw, ids.long()), "topk_ids must be torch.int32, got torch.int64"),
        ((x[:, :32].contiguous(), w13, down, tw, ids), r"w13 must have shape \(experts, 2\*intermediate, 32\)"),
        ((x, w13, down[:, :, :16].contiguous(), tw, ids), r"w2 must have shape \(8, 64, 32\)"),
        ((x, w13, down, tw[:3].contiguous(), ids[:3].contiguous()), r"must both have shape \(6, top_k\)"),
        ((x, w13, down, tw, ids.t().contiguous().t()), "topk_ids must be contiguous"),
        ((x[0], w13, down, tw, ids), r"x must be a 2-D tensor, got shape \(64,\)"),
    ]
    for args, msg in cases:
        with pytest.raises(KernelArgumentError, match=msg) as exc:
            op(*args)
        assert str(exc.value).count(". ") == 0 and "\n" not in str(exc.value)
    with pytest.raises(KernelArgumentError, match="activation must be one of swiglu, geglu, swigluoai, got 'relu'"):
        op(x, w13, down, tw, ids, "relu")


@pytest.mark.parametrize("routing", ["softmax_topk", "topk_softmax", "grouped_topk"])
def test_routed_op_is_routing_then_the_op(routing):
    gate, up, down = weights(E=16)
    w13 = prepare_weights(gate, up)
    x = torch.randn(5, H).bfloat16()
    logits, bias = torch.randn(5, 16), torch.rand(16) * 0.1
    emap = torch.tensor([3, 2, 1, 0, -1, -1] + list(range(4, 14)), dtype=torch.int32)
    kw = dict(renormalize=True, n_group=4, topk_group=2, e_score_correction_bias=bias, routed_scaling_factor=2.5,
              expert_map=emap)
    got = torch.ops.moe_aot.fused_moe_routed(x, logits, w13, down, 4, routing, **kw)
    if routing == "softmax_topk":
        tw, ids = softmax_topk(logits, 4, True)
    elif routing == "topk_softmax":
        tw, ids = topk_softmax(logits, 4)
    else:
        tw, ids = grouped_topk(logits, 4, 4, 2, bias, True, 2.5)
    assert torch.equal(got, torch.ops.moe_aot.fused_moe(x, w13, down, tw, map_experts(ids, emap)))
    torch.library.opcheck(torch.ops.moe_aot.fused_moe_routed.default, (x, logits, w13, down, 4, routing), kw)
    with pytest.raises(KernelArgumentError, match="routing must be one of softmax_topk, topk_softmax, grouped_topk"):
        torch.ops.moe_aot.fused_moe_routed(x, logits, w13, down, 4, "sinkhorn")


class _Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        gate, up, down = weights(E=16)
        self.moe = MoeBlock(
            Router(torch.randn(16, H), 4, "grouped_topk", n_group=4, topk_group=2, logits_dtype=torch.float32,
                   e_score_correction_bias=torch.rand(16) * 0.1, renormalize=True, routed_scaling_factor=2.5),
            MoeExperts.from_gate_up(gate, up, down, expert_map=torch.tensor([-1, -1] + list(range(14)) + [14, 15])),
            shared=GatedMLP(*(w[0].float() for w in weights(E=1, I=48, seed=3))), shared_gate=torch.randn(1, H))

    def forward(self, h):
        return self.moe(h) * 2


def test_torch_compile_fullgraph_matches_eager():
    torch._dynamo.reset()
    block = _Block()
    h = torch.randn(2, 5, H)
    eager = block(h)
    compiled = torch.compile(block, fullgraph=True, backend="inductor")(h)
    assert compiled.shape == h.shape and compiled.dtype == h.dtype
    assert rel_err(compiled, eager.float()) < 1e-5
    # the routed op (composite: routing ops + fused_moe) traces into the same kind of graph
    gate, up, down = weights(E=16)
    w13, x, logits = prepare_weights(gate, up), torch.randn(7, H).bfloat16(), torch.randn(7, 16)

    def routed(x, logits):
        return torch.ops.moe_aot.fused_moe_routed(x, logits, w13, down, 4, "grouped_topk", True, 4, 2, None, 2.5)

    assert torch.equal(torch.compile(routed, fullgraph=True)(x, logits), routed(x, logits))


# -- fused_experts (vLLM / SGLang layout) -------------------------------------------------------
def test_fused_experts_takes_the_gate_first_layout_and_matches_the_op():
    gate, up, down = weights()
    x, tw, ids = inputs()
    w1 = torch.cat([gate, up], 1)
    ref = torch.ops.moe_aot.fused_moe(x, prepare_weights(gate, up), down, tw, ids)
    assert torch.equal(fused_experts(x, w1, down, tw, ids.long()), ref)  # int64 ids accepted
    assert torch.equal(fused_experts(x, w1, down, tw.bfloat16().float(), ids),
                       torch.ops.moe_aot.fused_moe(x, prepare_weights(gate, up), down, tw.bfloat16().float(), ids))
    assert rel_err(fused_experts(x, w1, down, tw, ids, routed_scaling_factor=2.5), ref.float() * 2.5) < 1e-2
    y = x.clone()
    assert fused_experts(y, w1, down, tw, ids, inplace=True) is y and torch.equal(y, ref)
    # swapping the halves (the kernels' gate read as up) must change the result
    assert rel_err(fused_experts(x, torch.cat([up, gate], 1), down, tw, ids), ref.float()) > 0.1


def test_fused_experts_caches_by_weight_and_forgets_it():
    gate, up, down = weights()
    x, tw, ids = inputs()
    PREPARED.clear()
    w1 = torch.cat([gate, up], 1)
    a = fused_experts(x, w1, down, tw, ids)
    prepared = PREPARED.get(w1)
    fused_experts(x, w1, down, tw, ids)
    assert len(PREPARED) == 1 and PREPARED.get(w1) is prepared
    with torch.no_grad():
        w1.mul_(2)  # an in-place update bumps the version: prepared again, result follows
    b = fused_experts(x, w1, down, tw, ids)
    assert PREPARED.get(w1) is not prepared and len(PREPARED) == 1
    assert rel_err(b, fused_experts(x, torch.cat([gate, up], 1) * 2, down, tw, ids).float()) == 0
    assert rel_err(b, a.float()) > 0.1
    del w1
    gc.collect()
    assert len(PREPARED) == 0


def test_fused_experts_under_inference_mode():
    """Inference tensors have no version counter; the cache still works on them."""
    gate, up, down = weights()
    x, tw, ids = inputs()
    PREPARED.clear()
    with torch.inference_mode():
        w1 = torch.cat([gate, up], 1)
        out = fused_experts(x, w1, down, tw, ids)
        assert PREPARED.get(w1) is PREPARED.get(w1) and len(PREPARED) == 1
    assert torch.equal(out, torch.ops.moe_aot.fused_moe(x, prepare_weights(gate, up), down, tw, ids))
    del w1
    gc.collect()
    assert len(PREPARED) == 0


def test_fused_experts_expert_map_and_refusals():
    gate, up, down = weights()
    x, tw, ids = inputs()
    w1 = torch.cat([gate, up], 1)
    # 16 global experts, this rank holds global 8..15 as local 0..7
    expert_map = torch.tensor([-1] * 8 + list(range(8)), dtype=torch.int32)
    out = fused_experts(x, w1, down, tw, ids + 8, global_num_experts=16, expert_map=expert_map)
    assert torch.equal(out, fused_experts(x, w1, down, tw, ids))
    assert fused_experts(x, w1, down, tw, ids, expert_map=expert_map).float().abs().max() == 0
    with pytest.raises(KernelArgumentError, match="use_fp8_w8a8 needs w1_scale and w2_scale"):
        fused_experts(x, w1, down, tw, ids, use_fp8_w8a8=True)
    with pytest.raises(KernelArgumentError, match="pass use_fp8_w8a8=True"):
        fused_experts(x, w1, down, tw, ids, w1_scale=torch.ones(E))
    with pytest.raises(KernelArgumentError, match="a1_scale asks for static activation scales"):
        fused_experts(x, w1, down, tw, ids, a1_scale=torch.ones(1))
    with pytest.raises(KernelArgumentError, match="expert biases come in pairs"):
        fused_experts(x, w1, down, tw, ids, w1_bias=torch.zeros(E, 2 * I))
    # gpt-oss through vLLM's form: w1_bias [E, 2I] gate half first, w2_bias [E, H], "swigluoai"
    gen = torch.Generator().manual_seed(3)
    b1, b2 = torch.randn(E, 2 * I, generator=gen), torch.randn(E, H, generator=gen)
    got = fused_experts(x, w1, down, tw, ids, activation="swigluoai", w1_bias=b1, w2_bias=b2)
    want = moe_reference(x, prepare_weights(gate, up), down, tw, ids, "swigluoai", 16,
                         prepare_biases(b1[:, :I].bfloat16(), b1[:, I:].bfloat16()), b2.bfloat16())
    assert row_rel_err(got.float(), want) < 1e-2
    assert fused_experts(x, w1, down, tw, ids, activation="swigluoai", w1_bias=b1, w2_bias=b2).equal(got)
    with pytest.raises(KernelArgumentError, match="unknown argument 'foo'"):
        fused_experts(x, w1, down, tw, ids, foo=1)
    with pytest.raises(KernelArgumentError, match="activation must be one of .*got 'gelu'"):
        fused_experts(x, w1, down, tw, ids, activation="gelu")
    with pytest.raises(KernelArgumentError, match=r"w1 must be an \[experts, 2\*intermediate, hidden\]"):
        fused_experts(x, w1[:, :-1], down, tw, ids)
    assert fused_experts(x, w1, down, tw, ids, use_fp8_w8a8=False, w1_scale=None).shape == x.shape


def test_fused_experts_router_weight_on_input():
    gate, up, down = weights()
    x, _, _ = inputs()
    tw = torch.rand(6, 1)
    ids = torch.randint(0, E, (6, 1), dtype=torch.int32)
    w1 = torch.cat([gate, up], 1)
    out = fused_experts(x, w1, down, tw, ids, apply_router_weight_on_input=True)
    xs = (x.float() * tw).bfloat16()
    assert row_rel_err(out, ffn_loop(xs, gate, up, down, torch.ones(6, 1), ids)) < 1e-2
    with pytest.raises(KernelArgumentError, match="apply_router_weight_on_input needs top_k == 1"):
        fused_experts(x, w1, down, *inputs()[1:], apply_router_weight_on_input=True)


# -- routing conventions ------------------------------------------------------------------------
def _by_id(w, ids):
    order = ids.long().argsort(-1)
    return w.gather(-1, order), ids.long().gather(-1, order)


@pytest.mark.parametrize("renormalize", [False, True])
def test_softmax_topk_against_a_loop(renormalize):
    logits = torch.randn(9, 16)
    w, ids = softmax_topk(logits, 4, renormalize)
    assert w.dtype == torch.float32 and ids.dtype == torch.int32
    for m in range(9):
        p = [torch.exp(v).item() for v in logits[m]]
        p = [v / sum(p) for v in p]
        best = sorted(range(16), key=lambda e: -p[e])[:4]
        want = [p[e] for e in best]
        if renormalize:
            want = [v / sum(want) for v in want]
        assert ids[m].tolist() == best
        assert torch.allclose(w[m], torch.tensor(want), rtol=1e-5)


def test_topk_softmax_against_a_loop():
    logits = torch.randn(5, 8)
    w, ids = topk_softmax(logits, 3)
    for m in range(5):
        best = sorted(range(8), key=lambda e: -logits[m, e].item())[:3]
        assert ids[m].tolist() == best
        assert torch.allclose(w[m], torch.softmax(logits[m, best], 0))


def test_grouped_topk_against_a_loop():
    torch.manual_seed(0)
    E_, G, TG, K_ = 32, 8, 3, 6
    logits, bias = torch.randn(11, E_), torch.rand(E_) * 0.2
    w, ids = grouped_topk(logits, K_, G, TG, bias, renormalize=True, routed_scaling_factor=2.5)
    w, ids = _by_id(w, ids)
    for m in range(11):
        s = torch.sigmoid(logits[m])
        c = s + bias
        gs = [sum(sorted(c[j * 4:(j + 1) * 4].tolist(), reverse=True)[:2]) for j in range(G)]
        groups = sorted(range(G), key=lambda j: -gs[j])[:TG]
        allowed = [e for e in range(E_) if e // 4 in groups]
        best = sorted(sorted(allowed, key=lambda e: -c[e].item())[:K_])
        want = s[best] / s[best].sum() * 2.5
        assert ids[m].tolist() == best
        assert torch.allclose(w[m], want, rtol=1e-5)
    # without the bias the choice differs for some token (the bias only moves the choice)
    _, ids0 = grouped_topk(logits, K_, G, TG, torch.ones(E_) * torch.arange(E_) * 0.1, renormalize=True)
    assert not torch.equal(_by_id(w, ids0)[1], ids)


def test_routing_refusals():
    with pytest.raises(KernelArgumentError, match="n_group must be a positive integer dividing the 10 experts"):
        grouped_topk(torch.randn(2, 10), 2, 3, 1)
    with pytest.raises(KernelArgumentError, match=r"top_k \(9\) must not exceed the experts of the chosen groups"):
        grouped_topk(torch.randn(2, 16), 9, 4, 2)
    with pytest.raises(KernelArgumentError, match=r"top_k must be an integer in \[1, 8\]"):
        softmax_topk(torch.randn(2, 8), 9)
    with pytest.raises(KernelArgumentError, match="routing must be one of"):
        Router(torch.randn(8, H), 2, "sinkhorn")


def test_map_experts_against_a_loop():
    emap = torch.tensor([3, -1, 0, -1, 1, 2], dtype=torch.int32)
    ids = torch.tensor([[0, 1], [2, 5], [4, 7], [-2, 3]], dtype=torch.int32)
    want = [[emap[e].item() if 0 <= e < 6 else -1 for e in row] for row in ids.tolist()]
    assert map_experts(ids, emap).tolist() == want


def test_expert_parallel_ranks_sum_to_the_whole_layer():
    gate, up, down = weights(E=8)
    x, tw, ids = inputs(M=10, E=8, K=3)
    whole = MoeExperts.from_gate_up(gate, up, down)(x, tw, ids)
    parts = []
    for rank in range(2):  # global experts 4*rank..4*rank+3 are local 0..3
        emap = torch.full((8,), -1, dtype=torch.int32)
        emap[4 * rank:4 * rank + 4] = torch.arange(4, dtype=torch.int32)
        sl = slice(4 * rank, 4 * rank + 4)
        parts.append(MoeExperts.from_gate_up(gate[sl], up[sl], down[sl], expert_map=emap)(x, tw, ids).float())
    assert rel_err(parts[0] + parts[1], whole.float()) < 1e-2
    assert rel_err(parts[0], whole.float()) > 0.2


@pytest.mark.parametrize("shape", [(0, H), (2, 0, H), (0, 3, H)])
def test_empty_batch_gives_an_empty_output(shape):
    """No tokens (a rank nobody routed to, an empty step) is a shape: the modules, the op and the
    references return an empty output of the input's shape and dtype."""
    gate, up, down = weights()
    w13 = prepare_weights(gate, up)
    x = torch.zeros(shape, dtype=torch.float32)
    tw, ids = torch.zeros(*shape[:-1], K), torch.zeros(*shape[:-1], K, dtype=torch.int32)
    out = MoeExperts(w13, down)(x, tw, ids)
    assert out.shape == shape and out.dtype == torch.float32
    bias = MoeExperts(w13, down, "swigluoai", b13=torch.zeros(E, 2 * I).bfloat16(), b2=torch.zeros(E, H).bfloat16())
    assert bias(x, tw, ids).shape == shape
    x0, tw0, ids0 = x.reshape(0, H).bfloat16(), tw.reshape(0, K), ids.reshape(0, K)
    assert moe_reference(x0, w13, down, tw0, ids0).shape == (0, H)
    assert torch.ops.moe_aot.fused_moe(x0, w13, down, tw0, ids0).shape == (0, H)
    block = MoeBlock(Router(torch.randn(E, H), K), MoeExperts(w13, down))
    assert block(x).shape == shape


def test_moe_block_with_gated_shared_expert_against_a_loop():
    gate, up, down = weights()
    sg, su, sd = (w[0].float() for w in weights(E=1, I=48, seed=4))
    rw, sgate = torch.randn(E, H), torch.randn(1, H)
    block = MoeBlock(Router(rw, K, "softmax_topk"), MoeExperts.from_gate_up(gate, up, down),
                     shared=GatedMLP(sg, su, sd), shared_gate=sgate)
    h = torch.randn(3, 4, H).bfloat16().float()
    out = block(h)
    x = h.reshape(-1, H)
    tw, ids = softmax_topk(x @ rw.t(), K)
    want = ffn_loop(x.bfloat16(), gate, up, down, tw, ids)
    for m in range(x.shape[0]):
        want[m] += torch.sigmoid(sgate[0] @ x[m]) * (sd @ (F.silu(sg @ x[m]) * (su @ x[m])))
    assert out.shape == h.shape
    assert row_rel_err(out.reshape(-1, H), want) < 1e-2


def test_moe_experts_loads_every_checkpoint_layout():
    gate, up, down = weights()
    ref = MoeExperts.from_gate_up(gate, up, down)
    layouts = [
        {"mlp.experts.gate_up_proj": torch.cat([gate, up], 1), "mlp.experts.down_proj": down},
        {f"mlp.experts.{e}.{n}.weight": w[e] for e in range(E)
         for n, w in (("gate_proj", gate), ("up_proj", up), ("down_proj", down))},
        {f"mlp.experts.{e}.{n}.weight": w[e] for e in range(E) for n, w in (("w1", gate), ("w3", up), ("w2", down))},
    ]
    for sd in layouts:
        sd["mlp.gate.weight"] = torch.zeros(E, H)  # other tensors of the block are ignored
        got = MoeExperts.from_state_dict(sd, "mlp.experts.")
        assert torch.equal(got.w13, ref.w13) and torch.equal(got.w2, ref.w2)
    bad = dict(layouts[1])
    del bad["mlp.experts.3.up_proj.weight"]
    with pytest.raises(KernelArgumentError, match="missing mlp.experts.3.up_proj.weight"):
        MoeExperts.from_state_dict(bad, "mlp.experts.")
    with pytest.raises(KernelArgumentError, match="no expert weights under 'other.'"):
        MoeExperts.from_state_dict(layouts[0], "other.")


# -- transformers patch, on stand-in blocks -----------------------------------------------------
@pytest.mark.parametrize("cls", ["Qwen3MoeSparseMoeBlock", "Qwen2MoeSparseMoeBlock", "MixtralSparseMoeBlock",
                                 "DeepseekV3MoE"])
def test_patch_replaces_known_blocks_with_the_same_function(cls):
    torch.manual_seed(0)
    model = moe_fakes.Decoder(getattr(moe_fakes, cls)(), getattr(moe_fakes, cls)())
    h = torch.randn(2, 3, H)
    with torch.no_grad():
        ref = [layer.mlp(h) for layer in model.layers]
        assert patch(model) == ["layers.0.mlp", "layers.1.mlp"]
        got = [layer.mlp(h) for layer in model.layers]
    assert all(isinstance(layer.mlp, MoeBlock) for layer in model.layers)
    for r, g in zip(ref, got):
        assert row_rel_err(g.reshape(-1, H), r.reshape(-1, H)) < 1.5e-2


def test_convert_one_block():
    from moe_aot.integrations.transformers import convert

    torch.manual_seed(0)
    block = moe_fakes.DeepseekV3MoE()
    h = torch.randn(5, H)
    with torch.no_grad():
        assert row_rel_err(convert(block)(h), block(h)) < 1.5e-2
    mixtral = moe_fakes.MixtralSparseMoeBlock()
    with pytest.raises(PatchError, match=r"carries no config: pass the model's, convert\(block, model.config\)"):
        convert(mixtral)
    assert isinstance(convert(mixtral, moe_fakes.Decoder().config), MoeBlock)
    with pytest.raises(PatchError, match="hidden_act 'gelu' has no moe-aot kernel"):
        convert(mixtral, moe_fakes.Decoder(hidden_act="gelu").config)
    with pytest.raises(PatchError, match="UnknownSparseMoeBlock is not a MoE block convert"):
        convert(moe_fakes.UnknownSparseMoeBlock())


def test_patch_refuses_unknown_and_gpt_oss_blocks_before_replacing_anything():
    model = moe_fakes.Decoder(moe_fakes.MixtralSparseMoeBlock(), moe_fakes.UnknownSparseMoeBlock())
    with pytest.raises(PatchError, match=r"layers.1.mlp \(UnknownSparseMoeBlock\) looks like a MoE block that "
                                         r"patch\(\) does not know; known blocks: Qwen3MoeSparseMoeBlock"):
        patch(model)
    assert isinstance(model.layers[0].mlp, moe_fakes.MixtralSparseMoeBlock)
    model = moe_fakes.Decoder(moe_fakes.MixtralSparseMoeBlock(), moe_fakes.GptOssMLP())
    with pytest.raises(PatchError, match=r"layers.1.mlp \(GptOssMLP\) is a GPT-OSS block and gpt_oss='refuse'"):
        patch(model, gpt_oss="refuse")
    assert isinstance(model.layers[0].mlp, moe_fakes.MixtralSparseMoeBlock)
    assert patch(model, gpt_oss="keep") == ["layers.0.mlp"]
    assert isinstance(model.layers[1].mlp, moe_fakes.GptOssMLP)
    with pytest.raises(PatchError, match="has no sparse-MoE block"):
        patch(torch.nn.Sequential(torch.nn.Linear(4, 4)))
    model = moe_fakes.Decoder(moe_fakes.MixtralSparseMoeBlock(), hidden_act="relu")
    with pytest.raises(PatchError, match="hidden_act 'relu' has no moe-aot kernel"):
        patch(model)
    assert isinstance(model.layers[0].mlp, moe_fakes.MixtralSparseMoeBlock)
    model = moe_fakes.Decoder(moe_fakes.MixtralSparseMoeBlock())
    del model.config
    with pytest.raises(PatchError, match="neither the block nor the model has a config"):
        patch(model)
    assert patch(moe_fakes.Decoder(moe_fakes.MixtralSparseMoeBlock())) == ["layers.0.mlp"]


# -- transformers patch, on tiny real models (where transformers is installed) ------------------
HF_FAMILIES = ["qwen3_moe", "qwen2_moe", "mixtral", "deepseek_v3", "gpt_oss"]


@pytest.mark.parametrize("family", HF_FAMILIES)
def test_patched_transformers_model_matches_unpatched(family):
    pytest.importorskip("transformers")
    from hf_tiny import moe_block_io, tiny_model

    model = tiny_model(family, 8, 2, H, I)
    tokens = torch.randint(0, 512, (4, 64), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref, blocks_in = moe_block_io(model, lambda: model(tokens).logits)
    names = patch(model)
    assert names and all(n in blocks_in for n in names)
    with torch.no_grad():
        for name in names:  # each block on the very input the original saw
            x, want = blocks_in[name]
            got = model.get_submodule(name)(x)
            if isinstance(want, tuple):  # GPT-OSS's blocks return (hidden_states, router_scores)
                assert torch.allclose(got[1].float(), want[1].float(), atol=1e-6), name
                got, want = got[0], want[0]
            assert row_rel_err(got.reshape(-1, H), want.reshape(-1, H)) < 1.5e-2, name
        out = model(tokens).logits
    assert rel_err(out, ref) <= 2e-2
    assert (out.argmax(-1) == ref.argmax(-1)).float().mean() >= 0.97


def test_gpt_oss_reference_is_transformers_gpt_oss_experts():
    """The fp32 reference the kernels are checked against computes transformers' GptOssExperts
    (clamped SwiGLU, biases in both GEMMs) on its own weights, clamps included; the converted
    experts' CPU op agrees to bf16 rounding; other alpha/limit values are refused."""
    pytest.importorskip("transformers")
    from hf_tiny import tiny_model

    from moe_aot.harness.reference import moe_reference, row_rel_err
    from moe_aot.integrations.modules import MoeExperts
    from moe_aot.integrations.transformers import convert

    model = tiny_model("gpt_oss", 8, 2, H, I, expert_scale=3.0)  # large sums: both clamps bite
    block = model.model.layers[0].mlp
    e = block.experts
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        e.gate_up_proj_bias.normal_(0, 1.0, generator=gen)
        e.down_proj_bias.normal_(0, 0.5, generator=gen)
        x = torch.randn(24, H, generator=gen)
        _, scores, ids = block.router(x)
        want = e(x, ids, scores)
        gu = x @ e.gate_up_proj[0] + e.gate_up_proj_bias[0]
        assert (gu[:, 0::2] > 7).any() and (gu[:, 1::2].abs() > 7).any()  # the clamps are exercised
        ex = MoeExperts.from_gpt_oss(e.gate_up_proj.float(), e.gate_up_proj_bias.float(), e.down_proj.float(),
                                     e.down_proj_bias.float())
        w13 = torch.cat([e.gate_up_proj[..., 0::2], e.gate_up_proj[..., 1::2]], -1).transpose(1, 2)
        from moe_aot.runtime.layer import prepare_biases, prepare_weights
        w13 = prepare_weights(w13[:, :I].contiguous(), w13[:, I:].contiguous())
        b13 = prepare_biases(e.gate_up_proj_bias[:, 0::2].contiguous(), e.gate_up_proj_bias[:, 1::2].contiguous())
        ref = moe_reference(x, w13, e.down_proj.transpose(1, 2), scores, ids.int(), "swigluoai", 16, b13,
                            e.down_proj_bias)
        assert row_rel_err(ref, want) < 1e-5
        got = ex(x, scores, ids)
        assert row_rel_err(got.float(), want) < 2e-2
        assert ex.activation == "swigluoai" and "biases" in repr(ex)
        out, router_scores = convert(block, model.config)(x[None])
        assert row_rel_err(out[0].float(), want) < 2e-2 and torch.equal(router_scores.float(), scores.float())
        e.limit = 8.0
        with pytest.raises(PatchError, match="alpha 1.702 and limit 7.0 only, this block has alpha 1.702 and limit 8"):
            convert(block, model.config)


# -- the README's examples run as written -------------------------------------------------------
@pytest.mark.parametrize("name", ["level1", "level2", "training"])
def test_readme_example_runs(name):
    import re

    text = (Path(__file__).parent.parent / "README.md").read_text()
    m = re.search(rf"<!-- example: {name} -->\n```python\n(.*?)```", text, re.S)
    assert m, f"README has no example {name}"
    torch._dynamo.reset()
    exec(compile(m.group(1), f"README:{name}", "exec"), {})


def _fp8_vllm_weights(block: bool):
    """vLLM's fp8 layout of random weights: w1 = [gate; up] e4m3 with w1_scale ([E] per expert, or
    [E, 2I/128, H/128] per block, gate blocks first), w2 e4m3 with w2_scale; and ours."""
    from moe_aot.runtime import fp8

    torch.manual_seed(3)
    e, h, i = 4, 256, 256
    gate, up = torch.randn(e, i, h) / h ** 0.5, torch.randn(e, i, h) / h ** 0.5
    down = torch.randn(e, h, i) / i ** 0.5
    if block:
        (gq, gs), (uq, us), (dq, ds) = (fp8.quantize_blocks(w) for w in (gate, up, down))
        w1, w1s = torch.cat([gq, uq], 1), torch.cat([gs, us], 1)
        ours = fp8.from_block128_checkpoint(gq, gs, uq, us, dq, ds)
        return w1, w1s, dq, ds, ((ours[0], ours[1]), (ours[2], ours[3])), "fp8-block128"
    q1, s1 = fp8.quantize_tensor(torch.cat([gate, up], 1))  # one scale for gate and up, as vLLM keeps it
    dq, ds = fp8.quantize_tensor(down)
    g, u = q1.view(torch.uint8).chunk(2, 1)
    from moe_aot.layout import interleave_gate_up

    w13 = interleave_gate_up(g, u).view(fp8.E4M3)
    return q1, s1, dq, ds, ((w13, torch.stack([s1, s1], 1)), (dq, ds)), "fp8"


@pytest.mark.parametrize("block", [False, True])
def test_fused_experts_fp8_on_vllm_layout(block):
    """use_fp8_w8a8 with vLLM's fp8 weights (per expert, or 128x128 blocks with block_shape) is
    the fp8 layer on them: on the CPU, the op's reference of the fp8 math, equal to the reference
    on the same weights prepared by moe-aot's own functions."""
    from moe_aot.harness import fp8 as fp8_ref

    w1, w1s, w2, w2s, (w13, w2p), precision = _fp8_vllm_weights(block)
    m, k = 7, 2
    x = torch.randn(m, w1.shape[2]).bfloat16()
    ids = torch.stack([torch.randperm(w1.shape[0])[:k] for _ in range(m)]).int()
    tw = torch.softmax(torch.randn(m, k), -1)
    out = fused_experts(x, w1, w2, tw, ids, use_fp8_w8a8=True, w1_scale=w1s, w2_scale=w2s,
                        block_shape=[128, 128] if block else None)
    want = fp8_ref.moe_fp8_reference(x, w13, w2p, tw, ids, precision).to(torch.bfloat16)
    assert torch.equal(out, want)
    with pytest.raises(KernelArgumentError, match="block_shape must be"):
        fused_experts(x, w1, w2, tw, ids, use_fp8_w8a8=True, w1_scale=w1s, w2_scale=w2s, block_shape=[64, 64])
    with pytest.raises(KernelArgumentError, match="w1_scale .* must be"):
        fused_experts(x, w1, w2, tw, ids, use_fp8_w8a8=True, w1_scale=w1s[:1], w2_scale=w2s)
    with pytest.raises(KernelArgumentError, match="float8_e4m3fn"):
        fused_experts(x, w1.float(), w2, tw, ids, use_fp8_w8a8=True, w1_scale=w1s, w2_scale=w2s)


def test_fused_moe_fp8_op_checks_and_fake():
    from moe_aot.runtime import fp8

    _, _, _, _, ((w13, w13s), (w2, w2s)), _ = _fp8_vllm_weights(True)
    x = torch.randn(5, w13.shape[2]).bfloat16()
    ids = torch.zeros(5, 2, dtype=torch.int32)
    ids[:, 1] = 1
    tw = torch.full((5, 2), 0.5)
    with pytest.raises(KernelArgumentError, match="w13_scale .* and w2_scale .* must be"):
        torch.ops.moe_aot.fused_moe_fp8(x, w13, w13s[:, :1].contiguous(), w2, w2s, tw, ids)
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode() as mode:
        fx = mode.from_tensor(x)
        out = torch.ops.moe_aot.fused_moe_fp8(fx, mode.from_tensor(w13), mode.from_tensor(w13s),
                                              mode.from_tensor(w2), mode.from_tensor(w2s), mode.from_tensor(tw),
                                              mode.from_tensor(ids))
        assert out.shape == x.shape and out.dtype == torch.bfloat16
    assert fp8.FP8 == ("fp8", "fp8-block128")


def test_moe_experts_fp8_from_bf16_and_from_a_deepseek_state_dict():
    """MoeExperts keeps fp8 experts in e4m3 (quantized here, or DeepSeek-V3's per-expert
    weight + weight_scale_inv as shipped) and computes the fp8 layer: on the CPU the op's
    reference of the fp8 math, the same from either source."""
    from moe_aot.harness import fp8 as fp8_ref
    from moe_aot.integrations.modules import MoeExperts
    from moe_aot.runtime import fp8

    torch.manual_seed(5)
    e, h, i, m, k = 3, 256, 128, 5, 2
    gate, up = torch.randn(e, i, h) / h ** 0.5, torch.randn(e, i, h) / h ** 0.5
    down = torch.randn(e, h, i) / i ** 0.5
    mod = MoeExperts.from_fp8(gate, up, down, "fp8-block128")
    assert mod.fp8 and mod.w13.dtype == torch.float8_e4m3fn and "128x128 blocks" in repr(mod)
    sd = {}
    for n, w in (("gate_proj", gate), ("up_proj", up), ("down_proj", down)):
        q, sc = fp8.quantize_blocks(w)
        for ex in range(e):
            sd[f"layers.0.mlp.experts.{ex}.{n}.weight"] = q[ex]
            sd[f"layers.0.mlp.experts.{ex}.{n}.weight_scale_inv"] = sc[ex]
    loaded = MoeExperts.from_state_dict(sd, "layers.0.mlp.experts.")
    for name in ("w13", "w13_scale", "w2", "w2_scale"):
        a, b = getattr(mod, name), getattr(loaded, name)
        assert torch.equal(a.view(torch.uint8) if a.dtype == torch.float8_e4m3fn else a,
                           b.view(torch.uint8) if b.dtype == torch.float8_e4m3fn else b), name
    x = torch.randn(m, h).bfloat16()
    ids = torch.stack([torch.randperm(e)[:k] for _ in range(m)]).int()
    tw = torch.softmax(torch.randn(m, k), -1)
    want = fp8_ref.moe_fp8_reference(x, (mod.w13, mod.w13_scale), (mod.w2, mod.w2_scale), tw, ids, "fp8-block128")
    assert torch.equal(loaded(x, tw, ids), want.to(torch.bfloat16))
    with pytest.raises(KernelArgumentError, match="fp8 experts need"):
        MoeExperts(mod.w13, mod.w2)
    del sd["layers.0.mlp.experts.1.up_proj.weight_scale_inv"]
    with pytest.raises(KernelArgumentError, match="incomplete"):
        MoeExperts.from_state_dict(sd, "layers.0.mlp.experts.")
