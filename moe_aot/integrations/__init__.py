"""Framework integrations of the fused MoE layer (design.md, "Integration levels").

Level 1: torch.ops.moe_aot.fused_moe and fused_moe_routed (op.py) and the vLLM/SGLang-style
fused_experts (functional.py). Level 2: MoeExperts, Router, GatedMLP, MoeBlock (modules.py) and
moe_aot.integrations.transformers.patch(model). Routing conventions: routing.py.
"""
from .functional import PREPARED, fused_experts, prepare_fused_gate_up
from .modules import GatedMLP, MoeBlock, MoeExperts, Router
from .op import check_op_inputs, fused_moe
from .routing import grouped_topk, map_experts, softmax_topk, topk_softmax

__all__ = ["PREPARED", "GatedMLP", "MoeBlock", "MoeExperts", "Router", "check_op_inputs", "fused_experts",
           "fused_moe", "grouped_topk", "map_experts", "prepare_fused_gate_up", "softmax_topk", "topk_softmax"]
