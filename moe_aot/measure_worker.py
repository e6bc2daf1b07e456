"""The measuring half of the tuner: on a GPU machine, claim compiled ("ready") trials from the
studies in the database, measure them the way the benchmark does, record and tell.

Imports optuna, the runtime and the tuner's study plumbing, never cutlass or the compiler (a test
asserts it): it runs where only torch and the kernel database are. Several workers may measure
the same studies at once; each WAITING trial is claimed by exactly one of them through optuna's
WAITING -> RUNNING transition (row-locked on PostgreSQL, BEGIN IMMEDIATE on SQLite).

Once a study has no ready trial left, its bucket gets a confirmation round (confirm_round): the
best few candidates and the default measured again, interleaved, each measurement a record.
"""
from __future__ import annotations

import math
import re
import time
import uuid
from pathlib import Path
from typing import Callable

import optuna
from optuna.trial import TrialState

from .database import SUSTAINED_WARMUP_S, Database, timing_context
from .picks import (
    CONFIRM_K,
    CONFIRM_WITHIN,
    choose_pick,
    commit_picks,
    complete_rounds,
    confirm_plan,
    current_contents,
    live_records,
    round_medians,
    variant_content,
)
from .spec import LayerSpec
from .tuner import (
    Outcome,
    baseline_trial,
    default_recorded,
    device_stats,
    line,
    measure_trial,
    open_storage,
    parse_study_name,
    requeue_stale,
    search_space,
    space_key,
    study_name,
    study_spec,
    suggest,
    worker_id,
)
from .variants import BACKWARD_SUFFIX, BackwardVariant, LayerVariant, parse_variant, workload_for

# The first line of /proc/driver/nvidia/version, by kernel module flavour:
#   NVRM version: NVIDIA UNIX x86_64 Kernel Module  570.86.15  Fri Jan 24 18:39:31 UTC 2025
#   NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  580.95.05  Release Build  (dvs-builder@...)  Tue ...
# The open one has "for <arch>" after "Kernel Module", which a parser taking the next word read as
# the version ("for"); the version is the first dotted number after "Kernel Module".
# cudaError_t values that mean the launch asked for more than the GPU has (a typed resource
# failure: "infinitely slow" to the tuner); any other launch error is recorded as launch_error
RESOURCE_CUDA_ERRORS = {2: "cudaErrorMemoryAllocation", 701: "cudaErrorLaunchOutOfResources"}
_NVRM = re.compile(r"^NVRM version:.*?Kernel Module\b.*?\s(\d+\.\d+(?:\.\d+)*)(?=\s|$)", re.MULTILINE)


def parse_driver_version(text: str) -> str | None:
    """The kernel driver version in the text of /proc/driver/nvidia/version, or None."""
    m = _NVRM.search(text)
    return m[1] if m else None


def driver_version(proc_file: str = "/proc/driver/nvidia/version") -> str:
    """The NVIDIA kernel driver and the CUDA version it supports, e.g. '570.86.15 (CUDA 12.8)'.
    Part of every measurement's key, so an unreadable driver version says "unknown" rather than
    passing for another driver's."""
    try:
        version = parse_driver_version(Path(proc_file).read_text())
    except OSError:
        version = None
    parts = [version or "unknown"]
    try:
        from .runtime.store import driver_cuda_version

        major, minor = driver_cuda_version()
        parts.append(f"(CUDA {major}.{minor})")
    except (OSError, RuntimeError):
        pass
    return " ".join(parts)


class GpuMeasurer:
    """measure_variant on the current GPU: correctness check against the fp32 reference, then
    CUDA-graph replays over several input sets, median. Failures come back typed as Outcomes.

    warmup_s: the candidate's graphs are replayed untimed for about that long before the timed
    replays, so that each is timed at the clock the GPU sustains under it (the H200 under a large
    layer runs at its power cap, 0.9-1.5 GHz, where short bursts run at up to 1.98 GHz: NOTES,
    2026-12-03, call 7); 0 is the burst timing of the records before 2026-12-03. Each record
    carries the SM clock, power and throttle reasons sampled during its timed replays."""

    def __init__(self, db_url: str | None, replays: int = 100, device: int | None = None,
                 index: int | None = None, warmup_s: float = SUSTAINED_WARMUP_S):
        import torch

        from .harness.gpustate import Nvml, gpu_uuid
        from .runtime.store import KernelStore

        if not torch.cuda.is_available():
            raise RuntimeError("measuring needs a CUDA GPU; none is visible here")
        self.device = torch.device("cuda", torch.cuda.current_device() if device is None else device)
        torch.cuda.set_device(self.device)  # CUDA graphs and the runtime's streams on this GPU
        self.gpu = torch.cuda.get_device_name(self.device)
        self.warmup_s = warmup_s
        self.driver = timing_context(driver_version(), warmup_s)
        # Which GPU of the host measured (tuner.device_stats): `index` is the host's numbering where
        # a --devices worker sees its GPU as cuda:0 through CUDA_VISIBLE_DEVICES.
        uuid = gpu_uuid(self.device)
        self.device_info = {"index": self.device.index if index is None else index, "uuid": uuid}
        self.store = KernelStore(db_url)
        self.replays = replays
        self.nvml = Nvml.open(uuid=uuid)
        self._weights: tuple[LayerSpec, tuple] | None = None

    def weights(self, spec: LayerSpec):
        from .harness.verify import random_weights

        if self._weights is None or self._weights[0] != spec:
            self._weights = None  # free the previous layer's weights before allocating
            self._weights = (spec, random_weights(spec, self.device))
        return self._weights[1]

    def __call__(self, spec: LayerSpec, variant: LayerVariant, tokens: int) -> Outcome:
        import torch

        from .harness.measure import measure_variant
        from .runtime.layer import MoeLayer
        from .runtime.library import KernelLaunchError
        from .runtime.store import KernelMissingError

        w13, w2 = self.weights(spec)
        try:
            if isinstance(variant, BackwardVariant):  # the fused backward (`moe-aot tune --backward`)
                from .harness.backward import measure_backward

                r = measure_backward(spec, variant, tokens, w13, w2, self.store, self.device, self.replays,
                                     warmup_s=self.warmup_s, nvml=self.nvml)
                if not r["ok"]:
                    worst = max(r["errors"], key=lambda k: r["errors"][k])
                    return Outcome("wrong_result", rel_err=r["errors"][worst],
                                   error=f"relative error of {worst} {r['errors'][worst]:.3g}")
                r["rel_err"] = max(r["errors"].values())
            else:
                layer = MoeLayer(spec, self.store, device=self.device, variants={tokens: variant})
                r = measure_variant(layer, None, tokens, w13, w2, replays=self.replays, warmup_s=self.warmup_s,
                                    nvml=self.nvml)
        except KernelMissingError as exc:
            return Outcome("compile_error", error=str(exc))
        except torch.cuda.OutOfMemoryError as exc:
            return Outcome("resource_error", error=str(exc))
        except KernelLaunchError as exc:
            status = "resource_error" if exc.code in RESOURCE_CUDA_ERRORS else "launch_error"
            torch.cuda.synchronize()  # a sticky error ends the worker here rather than later
            return Outcome(status, error=str(exc))
        if not r["ok"]:
            return Outcome("wrong_result", rel_err=r["rel_err"], error=f"relative error {r['rel_err']:.3g}")
        stats = {k: v for k, v in r.items() if k not in ("ok", "rel_err")}
        return Outcome("ok", median_us=r["median_us"], stats=stats, rel_err=r["rel_err"])


def find_studies(storage, gpu: str, workloads=None, target: str | None = None,
                 buckets=None) -> list[optuna.Study]:
    names = optuna.get_all_study_names(storage)
    parsed = {n: p for n in names if (p := parse_study_name(n))}
    wanted = [n for n, p in parsed.items() if (workloads is None or p["workload"] in workloads)
              and (target is None or p["target"] == target) and (buckets is None or p["tokens"] in buckets)]
    mine = [n for n in wanted if parsed[n]["gpu"] == gpu]
    if not mine:
        others = sorted({parsed[n]["gpu"] for n in wanted})
        hint = (f"it has studies for {', '.join(others)}; prepare them for this GPU with "
                f"`moe-aot tune --compile-only --gpu \"{gpu}\" ...`" if others else
                f"prepare some with `moe-aot tune --compile-only --gpu \"{gpu}\" ...`")
        raise LookupError(f"no tuning studies for {gpu} in the database; {hint}")
    studies = [optuna.load_study(study_name=n, storage=storage) for n in sorted(mine)]
    # a study of another search space (an older moe-aot's) is not resumed: its trials name
    # parameters this one cannot suggest (tuner.space_key); its records still count
    current = [s for s in studies if parsed[s.study_name]["space"] == space_key(study_spec(s))]
    if not current:
        raise LookupError(f"the database's tuning studies for {gpu} were prepared over another search space (an "
                          "older moe-aot's candidate tiles); prepare them again with `moe-aot tune --compile-only "
                          f"--gpu \"{gpu}\" ...` (the records measured so far still count)")
    return current


def _hold_sigint():
    """Defer SIGINT (this thread's signal mask) across a WAITING -> RUNNING claim, so that a Ctrl-C
    cannot land between the claim and the code that hands an interrupted trial back; None where
    the mask cannot be set (not the main thread, no pthread_sigmask)."""
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread() or not hasattr(signal, "pthread_sigmask"):
        return None
    return signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})


def _release_sigint(held) -> None:
    """Restore the mask `_hold_sigint` changed; a SIGINT that came meanwhile is raised now."""
    if held is not None:
        import signal

        signal.pthread_sigmask(signal.SIG_SETMASK, held)


def _hand_back(storage, trial_id: int, tries: int = 50) -> None:
    """RUNNING -> WAITING for a trial this worker could not finish. Retried: beside other workers'
    writes the database can be locked for a moment, and a trial left RUNNING would wait for the
    stale-trial timeout instead of the next run."""
    for _ in range(tries):
        try:
            storage.set_trial_state_values(trial_id, TrialState.WAITING)
            return
        except optuna.exceptions.UpdateFinishedTrialError:
            return  # finished after all
        except Exception:
            time.sleep(0.1)


def claim(study: optuna.Study) -> tuple[optuna.Trial, dict] | None:
    """The first ready WAITING trial this worker manages to switch to RUNNING.

    The trial names this worker before it turns RUNNING: a handed-back trial still names the
    (dead) worker of an earlier run, and another worker starting meanwhile (requeue_stale) would
    otherwise see it RUNNING under a dead worker and put it back to WAITING, so that two workers
    measured it. A worker that loses the claim leaves its name on a trial another one runs; the
    winner writes its own again at once."""
    for t in study.get_trials(deepcopy=False, states=(TrialState.WAITING,)):
        if not t.user_attrs.get("ready"):
            continue  # handed back uncompiled by a killed `tune`: a compiling worker takes it
        try:
            study._storage.set_trial_user_attr(t._trial_id, "worker", worker_id())
            if study._storage.set_trial_state_values(t._trial_id, TrialState.RUNNING):
                trial = optuna.Trial(study, t._trial_id)
                trial.set_user_attr("worker", worker_id())
                return trial, t.user_attrs
        except optuna.exceptions.UpdateFinishedTrialError:
            continue
    return None


def _has_ready(study: optuna.Study) -> bool:
    return any(t.user_attrs.get("ready") for t in study.get_trials(deepcopy=False, states=(TrialState.WAITING,)))


def measure(db_url: str, measurer, workloads=None, target: str | None = None, buckets=None,
            max_trials: int | None = None, timeout_s: float | None = None, wait_s: float = 0.0,
            progress: Callable[[str], None] = line, poll_s: float = 2.0, confirm: int = CONFIRM_K,
            claim_once: Callable[[str], bool] | None = None, commit: bool = True) -> int:
    """Measure ready trials of `measurer.gpu`'s studies until none is left (or, with wait_s, none
    arrived for that long: a compiling side may still be adding some), `max_trials` were measured
    or `timeout_s` passed. A study with no ready trial left gets a confirmation round of up to
    `confirm` candidates when one is due (confirm_round; not after `timeout_s`, and not counted in
    `max_trials`). Returns how many trials this worker measured.

    claim_once(key) -> bool, for workers started together (measure_devices): a default's
    measurement and a confirmation round are work outside the trials' WAITING -> RUNNING claims,
    so the workers claim them by key through it, and a round waits until its study is settled
    (no trial ready or running anywhere), so it sees every candidate's record. commit=False
    leaves deriving the picks to the caller (concurrent first inserts of one pick would collide)."""
    if confirm < 0:
        raise ValueError(f"confirm must be 0 (no confirmation rounds) or a number of candidates, not {confirm}")
    db = Database(db_url)
    storage = open_storage(db_url)
    deadline = time.monotonic() + timeout_s if timeout_s else math.inf
    studies = find_studies(storage, measurer.gpu, workloads, target, buckets)
    for study in studies:
        requeue_stale(study)  # trials a killed measurer held
    specs: dict[str, tuple[LayerSpec, dict, int]] = {}

    def study_of(study):
        if study.study_name not in specs:
            spec = study_spec(study)
            specs[study.study_name] = (spec, search_space(spec), parse_study_name(study.study_name)["tokens"])
        return specs[study.study_name]

    done, idle_since = 0, time.monotonic()
    checked: set[str] = set()
    confirmed: set[str] = set()  # studies whose round was considered since their last trial here

    def confirm_drained(study):
        if confirm and time.monotonic() < deadline:
            if claim_once is not None:
                trials = study.get_trials(deepcopy=False)
                if any(t.state == TrialState.RUNNING or (t.state == TrialState.WAITING and t.user_attrs.get("ready"))
                       for t in trials):
                    return  # not settled: whoever finishes its last trial considers the round
                confirmed.add(study.study_name)
                if not claim_once(f"confirm|{study.study_name}|{sum(t.state.is_finished() for t in trials)}"):
                    return
            spec, _, tokens = study_of(study)
            confirm_round(db, spec, tokens, measurer, confirm, progress=progress)
            confirmed.add(study.study_name)

    try:
        while (max_trials is None or done < max_trials) and time.monotonic() < deadline:
            for study in studies:
                if study.study_name not in checked:
                    checked.add(study.study_name)
                    spec, _, tokens = study_of(study)
                    _measure_default(db, study, spec, tokens, measurer, progress, claim_once)
            held = _hold_sigint()  # a Ctrl-C while claiming waits until the claim can be handed back
            try:
                got = next(((s, c) for s in studies if (c := claim(s))), None)
            except BaseException:
                _release_sigint(held)
                raise
            if got is None:
                _release_sigint(held)
                for s in studies:
                    if s.study_name not in confirmed:
                        confirm_drained(s)
                if time.monotonic() - idle_since >= wait_s:
                    break
                time.sleep(poll_s)
                studies = find_studies(storage, measurer.gpu, workloads, target, buckets)
                continue
            study, (trial, attrs) = got
            try:
                _release_sigint(held)  # a Ctrl-C that came while claiming is raised here, inside the hand-back
                spec, space, tokens = study_of(study)
                variant = suggest(trial, space)
                out = measure_trial(db, study, trial, spec, tokens, variant, attrs["toolchain"], None, measurer)
            except (optuna.exceptions.UpdateFinishedTrialError, ValueError):
                if not storage.get_trial(trial._trial_id).state.is_finished():
                    _hand_back(storage, trial._trial_id)
                    raise
                # Another worker finished it meanwhile (a trial of another host taken back after
                # STALE_AFTER_S while its worker was still measuring): the first record stands.
                progress(f"[{done}] {study.study_name} trial {trial.number}: finished by another worker meanwhile; "
                         "its record stands")
                continue
            except BaseException:
                _hand_back(storage, trial._trial_id)  # so that another worker (or the next run) measures it
                raise
            done += 1
            idle_since = time.monotonic()
            progress(_line(db, spec, tokens, trial, out, variant, measurer, f"[{done}]"))
            confirmed.discard(study.study_name)
            if not _has_ready(study):
                confirm_drained(study)
        if confirm and time.monotonic() >= deadline and len(confirmed) < len(studies):
            progress("[confirm] --timeout spent: no confirmation round for the buckets not yet considered; "
                     "`moe-aot measure` runs the rounds that are due")
        if commit:
            commit_picks(db, measurer.gpu)
    finally:
        db.close()
    return done


def _line(db, spec, tokens, trial, out, variant, measurer, tag) -> str:
    best = next(iter(db.top_k(spec.workload_key, spec.target, measurer.gpu, tokens, driver=measurer.driver)), None)
    took = f"{out.median_us:9.1f}us" if out.median_us else f"{'-':>11}"
    return (f"{tag} {spec.label()} tokens={tokens:<6} trial {trial.number:<4} {out.status:14} {took}"
            f"  best {best.median_us if best else float('nan'):9.1f}us  {variant.name(spec)}")


def _measure_default(db: Database, study: optuna.Study, spec: LayerSpec, tokens: int, measurer,
                     progress, claim_once: Callable[[str], bool] | None = None) -> None:
    """Measure the bucket's default first when its binaries have no record under this GPU and
    driver and no ready trial of it is waiting (a new driver, or candidates compiled under a new
    toolchain): every pick is compared with the default measured beside it."""
    from .variants import default_variant

    if default_recorded(db, spec, measurer.gpu, tokens, measurer.driver):
        return
    name = default_variant(spec, tokens).name(spec)
    if any(t.user_attrs.get("variant") == name and t.user_attrs.get("ready")
           for t in study.get_trials(deepcopy=False, states=(TrialState.WAITING,))):
        return
    try:
        variant_content(db, spec, default_variant(spec, tokens))
    except LookupError as exc:
        progress(f"[default] {spec.label()} tokens={tokens}: not measured, {exc} "
                 "(`moe-aot tune --compile-only` compiles it)")
        return
    if claim_once is not None and not claim_once(f"default|{study.study_name}"):
        return  # another worker of this run measures it
    trial, variant = baseline_trial(study, spec, tokens)
    try:
        out = measure_trial(db, study, trial, spec, tokens, variant, "-", None, measurer)
    except BaseException:
        study._storage.set_trial_state_values(trial._trial_id, TrialState.FAIL)
        raise
    progress(_line(db, spec, tokens, trial, out, variant, measurer, "[default]"))


def confirm_round(db: Database, spec: LayerSpec, tokens: int, measurer, k: int = CONFIRM_K,
                  within: float = CONFIRM_WITHIN, progress: Callable[[str], None] = line,
                  backward: bool = False) -> bool:
    """Measure the bucket's best few candidates (picks.confirm_plan) and its default again, each
    twice, in mirrored order (A B C D D C B A, so a drift during the round weighs on each of them
    alike), recording every measurement as it comes (one that raises leaves those before it in
    the database; an incomplete round does not count in the picks). Runs only when a round is
    due (some candidate has not been in one) and the bucket's context is this measurer's GPU and
    driver. ``backward``: the bucket of the layer's backward (workload backward_workload(spec)).
    Returns whether a round ran."""
    from .picks import bucket_default

    if k <= 0:
        return False
    workload = workload_for(spec, backward)
    recs = db.records(workload, spec.target, measurer.gpu, tokens)
    current = current_contents(db, spec)
    dname = bucket_default(spec, tokens, backward).name(spec)
    plan = confirm_plan(live_records(db, spec, recs, current), dname, current(dname), k, within,
                        complete_rounds(recs))
    if plan is None or not plan.due or plan.default.driver != measurer.driver:
        return False
    members = plan.candidates + [plan.default]
    order = members + members[::-1]
    rid = uuid.uuid4().hex
    for i, r in enumerate(order):
        out = measurer(spec, parse_variant(r.variant), tokens)
        stats = {**out.stats, **device_stats(measurer),
                 "study": study_name(spec, measurer.gpu, tokens) + (BACKWARD_SUFFIX if backward else ""),
                 "worker": worker_id(),
                 "confirm": {"round": rid, "position": i, "size": len(order), "record": r.id}}
        db.add_record(workload=workload, target=spec.target, toolchain=r.toolchain, gpu=measurer.gpu,
                      driver=measurer.driver, tokens=tokens, variant=r.variant, content=r.content,
                      status=out.status, median_us=out.median_us, stats=stats, rel_err=out.rel_err,
                      error=out.error)
    recs = db.records(workload, spec.target, measurer.gpu, tokens)
    live, done = live_records(db, spec, recs, current), complete_rounds(recs)
    medians = round_medians(live, dname, current(dname), done)
    pick = choose_pick(live, dname, current(dname), done)

    def us(name):
        return "failed" if medians.get(name) is None else f"{medians[name]:.1f}us"

    shown = ", ".join(f"{r.variant} {us(r.variant)}" for r in plan.candidates)
    chosen = "-" if pick is None else "the default" if pick[0].variant == plan.default.variant else pick[0].variant
    progress(f"[confirm] {spec.label()} tokens={tokens:<6} medians: {shown}, default {us(plan.default.variant)}; "
             f"pick {chosen}")
    return True


# -- several GPUs of one host: one measuring worker per GPU, one database ------------------------

def parse_devices(text: str, visible: int) -> tuple[int, ...]:
    """`--devices`: "all" (every visible GPU) or comma-separated indices of visible GPUs (as torch
    numbers them, i.e. within CUDA_VISIBLE_DEVICES when that is set). Raises ValueError with
    the sentence to show."""
    text = (text or "").strip()
    if text == "all":
        if visible < 1:
            raise ValueError("--devices all: no CUDA GPU is visible here")
        return tuple(range(visible))
    try:
        devices = [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise ValueError(f"--devices must be 'all' or comma-separated GPU indices such as 0,1, got {text!r}") from None
    if not devices:
        raise ValueError(f"--devices must be 'all' or comma-separated GPU indices such as 0,1, got {text!r}")
    twice = sorted({d for d in devices if devices.count(d) > 1})
    if twice:
        raise ValueError(f"--devices names GPU {twice[0]} twice; one worker per GPU")
    bad = [d for d in devices if not 0 <= d < visible]
    if bad:
        have = f"GPUs 0-{visible - 1}" if visible > 1 else "GPU 0" if visible else "no GPU"
        raise ValueError(f"--devices {text}: there is no GPU {bad[0]}; this machine has {have}")
    return tuple(devices)


def child_visible_devices(device: int, environ=None) -> str:
    """CUDA_VISIBLE_DEVICES for the worker of `device`: its entry of the parent's list (indices
    or GPU-UUIDs) when the parent has one, else the index itself."""
    import os

    parent = (os.environ if environ is None else environ).get("CUDA_VISIBLE_DEVICES", "")
    entries = [e.strip() for e in parent.split(",") if e.strip()]
    return entries[device] if entries else str(device)


def gpu_measurer_on(db_url: str, replays: int, device: int, warmup_s: float = SUSTAINED_WARMUP_S) -> GpuMeasurer:
    """The measurer of a --devices worker: its GPU is the only one it sees (cuda:0); records
    carry the host's index `device`."""
    return GpuMeasurer(db_url, replays=replays, device=0, index=device, warmup_s=warmup_s)


class ClaimDir:
    """claim_once for workers started together: the first to create a key's file wins
    (O_CREAT | O_EXCL is atomic on a local file system). The folder lives as long as one
    `measure_devices` run, so a later run considers the defaults and rounds again."""

    def __init__(self, path):
        self.path = Path(path)

    def __call__(self, key: str) -> bool:
        import hashlib
        import os

        name = self.path / hashlib.sha256(key.encode()).hexdigest()[:32]
        try:
            os.close(os.open(name, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        except FileExistsError:
            return False
        return True


def _interrupt_once(signum, frame):
    """A worker's SIGINT: the terminal's Ctrl-C and the parent's forwarded one both arrive; the
    first raises KeyboardInterrupt, the second must not cut short handing the trial back."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    raise KeyboardInterrupt


def _device_worker(device: int, db_url: str, make_measurer, kwargs: dict, claims: str, events) -> None:
    import signal

    if signal.getsignal(signal.SIGINT) is not signal.SIG_IGN:  # started with SIGINT ignored (nohup, &): keep it so
        signal.signal(signal.SIGINT, _interrupt_once)
    tag = f"[gpu {device}]"
    try:
        measurer = make_measurer(device)
        events.put(("gpu", device, measurer.gpu))
        try:
            n = measure(db_url, measurer, progress=lambda s: line(f"{tag} {s}"), claim_once=ClaimDir(claims),
                        commit=False, **kwargs)
        except LookupError as exc:  # no studies for this GPU's model; others may have some
            events.put(("none", device, str(exc)))
            return
        events.put(("done", device, n))
    except KeyboardInterrupt:
        events.put(("interrupted", device, None))
    except BaseException as exc:
        events.put(("error", device, f"{type(exc).__name__}: {exc}"))
        raise


def measure_devices(db_url: str, devices, make_measurer: Callable, workloads=None, target: str | None = None,
                    buckets=None, max_trials: int | None = None, timeout_s: float | None = None,
                    wait_s: float = 0.0, confirm: int = CONFIRM_K, progress: Callable[[str], None] = line,
                    poll_s: float = 2.0, join_s: float = 60.0) -> dict[int, int]:
    """One measuring worker per GPU of this host, all on one database and its studies; returns
    the trials each device measured.

    Each worker is a spawned process whose only GPU is its device (CUDA_VISIBLE_DEVICES set
    before it starts, so nothing in it can touch another GPU) running `measure` with
    `make_measurer(device)` (picklable: gpu_measurer_on in the CLI, a CPU stand-in in the
    tests). Trials are claimed through optuna's WAITING -> RUNNING transition, one worker each;
    defaults and confirmation rounds, which are no trials of the budget, through a claim folder
    of this run (ClaimDir). --trials (`max_trials`) is per worker. Lines are prefixed
    `[gpu N]`. The picks are derived once, here, after every worker has ended, from the records;
    so also after Ctrl-C (SIGINT reaches the workers from the terminal or forwarded from here:
    each hands back the trial it was measuring and stops, keeping every finished measurement),
    after which KeyboardInterrupt is raised again.

    Database: PostgreSQL (tools/pg_local.sh starts Debian's on the GPU host) is the intended
    one. A SQLite file on a local disk is safe too: every write transaction there takes the
    lock up front (BEGIN IMMEDIATE; optuna's storage likewise, tuner.open_storage), so a claim
    cannot be won twice, and writes are milliseconds against seconds of measuring. A SQLite
    file on a network file system is not (its locks are not reliable), which cannot be
    detected here."""
    import multiprocessing
    import os
    import queue
    import signal
    import tempfile

    devices = list(devices)
    if not devices:
        raise ValueError("measure_devices needs at least one device")
    kwargs = dict(workloads=workloads, target=target, buckets=buckets, max_trials=max_trials,
                  timeout_s=timeout_s, wait_s=wait_s, confirm=confirm, poll_s=poll_s)
    Database(db_url).close()
    open_storage(db_url)  # optuna's tables exist before the workers race to create them
    ctx = multiprocessing.get_context("spawn")
    events = ctx.Queue()
    counts: dict[int, int] = {}
    gpus: set[str] = set()
    none: dict[int, str] = {}
    errors: dict[int, str] = {}
    interrupted = False
    with tempfile.TemporaryDirectory(prefix="moe_aot_claims_") as claims:
        procs = {}
        saved = os.environ.get("CUDA_VISIBLE_DEVICES")
        try:
            for d in devices:
                os.environ["CUDA_VISIBLE_DEVICES"] = child_visible_devices(d, {"CUDA_VISIBLE_DEVICES": saved or ""})
                p = ctx.Process(target=_device_worker, args=(d, db_url, make_measurer, kwargs, claims, events),
                                name=f"moe-aot-measure-gpu{d}")
                p.start()
                procs[d] = p
        finally:
            if saved is None:
                os.environ.pop("CUDA_VISIBLE_DEVICES", None)
            else:
                os.environ["CUDA_VISIBLE_DEVICES"] = saved
        progress(f"[devices] {len(procs)} measuring worker(s), GPUs {','.join(map(str, procs))}, one database")

        def drain(block_s: float) -> None:
            try:
                ev = events.get(timeout=block_s)
            except queue.Empty:
                return
            kind, d, val = ev
            if kind == "gpu":
                gpus.add(val)
            elif kind == "done":
                counts[d] = val
            elif kind == "none":
                none[d] = val
            elif kind == "error":
                errors[d] = val

        try:
            while any(p.is_alive() for p in procs.values()):
                drain(0.5)
        except KeyboardInterrupt:
            interrupted = True
            progress("[devices] interrupted: stopping every worker (finished measurements are kept)")
            for p in procs.values():
                if p.is_alive():
                    try:
                        os.kill(p.pid, signal.SIGINT)
                    except ProcessLookupError:
                        pass
            end = time.monotonic() + join_s
            while any(p.is_alive() for p in procs.values()) and time.monotonic() < end:
                try:
                    drain(0.5)
                except (KeyboardInterrupt, Exception):  # a second Ctrl-C, or a message it cut in half
                    continue
        for p in procs.values():
            p.join(1 if interrupted else None)
            if p.is_alive():  # did not stop in join_s: its RUNNING trial is requeued next run
                p.terminate()
                p.join()
        while not events.empty():
            try:
                drain(0.05)
            except Exception:
                break
    with Database(db_url) as db:
        for g in sorted(gpus):
            commit_picks(db, g)
    for d, p in procs.items():
        if p.exitcode not in (0, None) and d not in errors and not interrupted:
            errors[d] = f"exited with code {p.exitcode}"
    if interrupted:
        raise KeyboardInterrupt
    if errors:
        raise RuntimeError("; ".join(f"the worker of GPU {d} failed: {e}" for d, e in sorted(errors.items())))
    if none and not counts:
        raise LookupError(next(iter(none.values())))
    for d, msg in sorted(none.items()):
        progress(f"[gpu {d}] {msg}")
    return {d: counts.get(d, 0) for d in procs}
