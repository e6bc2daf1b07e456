"""The tuner: one optuna study per (workload, target, GPU, token bucket) over layer variants.

The studies live in the kernel database's own URL (optuna's RDB storage), which is what lets a
killed session resume, several GPU workers share a study, and the work split across machines:
`prepare` asks and compiles where the DSL is and enqueues compiled trials as WAITING ("ready");
`measure_worker.measure` claims them on a GPU machine that has no DSL. `tune` does both in one
process, compiling in a pool of spawned CPU processes a few trials ahead of the GPU.

Nothing here imports cutlass or the compiler at module level: the measuring side imports this
module for the search space, the study names and the way results are told and recorded.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import random
import socket
import sys
import time
import warnings
from collections import deque
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from multiprocessing import get_context
from pathlib import Path
from typing import Callable

import optuna
from optuna.distributions import CategoricalDistribution
from optuna.trial import TrialState, create_trial

from .database import Database
from .spec import LayerSpec
from .variants import LayerVariant, can_implement, candidate_space

optuna.logging.set_verbosity(optuna.logging.WARNING)

STUDY_PREFIX = "moe-aot"
STALE_AFTER_S = 3600.0  # a RUNNING trial of another host untouched this long is taken back
FAILED_US = math.inf  # compile and resource failures are "infinitely slow" to the sampler


# -- search space ------------------------------------------------------------------------------
# Parameters are the variant's dataclass fields, flattened (glu.tile_n -> "glu_tile_n"), so a new
# compile-time field in variants.py joins the search without a change here.

def _flatten(v, prefix="") -> dict:
    out = {}
    for f in dataclasses.fields(v):
        val = getattr(v, f.name)
        if dataclasses.is_dataclass(val):
            out.update(_flatten(val, f"{prefix}{f.name}_"))
        else:
            out[f"{prefix}{f.name}"] = val
    return out


def params_of(v: LayerVariant) -> dict:
    return _flatten(v)


def variant_of(params: dict) -> LayerVariant:
    """Inverse of params_of. A parameter missing from `params` (a trial recorded before that
    field joined the variant) takes the field's default, which is what was compiled then."""
    kw = {}
    for f in dataclasses.fields(LayerVariant):
        default = getattr(LayerVariant(), f.name)
        if dataclasses.is_dataclass(default):
            kw[f.name] = type(default)(**{g.name: params.get(f"{f.name}_{g.name}", getattr(default, g.name))
                                          for g in dataclasses.fields(default)})
        else:
            kw[f.name] = params.get(f.name, default)
    return LayerVariant(**kw)


def search_space(spec: LayerSpec) -> dict[str, CategoricalDistribution]:
    """Per parameter, the values that occur in candidate_space (sorted, so every process and
    session builds the same distributions); combinations can_implement refuses are pruned."""
    values: dict[str, set] = {}
    for v in candidate_space(spec):
        for k, x in params_of(v).items():
            values.setdefault(k, set()).add(x)
    if not values:
        raise ValueError(f"no variant can implement {spec.workload_key} on {spec.target}")
    return {k: CategoricalDistribution(sorted(xs, key=lambda x: (str(type(x)), x))) for k, xs in values.items()}


def suggest(trial: optuna.Trial, space: dict[str, CategoricalDistribution]) -> LayerVariant:
    """A trial enqueued by `prepare` carries fixed params: suggest returns those and records them.
    One enqueued before a field joined the search space lacks that param; it keeps the field's
    default (what was compiled for it) instead of having the sampler pick a value."""
    fixed = trial.storage.get_trial_system_attrs(trial._trial_id).get("fixed_params")
    return variant_of({k: trial.suggest_categorical(k, d.choices) for k, d in space.items()
                       if fixed is None or k in fixed})


# -- studies -----------------------------------------------------------------------------------

def study_name(spec: LayerSpec, gpu: str, tokens: int) -> str:
    return f"{STUDY_PREFIX}:{spec.workload_key}:{spec.target}:{gpu}:t{tokens}"


def parse_study_name(name: str) -> dict | None:
    parts = name.split(":")
    if len(parts) < 5 or parts[0] != STUDY_PREFIX or not parts[-1].startswith("t"):
        return None
    return {"workload": parts[1], "target": parts[2], "gpu": ":".join(parts[3:-1]),
            "tokens": int(parts[-1][1:])}


def open_storage(url: str) -> optuna.storages.RDBStorage:
    """optuna's storage on the kernel database's URL. On SQLite every transaction takes the write
    lock up front: optuna claims a WAITING trial by read-then-update, which SQLite's deferred
    transactions would let two processes both win."""
    from sqlalchemy import event
    from sqlalchemy.engine import make_url

    sqlite = make_url(url).get_backend_name() == "sqlite"
    kwargs = {"connect_args": {"timeout": 60}} if sqlite else {}
    for attempt in range(3):  # workers started together race to create optuna's tables
        try:
            storage = optuna.storages.RDBStorage(url, engine_kwargs=kwargs)
            break
        except Exception:
            if attempt == 2:
                raise
            time.sleep(0.5 + random.random())
    if sqlite:
        @event.listens_for(storage.engine, "connect")
        def _connect(dbapi_conn, _rec):
            dbapi_conn.isolation_level = None

        @event.listens_for(storage.engine, "begin")
        def _begin(conn):
            conn.exec_driver_sql("BEGIN IMMEDIATE")
        storage.engine.dispose()  # connections opened before the hooks lack them
    return storage


def sampler(seed: int | None = None) -> optuna.samplers.BaseSampler:
    # constant_liar: trials asked ahead (still compiling) steer the sampler away from themselves.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        return optuna.samplers.TPESampler(constant_liar=True, n_startup_trials=8, seed=seed)


def open_study(storage, spec: LayerSpec, gpu: str, tokens: int, seed: int | None = None) -> optuna.Study:
    study = optuna.create_study(study_name=study_name(spec, gpu, tokens), storage=storage,
                                direction="minimize", sampler=sampler(seed), load_if_exists=True)
    if "spec" not in study.user_attrs:
        study.set_user_attr("spec", {**spec.to_dict(), "model": spec.model})
    return study


def study_spec(study: optuna.Study) -> LayerSpec:
    return LayerSpec(**study.user_attrs["spec"])


def worker_id() -> str:
    return f"{socket.gethostname()}:{os.getpid()}"


def _dead(worker: str | None) -> bool:
    host, _, pid = (worker or "").rpartition(":")
    if host != socket.gethostname() or not pid.isdigit():
        return False
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return False


def requeue_stale(study: optuna.Study, stale_after_s: float = STALE_AFTER_S) -> int:
    """RUNNING trials of a killed session go back to WAITING (keeping their params and whether
    they were compiled), so running again resumes them instead of losing them."""
    n = 0
    cutoff = datetime.now() - timedelta(seconds=stale_after_s)
    for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
        if _dead(t.user_attrs.get("worker")) or (t.datetime_start and t.datetime_start < cutoff):
            try:
                study._storage.set_trial_state_values(t._trial_id, TrialState.WAITING)
                n += 1
            except optuna.exceptions.UpdateFinishedTrialError:
                pass
    return n


# -- outcomes: record, tell, commit --------------------------------------------------------------

@dataclass
class Outcome:
    """One measurement (or failure) of one variant at one token count."""
    status: str  # one of database.RECORD_STATUSES
    median_us: float | None = None
    stats: dict = field(default_factory=dict)
    rel_err: float | None = None
    error: str | None = None


@dataclass
class Compiled:
    toolchain: str
    error: str | None
    seconds: float


def known_outcome(db: Database, spec: LayerSpec, gpu: str, toolchain: str, tokens: int,
                  variant: LayerVariant) -> Outcome | None:
    """The recorded outcome of this variant at this bucket, GPU and toolchain: the sampler
    proposing a point again (or two studies' trials naming one variant) costs a lookup, not a
    second measurement of scarce GPU time."""
    r = db.find_record(workload=spec.workload_key, target=spec.target, gpu=gpu, toolchain=toolchain,
                       tokens=tokens, variant=variant.name(spec))
    return None if r is None else Outcome(r.status, r.median_us, r.stats, r.rel_err, r.error)


def finish(db: Database, study: optuna.Study, trial: optuna.Trial, spec: LayerSpec, tokens: int,
           variant: LayerVariant, toolchain: str, gpu: str, driver: str, out: Outcome) -> int | None:
    """Record the outcome, tell the study, commit the best. A variant already recorded for this
    bucket, GPU and toolchain (the sampler proposing a point again, or two workers measuring it
    at once) keeps its first record, and the trial is told that record's outcome."""
    name = variant.name(spec)
    stats = {**out.stats, "study": study.study_name, "trial": trial.number, "worker": worker_id()}
    rid, prev = db.add_record_once(workload=spec.workload_key, target=spec.target, toolchain=toolchain,
                                   gpu=gpu, driver=driver, tokens=tokens, variant=name,
                                   status=out.status, median_us=out.median_us, stats=stats,
                                   rel_err=out.rel_err, error=out.error)
    if prev is not None:
        out = Outcome(prev.status, prev.median_us, prev.stats, prev.rel_err, prev.error)
        trial.set_user_attr("repeat_of_record", rid)
    else:
        trial.set_user_attr("record", rid)
    trial.set_user_attr("status", out.status)
    if out.error:
        trial.set_user_attr("error", out.error[:500])
    if out.status == "ok":
        db.commit_best(workload=spec.workload_key, target=spec.target, gpu=gpu, toolchain=toolchain,
                       tokens=tokens, variant=name, median_us=out.median_us, record_id=rid)
        study.tell(trial, out.median_us)
    elif out.status in ("compile_error", "resource_error"):
        study.tell(trial, FAILED_US)
    else:  # a wrong result or a failed launch says nothing about speed
        study.tell(trial, state=TrialState.FAIL)
    return rid


# -- compiling -----------------------------------------------------------------------------------

def compile_variant(db_url: str, spec: LayerSpec, variant: LayerVariant) -> Compiled:
    """Compile every kernel of `variant` into the database (existing ones are skipped). Runs in a
    pool process; this is where the DSL gets imported, never in the measuring process."""
    from .compiler import compile_into, toolchain_key

    t0 = time.perf_counter()
    with Database(db_url) as db:
        results = compile_into(db, [(spec, variant)], jobs=1)
    errors = [f"{r.kernel.name}: {r.error}" for r in results if r.artifact is None]
    return Compiled(toolchain_key(spec.target), "\n".join(errors) or None, time.perf_counter() - t0)


class CompilePool:
    """Spawned compile processes (the DSL is not fork-safe); jobs=0 compiles inline (tests)."""

    def __init__(self, jobs: int, compile_fn: Callable = compile_variant):
        self.compile_fn = compile_fn
        self._pool = ProcessPoolExecutor(jobs, mp_context=get_context("spawn")) if jobs > 0 else None

    def submit(self, *args) -> Future:
        if self._pool is not None:
            return self._pool.submit(self.compile_fn, *args)
        fut: Future = Future()
        try:
            fut.set_result(self.compile_fn(*args))
        except BaseException as exc:
            fut.set_exception(exc)
        return fut

    def close(self, cancel: bool = False) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=not cancel, cancel_futures=cancel)


# -- budgets and the per-bucket slots ------------------------------------------------------------

@dataclass
class Slot:
    """One bucket's study in this session."""
    spec: LayerSpec
    tokens: int
    study: optuna.Study
    space: dict
    pending: int = 0  # compiling in `prepare`, not yet a trial in the study

    def remaining(self, trials: int) -> int:
        return trials - len(self.study.get_trials(deepcopy=False)) - self.pending


def open_slots(storage, specs, gpu: str, buckets, seed=None, stale_after_s=STALE_AFTER_S) -> list[Slot]:
    slots = []
    for spec in specs:
        space = search_space(spec)
        for tokens in buckets:
            study = open_study(storage, spec, gpu, tokens, seed)
            requeue_stale(study, stale_after_s)
            slots.append(Slot(spec, tokens, study, space))
    return slots


def _next_slot(slots: list[Slot], trials: int, turn: list[int]) -> Slot | None:
    for i in range(len(slots)):
        s = slots[(turn[0] + i) % len(slots)]
        if s.remaining(trials) > 0:
            turn[0] = (turn[0] + i + 1) % len(slots)
            return s
    return None


def _prune(trial: optuna.Trial, study: optuna.Study, why: str) -> None:
    trial.set_user_attr("pruned", why)
    study.tell(trial, state=TrialState.PRUNED)


def line(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# -- tune: ask, compile ahead, measure, tell (one process with a GPU and the DSL) ----------------

@dataclass
class _Job:
    slot: Slot
    trial: optuna.Trial
    variant: LayerVariant
    compiled: Compiled | None = None


def tune(db_url: str, specs, buckets, measurer, trials: int = 30, timeout_s: float | None = None,
         jobs: int = 2, ahead: int | None = None, compile_fn: Callable = compile_variant,
         seed: int | None = None, progress: Callable[[str], None] = line,
         stale_after_s: float = STALE_AFTER_S) -> None:
    """Tune every (spec, bucket) until its study holds `trials` trials or `timeout_s` passes
    (then nothing new is asked; what is in flight finishes). `measurer(spec, variant, tokens)`
    returns an Outcome and carries `.gpu` and `.driver`."""
    db = Database(db_url)
    storage = open_storage(db_url)
    slots = open_slots(storage, specs, measurer.gpu, buckets, seed, stale_after_s)
    deadline = time.monotonic() + timeout_s if timeout_s else math.inf
    ahead = ahead or max(2, jobs + 1)
    pool = CompilePool(jobs, compile_fn)
    compiling: dict[Future, _Job] = {}
    ready: deque[_Job] = deque()
    turn, done = [0], 0
    try:
        while True:
            while len(compiling) + len(ready) < ahead and time.monotonic() < deadline:
                slot = _next_slot(slots, trials, turn)
                if slot is None:
                    break
                job = _ask(slot)
                if job is not None:
                    compiling[pool.submit(db_url, slot.spec, job.variant)] = job
            if not compiling and not ready:
                break
            for fut in [f for f in compiling if f.done()] if ready else wait(compiling, return_when=FIRST_COMPLETED)[0]:
                job = compiling.pop(fut)
                job.compiled = fut.result()
                job.trial.set_user_attr("toolchain", job.compiled.toolchain)
                job.trial.set_user_attr("ready", True)
                ready.append(job)
            if ready:
                job = ready[0]
                c = job.compiled
                out = (Outcome("compile_error", error=c.error) if c.error else
                       known_outcome(db, job.slot.spec, measurer.gpu, c.toolchain, job.slot.tokens, job.variant)
                       or measurer(job.slot.spec, job.variant, job.slot.tokens))
                ready.popleft()
                finish(db, job.slot.study, job.trial, job.slot.spec, job.slot.tokens, job.variant,
                       c.toolchain, measurer.gpu, measurer.driver, out)
                done += 1
                progress(_progress_line(db, job, out, c.toolchain, measurer.gpu, done))
    except BaseException:
        # Hand unfinished trials back (WAITING) so the next run resumes them at once.
        pool.close(cancel=True)
        for job in list(compiling.values()) + list(ready):
            try:
                storage.set_trial_state_values(job.trial._trial_id, TrialState.WAITING)
            except Exception:
                pass
        raise
    finally:
        pool.close()
        db.close()


def _ask(slot: Slot) -> _Job | None:
    if not slot.study.get_trials(deepcopy=False):
        # The documented default is a new study's first trial: the tuned pick is measured against it.
        from .variants import default_variant

        slot.study.enqueue_trial(params_of(default_variant(slot.spec, slot.tokens)))
    trial = slot.study.ask()
    trial.set_user_attr("worker", worker_id())
    variant = suggest(trial, slot.space)
    ok, why = can_implement(slot.spec, variant)
    if not ok:
        _prune(trial, slot.study, why)
        return None
    trial.set_user_attr("variant", variant.name(slot.spec))
    trial.set_user_attr("tokens", slot.tokens)
    return _Job(slot, trial, variant)


def _progress_line(db, job: _Job, out: Outcome, toolchain: str, gpu: str, done: int) -> str:
    best = db.best(job.slot.spec.workload_key, job.slot.spec.target, gpu, toolchain).get(job.slot.tokens)
    took = f"{out.median_us:9.1f}us" if out.median_us else f"{'-':>11}"
    return (f"[{done}] {job.slot.spec.label()} tokens={job.slot.tokens:<6} trial {job.trial.number:<4}"
            f" {out.status:14} {took}  best {best.median_us if best else float('nan'):9.1f}us"
            f"  {job.variant.name(job.slot.spec)}")


# -- prepare: the compile-only half (a machine with the DSL and no GPU) --------------------------

def propose(slot: Slot, exclude: set[str], rng: random.Random) -> LayerVariant | None:
    """A new variant for the slot's study from its sampler, without creating a trial there: the
    study's trials are replayed into an in-memory study (pending ones as RUNNING, which the
    constant liar avoids), so a WAITING ready trial is never popped by the compiling side.
    The documented default goes first: every tuned pick is then measured against it."""
    from .variants import default_variant

    base = default_variant(slot.spec, slot.tokens)
    if base.name(slot.spec) not in exclude:
        return base
    # With a few trials per bucket, sampling a space of ~10^4 points rarely beats a good default;
    # every other proposal changes one field of the best measured variant (a local step).
    done = [t for t in slot.study.get_trials(deepcopy=False) if t.state == TrialState.COMPLETE
            and "variant" in t.user_attrs and t.value is not None and t.value < FAILED_US]
    if done and len(slot.study.get_trials(deepcopy=False)) % 2 == 1:
        step = mutate(variant_of(min(done, key=lambda t: t.value).params), slot, exclude, rng)
        if step is not None:
            return step
    tmp = optuna.create_study(direction="minimize", sampler=sampler(rng.randrange(2**31)))
    for t in slot.study.get_trials(deepcopy=False):
        params = t.params or t.system_attrs.get("fixed_params")
        if not params or not set(params) <= set(slot.space):
            continue
        params = params_of(variant_of(params))  # fields added since: their defaults
        state = t.state if t.state.is_finished() else TrialState.RUNNING
        tmp.add_trial(create_trial(state=state, value=t.value if state == TrialState.COMPLETE else None,
                                   params=params, distributions=slot.space))
    for _ in range(16):
        tt = tmp.ask()
        v = suggest(tt, slot.space)
        if can_implement(slot.spec, v)[0] and v.name(slot.spec) not in exclude:
            return v
        tmp.tell(tt, state=TrialState.PRUNED)
    unseen = [v for v in candidate_space(slot.spec) if v.name(slot.spec) not in exclude]
    return rng.choice(unseen) if unseen else None


def mutate(best: LayerVariant, slot: Slot, exclude: set[str], rng: random.Random,
           tries: int = 64) -> LayerVariant | None:
    """A valid, unseen variant that differs from `best` in one searched field."""
    params = params_of(best)
    keys = sorted(slot.space)
    for _ in range(tries):
        key = rng.choice(keys)
        choices = [c for c in slot.space[key].choices if c != params[key]]
        if not choices:
            continue
        v = variant_of({**params, key: rng.choice(choices)})
        if can_implement(slot.spec, v)[0] and v.name(slot.spec) not in exclude:
            return v
    return None


def _seen(slot: Slot) -> set[str]:
    return {t.user_attrs["variant"] for t in slot.study.get_trials(deepcopy=False) if "variant" in t.user_attrs}


def prepare(db_url: str, specs, buckets, gpu: str, trials: int = 30, timeout_s: float | None = None,
            jobs: int = 2, compile_fn: Callable = compile_variant, seed: int | None = None,
            progress: Callable[[str], None] = line) -> int:
    """Compile candidates for `gpu`'s studies and enqueue them as ready WAITING trials, until each
    study holds `trials` trials. A compile failure becomes a finished trial and a record here.
    Returns the number of trials added."""
    db = Database(db_url)
    storage = open_storage(db_url)
    slots = open_slots(storage, specs, gpu, buckets, seed)
    rng = random.Random(seed)
    deadline = time.monotonic() + timeout_s if timeout_s else math.inf
    pool = CompilePool(jobs, compile_fn)
    compiling: dict[Future, tuple[Slot, LayerVariant]] = {}
    turn, added = [0], 0
    try:
        while True:
            while len(compiling) < max(1, jobs) and time.monotonic() < deadline:
                slot = _next_slot(slots, trials, turn)
                if slot is None:
                    break
                exclude = _seen(slot) | {v.name(s.spec) for s, v in compiling.values() if s is slot}
                variant = propose(slot, exclude, rng)
                if variant is None:  # the whole space is tried
                    slot.pending = trials
                    continue
                slot.pending += 1
                compiling[pool.submit(db_url, slot.spec, variant)] = (slot, variant)
            if not compiling:
                break
            for fut in wait(compiling, return_when=FIRST_COMPLETED)[0]:
                slot, variant = compiling.pop(fut)
                c = fut.result()
                _enqueue(db, slot, variant, c, gpu)
                slot.pending -= 1
                added += 1
                status = "compile_error" if c.error else "ready"
                progress(f"[{added}] {slot.spec.label()} tokens={slot.tokens:<6} {status:14} "
                         f"{c.seconds:6.1f}s  {variant.name(slot.spec)}")
    finally:
        pool.close(cancel=True)
        db.close()
    return added


def _enqueue(db: Database, slot: Slot, variant: LayerVariant, c: Compiled, gpu: str) -> None:
    name = variant.name(slot.spec)
    attrs = {"variant": name, "tokens": slot.tokens, "toolchain": c.toolchain, "compiled_by": worker_id()}
    if c.error is None:
        slot.study.enqueue_trial(params_of(variant), user_attrs={**attrs, "ready": True},
                                 skip_if_exists=False)
        return
    rid, _ = db.add_record_once(workload=slot.spec.workload_key, target=slot.spec.target,
                                toolchain=c.toolchain, gpu=gpu, driver="-", tokens=slot.tokens,
                                variant=name, status="compile_error", median_us=None, rel_err=None,
                                stats={"study": slot.study.study_name, "compile_s": round(c.seconds, 3)},
                                error=c.error)
    slot.study.add_trial(create_trial(
        value=FAILED_US, params=params_of(variant), distributions=slot.space,
        user_attrs={**attrs, "status": "compile_error", "record": rid, "error": c.error[:500]}))


# -- roofline, summary, text export --------------------------------------------------------------

def roofline_floor_us(spec: LayerSpec, tokens: int) -> float:
    """max(tensor-core time at 790 TFLOP/s, HBM time at 4.8 TB/s for the routed experts' weights
    (expected distinct experts under uniform routing) and the activations)."""
    H, I, E, K = spec.hidden, spec.intermediate, spec.experts, spec.top_k
    flops = 6 * tokens * K * H * I
    experts = E * (1 - (1 - K / E) ** tokens)
    nbytes = 3 * H * I * 2 * experts + 4 * tokens * H
    return max(flops / 790e12, nbytes / 4.8e12) * 1e6


def summary(db: Database, spec: LayerSpec, gpu: str, buckets) -> list[dict]:
    rows = []
    for tokens in buckets:
        recs = db.records(spec.workload_key, spec.target, gpu, tokens)
        ok = [r for r in recs if r.status == "ok"]
        best = min(ok, key=lambda r: r.median_us, default=None)
        floor = roofline_floor_us(spec, tokens)
        rows.append({"tokens": tokens, "records": len(recs), "ok": len(ok), "failed": len(recs) - len(ok),
                     "best_us": best.median_us if best else None, "floor_us": floor,
                     "of_floor": floor / best.median_us if best else None,
                     "variant": best.variant if best else None})
    return rows


def format_summary(spec: LayerSpec, gpu: str, rows: list[dict]) -> str:
    out = [f"{spec.label()} on {gpu} ({spec.target})",
           f"{'tokens':>7} {'records':>7} {'ok':>4} {'failed':>6} {'best us':>10} {'floor us':>9} {'floor/best':>10}  variant"]
    for r in rows:
        best = f"{r['best_us']:10.1f}" if r["best_us"] else f"{'-':>10}"
        frac = f"{r['of_floor']:10.0%}" if r["of_floor"] else f"{'-':>10}"
        out.append(f"{r['tokens']:>7} {r['records']:>7} {r['ok']:>4} {r['failed']:>6} {best} "
                   f"{r['floor_us']:9.1f} {frac}  {r['variant'] or '-'}")
    return "\n".join(out)


def tuned_path(directory: Path, gpu: str) -> Path:
    return Path(directory) / f"{gpu.replace(' ', '_')}.jsonl"


def export_tuned(db: Database, directory: Path, gpu: str | None = None) -> list[Path]:
    """Write the best picks as reviewable text, one file per GPU, one JSON object per line, sorted
    so a re-export of unchanged results is byte-identical. Picks of the newest toolchain win."""
    newest: dict[tuple, object] = {}
    for b in db.all_best(gpu=gpu):
        key = (b.gpu, b.workload, b.target, b.tokens)
        if key not in newest or b.updated_at > newest[key].updated_at:
            newest[key] = b
    by_gpu: dict[str, list[dict]] = {}
    for (g, w, t, n), b in sorted(newest.items()):
        by_gpu.setdefault(g, []).append({"workload": w, "target": t, "gpu": g, "tokens": n,
                                         "variant": b.variant, "median_us": round(b.median_us, 3)})
    paths = []
    for g, entries in by_gpu.items():
        path = tuned_path(directory, g)
        path.parent.mkdir(parents=True, exist_ok=True)
        keep = [e for e in read_tuned_file(path) if (e["workload"], e["target"], e["tokens"]) not in
                {(x["workload"], x["target"], x["tokens"]) for x in entries}] if path.exists() else []
        merged = sorted(keep + entries, key=lambda e: (e["workload"], e["target"], e["tokens"]))
        tmp = path.with_suffix(".jsonl.tmp")
        tmp.write_text("".join(json.dumps(e, sort_keys=True) + "\n" for e in merged))
        os.replace(tmp, path)
        paths.append(path)
    return paths


def read_tuned_file(path: Path) -> list[dict]:
    out = []
    for i, text in enumerate(Path(path).read_text().splitlines(), 1):
        if not text.strip():
            continue
        try:
            e = json.loads(text)
            LayerVariant.parse(e["variant"])
            out.append({k: e[k] for k in ("workload", "target", "gpu", "tokens", "variant", "median_us")})
        except (ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"{path}:{i}: not a tuned pick ({exc}); expected one JSON object with "
                             "workload, target, gpu, tokens, variant, median_us") from None
    return out


def read_tuned(directory: Path, gpu: str | None = None) -> list[dict]:
    files = [tuned_path(directory, gpu)] if gpu else sorted(Path(directory).glob("*.jsonl"))
    return [e for f in files if f.exists() for e in read_tuned_file(f)]


def build_plan(db: Database, specs, buckets, gpu: str | None, tuned_dir: Path) -> tuple[list, list]:
    """What `moe-aot build` compiles: per spec and bucket the default variant, plus every tuned
    pick for the target (one GPU or all) from the database's best table and the text export.
    Returns (spec, variant) pairs to compile and the picks to (re)commit under the build's
    toolchain, as (spec, gpu, tokens, variant, median_us)."""
    from .variants import default_variant

    pairs, picks = [], []
    text = read_tuned(tuned_dir, gpu) if Path(tuned_dir).is_dir() else []
    for spec in specs:
        for tokens in buckets:
            pairs.append((spec, default_variant(spec, tokens)))
        found, when = {}, {}
        for b in db.all_best(workload=spec.workload_key, target=spec.target, gpu=gpu):
            if (b.gpu, b.tokens) not in when or b.updated_at > when[(b.gpu, b.tokens)]:
                found[(b.gpu, b.tokens)], when[(b.gpu, b.tokens)] = (b.variant, b.median_us), b.updated_at
        for e in text:
            if e["workload"] == spec.workload_key and e["target"] == spec.target:
                found.setdefault((e["gpu"], e["tokens"]), (e["variant"], e["median_us"]))
        for (g, tokens), (name, us) in sorted(found.items()):
            v = LayerVariant.parse(name)
            ok, why = can_implement(spec, v)
            if not ok:
                raise ValueError(f"tuned pick {name} for {g} cannot implement {spec.label()}: {why}")
            pairs.append((spec, v))
            picks.append((spec, g, tokens, v, us))
    return list(dict.fromkeys(pairs)), picks
