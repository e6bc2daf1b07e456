#!/usr/bin/env python3
"""How well moe_aot/perfmodel.py orders variants: its predictions against every measurement one GPU's
tuner rounds recorded (tools/results/tuning_*/all_records.json), per (layer, token bucket).

    python3 tools/perfmodel_check.py [--gpu "NVIDIA H200"] [--out tools/results]
                                     [--records 'tools/results/tuning_*/all_records.json']

Per bucket with at least 4 measured bf16 variants (a variant measured in several sessions counts
once, at its median): Spearman's rank correlation between predicted and measured time, the
regret of trusting the model (measured time of the variant it ranks first / the best measured),
whether its top 3 hold the best, and the ratio predicted / measured of the best. Then the same
for the documented default instead of the model (the default's measured time / the best), so the
two can be compared. The model runs with --gpu's device (perfmodel.device_of: the H200's constants
were fitted on the H200's records; the H100's entry changes only the HBM rate). Writes
OUT/perfmodel_h200.{json,md} for the H200, OUT/perfmodel_<gpu>.{json,md} for another GPU. CPU only,
no DSL.
"""
from __future__ import annotations

import argparse
import glob
import json
import math
import re
import statistics
import sys
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from moe_aot.perfmodel import device_of, predict  # noqa: E402
from moe_aot.spec import make_spec  # noqa: E402
from moe_aot.variants import LayerVariant, can_implement, default_variant  # noqa: E402

WORKLOAD = re.compile(r"^e(\d+)_k(\d+)_h(\d+)_i(\d+)_([a-z]+?)(_bias)?_bf16$")


def spec_of(workload: str):
    m = WORKLOAD.match(workload)
    if not m:
        return None
    e, k, h, i, act, bias = m.groups()
    return make_spec(experts=int(e), top_k=int(k), hidden=int(h), intermediate=int(i), activation=act,
                     bias=bool(bias), target="sm_90a")


def spearman(a, b) -> float:
    def ranks(x):
        order = sorted(range(len(x)), key=lambda i: x[i])
        r = [0.0] * len(x)
        for pos, i in enumerate(order):
            r[i] = pos
        return r
    ra, rb = ranks(a), ranks(b)
    n = len(a)
    ma, mb = sum(ra) / n, sum(rb) / n
    cov = sum((x - ma) * (y - mb) for x, y in zip(ra, rb))
    va = math.sqrt(sum((x - ma) ** 2 for x in ra))
    vb = math.sqrt(sum((y - mb) ** 2 for y in rb))
    return cov / (va * vb) if va and vb else 0.0


# the GPU whose records the model's sm_90a constants were fitted on, and the default of --gpu (the
# H100's records are another GPU's: slower memory, so other times for the same variants)
GPU = "NVIDIA H200"


def buckets(pattern: str, gpu: str = GPU) -> dict:
    """(workload, tokens) -> {variant name: median of its measured medians} over gpu's records."""
    times = defaultdict(lambda: defaultdict(list))
    for path in sorted(glob.glob(pattern)):
        for r in json.load(open(path)):
            if (r.get("status") == "ok" and r.get("median_us") and r["workload"].endswith("_bf16")
                    and r["gpu"] == gpu):
                times[(r["workload"], r["tokens"])][r["variant"]].append(r["median_us"])
    return {key: {v: statistics.median(ts) for v, ts in vs.items()} for key, vs in times.items()}


def measured_buckets(pattern: str, gpu: str = GPU):
    """(workload, tokens, spec, measured) per bf16 bucket with >= 4 measured variants that the
    templates can still build, measured = [(variant, µs)]."""
    for (workload, tokens), measured in sorted(buckets(pattern, gpu).items()):
        spec = spec_of(workload)
        if spec is None:
            continue
        vs = []
        for name, us in measured.items():
            try:
                v = LayerVariant.parse(name)
            except ValueError:
                continue
            if can_implement(spec, v)[0]:
                vs.append((v, us))
        if len(vs) >= 4:
            yield workload, tokens, spec, vs


def evaluate(pattern: str, gpu: str = GPU) -> dict:
    dev = device_of(gpu)
    rows = []
    for workload, tokens, spec, vs in measured_buckets(pattern, gpu):
        measured = {v.name(spec): us for v, us in vs}
        pairs = [(v, us, predict(spec, v, tokens, dev)["seconds"] * 1e6) for v, us in vs]
        meas = [p[1] for p in pairs]
        pred = [p[2] for p in pairs]
        best = min(meas)
        pick = min(pairs, key=lambda p: p[2])
        top3 = sorted(pairs, key=lambda p: p[2])[:3]
        default = default_variant(spec, tokens).name(spec)
        default_us = measured.get(default)
        rows.append({
            "workload": workload, "tokens": tokens, "variants": len(pairs),
            "spearman": spearman(pred, meas), "regret": pick[1] / best,
            "best_in_top3": any(p[1] == best for p in top3),
            "pred_over_meas_best": min(pairs, key=lambda p: p[1])[2] / best,
            "default_regret": None if default_us is None else default_us / best,
        })
    return {"rows": rows}


FIT_GRID = {"warp": (0.25, 0.32, 0.4), "hop": (0.55, 0.64, 0.72),
            "reread": (0.1, 0.25, 0.5), "narrow": (0.0, 0.25, 0.5), "lat": (1.0e-6, 1.6e-6, 2.5e-6),
            "ks": (3e-6, 5e-6, 8e-6), "pdl": (1e-6, 2e-6, 3e-6), "sf": (0.85, 0.9),
            "kt": (0.0, 0.05e-6, 0.1e-6, 0.2e-6)}


def fit(pattern: str) -> None:
    """Coordinate descent of the model's H200 constants on FIT_GRID (three rounds), least geomean
    regret of the pick per bucket (minus 0.05 x mean Spearman); then the same fitted on all layers
    but one and scored on that one. Prints the constants and the scores; perfmodel.py holds the
    fitted values by hand."""
    import dataclasses

    from moe_aot import perfmodel as pm

    data = list(measured_buckets(pattern))
    dev0 = pm.DEVICES["sm_90a"]

    def apply(p):
        pm.MMA_EFFICIENCY.update(warp=p["warp"], hopws=p["hop"], hoppp=p["hop"])
        pm.REREAD, pm.NARROW_EXP, pm.KTILE_S = p["reread"], p["narrow"], p["kt"]
        pm.DEVICES["sm_90a"] = dataclasses.replace(dev0, latency_s=p["lat"], kernel_s=p["ks"], pdl_save_s=p["pdl"],
                                                   stream_frac=p["sf"])

    def score(p, subset):
        apply(p)
        regrets, sps = [], []
        for _, tokens, spec, vs in subset:
            pred = [predict(spec, v, tokens)["seconds"] for v, _ in vs]
            meas = [us for _, us in vs]
            i = min(range(len(vs)), key=lambda j: pred[j])
            regrets.append(math.log(meas[i] / min(meas)))
            sps.append(spearman(pred, meas))
        return (sum(regrets) / len(regrets) - 0.05 * statistics.mean(sps), math.exp(statistics.mean(regrets)),
                statistics.median(sps))

    def descend(subset, p):
        p = dict(p)
        for _ in range(3):
            for key, values in FIT_GRID.items():
                p[key] = min(values, key=lambda v: score({**p, key: v}, subset)[0])
        return p

    d = pm.DEVICES["sm_90a"]
    start = {"warp": pm.MMA_EFFICIENCY["warp"], "hop": pm.MMA_EFFICIENCY["hopws"],
             "reread": pm.REREAD, "narrow": pm.NARROW_EXP, "lat": d.latency_s, "ks": d.kernel_s,
             "pdl": d.pdl_save_s, "sf": d.stream_frac, "kt": pm.KTILE_S}
    print("as committed: regret %.3f, median Spearman %.2f" % score(start, data)[1:])
    best = descend(data, start)
    print("fitted on all:", best, "regret %.3f, median Spearman %.2f" % score(best, data)[1:])
    for layer in sorted({w for w, *_ in data}):
        p = descend([x for x in data if x[0] != layer], start)
        print("fitted without %s, scored on it: regret %.3f, median Spearman %.2f"
              % ((layer,) + score(p, [x for x in data if x[0] == layer])[1:]))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("tools/results"))
    ap.add_argument("--records", default="tools/results/tuning_*/all_records.json")
    ap.add_argument("--gpu", default=GPU, help=f"whose records, with that GPU's model device (default {GPU!r})")
    ap.add_argument("--fit", action="store_true", help="fit the model's H200 constants instead (prints them)")
    ns = ap.parse_args()
    try:
        device_of(ns.gpu)
    except ValueError as e:
        ap.error(str(e))
    if ns.fit:
        if ns.gpu != GPU:
            ap.error(f"--fit fits the {GPU}'s constants, on its records; --gpu {ns.gpu!r} is not that")
        fit(ns.records)
        return 0
    res = evaluate(ns.records, ns.gpu)
    rows = res["rows"]
    if not rows:
        print(f"no {ns.gpu} bucket with >= 4 measured bf16 variants in {ns.records}", file=sys.stderr)
        return 1
    geo = lambda xs: math.exp(sum(math.log(x) for x in xs) / len(xs))  # noqa: E731
    summary = {
        "buckets": len(rows),
        "measured_variants": sum(r["variants"] for r in rows),
        "median_spearman": statistics.median(r["spearman"] for r in rows),
        "geomean_regret": geo([r["regret"] for r in rows]),
        "worst_regret": max(r["regret"] for r in rows),
        "best_in_top3": sum(r["best_in_top3"] for r in rows),
        "geomean_pred_over_meas": geo([r["pred_over_meas_best"] for r in rows]),
    }
    with_default = [r for r in rows if r["default_regret"] is not None]
    if with_default:
        summary["geomean_default_regret"] = geo([r["default_regret"] for r in with_default])
        summary["geomean_model_regret_same_buckets"] = geo([r["regret"] for r in with_default])
    res["summary"] = summary
    ns.out.mkdir(parents=True, exist_ok=True)
    stem = "perfmodel_h200" if ns.gpu == GPU else "perfmodel_" + re.sub(r"[^a-z0-9]+", "_", ns.gpu.lower()).strip("_")
    (ns.out / f"{stem}.json").write_text(json.dumps(res, indent=1))
    lines = [f"# The performance model against the {ns.gpu} tuning records", "",
             f"Command: `python3 tools/perfmodel_check.py {' '.join(sys.argv[1:])}` (moe_aot/perfmodel.py; records: "
             f"`{ns.records}`, bf16 buckets with >= 4 measured variants).", "",
             "| layer | tokens | variants | Spearman | regret (model's pick / best) | best in model's top 3 "
             "| predicted / measured (best) | default / best |", "|" + "---|" * 8]
    for r in rows:
        d = "" if r["default_regret"] is None else f"{r['default_regret']:.3f}"
        lines.append(f"| {r['workload']} | {r['tokens']} | {r['variants']} | {r['spearman']:.2f} | {r['regret']:.3f} | "
                     f"{'yes' if r['best_in_top3'] else 'no'} | {r['pred_over_meas_best']:.2f} | {d} |")
    s = summary
    lines += ["", f"{s['buckets']} buckets, {s['measured_variants']} measured variants: median Spearman "
              f"{s['median_spearman']:.2f}; regret of the model's pick: geomean {s['geomean_regret']:.3f}, worst "
              f"{s['worst_regret']:.3f}; the best in the model's top 3 in {s['best_in_top3']} of {s['buckets']}; "
              f"predicted / measured time of the best: geomean {s['geomean_pred_over_meas']:.2f}."]
    if with_default:
        lines.append(f"Where the documented default was measured ({len(with_default)} buckets): its regret geomean "
                     f"{s['geomean_default_regret']:.3f}, the model's pick's "
                     f"{s['geomean_model_regret_same_buckets']:.3f}.")
    (ns.out / f"{stem}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines[-2:]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
