"""tools/bench_backward.py's table: a path that ran out of the GPU's memory at one point (DeepSeek-V3
at 16384 tokens on an 80 GB H100 with torch's weight gradients) shows as OOM, and the geometric means
are taken over the points where both paths ran, instead of the whole run stopping there."""
import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
_spec = importlib.util.spec_from_file_location("bench_backward", ROOT / "tools" / "bench_backward.py")
bb = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bb)


def _row(model, tokens, ours, recompute, torch_):
    """A point()-shaped row: each path's (fwd, step) in µs, or None where it did not fit."""
    r = {"model": model, "tokens": tokens, "fused_gemms": True, "bwd_variant": None, "floor_step_us": 100.0,
         "floor_bwd_us": 50.0, "floor_bwd_sustained_us": 60.0,
         "grad_rel_diff": None if ours is None or torch_ is None else {"x": 1e-3, "w13": 6e-3}}
    for key, res in (("ours", ours), ("recompute", recompute), ("torch", torch_)):
        r[f"{key}_fwd"], r[f"{key}_step"] = res or (None, None)
        r[f"{key}_bwd"] = None if res is None else res[1] - res[0]
        r[f"saved_bytes_{key}"] = None if res is None else 2**20 * 3
    r["step_speedup"] = bb._ratio(r["torch_step"], r["ours_step"])
    r["bwd_speedup"] = bb._ratio(r["torch_bwd"], r["ours_bwd"])
    return r


def test_an_out_of_memory_path_is_a_cell_not_the_end_of_the_run():
    rows = [_row("a", 4096, (100.0, 300.0), (100.0, 350.0), (150.0, 750.0)),  # step 2.5x, bwd 3x
            _row("b", 4096, (100.0, 500.0), (100.0, 600.0), (150.0, 1150.0)),  # step 2.3x, bwd 2.5x
            _row("deepseek-v3", 16384, (100.0, 900.0), None, None)]  # torch's paths out of memory
    lines = bb.table_md(rows, "NVIDIA H100 80GB HBM3", "2026-12-07 04:05 UTC", 7e14, 6e14, ["--out", "x"])
    oom = next(line for line in lines if line.startswith("| deepseek-v3 | 16384 |"))
    cells = [c.strip() for c in oom.strip("|").split("|")]
    assert cells[3] == "900" and cells[4] == "OOM" and cells[5] == "OOM" and cells[6] == "OOM"  # fwd+bwd
    assert cells[7] == "800" and cells[8:11] == ["OOM", "OOM", "OOM"]  # the backward alone
    assert cells[12] == "9.00" and cells[16] == "3 / OOM" and cells[17] == "OOM"  # ours/floor; saved; grad diff
    geo = next(line for line in lines if line.startswith("Geometric"))
    assert f"fwd+bwd torch/ours {(2.5 * 2.3) ** 0.5:.2f}, backward torch/ours {(3 * 2.5) ** 0.5:.2f}" in geo
    assert f"Backward over its floor: ours {(200 / 50 * 400 / 50 * 800 / 50) ** (1 / 3):.2f}" in geo


def test_a_run_where_nothing_fits_has_no_means_rather_than_a_crash():
    lines = bb.table_md([_row("deepseek-v3", 16384, None, None, None)], "NVIDIA H100 80GB HBM3",
                        "2026-12-07 04:05 UTC", 7e14, 6e14, [])
    assert "fwd+bwd torch/ours OOM" in next(line for line in lines if line.startswith("Geometric"))


def test_a_paths_mirrored_measurements_are_averaged_and_both_kept():
    """_merged: a path measured twice (the mirrored order) reads the mean of its forward, backward
    and step times and keeps each; a measurement that ran out of memory is left out of the mean; a
    path that never fit is None (an OOM cell). The backward is its own measurement, not the step
    less the forward."""
    a = ({"fwd": 100.0, "bwd": 190.0, "step": 300.0, "saved": 7}, "grads")
    b = ({"fwd": 110.0, "bwd": 160.0, "step": 260.0, "saved": 7}, None)
    m = bb._merged([a, b])
    assert (m["fwd"], m["bwd"], m["step"], m["saved"]) == (105.0, 175.0, 280.0, 7)
    assert m["runs"] == [(100.0, 190.0, 300.0), (110.0, 160.0, 260.0)]
    assert bb._bwd(m) == 175.0
    assert bb._bwd({"fwd": 100.0, "bwd": 150.0, "step": 300.0}) == 150.0
    m = bb._merged([(None, None), b])
    assert (m["fwd"], m["step"]) == (110.0, 260.0) and m["runs"] == [None, (110.0, 160.0, 260.0)]
    assert bb._merged([(None, None), (None, None)]) is None


def test_saved_bytes_leaves_no_reference_cycle():
    """saved_bytes counts what autograd saves without keeping it: a node that saves its own output
    (sigmoid) must not hold that output alive after the forward's result is dropped."""
    import gc
    import weakref

    import torch

    x = torch.randn(100, 100, requires_grad=True)
    kept = []

    def fwd():
        y = torch.sigmoid(x.float() * 2)
        kept.append(weakref.ref(y))
        return y.sum()

    assert bb.saved_bytes(fwd, weights=(x,)) == 100 * 100 * 4  # sigmoid's output; x (a weight) not counted
    gc.collect()
    assert kept[0]() is None, "the forward's output outlived saved_bytes"
