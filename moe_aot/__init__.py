"""moe-aot: ahead-of-time compiled, tuned fused Mixture-of-Experts kernels (CuTe DSL)."""

__version__ = "0.1.0"
