"""Many GPU workers on one PostgreSQL server: concurrent `tune` workers share studies, concurrent
measurers split the ready trials. Needs MOE_AOT_TEST_PG_URL (`.ci/run` starts a server and sets
it); every run uses its own GPU name, so the database need not be empty."""
import multiprocessing
import os
import uuid

import pytest
from optuna.trial import TrialState
from tuner_fakes import check_records_and_best, fake_compile, measure_worker_run, tune_worker

from moe_aot import picks, tuner
from moe_aot.database import Database
from moe_aot.spec import make_spec

URL = os.environ.get("MOE_AOT_TEST_PG_URL")
pytestmark = pytest.mark.skipif(not URL, reason="MOE_AOT_TEST_PG_URL not set (no PostgreSQL server)")
SPEC = make_spec("qwen3-30b-a3b")


@pytest.fixture()
def gpu():
    return f"Fake GPU {uuid.uuid4().hex[:8]}"


def _records_by_trial(gpu):
    with Database(URL, readonly=True) as db:
        recs = [r for r in db.records(SPEC.workload_key, SPEC.target, gpu) if picks.confirmation(r) is None]
    return recs, [(r.stats["study"], r.stats["trial"]) for r in recs if "trial" in r.stats]


def test_two_tune_workers_share_one_study(gpu):
    Database(URL).close()
    tuner.open_storage(URL)  # optuna's tables exist before the workers race for them
    buckets, trials = (16, 1024), 12
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=tune_worker, args=(URL, SPEC, buckets, trials, gpu, seed)) for seed in (1, 2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(300)
        assert p.exitcode == 0
    storage = tuner.open_storage(URL)
    for tokens in buckets:
        # the budget counts every trial but the proposals pruned before compiling
        n = sum(t.state != TrialState.PRUNED for t in tuner.open_study(storage, SPEC, gpu, tokens).trials)
        # Each worker may ask its last trials while the other's are still in flight.
        assert trials <= n <= trials + 2 * 3
    recs, keys = _records_by_trial(gpu)
    assert len(keys) == len(set(keys)) == len(recs)
    check_records_and_best(URL, SPEC, gpu, buckets)


def test_two_measurers_claim_each_ready_trial_once(gpu):
    tuner.prepare(URL, [SPEC], (64,), gpu, trials=20, jobs=0, compile_fn=fake_compile, seed=3,
                  progress=lambda s: None)
    with multiprocessing.get_context("spawn").Pool(2) as pool:
        counts = pool.starmap(measure_worker_run, [(URL, gpu), (URL, gpu)])
    study = tuner.open_study(tuner.open_storage(URL), SPEC, gpu, 64)
    ready = [t for t in study.trials if t.user_attrs.get("ready")]
    assert sum(counts) == len(ready) and all(t.state.is_finished() for t in ready)
    recs, keys = _records_by_trial(gpu)
    assert len(keys) == len(set(keys))
    check_records_and_best(URL, SPEC, gpu, (64,))
