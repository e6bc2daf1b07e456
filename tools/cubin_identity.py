#!/usr/bin/env python3
"""Recompile kernels of a database with the current templates and compare cubins byte for byte.

After a template refactor that must not change shipped kernels:

    python3 tools/cubin_identity.py [--db cache/moe_aot.sqlite] [--match hopws] [--limit 8]

Prints one line per kernel (same / DIFFERENT) and exits non-zero if any cubin differs.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from moe_aot.compiler import build_template  # noqa: E402
from moe_aot.database import Database  # noqa: E402
from moe_aot.kernel_build import compile_kernel  # noqa: E402
from moe_aot.spec import PRESETS, make_spec  # noqa: E402
from moe_aot.variants import LayerVariant, default_variant, token_buckets  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--db", default="cache/moe_aot.sqlite")
    ap.add_argument("--picks", default="cache/tuned/NVIDIA_H200.jsonl")
    ap.add_argument("--match", default="", help="only kernels whose name contains this (comma-separated: any of them)")
    ap.add_argument("--limit", type=int, default=0, help="at most this many kernels (0: all)")
    args = ap.parse_args()
    db = Database(f"sqlite:///{Path(args.db).resolve()}", readonly=True)
    # every kernel of every preset's defaults and committed picks (sm_90a), as `build` makes them
    picks = [json.loads(line) for line in open(args.picks)]
    kernels = {}
    for model in PRESETS:
        spec = make_spec(model, target="sm_90a")
        variants = [default_variant(spec, t) for t in token_buckets()]
        variants += [LayerVariant.parse(p["variant"]) for p in picks if p["workload"] == spec.workload_key]
        for v in variants:
            for kv in v.kernels(spec):
                if any(m in kv.name for m in args.match.split(",")):
                    kernels.setdefault(kv.name, (kv, spec.target))
    stored = {a.name: a for a in db.list_artifacts(status="ok")}
    todo = [k for k in sorted(kernels) if k in stored]
    if args.limit:
        todo = todo[: args.limit]
    bad = 0
    for name in todo:
        kv, target = kernels[name]
        old = db.get_artifact(name, stored[name].toolchain)
        art = compile_kernel(build_template(kv), target, name)
        same = art.cubin == old.cubin
        bad += not same
        print(("same      " if same else "DIFFERENT ") + name, flush=True)
    print(f"{len(todo) - bad} of {len(todo)} cubins identical ({len(kernels) - len(todo)} not in the database)")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
