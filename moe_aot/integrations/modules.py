"""Level 2: nn.Modules that own prepared weights and compute a whole MoE block.

- MoeExperts: the routed experts (prepared w13, w2 as buffers) -> torch.ops.moe_aot.fused_moe
  (fp8 experts: fused_moe_fp8), with an optional expert_map for expert parallelism.
- Router: router logits and one of the routing conventions of .routing.
- GatedMLP: a dense SwiGLU/GeGLU MLP (the shared experts of DeepSeek-V2/V3 and Qwen2-MoE).
- MoeBlock: router -> experts (+ shared experts, optionally gated by sigmoid(shared_gate(x)) as
  in Qwen2-MoE).

Everything is torch ops on the device with no host sync; a MoeBlock compiles with
torch.compile(fullgraph=True) and captures in CUDA graphs. Training: MoeExperts(trainable=True)
holds its weights as parameters; fp8 experts are inference only.
"""
from __future__ import annotations

import re

import torch
import torch.nn.functional as F
from torch import nn

from ..runtime.layer import prepare_biases, prepare_fp8_weights, prepare_weights
from ..runtime.library import KernelArgumentError
from ..spec import ACTIVATIONS
from . import op  # noqa: F401  (registers torch.ops.moe_aot.fused_moe)
from .functional import prepare_fused_gate_up
from .routing import ROUTINGS, grouped_topk, map_experts, softmax_topk, topk_softmax


class MoeExperts(nn.Module):
    """The routed experts of one layer: forward(x [..., H], topk_weights [..., K], topk_ids [..., K])
    -> [..., H] in x's dtype. x is computed in bf16 (the kernels' precision); weights are kept as
    buffers in the kernels' layout: w13 [E, 2I, H] interleaved (prepare_weights), w2 [E, H, I], bf16;
    with trainable=True (bf16 experts) they are parameters instead, with gradients from the op's
    backward (integrations/autograd.py). Under autograd the forward runs fused_moe_train, which
    keeps GEMM1's pre-activations (4I bytes per routed pair) so that the backward need not
    recompute GEMM1; save_preact=False keeps only the inputs (fused_moe) and recomputes it.

    expert_map ([global experts] int, -1 where not local) maps global ids to this rank's experts;
    pairs routed elsewhere contribute nothing, so the output is this rank's partial sum to be
    reduced by the engine's all-to-all/all-reduce."""

    def __init__(self, w13: torch.Tensor, w2: torch.Tensor, activation: str = "swiglu",
                 expert_map: torch.Tensor | None = None, w13_scale: torch.Tensor | None = None,
                 w2_scale: torch.Tensor | None = None, b13: torch.Tensor | None = None,
                 b2: torch.Tensor | None = None, trainable: bool = False, save_preact: bool = True):
        super().__init__()
        self.save_preact = bool(save_preact)
        if activation not in ACTIVATIONS:
            raise KernelArgumentError(f"activation must be one of {', '.join(ACTIVATIONS)}, got {activation!r}")
        if w13.dim() != 3 or w2.dim() != 3 or w2.shape != (w13.shape[0], w13.shape[2], w13.shape[1] // 2):
            raise KernelArgumentError(f"w13 [E, 2I, H] and w2 [E, H, I] do not match: {tuple(w13.shape)} and "
                                      f"{tuple(w2.shape)}")
        self.activation = activation
        # fp8 experts (w13, w2 float8_e4m3fn with their scales, in prepare_fp8_weights' layout) stay
        # e4m3 and run torch.ops.moe_aot.fused_moe_fp8; anything else is kept as bf16
        self.fp8 = w13.dtype == torch.float8_e4m3fn
        if self.fp8 != (w13_scale is not None) or (w13_scale is None) != (w2_scale is None) or \
                (self.fp8 and w2.dtype != torch.float8_e4m3fn):
            raise KernelArgumentError("fp8 experts need float8_e4m3fn w13 and w2 with both w13_scale and w2_scale; "
                                      f"got w13 {w13.dtype}, w2 {w2.dtype}, scales "
                                      f"{'given' if w13_scale is not None else 'not given'}")
        if self.fp8:
            self.register_buffer("w13", w13.contiguous())
            self.register_buffer("w2", w2.to(w13.device).contiguous())
            self.register_buffer("w13_scale", w13_scale.to(w13.device, torch.float32).contiguous())
            self.register_buffer("w2_scale", w2_scale.to(w13.device, torch.float32).contiguous())
        else:
            self.register_buffer("w13", w13.to(torch.bfloat16).contiguous())
            self.register_buffer("w2", w2.to(w13.device, torch.bfloat16).contiguous())
        if (b13 is None) != (b2 is None) or (b13 is not None and self.fp8):
            raise KernelArgumentError("expert biases need both b13 [E, 2I] and b2 [E, H], on bf16 experts")
        # expert biases (gpt-oss): b13 interleaved as w13's rows (prepare_biases), b2 [E, H]
        self.register_buffer("b13", None if b13 is None else b13.to(w13.device, torch.bfloat16).contiguous())
        self.register_buffer("b2", None if b2 is None else b2.to(w13.device, torch.bfloat16).contiguous())
        if expert_map is not None:
            expert_map = expert_map.to(w13.device, torch.int32)
        self.register_buffer("expert_map", expert_map)
        if trainable:  # the same tensors as parameters, under the same state-dict names
            if self.fp8:
                raise KernelArgumentError("fp8 experts cannot be trained (fused_moe_fp8 has no backward); "
                                          "train bf16 experts (trainable=True without scales)")
            for name in ("w13", "w2", "b13", "b2"):
                t = self._buffers.pop(name)
                self.register_parameter(name, None if t is None else nn.Parameter(t))

    @property
    def experts(self) -> int:
        return self.w13.shape[0]

    @property
    def hidden(self) -> int:
        return self.w13.shape[2]

    @property
    def intermediate(self) -> int:
        return self.w13.shape[1] // 2

    def extra_repr(self) -> str:
        local = "" if self.expert_map is None else f", expert_map over {self.expert_map.shape[0]} global experts"
        fp8 = f", fp8 ({'per expert' if self.w13_scale.dim() == 2 else '128x128 blocks'})" if self.fp8 else ""
        bias = ", biases" if self.b13 is not None else ""
        return (f"experts={self.experts}, hidden={self.hidden}, intermediate={self.intermediate}, "
                f"activation={self.activation}{bias}{fp8}{local}")

    # -- loading -------------------------------------------------------------------------------
    @classmethod
    def from_gate_up(cls, w_gate, w_up, w_down, **kw) -> "MoeExperts":
        """Separate gate and up [E, I, H] and down [E, H, I] (nn.Linear weight layout per expert)."""
        return cls(prepare_weights(w_gate.to(torch.bfloat16), w_up.to(torch.bfloat16)), w_down, **kw)

    @classmethod
    def from_fp8(cls, w_gate, w_up, w_down, precision: str = "fp8-block128", **kw) -> "MoeExperts":
        """bf16 (or fp32) gate, up [E, I, H] and down [E, H, I], quantized once to fp8 ("fp8": a scale
        per expert and matrix; "fp8-block128": per 128x128 block)."""
        (w13, w13s), (w2, w2s) = prepare_fp8_weights(w_gate, w_up, w_down, precision)
        return cls(w13, w2, w13_scale=w13s, w2_scale=w2s, **kw)

    @classmethod
    def from_fused(cls, w_gate_up, w_down, **kw) -> "MoeExperts":
        """transformers 5.x / vLLM layout: gate_up [E, 2I, H] with the gate rows first, down [E, H, I]."""
        return cls(prepare_fused_gate_up(w_gate_up.to(torch.bfloat16)), w_down, **kw)

    @classmethod
    def from_gpt_oss(cls, gate_up_proj, gate_up_proj_bias, down_proj, down_proj_bias, **kw) -> "MoeExperts":
        """transformers' GptOssExperts layout: gate_up_proj [E, H, 2I] with gate and up in alternate
        columns (gate even), its bias [E, 2I] likewise, down_proj [E, I, H], down_proj_bias [E, H];
        activation "swigluoai" (gpt-oss's clamped SwiGLU) unless given."""
        bf = torch.bfloat16
        gu = gate_up_proj.detach().to(bf)
        w13 = prepare_weights(gu[..., 0::2].transpose(1, 2).contiguous(), gu[..., 1::2].transpose(1, 2).contiguous())
        b = gate_up_proj_bias.detach().to(bf)
        kw.setdefault("activation", "swigluoai")
        return cls(w13, down_proj.detach().to(bf).transpose(1, 2).contiguous(),
                   b13=prepare_biases(b[:, 0::2].contiguous(), b[:, 1::2].contiguous()),
                   b2=down_proj_bias.detach().to(bf), **kw)

    @classmethod
    def from_per_expert(cls, gates, ups, downs, **kw) -> "MoeExperts":
        """Lists of per-expert nn.Linear weights: gate [I, H], up [I, H], down [H, I]."""
        return cls.from_gate_up(torch.stack(list(gates)), torch.stack(list(ups)), torch.stack(list(downs)), **kw)

    @classmethod
    def from_state_dict(cls, state_dict: dict, prefix: str = "", **kw) -> "MoeExperts":
        """From a checkpoint's tensors under prefix (e.g. 'model.layers.3.mlp.experts.'), in any of:
        - fused: gate_up_proj [E, 2I, H] (gate rows first), down_proj [E, H, I] (transformers 5.x);
        - per expert: {e}.gate_proj.weight, {e}.up_proj.weight, {e}.down_proj.weight (Qwen, DeepSeek;
          with {e}.*.weight_scale_inv beside float8_e4m3fn weights, DeepSeek-V3's fp8 experts as
          shipped: the module keeps them in fp8-block128);
        - per expert: {e}.w1.weight (gate), {e}.w3.weight (up), {e}.w2.weight (down) (Mixtral)."""
        sd = {k[len(prefix):]: v for k, v in state_dict.items() if k.startswith(prefix)}
        if "gate_up_proj" in sd and "down_proj" in sd:
            return cls.from_fused(sd["gate_up_proj"], sd["down_proj"], **kw)
        for g, u, d in (("gate_proj", "up_proj", "down_proj"), ("w1", "w3", "w2")):
            pat = re.compile(rf"^(\d+)\.{g}\.weight$")
            ids = sorted(int(m.group(1)) for k in sd if (m := pat.match(k)))
            if ids:
                if ids != list(range(len(ids))):
                    raise KernelArgumentError(f"experts under {prefix!r} must be numbered 0..E-1 without gaps, "
                                              f"found {len(ids)} ids up to {ids[-1]}")
                try:
                    if f"{ids[0]}.{g}.weight_scale_inv" in sd:  # DeepSeek-V3's fp8 experts, as shipped
                        from ..runtime import fp8

                        t = [torch.stack([sd[f"{e}.{n}"] for e in ids]) for n in
                             (f"{g}.weight", f"{g}.weight_scale_inv", f"{u}.weight", f"{u}.weight_scale_inv",
                              f"{d}.weight", f"{d}.weight_scale_inv")]
                        try:
                            w13, w13s, w2, w2s = fp8.from_block128_checkpoint(*t)
                        except ValueError as exc:
                            raise KernelArgumentError(f"fp8 experts under {prefix!r}: {exc}") from None
                        return cls(w13, w2, w13_scale=w13s, w2_scale=w2s, **kw)
                    return cls.from_per_expert([sd[f"{e}.{g}.weight"] for e in ids],
                                               [sd[f"{e}.{u}.weight"] for e in ids],
                                               [sd[f"{e}.{d}.weight"] for e in ids], **kw)
                except KeyError as exc:
                    raise KernelArgumentError(f"expert weights under {prefix!r} are incomplete: missing "
                                              f"{prefix}{exc.args[0]}") from None
        raise KernelArgumentError(f"no expert weights under {prefix!r}: expected gate_up_proj/down_proj, "
                                  "{e}.gate_proj/up_proj/down_proj.weight or {e}.w1/w3/w2.weight")

    # -- the layer -----------------------------------------------------------------------------
    def forward(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        shape, dtype = x.shape, x.dtype
        xs = x.reshape(-1, shape[-1]).to(torch.bfloat16).contiguous()
        M = xs.shape[0]
        # [M, K] by the last dimension when there are no rows (reshape cannot infer -1 from 0 elements)
        tw = topk_weights.reshape(M, -1 if M else topk_weights.shape[-1]).float().contiguous()
        ids = topk_ids.reshape(M, -1 if M else topk_ids.shape[-1])
        if self.expert_map is not None:
            ids = map_experts(ids, self.expert_map)
        ids = ids.to(torch.int32).contiguous()
        if self.fp8:
            out = torch.ops.moe_aot.fused_moe_fp8(xs, self.w13, self.w13_scale, self.w2, self.w2_scale, tw, ids,
                                                  self.activation)
        elif self.save_preact and torch.is_grad_enabled() and any(
                t is not None and t.requires_grad for t in (xs, self.w13, self.w2, tw, self.b13, self.b2)):
            # training: the forward keeps GEMM1's pre-activations for the backward (4I bytes per
            # routed pair), which then skips recomputing GEMM1
            out = torch.ops.moe_aot.fused_moe_train(xs, self.w13, self.w2, tw, ids, self.activation, self.b13,
                                                    self.b2)[0]
        else:
            out = torch.ops.moe_aot.fused_moe(xs, self.w13, self.w2, tw, ids, self.activation, self.b13, self.b2)
        return out.to(dtype).reshape(shape)


class Router(nn.Module):
    """Router logits = x @ weight.T (+ bias), then a routing convention (see .routing).

    logits_dtype: None computes the logits in x's dtype (Qwen, Mixtral), torch.float32 in fp32
    (DeepSeek-V3). Returns (topk_weights fp32, topk_ids int32), both [tokens, top_k]."""

    def __init__(self, weight: torch.Tensor, top_k: int, routing: str = "softmax_topk", renormalize: bool = False,
                 bias: torch.Tensor | None = None, logits_dtype: torch.dtype | None = None, n_group: int = 1,
                 topk_group: int = 1, e_score_correction_bias: torch.Tensor | None = None,
                 routed_scaling_factor: float = 1.0):
        super().__init__()
        if routing not in ROUTINGS:
            raise KernelArgumentError(f"routing must be one of {', '.join(ROUTINGS)}, got {routing!r}")
        if not isinstance(top_k, int) or not 0 < top_k <= weight.shape[0]:
            raise KernelArgumentError(f"top_k must be an integer in [1, {weight.shape[0]}], got {top_k!r}")
        self.top_k, self.routing, self.renormalize = top_k, routing, renormalize
        self.logits_dtype, self.n_group, self.topk_group = logits_dtype, n_group, topk_group
        self.routed_scaling_factor = routed_scaling_factor
        self.register_buffer("weight", weight.detach().clone())
        self.register_buffer("bias", None if bias is None else bias.detach().clone())
        self.register_buffer("e_score_correction_bias",
                             None if e_score_correction_bias is None else e_score_correction_bias.detach().clone())

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        dt = self.logits_dtype or x.dtype
        bias = None if self.bias is None else self.bias.to(dt)
        return F.linear(x.to(dt), self.weight.to(dt), bias)

    def forward(self, x: torch.Tensor):
        logits = self.logits(x.reshape(-1, x.shape[-1]))
        if self.routing == "softmax_topk":
            return softmax_topk(logits, self.top_k, self.renormalize)
        if self.routing == "topk_softmax":
            return topk_softmax(logits, self.top_k)
        return grouped_topk(logits, self.top_k, self.n_group, self.topk_group, self.e_score_correction_bias,
                            self.renormalize, self.routed_scaling_factor)


class GatedMLP(nn.Module):
    """down(act(gate(x)) * up(x)) with nn.Linear weights gate/up [I, H], down [H, I] (no biases)."""

    def __init__(self, w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor, activation: str = "swiglu"):
        super().__init__()
        if activation not in ACTIVATIONS:
            raise KernelArgumentError(f"activation must be one of {', '.join(ACTIVATIONS)}, got {activation!r}")
        self.activation = activation
        self.register_buffer("w_gate", w_gate.detach().clone())
        self.register_buffer("w_up", w_up.detach().clone())
        self.register_buffer("w_down", w_down.detach().clone())

    def forward(self, x):
        g = F.linear(x, self.w_gate)
        g = F.silu(g) if self.activation == "swiglu" else F.gelu(g, approximate="tanh")
        return F.linear(g * F.linear(x, self.w_up), self.w_down)


class MoeBlock(nn.Module):
    """A sparse-MoE block: forward(hidden_states [..., H]) -> [..., H].

    out = experts(x, *router(x)) + [sigmoid(shared_gate(x)) *] shared(x)

    shared is any module mapping [tokens, H] -> [tokens, H] (GatedMLP, or the model's own MLP);
    shared_gate a [1, H] weight (Qwen2-MoE's shared_expert_gate) or None."""

    def __init__(self, router: Router, experts: MoeExperts, shared: nn.Module | None = None,
                 shared_gate: torch.Tensor | None = None):
        super().__init__()
        self.router, self.experts, self.shared = router, experts, shared
        if shared_gate is not None and shared is None:
            raise KernelArgumentError("shared_gate needs a shared expert module (shared=...)")
        self.register_buffer("shared_gate", None if shared_gate is None else shared_gate.detach().clone())

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        shape = hidden_states.shape
        x = hidden_states.reshape(-1, shape[-1])
        topk_weights, topk_ids = self.router(x)
        out = self.experts(x, topk_weights, topk_ids)
        if self.shared is not None:
            s = self.shared(x)
            if self.shared_gate is not None:
                s = torch.sigmoid(F.linear(x, self.shared_gate.to(x.dtype))) * s
            out = out + s
        return out.reshape(shape)
