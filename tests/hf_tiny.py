"""Tiny transformers configs of the five MoE families around a given MoE shape (experts, top_k,
hidden, intermediate): few layers, small attention and vocabulary, random weights. The CPU tests
use small shapes; the GPU tests one of the presets the database holds kernels for."""
from __future__ import annotations

FAMILIES = ("qwen3_moe", "qwen2_moe", "mixtral", "deepseek_v3", "gpt_oss")


def tiny_config(family: str, experts: int, top_k: int, hidden: int, intermediate: int, layers: int = 2,
                vocab: int = 512, heads: int = 4, head_dim: int = 32):
    import transformers as tf

    common = dict(hidden_size=hidden, num_hidden_layers=layers, vocab_size=vocab, num_attention_heads=heads,
                  num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=False)
    if family == "qwen3_moe":
        return tf.Qwen3MoeConfig(**common, head_dim=head_dim, num_experts=experts, num_experts_per_tok=top_k,
                                 moe_intermediate_size=intermediate, intermediate_size=2 * intermediate,
                                 norm_topk_prob=True)
    if family == "qwen2_moe":
        return tf.Qwen2MoeConfig(**common, num_experts=experts, num_experts_per_tok=top_k,
                                 moe_intermediate_size=intermediate, intermediate_size=2 * intermediate,
                                 shared_expert_intermediate_size=2 * intermediate, norm_topk_prob=False)
    if family == "mixtral":
        return tf.MixtralConfig(**common, head_dim=head_dim, num_local_experts=experts, num_experts_per_tok=top_k,
                                intermediate_size=intermediate)
    if family == "deepseek_v3":
        n_group = 8 if experts % 8 == 0 and experts >= 16 else 2
        common["num_key_value_heads"] = heads  # multi-head latent attention: one kv head per head
        return tf.DeepseekV3Config(**common, n_routed_experts=experts, num_experts_per_tok=top_k,
                                   moe_intermediate_size=intermediate, intermediate_size=2 * intermediate,
                                   n_shared_experts=1, n_group=n_group, topk_group=n_group // 2,
                                   first_k_dense_replace=1 if layers > 1 else 0, routed_scaling_factor=2.5,
                                   q_lora_rank=64, kv_lora_rank=32, qk_rope_head_dim=16, qk_nope_head_dim=16,
                                   v_head_dim=16)
    if family == "gpt_oss":
        return tf.GptOssConfig(**common, head_dim=head_dim, num_local_experts=experts, num_experts_per_tok=top_k,
                               intermediate_size=intermediate, layer_types=["full_attention"] * layers)
    raise ValueError(family)


def tiny_model(family: str, *shape, device="cpu", dtype=None, seed: int = 0, expert_scale: float = 0.3, **kw):
    import torch
    import transformers as tf

    torch.manual_seed(seed)
    config = tiny_config(family, *shape, **kw)
    with torch.device(device):
        model = tf.AutoModelForCausalLM.from_config(config, dtype=dtype or torch.float32)
    # Routers and DeepSeek's correction bias start at zero (every expert tied): give them values.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("gate.weight", "router.weight")) and p.dim() == 2:
                p.normal_(0, 0.5 / p.shape[1] ** 0.5 * 4)
            elif name.endswith(("experts.gate_up_proj", "experts.down_proj")):
                # [E, 2I, H], [E, H, I] (GPT-OSS: [E, H, 2I], [E, I, H]): each block adds a part of
                # the residual stream (the initializer's 0.02 leaves the experts so small that no
                # error would show).
                fan_in = p.shape[-2] if family == "gpt_oss" else p.shape[-1]
                p.normal_(0, expert_scale * fan_in ** -0.5)
            elif name.endswith(("experts.gate_up_proj_bias", "experts.down_proj_bias")):
                p.normal_(0, 0.1)  # GPT-OSS's expert biases (zeros at init)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.uniform_(-0.05, 0.05)
    return model.eval()


def moe_block_io(model, run):
    """`run()` once with a forward hook on every MoE block (`*.mlp`): returns its result and, per
    block name, the (input, output) that block saw, so a patched block can be fed the same input."""
    seen = {}

    def keep(name):
        def hook(module, args, out):
            seen[name] = (args[0], out)
        return hook

    hooks = [m.register_forward_hook(keep(n)) for n, m in model.named_modules() if n.endswith(".mlp")]
    try:
        result = run()
    finally:
        for h in hooks:
            h.remove()
    return result, seen
