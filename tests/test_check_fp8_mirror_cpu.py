"""CPU test of tools/check_fp8_kernels.py's --mirror timing (mirror_pairs, kernel_timing.mirrored_rounds):
CUDA-graph timing is replaced by a stand-in that records which config ran and returns a fixed time
per config and GEMM. What is checked is the tool's own logic: each config is paired with its base
(VERSUS) at the same token count only, the rounds run in mirrored order, and the ratios are base /
config per GEMM."""
from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tools"))

import check_fp8_kernels  # noqa: E402

import moe_aot.harness.measure as measure  # noqa: E402

US = {"base": (100.0, 40.0), "new": (80.0, 50.0)}  # (GEMM1, GEMM2) µs per config


def test_mirror_pairs_times_each_config_beside_its_base_in_mirrored_order(monkeypatch):
    ran = []

    def graph_times_us(fns, replays, warmup_s=0.0):
        names = [f() for f in fns]
        ran.append(names[0])
        return [US[names[0]][i % 2] for i in range(replays)]  # the two GEMMs in turn

    monkeypatch.setattr(measure, "graph_times_us", graph_times_us)
    monkeypatch.setitem(check_fp8_kernels.VERSUS, "new", "base")

    def point(tag, tokens):
        row = {"variant": tag, "tokens": tokens, "model": "m", "precision": "fp8"}
        return row, (lambda: tag), (lambda: tag)

    points = [point("base", 4096), point("new", 4096), point("new", 1024)]  # no base at 1024
    rows = check_fp8_kernels.mirror_pairs(points, rounds=3)
    assert ran == ["base", "new", "new", "base", "base", "new"]
    assert len(rows) == 1 and rows[0]["tokens"] == 4096 and rows[0]["config"] == "new"
    assert rows[0]["glu_base_over_config"] == 100.0 / 80.0
    assert rows[0]["down_base_over_config"] == 40.0 / 50.0
    assert rows[0]["rounds_us"]["base"] == ([100.0] * 3, [40.0] * 3)
