"""Compiler stage: (spec, variant, target) -> artifact. See kernel_build for one kernel."""
from __future__ import annotations

from .kernel_build import Artifact, KernelCompileError, compile_kernel  # noqa: F401
