"""Routing conventions of the models we integrate, as plain sync-free torch ops.

Each returns (topk_weights fp32 [M, top_k], topk_ids int32 [M, top_k]) ready for the fused op.
Nothing here reads a value back to the host (no .item(), no .tolist(), no data-dependent shape),
so every function runs inside torch.compile(fullgraph=True) and CUDA-graph capture.

Built in:
- softmax_topk: softmax over all experts, then top-k, optionally renormalised to sum to 1
  (Qwen2-MoE, Qwen3-MoE with norm_topk_prob; Mixtral always renormalises).
- topk_softmax: top-k of the logits, then softmax over the k chosen (GPT-OSS).
- grouped_topk: sigmoid scores, e_score_correction_bias added for the choice only, experts chosen
  within the topk_group best of n_group groups (a group's score is the sum of its two best),
  weights are the unbiased scores, optionally renormalised, times routed_scaling_factor
  (DeepSeek-V3).
- map_experts: a global-to-local expert id map for expert parallelism.
"""
from __future__ import annotations

import torch

from ..runtime.library import KernelArgumentError

ROUTINGS = ("softmax_topk", "topk_softmax", "grouped_topk")


def _check_logits(logits: torch.Tensor, top_k: int) -> None:
    if not isinstance(logits, torch.Tensor) or logits.dim() != 2 or not logits.is_floating_point():
        raise KernelArgumentError("router logits must be a floating-point [tokens, experts] tensor")
    if not isinstance(top_k, int) or not 0 < top_k <= logits.shape[1]:
        raise KernelArgumentError(f"top_k must be an integer in [1, {logits.shape[1]}] (the number of "
                                  f"experts), got {top_k!r}")


def softmax_topk(logits: torch.Tensor, top_k: int, renormalize: bool = False):
    """Softmax (fp32) over all experts, then the top_k largest; renormalize divides them by their sum."""
    _check_logits(logits, top_k)
    probs = torch.softmax(logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids.to(torch.int32)


def topk_softmax(logits: torch.Tensor, top_k: int):
    """The top_k largest logits, then softmax (fp32) over those k."""
    _check_logits(logits, top_k)
    top, ids = torch.topk(logits, top_k, dim=-1)
    return torch.softmax(top.float(), dim=-1), ids.to(torch.int32)


def grouped_topk(logits: torch.Tensor, top_k: int, n_group: int, topk_group: int,
                 e_score_correction_bias: torch.Tensor | None = None, renormalize: bool = True,
                 routed_scaling_factor: float = 1.0):
    """DeepSeek-V3's routing: sigmoid scores; the bias shifts which experts are chosen but not their
    weights; only experts of the topk_group best groups (a group scores the sum of its two best
    biased scores) can be chosen."""
    _check_logits(logits, top_k)
    E = logits.shape[1]
    if not isinstance(n_group, int) or n_group <= 0 or E % n_group:
        raise KernelArgumentError(f"n_group must be a positive integer dividing the {E} experts, got {n_group!r}")
    per_group = E // n_group
    if not isinstance(topk_group, int) or not 0 < topk_group <= n_group:
        raise KernelArgumentError(f"topk_group must be an integer in [1, n_group={n_group}], got {topk_group!r}")
    if top_k > topk_group * per_group:
        raise KernelArgumentError(f"top_k ({top_k}) must not exceed the experts of the chosen groups "
                                  f"(topk_group * experts per group = {topk_group * per_group})")
    if per_group < 2:
        raise KernelArgumentError(f"grouped_topk scores a group by its two best experts, so groups need at "
                                  f"least 2 experts; {E} experts in {n_group} groups have {per_group}")
    scores = torch.sigmoid(logits.float())
    choice = scores
    if e_score_correction_bias is not None:
        if e_score_correction_bias.shape != (E,):
            raise KernelArgumentError(f"e_score_correction_bias must have shape ({E},), got "
                                      f"{tuple(e_score_correction_bias.shape)}")
        choice = scores + e_score_correction_bias.float()
    group_scores = choice.view(-1, n_group, per_group).topk(2, dim=-1)[0].sum(dim=-1)
    group_idx = torch.topk(group_scores, topk_group, dim=-1, sorted=False)[1]
    group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1.0)
    expert_mask = group_mask.unsqueeze(-1).expand(-1, n_group, per_group).reshape(-1, E)
    choice = choice.masked_fill(expert_mask == 0, float("-inf"))
    ids = torch.topk(choice, top_k, dim=-1, sorted=False)[1]
    weights = scores.gather(1, ids)
    if renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * routed_scaling_factor, ids.to(torch.int32)


def map_experts(topk_ids: torch.Tensor, expert_map: torch.Tensor) -> torch.Tensor:
    """Global expert ids -> this rank's local ids through expert_map ([global experts] int, -1 for
    experts held by other ranks). Ids outside [0, global experts) also become -1; the kernels drop
    every id outside [0, local experts), so non-local pairs contribute nothing."""
    if not isinstance(expert_map, torch.Tensor) or expert_map.dim() != 1 or expert_map.is_floating_point():
        raise KernelArgumentError("expert_map must be a 1-D integer tensor [global experts] of local ids "
                                  "(-1: not local)")
    if expert_map.device != topk_ids.device:
        raise KernelArgumentError(f"expert_map must be on {topk_ids.device} like topk_ids, got {expert_map.device}")
    ids = topk_ids.long()
    valid = (ids >= 0) & (ids < expert_map.shape[0])
    local = expert_map.to(torch.int32)[ids.clamp(0, expert_map.shape[0] - 1)]
    return torch.where(valid, local, torch.full_like(local, -1))
