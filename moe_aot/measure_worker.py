"""The measuring half of the tuner: on a GPU machine, claim compiled ("ready") trials from the
studies in the database, measure them the way the benchmark does, record and tell.

Imports optuna, the runtime and the tuner's study plumbing, never cutlass or the compiler (a test
asserts it): it runs where only torch and the kernel database are. Several workers may measure
the same studies at once; each WAITING trial is claimed by exactly one of them through optuna's
WAITING -> RUNNING transition (row-locked on PostgreSQL, BEGIN IMMEDIATE on SQLite).
"""
from __future__ import annotations

import math
import re
import time
from pathlib import Path
from typing import Callable

import optuna
from optuna.trial import TrialState

from .database import Database
from .spec import LayerSpec
from .tuner import (Outcome, finish, known_outcome, line, open_storage, parse_study_name, requeue_stale,
                    search_space, study_spec, suggest, worker_id)
from .variants import LayerVariant


def driver_version() -> str:
    """The NVIDIA kernel driver and the CUDA version it supports, e.g. '570.86.15 (CUDA 12.8)'."""
    parts = []
    try:
        m = re.search(r"Kernel Module\s+(\S+)", Path("/proc/driver/nvidia/version").read_text())
        if m:
            parts.append(m[1])
    except OSError:
        pass
    try:
        from .runtime.store import driver_cuda_version

        major, minor = driver_cuda_version()
        parts.append(f"(CUDA {major}.{minor})")
    except (OSError, RuntimeError):
        pass
    return " ".join(parts) or "unknown"


class GpuMeasurer:
    """measure_variant on the current GPU: correctness check against the fp32 reference, then
    CUDA-graph replays over several input sets, median. Failures come back typed as Outcomes."""

    def __init__(self, db_url: str | None, replays: int = 100, device: int | None = None):
        import torch

        from .runtime.store import KernelStore

        if not torch.cuda.is_available():
            raise RuntimeError("measuring needs a CUDA GPU; none is visible here")
        self.device = torch.device("cuda", torch.cuda.current_device() if device is None else device)
        self.gpu = torch.cuda.get_device_name(self.device)
        self.driver = driver_version()
        self.store = KernelStore(db_url)
        self.replays = replays
        self._weights: tuple[LayerSpec, tuple] | None = None

    def weights(self, spec: LayerSpec):
        from .runtime.verify import random_weights

        if self._weights is None or self._weights[0] != spec:
            self._weights = None  # free the previous layer's weights before allocating
            self._weights = (spec, random_weights(spec, self.device))
        return self._weights[1]

    def __call__(self, spec: LayerSpec, variant: LayerVariant, tokens: int) -> Outcome:
        import torch

        from .runtime.layer import MoeLayer
        from .runtime.library import KernelLaunchError
        from .runtime.measure import measure_variant
        from .runtime.store import KernelMissingError

        w13, w2 = self.weights(spec)
        try:
            layer = MoeLayer(spec, self.store, device=self.device, variants={tokens: variant})
            r = measure_variant(layer, None, tokens, w13, w2, replays=self.replays)
        except KernelMissingError as exc:
            return Outcome("compile_error", error=str(exc))
        except torch.cuda.OutOfMemoryError as exc:
            return Outcome("resource_error", error=str(exc))
        except KernelLaunchError as exc:
            msg = str(exc)
            # cudaErrorLaunchOutOfResources (701), too much shared memory or too many registers
            status = "resource_error" if "701" in msg or "resources" in msg.lower() else "launch_error"
            torch.cuda.synchronize()  # a sticky error ends the worker here rather than later
            return Outcome(status, error=msg)
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
    return [optuna.load_study(study_name=n, storage=storage) for n in sorted(mine)]


def claim(study: optuna.Study) -> tuple[optuna.Trial, dict] | None:
    """The first ready WAITING trial this worker manages to switch to RUNNING."""
    for t in study.get_trials(deepcopy=False, states=(TrialState.WAITING,)):
        if not t.user_attrs.get("ready"):
            continue  # handed back uncompiled by a killed `tune`: a compiling worker takes it
        try:
            if study._storage.set_trial_state_values(t._trial_id, TrialState.RUNNING):
                trial = optuna.Trial(study, t._trial_id)
                trial.set_user_attr("worker", worker_id())
                return trial, t.user_attrs
        except optuna.exceptions.UpdateFinishedTrialError:
            continue
    return None


def measure(db_url: str, measurer, workloads=None, target: str | None = None, buckets=None,
            max_trials: int | None = None, timeout_s: float | None = None, wait_s: float = 0.0,
            progress: Callable[[str], None] = line, poll_s: float = 2.0) -> int:
    """Measure ready trials of `measurer.gpu`'s studies until none is left (or, with wait_s, none
    arrived for that long: a compiling side may still be adding some), `max_trials` were measured
    or `timeout_s` passed. Returns how many this worker measured."""
    db = Database(db_url)
    storage = open_storage(db_url)
    deadline = time.monotonic() + timeout_s if timeout_s else math.inf
    studies = find_studies(storage, measurer.gpu, workloads, target, buckets)
    for study in studies:
        requeue_stale(study)  # trials a killed measurer held
    specs: dict[str, tuple[LayerSpec, dict, int]] = {}
    done, idle_since = 0, time.monotonic()
    try:
        while (max_trials is None or done < max_trials) and time.monotonic() < deadline:
            got = next(((s, c) for s in studies if (c := claim(s))), None)
            if got is None:
                if time.monotonic() - idle_since >= wait_s:
                    break
                time.sleep(poll_s)
                studies = find_studies(storage, measurer.gpu, workloads, target, buckets)
                continue
            study, (trial, attrs) = got
            if study.study_name not in specs:
                spec = study_spec(study)
                specs[study.study_name] = (spec, search_space(spec), parse_study_name(study.study_name)["tokens"])
            spec, space, tokens = specs[study.study_name]
            try:
                variant = suggest(trial, space)
                out = (known_outcome(db, spec, measurer.gpu, attrs["toolchain"], tokens, variant)
                       or measurer(spec, variant, tokens))
                finish(db, study, trial, spec, tokens, variant, attrs["toolchain"], measurer.gpu,
                       measurer.driver, out)
            except BaseException:
                try:  # hand it back so another worker (or the next run) measures it
                    storage.set_trial_state_values(trial._trial_id, TrialState.WAITING)
                except Exception:
                    pass
                raise
            done += 1
            idle_since = time.monotonic()
            best = db.best(spec.workload_key, spec.target, measurer.gpu, attrs["toolchain"]).get(tokens)
            took = f"{out.median_us:9.1f}us" if out.median_us else f"{'-':>11}"
            progress(f"[{done}] {spec.label()} tokens={tokens:<6} trial {trial.number:<4} {out.status:14} {took}"
                     f"  best {best.median_us if best else float('nan'):9.1f}us  {variant.name(spec)}")
    finally:
        db.close()
    return done
