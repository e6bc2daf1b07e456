#!/usr/bin/env python3
"""Recompile kernels with the current templates and compare cubins byte for byte.

After a template refactor that must not change shipped kernels: every GEMM of every preset's
defaults and committed picks (`build`'s kernels), against a database built before the change

    python3 tools/cubin_identity.py [--db cache/moe_aot.sqlite] [--match hopws] [--limit 8]

or against cubins written by this tool from a checkout of the old commit (no database needed):

    (old checkout)  python3 tools/cubin_identity.py --precisions fp8,fp8-block128 --targets sm_90a,sm_100a --write DIR
    (this one)      python3 tools/cubin_identity.py --precisions fp8,fp8-block128 --targets sm_90a,sm_100a --against DIR

Prints one line per kernel (same / DIFFERENT) and exits non-zero if any cubin differs.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from moe_aot.compiler import build_template  # noqa: E402
from moe_aot.kernel_build import compile_kernel  # noqa: E402
from moe_aot.spec import PRESETS, SpecError, make_spec  # noqa: E402
from moe_aot.variants import default_variant, parse_variant, token_buckets  # noqa: E402


def build_kernels(picks_path, precisions, targets, match) -> dict:
    """name -> (kernel variant, target): the kernels of every preset's defaults (each target) and
    committed picks (their target), as `build` makes them; with --db all roles, else the GEMMs."""
    picks = [json.loads(line) for line in open(picks_path)]
    kernels = {}
    for model in PRESETS:
        for precision in precisions:
            for target in targets:
                try:
                    spec = make_spec(model, target=target, precision=precision)
                except SpecError:  # gpt-oss's 2880 in fp8
                    continue
                variants = [default_variant(spec, t) for t in token_buckets()]
                variants += [parse_variant(p["variant"]) for p in picks  # a layer's, or a decode kernel
                             if p["workload"] == spec.workload_key and p["target"] == target]
                for v in variants:
                    for kv in v.kernels(spec):
                        if any(m in kv.name for m in match.split(",")):
                            kernels.setdefault(kv.name, (kv, spec.target))
    return kernels


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--db", default="cache/moe_aot.sqlite")
    ap.add_argument("--picks", default="cache/tuned/NVIDIA_H200.jsonl")
    ap.add_argument("--precisions", default="bf16", help="comma-separated (default: bf16)")
    ap.add_argument("--targets", default="sm_90a", help="comma-separated (default: sm_90a)")
    ap.add_argument("--match", default="", help="only kernels whose name contains this (comma-separated: any of them)")
    ap.add_argument("--limit", type=int, default=0, help="at most this many kernels (0: all)")
    ap.add_argument("--write", metavar="DIR", type=Path, help="write each GEMM's cubin to DIR/<name>.cubin")
    ap.add_argument("--against", metavar="DIR", type=Path, help="compare with DIR/<name>.cubin instead of --db")
    args = ap.parse_args()
    kernels = build_kernels(args.picks, args.precisions.split(","), args.targets.split(","), args.match)
    if args.write or args.against:
        kernels = {n: kt for n, kt in kernels.items() if kt[0].role in ("glu", "down", "decode")}
    if args.write:
        args.write.mkdir(parents=True, exist_ok=True)
        for name in sorted(kernels)[: args.limit or None]:
            kv, target = kernels[name]
            (args.write / f"{name}.cubin").write_bytes(compile_kernel(build_template(kv), target, name).cubin)
            print("written   " + name, flush=True)
        return 0
    if args.against:
        old = {p.stem: p.read_bytes for p in args.against.glob("*.cubin")}
    else:
        from moe_aot.database import Database

        db = Database(f"sqlite:///{Path(args.db).resolve()}", readonly=True)
        stored = {a.name: a for a in db.list_artifacts(status="ok")}
        old = {n: (lambda a=a: db.get_artifact(a.name, a.toolchain).cubin) for n, a in stored.items()}
    todo = [k for k in sorted(kernels) if k in old][: args.limit or None]
    bad = 0
    for name in todo:
        kv, target = kernels[name]
        same = compile_kernel(build_template(kv), target, name).cubin == old[name]()
        bad += not same
        print(("same      " if same else "DIFFERENT ") + name, flush=True)
    print(f"{len(todo) - bad} of {len(todo)} cubins identical ({len(kernels) - len(todo)} not found to compare)")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
