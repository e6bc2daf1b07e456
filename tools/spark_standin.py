#!/usr/bin/env python3
"""The DGX Spark layers and their tuning flow, exercised on an H100/H200 through the sm_90a stand-in
(target "sm_121a-standin", moe_aot/gemm_limits.STANDINS): the Spark's variants, limits and kernels,
built for sm_90a, the block-scaled MMA emulated.

  python3 tools/spark_standin.py --build DIR [-j N] [--trials N] [--gpu NAME] [--precisions P,..]
      (CPU, needs the DSL) into DIR/standin.sqlite: the bucket defaults of every layer, precision
      and token count of harness/blockscaled.STANDIN_CHECKS (`compile_into`, as `moe-aot build`
      does), then `moe-aot tune --compile-only --target sm_121a-standin` of the small layer (bf16 at
      1 and 256 tokens, mxfp8 and nvfp4 at 1 token, --trials each) for --gpu (default NVIDIA H200).
      Kernels already in DIR/standin.sqlite are kept, so a second --build compiles only what is new.
  python3 tools/spark_standin.py --run DIR --out OUTDIR [--replays N] [--precisions P,..]
      (H100/H200, torch + moe_aot, no DSL) every check of STANDIN_CHECKS twice (uniform and skewed
      routing) through MoeLayer.forward against the fp32 references (harness/verify.check_stages:
      mxfp8 / nvfp4 / w4a8-mx each stage on the bytes its kernels consumed), a CUDA-graph replay of each
      block-scaled layer against its eager forward, then `moe-aot measure --target
      sm_121a-standin` on a copy of the database in OUTDIR (the compiled trials, each bucket's
      default, a confirmation round). Writes OUTDIR/checks.json, OUTDIR/measure.txt,
      OUTDIR/summary.txt and OUTDIR/standin.sqlite (the records); exits 1 on any failed check.
  --precisions (both steps): only these precisions' layers and tuning (e.g. w4a8-mx: its kernels
      alone, no tuning, none measured).
  --gpt-oss (both steps): only the gpt-oss-shape checks (harness/blockscaled.GPT_OSS_CHECK: H = I =
      2880, K padded to 2944, clamped SwiGLU, expert biases, 8 experts, top-4; no tuning), e.g.
      `--build DIR --gpt-oss --precisions w4a8-mx` then `--run DIR --out OUT --gpt-oss --precisions w4a8-mx`.

What passing means: the Spark layer's kernels, runtime path and tuning flow are right everywhere
except the block-scaled mma.sync instruction itself (emulated here; it needs an sm_120-family GPU)
and the e2m1 conversion instruction (software here). Times are the H200's, of sm_90a builds with an
emulated MMA: they say nothing about a Spark's speed.
"""
from __future__ import annotations

import argparse
import json
import sqlite3
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

STANDIN = "sm_121a-standin"
DB_NAME = "standin.sqlite"
SMALL = dict(experts=8, top_k=2, hidden=1024, intermediate=512)
# (precision, token buckets) of the compile-only tuning of the small layer
TUNE = (("bf16", "1,256"), ("mxfp8", "1"), ("nvfp4", "1"))


def _specs(only=None, gpt_oss=False):
    from moe_aot.harness.blockscaled import GPT_OSS_CHECK, STANDIN_CHECKS
    from moe_aot.spec import make_spec

    for fields, precisions, tokens in ((GPT_OSS_CHECK,) if gpt_oss else STANDIN_CHECKS):
        for p in precisions:
            if only is None or p in only:
                yield make_spec(**fields, precision=p, target=STANDIN), tokens


def _tune(only=None, gpt_oss=False):
    return [] if gpt_oss else [(p, t) for p, t in TUNE if only is None or p in only]


def _cli(args: list[str]) -> None:
    from moe_aot.cli import main

    print("$ moe-aot " + " ".join(args), flush=True)
    main.main(args, standalone_mode=False)


def build(folder: Path, jobs: int, trials: int, gpu: str, only=None, gpt_oss=False) -> int:
    from moe_aot.compiler import compile_into
    from moe_aot.database import Database
    from moe_aot.variants import bucket_for, default_variant

    folder.mkdir(parents=True, exist_ok=True)
    url = f"sqlite:///{folder / DB_NAME}"
    pairs = [(spec, default_variant(spec, b)) for spec, tokens in _specs(only, gpt_oss)
             for b in sorted({bucket_for(t) for t in tokens})]
    t0 = time.time()

    def progress(res, i, n):
        status = "ok    " if res.error is None else "FAILED"
        print(f"{status} {i}/{n} {res.seconds:6.1f}s {res.kernel.name}" + (f": {res.error}" if res.error else ""),
              flush=True)

    with Database(url) as db:
        results = compile_into(db, pairs, jobs=jobs, progress=progress)
    failed = [r for r in results if r.error]
    print(f"defaults: {len(results)} kernels compiled, {len(failed)} failed, {time.time() - t0:.0f}s", flush=True)
    sizes = [f"--{k.replace('_', '-')}={v}" for k, v in SMALL.items()]
    for precision, tokens in _tune(only, gpt_oss):
        _cli(["tune", "--compile-only", "--gpu", gpu, "--target", STANDIN, *sizes, "--precision", precision,
              "--tokens", tokens, "--trials", str(trials), "--seed", "0", "-j", str(jobs), "--db", url])
    print(f"built {url} in {time.time() - t0:.0f}s", flush=True)
    return 1 if failed else 0


def run(folder: Path, out: Path, replays: int, only=None, gpt_oss=False) -> int:
    import torch

    from moe_aot.gemm_limits import BLOCKSCALED
    from moe_aot.harness.blockscaled import graph_replay_check
    from moe_aot.harness.verify import check_stages, random_routing, random_weights
    from moe_aot.runtime.layer import MoeLayer
    from moe_aot.runtime.store import KernelStore
    from moe_aot.variants import bucket_for

    out.mkdir(parents=True, exist_ok=True)
    gpu = torch.cuda.get_device_name()
    store = KernelStore(f"sqlite:///{folder / DB_NAME}")
    rows, t0 = [], time.time()
    for spec, tokens in _specs(only, gpt_oss):
        layer = MoeLayer(spec, store, variants={})
        w13, w2 = random_weights(spec, layer.device)
        for t in tokens:
            for routing in ("uniform", "skewed"):
                x = torch.randn(t, spec.hidden, device=layer.device, dtype=torch.bfloat16)
                tw, ids = random_routing(t, spec, layer.device, skew=routing == "skewed")
                for r in check_stages(layer, x, w13, w2, tw, ids):
                    r.update(layer=spec.label(), precision=spec.precision, tokens=t, routing=routing)
                    rows.append(r)
                    print(json.dumps(r), flush=True)
        if spec.precision in BLOCKSCALED:
            r = graph_replay_check(layer, w13, w2, tokens[-1])
            r.update(layer=spec.label(), precision=spec.precision, variant=layer.variant_for(tokens[-1]).name(spec))
            rows.append(r)
            print(json.dumps(r), flush=True)
        del layer, w13, w2
        torch.cuda.empty_cache()
    (out / "checks.json").write_text(json.dumps(rows, indent=1))
    bad = [r for r in rows if not r["ok"]]
    lines = [f"{len(rows) - len(bad)} of {len(rows)} stand-in checks passed on {gpu} ({time.time() - t0:.0f}s)"]
    lines += [f"  FAILED {json.dumps(r)}" for r in bad]

    if not _tune(only, gpt_oss):  # --precisions without a tuned one, or --gpt-oss: the checks alone
        (out / "summary.txt").write_text("\n".join(lines) + "\n")
        print("\n".join(lines), flush=True)
        return 1 if bad else 0

    # the tuning flow: measure what `tune --compile-only` left ready, on a copy (OUTDIR holds the records);
    # the checks alone above need only torch and the runtime (no sqlalchemy)
    from moe_aot import picks
    from moe_aot.database import Database

    db_copy = out / DB_NAME
    db_copy.unlink(missing_ok=True)
    src, dst = sqlite3.connect(folder / DB_NAME), sqlite3.connect(db_copy)
    src.backup(dst)  # with what a write-ahead log holds
    src.close(), dst.close()
    url = f"sqlite:///{db_copy}"
    measured_ok = True
    try:
        _cli(["measure", "--target", STANDIN, "--replays", str(replays), "--confirm", "1",
              "--export-dir", str(out / "tuned"), "--db", url])
    except Exception as exc:  # reported, and the run fails
        measured_ok = False
        lines.append(f"measure FAILED: {type(exc).__name__}: {exc}")
    from moe_aot.spec import make_spec

    sizes = dict(SMALL, target=STANDIN)
    with Database(url) as db:
        report = []
        for precision, tokens in _tune(only, gpt_oss):
            spec = make_spec(**sizes, precision=precision)
            buckets = [bucket_for(int(t)) for t in tokens.split(",")]
            rows_ = picks.summary(db, spec, gpu, buckets)
            report.append(picks.format_summary(spec, gpu, rows_))
            measured_ok &= all(r["ok"] > 0 for r in rows_)
            for pk in picks.derive_picks(db, spec, gpu):
                report.append(f"  pick t{pk.tokens}: {pk.variant} {pk.median_us:.1f} us "
                              f"(default {pk.default} {pk.default_us} us)")
    (out / "measure.txt").write_text("\n\n".join(report) + "\n")
    lines.append(("" if measured_ok else "FAILED: ") + "tune -> measure on the stand-in: see measure.txt")
    print("\n\n".join(report), flush=True)
    (out / "summary.txt").write_text("\n".join(lines) + "\n")
    print("\n".join(lines), flush=True)
    return 1 if bad or not measured_ok else 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--build", type=Path, help="compile the stand-in database into this folder (CPU, DSL)")
    ap.add_argument("--run", type=Path, help="check and measure the stand-ins of this folder (GPU)")
    ap.add_argument("--out", type=Path, default=Path("spark_standin"))
    ap.add_argument("-j", "--jobs", type=int, default=2)
    ap.add_argument("--trials", type=int, default=3, help="compile-only trials per tuned bucket (default 3)")
    ap.add_argument("--gpu", default="NVIDIA H200", help="the GPU the trials are for, as torch names it")
    ap.add_argument("--replays", type=int, default=30, help="CUDA-graph replays per measurement (default 30)")
    ap.add_argument("--precisions", help="only these precisions (comma-separated), e.g. w4a8-mx")
    ap.add_argument("--gpt-oss", action="store_true", help="only the gpt-oss-shape checks (GPT_OSS_CHECK)")
    args = ap.parse_args()
    if bool(args.build) == bool(args.run):
        ap.error("give exactly one of --build DIR and --run DIR")
    only = set(args.precisions.split(",")) if args.precisions else None
    if args.build:
        return build(args.build, args.jobs, args.trials, args.gpu, only, args.gpt_oss)
    return run(args.run, args.out, args.replays, only, args.gpt_oss)


if __name__ == "__main__":
    sys.exit(main())
