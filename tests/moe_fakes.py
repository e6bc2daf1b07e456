"""Small stand-ins for transformers 5.x sparse-MoE blocks: the same class and attribute names
and a straightforward forward of each model's published math, so that patch() is tested without
transformers installed."""
from __future__ import annotations

import types

import torch
import torch.nn.functional as F
from torch import nn


class _Experts(nn.Module):
    def __init__(self, E, H, I):
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.randn(E, 2 * I, H) * H ** -0.5)
        self.down_proj = nn.Parameter(torch.randn(E, H, I) * I ** -0.5)

    def forward(self, x, ids, weights):  # one token, one pair at a time
        out = torch.zeros_like(x)
        I = self.down_proj.shape[2]
        for m in range(x.shape[0]):
            for k in range(ids.shape[1]):
                gu = self.gate_up_proj[ids[m, k]] @ x[m]
                out[m] += weights[m, k] * (self.down_proj[ids[m, k]] @ (F.silu(gu[:I]) * gu[I:]))
        return out


class _Router(nn.Module):
    def __init__(self, E, H, top_k, **attrs):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(E, H))
        self.top_k = top_k
        for k, v in attrs.items():
            setattr(self, k, v)


class _MLP(nn.Module):
    def __init__(self, H, I):
        super().__init__()
        self.gate_proj, self.up_proj = nn.Linear(H, I, bias=False), nn.Linear(H, I, bias=False)
        self.down_proj = nn.Linear(I, H, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def _softmax_route(router, x, renorm):
    p = torch.softmax(F.linear(x, router.weight).float(), -1)
    w, i = torch.topk(p, router.top_k, -1)
    return (w / w.sum(-1, keepdim=True) if renorm else w), i


class Qwen3MoeSparseMoeBlock(nn.Module):
    def __init__(self, E=8, K=2, H=64, I=32, norm_topk_prob=True):
        super().__init__()
        self.gate = _Router(E, H, K, norm_topk_prob=norm_topk_prob)
        self.experts = _Experts(E, H, I)

    def forward(self, h):
        x = h.reshape(-1, h.shape[-1])
        w, i = _softmax_route(self.gate, x, self.gate.norm_topk_prob)
        return self.experts(x, i, w).reshape(h.shape)


class Qwen2MoeSparseMoeBlock(Qwen3MoeSparseMoeBlock):
    def __init__(self, E=8, K=2, H=64, I=32, shared=48):
        super().__init__(E, K, H, I, norm_topk_prob=False)
        self.shared_expert = _MLP(H, shared)
        self.shared_expert_gate = nn.Linear(H, 1, bias=False)

    def forward(self, h):
        x = h.reshape(-1, h.shape[-1])
        return (super().forward(h).reshape(x.shape)
                + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)).reshape(h.shape)


class MixtralSparseMoeBlock(nn.Module):
    def __init__(self, E=8, K=2, H=64, I=32):
        super().__init__()
        self.gate = _Router(E, H, K)
        self.experts = _Experts(E, H, I)

    def forward(self, h):
        x = h.reshape(-1, h.shape[-1])
        w, i = _softmax_route(self.gate, x, True)
        return self.experts(x, i, w).reshape(h.shape)


class DeepseekV3MoE(nn.Module):
    def __init__(self, E=16, K=4, H=64, I=32, n_group=4, topk_group=2, scale=2.5):
        super().__init__()
        self.config = types.SimpleNamespace(hidden_act="silu")
        self.gate = _Router(E, H, K, num_group=n_group, topk_group=topk_group, norm_topk_prob=True,
                            routed_scaling_factor=scale)
        self.gate.register_buffer("e_score_correction_bias", torch.rand(E) * 0.1)
        self.experts = _Experts(E, H, I)
        self.shared_experts = _MLP(H, I)

    def forward(self, h):
        x = h.reshape(-1, h.shape[-1])
        g = self.gate
        E, G = g.weight.shape[0], g.num_group
        s = torch.sigmoid(F.linear(x.float(), g.weight.float()))
        ids = torch.empty(x.shape[0], g.top_k, dtype=torch.long)
        for m in range(x.shape[0]):  # per token, in plain steps
            c = s[m] + g.e_score_correction_bias
            groups = c.view(G, E // G)
            gscore = [sorted(groups[j].tolist(), reverse=True)[:2] for j in range(G)]
            best = sorted(range(G), key=lambda j: -sum(gscore[j]))[: g.topk_group]
            allowed = [e for e in range(E) if e // (E // G) in best]
            ids[m] = torch.tensor(sorted(allowed, key=lambda e: -c[e].item())[: g.top_k])
        w = s.gather(1, ids)
        w = w / w.sum(-1, keepdim=True) * g.routed_scaling_factor
        return (self.experts(x, ids, w) + self.shared_experts(x)).reshape(h.shape)


class GptOssMLP(nn.Module):
    def __init__(self, E=8, K=2, H=64, I=32):
        super().__init__()
        self.router = _Router(E, H, K)
        self.experts = _Experts(E, H, I)


class UnknownSparseMoeBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.gate = _Router(8, 64, 2)
        self.experts = _Experts(8, 64, 32)


class Decoder(nn.Module):
    """A model of `layers` blocks applied with residuals, with a config like transformers'."""

    def __init__(self, *blocks, hidden_act="silu"):
        super().__init__()
        self.config = types.SimpleNamespace(hidden_act=hidden_act)
        self.layers = nn.ModuleList(nn.Module() for _ in blocks)
        for layer, block in zip(self.layers, blocks):
            layer.mlp = block

    def forward(self, h):
        for layer in self.layers:
            h = h + layer.mlp(h)
        return h
