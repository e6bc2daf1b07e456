"""The GLU activations of GEMM1 in torch (fp32 references, the op's backward), one copy for the
harness and the integrations. Imports torch only when a function runs."""
from __future__ import annotations

SWIGLUOAI_ALPHA, SWIGLUOAI_LIMIT = 1.702, 7.0  # gpt-oss's published constants (gemm_limits has the kernels')


def activation_fn(name: str):
    import torch.nn.functional as F

    if name == "swiglu":
        return F.silu
    if name == "geglu":
        return lambda t: F.gelu(t, approximate="tanh")
    raise ValueError(name)


def glu_fn(name: str):
    """h = f(gate, up): act(gate) * up, or gpt-oss's clamped SwiGLU ("swigluoai") as transformers'
    GptOssExperts computes it: gate clamped to <= limit, up to [-limit, limit],
    (up + 1) * gate * sigmoid(alpha * gate)."""
    import torch

    if name == "swigluoai":
        def swigluoai(g, u):
            g = g.clamp(max=SWIGLUOAI_LIMIT)
            u = u.clamp(min=-SWIGLUOAI_LIMIT, max=SWIGLUOAI_LIMIT)
            return (u + 1) * (g * torch.sigmoid(SWIGLUOAI_ALPHA * g))
        return swigluoai
    act = activation_fn(name)
    return lambda g, u: act(g) * u
