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
import functools
import hashlib
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

from .database import Database, measurement_toolchain
from .picks import CONFIRM_K, commit_picks, read_tuned_file, tuned_path, variant_content
from .spec import LayerSpec
from .variants import DecodeVariant, LayerVariant, can_implement, candidate_space, decode_candidates, parse_variant

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


# A one-launch decode candidate (variants.decode_candidates) is a trial of its bucket's study too,
# enqueued with this one fixed parameter (a one-choice distribution, the same in every study, so it
# never conflicts with another trial's); its variant is the trial's "variant" attribute. Outside
# the sampler's space: the sampler neither proposes it nor learns from it.
DECODE_PARAM = "decode"
DECODE_DISTRIBUTION = CategoricalDistribution((True,))


def params_of(v: LayerVariant | DecodeVariant) -> dict:
    return {DECODE_PARAM: True} if isinstance(v, DecodeVariant) else _flatten(v)


def distributions_of(v: LayerVariant | DecodeVariant, space: dict) -> dict:
    """The distributions of params_of(v)'s parameters in a study of search space `space`."""
    return {DECODE_PARAM: DECODE_DISTRIBUTION} if isinstance(v, DecodeVariant) else space


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


@functools.lru_cache(maxsize=128)
def search_space(spec: LayerSpec) -> dict[str, CategoricalDistribution]:
    """Per parameter, the values that occur in candidate_space (sorted, so every process and
    session builds the same distributions); combinations can_implement refuses are pruned.
    Computed once per spec and process (a second or two); callers must not change it."""
    values: dict[str, set] = {}
    for v in candidate_space(spec):
        for k, x in params_of(v).items():
            values.setdefault(k, set()).add(x)
    if not values:
        raise ValueError(f"no variant can implement {spec.workload_key} on {spec.target}")
    return {k: CategoricalDistribution(sorted(xs, key=lambda x: (str(type(x)), x))) for k, xs in values.items()}


def suggest(trial: optuna.Trial, space: dict[str, CategoricalDistribution]) -> LayerVariant | DecodeVariant:
    """A trial enqueued by `prepare` carries fixed params: suggest returns those and records them.
    One enqueued before a field joined the search space lacks that param; it keeps the field's
    default (what was compiled for it) instead of having the sampler pick a value. A decode
    candidate's trial (DECODE_PARAM) returns the DecodeVariant its "variant" attribute names."""
    fixed = trial.storage.get_trial_system_attrs(trial._trial_id).get("fixed_params")
    if fixed is not None and fixed.get(DECODE_PARAM):
        trial.suggest_categorical(DECODE_PARAM, DECODE_DISTRIBUTION.choices)
        return DecodeVariant.parse(trial.user_attrs["variant"])
    params = {}
    for k, d in space.items():
        if fixed is not None and k not in fixed:
            continue
        if fixed is None and not _option_applies(params, k):
            continue  # a GEMM option its MMA / cluster lacks (cluster, raster_experts): keep the default
        params[k] = trial.suggest_categorical(k, d.choices)
    return variant_of(params)


def _option_applies(params: dict, key: str) -> bool:
    """Whether the sampler should choose `key` given the parameters chosen so far: a GEMM's
    cluster (glu_cluster / down_cluster) exists only for hopws 128-row and umma 256-row tiles, its
    raster_experts only for hopws / hoppp in single CTAs, promote only for GEMM1 on hopws (fp8),
    fast_act only for GEMM1; asked everywhere, they would make most proposals invalid and get them
    pruned. Every other parameter (route_cluster, the routing
    kernel's, too): True."""
    from .gemm_limits import cluster_applies, raster_applies

    role = key.split("_", 1)[0]
    if role not in ("glu", "down"):
        return True
    if key.endswith("_cluster"):
        return cluster_applies(params.get(f"{role}_mma"), params.get("tile_m"))
    if key.endswith("_raster_experts"):
        return raster_applies(params.get(f"{role}_mma"), params.get(f"{role}_cluster", 1))
    if key.endswith("_promote"):  # fp8 GEMM1 on the cooperative core only (check_promote_every)
        return role == "glu" and params.get("glu_mma") == "hopws"
    if key.endswith("_fast_act"):  # GEMM1's activation (check_fast_act)
        return role == "glu"
    return True


# -- studies -----------------------------------------------------------------------------------

def space_key(spec: LayerSpec) -> str:
    """A digest of the layer's search space (every parameter's choices). A study holds one space:
    optuna refuses a parameter whose choices differ from its earlier trials' ("does not support
    dynamic value space"), so a moe-aot whose candidate space changed (a tile, an MMA family, a
    field added or removed) opens new studies beside the old ones. Nothing measured is lost: the
    records, the picks derived from them and the outcomes reused for the same binaries
    (known_outcome) live in the records table, not in the studies."""
    space = search_space(spec)
    text = json.dumps({k: [repr(c) for c in d.choices] for k, d in sorted(space.items())})
    return hashlib.sha256(text.encode()).hexdigest()[:10]


def study_name(spec: LayerSpec, gpu: str, tokens: int) -> str:
    return f"{STUDY_PREFIX}:{spec.workload_key}:{spec.target}:{gpu}:t{tokens}:s{space_key(spec)}"


def parse_study_name(name: str) -> dict | None:
    """The parts of a study's name; "space" is None for a study named before the space key was
    (an older moe-aot's: it is not resumed)."""
    parts = name.split(":")
    space = None
    if len(parts) >= 6 and parts[-1].startswith("s") and parts[-2].startswith("t"):
        space = parts.pop()[1:]
    if len(parts) < 5 or parts[0] != STUDY_PREFIX or not parts[-1].startswith("t") or not parts[-1][1:].isdigit():
        return None
    return {"workload": parts[1], "target": parts[2], "gpu": ":".join(parts[3:-1]),
            "tokens": int(parts[-1][1:]), "space": space}


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
    they were compiled), so running again resumes them instead of losing them. Each is read again
    just before: the list may be older than a live worker's claim of a trial (measure_worker.claim
    names the worker before the trial turns RUNNING)."""
    cutoff = datetime.now() - timedelta(seconds=stale_after_s)

    def stale(t) -> bool:
        return t.state == TrialState.RUNNING and (
            _dead(t.user_attrs.get("worker")) or bool(t.datetime_start and t.datetime_start < cutoff))

    n = 0
    for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
        if stale(t) and stale(study._storage.get_trial(t._trial_id)):
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


def uncompiled_content(variant_name: str, toolchain: str) -> str:
    """The key of a variant that did not compile: its name under that exact toolchain (a fixed
    template makes it a new key)."""
    return hashlib.sha256(f"uncompiled|{toolchain}|{variant_name}".encode()).hexdigest()


def known_outcome(db: Database, spec: LayerSpec, gpu: str, driver: str, toolchain: str, tokens: int,
                  content: str, workload: str | None = None) -> Outcome | None:
    """The recorded outcome of these binaries at this bucket, GPU, driver and toolchain: the
    sampler proposing a point again (or two studies' trials naming one variant, or a template
    refactor that left the cubins alone) costs a lookup, not a second measurement. ``workload``:
    another key than the layer's (its backward's, backward_tune)."""
    r = db.find_record(workload=workload or spec.workload_key, target=spec.target, gpu=gpu, driver=driver,
                       toolchain=toolchain, tokens=tokens, content=content)
    return None if r is None else Outcome(r.status, r.median_us, r.stats, r.rel_err, r.error)


def finish(db: Database, study: optuna.Study, trial: optuna.Trial, spec: LayerSpec, tokens: int,
           variant: LayerVariant, toolchain: str, gpu: str, driver: str, out: Outcome,
           content: str) -> int | None:
    """Record the outcome and tell the study. Binaries already recorded for this bucket, GPU,
    driver and toolchain (the sampler proposing a point again, or two workers measuring it at
    once) keep their first record, and the trial is told that record's outcome. Nothing is
    stored as "best": picks are derived from the records (derive_picks)."""
    name = variant.name(spec)
    stats = {**out.stats, "study": study.study_name, "trial": trial.number, "worker": worker_id()}
    rid, prev = db.add_record_once(workload=spec.workload_key, target=spec.target, toolchain=toolchain,
                                   gpu=gpu, driver=driver, tokens=tokens, variant=name, content=content,
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
        study.tell(trial, out.median_us)
    elif out.status in ("compile_error", "resource_error"):
        study.tell(trial, FAILED_US)
    else:  # a wrong result or a failed launch says nothing about speed
        study.tell(trial, state=TrialState.FAIL)
    return rid


def measure_trial(db: Database, study: optuna.Study, trial: optuna.Trial, spec: LayerSpec, tokens: int,
                  variant: LayerVariant, compiled_toolchain: str, compile_error: str | None,
                  measurer) -> Outcome:
    """Key the trial by the binaries the runtime will load, reuse a record of them or measure,
    then finish(). Returns the outcome told."""
    name = variant.name(spec)
    try:
        content, toolchain = (variant_content(db, spec, variant) if compile_error is None
                              else (uncompiled_content(name, compiled_toolchain), compiled_toolchain))
    except LookupError as exc:
        compile_error = str(exc)
        content, toolchain = uncompiled_content(name, compiled_toolchain), compiled_toolchain
    out = (Outcome("compile_error", error=compile_error) if compile_error else
           known_outcome(db, spec, measurer.gpu, measurer.driver, toolchain, tokens, content))
    if out is None:
        out = measurer(spec, variant, tokens)
        out = dataclasses.replace(out, stats={**out.stats, **device_stats(measurer)})
    finish(db, study, trial, spec, tokens, variant, toolchain, measurer.gpu, measurer.driver, out, content)
    return out


def device_stats(measurer) -> dict:
    """{"device": {"index", "uuid"}} of the GPU that made a measurement, for its record's stats
    (empty for a measurer that does not say). The record's key keeps the GPU model
    (`measurer.gpu`), so the GPUs of one model on a host share one pool of records and each
    candidate is measured once among them; the device only says which of them measured it."""
    info = getattr(measurer, "device_info", None)
    return {"device": dict(info)} if info else {}


def default_recorded(db: Database, spec: LayerSpec, gpu: str, tokens: int, driver: str | None = None) -> bool:
    """Whether the binaries the runtime would load for this bucket's default have a record on
    this GPU (and driver, when known): every tuned pick is compared with that record."""
    from .variants import default_variant

    try:
        content, toolchain = variant_content(db, spec, default_variant(spec, tokens))
    except LookupError:
        return False
    base = measurement_toolchain(toolchain)
    return any(r.content == content and measurement_toolchain(r.toolchain) == base
               and (driver is None or r.driver == driver)
               for r in db.records(spec.workload_key, spec.target, gpu, tokens))


def baseline_trial(study: optuna.Study, spec: LayerSpec, tokens: int) -> tuple[optuna.Trial, LayerVariant]:
    """A RUNNING trial of the bucket's default, outside the study's budget, for a measurer that
    finds the default unmeasured under its key (a new driver or toolchain)."""
    from .variants import default_variant

    v = default_variant(spec, tokens)
    tid = study._storage.create_new_trial(study._study_id)
    study._storage.set_trial_system_attr(tid, "fixed_params", params_of(v))
    trial = optuna.Trial(study, tid)
    for k, val in {"worker": worker_id(), "variant": v.name(spec), "tokens": tokens, "baseline": True}.items():
        trial.set_user_attr(k, val)
    return trial, v


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

MAX_PRUNED_IN_A_ROW = 64


@dataclass
class Slot:
    """One bucket's study in this session."""
    spec: LayerSpec
    tokens: int
    study: optuna.Study
    space: dict
    pending: int = 0  # compiling in `prepare`, not yet a trial in the study
    # Every session first compiles the default (a no-op when its binaries are there) and, when
    # they have no record under this session's key (GPU, driver, toolchain), measures it (or
    # leaves it ready for measuring) before anything else, outside the budget: every pick is
    # compared with the default measured beside it.
    baseline_due: bool = True
    # The default's job was asked but its trial is not created yet (it is, once compiled, unless
    # its binaries were measured already): it counts against the budget meanwhile, so a study
    # with room for it never ends one trial over `trials`.
    baseline_pending: bool = False
    # Variants to try right after the default, before any proposal: the bucket's one-launch decode
    # candidates (variants.decode_candidates), then `seed_variants`'s.
    seeds: list = dataclasses.field(default_factory=list)

    # Proposals can_implement refused in a row; a slot whose sampler keeps proposing only
    # invalid points is given up (MAX_PRUNED_IN_A_ROW) instead of asked forever.
    pruned_in_a_row: int = 0

    def remaining(self, trials: int) -> int:
        """Trials still to ask: pruned proposals (refused before compiling) do not count."""
        if self.pruned_in_a_row >= MAX_PRUNED_IN_A_ROW:
            return 0
        held = sum(t.state != TrialState.PRUNED for t in self.study.get_trials(deepcopy=False))
        return trials - held - self.pending - self.baseline_pending


def open_slots(storage, specs, gpu: str, buckets, seed=None, stale_after_s=STALE_AFTER_S) -> list[Slot]:
    slots = []
    for spec in specs:
        space = search_space(spec)
        for tokens in buckets:
            study = open_study(storage, spec, gpu, tokens, seed)
            requeue_stale(study, stale_after_s)
            slots.append(Slot(spec, tokens, study, space, seeds=decode_candidates(spec, tokens)))
    return slots


def _next_slot(slots: list[Slot], trials: int, turn: list[int]) -> Slot | None:
    for i in range(len(slots)):
        s = slots[(turn[0] + i) % len(slots)]
        if s.baseline_due or s.remaining(trials) > 0:
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
    trial: optuna.Trial | None  # None: the default, a trial only once it needs measuring
    variant: LayerVariant
    compiled: Compiled | None = None


def tune(db_url: str, specs, buckets, measurer, trials: int = 30, timeout_s: float | None = None,
         jobs: int = 2, ahead: int | None = None, compile_fn: Callable = compile_variant,
         seed: int | None = None, progress: Callable[[str], None] = line,
         stale_after_s: float = STALE_AFTER_S, confirm: int = CONFIRM_K) -> None:
    """Tune every (spec, bucket) until its study holds `trials` trials or `timeout_s` passes
    (then nothing new is asked; what is in flight finishes), then give each bucket a
    confirmation round of up to `confirm` candidates where one is due (unless `timeout_s` has
    passed). After each bucket's default, its one-launch decode candidates
    (variants.decode_candidates) come first. `measurer(spec, variant, tokens)` returns an Outcome and carries `.gpu` and
    `.driver`."""
    if confirm < 0:
        raise ValueError(f"confirm must be 0 (no confirmation rounds) or a number of candidates, not {confirm}")
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
                baseline = job.trial is None
                if baseline:
                    job.slot.baseline_pending = False
                    if job.compiled.error is None and default_recorded(
                            db, job.slot.spec, measurer.gpu, job.slot.tokens, measurer.driver):
                        continue
                    job.trial, _ = baseline_trial(job.slot.study, job.slot.spec, job.slot.tokens)
                job.trial.set_user_attr("toolchain", job.compiled.toolchain)
                job.trial.set_user_attr("ready", True)
                if baseline:  # the default is measured before anything else of its session
                    ready.appendleft(job)
                else:
                    ready.append(job)
            if ready:
                job = ready[0]
                c = job.compiled
                out = measure_trial(db, job.slot.study, job.trial, job.slot.spec, job.slot.tokens,
                                    job.variant, c.toolchain, c.error, measurer)
                ready.popleft()
                done += 1
                progress(_progress_line(db, job, out, measurer, done))
    except BaseException:
        # Hand unfinished trials back (WAITING) so the next run resumes them at once.
        pool.close(cancel=True)
        for job in list(compiling.values()) + list(ready):
            if job.trial is None:
                continue
            try:
                storage.set_trial_state_values(job.trial._trial_id, TrialState.WAITING)
            except Exception:
                pass
        raise
    else:
        if confirm and time.monotonic() < deadline:
            from .measure_worker import confirm_round

            for slot in slots:
                confirm_round(db, slot.spec, slot.tokens, measurer, confirm, progress=progress)
        elif confirm:
            progress("[confirm] --timeout spent: no confirmation rounds; `moe-aot measure` runs the rounds "
                     "that are due")
        commit_picks(db, measurer.gpu, specs)
    finally:
        pool.close()
        db.close()


def _ask(slot: Slot) -> _Job | None:
    if slot.baseline_due:
        from .variants import default_variant

        slot.baseline_due = False
        slot.baseline_pending = True
        return _Job(slot, None, default_variant(slot.spec, slot.tokens))
    while slot.seeds:  # the seeds first, each as an enqueued trial that ask() hands out next
        v = slot.seeds.pop(0)
        name = v.name(slot.spec)
        if name not in _seen(slot):
            slot.study.enqueue_trial(params_of(v), user_attrs={"variant": name, "tokens": slot.tokens},
                                     skip_if_exists=False)
            break
    trial = slot.study.ask()
    trial.set_user_attr("worker", worker_id())
    variant = suggest(trial, slot.space)
    ok, why = can_implement(slot.spec, variant)
    if not ok:
        _prune(trial, slot.study, why)
        slot.pruned_in_a_row += 1
        return None
    slot.pruned_in_a_row = 0
    trial.set_user_attr("variant", variant.name(slot.spec))
    trial.set_user_attr("tokens", slot.tokens)
    return _Job(slot, trial, variant)


def _progress_line(db, job: _Job, out: Outcome, measurer, done: int) -> str:
    best = next(iter(db.top_k(job.slot.spec.workload_key, job.slot.spec.target, measurer.gpu,
                              job.slot.tokens, driver=measurer.driver)), None)
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
            and "variant" in t.user_attrs and t.value is not None and t.value < FAILED_US
            and DECODE_PARAM not in t.params]  # a decode kernel has no tiles to step from
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


def seed_variants(tuned_dir: Path | None, gpu: str, specs, buckets,
                  extra: tuple[LayerVariant, ...] = ()) -> dict[tuple[str, int], list[LayerVariant]]:
    """Per (workload, bucket), in this order: the committed pick for `gpu` in `tuned_dir`, the
    `extra` variants (`tune --try`), the 64-row ping-pong twins (LayerVariant.pingpong_twin) of
    the pick and of the default, the pick's and the default's twins with programmatic dependent
    launch flipped, their twins with h scaled per 128 columns (fp8, LayerVariant.h_block_twin), then
    the 2-CTA-cluster twins (LayerVariant.cluster_twins) of the pick, or of the default where there
    is none, and the pick's and the default's twins with raster groups cut at expert boundaries
    (LayerVariant.raster_twin), then fp8 GEMM1 promoted once per 2 k-tiles (LayerVariant.promote_twin)
    in the pick, the default and the pick's cluster twins, and GEMM1's activation on rcp.approx
    (LayerVariant.fast_act_twin) in the pick, the default and their promoted twins, and GEMM1's
    ring three stages deep (LayerVariant.shallow_twin) in the pick and the default. After a
    template change these are what a new default must be measured against first (the newest
    family first: a small --trials measures the pick and its ping-pong twins). Without
    `tuned_dir`, only the `extra` variants."""
    from .variants import default_variant

    path = tuned_path(tuned_dir, gpu) if tuned_dir is not None else None
    rows = read_tuned_file(path) if path and path.exists() else []
    picks = {(r["workload"], r["tokens"]): r["variant"] for r in rows}
    out = {}
    for spec in specs:
        for tokens in buckets:
            base = default_variant(spec, tokens)
            seeds = list(extra)
            if tuned_dir is not None:
                name = picks.get((spec.workload_key, tokens))
                pick = parse_variant(name) if name else None
                four = pick if isinstance(pick, LayerVariant) else None  # a decode pick has no twins
                seeds = [pick, *extra] + [v.pingpong_twin(spec) for v in (four or base, base)]
                seeds += [four and four.pdl_twin(), base.pdl_twin()]
                seeds += [four and four.h_block_twin(spec), base.h_block_twin(spec)] + (four or base).cluster_twins()
                seeds += [four and four.raster_twin(spec), base.raster_twin(spec)]
                # fp8 GEMM1 promoted once per 2 k-tiles: of the pick, the default and the pick's 2-CTA twins
                promoted = [v and v.promote_twin(spec) for v in (four, base, *(four or base).cluster_twins())]
                seeds += promoted
                # GEMM1's activation on rcp.approx: of the pick, the default and their promoted twins
                seeds += [v and v.fast_act_twin(spec) for v in (four, base, *promoted[:2])]
                # GEMM1's ring three stages deep: of the pick and the default
                seeds += [four and four.shallow_twin(spec), base.shallow_twin(spec)]
            out[(spec.workload_key, tokens)] = [v for v in dict.fromkeys(seeds)
                                               if v is not None and v != base and can_implement(spec, v)[0]]
    return out


def prepare(db_url: str, specs, buckets, gpu: str, trials: int = 30, timeout_s: float | None = None,
            jobs: int = 2, compile_fn: Callable = compile_variant, seed: int | None = None,
            progress: Callable[[str], None] = line, seeds: dict | None = None) -> int:
    """Compile candidates for `gpu`'s studies and enqueue them as ready WAITING trials, until each
    study holds `trials` trials: the default first, then the bucket's one-launch decode candidates
    (variants.decode_candidates: at the 1-token bucket), then `seeds` of the bucket (see
    `seed_variants`), then proposals. A compile failure becomes a finished trial and a record
    here. Returns the number of trials added."""
    db = Database(db_url)
    storage = open_storage(db_url)
    slots = open_slots(storage, specs, gpu, buckets, seed)
    for slot in slots:
        # the decode candidates first (at the 1-token bucket only), then `seeds`
        slot.seeds += list((seeds or {}).get((slot.spec.workload_key, slot.tokens), ()))
    rng = random.Random(seed)
    deadline = time.monotonic() + timeout_s if timeout_s else math.inf
    pool = CompilePool(jobs, compile_fn)
    compiling: dict[Future, tuple[Slot, LayerVariant, bool]] = {}
    turn, added = [0], 0
    try:
        while True:
            while len(compiling) < max(1, jobs) and time.monotonic() < deadline:
                slot = _next_slot(slots, trials, turn)
                if slot is None:
                    break
                exclude = _seen(slot) | {v.name(s.spec) for s, v, _ in compiling.values() if s is slot}
                baseline = slot.baseline_due
                if baseline:
                    from .variants import default_variant

                    slot.baseline_due = False
                    variant = default_variant(slot.spec, slot.tokens)
                else:
                    variant = None
                    while slot.seeds and variant is None:
                        v = slot.seeds.pop(0)
                        variant = v if v.name(slot.spec) not in exclude else None
                    variant = variant or propose(slot, exclude, rng)
                if variant is None:  # the whole space is tried
                    slot.pending = trials
                    continue
                slot.pending += 1
                compiling[pool.submit(db_url, slot.spec, variant)] = (slot, variant, baseline)
            if not compiling:
                break
            for fut in wait(compiling, return_when=FIRST_COMPLETED)[0]:
                slot, variant, baseline = compiling.pop(fut)
                c = fut.result()
                slot.pending -= 1
                if baseline and c.error is None and default_recorded(db, slot.spec, gpu, slot.tokens):
                    continue  # these binaries of the default were measured on this GPU already
                _enqueue(db, slot, variant, c, gpu)
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
                                variant=name, content=uncompiled_content(name, c.toolchain),
                                status="compile_error", median_us=None, rel_err=None,
                                stats={"study": slot.study.study_name, "compile_s": round(c.seconds, 3)},
                                error=c.error)
    slot.study.add_trial(create_trial(
        value=FAILED_US, params=params_of(variant), distributions=distributions_of(variant, slot.space),
        user_attrs={**attrs, "status": "compile_error", "record": rid, "error": c.error[:500]}))
