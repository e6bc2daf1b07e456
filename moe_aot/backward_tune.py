"""Tuning the fused backward (`moe-aot tune --backward`): per layer and token bucket, the
candidates of variants.backward_candidates (the bucket's default, then one part changed at a time:
dH tiles, dX tiles, the data path at 64-row routing tiles, the weight gradients) and the
combination of the parts that beat the default (variants.combine_backward), measured on the GPU
(harness/backward.py: checked against fp32, then the whole backward replayed from CUDA graphs), a
confirmation round over the best few and the default, and the picks derived from the records
exactly as the forward's (picks.derive_picks(..., backward=True)).

The space is a handful of variants per bucket, so it is walked whole rather than sampled: no
optuna study. Records go to the database under the backward's workload key
(variants.backward_workload), keyed by the binaries measured like the forward's; `build --backward`
deploys the picks, and the runtime (runtime.layer.backward_plan) serves them. Compiling
(`compile_candidates`) needs the DSL; measuring does not.
"""
from __future__ import annotations

from typing import Callable

from .database import Database
from .picks import CONFIRM_K, commit_picks, variant_content
from .spec import LayerSpec
from .tuner import Outcome, device_stats, known_outcome, line, uncompiled_content, worker_id
from .variants import BackwardVariant, backward_candidates, backward_workload, combine_backward


def candidate_kernels(specs, buckets) -> list[tuple]:
    """(spec, KernelVariant) of every candidate of every bucket, each kernel once."""
    out = []
    for spec in specs:
        for tokens in buckets:
            for v in backward_candidates(spec, tokens):
                out += [(spec, kv) for kv in v.kernels(spec)]
    return list(dict.fromkeys(out))


def compile_candidates(db: Database, specs, buckets, jobs: int | None = None, progress=None) -> list:
    """Compile every candidate's kernels into `db` (the DSL's side); returns the compile results."""
    from .compiler import compile_into

    for spec in specs:
        db.put_workload(backward_workload(spec), spec.workload_dict())
    return compile_into(db, [], jobs=jobs, progress=progress, extra=candidate_kernels(specs, buckets))


def measure_one(db: Database, spec: LayerSpec, tokens: int, variant: BackwardVariant, measurer) -> Outcome:
    """The recorded outcome of this variant's binaries at this bucket, GPU and driver, else a new
    measurement recorded (a variant whose kernels are not all compiled: a compile_error record)."""
    name = variant.name(spec)
    workload = backward_workload(spec)
    try:
        content, toolchain = variant_content(db, spec, variant)
    except LookupError as exc:
        content, toolchain = uncompiled_content(name, "-"), "-"
        out = Outcome("compile_error", error=str(exc))
    else:
        prev = known_outcome(db, spec, measurer.gpu, measurer.driver, toolchain, tokens, content, workload)
        if prev is not None:
            return prev
        out = measurer(spec, variant, tokens)
    stats = {**out.stats, **device_stats(measurer), "worker": worker_id(), "backward": True}
    db.add_record_once(workload=workload, target=spec.target, toolchain=toolchain, gpu=measurer.gpu,
                       driver=measurer.driver, tokens=tokens, variant=name, content=content, status=out.status,
                       median_us=out.median_us, stats=stats, rel_err=out.rel_err, error=out.error)
    return out


def tune_bucket(db: Database, spec: LayerSpec, tokens: int, measurer, confirm_k: int = CONFIRM_K,
                progress: Callable[[str], None] = line) -> dict[str, Outcome]:
    """Measure one bucket's candidates, then the combination of the parts that beat the default,
    then (confirm_k > 0) a confirmation round. Returns the outcome per variant name."""
    from .measure_worker import confirm_round

    cands = backward_candidates(spec, tokens)
    if not cands:
        progress(f"[backward] {spec.label()} tokens={tokens}: no fused backward on {spec.target}")
        return {}
    base = cands[0]
    seen: dict[BackwardVariant, Outcome] = {}

    def run(v: BackwardVariant, tag: str) -> None:
        out = seen[v] = measure_one(db, spec, tokens, v, measurer)
        took = f"{out.median_us:10.1f}us" if out.median_us else f"{'-':>12}"
        progress(f"[backward{tag}] {spec.label()} tokens={tokens:<6} {out.status:14} {took}  {v.name(spec)}"
                 + (f"  ({out.error[:160]})" if out.error else ""))

    for v in cands:
        run(v, "")
    b = seen[base]
    if b.status == "ok":
        faster = sorted((o.median_us, i, v) for i, (v, o) in enumerate(seen.items())
                        if o.status == "ok" and o.median_us < b.median_us)
        combo = combine_backward(base, [v for *_, v in faster])
        if combo not in seen:
            run(combo, " combined")
    confirm_round(db, spec, tokens, measurer, k=confirm_k, progress=progress, backward=True)
    return {v.name(spec): o for v, o in seen.items()}


def tune_backward(db_url: str | None, specs, buckets, measurer, confirm_k: int = CONFIRM_K,
                  progress: Callable[[str], None] = line) -> int:
    """Every bucket of every layer, then the picks derived and deployed for the measurer's GPU
    (picks.commit_picks). Returns how many picks were deployed."""
    db = Database(db_url)
    try:
        for spec in specs:
            db.put_workload(backward_workload(spec), spec.workload_dict())
            for tokens in buckets:
                tune_bucket(db, spec, tokens, measurer, confirm_k, progress)
        return commit_picks(db, measurer.gpu, specs, backward=True)
    finally:
        db.close()
