"""tools/raster_l2.py: the model of a persistent grouped GEMM's weight traffic behind the
raster_experts option (hopper_gemm.py). Its group cutting must be the template's, and its byte
counts must reach the bounds they are defined by."""
import importlib.util
from pathlib import Path

import numpy as np

from moe_aot.layout import max_tiles

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("raster_l2", ROOT / "tools" / "raster_l2.py")
raster_l2 = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(raster_l2)


def test_the_model_uses_the_templates_raster_group():
    src = (ROOT / "templates" / "grouped_gemm.py").read_text()
    assert f"RASTER_GROUP = {raster_l2.RASTER_GROUP} " in src


def test_groups_cut_at_the_last_expert_boundary_within_a_group():
    # experts of 3, 5, 2, 12 and 1 tiles, then 4 unused tiles (-1)
    te = np.array([0] * 3 + [1] * 5 + [2] * 2 + [3] * 12 + [4] + [-1] * 4)
    fixed = raster_l2.groups(te, cut=False)
    assert fixed == [(0, 8), (8, 8), (16, 8), (24, 3)]
    cut = raster_l2.groups(te, cut=True)
    # 0..7 holds experts 0 and 1 whole (the boundary at 8 is within the 9 tiles looked at);
    # 8..9 expert 2; expert 3's 12 tiles split 8 + 4 (no boundary within 8), the 4 grouped with
    # expert 4 up to the last boundary (the unused tail's first tile); then the tail
    assert cut == [(0, 8), (8, 2), (10, 8), (18, 5), (23, 4)]
    assert sum(s for _, s in cut) == te.size and all(1 <= s <= raster_l2.RASTER_GROUP for _, s in cut)
    for first, size in cut:  # every group but a long expert's pieces ends where an expert ends
        end = first + size
        assert end == te.size or te[end] != te[end - 1] or size == raster_l2.RASTER_GROUP


def test_weight_bytes_reach_their_bounds():
    rng = np.random.default_rng(1)
    te = raster_l2.tile_experts(experts=64, top_k=4, tokens=2048, tile_m=64, rng=rng)
    used = te[te >= 0]
    assert np.all(np.diff(used) >= 0) and te.size == max_tiles(2048, 4, 64, 64)
    n_tiles, w_tile, a_tile = 6, 1000, 100
    touched = np.unique(used).size
    minimum = touched * n_tiles * w_tile
    for cut in (False, True):
        # an L2 that holds everything: each weight tile and A tile read once
        big = raster_l2.simulate(te, n_tiles, cut, w_tile, a_tile, l2_b=10**12)
        assert round(big["dram_w_gb"] * 1e9) == minimum and round(big["dram_a_gb"] * 1e9) == used.size * a_tile
        # an L2 of one tile: every access misses
        tiny = raster_l2.simulate(te, n_tiles, cut, w_tile, a_tile, l2_b=w_tile)
        assert round(tiny["dram_w_gb"] * 1e9) == used.size * n_tiles * w_tile
    # experts of at most RASTER_GROUP tiles: cut groups read each expert's weights in one group
    counts = np.bincount(used)
    assert counts.max() <= raster_l2.RASTER_GROUP
    assert raster_l2.simulate(te, n_tiles, True, w_tile, a_tile, l2_b=0)["passes"] == 1.0
    assert raster_l2.simulate(te, n_tiles, False, w_tile, a_tile, l2_b=0)["passes"] > 1.0
