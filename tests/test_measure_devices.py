"""`moe-aot measure --devices`: one measuring worker per GPU of a host on one database, here with
CPU stand-in measurers (tests/tuner_fakes.py) in spawned processes. On a SQLite file always, on
PostgreSQL where MOE_AOT_TEST_PG_URL names a server (`.ci/run` starts one). Every run uses its
own GPU name, so the server's database need not be empty."""
import functools
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from click.testing import CliRunner
from optuna.trial import TrialState
from tuner_fakes import check_records_and_best, fake_compile, fake_device_measurer

from moe_aot import picks, tuner
from moe_aot.cli import main
from moe_aot.database import Database
from moe_aot.measure_worker import ClaimDir, child_visible_devices, measure_devices, parse_devices
from moe_aot.spec import make_spec

SPEC = make_spec("qwen3-30b-a3b")
PG_URL = os.environ.get("MOE_AOT_TEST_PG_URL")
BUCKETS = (64,)
TESTS = Path(__file__).resolve().parent


@pytest.fixture(params=["sqlite", "postgresql"])
def url(request, tmp_path):
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'kernels.sqlite'}"
    if not PG_URL:
        pytest.skip("MOE_AOT_TEST_PG_URL not set (no PostgreSQL server)")
    return PG_URL


@pytest.fixture()
def gpu():
    return f"Fake GPU {uuid.uuid4().hex[:8]}"


def test_parse_devices():
    assert parse_devices("all", 4) == (0, 1, 2, 3)
    assert parse_devices("2, 0", 4) == (2, 0)
    for text, why in (("all", "no CUDA GPU"), ("0,x", "comma-separated"), ("", "comma-separated"),
                      ("1,1", "GPU 1 twice"), ("0,2", "there is no GPU 2; this machine has GPUs 0-1")):
        with pytest.raises(ValueError, match=why):
            parse_devices(text, 0 if text == "all" else 2)


def test_each_worker_sees_only_its_gpu():
    assert child_visible_devices(1, {}) == "1"
    assert child_visible_devices(1, {"CUDA_VISIBLE_DEVICES": "4,6"}) == "6"
    assert child_visible_devices(0, {"CUDA_VISIBLE_DEVICES": "GPU-a, GPU-b"}) == "GPU-a"


def test_claim_dir_claims_each_key_once(tmp_path):
    a, b = ClaimDir(tmp_path), ClaimDir(tmp_path)
    assert a("confirm|s|3") and not b("confirm|s|3") and not a("confirm|s|3") and b("confirm|s|4")


def test_cli_devices_refused_without_a_gpu(tmp_path):
    r = CliRunner().invoke(main, ["measure", "--devices", "all", "--db", f"sqlite:///{tmp_path / 'k.sqlite'}"])
    assert r.exit_code != 0 and "--devices measures on this machine's GPUs and none is visible here" in r.output


def _trials(url, gpu):
    storage = tuner.open_storage(url)
    return [t for b in BUCKETS for t in tuner.open_study(storage, SPEC, gpu, b).trials]


def _records(url, gpu):
    with Database(url, readonly=True) as db:
        return db.records(SPEC.workload_key, SPEC.target, gpu)


def test_workers_on_three_devices_share_the_studies(url, gpu):
    """Nothing lost or duplicated: every ready trial is measured by exactly one worker, every
    record of a trial is its only one, each bucket has one confirmation round, and each record
    names the device (and only that device was visible to its worker). A second run under a new
    driver measures each bucket's default once among the workers (a claim outside the trials)."""
    tuner.prepare(url, [SPEC], BUCKETS, gpu, trials=6, jobs=0, compile_fn=fake_compile, seed=5,
                  progress=lambda s: None)
    ready = [t for t in _trials(url, gpu) if t.user_attrs.get("ready")]
    lines = []
    # a stand-in measurement of 0.5 s: at 0.05 s the whole bucket (~0.3 s) could be measured by the
    # first worker up before the others had started, on a loaded 2-core machine (CI, 2026-12-06)
    counts = measure_devices(url, (0, 1, 2), functools.partial(fake_device_measurer, gpu, 0.5, None),
                             progress=lines.append, poll_s=0.2)
    assert set(counts) == {0, 1, 2} and sum(counts.values()) == len(ready)
    trials = _trials(url, gpu)
    assert not [t for t in trials if t.state in (TrialState.RUNNING, TrialState.WAITING)]
    recs = _records(url, gpu)
    firsts = [r for r in recs if picks.confirmation(r) is None]
    keys = [(r.stats["study"], r.stats["trial"]) for r in firsts if "trial" in r.stats]
    assert len(keys) == len(set(keys)) == len([r for r in firsts if r.status != "compile_error"])
    measured = [r for r in recs if r.status != "compile_error"]
    assert all(r.stats["device"]["index"] in (0, 1, 2) and r.stats["visible"] == str(r.stats["device"]["index"])
               and r.stats["device"]["uuid"] == f"GPU-fake-{r.stats['device']['index']}" for r in measured)
    assert len({r.stats["device"]["index"] for r in measured}) >= 2  # the work was shared
    rounds = {picks.confirmation(r)["round"]: r.tokens for r in recs if picks.confirmation(r)}
    assert len(rounds) <= len(BUCKETS) and len(set(rounds.values())) == len(rounds)  # claimed once per bucket
    assert len(rounds) == sum("[confirm]" in line for line in lines)
    check_records_and_best(url, SPEC, gpu, BUCKETS)
    with Database(url, readonly=True) as db:
        assert {b.tokens for b in db.all_best(workload=SPEC.workload_key, gpu=gpu)} == set(BUCKETS)

    counts = measure_devices(url, (0, 1), functools.partial(fake_device_measurer, gpu, 0.05, "1000.1 (CUDA 13.1)"),
                             confirm=0, progress=lines.append, poll_s=0.2)
    assert sum(counts.values()) == 0  # no ready trial was left; the defaults are not trials of the budget
    new = [r for r in _records(url, gpu) if r.driver == "1000.1 (CUDA 13.1)"]
    assert sorted(r.tokens for r in new) == sorted(BUCKETS)
    assert all(line.startswith(("[gpu 0] ", "[gpu 1] ", "[gpu 2] ", "[devices] ")) for line in lines)


def test_ctrl_c_stops_every_worker_and_keeps_the_measurements(tmp_path, gpu):
    """SIGINT to the whole process group, as a terminal's Ctrl-C sends it: every worker hands
    back the trial it was measuring, the finished ones stay recorded, and a second run measures
    exactly the rest."""
    url = f"sqlite:///{tmp_path / 'kernels.sqlite'}"
    tuner.prepare(url, [SPEC], BUCKETS, gpu, trials=7, jobs=0, compile_fn=fake_compile, seed=7,
                  progress=lambda s: None)
    ready = len([t for t in _trials(url, gpu) if t.user_attrs.get("ready")])
    code = ("import functools, signal, sys\nsignal.signal(signal.SIGINT, signal.default_int_handler)\n"
            "sys.path.insert(0, sys.argv[3])\nfrom tuner_fakes import fake_device_measurer\n"
            "from moe_aot.measure_worker import measure_devices\n"
            "make = functools.partial(fake_device_measurer, sys.argv[2], 1.0, None)\n"
            "try:\n    measure_devices(sys.argv[1], (0, 1), make, confirm=0)\nexcept KeyboardInterrupt:\n"
            "    sys.exit(130)\n")
    proc = subprocess.Popen([sys.executable, "-c", code, url, gpu, str(TESTS)], start_new_session=True,
                            stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and len(_records(url, gpu)) < 3 + ready - len(
            [t for t in _trials(url, gpu) if t.user_attrs.get("ready")]):
        time.sleep(0.2)
    assert sum(r.status != "compile_error" for r in _records(url, gpu)) >= 1, "no worker measured anything"
    os.killpg(proc.pid, signal.SIGINT)
    # longer than measure_devices' own wait for its workers (join_s, 60 s) plus their termination: on a
    # loaded 2-core machine a worker may still be starting or waiting on SQLite's lock when the SIGINT comes
    _, err = proc.communicate(timeout=150)
    assert proc.returncode == 130, err
    assert "interrupted" in err
    trials = _trials(url, gpu)
    assert not [t for t in trials if t.state == TrialState.RUNNING]
    done = [t for t in trials if t.user_attrs.get("ready") and t.state.is_finished()]
    assert 1 <= len(done) < ready
    counts = measure_devices(url, (0, 1), functools.partial(fake_device_measurer, gpu, 0.0, None), confirm=0,
                             progress=lambda s: None, poll_s=0.2)
    assert sum(counts.values()) == ready - len(done)
    check_records_and_best(url, SPEC, gpu, BUCKETS)
