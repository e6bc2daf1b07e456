"""How many weight bytes a persistent Hopper grouped GEMM reads from DRAM, fixed raster groups
against groups cut at expert boundaries (templates/hopper_gemm.py raster_experts), by a model:
no GPU needed.

The model: a routing of uniform random top-k experts per token, laid out as the routing kernel
lays it out (each expert's rows padded to tile_m, M tiles in expert order, the tile list as long
as the workspace's worst case, unused tiles expert -1); the persistent CTAs' tiles taken in the
order of their linear index (CTA t % ctas runs tile t in round t // ctas), each tile reading its
expert's weight tile (tile_n x K) and its A rows (tile_m x K); an LRU cache of `--l2-mb` in front
of DRAM at the granularity of those tiles. It counts:
  * passes: per expert, the raster groups that read its weights (1.00 = each expert's weights
    read by one group; the minimum);
  * DRAM GB: weight and A bytes missed by the LRU, against the minimum (every touched expert's
    weights and every A tile once).
It is a model (no L2 set associativity, no partition split, no in-flight overlap within a round):
its numbers are predictions to compare with ncu's dram__bytes_read, not measurements.

    python3 tools/raster_l2.py --models gpt-oss-120b,qwen3-30b-a3b --tokens 4096 --tile-m 64 \
        --out tools/results/raster_l2.json
"""
from __future__ import annotations

import argparse
import json
import sys
from collections import OrderedDict
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from moe_aot.layout import max_tiles  # noqa: E402
from moe_aot.spec import make_spec  # noqa: E402

RASTER_GROUP = 8  # templates/grouped_gemm.py RASTER_GROUP (the template module needs the DSL)


def tile_experts(experts: int, top_k: int, tokens: int, tile_m: int, rng: np.random.Generator) -> np.ndarray:
    """Each M tile's expert (-1 past the used tiles), for one uniform random top-k routing."""
    picks = np.argsort(rng.random((tokens, experts)), axis=1)[:, :top_k]
    counts = np.bincount(picks.ravel(), minlength=experts)
    used = np.repeat(np.arange(experts), (counts + tile_m - 1) // tile_m)
    worst = max_tiles(tokens, top_k, experts, tile_m)  # the workspace's tile list
    return np.concatenate([used, -np.ones(worst - used.size, dtype=used.dtype)])


def groups(tile_expert: np.ndarray, cut: bool) -> list[tuple[int, int]]:
    """(first M tile, size) of each raster group: RASTER_GROUP tiles, or (cut) up to the last
    expert boundary within the first RASTER_GROUP + 1 tiles, as hopper_gemm._group_size."""
    out, first, n = [], 0, tile_expert.size
    while first < n:
        size = min(RASTER_GROUP, n - first)
        if cut:
            window = tile_expert[first:first + RASTER_GROUP + 1].tolist()
            window += [-2] * (RASTER_GROUP + 1 - len(window))  # past the end differs from every expert
            bounds = [j for j in range(1, RASTER_GROUP + 1) if window[j] != window[j - 1]]
            size = bounds[-1] if bounds else RASTER_GROUP
        out.append((first, size))
        first += size
    return out


def simulate(tile_expert: np.ndarray, n_tiles: int, cut: bool, w_tile_b: int, a_tile_b: int,
             l2_b: int) -> dict:
    """DRAM bytes of weights and A under an LRU of l2_b bytes, and the weight passes per expert."""
    lru: OrderedDict = OrderedDict()
    held = 0
    dram = {"w": 0, "a": 0}
    readers: dict[int, set] = {}

    def touch(key, size, kind):
        nonlocal held
        if key in lru:
            lru.move_to_end(key)
            return
        dram[kind] += size
        lru[key] = size
        held += size
        while held > l2_b:
            _, s = lru.popitem(last=False)
            held -= s

    for gi, (first, size) in enumerate(groups(tile_expert, cut)):
        for bn in range(n_tiles):
            for bt in range(first, first + size):
                e = int(tile_expert[bt])
                if e < 0:
                    continue
                readers.setdefault(e, set()).add(gi)
                touch(("w", e, bn), w_tile_b, "w")
                touch(("a", bt), a_tile_b, "a")
    passes = sum(len(g) for g in readers.values()) / max(1, len(readers))
    return {"passes": round(passes, 3), "dram_w_gb": dram["w"] / 1e9, "dram_a_gb": dram["a"] / 1e9,
            "experts_touched": len(readers)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="qwen3-30b-a3b,qwen3-235b-a22b,gpt-oss-120b,deepseek-v3,mixtral-8x7b")
    ap.add_argument("--tokens", default="1024,4096,16384")
    ap.add_argument("--tile-m", type=int, default=64)
    ap.add_argument("--tile-n", default="256", help="GEMM1's and GEMM2's tile_n, or one for both (e.g. 192,192)")
    ap.add_argument("--l2-mb", type=float, default=50.0, help="the modelled L2 (H100 / H200: 50 MB)")
    ap.add_argument("--routings", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path)
    ns = ap.parse_args()
    tns = [int(x) for x in ns.tile_n.split(",")]
    tn1, tn2 = (tns[0], tns[-1])
    rows = []
    for model in ns.models.split(","):
        s = make_spec(model, target="sm_90a")
        for tokens in (int(t) for t in ns.tokens.split(",")):
            for gemm, n, k, tn in (("glu", 2 * s.intermediate, s.hidden, tn1), ("down", s.hidden, s.intermediate, tn2)):
                if n % tn:
                    continue
                res = {}
                for cut in (False, True):
                    acc = []
                    for r in range(ns.routings):
                        te = tile_experts(s.experts, s.top_k, tokens, ns.tile_m, np.random.default_rng(ns.seed + r))
                        acc.append(simulate(te, n // tn, cut, tn * k * 2, ns.tile_m * k * 2, int(ns.l2_mb * 1e6)))
                    res["cut" if cut else "fixed"] = {key: round(float(np.mean([a[key] for a in acc])), 3)
                                                      for key in acc[0]}
                touched = res["fixed"]["experts_touched"]
                w_min = touched * n * k * 2 / 1e9
                row = {"model": model, "tokens": tokens, "gemm": gemm, "tile_m": ns.tile_m, "tile_n": tn,
                       "l2_mb": ns.l2_mb, "weights_min_gb": round(w_min, 3), **res}
                rows.append(row)
                f, c = res["fixed"], res["cut"]
                print(f"{model:16s} {tokens:6d} {gemm:4s} passes {f['passes']:.2f} -> {c['passes']:.2f}  "
                      f"DRAM weights {f['dram_w_gb']:.2f} -> {c['dram_w_gb']:.2f} GB (min {w_min:.2f}), "
                      f"A {f['dram_a_gb']:.2f} -> {c['dram_a_gb']:.2f} GB", flush=True)
    if ns.out:
        ns.out.parent.mkdir(parents=True, exist_ok=True)
        ns.out.write_text(json.dumps({"argv": sys.argv, "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
