"""Stand-ins for the tuner's two expensive halves, importable by spawned worker processes:
a compiler that stores placeholder artifacts in a blink, a measurer whose time is a
deterministic function of the variant's tiles (so the best pick is known in advance), and one
that plays given draws per variant (noise, drift, a lucky first draw) and can fail on cue."""
from __future__ import annotations

import math
import os
import time

import optuna
from optuna.trial import TrialState

from moe_aot import measure_worker, picks, tuner
from moe_aot.database import Database
from moe_aot.tuner import Compiled, Outcome
from moe_aot.variants import DecodeVariant, default_variant

GPU = "Fake GPU 80GB"
# the one-launch decode candidates (1-token buckets on sm_90a): slower than the best tiles here, so a
# pick is a four-kernel variant unless a test says otherwise (DECODE_US of the measurer)
DECODE_US = 60.0


def toolchain(target: str) -> str:
    return f"fake-dsl|cu13.0|{target}|x86-64|fmt1|srcfake"


def fake_compile(db_url, spec, variant) -> Compiled:
    tc = toolchain(spec.target)
    with Database(db_url) as db:
        db.put_workload(spec.workload_key, spec.workload_dict())
        for kv in variant.kernels(spec):
            if not db.has_artifact(kv.name, tc):
                db.put_artifact(name=kv.name, workload=spec.workload_key, role=kv.role, target=spec.target,
                                toolchain=tc, status="ok", library=b"fake:" + kv.name.encode(), meta={})
    # Like the real templates, some tile shapes fail to compile (here: ping-pong tiles, 8 stages).
    gemms = () if isinstance(variant, DecodeVariant) else (variant.glu, variant.down)
    bad = [g for g in gemms if g.mma == "hoppp" and g.stages == 8]
    return Compiled(tc, "ptxas: too much shared memory for 8 ping-pong stages" if bad else None, 0.01)


def fake_time_us(spec, variant, tokens: int, decode_us: float = DECODE_US) -> float:
    if isinstance(variant, DecodeVariant):
        return decode_us + (variant.warps == 8) * 1.0 + (variant.seg_bytes == 4096) * 0.5
    g, d = variant.glu, variant.down
    return (5.0 + tokens / 64 + abs(math.log2(variant.tile_m) - (6 if tokens < 256 else 7)) * 3
            + abs(math.log2(g.tile_n) - 7) * 2 + abs(math.log2(d.tile_n) - 7) * 1.5
            + abs(g.stages - 4) * 0.7 + abs(d.stages - 4) * 0.3 + (g.tile_k == 32) * 0.9
            + (d.tile_k == 32) * 0.4 + (g.mma == "hoppp") * -0.5 + math.log2(variant.route_cluster) * 0.05)


class FakeMeasurer:
    gpu = GPU
    driver = "999.0 (CUDA 13.0)"

    def __init__(self, gpu: str = GPU, delay_s: float = 0.0, decode_us: float = DECODE_US):
        self.gpu = gpu
        self.delay_s = delay_s
        self.decode_us = decode_us

    def __call__(self, spec, variant, tokens) -> Outcome:
        time.sleep(self.delay_s)
        if isinstance(variant, DecodeVariant):
            t = fake_time_us(spec, variant, tokens, self.decode_us)
            return Outcome("ok", median_us=t, stats={"median_us": t, "replays": 100}, rel_err=3e-3)
        if variant.tile_m == 128 and variant.down.tile_n == 256 and variant.down.stages == 5:
            return Outcome("resource_error", error="too many resources requested for launch")
        if variant.glu.tile_n == 64 and variant.down.tile_n == 64 and variant.tile_m == 128:
            return Outcome("wrong_result", rel_err=0.5, error="relative error 0.5")
        t = fake_time_us(spec, variant, tokens)
        return Outcome("ok", median_us=t, stats={"median_us": t, "min_us": t * 0.98, "replays": 100},
                       rel_err=3e-3)


class DefaultVsOthers(FakeMeasurer):
    """The bucket's default takes `default_us`, every other variant `other_us`; remembers what it ran."""

    def __init__(self, default_us=10.0, other_us=30.0, driver="999.0 (CUDA 13.0)"):
        super().__init__()
        self.default_us, self.other_us, self.driver, self.calls = default_us, other_us, driver, []

    def __call__(self, spec, variant, tokens):
        self.calls.append(variant.name(spec))
        t = self.default_us if variant == default_variant(spec, tokens) else self.other_us
        return Outcome("ok", median_us=t, stats={"median_us": t}, rel_err=1e-3)


class DrawMeasurer(FakeMeasurer):
    """Times from `draws`: per variant name, the times of its successive measurements (the last
    one repeats; None: a failed launch); other variants take fake_time_us. Every call is in
    `calls` (names) and `times`; the call numbered `fail_at` (0-based) raises RuntimeError, as a
    crashing worker would."""

    def __init__(self, draws: dict[str, list[float]] | None = None, fail_at: int | None = None):
        super().__init__()
        self.draws, self.fail_at = draws or {}, fail_at
        self.calls: list[str] = []
        self.times: list[float] = []

    def __call__(self, spec, variant, tokens) -> Outcome:
        name = variant.name(spec)
        if self.fail_at is not None and len(self.calls) == self.fail_at:
            raise RuntimeError("the measuring process died")
        seq = self.draws.get(name)
        t = seq[min(self.calls.count(name), len(seq) - 1)] if seq else fake_time_us(spec, variant, tokens)
        self.calls.append(name)
        self.times.append(t)
        if t is None:  # a draw of None: the launch failed this time
            return Outcome("launch_error", error="unspecified launch failure")
        return Outcome("ok", median_us=t, stats={"median_us": t, "min_us": t * 0.98, "replays": 100}, rel_err=3e-3)


def check_records_and_best(url, spec, gpu, buckets):
    """No duplicates, every told trial has its record, the derived pick is the minimum over the
    records and the default was measured beside it; confirmation rounds are complete and each of
    their measurements is of a trial's record of the same binaries. With a deterministic
    measurer the medians are the single times, so the pick is the same with or without rounds."""
    db = Database(url, readonly=True)
    storage = tuner.open_storage(url)
    for tokens in buckets:
        everything = db.records(spec.workload_key, spec.target, gpu, tokens)
        recs = [r for r in everything if picks.confirmation(r) is None]
        again = [r for r in everything if picks.confirmation(r) is not None]
        assert {picks.confirmation(r)["round"] for r in again} == picks.complete_rounds(everything)
        by_id = {r.id: r for r in recs}
        for r in again:
            of = by_id[picks.confirmation(r)["record"]]
            assert (of.variant, of.content, of.driver) == (r.variant, r.content, r.driver)
        assert len({r.variant for r in recs}) == len(recs)
        study = optuna.load_study(study_name=tuner.study_name(spec, gpu, tokens), storage=storage)
        told = [t for t in study.trials if t.state.is_finished() and "pruned" not in t.user_attrs]
        ids = {t.user_attrs.get("record", t.user_attrs.get("repeat_of_record")) for t in told}
        assert ids == {r.id for r in recs}
        assert [t for t in study.trials if t.state == TrialState.RUNNING] == []
        ok = [r for r in recs if r.status == "ok"]
        best = {p.tokens: p for p in picks.derive_picks(db, spec, gpu)}[tokens]
        assert best.median_us == min(r.median_us for r in ok)
        assert best.variant == min(ok, key=lambda r: r.median_us).variant
        default = default_variant(spec, tokens).name(spec)
        assert best.default == default and default in {r.variant for r in recs}
        assert best.default_us is None or best.median_us <= best.default_us
    db.close()


def tune_worker(url, spec, buckets, trials, gpu, seed):
    tuner.tune(url, [spec], buckets, FakeMeasurer(gpu, delay_s=0.01), trials=trials, jobs=0,
               compile_fn=fake_compile, seed=seed, progress=lambda s: None)


def measure_worker_run(url, gpu):
    return measure_worker.measure(url, FakeMeasurer(gpu, delay_s=0.01), progress=lambda s: None)


class DeviceFakeMeasurer(FakeMeasurer):
    """The measurer of one `--devices` worker: says which GPU it is (device_info, as
    GpuMeasurer does) and puts the CUDA_VISIBLE_DEVICES its process was started with into every
    outcome's stats, so a test can check that each worker saw only its GPU."""

    def __init__(self, gpu: str, device: int, delay_s: float = 0.0, driver: str | None = None):
        super().__init__(gpu, delay_s)
        self.device_info = {"index": device, "uuid": f"GPU-fake-{device}"}
        if driver is not None:
            self.driver = driver

    def __call__(self, spec, variant, tokens) -> Outcome:
        out = super().__call__(spec, variant, tokens)
        out.stats = {**out.stats, "visible": os.environ.get("CUDA_VISIBLE_DEVICES")}
        return out


def fake_device_measurer(gpu, delay_s, driver, device) -> DeviceFakeMeasurer:
    """make_measurer for measure_devices (functools.partial of it pickles into spawned workers)."""
    return DeviceFakeMeasurer(gpu, device, delay_s, driver)
