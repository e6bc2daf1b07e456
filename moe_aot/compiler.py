"""Compiler stage: (spec, variant) -> kernel artifacts in the database, on any machine, no GPU.

Jobs run in a pool of spawned processes (the DSL is not fork-safe and each compile is
CPU-bound); every kernel that fails is recorded with the compiler's message and the batch goes on.
Kernels already in the database under the same name and toolchain are not compiled again.
"""
from __future__ import annotations

import os
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass
from multiprocessing import get_context
from pathlib import Path
from typing import Callable, Iterable

from .gemm_limits import BLOCKSCALED, UMMA, W4, WARP_SPECIALIZED
from .hosts import HOSTS, host_for
from .kernel_build import Artifact, HostToolchainError, KernelCompileError, compile_kernel, host_toolchain  # noqa: F401
from .spec import LayerSpec
from .variants import KernelVariant, LayerVariant, can_implement


def templates_hash(host: str = "x86-64") -> str:
    """Hash of the kernel sources (the templates, the validity rules they import, gemm_limits.py,
    and the CUDA runtime shim every library links, cudart_shim.c): editing any must never reuse a
    stale binary. For a host other than x86-64 its --host-target (hosts.py) is hashed too, so a
    changed baseline CPU is a new key; x86-64 keys stay those of every existing database."""
    import hashlib

    import moe_aot_templates

    from . import gemm_limits
    from .kernel_build import CUDART_SHIM

    h = hashlib.sha256()
    for path in (sorted(Path(moe_aot_templates.__file__).parent.glob("*.py")) + [Path(gemm_limits.__file__)]
                 + [CUDART_SHIM]):
        h.update(path.name.encode() + b"\0" + path.read_bytes())
    if host != "x86-64":
        h.update(b"host\0" + HOSTS[host].llvm_target.encode())
    return h.hexdigest()[:12]


def toolchain_key(target: str) -> str:
    """The fingerprint string artifacts are keyed by: DSL version, CUDA flavour, arch, host
    (hosts.TARGET_HOSTS: x86-64, aarch64 for sm_121a), artifact format and the templates' source
    hash."""
    from .kernel_build import toolchain_fingerprint

    fp = toolchain_fingerprint(target)
    host = host_for(target).name
    return (f"{fp['dsl']}|{fp['cuda_flavour']}|{fp['arch']}|{host}|fmt{fp['artifact_format']}"
            f"|src{templates_hash(host)}")


# The template registry: (role, family) -> (module under moe_aot_templates, class). A GEMM's
# family is its precision's where that has templates of its own (fp8: "fp8" on the Hopper core,
# "fp8_warp" on mma.sync; mxfp4-w: "w4"; mxfp8 / nvfp4: "blockscaled"), else its MMA's mainloop
# family ("grouped": mma.sync, "hopper": hopws / hoppp, "umma": tcgen05 on sm_100a; the
# block-scaled ones on tcgen05: "blockscaled_umma"): one
# template module per family, all taking the same constructor arguments per role.
TEMPLATES = {
    ("routing", None): ("routing", "MoeRouting"),
    ("combine", None): ("routing", "MoeCombine"),
    ("routing", "quant"): ("routing", "MoeRoutingQuant"),  # fp8: x quantized in the same launch
    ("glu_bwd", None): ("glu_backward", "GluBackward"),
    ("dh", None): ("hopper_bwd", "HopperDhGemm"),
    ("dx", None): ("hopper_bwd", "HopperDxGemm"),
    ("wgrad", None): ("hopper_wgrad", "HopperWgrad"),
    ("bsquant", None): ("blockscale_quant", "BlockScaleQuant"),
    ("decode", None): ("decode", "MoeDecode"),  # the whole layer in one launch (a DecodeVariant)
    ("glu", "grouped"): ("grouped_gemm", "GroupedGluGemm"),
    ("down", "grouped"): ("grouped_gemm", "GroupedDownGemm"),
    ("glu", "hopper"): ("hopper_gemm", "HopperGluGemm"),
    ("glu_train", "hopper"): ("hopper_gemm", "HopperGluGemm"),  # with save_preact=True
    ("glu_train", "grouped"): ("grouped_gemm", "GroupedGluGemm"),  # refuses save_preact, in one sentence
    ("down", "hopper"): ("hopper_gemm", "HopperDownGemm"),
    ("glu", "fp8"): ("hopper_fp8", "HopperGluGemmFp8"),
    ("down", "fp8"): ("hopper_fp8", "HopperDownGemmFp8"),
    ("glu", "fp8_warp"): ("warp_fp8", "WarpGluGemmFp8"),
    ("down", "fp8_warp"): ("warp_fp8", "WarpDownGemmFp8"),
    ("glu", "w4"): ("grouped_w4", "GroupedGluGemmW4"),
    ("down", "w4"): ("grouped_w4", "GroupedDownGemmW4"),
    ("glu", "blockscaled"): ("blockscaled_warp", "BlockScaledGluGemm"),
    ("down", "blockscaled"): ("blockscaled_warp", "BlockScaledDownGemm"),
    ("glu", "umma"): ("blackwell_gemm", "BlackwellGluGemm"),
    ("down", "umma"): ("blackwell_gemm", "BlackwellDownGemm"),
    ("glu", "blockscaled_umma"): ("blackwell_blockscaled", "BlackwellBlockScaledGluGemm"),
    ("down", "blockscaled_umma"): ("blackwell_blockscaled", "BlackwellBlockScaledDownGemm"),
}


def template_family(kv: KernelVariant) -> str | None:
    kw = kv.kwargs()
    if kv.role == "routing":
        return "quant" if "quant" in kw else None
    if kv.role not in ("glu", "down", "glu_train"):
        return None
    precision = kw.get("precision", "bf16")
    if precision in W4:
        return "w4"
    if precision in BLOCKSCALED:
        return "blockscaled_umma" if kw.get("mma") in UMMA else "blockscaled"
    if precision != "bf16":
        return "fp8" if kw.get("mma") in WARP_SPECIALIZED else "fp8_warp"
    if kw.get("mma") in UMMA:
        return "umma"
    return "hopper" if kw.get("mma") in WARP_SPECIALIZED else "grouped"


def build_template(kv: KernelVariant):
    """The template object for one kernel variant (imports the DSL)."""
    import importlib

    key = (kv.role, template_family(kv))
    if key not in TEMPLATES:
        raise ValueError(f"unknown kernel role {kv.role!r}")
    module, cls = TEMPLATES[key]
    return getattr(importlib.import_module(f"moe_aot_templates.{module}"), cls)(**kv.kwargs())


@dataclass
class JobResult:
    kernel: KernelVariant
    target: str
    artifact: Artifact | None
    error: str | None
    seconds: float


def _compile_job(kv: KernelVariant, target: str) -> JobResult:
    t0 = time.perf_counter()
    try:
        art = compile_kernel(build_template(kv), target, kv.name)
        return JobResult(kv, target, art, None, time.perf_counter() - t0)
    except KernelCompileError as exc:  # the only failure that is this kernel's: DSL, ptxas, linker
        return JobResult(kv, target, None, str(exc), time.perf_counter() - t0)
    # anything else (TemplateBugError, a template refusing what can_implement allowed, ...) is a
    # programming error and propagates: it stops the batch instead of becoming a failed kernel


def kernels_for(specs_and_variants: Iterable[tuple[LayerSpec, LayerVariant]]) -> list[tuple[LayerSpec, KernelVariant]]:
    """Distinct kernels needed by (spec, variant) pairs; variants that cannot serve their spec
    raise ValueError with the reason."""
    seen, out = set(), []
    for spec, var in specs_and_variants:
        ok, why = can_implement(spec, var)
        if not ok:
            raise ValueError(f"{var.name(spec)} cannot implement {spec.label()}: {why}")
        for kv in var.kernels(spec):
            key = (spec.target, kv.name)
            if key not in seen:
                seen.add(key)
                out.append((spec, kv))
    return out


def compile_into(db, specs_and_variants, jobs: int | None = None,
                 progress: Callable[[JobResult, int, int], None] | None = None,
                 force: bool = False, extra: Iterable[tuple[LayerSpec, KernelVariant]] = ()) -> list[JobResult]:
    """Compile every kernel the pairs need into `db`, and the (spec, kernel) pairs of `extra`
    (kernels outside a layer variant: the backward's; a spec there may be any workload with
    `workload_key`, `workload_dict()` and `target`, e.g. variants.BlockScaleShape); returns the
    results of the jobs that ran."""
    needed = kernels_for(specs_and_variants)
    needed += [e for e in extra if e not in needed]
    tool = {}
    todo = []
    for spec, kv in needed:
        if spec.target not in tool:
            tool[spec.target] = toolchain_key(spec.target)
        db.put_workload(spec.workload_key, spec.workload_dict())
        if force or not db.has_artifact(kv.name, tool[spec.target]):
            todo.append((spec, kv))
    results: list[JobResult] = []
    if not todo:
        return results
    # The linker and runtime archive of each host first (a cross build may fetch its archive):
    # without them no kernel could link, and none must be recorded as a failed kernel.
    for host in {host_for(spec.target) for spec, _ in todo}:
        host_toolchain(host)
    jobs = max(1, min(jobs or os.cpu_count() or 1, len(todo)))
    owner = {kv.name: spec for spec, kv in todo}

    def record(res: JobResult) -> None:
        spec = owner[res.kernel.name]
        common = dict(name=res.kernel.name, workload=spec.workload_key, role=res.kernel.role,
                      target=res.target, toolchain=tool[res.target], compile_s=round(res.seconds, 3))
        if res.artifact is not None:
            db.put_artifact(status="ok", library=res.artifact.library, cubin=res.artifact.cubin,
                            meta=res.artifact.meta, **common)
        else:
            db.put_artifact(status="failed", error=res.error, **common)
        results.append(res)
        if progress:
            progress(res, len(results), len(todo))

    if jobs == 1:
        for spec, kv in todo:
            record(_compile_job(kv, spec.target))
        return results
    pool = ProcessPoolExecutor(max_workers=jobs, mp_context=get_context("spawn"))
    try:
        futures = [pool.submit(_compile_job, kv, spec.target) for spec, kv in todo]
        for fut in as_completed(futures):
            record(fut.result())  # each kernel is in the database as soon as it is compiled
    except BaseException:
        # Ctrl-C (or a failure here): stop at once, keep what finished, drop what is queued or
        # running (a pool's own exit would first wait for every queued compile)
        pool.shutdown(wait=False, cancel_futures=True)
        for proc in list((getattr(pool, "_processes", None) or {}).values()):
            proc.terminate()
        raise
    pool.shutdown()
    return results
