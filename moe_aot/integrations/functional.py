"""A vLLM/SGLang-compatible functional form over the custom op.

    out = fused_experts(hidden_states, w1, w2, topk_weights, topk_ids)

w1 is the engines' [E, 2I, H] layout with the gate rows first, then the up rows
(`torch.cat([w_gate, w_up], 1)`, SiLU applied to the first half). It is interleaved into the
kernels' layout once and cached by the weight tensor: a weak reference to it, its data_ptr,
version counter, shape, stride, dtype and device; the cache entry goes when the tensor does, and an
in-place update of the weight (which bumps its version) prepares it again. Tensors made under
torch.inference_mode have no version counter: after updating one in place, PREPARED.clear(). The cache holds one
prepared copy per weight (as much memory as w1): to avoid it, prepare once with
prepare_fused_gate_up() and call torch.ops.moe_aot.fused_moe, or use MoeExperts.

The cache is a Python dict, so fused_experts is for eager code and CUDA graphs (call it once
before capture so that the preparation happens outside the graph). Under torch.compile call the
op with prepared weights, or MoeExperts, instead.
"""
from __future__ import annotations

import weakref

import torch

from ..runtime.layer import prepare_biases, prepare_weights
from ..runtime.library import KernelArgumentError
from . import op  # noqa: F401  (registers torch.ops.moe_aot.fused_moe)
from .routing import map_experts

# vLLM / SGLang activation names -> the spec's activation.
ACTIVATION_NAMES = {"silu": "swiglu", "swiglu": "swiglu", "gelu_tanh": "geglu", "geglu": "geglu",
                    "swigluoai": "swigluoai"}  # gpt-oss's clamped SwiGLU (with w1_bias / w2_bias)


def prepare_fused_gate_up(w1: torch.Tensor) -> torch.Tensor:
    """[E, 2I, H] with the gate rows first -> the kernels' interleaved [E, 2I, H] (a new tensor)."""
    if not isinstance(w1, torch.Tensor) or w1.dim() != 3 or w1.shape[1] % 2:
        got = tuple(w1.shape) if isinstance(w1, torch.Tensor) else type(w1).__name__
        raise KernelArgumentError(f"w1 must be an [experts, 2*intermediate, hidden] tensor with the gate rows "
                                  f"first, got {got}")
    gate, up = w1.chunk(2, dim=1)
    try:
        return prepare_weights(gate, up)
    except ValueError as exc:
        raise KernelArgumentError(f"w1 {tuple(w1.shape)} cannot be prepared: {exc}") from None


def prepare_fused_bias(w1_bias: torch.Tensor) -> torch.Tensor:
    """vLLM's w1_bias [E, 2I] (gate half first) -> the kernels' b13, interleaved as w13's rows."""
    if not isinstance(w1_bias, torch.Tensor) or w1_bias.dim() != 2 or w1_bias.shape[1] % 2:
        got = tuple(w1_bias.shape) if isinstance(w1_bias, torch.Tensor) else type(w1_bias).__name__
        raise KernelArgumentError(f"w1_bias must be an [experts, 2*intermediate] tensor with the gate half first, "
                                  f"got {got}")
    gate, up = w1_bias.to(torch.bfloat16).chunk(2, dim=1)
    try:
        return prepare_biases(gate.contiguous(), up.contiguous())
    except ValueError as exc:
        raise KernelArgumentError(f"w1_bias {tuple(w1_bias.shape)} cannot be prepared: {exc}") from None


def prepare_fp8_gate_up(w1: torch.Tensor, w1_scale: torch.Tensor):
    """vLLM's fp8 w1 [E, 2I, H] (e4m3, gate rows first) and its scales -> the kernels' (w13, w13
    scales): per expert [E] (one scale for gate and up, as vLLM keeps it after loading) or [E, 2]
    (gate, up), or per 128x128 block [E, 2I/128, H/128] (gate blocks first; block_shape [128, 128])."""
    from ..gemm_limits import SCALE_BLOCK
    from ..runtime import fp8

    if not isinstance(w1, torch.Tensor) or w1.dim() != 3 or w1.dtype != torch.float8_e4m3fn or w1.shape[1] % 2:
        got = f"{tuple(w1.shape)} {w1.dtype}" if isinstance(w1, torch.Tensor) else type(w1).__name__
        raise KernelArgumentError(f"w1 must be an [experts, 2*intermediate, hidden] float8_e4m3fn tensor with the "
                                  f"gate rows first, got {got}")
    e, i2, h = w1.shape
    s = w1_scale.float()
    if tuple(s.shape) in ((e,), (e, 1)):
        scales = s.reshape(e, 1).expand(e, 2).contiguous()
    elif tuple(s.shape) == (e, 2):
        scales = s.contiguous()
    elif tuple(s.shape) == (e, i2 // SCALE_BLOCK, h // SCALE_BLOCK) and not (i2 // 2) % SCALE_BLOCK:
        n = i2 // 2 // SCALE_BLOCK
        scales = fp8.interleave_block_scales(s[:, :n], s[:, n:])
    else:
        raise KernelArgumentError(
            f"w1_scale {tuple(s.shape)} must be ({e},) or ({e}, 2) per expert, or ({e}, {i2 // SCALE_BLOCK}, "
            f"{h // SCALE_BLOCK}) per 128x128 block (gate blocks first)")
    gate, up = w1.view(torch.uint8).chunk(2, dim=1)
    try:
        w13 = prepare_weights(gate, up).view(torch.float8_e4m3fn)
    except ValueError as exc:
        raise KernelArgumentError(f"w1 {tuple(w1.shape)} cannot be prepared: {exc}") from None
    return w13, scales


class PreparedCache:
    """Prepared w13 per weight tensor, keyed weakly (see the module docstring)."""

    def __init__(self):
        self._entries: dict[int, tuple[weakref.ref, tuple, torch.Tensor]] = {}

    @staticmethod
    def _key(w: torch.Tensor) -> tuple:
        # Inference tensors (made under torch.inference_mode) keep no version counter: for them an
        # in-place update of the same storage goes unnoticed (call PREPARED.clear() after one).
        version = None if w.is_inference() else w._version
        return (w.data_ptr(), version, tuple(w.shape), tuple(w.stride()), w.dtype, w.device)

    def get(self, w1: torch.Tensor, scale: torch.Tensor | None = None, bias: bool = False):
        """The prepared w13 of w1 (bf16), or with ``scale`` the prepared fp8 (w13, scales) pair
        (prepare_fp8_gate_up): keyed by both tensors; with bias=True, w1 is w1_bias and the
        prepared b13 is returned (prepare_fused_bias)."""
        key = self._key(w1) + (() if scale is None else self._key(scale)) + (("bias",) if bias else ())
        hit = self._entries.get(id(w1))
        if hit is not None and hit[0]() is w1 and hit[1] == key:
            return hit[2]
        if bias:
            prepared = prepare_fused_bias(w1)
        else:
            prepared = prepare_fused_gate_up(w1) if scale is None else prepare_fp8_gate_up(w1, scale)
        ident = id(w1)

        def drop(ref, ident=ident, entries=self._entries):
            entry = entries.get(ident)
            if entry is not None and entry[0] is ref:
                del entries[ident]

        self._entries[ident] = (weakref.ref(w1, drop), key, prepared)
        return prepared

    def __len__(self) -> int:
        return len(self._entries)

    def clear(self) -> None:
        self._entries.clear()


PREPARED = PreparedCache()

_UNSUPPORTED = {  # argument -> what it asks for, refused when not at its default
    "use_int8_w8a8": "int8 weights", "use_int8_w8a16": "int8 weights",
    "use_int4_w4a16": "int4 weights", "use_mxfp4_w4a4": "mxfp4 weights",
    "per_channel_quant": "per-channel weight scales", "w1_zp": "quantized weights", "w2_zp": "quantized weights",
    "a1_scale": "static activation scales (the fp8 layers quantize x on the GPU, per token or per 1x128 block)",
    "a2_scale": "static activation scales (the fp8 layers quantize x on the GPU, per token or per 1x128 block)",
    "no_combine": "uncombined per-expert outputs",
}
FP8_ARGS = ("use_fp8_w8a8", "w1_scale", "w2_scale", "block_shape")


def fused_experts(hidden_states: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor,
                  topk_weights: torch.Tensor, topk_ids: torch.Tensor, inplace: bool = False,
                  activation: str = "silu", apply_router_weight_on_input: bool = False,
                  global_num_experts: int = -1, expert_map: torch.Tensor | None = None,
                  routed_scaling_factor: float | None = None, w1_bias: torch.Tensor | None = None,
                  w2_bias: torch.Tensor | None = None, **unsupported) -> torch.Tensor:
    """vLLM's/SGLang's fused_experts on the moe-aot kernels.

    hidden_states [M, H] bf16; w1 [E, 2I, H] bf16, gate rows first; w2 [E, H, I] bf16;
    topk_weights [M, K] (any float dtype, used as fp32); topk_ids [M, K] int32 or int64, global
    ids when expert_map ([global_num_experts] int, -1 for experts on other ranks) is given.
    inplace writes the result into hidden_states and returns it. routed_scaling_factor (SGLang)
    scales the output. fp8 (use_fp8_w8a8=True): w1, w2 float8_e4m3fn with w1_scale / w2_scale per
    expert ([E], [E, 2] for gate and up) or, with block_shape=[128, 128], per 128x128 block (vLLM's
    layout, gate blocks first); x is quantized on the GPU (per token, or per 1x128 block), so
    a1_scale / a2_scale are refused. Expert biases (bf16 layers, gpt-oss with activation
    "swigluoai"): w1_bias [E, 2I] (gate half first, interleaved once and cached like w1) and
    w2_bias [E, H]. Other quantizations and uncombined output are refused.
    """
    fp8_args = {k: unsupported.pop(k) for k in FP8_ARGS if k in unsupported}
    for name, value in unsupported.items():
        if name not in _UNSUPPORTED:
            raise KernelArgumentError(f"fused_experts got an unknown argument {name!r}")
        if value is not None and value is not False:
            raise KernelArgumentError(f"{name} asks for {_UNSUPPORTED[name]}, which the moe-aot kernels do not "
                                      "compute yet (bf16 with or without expert biases, or fp8 with per-expert "
                                      "or 128x128-block scales)")
    use_fp8 = bool(fp8_args.get("use_fp8_w8a8"))
    if not use_fp8 and any(fp8_args.get(k) is not None for k in FP8_ARGS[1:]):
        raise KernelArgumentError("w1_scale, w2_scale and block_shape are fp8 arguments: pass use_fp8_w8a8=True")
    if use_fp8:
        if fp8_args.get("w1_scale") is None or fp8_args.get("w2_scale") is None:
            raise KernelArgumentError("use_fp8_w8a8 needs w1_scale and w2_scale")
        block = fp8_args.get("block_shape")
        if block is not None and list(block) != [128, 128]:
            raise KernelArgumentError(f"block_shape must be [128, 128] (DeepSeek-V3's blocks) or None (per-expert "
                                      f"scales), got {list(block)}")
    if activation not in ACTIVATION_NAMES:
        raise KernelArgumentError(f"activation must be one of {', '.join(ACTIVATION_NAMES)}, got {activation!r} "
                                  "(GeGLU is the tanh approximation: 'gelu_tanh')")
    if not isinstance(hidden_states, torch.Tensor) or not isinstance(topk_ids, torch.Tensor) or \
            not isinstance(topk_weights, torch.Tensor):
        raise KernelArgumentError("hidden_states, topk_weights and topk_ids must be torch.Tensors")
    if topk_ids.dtype not in (torch.int32, torch.int64):
        raise KernelArgumentError(f"topk_ids must be int32 or int64, got {topk_ids.dtype}")
    if not topk_weights.is_floating_point():
        raise KernelArgumentError(f"topk_weights must be a floating-point tensor, got {topk_weights.dtype}")
    if apply_router_weight_on_input:
        if topk_ids.dim() != 2 or topk_ids.shape[1] != 1:
            raise KernelArgumentError("apply_router_weight_on_input needs top_k == 1, got topk_ids of shape "
                                      f"{tuple(topk_ids.shape)}")
        hidden_states_in = (hidden_states.float() * topk_weights.float()).to(hidden_states.dtype)
        weights = torch.ones_like(topk_weights, dtype=torch.float32)
    else:
        hidden_states_in = hidden_states
        weights = topk_weights.float()
    if routed_scaling_factor is not None:
        weights = weights * routed_scaling_factor
    ids = topk_ids
    if expert_map is not None:
        if global_num_experts not in (-1, expert_map.shape[0]):
            raise KernelArgumentError(f"global_num_experts ({global_num_experts}) must equal the length of "
                                      f"expert_map ({expert_map.shape[0]})")
        ids = map_experts(topk_ids, expert_map)
    ids = ids.to(torch.int32).contiguous()
    if (w1_bias is None) != (w2_bias is None):
        raise KernelArgumentError("expert biases come in pairs: give both w1_bias and w2_bias, or neither")
    if use_fp8 and w1_bias is not None:
        raise KernelArgumentError("expert biases (w1_bias, w2_bias) are built for bf16 experts only, not fp8")
    if use_fp8:
        w13, w13_scale = PREPARED.get(w1, fp8_args["w1_scale"])
        w2_scale = fp8_args["w2_scale"].float()
        if w2_scale.dim() == 2 and w2_scale.shape[1] == 1:
            w2_scale = w2_scale.reshape(-1)
        if (block is None) != (w13_scale.dim() == 2):
            raise KernelArgumentError(f"block_shape {block} does not match w1_scale of shape "
                                      f"{tuple(fp8_args['w1_scale'].shape)}")
        out = torch.ops.moe_aot.fused_moe_fp8(hidden_states_in.contiguous(), w13, w13_scale, w2.contiguous(),
                                              w2_scale.contiguous(), weights.contiguous(), ids,
                                              ACTIVATION_NAMES[activation])
    else:
        w13 = PREPARED.get(w1)
        b13 = None if w1_bias is None else PREPARED.get(w1_bias, bias=True)
        b2 = None if w2_bias is None else w2_bias.to(torch.bfloat16).contiguous()
        out = torch.ops.moe_aot.fused_moe(hidden_states_in.contiguous(), w13, w2, weights.contiguous(), ids,
                                          ACTIVATION_NAMES[activation], b13, b2)
    if inplace:
        return hidden_states.copy_(out)
    return out
