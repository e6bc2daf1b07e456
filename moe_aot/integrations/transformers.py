"""Level 2 for Hugging Face transformers 5.x: patch(model) swaps each sparse-MoE block for a
MoeBlock running the moe-aot kernels, built from the block's own weights and config.

Known blocks (transformers 5.x class names, attributes read):
- Qwen3MoeSparseMoeBlock: gate (weight, top_k, norm_topk_prob), experts (gate_up_proj, down_proj);
  softmax then top-k, renormalised when norm_topk_prob.
- Qwen2MoeSparseMoeBlock: the same, plus shared_expert (kept as is) and shared_expert_gate
  (sigmoid gate of the shared expert).
- MixtralSparseMoeBlock: gate (weight, top_k), experts; softmax, top-k, always renormalised.
  Router jitter noise (training only) is not applied.
- DeepseekV3MoE: gate (weight, top_k, num_group, topk_group, norm_topk_prob,
  routed_scaling_factor, e_score_correction_bias), experts, shared_experts (kept as is); sigmoid
  grouped top-k in fp32.
- GptOssMLP: router (weight, bias, top_k; top-k of the logits, then softmax over the k), experts
  (gate_up_proj [E, H, 2I] with gate/up in alternate columns, gate_up_proj_bias, down_proj,
  down_proj_bias, alpha, limit): the clamped SwiGLU "swigluoai" with biases in both GEMMs, for
  gpt-oss's published alpha 1.702 and limit 7.0 (others are refused). Like the original it
  returns (hidden_states, router_scores). gpt_oss="keep" leaves those blocks to transformers.

Any other module that looks like a MoE block (a child named experts beside a gate or router) is
refused with its name, so a model is never half-patched silently. The patched blocks are
inference only, compute the experts in bf16 and record no router logits (no auxiliary loss).
"""
from __future__ import annotations

import torch
from torch import nn

from ..gemm_limits import SWIGLUOAI_ALPHA, SWIGLUOAI_LIMIT
from ..runtime.library import KernelArgumentError
from .modules import MoeBlock, MoeExperts, Router

HIDDEN_ACTS = {"silu": "swiglu", "swish": "swiglu", "gelu_pytorch_tanh": "geglu"}
GPT_OSS = ("GptOssMLP",)


class PatchError(KernelArgumentError):
    """A model, or one of its blocks, that patch() cannot replace; one sentence says which and why."""


def _activation(config, where: str) -> str:
    act = getattr(config, "hidden_act", "silu")
    if act not in HIDDEN_ACTS:
        raise PatchError(f"{where}: hidden_act {act!r} has no moe-aot kernel (supported: {', '.join(HIDDEN_ACTS)})")
    return HIDDEN_ACTS[act]


def _experts(block, activation: str) -> MoeExperts:
    e = block.experts
    return MoeExperts.from_fused(e.gate_up_proj.detach(), e.down_proj.detach(), activation=activation)


def _qwen3(block, config, where):
    g = block.gate
    return MoeBlock(Router(g.weight, g.top_k, "softmax_topk", renormalize=bool(g.norm_topk_prob)),
                    _experts(block, _activation(config, where)))


def _qwen2(block, config, where):
    g = block.gate
    return MoeBlock(Router(g.weight, g.top_k, "softmax_topk", renormalize=bool(g.norm_topk_prob)),
                    _experts(block, _activation(config, where)), shared=block.shared_expert,
                    shared_gate=block.shared_expert_gate.weight)


def _mixtral(block, config, where):
    g = block.gate
    return MoeBlock(Router(g.weight, g.top_k, "softmax_topk", renormalize=True),
                    _experts(block, _activation(config, where)))


class GptOssBlock(MoeBlock):
    """GPT-OSS's MoE block: its decoder layers unpack (hidden_states, router_scores)."""

    def forward(self, hidden_states: torch.Tensor):
        shape = hidden_states.shape
        x = hidden_states.reshape(-1, shape[-1])
        topk_weights, topk_ids = self.router(x)
        return self.experts(x, topk_weights, topk_ids).reshape(shape), topk_weights


def _gpt_oss(block, config, where):
    r, e = block.router, block.experts
    alpha, limit = getattr(e, "alpha", None), getattr(e, "limit", None)
    if (alpha, limit) != (SWIGLUOAI_ALPHA, SWIGLUOAI_LIMIT):
        raise PatchError(f"{where}: the kernels compute gpt-oss's clamped SwiGLU for alpha {SWIGLUOAI_ALPHA} and "
                         f"limit {SWIGLUOAI_LIMIT} only, this block has alpha {alpha} and limit {limit}")
    return GptOssBlock(Router(r.weight, r.top_k, "topk_softmax", bias=r.bias),
                       MoeExperts.from_gpt_oss(e.gate_up_proj, e.gate_up_proj_bias, e.down_proj, e.down_proj_bias))


def _deepseek_v3(block, config, where):
    g = block.gate
    router = Router(g.weight, g.top_k, "grouped_topk", renormalize=bool(g.norm_topk_prob),
                    logits_dtype=torch.float32, n_group=g.num_group, topk_group=g.topk_group,
                    e_score_correction_bias=g.e_score_correction_bias,
                    routed_scaling_factor=float(g.routed_scaling_factor))
    return MoeBlock(router, _experts(block, _activation(config, where)), shared=block.shared_experts)


BLOCKS = {
    "Qwen3MoeSparseMoeBlock": _qwen3,
    "Qwen2MoeSparseMoeBlock": _qwen2,
    "MixtralSparseMoeBlock": _mixtral,
    "DeepseekV3MoE": _deepseek_v3,
    "GptOssMLP": _gpt_oss,
}


def convert(block: nn.Module, config=None) -> MoeBlock:
    """One known block -> its MoeBlock (the block is left as it is); config (for hidden_act)
    defaults to block.config, which only some blocks carry.
    Raises PatchError for an unknown block."""
    cls = type(block).__name__
    if cls not in BLOCKS:
        raise PatchError(f"{cls} is not a MoE block convert() knows; known blocks: {', '.join(BLOCKS)}")
    config = _config(block, config)
    if config is None:
        raise PatchError(f"{cls} carries no config: pass the model's, convert(block, model.config)")
    _activation(config, cls)
    return BLOCKS[cls](block, config, cls).train(False)


def _looks_like_moe(module: nn.Module) -> bool:
    children = dict(module.named_children())
    return "experts" in children and ("gate" in children or "router" in children)


def patch(model: nn.Module, gpt_oss: str = "patch") -> list[str]:
    """Replace every known sparse-MoE block of model in place; returns the replaced modules' names.

    gpt_oss: "patch" (default) replaces GPT-OSS blocks too; "keep" leaves them to transformers;
    "refuse" raises on them.
    Raises PatchError, before replacing anything, on an unknown MoE-looking block or when the model
    has no MoE block at all."""
    if gpt_oss not in ("patch", "refuse", "keep"):
        raise PatchError(f"gpt_oss must be 'patch', 'keep' or 'refuse', got {gpt_oss!r}")
    config = getattr(model, "config", None)
    targets, skip = [], ()
    for name, module in model.named_modules():
        if skip and any(name.startswith(p + ".") for p in skip):
            continue
        cls = type(module).__name__
        where = f"{name or 'model'} ({cls})"
        if isinstance(module, MoeBlock):
            skip += (name,)
        elif cls in GPT_OSS and gpt_oss != "patch":
            if gpt_oss == "refuse":
                raise PatchError(f"{where} is a GPT-OSS block and gpt_oss='refuse'; pass gpt_oss='patch' (the "
                                 "default) to replace it or 'keep' to leave it to transformers")
            skip += (name,)
        elif cls in BLOCKS:
            targets.append((name, module))
            skip += (name,)
        elif _looks_like_moe(module):
            raise PatchError(f"{where} looks like a MoE block that patch() does not know; known blocks: "
                             f"{', '.join(BLOCKS)}")
    if not targets:
        if skip:
            return []
        raise PatchError(f"{type(model).__name__} has no sparse-MoE block patch() knows ({', '.join(BLOCKS)})")
    for name, module in targets:  # every block's activation is checked before any is replaced
        if _config(module, config) is None:
            raise PatchError(f"{name} ({type(module).__name__}): neither the block nor the model has a config to "
                             "read hidden_act from")
        _activation(_config(module, config), f"{name} ({type(module).__name__})")
    names = []
    while targets:  # one block at a time: the original's weights can go before the next is prepared
        name, module = targets.pop(0)
        new = BLOCKS[type(module).__name__](module, _config(module, config), name)
        del module
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        new.train(False)
        setattr(parent, attr, new)
        names.append(name)
    return names


def _config(module, model_config):
    config = getattr(module, "config", None) or model_config
    return getattr(config, "text_config", None) or config
