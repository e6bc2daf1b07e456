"""Smoke run of the JAX path on a GPU (moe_aot.integrations.jax), printing what a failure needs:

    MOE_AOT_DB=sqlite:///deploy.sqlite python3 tools/jax_smoke.py --model qwen3-30b-a3b --tokens 1,37,1000 \
        [--command-buffers] [--json out.json]

For each token count: the plan (variant, key, workspace shapes), whether the custom call sits in
one of XLA's command buffers (from the thunk sequence XLA dumps after its thunk passes, where
command buffers are formed; tools/jax_cmdbuf_probe.py tries several flag sets and times them),
the error against the fp32 jnp reference
on fresh random inputs with the output poisoned with NaN (every row), and whether dispatching
the call waited for the GPU (it must not: a long matmul chain queued before it is still running
when the call returns). --command-buffers turns on XLA's command buffers for custom calls
(XLA_FLAGS, before jax starts). Exit status 0 when every check passed.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from pathlib import Path

CB_FLAGS = "--xla_gpu_enable_command_buffer=FUSION,CUSTOM_CALL --xla_gpu_graph_min_graph_size=1"


def row_report(out, ref) -> dict:
    """Whole-output and per-row errors of out against the fp32 reference (numpy, every row)."""
    import numpy as np

    out, ref = np.asarray(out, np.float32), np.asarray(ref, np.float32)
    finite = np.isfinite(out).all(axis=1)
    diff = np.where(np.isfinite(out), out - ref, np.inf)
    norms = np.linalg.norm(ref, axis=1)
    floor = max(float(norms.mean()) * 1e-3, 1e-30) if len(norms) else 1e-30
    row_rel = np.linalg.norm(diff, axis=1) / np.maximum(norms, floor)
    maxabs = np.abs(diff).max(axis=1) if out.size else np.zeros(0)
    worst = int(np.argmax(row_rel)) if len(row_rel) else 0
    zero_rows = np.where(norms == 0)[0]
    return {"rel_err": float(np.linalg.norm(diff) / max(float(np.linalg.norm(ref)), 1e-30)),
            "row_rel_err": float(row_rel.max()) if len(row_rel) else 0.0, "worst_row": worst,
            "worst_row_maxabs": float(maxabs[worst]) if len(maxabs) else 0.0,
            "worst_row_ref_max": float(np.abs(ref[worst]).max()) if len(ref) else 0.0,
            "nonfinite_rows": np.where(~finite)[0][:8].tolist(), "n_nonfinite_rows": int((~finite).sum()),
            "zero_rows_nonzero": [int(r) for r in zero_rows if np.any(out[r] != 0)][:8]}


def routing(key, M, E, K, kind="uniform"):
    """Distinct experts per token; "skew": every token from the same K+2 experts; "invalid":
    some ids -1 or E (they contribute nothing)."""
    import jax
    import jax.numpy as jnp

    k1, k2 = jax.random.split(key)
    scores = jax.random.uniform(k1, (M, E))
    if kind == "skew":
        scores = scores + 10.0 * (jnp.arange(E) < K + 2)
    ids = jnp.argsort(-scores, axis=1)[:, :K].astype(jnp.int32)
    w = jax.random.uniform(k2, (M, K), minval=0.1, maxval=1.0)
    w = (w / w.sum(axis=1, keepdims=True)).astype(jnp.float32)
    if kind == "invalid":
        ids = ids.at[::5, K - 1].set(-1).at[1::7, 0].set(E)
    return w, ids


def weights(key, spec):
    import jax
    import jax.numpy as jnp

    k1, k2 = jax.random.split(key)
    E, H, I = spec.experts, spec.hidden, spec.intermediate
    w13 = (jax.random.normal(k1, (E, 2 * I, H), jnp.float32) * H ** -0.5).astype(jnp.bfloat16)
    w2 = (jax.random.normal(k2, (E, H, I), jnp.float32) * I ** -0.5).astype(jnp.bfloat16)
    return w13, w2


def hlo_placement(text: str, target: str, dump_dir=None, module: str | None = None) -> dict:
    """The computations of an optimized HLO module that hold the custom call, and whether the
    call ends inside a command buffer. XLA forms command buffers on the thunk sequence after
    compilation (CommandBufferConversionPass), so the HLO never shows them: with `dump_dir` (the
    run's --xla_dump_to) and the module's name the answer is read from the dumped thunk sequence
    (tools/jax_cmdbuf_probe.py); without, from HLO computation names (older XLA outlined command
    buffers into computations so named)."""
    from jax_cmdbuf_probe import hlo_placement as hlo
    from jax_cmdbuf_probe import thunk_placement

    h = hlo(text, target)
    out = {"computations": h["computations"], "in_command_buffer": h["hlo_command_buffer"]}
    if dump_dir is not None and module is not None:
        t = thunk_placement(dump_dir, module)
        out["thunks"] = {k: t[k] for k in ("file", "kinds", "custom_calls")}
        out["in_command_buffer"] = bool(t["in_command_buffer"]) or h["hlo_command_buffer"]
    return out


def dispatch_is_async(call, args, size: int = 8192, n: int = 60) -> dict:
    """Queue ~n matmuls of size^3 on the GPU, then dispatch `call`: if anything in the call waited
    for the GPU (a host sync), the matmuls would be done by the time it returns."""
    import jax
    import jax.numpy as jnp

    a = jnp.ones((size, size), jnp.bfloat16) * 1e-3

    @jax.jit
    def heavy(a):
        for _ in range(n):
            a = (a @ a) * 1e-2
        return a

    jax.block_until_ready(heavy(a))  # compiled
    t0 = time.perf_counter()
    jax.block_until_ready(heavy(a))
    heavy_ms = 1e3 * (time.perf_counter() - t0)
    jax.block_until_ready(call(*args))  # compiled
    h = heavy(a)
    t0 = time.perf_counter()
    out = call(*args)
    dispatch_ms = 1e3 * (time.perf_counter() - t0)
    heavy_ready, out_ready = h.is_ready(), out.is_ready()
    jax.block_until_ready((h, out))
    return {"heavy_ms": heavy_ms, "dispatch_ms": dispatch_ms, "heavy_ready_after_dispatch": heavy_ready,
            "out_ready_after_dispatch": out_ready, "async": not heavy_ready and not out_ready}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="qwen3-30b-a3b")
    ap.add_argument("--tokens", default="1,37,1000")
    ap.add_argument("--command-buffers", action="store_true")
    ap.add_argument("--no-dispatch-check", action="store_true")
    ap.add_argument("--db", default=None, help="kernel database URL (default MOE_AOT_DB)")
    ap.add_argument("--json", default=None)
    ns = ap.parse_args(argv)
    dump_dir = None
    if ns.command_buffers:  # and a dump, where the thunk sequence says whether the call is in one
        import tempfile

        dump_dir = tempfile.mkdtemp(prefix="jax_smoke_dump_")
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + CB_FLAGS +
                                   f" --xla_dump_to={dump_dir}").strip()
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import jax
    import jax.numpy as jnp
    import jaxlib

    import moe_aot.integrations.jax as mj
    from moe_aot.runtime.verify import ROW_TOLERANCE, TOLERANCE
    from moe_aot.spec import make_spec

    report = {"jax": jax.__version__, "jaxlib": jaxlib.__version__, "xla_flags": os.environ.get("XLA_FLAGS", ""),
              "cases": [], "ok": True}
    dev = jax.devices()[0]
    report["device"] = f"{dev} {getattr(dev, 'device_kind', '')} cc {getattr(dev, 'compute_capability', None)}"
    print(json.dumps({k: report[k] for k in ("jax", "jaxlib", "xla_flags", "device")}), flush=True)
    try:
        report["shim"] = str(mj.build_shim())
        mj.register()
        report["traits_registered"] = dict(mj.REGISTERED_TRAITS)
        print(json.dumps({"traits_registered": report["traits_registered"]}), flush=True)
        spec = make_spec(ns.model, target="sm_90a")
        key = jax.random.PRNGKey(0)
        w13, w2 = weights(key, spec)
        ref_fn = jax.jit(mj.moe_reference)
        def smoke_call(out, *a):
            return mj.fused_moe(*a, out=out, db=ns.db)

        f = jax.jit(smoke_call, donate_argnums=0)
        for i, M in enumerate(int(t) for t in ns.tokens.split(",")):
            kind = ("uniform", "invalid", "skew")[i % 3]
            kx, kr = jax.random.split(jax.random.fold_in(key, M))
            x = jax.random.normal(kx, (M, spec.hidden), jnp.float32).astype(jnp.bfloat16)
            tw, ids = routing(kr, M, spec.experts, spec.top_k, kind)
            poison = jnp.full((M, spec.hidden), jnp.nan, jnp.bfloat16)
            lowered = f.trace(poison, x, w13, w2, tw, ids).lower()
            plan = mj.prepare(x.shape, w13.shape, ids.shape, out=True, db=ns.db)
            compiled = lowered.compile()  # what runs below: its HLO is what is inspected
            case = {"tokens": M, "routing": kind, "variant": plan.variant, "key": plan.key,
                    "results": {n: list(s) for n, (s, _) in plan.results.items()},
                    **hlo_placement(compiled.as_text(), mj.TARGET, dump_dir, "jit_smoke_call")}
            out = compiled(poison, x, w13, w2, tw, ids)
            case.update(row_report(out, ref_fn(x, w13, w2, tw, ids)))
            case["ok"] = (case["n_nonfinite_rows"] == 0 and not case["zero_rows_nonzero"]
                          and case["rel_err"] <= TOLERANCE and case["row_rel_err"] <= ROW_TOLERANCE
                          and (case["in_command_buffer"] or not ns.command_buffers))
            report["ok"] &= case["ok"]
            report["cases"].append(case)
            print(json.dumps(case), flush=True)
        if not ns.no_dispatch_check:
            M = 256
            x = jax.random.normal(key, (M, spec.hidden), jnp.float32).astype(jnp.bfloat16)
            tw, ids = routing(key, M, spec.experts, spec.top_k)
            g = jax.jit(lambda *a: mj.fused_moe(*a, db=ns.db))
            report["dispatch"] = dispatch_is_async(g, (x, w13, w2, tw, ids))
            report["ok"] &= report["dispatch"]["async"]
            print(json.dumps({"dispatch": report["dispatch"]}), flush=True)
    except Exception as exc:  # a smoke run reports whatever broke
        report["ok"] = False
        report["error"] = f"{type(exc).__name__}: {exc}"
        report["traceback"] = traceback.format_exc()[-4000:]
        print(report["traceback"], flush=True)
    if ns.json:
        Path(ns.json).write_text(json.dumps(report, indent=1))
    print("OK" if report["ok"] else "FAILED", flush=True)
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
