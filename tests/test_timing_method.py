"""How measurements are timed: the warm-up to the GPU's sustained clock keeps its records apart
from burst timings, and the NVML readings that go with each timing (CPU: a fake reader)."""
from __future__ import annotations

import json
import time

import pytest
from click.testing import CliRunner
from tuner_fakes import GPU, DefaultVsOthers, fake_compile

from moe_aot import measure_worker, picks, tuner
from moe_aot.cli import main
from moe_aot.database import SUSTAINED_WARMUP_S, Database, timing_context
from moe_aot.harness import gpustate
from moe_aot.spec import make_spec
from moe_aot.variants import default_variant

SPEC = make_spec("qwen3-30b-a3b")
DRIVER = "580.95.05 (CUDA 13.0)"


@pytest.fixture()
def url(tmp_path):
    return f"sqlite:///{tmp_path / 'm.sqlite'}"


def test_the_timing_context_keeps_burst_records_as_they_were_and_names_the_warmup():
    assert timing_context(DRIVER, 0) == DRIVER  # the records before the warm-up existed keep their context
    sustained = timing_context(DRIVER, SUSTAINED_WARMUP_S)
    assert sustained != DRIVER and sustained.startswith(DRIVER) and "sustained 0.5 s" in sustained
    assert timing_context(DRIVER, 0.25) != sustained


def test_sustained_timings_are_judged_apart_from_burst_ones(url, tmp_path):
    """Candidates timed in bursts beat the default by 10%; timed at the sustained clock they lose.
    The bucket is judged in the context of the default's newest record: the sustained one."""
    d = default_variant(SPEC, 64).name(SPEC)
    tuner.prepare(url, [SPEC], (64,), GPU, trials=3, jobs=0, compile_fn=fake_compile, seed=1, progress=lambda s: None)
    burst = DefaultVsOthers(default_us=10.0, other_us=9.0, driver=timing_context(DRIVER, 0))
    measure_worker.measure(url, burst, progress=lambda s: None, confirm=0)
    tuner.prepare(url, [SPEC], (64,), GPU, trials=6, jobs=0, compile_fn=fake_compile, seed=2, progress=lambda s: None)
    sustained = DefaultVsOthers(default_us=12.0, other_us=14.0, driver=timing_context(DRIVER, SUSTAINED_WARMUP_S))
    measure_worker.measure(url, sustained, progress=lambda s: None, confirm=0)
    assert sustained.calls[0] == d  # no sustained record of the default yet: measured first
    with Database(url) as db:
        [path] = picks.export_tuned(db, tmp_path / "tuned")
        # the timing contexts of what was timed (a sampled proposal that failed to compile has a
        # compile_error record with no context, "-")
        drivers = {r.driver for r in db.records(SPEC.workload_key, SPEC.target, GPU, 64)
                   if r.status != "compile_error"}
    [row] = [json.loads(x) for x in path.read_text().splitlines()]
    assert (row["variant"], row["median_us"], row["default_us"]) == (d, 12.0, 12.0)
    assert drivers == {burst.driver, sustained.driver}  # both kept, never mixed


def test_measure_and_tune_refuse_a_negative_warmup(url):
    for cmd in (["measure", "--db", url, "--warmup", "-1"],
                ["tune", "--models", "qwen3-30b-a3b", "--db", url, "--warmup", "-0.5"]):
        r = CliRunner().invoke(main, cmd)
        assert r.exit_code == 2 and "is negative; give the seconds of untimed replays" in r.output, r.output


class _Reader:
    """NVML readings as a board under load gives them: clocks, power, reasons, an energy counter."""

    def __init__(self):
        self.energy, self.n = 1_000_000, 0

    def sm_mhz(self):
        self.n += 1
        return (1980, 1455, 1410)[min(self.n - 1, 2)]

    def power_w(self):
        return 690.0

    def reasons(self):
        return 0x4

    def energy_mj(self):
        self.energy += 350  # 350 mJ between the start and the stop reading
        return self.energy


def test_the_sampler_reports_clock_power_reasons_and_energy_per_replay():
    with gpustate.Sampler(_Reader(), period=0.001) as s:
        time.sleep(0.01)
    out = s.summary(replays=100)
    assert out["power_w"] == 690.0 and out["reasons"] == ["sw_power_cap"]
    assert out["sm_mhz_min"] <= out["sm_mhz"] <= 1980 and out["sm_mhz_min"] in (1410, 1455, 1980)
    assert out["mj_per_replay"] == 3.5 and out["replays"] == 100
    assert out["counter_w"] == round(0.35 / out["window_s"], 1)  # 350 mJ over the window


def test_reason_names_name_every_bit_and_keep_unknown_ones():
    assert gpustate.reason_names(0) == []
    assert gpustate.reason_names(0x4 | 0x40) == ["sw_power_cap", "hw_thermal"]
    assert gpustate.reason_names(0x4 | 0x10000) == ["sw_power_cap", "0x10000"]


def test_no_readings_without_nvml(monkeypatch):
    def missing(name):
        raise OSError(f"{name}: cannot open shared object file")

    monkeypatch.setattr(gpustate.ctypes, "CDLL", missing)
    assert gpustate.Nvml.open(index=0) is None
    assert gpustate.Nvml.open(uuid="GPU-00000000-0000-0000-0000-000000000000") is None
