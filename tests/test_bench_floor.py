"""tools/bench.py's floor: the bytes go at the running GPU's HBM rate, and a GPU the table does not
know is refused rather than measured against another card's rate; the result files carry the
card's name."""
import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
_spec = importlib.util.spec_from_file_location("bench", ROOT / "tools" / "bench.py")
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)


def test_the_floor_takes_the_gpus_hbm_rate():
    flops, bytes_, rate = 1e12, 6.7e9, 1e15  # 1 ms of matmul, 2 ms of H100 HBM
    h100, h200 = bench.hbm_bytes_per_s("NVIDIA H100 80GB HBM3"), bench.hbm_bytes_per_s("NVIDIA H200")
    assert bench.floor_us(flops, bytes_, rate, h100) == pytest.approx(2000.0)
    assert bench.floor_us(flops, bytes_, rate, h200) == pytest.approx(6.7e9 / 4.8e12 * 1e6)
    assert bench.floor_us(flops, 1e6, rate, h100) == pytest.approx(1000.0)  # compute-bound: the matmul rate


def test_an_unknown_gpu_has_no_floor():
    with pytest.raises(SystemExit, match=r"no HBM rate known for 'NVIDIA B200', so no floor; known GPUs: NVIDIA H200"):
        bench.hbm_bytes_per_s("NVIDIA B200")


def test_result_files_are_named_after_the_card():
    # bench.py, bench_fp8.py and bench_backward.py write bench[_fp8|_backward]_<card>.{json,md}
    assert bench.card_tag("NVIDIA H200") == "h200"
    assert bench.card_tag("NVIDIA H100 80GB HBM3") == "h100"
    assert bench.card_tag("NVIDIA GB10") == "gb10"
    with pytest.raises(SystemExit, match=r"cannot name result files after the GPU 'NVIDIA': its name has no model"):
        bench.card_tag("NVIDIA")
