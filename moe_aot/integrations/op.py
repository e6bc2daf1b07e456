"""Level 1: the fused MoE layer as a PyTorch custom op, `torch.ops.moe_aot.fused_moe`.

    out = torch.ops.moe_aot.fused_moe(x, w13, w2, topk_weights, topk_ids, activation="swiglu")

- x [M, H] bf16; w13 [E, 2I, H] bf16 from prepare_weights() (gate/up interleaved in blocks of
  16 rows); w2 [E, H, I] bf16; topk_weights [M, K] fp32; topk_ids [M, K] int32; out [M, H] bf16,
  a new tensor. Ids outside [0, E) contribute nothing. All tensors contiguous, on one device.
- CUDA: the AOT kernels from the database (runtime.layer.moe_forward), launched on the current
  stream with no host sync, so the op captures in CUDA graphs (warm up once at the largest token
  count first: that call loads the kernels and allocates the layer's workspace).
- CPU: the fp32 reference (harness.reference.moe_reference), rounded to bf16; it exists so that
  registration, fake tensors, opcheck and torch.compile can be tested without a GPU.
- Meta / fake tensors: the same checks, then an empty [M, H] bf16 output.
- Autograd: gradients for x, w13, w2, topk_weights and the biases (integrations/autograd.py: an
  unfused torch backward for now, sync-free and deterministic, saving only the op's inputs).
  fused_moe_fp8 has no backward (calling backward through it raises).

    out = torch.ops.moe_aot.fused_moe_fp8(x, w13, w13_scale, w2, w2_scale, topk_weights, topk_ids)

is the same layer on fp8 weights (e4m3, from runtime.layer.prepare_fp8_weights or
runtime.fp8.from_block128_checkpoint), the precision read off the scales' shape.
"""
from __future__ import annotations

import inspect
from typing import Optional

import torch

from ..runtime.library import KernelArgumentError
from ..spec import ACTIVATIONS
from ..variants import INTERLEAVE
from . import autograd as _autograd
from .routing import ROUTINGS, grouped_topk, map_experts, softmax_topk, topk_softmax
from .shapes import check_layer_shapes


def check_op_inputs(x, w13, w2, topk_weights, topk_ids, activation: str = "swiglu", w13_bias=None,
                    w2_bias=None) -> None:
    """The op's contract, checked on real and fake tensors alike (shapes, dtypes, devices)."""
    biases = tuple((n, t) for n, t in (("w13_bias", w13_bias), ("w2_bias", w2_bias)) if t is not None)
    for name, t, rank in (("x", x, 2), ("w13", w13, 3), ("w2", w2, 3), ("topk_weights", topk_weights, 2),
                          ("topk_ids", topk_ids, 2)) + tuple((n, t, 2) for n, t in biases):
        if not isinstance(t, torch.Tensor) or t.dim() != rank:
            got = f"shape {tuple(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
            raise KernelArgumentError(f"{name} must be a {rank}-D tensor, got {got}")
    for name, t, dtype in (("x", x, torch.bfloat16), ("w13", w13, torch.bfloat16), ("w2", w2, torch.bfloat16),
                           ("topk_weights", topk_weights, torch.float32), ("topk_ids", topk_ids, torch.int32)) + \
            tuple((n, t, torch.bfloat16) for n, t in biases):
        if t.dtype != dtype:
            raise KernelArgumentError(f"{name} must be {dtype}, got {t.dtype}")
    check_layer_shapes(x.shape, w13.shape, w2.shape, topk_weights.shape, topk_ids.shape,
                       None if w13_bias is None else w13_bias.shape, None if w2_bias is None else w2_bias.shape,
                       bias_names=("w13_bias", "w2_bias"))
    _check_rest(x, (("w13", w13), ("w2", w2)) + biases, topk_weights, topk_ids, activation)


def _check_rest(x, weights, topk_weights, topk_ids, activation) -> None:
    """The checks both ops share once the shapes are checked: the activation, one device,
    contiguity. ``weights``: (name, tensor) pairs."""
    if activation not in ACTIVATIONS:
        raise KernelArgumentError(f"activation must be one of {', '.join(ACTIVATIONS)}, got {activation!r}")
    others = tuple(weights) + (("topk_weights", topk_weights), ("topk_ids", topk_ids))
    for name, t in others:
        if t.device != x.device:
            raise KernelArgumentError(f"{name} must be on {x.device} like x, got {t.device}")
    for name, t in (("x", x),) + others:
        if not t.is_contiguous():
            raise KernelArgumentError(f"{name} must be contiguous (call .contiguous() first)")


def _layout_tags() -> dict:
    # The kernels need contiguous operands: tell inductor not to hand the op padded or permuted
    # buffers (its comprehensive padding is on for CUDA). The tag's name, and whether custom_op
    # takes tags at all, depend on the torch version.
    if "tags" not in inspect.signature(torch.library.custom_op).parameters:
        return {}
    for name in ("needs_contiguous_strides", "needs_exact_strides", "needs_fixed_stride_order"):
        if hasattr(torch.Tag, name):
            return {"tags": (getattr(torch.Tag, name),)}
    return {}


@torch.library.custom_op("moe_aot::fused_moe", mutates_args=(), device_types="cpu", **_layout_tags())
def fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor, activation: str = "swiglu", w13_bias: Optional[torch.Tensor] = None,
              w2_bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """sum_k topk_weights[m, k] * FFN_{topk_ids[m, k]}(x[m]); see the module docstring. Expert
    biases (gpt-oss, with activation "swigluoai"): w13_bias [E, 2I] interleaved as w13's rows
    (prepare_biases), w2_bias [E, H], both bf16."""
    from ..harness.reference import moe_reference  # the CPU implementation only

    check_op_inputs(x, w13, w2, topk_weights, topk_ids, activation, w13_bias, w2_bias)
    if x.shape[0] == 0:
        return x.new_empty(0, x.shape[1])
    return moe_reference(x, w13, w2, topk_weights, topk_ids, activation, INTERLEAVE, w13_bias,
                         w2_bias).to(torch.bfloat16)


@fused_moe.register_kernel("cuda")
def _fused_moe_cuda(x, w13, w2, topk_weights, topk_ids, activation="swiglu", w13_bias=None, w2_bias=None):
    from ..runtime.layer import moe_forward  # loads kernels lazily; CPU use never opens a database

    check_op_inputs(x, w13, w2, topk_weights, topk_ids, activation, w13_bias, w2_bias)
    if w13_bias is not None:  # the layer with expert biases takes (weights, biases) pairs
        w13, w2 = (w13, w13_bias), (w2, w2_bias)
    return moe_forward(x, w13, w2, topk_weights, topk_ids, activation=activation)


@fused_moe.register_fake
def _fused_moe_fake(x, w13, w2, topk_weights, topk_ids, activation="swiglu", w13_bias=None, w2_bias=None):
    check_op_inputs(x, w13, w2, topk_weights, topk_ids, activation, w13_bias, w2_bias)
    return x.new_empty(x.shape)


@torch.library.custom_op("moe_aot::fused_moe_train", mutates_args=(), device_types="cpu", **_layout_tags())
def fused_moe_train(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                    topk_ids: torch.Tensor, activation: str = "swiglu", w13_bias: Optional[torch.Tensor] = None,
                    w2_bias: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """fused_moe for training: (out, preact), out as fused_moe's and preact [M * top_k + 1, 2I] bf16
    the GLU's input of each routed pair (row m * top_k + k; the last row zeros), which the backward
    reads instead of recomputing GEMM1 (autograd.preact_torch has the layout). On CUDA GEMM1's
    epilogue writes it where the database has that kernel (`moe-aot build --backward`), else
    torch ops compute it. It costs 4I bytes per routed pair of activation memory."""
    out = fused_moe(x, w13, w2, topk_weights, topk_ids, activation, w13_bias, w2_bias)
    return out, _autograd.preact_torch(x.float(), w13.float(), topk_ids,
                                       None if w13_bias is None else w13_bias.float()).to(torch.bfloat16)


@fused_moe_train.register_kernel("cuda")
def _fused_moe_train_cuda(x, w13, w2, topk_weights, topk_ids, activation="swiglu", w13_bias=None, w2_bias=None):
    from ..runtime.layer import moe_forward_train

    check_op_inputs(x, w13, w2, topk_weights, topk_ids, activation, w13_bias, w2_bias)
    res = moe_forward_train(x, w13, w2, topk_weights, topk_ids, activation, w13_bias, w2_bias)
    if res is not None:
        return res
    return (_fused_moe_cuda(x, w13, w2, topk_weights, topk_ids, activation, w13_bias, w2_bias),
            _autograd.preact_torch(x, w13, topk_ids, w13_bias))


@fused_moe_train.register_fake
def _fused_moe_train_fake(x, w13, w2, topk_weights, topk_ids, activation="swiglu", w13_bias=None, w2_bias=None):
    check_op_inputs(x, w13, w2, topk_weights, topk_ids, activation, w13_bias, w2_bias)
    return x.new_empty(x.shape), x.new_empty(topk_ids.numel() + 1, w13.shape[1])


_autograd.register(fused_moe, fused_moe_train)


# -- fp8: the same layer on e4m3 weights with their scales -----------------------------------------
def check_fp8_op_inputs(x, w13, w13_scale, w2, w2_scale, topk_weights, topk_ids, activation="swiglu") -> str:
    """fused_moe_fp8's contract (shapes, dtypes, devices); returns the precision the scales' shape
    says: w13_scale [E, 2] and w2_scale [E] "fp8", [E, 2I/128, H/128] and [E, H/128, I/128]
    "fp8-block128"."""
    from ..gemm_limits import SCALE_BLOCK

    for name, t, rank in (("x", x, 2), ("w13", w13, 3), ("w2", w2, 3), ("topk_weights", topk_weights, 2),
                          ("topk_ids", topk_ids, 2), ("w13_scale", w13_scale, None), ("w2_scale", w2_scale, None)):
        if not isinstance(t, torch.Tensor) or (rank is not None and t.dim() != rank):
            got = f"shape {tuple(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
            raise KernelArgumentError(f"{name} must be a {rank or 'scale'}-D tensor, got {got}")
    for name, t, dtype in (("x", x, torch.bfloat16), ("w13", w13, torch.float8_e4m3fn),
                           ("w2", w2, torch.float8_e4m3fn), ("w13_scale", w13_scale, torch.float32),
                           ("w2_scale", w2_scale, torch.float32), ("topk_weights", topk_weights, torch.float32),
                           ("topk_ids", topk_ids, torch.int32)):
        if t.dtype != dtype:
            raise KernelArgumentError(f"{name} must be {dtype}, got {t.dtype}")
    check_layer_shapes(x.shape, w13.shape, w2.shape, topk_weights.shape, topk_ids.shape,
                       source="from prepare_fp8_weights")
    H = x.shape[1]
    E, I2, _ = w13.shape
    I = I2 // 2
    shapes = {"fp8": ((E, 2), (E,)),
              "fp8-block128": ((E, I2 // SCALE_BLOCK, H // SCALE_BLOCK), (E, H // SCALE_BLOCK, I // SCALE_BLOCK))}
    precision = next((p for p, (a, b) in shapes.items()
                      if tuple(w13_scale.shape) == a and tuple(w2_scale.shape) == b), None)
    if precision is None:
        raise KernelArgumentError(
            f"w13_scale {tuple(w13_scale.shape)} and w2_scale {tuple(w2_scale.shape)} must be {shapes['fp8']} "
            f"(per expert) or {shapes['fp8-block128']} (per 128x128 block)")
    _check_rest(x, (("w13", w13), ("w13_scale", w13_scale), ("w2", w2), ("w2_scale", w2_scale)),
                topk_weights, topk_ids, activation)
    return precision


@torch.library.custom_op("moe_aot::fused_moe_fp8", mutates_args=(), device_types="cpu", **_layout_tags())
def fused_moe_fp8(x: torch.Tensor, w13: torch.Tensor, w13_scale: torch.Tensor, w2: torch.Tensor,
                  w2_scale: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                  activation: str = "swiglu") -> torch.Tensor:
    """fused_moe on fp8 weights (runtime.layer.prepare_fp8_weights's layout: w13 gate/up interleaved,
    its scales with it); x is quantized on the GPU. CPU: the fp32 reference of the fp8 math."""
    from ..harness import fp8  # the CPU implementation only

    precision = check_fp8_op_inputs(x, w13, w13_scale, w2, w2_scale, topk_weights, topk_ids, activation)
    if x.shape[0] == 0:
        return x.new_empty(0, x.shape[1])
    return fp8.moe_fp8_reference(x, (w13, w13_scale), (w2, w2_scale), topk_weights, topk_ids, precision,
                                 activation, INTERLEAVE).to(torch.bfloat16)


@fused_moe_fp8.register_kernel("cuda")
def _fused_moe_fp8_cuda(x, w13, w13_scale, w2, w2_scale, topk_weights, topk_ids, activation="swiglu"):
    from ..runtime.layer import moe_forward

    check_fp8_op_inputs(x, w13, w13_scale, w2, w2_scale, topk_weights, topk_ids, activation)
    return moe_forward(x, (w13, w13_scale), (w2, w2_scale), topk_weights, topk_ids, activation=activation)


@fused_moe_fp8.register_fake
def _fused_moe_fp8_fake(x, w13, w13_scale, w2, w2_scale, topk_weights, topk_ids, activation="swiglu"):
    check_fp8_op_inputs(x, w13, w13_scale, w2, w2_scale, topk_weights, topk_ids, activation)
    return x.new_empty(x.shape)


# -- the routing variants: router logits in, the layer's output out ------------------------------
# Composite (CompositeImplicitAutograd): the op is the routing convention's torch ops followed by
# fused_moe, so torch.compile traces through it and needs no fake implementation of its own.
torch.library.define(
    "moe_aot::fused_moe_routed",
    "(Tensor x, Tensor router_logits, Tensor w13, Tensor w2, int top_k, str routing='softmax_topk', "
    "bool renormalize=False, int n_group=1, int topk_group=1, Tensor? e_score_correction_bias=None, "
    "float routed_scaling_factor=1.0, Tensor? expert_map=None, str activation='swiglu') -> Tensor")


@torch.library.impl("moe_aot::fused_moe_routed", "CompositeImplicitAutograd")
def fused_moe_routed(x, router_logits, w13, w2, top_k, routing="softmax_topk", renormalize=False, n_group=1,
                     topk_group=1, e_score_correction_bias=None, routed_scaling_factor=1.0, expert_map=None,
                     activation="swiglu"):
    """fused_moe after one of the built-in routing conventions (routing.py): routing is
    softmax_topk (renormalize), topk_softmax, or grouped_topk (n_group, topk_group,
    e_score_correction_bias, renormalize, routed_scaling_factor); expert_map as in map_experts."""
    if routing == "softmax_topk":
        weights, ids = softmax_topk(router_logits, top_k, renormalize)
    elif routing == "topk_softmax":
        weights, ids = topk_softmax(router_logits, top_k)
    elif routing == "grouped_topk":
        weights, ids = grouped_topk(router_logits, top_k, n_group, topk_group, e_score_correction_bias,
                                    renormalize, routed_scaling_factor)
    else:
        raise KernelArgumentError(f"routing must be one of {', '.join(ROUTINGS)}, got {routing!r}")
    if expert_map is not None:
        ids = map_experts(ids, expert_map)
    return torch.ops.moe_aot.fused_moe(x, w13, w2, weights.contiguous(), ids.contiguous(), activation)
