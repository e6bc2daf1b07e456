"""The tuner on the CPU: search space, ask/compile/measure/tell with stand-ins (tuner_fakes),
budgets, resume, the compile/measure split with a DSL-free measuring process, concurrent
measurers, the text export, build, report, confirmation rounds. One CLI test compiles for real."""
import dataclasses
import json
import multiprocessing
import subprocess
import sys
from pathlib import Path

import click
import pytest
from click.testing import CliRunner
from optuna.trial import TrialState
from tuner_fakes import GPU, DrawMeasurer, FakeMeasurer, check_records_and_best, fake_compile, fake_time_us, toolchain
from tuner_fakes import DefaultVsOthers as _Times

from moe_aot import measure_worker, picks, tuner
from moe_aot.cli import main
from moe_aot.database import Database
from moe_aot.spec import make_spec
from moe_aot.variants import GemmTiles, LayerVariant, can_implement, candidate_space, default_variant

SPEC = make_spec("qwen3-30b-a3b")
TINY = make_spec(None, experts=8, top_k=2, hidden=256, intermediate=128)


@pytest.fixture()
def url(tmp_path):
    return f"sqlite:///{tmp_path / 'tune.sqlite'}"


def test_search_space_round_trips_and_covers_the_candidates():
    space = tuner.search_space(SPEC)
    assert {"tile_m", "route_cluster", "glu_tile_n", "glu_mma", "down_stages"} <= set(space)
    for v in candidate_space(SPEC)[::97]:
        p = tuner.params_of(v)
        assert tuner.variant_of(p) == v and all(p[k] in space[k].choices for k in space)
    name = tuner.study_name(SPEC, "NVIDIA H200", 64)
    assert tuner.parse_study_name(name) == {"workload": SPEC.workload_key, "target": "sm_90a",
                                            "gpu": "NVIDIA H200", "tokens": 64, "space": tuner.space_key(SPEC)}
    old = f"moe-aot:{SPEC.workload_key}:sm_90a:NVIDIA H200:t64"  # named before the space key
    assert tuner.parse_study_name(old) == {"workload": SPEC.workload_key, "target": "sm_90a", "gpu": "NVIDIA H200",
                                           "tokens": 64, "space": None}


def test_a_study_of_another_search_space_is_left_and_its_records_still_count(tmp_path):
    """A database tuned by a moe-aot whose candidate space differed (here: a study whose trials
    chose glu_mma among other values, which optuna refuses to mix with today's choices): tune
    opens new studies beside it, measure skips it (saying why when it is all there is), and the
    pick still sees the records measured then."""
    import optuna
    from optuna.distributions import CategoricalDistribution

    url = f"sqlite:///{tmp_path / 'old.sqlite'}"
    Database(url).close()
    storage = tuner.open_storage(url)
    spec, gpu = SPEC, GPU
    dflt = default_variant(spec, 64)
    for name in (f"moe-aot:{spec.workload_key}:{spec.target}:{gpu}:t64",  # before the space key
                 f"moe-aot:{spec.workload_key}:{spec.target}:{gpu}:t64:s0123456789"):  # another space
        old = optuna.create_study(study_name=name, storage=storage, direction="minimize")
        old.set_user_attr("spec", {**spec.to_dict(), "model": spec.model})
        old.add_trial(optuna.trial.create_trial(params={"glu_mma": "warp"}, value=50.0,
                                                distributions={"glu_mma": CategoricalDistribution(("warp", "x"))},
                                                user_attrs={"variant": dflt.name(spec), "ready": True}))
        old.enqueue_trial({"glu_mma": "warp"}, user_attrs={"variant": dflt.name(spec), "ready": True,
                                                          "toolchain": toolchain(spec.target)})
    with pytest.raises(LookupError, match="prepared over another search space"):
        measure_worker.find_studies(storage, gpu)
    fake_compile(url, spec, dflt)
    with Database(url) as db:  # the default's record from the old session
        content, tc = picks.variant_content(db, spec, dflt)
        db.add_record_once(workload=spec.workload_key, target=spec.target, toolchain=tc, gpu=gpu,
                           driver=FakeMeasurer.driver, tokens=64, variant=dflt.name(spec), content=content,
                           status="ok", median_us=fake_time_us(spec, dflt, 64), stats={}, rel_err=1e-3, error=None)
    measurer = DrawMeasurer()
    tuner.tune(url, [spec], [64], measurer, trials=3, jobs=0, compile_fn=fake_compile, seed=0, confirm=0)
    assert measurer.calls and dflt.name(spec) not in measurer.calls  # its record was reused, not measured again
    names = optuna.get_all_study_names(storage)
    assert tuner.study_name(spec, gpu, 64) in names and len(names) == 3
    [study] = measure_worker.find_studies(storage, gpu)
    assert study.study_name == tuner.study_name(spec, gpu, 64)
    told = [t for t in study.get_trials(deepcopy=False) if t.state.is_finished() and t.state != TrialState.PRUNED]
    assert len(told) == 3  # a new study, with this session's 3 trials
    with Database(url) as db:
        assert [p.tokens for p in picks.derive_picks(db, spec, gpu)] == [64]


def test_roofline_floor():
    # 1 token: bytes of top_k experts' weights dominate; 16384 tokens: every expert, FLOPs dominate.
    one = picks.roofline_floor_us(SPEC, 1)
    assert one == pytest.approx((3 * 2048 * 768 * 2 * 8 + 4 * 2048) / 4.8e12 * 1e6, rel=1e-6)
    big = picks.roofline_floor_us(SPEC, 16384)
    assert big == pytest.approx(6 * 16384 * 8 * 2048 * 768 / 790e12 * 1e6, rel=1e-6)


def test_tune_records_every_trial_and_commits_the_minimum(url):
    lines = []
    tuner.tune(url, [SPEC], (1, 4096), FakeMeasurer(), trials=14, jobs=0, compile_fn=fake_compile,
               seed=1, progress=lines.append)
    check_records_and_best(url, SPEC, GPU, (1, 4096))
    trial_lines = [ln for ln in lines if not ln.startswith("[confirm]")]
    assert trial_lines and "best" in trial_lines[-1]
    db = Database(url, readonly=True)
    statuses = {r.status for r in db.records()}
    assert "ok" in statuses and statuses <= {"ok", "compile_error", "resource_error", "wrong_result"}
    rec = db.records()[0]
    assert rec.gpu == GPU and rec.driver.startswith("999") and rec.toolchain == toolchain("sm_90a")
    rows = picks.summary(db, SPEC, GPU, (1, 4096))
    for row, tokens in zip(rows, (1, 4096)):
        recs = db.records(SPEC.workload_key, SPEC.target, GPU, tokens)
        ok = [r for r in recs if r.status == "ok"]
        best = min(ok, key=lambda r: r.median_us)
        assert (row["records"], row["ok"], row["failed"]) == (len(recs), len(ok), len(recs) - len(ok))
        assert (row["best_us"], row["variant"]) == (best.median_us, best.variant)
        assert row["floor_us"] == picks.roofline_floor_us(SPEC, tokens)
        assert row["of_floor"] == pytest.approx(row["floor_us"] / best.median_us)
    assert "floor us" in picks.format_summary(SPEC, GPU, rows)


def test_budget_resume_and_stale_trials(url):
    tuner.tune(url, [SPEC], (16,), FakeMeasurer(), trials=4, jobs=0, compile_fn=fake_compile, seed=2,
               progress=lambda s: None)
    storage = tuner.open_storage(url)
    study = tuner.open_study(storage, SPEC, GPU, 16)

    def held(trials):  # the budget counts every trial but the proposals pruned before compiling
        return [t for t in trials if t.state != TrialState.PRUNED]

    assert len(held(study.trials)) == 4
    # A session killed mid-trial leaves a RUNNING trial owned by a process that is gone.
    dead = study.ask()
    tuner.suggest(dead, tuner.search_space(SPEC))
    dead.set_user_attr("worker", f"{tuner.socket.gethostname()}:999999999")
    tuner.tune(url, [SPEC], (16,), FakeMeasurer(), trials=7, jobs=0, compile_fn=fake_compile, seed=3,
               progress=lambda s: None)
    trials = tuner.open_study(storage, SPEC, GPU, 16).trials
    assert len(held(trials)) == 7 and trials[dead.number].state.is_finished()
    check_records_and_best(url, SPEC, GPU, (16,))
    # A wall-time budget that is already spent asks nothing new.
    before = len(tuner.open_study(storage, SPEC, GPU, 16).trials)
    tuner.tune(url, [SPEC], (16,), FakeMeasurer(), trials=50, timeout_s=1e-9, jobs=0,
               compile_fn=fake_compile, progress=lambda s: None)
    assert len(tuner.open_study(storage, SPEC, GPU, 16).trials) == before


def test_tune_pipelines_compiles_in_a_process_pool(url):
    tuner.tune(url, [SPEC], (64,), FakeMeasurer(delay_s=0.05), trials=6, jobs=2,
               compile_fn=fake_compile, seed=4, progress=lambda s: None)
    check_records_and_best(url, SPEC, GPU, (64,))


def test_invalid_suggestions_are_pruned_with_the_reason(url):
    storage = tuner.open_storage(url)
    study = tuner.open_study(storage, SPEC, GPU, 1)
    space = tuner.search_space(SPEC)
    # smem of 5 stages of 128x256x64 tiles exceeds sm_90a's limit: a point of the product space
    # that candidate_space excludes.
    params = {k: d.choices[-1] if k.startswith("glu") or k == "tile_m" else d.choices[0] for k, d in space.items()}
    params.update(glu_stages=5, glu_tile_k=64, glu_cluster=1, glu_raster_experts=False)
    assert not can_implement(SPEC, tuner.variant_of(params))[0]
    study.enqueue_trial(params)
    job = tuner._ask(tuner.Slot(SPEC, 1, study, space, baseline_due=False))
    assert job is None
    t = study.trials[0]
    assert t.state == TrialState.PRUNED and "shared memory" in t.user_attrs["pruned"]


_BLOCK_DSL = """
import sys, importlib.abc
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if (name.split('.')[0] in ('cutlass', 'moe_aot_templates')
                or name in ('moe_aot.compiler', 'moe_aot.kernel_build')):
            raise ImportError('the measuring side must not import ' + name)
sys.meta_path.insert(0, Block())
"""


def _measure_in_subprocess(url, tests_dir, max_trials=None):
    code = _BLOCK_DSL + (f"sys.path.insert(0, {str(tests_dir)!r})\n"
                         "from moe_aot import measure_worker\nfrom tuner_fakes import FakeMeasurer\n"
                         f"n = measure_worker.measure({url!r}, FakeMeasurer(), max_trials={max_trials!r})\n"
                         "print('measured', n)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return int(proc.stdout.split()[-1])


def test_split_compile_here_measure_there_without_the_dsl(url):
    tests_dir = Path(__file__).parent
    added = tuner.prepare(url, [SPEC], (1, 256), GPU, trials=6, jobs=0, compile_fn=fake_compile, seed=5,
                          progress=lambda s: None)
    assert added == 12
    storage = tuner.open_storage(url)
    study = tuner.open_study(storage, SPEC, GPU, 1)
    waiting = study.get_trials(states=(TrialState.WAITING,))
    assert waiting and all(t.user_attrs["ready"] for t in waiting)
    assert _measure_in_subprocess(url, tests_dir, max_trials=3) == 3
    left = sum(len(tuner.open_study(storage, SPEC, GPU, b).get_trials(states=(TrialState.WAITING,)))
               for b in (1, 256))
    assert _measure_in_subprocess(url, tests_dir) == left
    check_records_and_best(url, SPEC, GPU, (1, 256))
    # The second round's proposals come from a sampler that has seen the measurements.
    assert tuner.prepare(url, [SPEC], (1,), GPU, trials=9, jobs=0, compile_fn=fake_compile,
                         progress=lambda s: None) == 3
    names = [t.user_attrs["variant"] for t in tuner.open_study(storage, SPEC, GPU, 1).trials]
    assert len(set(names)) == len(names) == 9


def _measure_worker(url):
    return measure_worker.measure(url, FakeMeasurer(delay_s=0.02), progress=lambda s: None)


def test_two_measurers_split_the_ready_trials(url):
    tuner.prepare(url, [SPEC], (16,), GPU, trials=16, jobs=0, compile_fn=fake_compile, seed=6,
                  progress=lambda s: None)
    with multiprocessing.get_context("spawn").Pool(2) as pool:
        counts = pool.map(_measure_worker, [url, url])
    db = Database(url, readonly=True)
    trials = [r.stats.get("trial") for r in db.records() if "trial" in r.stats]
    assert len(trials) == len(set(trials))
    study = tuner.open_study(tuner.open_storage(url), SPEC, GPU, 16)
    assert sum(counts) == len([t for t in study.trials if "ready" in t.user_attrs])
    check_records_and_best(url, SPEC, GPU, (16,))


def _handed_back_by_a_dead_worker(url, buckets=(16,)):
    """A prepared study whose first ready trial was handed back by a worker that is gone."""
    tuner.prepare(url, [SPEC], buckets, GPU, trials=3, jobs=0, compile_fn=fake_compile, seed=4,
                  progress=lambda s: None)
    study = tuner.open_study(tuner.open_storage(url), SPEC, GPU, buckets[0])
    first = next(t for t in study.trials if t.user_attrs.get("ready"))
    study._storage.set_trial_user_attr(first._trial_id, "worker", f"{tuner.socket.gethostname()}:999999999")
    return study, first


def test_a_claim_is_never_taken_back_by_a_worker_starting_meanwhile(url):
    """Another worker's start-up (requeue_stale) landing right after a claim of a trial that an
    earlier, dead worker had handed back must leave the trial with its claimer: before, it still
    named the dead worker there, went back to WAITING, and two workers measured it."""
    study, first = _handed_back_by_a_dead_worker(url)
    storage = study._storage
    real = storage.set_trial_state_values
    requeued = []

    def claim_then_other_worker_starts(trial_id, state, values=None):
        ok = real(trial_id, state, values)
        if state == TrialState.RUNNING:
            requeued.append(tuner.requeue_stale(tuner.open_study(tuner.open_storage(url), SPEC, GPU, 16)))
        return ok

    storage.set_trial_state_values = claim_then_other_worker_starts
    trial, _ = measure_worker.claim(study)
    assert trial.number == first.number and requeued == [0]
    assert storage.get_trial(first._trial_id).state == TrialState.RUNNING


def test_a_trial_finished_by_another_worker_meanwhile_is_left_to_its_record(url):
    """A trial taken back while its worker was still measuring (another host's, after
    STALE_AFTER_S) and finished by the other one: the slower worker goes on to the next trial
    instead of failing, and the first record stands."""
    study, first = _handed_back_by_a_dead_worker(url)
    lines = []

    class FinishedElsewhere(FakeMeasurer):
        def __call__(self, spec, variant, tokens):
            out = super().__call__(spec, variant, tokens)
            if not lines:  # the first trial measured: the other worker tells it first
                t = next(t for t in tuner.open_study(tuner.open_storage(url), SPEC, GPU, 16).trials
                         if t.state == TrialState.RUNNING)
                study._storage.set_trial_state_values(t._trial_id, TrialState.COMPLETE, [1.0])
                lines.append(t.number)
            return out

    ready = len([t for t in study.trials if t.user_attrs.get("ready")])
    n = measure_worker.measure(url, FinishedElsewhere(), progress=lines.append, confirm=0)
    assert n == ready - 1
    assert any(f"trial {lines[0]}: finished by another worker meanwhile" in str(x) for x in lines[1:])
    trials = tuner.open_study(tuner.open_storage(url), SPEC, GPU, 16).trials
    assert not [t for t in trials if t.state in (TrialState.RUNNING, TrialState.WAITING)]


def test_measure_names_the_gpus_it_has_studies_for(url):
    tuner.prepare(url, [SPEC], (16,), "NVIDIA H100 80GB HBM3", trials=1, jobs=0, compile_fn=fake_compile)
    with pytest.raises(LookupError, match="NVIDIA H100 80GB HBM3"):
        measure_worker.measure(url, FakeMeasurer())


def test_measure_worker_imports_neither_dsl_nor_compiler():
    code = ("import sys, moe_aot.measure_worker\nbad = sorted(m for m in sys.modules if m.split('.')[0] in "
            "('cutlass', 'moe_aot_templates') or m in ('moe_aot.compiler', 'moe_aot.kernel_build'))\n"
            "print(bad); sys.exit(1 if bad else 0)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_build_export_and_report_do_not_import_optuna(tmp_path):
    """Deployment (moe_aot.picks: export, the build plan) and the report read the records
    without the tuner's optuna; the test fails if either imports it again."""
    root = Path(__file__).resolve().parents[1]
    code = ("import sys\nfrom pathlib import Path\nfrom moe_aot import picks, report\n"
            "from moe_aot.database import Database\nfrom moe_aot.spec import make_spec\n"
            f"db = Database('sqlite:///{tmp_path / 'fresh.sqlite'}')\n"
            "pairs, planned = picks.build_plan(db, [make_spec('qwen3-30b-a3b')], (16, 4096), 'NVIDIA H200', "
            f"Path({str(root / 'cache' / 'tuned')!r}))\n"
            "assert planned and pairs, (pairs, planned)\n"
            "picks.export_tuned(db, Path(sys.argv[1]))\n"
            "bad = [m for m in sys.modules if m.split('.')[0] == 'optuna' or m == 'moe_aot.tuner']\n"
            "print(bad); sys.exit(1 if bad else 0)")
    proc = subprocess.run([sys.executable, "-c", code, str(tmp_path / "out")], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_export_is_stable_text_and_build_plan_reads_it(url, tmp_path):
    tuner.tune(url, [SPEC], (1, 256), FakeMeasurer(), trials=5, jobs=0, compile_fn=fake_compile, seed=7,
               progress=lambda s: None)
    out = tmp_path / "tuned"
    db = Database(url)
    [path] = picks.export_tuned(db, out)
    assert path.name == "Fake_GPU_80GB.jsonl"
    text = path.read_text()
    rows = [json.loads(x) for x in text.splitlines()]
    assert [r["tokens"] for r in rows] == [1, 256]
    assert set(rows[0]) == set(picks.TUNED_FIELDS)
    assert all(r["median_us"] <= r["default_us"] for r in rows)
    picks.export_tuned(db, out)
    assert path.read_text() == text
    # A fresh database (a container build) gets the picks from the text alone.
    fresh = Database(f"sqlite:///{tmp_path / 'fresh.sqlite'}")
    pairs, planned = picks.build_plan(fresh, [SPEC], (1, 256), GPU, out)
    assert {(g, n, v.name(SPEC)) for _, g, n, v, _ in planned} == {(GPU, r["tokens"], r["variant"]) for r in rows}
    assert len(pairs) >= 2


def test_fake_measurer_minimum_is_found_by_the_sampler(url):
    """Not a proof of TPE, a guard that told values steer it: 40 trials get within 15% of the
    best of the whole candidate space."""
    tuner.tune(url, [SPEC], (4096,), FakeMeasurer(), trials=40, jobs=0, compile_fn=fake_compile, seed=8,
               progress=lambda s: None)
    best = {p.tokens: p for p in picks.derive_picks(Database(url, readonly=True), SPEC, GPU)}[4096]
    floor = min(fake_time_us(SPEC, v, 4096) for v in candidate_space(SPEC))
    assert best.median_us <= floor * 1.15


@pytest.fixture()
def runner(tmp_path, monkeypatch):
    monkeypatch.setenv("MOE_AOT_DB", f"sqlite:///{tmp_path / 'cli.sqlite'}")
    monkeypatch.setenv("MOE_AOT_CACHE_DIR", str(tmp_path / "cache"))
    return CliRunner()


def test_new_commands_have_help(runner):
    for cmd in (["tune"], ["measure"], ["build"], ["export"], ["report"]):
        res = runner.invoke(main, cmd + ["--help"])
        assert res.exit_code == 0 and "Usage" in res.output, res.output


def test_tune_without_gpu_says_what_to_do(runner):
    res = runner.invoke(main, ["tune", "--model", "qwen3-30b-a3b", "--trials", "1"])
    assert res.exit_code != 0 and "--compile-only" in res.output


def test_cli_split_workflow_export_build_ls_report(runner, tmp_path):
    """Real compiles of the tiny layer: prepare two candidates, measure them with the stand-in,
    export the picks as text, build from the text into a fresh database twice (the second
    compiles nothing), and the runtime's picks() finds them for that GPU."""
    spec_file = tmp_path / "tiny.toml"
    spec_file.write_text("[[layer]]\nexperts = 8\ntop_k = 2\nhidden = 256\nintermediate = 128\n")
    db_url = f"sqlite:///{tmp_path / 'cli.sqlite'}"
    res = runner.invoke(main, ["tune", "--compile-only", "--spec", str(spec_file), "--tokens", "16",
                               "--gpu", GPU, "--trials", "2", "-j", "2", "--seed", "1"])
    assert res.exit_code == 0, res.output
    assert len([ln for ln in res.output.splitlines() if ln.startswith("[")]) == 2
    assert measure_worker.measure(db_url, FakeMeasurer(), progress=lambda s: None) >= 1
    tuned = tmp_path / "tuned"
    res = runner.invoke(main, ["export", "--dir", str(tuned)])
    assert res.exit_code == 0, res.output
    [path] = list(tuned.iterdir())
    pick = json.loads(path.read_text().splitlines()[0])
    res = runner.invoke(main, ["ls"])
    assert f"tuned\t{TINY.workload_key}\tsm_90a\t{GPU}\ttokens=16\t{pick['variant']}" in res.output
    fresh = f"sqlite:///{tmp_path / 'fresh.sqlite'}"
    args = ["build", "--spec", str(spec_file), "--tokens", "16", "--gpu", GPU, "--tuned-dir", str(tuned),
            "--db", fresh, "-j", "2"]
    res = runner.invoke(main, args)
    assert res.exit_code == 0, res.output
    assert "1 tuned pick(s)" in res.output
    again = runner.invoke(main, args)
    assert again.exit_code == 0 and "0 compiled" in again.output, again.output
    # --pdl-twins adds the programmatic-dependent-launch twin of every planned variant
    twins = runner.invoke(main, args + ["--pdl-twins"])
    assert twins.exit_code == 0 and "0 compiled" not in twins.output, twins.output
    from moe_aot.compiler import toolchain_key
    from moe_aot.database import Database
    from moe_aot.variants import default_variant
    with Database(fresh, readonly=True) as db:
        for v in (LayerVariant.parse(pick["variant"]), default_variant(TINY, 16)):
            twin = v.pdl_twin()
            assert all(db.has_artifact(kv.name, toolchain_key("sm_90a")) for kv in twin.kernels(TINY)), twin
    from moe_aot.runtime.store import KernelStore
    picks = KernelStore(fresh).picks(TINY, GPU)
    assert picks == {16: LayerVariant.parse(pick["variant"])}
    res = runner.invoke(main, ["show", picks[16].kernels(TINY)[1].name, "--db", fresh])
    assert res.exit_code == 0 and f"tuned for:  {GPU} tokens=16" in res.output, res.output
    pytest.importorskip("matplotlib")
    res = runner.invoke(main, ["report", "--spec", str(spec_file), "--gpu", GPU, "--tokens", "16",
                               "--out", str(tmp_path / "report")])
    assert res.exit_code == 0, res.output
    assert (tmp_path / "report" / f"{TINY.label()}_{GPU.replace(' ', '_')}.png").stat().st_size > 1000


def test_mutate_changes_one_field_and_stays_valid():
    import random as _random
    from types import SimpleNamespace

    from moe_aot.spec import make_spec
    from moe_aot.tuner import mutate, params_of, search_space
    from moe_aot.variants import can_implement, default_variant

    spec = make_spec("qwen3-30b-a3b")
    slot = SimpleNamespace(spec=spec, space=search_space(spec))
    best = default_variant(spec, 64)
    rng = _random.Random(0)
    for _ in range(20):
        v = mutate(best, slot, set(), rng)
        assert v is not None and can_implement(spec, v)[0]
        a, b = params_of(best), params_of(v)
        assert sum(a[k] != b[k] for k in a) == 1


def test_studies_from_before_a_new_field_keep_its_default(url):
    """A study prepared before `pdl` joined the variant holds trials without that param: the
    measuring side must measure what was compiled (the field's default), not let the sampler
    pick a value, and the compiling side must still learn from those trials."""
    import random as _random

    from optuna.trial import create_trial

    from moe_aot.variants import default_variant

    Database(url).close()
    storage = tuner.open_storage(url)
    study = tuner.open_study(storage, SPEC, GPU, 64)
    old_space = {k: d for k, d in tuner.search_space(SPEC).items() if k != "pdl"}
    base = default_variant(SPEC, 64)
    old = {k: v for k, v in tuner.params_of(base).items() if k != "pdl"}
    study.add_trial(create_trial(value=50.0, params=old, distributions=old_space,
                                 user_attrs={"variant": base.name(SPEC), "tokens": 64}))
    other = tuner.params_of(LayerVariant(64, base.glu, base.down, 16))
    del other["pdl"]
    study.enqueue_trial(other, user_attrs={"variant": "x", "ready": True, "toolchain": toolchain("sm_90a")})
    trial, _ = measure_worker.claim(study)
    assert tuner.suggest(trial, tuner.search_space(SPEC)) == LayerVariant(64, base.glu, base.down, 16)
    assert "pdl" not in trial.params  # not handed to the sampler, which would pick it at random
    slot = tuner.Slot(SPEC, 64, study, tuner.search_space(SPEC))
    seen = {base.name(SPEC)}
    v = tuner.propose(slot, seen, _random.Random(0))
    assert v is not None and can_implement(SPEC, v)[0] and v.name(SPEC) not in seen


class _CountingMeasurer(FakeMeasurer):
    def __init__(self):
        super().__init__()
        self.calls = []

    def __call__(self, spec, variant, tokens):
        self.calls.append(variant.name(spec))
        return super().__call__(spec, variant, tokens)


def test_a_variant_already_recorded_is_not_measured_again(url):
    tuner.prepare(url, [SPEC], (64,), GPU, trials=3, jobs=0, compile_fn=fake_compile, seed=5,
                  progress=lambda s: None)
    study = tuner.open_study(tuner.open_storage(url), SPEC, GPU, 64)
    ready = [t for t in study.trials if t.user_attrs.get("ready")]
    first = ready[0]
    study.enqueue_trial(first.system_attrs["fixed_params"], user_attrs=dict(first.user_attrs),
                        skip_if_exists=False)
    m = _CountingMeasurer()
    n = measure_worker.measure(url, m, progress=lambda s: None)
    assert n == len(ready) + 1
    assert sorted(m.calls) == sorted({t.user_attrs["variant"] for t in ready})  # each once
    study = tuner.open_study(tuner.open_storage(url), SPEC, GPU, 64)
    repeats = [t for t in study.trials if "repeat_of_record" in t.user_attrs]
    assert len(repeats) == 1 and repeats[0].state == TrialState.COMPLETE
    check_records_and_best(url, SPEC, GPU, (64,))


# -- picks: derived from records keyed by the measured binaries, never slower than the default --

def _refactored_compile(db_url, spec, variant):
    """fake_compile after a template refactor that left every cubin as it was: the toolchain's
    source hash changes, the binaries do not."""
    tc = toolchain(spec.target).replace("srcfake", "srcrefactored")
    with Database(db_url) as db:
        for kv in variant.kernels(spec):
            if not db.has_artifact(kv.name, tc):
                db.put_artifact(name=kv.name, workload=spec.workload_key, role=kv.role, target=spec.target,
                                toolchain=tc, status="ok", library=b"fake:" + kv.name.encode(), meta={})
    return tuner.Compiled(tc, None, 0.01)


def _exported(url, tmp_path):
    with Database(url) as db:
        [path] = picks.export_tuned(db, tmp_path / "tuned")
    return [json.loads(x) for x in path.read_text().splitlines()]


def test_a_cubin_identical_refactor_keeps_the_defaults_record_and_the_pick(url, tmp_path):
    """Old key / new key: round 2 runs under a new source hash with slower candidates. The
    default's record still counts (the binaries are the same), so the pick stays the default."""
    d = default_variant(SPEC, 64).name(SPEC)
    m1 = _Times()
    tuner.tune(url, [SPEC], (64,), m1, trials=1, jobs=0, compile_fn=fake_compile, seed=1, progress=lambda s: None)
    assert m1.calls == [d]
    m2 = _Times()
    tuner.tune(url, [SPEC], (64,), m2, trials=4, jobs=0, compile_fn=_refactored_compile, seed=2,
               progress=lambda s: None)
    assert m2.calls and d not in m2.calls  # same binaries: not measured again
    [row] = _exported(url, tmp_path)
    assert (row["variant"], row["median_us"]) == (d, 10.0)
    with Database(url) as db:
        [(_, _, _, v, us)] = picks.build_plan(db, [SPEC], (64,), GPU, tmp_path / "none")[1]
    assert (v.name(SPEC), us) == (d, 10.0)


def test_the_pick_is_the_fastest_record_not_the_newest(url, tmp_path):
    tuner.tune(url, [SPEC], (64,), _Times(other_us=8.0), trials=3, jobs=0, compile_fn=fake_compile, seed=3,
               progress=lambda s: None)
    m2 = _Times(other_us=9.0)
    tuner.tune(url, [SPEC], (64,), m2, trials=20, jobs=0, compile_fn=_refactored_compile, seed=4,
               progress=lambda s: None)
    assert m2.calls  # round 2 measured candidates, newer and slower than round 1's
    [row] = _exported(url, tmp_path)
    assert row["median_us"] == 8.0  # round 1, not round 2's 9.0
    assert row["default_us"] == 10.0
    with Database(url) as db:
        assert [us for *_, us in picks.build_plan(db, [SPEC], (64,), GPU, tmp_path / "none")[1]] == [8.0]
        assert db.top_k(SPEC.workload_key, SPEC.target, GPU, 64)[0].median_us == 8.0


def test_a_record_of_a_variant_todays_rules_refuse_never_makes_the_pick(url, tmp_path):
    """A variant measured once and refused today (here tcgen05 tiles, which sm_90a has not; in
    practice a tile or MMA family removed since): its record stays, fastest or not, but the pick
    is the fastest one that can still be built, and `build` gets no pick it would refuse."""
    tuner.tune(url, [SPEC], (64,), _Times(other_us=8.0), trials=3, jobs=0, compile_fn=fake_compile, seed=3,
               progress=lambda s: None, confirm=0)  # no rounds: the fastest record is the pick
    gone = LayerVariant(128, GemmTiles(128, 64, 3, "umma"), GemmTiles(128, 64, 3, "umma"))
    assert not can_implement(SPEC, gone)[0]
    fake_compile(url, SPEC, gone)  # its kernels are in the database
    with Database(url) as db:
        content, tc = picks.variant_content(db, SPEC, gone)
        db.add_record_once(workload=SPEC.workload_key, target=SPEC.target, toolchain=tc, gpu=GPU,
                           driver=_Times().driver, tokens=64, variant=gone.name(SPEC), content=content,
                           status="ok", median_us=1.0, stats={}, rel_err=1e-3, error=None)
        [pick] = picks.derive_picks(db, SPEC, GPU)
        assert pick.variant != gone.name(SPEC) and pick.median_us == 8.0
        assert [v for *_, v, _ in picks.build_plan(db, [SPEC], (64,), GPU, tmp_path / "none")[1]] != [gone]


def test_the_default_is_measured_again_under_a_new_driver_split(url, tmp_path):
    d = default_variant(SPEC, 64).name(SPEC)
    tuner.prepare(url, [SPEC], (64,), GPU, trials=2, jobs=0, compile_fn=fake_compile, seed=5, progress=lambda s: None)
    m1 = _Times(default_us=10.0, other_us=9.0, driver="570.86.15 (CUDA 12.8)")
    measure_worker.measure(url, m1, progress=lambda s: None)
    assert d in m1.calls
    tuner.prepare(url, [SPEC], (64,), GPU, trials=4, jobs=0, compile_fn=fake_compile, seed=6, progress=lambda s: None)
    m2 = _Times(default_us=12.0, other_us=14.0, driver="580.95.05 (CUDA 13.0)")  # a driver update
    measure_worker.measure(url, m2, progress=lambda s: None)
    assert d in m2.calls and len(m2.calls) >= 2
    [row] = _exported(url, tmp_path)  # the newest context: the default beats the new candidates
    assert (row["variant"], row["median_us"], row["default_us"]) == (d, 12.0, 12.0)
    check_records_and_best(url, SPEC, GPU, ())


def test_the_default_is_measured_again_under_a_new_driver_tune(url):
    d = default_variant(SPEC, 64).name(SPEC)
    tuner.tune(url, [SPEC], (64,), _Times(driver="570.86.15 (CUDA 12.8)"), trials=2, jobs=0,
               compile_fn=fake_compile, seed=7, progress=lambda s: None)
    m2 = _Times(driver="580.95.05 (CUDA 13.0)")
    tuner.tune(url, [SPEC], (64,), m2, trials=4, jobs=0, compile_fn=fake_compile, seed=8, progress=lambda s: None)
    assert m2.calls[0] == d


def test_build_refuses_a_text_pick_slower_than_its_default(tmp_path):
    d = default_variant(SPEC, 64)
    other = LayerVariant(128, d.glu, d.down, d.route_cluster)
    line = {"workload": SPEC.workload_key, "target": SPEC.target, "gpu": GPU, "tokens": 64,
            "variant": other.name(SPEC), "median_us": 12.0, "default": d.name(SPEC), "default_us": 10.0}
    (tmp_path / "tuned").mkdir()
    picks.tuned_path(tmp_path / "tuned", GPU).write_text(json.dumps(line) + "\n")
    with Database(f"sqlite:///{tmp_path / 'fresh.sqlite'}") as db:
        with pytest.raises(ValueError, match="slower than the default"):
            picks.build_plan(db, [SPEC], (64,), GPU, tmp_path / "tuned")


# -- the GPU measurer's driver version, parsed on the CPU --

PROPRIETARY = ("NVRM version: NVIDIA UNIX x86_64 Kernel Module  570.86.15  Fri Jan 24 18:39:31 UTC 2025\n"
               "GCC version:  gcc version 12.3.0 (Ubuntu 12.3.0-1ubuntu1~22.04)\n")
OPEN = ("NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  580.95.05  Release Build  "
        "(dvs-builder@U22-I3-AF03-09-1)  Tue Sep 23 09:59:53 UTC 2025\n"
        "GCC version:  gcc version 13.3.0 (Ubuntu 13.3.0-6ubuntu2~24.04)\n")
OPEN_ARM = ("NVRM version: NVIDIA UNIX Open Kernel Module for aarch64  580.82.07  Release Build  "
            "(dvs-builder@U16-I1-N07-12-3)  Wed Aug 27 14:23:18 UTC 2025\n")


@pytest.mark.parametrize("text, version", [(PROPRIETARY, "570.86.15"), (OPEN, "580.95.05"),
                                           (OPEN_ARM, "580.82.07"), ("", None), ("garbage\n", None)])
def test_driver_version_of_both_kernel_module_flavours(text, version, tmp_path, monkeypatch):
    assert measure_worker.parse_driver_version(text) == version
    proc = tmp_path / "version"
    proc.write_text(text)
    monkeypatch.setattr("moe_aot.runtime.store.driver_cuda_version", lambda: (13, 0))
    assert measure_worker.driver_version(str(proc)) == f"{version or 'unknown'} (CUDA 13.0)"
    assert measure_worker.driver_version(str(tmp_path / "missing")).startswith("unknown")


def test_gpu_measurer_turns_each_result_into_a_typed_outcome(monkeypatch):
    """GpuMeasurer.__call__ without a GPU: the layer and the measurement are stand-ins, so every
    branch that builds an Outcome runs here (a missing name in one of them once failed only on
    the GPU machine)."""
    import torch

    from moe_aot import measure_worker
    from moe_aot.harness import measure as measure_mod
    from moe_aot.runtime import layer as layer_mod
    from moe_aot.runtime.store import KernelMissingError
    from moe_aot.spec import make_spec
    from moe_aot.tuner import Outcome
    from moe_aot.variants import default_variant

    m = object.__new__(measure_worker.GpuMeasurer)
    m.device, m.store, m.replays, m._weights = torch.device("cpu"), None, 3, None
    m.warmup_s, m.nvml = 0.5, None
    monkeypatch.setattr(m, "weights", lambda spec: (None, None))
    monkeypatch.setattr(layer_mod, "MoeLayer", lambda *a, **k: object())
    spec = make_spec("qwen3-30b-a3b")
    v = default_variant(spec, 16)
    results = {"ok": {"ok": True, "rel_err": 3e-3, "median_us": 12.5, "min_us": 12.0},
               "wrong": {"ok": False, "rel_err": 0.5}}
    for key, want in (("ok", "ok"), ("wrong", "wrong_result")):
        seen = {}
        monkeypatch.setattr(measure_mod, "measure_variant", lambda *a, r=results[key], **k: seen.update(k) or r)
        out = m(spec, v, 16)
        assert seen["warmup_s"] == 0.5  # each candidate timed at the sustained clock
        assert isinstance(out, Outcome) and out.status == want
    assert out.rel_err == 0.5
    monkeypatch.setattr(measure_mod, "measure_variant", lambda *a, **k: 1 / 0)

    def missing(*a, **k):
        raise KernelMissingError("no kernel moe_glu_x")

    monkeypatch.setattr(layer_mod, "MoeLayer", missing)
    out = m(spec, v, 16)
    assert out.status == "compile_error" and "moe_glu_x" in out.error
    # launch failures are told apart by the CUDA error code, not by their wording
    from moe_aot.runtime.library import KernelLaunchError

    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    for code, words, want in ((701, "launch failed", "resource_error"),
                              (719, "launch failed: too many resources in the message", "launch_error"),
                              (None, "stored library is corrupt", "launch_error")):
        def failing(*a, code=code, words=words, **k):
            raise KernelLaunchError(f"moe_down_x: {words}", code)

        monkeypatch.setattr(layer_mod, "MoeLayer", failing)
        out = m(spec, v, 16)
        assert out.status == want and words in out.error, (code, out)


def test_seed_variants_measure_the_pick_its_twins_and_its_cluster_twins(tmp_path):
    """--seed-picks: per bucket the committed pick, the 64-row ping-pong twins of the pick and
    the default, the pick's and the default's PDL twins, the 2-CTA-cluster twins of the pick
    (GEMM2, then both GEMMs) and the pick's and the default's raster twins -- all implementable,
    none the default itself (that one is always measured first anyway)."""
    pick = LayerVariant.parse("moe_layer_sm90a_bf16_e128k8h2048i768_swiglu_m128r16_glun192k64s4hopws"
                              "_downn256k64s4hopws_pdl")
    entry = {"workload": SPEC.workload_key, "target": SPEC.target, "tokens": 4096, "gpu": GPU,
             "variant": pick.name(SPEC), "default": default_variant(SPEC, 4096).name(SPEC), "median_us": 1.0,
             "default_us": 1.1}
    picks.write_tuned(tmp_path, GPU, [entry])
    seeds = tuner.seed_variants(tmp_path, GPU, [SPEC], [16, 4096])
    got = seeds[(SPEC.workload_key, 4096)]
    base = default_variant(SPEC, 4096)
    assert got[:5] == [pick, pick.pingpong_twin(SPEC), base.pingpong_twin(SPEC), pick.pdl_twin(), base.pdl_twin()]
    assert got[1].pdl and got[1].glu.mma == got[2].down.mma == "hoppp" and not got[2].pdl
    clustered = [v for v in got if v.down.cluster == 2]
    assert [(v.glu.cluster, v.down.cluster, v.pdl) for v in clustered] == [(1, 2, True), (2, 2, True)]
    # then the raster twins (hopws / hoppp single CTAs: both GEMMs cut their groups at experts)
    rastered = [v for v in got if v.glu.raster_experts or v.down.raster_experts]
    assert rastered == got[-6:-4] == [pick.raster_twin(SPEC), base.raster_twin(SPEC)]
    # then GEMM1's activation on rcp.approx (bf16: no promoted twins) of the pick and the default
    assert got[-4:-2] == [pick.fast_act_twin(SPEC), base.fast_act_twin(SPEC)]
    assert all(v.glu.fast_act and not v.down.fast_act for v in got[-4:-2])
    # last, GEMM1's ring three stages deep in the pick and the default (both 128-row hopws at 4 stages)
    assert got[-2:] == [pick.shallow_twin(SPEC), base.shallow_twin(SPEC)]
    assert [(v.glu.stages, v.down.stages) for v in got[-2:]] == [(3, 4), (3, 4)]
    assert [dataclasses.replace(v, glu=dataclasses.replace(v.glu, stages=4)) for v in got[-2:]] == [pick, base]
    assert all(v.glu.raster_experts and v.down.raster_experts and v.glu.cluster == v.down.cluster == 1
               for v in rastered)
    assert dataclasses.replace(rastered[0], glu=pick.glu, down=pick.down) == pick
    assert base not in got and len(got) == 13
    assert all(can_implement(SPEC, v)[0] for v in got)
    # no pick for 16 tokens: the default's ping-pong twin, its PDL twin and its fast_act twin, and no
    # cluster or raster twin for its mma.sync tiles
    base16 = default_variant(SPEC, 16)
    assert base16.raster_twin(SPEC) is None
    assert seeds[(SPEC.workload_key, 16)] == [base16.pingpong_twin(SPEC), base16.pdl_twin(),
                                              base16.fast_act_twin(SPEC)]


def test_fp8_seeds_measure_h_scaled_per_128_columns_beside_64(tmp_path):
    """fp8 above the decode buckets (GEMM1 tiles of 128 h columns): the pick's and the default's
    twins with h_block 128 are seeded, so a tuning session measures them beside the 64-block
    variants; the decode buckets' 128-wide GEMM1 tiles have none."""
    spec = make_spec("mixtral-8x7b", precision="fp8")
    base = dataclasses.replace(default_variant(spec, 4096), h_block=64)  # a pick measured before h128
    pick = base.pdl_twin()
    picks.write_tuned(tmp_path, GPU, [{"workload": spec.workload_key, "target": spec.target, "tokens": 4096,
                                       "gpu": GPU, "variant": pick.name(spec), "default": base.name(spec),
                                       "median_us": 1.0, "default_us": 1.1}])
    seeds = tuner.seed_variants(tmp_path, GPU, [spec], [16, 4096])
    got = seeds[(spec.workload_key, 4096)]
    twins = [v for v in got if v.h_block == 128 and v.glu.promote == 1 and not v.glu.fast_act
             and v.glu.stages == pick.glu.stages]
    # GEMM1's ring three stages deep: the pick's and the default's twins, last
    shallow = [v for v in (pick.shallow_twin(spec), default_variant(spec, 4096).shallow_twin(spec)) if v]
    assert shallow and got[-len(shallow):] == shallow and all(v.glu.stages == 3 for v in shallow)
    # the old default's twin is the default now (measured as the default, not seeded again)
    assert base.h_block_twin(spec) == default_variant(spec, 4096)
    assert twins == [pick.h_block_twin(spec)]
    # GEMM1 promoted once per 2 k-tiles: the pick's and the default's twins (and nothing else changed)
    promoted = [v for v in got if v.glu.promote == 2]
    assert pick.promote_twin(spec) in promoted and default_variant(spec, 4096).promote_twin(spec) in promoted
    assert all(dataclasses.replace(v, glu=dataclasses.replace(v.glu, promote=1)) in [pick, base, *got,
               default_variant(spec, 4096)] and v.down.promote == 1 for v in promoted)
    assert [dataclasses.replace(v, h_block=64) for v in twins] == [pick]
    assert all(can_implement(spec, v)[0] for v in got)
    assert all(v.h_block == 64 for v in seeds[(spec.workload_key, 16)])
    assert default_variant(spec, 16).h_block_twin(spec) is None


def test_tried_tiles_come_right_after_the_pick_where_they_can_serve(tmp_path):
    """`tune --try`: the given tiles are seeded after the committed pick (or alone without
    --seed-picks), only in buckets they can serve, never the default again."""
    from moe_aot.cli import _tiles

    tried = _tiles("m16r1_glun32k128s6warp_downn32k128s6warp")
    big = _tiles("_m128r1_glun192k64s4hopws_downn256k64s4hopws")
    assert tried.tile_m == 16 and tried.glu.tile_k == 128 and big.glu.mma == "hopws"
    odd = make_spec(experts=8, top_k=2, hidden=1024, intermediate=1024)  # 2I = 2048: no 192-wide GEMM1 tile
    alone = tuner.seed_variants(None, GPU, [SPEC, odd], [16], (tried, big, default_variant(SPEC, 16)))
    assert alone[(SPEC.workload_key, 16)] == [tried, big]
    assert alone[(odd.workload_key, 16)] == [tried, default_variant(SPEC, 16)]  # SPEC's default, not odd's
    pick = default_variant(SPEC, 4096).pdl_twin()
    picks.write_tuned(tmp_path, GPU, [{"workload": SPEC.workload_key, "target": SPEC.target, "tokens": 4096,
                                       "gpu": GPU, "variant": pick.name(SPEC),
                                       "default": default_variant(SPEC, 4096).name(SPEC), "median_us": 1.0,
                                       "default_us": 1.1}])
    assert tuner.seed_variants(tmp_path, GPU, [SPEC], [4096], (tried,))[(SPEC.workload_key, 4096)][:2] == [pick, tried]
    with pytest.raises(click.BadParameter, match="not a variant's tiles"):
        _tiles("m16_bogus")


# -- confirmation rounds: the fastest few candidates and the default measured again, interleaved --

def _prepared(url, trials, tokens=4096, seed=11):
    """A study of compiled candidates left ready; (the default's name, the others' names)."""
    tuner.prepare(url, [SPEC], (tokens,), GPU, trials=trials, jobs=0, compile_fn=fake_compile, seed=seed,
                  progress=lambda s: None)
    study = tuner.open_study(tuner.open_storage(url), SPEC, GPU, tokens)
    names = [t.user_attrs["variant"] for t in study.trials if t.user_attrs.get("ready")]
    d = default_variant(SPEC, tokens).name(SPEC)
    assert names[0] == d
    return d, names[1:]


def _confirmations(url, tokens=4096):
    with Database(url, readonly=True) as db:
        return [r for r in db.records(SPEC.workload_key, SPEC.target, GPU, tokens) if picks.confirmation(r)]


@pytest.mark.parametrize("steady_draws, expect", [([690.0, 689.0, 691.0], "steady"),
                                                  ([710.0, 712.0, 709.0], "default")])
def test_a_lucky_draw_loses_the_pick_after_confirmation(url, tmp_path, steady_draws, expect):
    """Qwen3-30B 4096 on the H200 in small: one variant reads 668 once, then 725 and 747; the
    default reads 698-702 throughout. Judged by its median it loses to the default, or to a
    candidate that is steadily faster than the default."""
    d, (lucky, steady, *rest) = _prepared(url, 4)
    draws = {d: [700.0, 698.0, 702.0], lucky: [668.0, 725.0, 747.0], steady: steady_draws,
             **{n: [900.0] for n in rest}}
    lines = []
    m = DrawMeasurer(draws)
    measure_worker.measure(url, m, progress=lines.append)
    [row] = _exported(url, tmp_path)
    want = (steady, 690.0, 700.0) if expect == "steady" else (d, 700.0, 700.0)  # medians of three
    assert (row["variant"], row["median_us"], row["default_us"]) == want
    [line] = [ln for ln in lines if ln.startswith("[confirm]")]
    steady_median = sorted(steady_draws)[1]
    assert ("tokens=4096" in line and f"{lucky} 725.0us" in line and f"{steady} {steady_median:.1f}us" in line
            and "default 700.0us" in line), line
    assert line.endswith(f"pick {steady}" if expect == "steady" else "pick the default"), line
    with Database(url) as db:  # what measure deployed for the runtime is the same pick
        [best] = db.all_best(SPEC.workload_key, gpu=GPU)
    assert best.variant == row["variant"]
    again = DrawMeasurer(draws)  # every candidate is confirmed: nothing is due, nothing measured
    measure_worker.measure(url, again, progress=lambda s: None)
    assert again.calls == [] and _exported(url, tmp_path) == [row]


def test_confirm_0_measures_each_trial_once_and_picks_the_fastest_draw(url, tmp_path):
    d, (lucky, steady, *rest) = _prepared(url, 4)
    draws = {d: [700.0, 698.0, 702.0], lucky: [668.0, 725.0, 747.0], steady: [690.0, 689.0, 691.0],
             **{n: [900.0] for n in rest}}
    m = DrawMeasurer(draws)
    lines = []
    measure_worker.measure(url, m, progress=lines.append, confirm=0)
    assert sorted(m.calls) == sorted([d, lucky, steady, *rest])
    assert _confirmations(url) == [] and not any(ln.startswith("[confirm]") for ln in lines)
    [row] = _exported(url, tmp_path)
    assert (row["variant"], row["median_us"], row["default_us"]) == (lucky, 668.0, 700.0)
    with pytest.raises(ValueError, match="confirm must be 0"):
        measure_worker.measure(url, m, confirm=-1)


@pytest.mark.parametrize("k", [3, 4])
def test_the_round_is_the_fastest_candidates_then_the_default_then_back(url, k):
    d, others = _prepared(url, 8)
    a, b, c, e, f, *rest = others
    draws = {d: [650.0], a: [600.0], b: [610.0], c: [620.0], e: [630.0], f: [700.0],
             **{n: [900.0] for n in rest}}
    m = DrawMeasurer(draws)
    measure_worker.measure(url, m, progress=lambda s: None, confirm=k)
    members = [a, b, c, e][:k] + [d]  # f is over 10% slower than a; e is 4th
    assert m.calls[1 + len(others):] == members + members[::-1]
    again = sorted(_confirmations(url), key=lambda r: r.id)
    assert [r.variant for r in again] == members + members[::-1]
    assert [picks.confirmation(r)["position"] for r in again] == list(range(2 * len(members)))
    assert {picks.confirmation(r)["size"] for r in again} == {2 * len(members)}
    assert len({picks.confirmation(r)["round"] for r in again}) == 1
    check_records_and_best(url, SPEC, GPU, (4096,))


def test_every_measurement_of_the_round_is_a_record_and_in_the_records_json(url, tmp_path):
    import importlib.util

    d, (a, b, *rest) = _prepared(url, 4)
    draws = {d: [650.0, 651.5, 648.25], a: [600.0, 633.125, 612.5], b: [610.0, 640.75, 599.5],
             **{n: [900.0] for n in rest}}
    m = DrawMeasurer(draws)
    measure_worker.measure(url, m, progress=lambda s: None)
    n = len(m.calls) - 6
    again = sorted(_confirmations(url), key=lambda r: r.id)
    assert [(r.variant, r.median_us) for r in again] == list(zip(m.calls[n:], m.times[n:]))
    with Database(url, readonly=True) as db:
        trial = {r.id: r for r in db.records() if picks.confirmation(r) is None}
    for r in again:
        of = trial[picks.confirmation(r)["record"]]
        assert (r.gpu, r.driver, r.status) == (GPU, m.driver, "ok")
        assert (r.variant, r.content, r.toolchain) == (of.variant, of.content, of.toolchain)
        assert r.stats["min_us"] == r.median_us * 0.98 and r.stats["study"] == tuner.study_name(SPEC, GPU, 4096)
    # a: 600, 633.125, 612.5 -> 612.5; b: 610, 640.75, 599.5 -> 610; default: 650, 651.5, 648.25 -> 650
    [pick] = picks.derive_picks(Database(url, readonly=True), SPEC, GPU)
    assert (pick.variant, pick.median_us, pick.default_us) == (b, 610.0, 650.0)
    # tools/gpu_run.py dumps every record, the round's too, and the picks re-derived from that
    # JSON the way tests/test_shipped_tunings.py does are the database's
    spec = importlib.util.spec_from_file_location("gpu_run", Path(__file__).parents[1] / "tools" / "gpu_run.py")
    gpu_run = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu_run)
    out = tmp_path / "records.json"
    proc = subprocess.run([sys.executable, "-c", gpu_run.DUMP_RECORDS, url, str(out)], capture_output=True,
                          text=True, cwd=Path(__file__).parents[1])
    assert proc.returncode == 0, proc.stderr
    from datetime import datetime

    from moe_aot.database import RecordRow

    rows = [RecordRow(**{**r, "created_at": datetime.fromisoformat(r["created_at"])})
            for r in json.loads(out.read_text())]
    assert len([r for r in rows if picks.confirmation(r)]) == 6
    best, base = picks.choose_pick(rows, d)
    assert (best.variant, best.median_us, base.median_us) == (b, 610.0, 650.0)


def test_a_failure_in_the_round_loses_no_measurement_and_leaves_the_pick(url, tmp_path):
    d, (lucky, steady, *rest) = _prepared(url, 4)
    slow = {n: [900.0] for n in rest}
    measure_worker.measure(url, DrawMeasurer({d: [700.0], lucky: [668.0], steady: [690.0], **slow}),
                           progress=lambda s: None, confirm=0)
    before = _exported(url, tmp_path)
    assert before[0]["variant"] == lucky
    with Database(url) as db:
        deployed = [(b.variant, b.median_us) for b in db.all_best()]
    # A database measured without rounds: the next `measure` finds one due although no trial is
    # ready. Its order is lucky steady D D steady lucky; the process dies at the 5th measurement.
    dying = DrawMeasurer({lucky: [760.0], steady: [650.0], d: [720.0]}, fail_at=4)
    with pytest.raises(RuntimeError, match="died"):
        measure_worker.measure(url, dying, progress=lambda s: None)
    again = sorted(_confirmations(url), key=lambda r: r.id)
    assert [(r.variant, r.median_us) for r in again] == [(lucky, 760.0), (steady, 650.0), (d, 720.0), (d, 720.0)]
    # counted, those four would make steady the pick (median 670 against the default's 720)
    assert _exported(url, tmp_path) == before
    with Database(url) as db:
        assert [(b.variant, b.median_us) for b in db.all_best()] == deployed
    study = tuner.open_study(tuner.open_storage(url), SPEC, GPU, 4096)
    assert not study.get_trials(states=(TrialState.RUNNING, TrialState.WAITING))
    # The next run measures a whole round; the interrupted one still does not count.
    whole = DrawMeasurer({lucky: [725.0, 747.0], steady: [689.0, 691.0], d: [698.0, 702.0]})
    measure_worker.measure(url, whole, progress=lambda s: None)
    assert whole.calls == [lucky, steady, d, d, steady, lucky]
    [row] = _exported(url, tmp_path)
    assert (row["variant"], row["median_us"], row["default_us"]) == (steady, 690.0, 700.0)
    assert len(_confirmations(url)) == 4 + 6


def test_a_candidate_that_fails_once_in_the_round_cannot_be_the_pick(url, tmp_path):
    d, (fast, *rest) = _prepared(url, 4)
    draws = {d: [700.0], fast: [650.0, None, 651.0], **{n: [900.0] for n in rest}}
    measure_worker.measure(url, DrawMeasurer(draws), progress=lambda s: None)
    assert [r.status for r in _confirmations(url)].count("launch_error") == 1
    [row] = _exported(url, tmp_path)
    assert (row["variant"], row["median_us"]) == (d, 700.0)


class _LuckyFirst(FakeMeasurer):
    """Every variant but the default reads half its time the first time and twice it after."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def __call__(self, spec, variant, tokens):
        name = variant.name(spec)
        t = fake_time_us(spec, variant, tokens)
        if variant != default_variant(spec, tokens):
            t *= 0.5 if name not in self.seen else 2.0
        self.seen.append(name)
        return tuner.Outcome("ok", median_us=t, stats={"median_us": t}, rel_err=1e-3)


def test_tune_confirms_too(tmp_path):
    chosen = {}
    for confirm in (0, 3):
        url = f"sqlite:///{tmp_path / f'tune{confirm}.sqlite'}"
        m = _LuckyFirst()
        tuner.tune(url, [SPEC], (256,), m, trials=5, jobs=0, compile_fn=fake_compile, seed=1,
                   progress=lambda s: None, confirm=confirm)  # a seed whose proposals are not all pruned
        [chosen[confirm]] = picks.derive_picks(Database(url, readonly=True), SPEC, GPU)
        assert (len(m.seen) > len(set(m.seen))) == (confirm > 0)
    d = default_variant(SPEC, 256).name(SPEC)
    assert chosen[0].variant != d and chosen[3].variant == d


def test_cli_confirm_flag(runner, tmp_path, monkeypatch):
    url = f"sqlite:///{tmp_path / 'cli.sqlite'}"
    d, (lucky, steady, *rest) = _prepared(url, 4)
    draws = {d: [700.0, 698.0, 702.0], lucky: [668.0, 725.0, 747.0], steady: [710.0, 712.0, 709.0],
             **{n: [900.0] for n in rest}}
    monkeypatch.setattr("moe_aot.cli._gpu_measurer", lambda url, replays, warmup_s: DrawMeasurer(draws))
    res = runner.invoke(main, ["measure", "--confirm", "-1"])
    assert res.exit_code == 2 and "-1 is negative" in res.output and "0 for no confirmation round" in res.output
    res = runner.invoke(main, ["tune", "--compile-only", "--gpu", GPU, "--model", "qwen3-30b-a3b", "--confirm", "2"])
    assert res.exit_code == 2 and "--confirm goes with measuring" in res.output
    assert f"(default: {picks.CONFIRM_K})" in runner.invoke(main, ["measure", "--help"]).output
    other = f"sqlite:///{tmp_path / 'other.sqlite'}"
    assert _prepared(other, 4) == (d, [lucky, steady, *rest])
    res = runner.invoke(main, ["measure", "--confirm", "0", "--db", other, "--export-dir", str(tmp_path / "t0")])
    assert res.exit_code == 0 and "[confirm]" not in res.output, res.output
    assert json.loads(next((tmp_path / "t0").iterdir()).read_text())["variant"] == lucky
    res = runner.invoke(main, ["measure", "--export-dir", str(tmp_path / "t3")])
    assert res.exit_code == 0, res.output
    [line] = [ln for ln in res.output.splitlines() if ln.startswith("[confirm]")]
    assert f"{lucky} 725.0us" in line and f"{steady} 710.0us" in line and line.endswith("pick the default")
    assert json.loads(next((tmp_path / "t3").iterdir()).read_text())["variant"] == d


def test_the_report_table_marks_the_confirmation_measurements():
    from datetime import datetime, timezone

    from moe_aot.database import RecordRow
    from moe_aot.report import _table

    name = default_variant(SPEC, 16).name(SPEC)
    trial = RecordRow(1, SPEC.workload_key, "sm_90a", "tc", GPU, "d", 16, name, "c", "ok", 10.0, {}, 1e-3, None,
                      datetime.now(timezone.utc))
    again = [dataclasses.replace(trial, id=i, median_us=10.0 + i, stats={"confirm": {"round": "r", "position": i - 2,
                                                                                    "size": 2, "record": 1}})
             for i in (2, 3)]
    page = _table(16, [trial, *again])
    assert page.count("ok (confirmation round)") == 2 and page.count("<td>ok<td>") == 1


def test_the_sampler_chooses_the_routing_cluster():
    """The GEMM-option rule (_option_applies) covers glu_* / down_* only: the routing kernel's
    route_cluster (1 or 16 CTAs) is the sampler's to choose at every bucket."""
    import optuna

    assert tuner._option_applies({"tile_m": 64}, "route_cluster")
    assert not tuner._option_applies({"tile_m": 64, "glu_mma": "warp"}, "glu_cluster")
    space = tuner.search_space(SPEC)
    assert set(space["route_cluster"].choices) == {1, 16}
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=3))
    seen = {tuner.suggest(study.ask(), space).route_cluster for _ in range(24)}
    assert seen == {1, 16}


def test_seed_gpu_seeds_one_gpus_studies_from_another_gpus_picks(tmp_path, monkeypatch):
    """`tune --compile-only --gpu A --seed-picks DIR --seed-gpu B`: the studies are A's, seeded
    with B's committed picks and their twins (how the H100's first picks were seeded from the
    H200's); B without picks in DIR, or --seed-gpu without --seed-picks, is refused."""
    pick = LayerVariant.parse("moe_layer_sm90a_bf16_e128k8h2048i768_swiglu_m128r16_glun192k64s4hopws"
                              "_downn256k64s4hopws_pdl")
    entry = {"workload": SPEC.workload_key, "target": SPEC.target, "tokens": 4096, "gpu": GPU,
             "variant": pick.name(SPEC), "default": default_variant(SPEC, 4096).name(SPEC), "median_us": 1.0,
             "default_us": 1.1}
    picks.write_tuned(tmp_path / "tuned", GPU, [entry])
    got = {}
    monkeypatch.setattr(tuner, "prepare", lambda url, specs, buckets, gpu, **kw: got.update(gpu=gpu, **kw) or 0)
    base = ["tune", "--compile-only", "--model", "qwen3-30b-a3b", "--tokens", "4096", "--gpu", "Another GPU",
            "--db", f"sqlite:///{tmp_path / 't.sqlite'}"]
    r = CliRunner().invoke(main, [*base, "--seed-picks", str(tmp_path / "tuned"), "--seed-gpu", GPU])
    assert r.exit_code == 0, r.output
    assert got["gpu"] == "Another GPU"
    assert got["seeds"] == tuner.seed_variants(tmp_path / "tuned", GPU, [SPEC], [4096])
    assert got["seeds"][(SPEC.workload_key, 4096)][0] == pick
    # without --seed-gpu the folder has nothing for "Another GPU": the twins of the default only
    assert CliRunner().invoke(main, [*base, "--seed-picks", str(tmp_path / "tuned")]).exit_code == 0
    assert pick not in got["seeds"][(SPEC.workload_key, 4096)]
    r = CliRunner().invoke(main, [*base, "--seed-picks", str(tmp_path / "tuned"), "--seed-gpu", "NVIDIA B200"])
    assert r.exit_code != 0
    assert f"holds no picks for 'NVIDIA B200'; GPUs with picks there: {GPU!r}" in r.output
    r = CliRunner().invoke(main, [*base, "--seed-gpu", GPU])
    assert r.exit_code != 0 and "--seed-gpu goes with --seed-picks DIR" in r.output


def test_a_default_that_failed_its_trial_but_ran_in_a_round_is_the_picks_bar():
    """choose_pick where the default's trial failed (the H100's DeepSeek-V3 16384 backward ran out
    of memory there) and a confirmation round measured it: the pick must beat the default's median
    over the measurements that ran, which the export then keeps as default_us; without a round the
    default has no time (None) and any valid record is the pick."""
    from datetime import datetime, timezone

    from moe_aot.database import RecordRow

    d = default_variant(SPEC, 16).name(SPEC)
    other = "some_other_variant"
    now = datetime.now(timezone.utc)

    def rec(i, name, status, us, rnd=None):
        stats = {} if rnd is None else {"confirm": {"round": rnd, "position": i, "size": 4, "record": 1}}
        return RecordRow(i, SPEC.workload_key, "sm_90a", "tc", GPU, "d", 16, name, "c" + name, status, us, stats,
                         None, None, now)

    trials = [rec(1, d, "resource_error", None), rec(2, other, "ok", 500.0)]
    best, base = picks.choose_pick(trials, d)
    assert (best.variant, best.median_us, base.median_us) == (other, 500.0, None)
    again = [rec(3, other, "ok", 490.0, "r"), rec(4, d, "ok", 560.0, "r"), rec(5, d, "ok", 550.0, "r"),
             rec(6, other, "ok", 495.0, "r")]
    best, base = picks.choose_pick(trials + again, d)
    assert (best.variant, best.median_us, base.median_us) == (other, 495.0, 555.0)
    slower = [dataclasses.replace(r, median_us=600.0) if r.variant == other else r for r in again]
    best, base = picks.choose_pick(trials + slower, d)
    assert (best.variant, base.median_us) == (d, 555.0)  # beaten in the round: the default stays
