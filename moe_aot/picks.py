"""Deployment: the tuned picks derived from the records, as text and as a build plan.

What the tuner's records say, read without optuna: a bucket's pick is its fastest valid record
in the newest context that holds the default's (medians where a confirmation round measured
candidates beside the default again), never slower than the default; `export` writes the picks
as `cache/tuned/<GPU>.jsonl`, `build` turns them (and the defaults) into kernels. The tuner
(tuner.py) writes the records and runs the rounds; `build`, `export` and `report` import only
this module.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import statistics
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from .database import Database, RecordRow
from .gemm_limits import STANDINS
from .spec import LayerSpec
from .variants import BACKWARD_SUFFIX, LayerVariant, can_implement, parse_variant, workload_for

CONFIRM_K = 3  # candidates per confirmation round (`--confirm`); 0: no rounds
CONFIRM_WITHIN = 0.10  # a candidate is measured again when within this fraction of the bucket's fastest


def variant_content(db: Database, spec: LayerSpec, variant: LayerVariant) -> tuple[str, str]:
    """(content, toolchain) of what the runtime would load for `variant` from `db`: a digest of
    its kernels' cubin sha256s (a kernel stored without a cubin: its library's), each kernel's
    newest compiled version as `KernelStore.load` picks it, and the newest of their toolchains.
    This is a measurement's key, so a kernel that is missing raises LookupError (fails closed)."""
    parts, newest = [], None
    for kv in variant.kernels(spec):
        rows = [a for a in db.list_artifacts(name=kv.name, status="ok") if a.target == spec.target]
        a = max(rows, key=lambda a: a.created_at, default=None)
        digest = a and (a.cubin_sha256 or a.sha256)
        if not digest:
            raise LookupError(f"kernel {kv.name} is not compiled in the database, so what would be "
                              f"measured for {variant.name(spec)} is unknown; compile it first")
        parts.append(f"{kv.role}:{digest}")
        newest = a if newest is None or a.created_at > newest.created_at else newest
    return hashlib.sha256("\n".join(parts).encode()).hexdigest(), newest.toolchain



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
           f"{'tokens':>7} {'records':>7} {'ok':>4} {'failed':>6} {'best us':>10} {'floor us':>9} "
           f"{'floor/best':>10}  variant"]
    for r in rows:
        best = f"{r['best_us']:10.1f}" if r["best_us"] else f"{'-':>10}"
        frac = f"{r['of_floor']:10.0%}" if r["of_floor"] else f"{'-':>10}"
        out.append(f"{r['tokens']:>7} {r['records']:>7} {r['ok']:>4} {r['failed']:>6} {best} "
                   f"{r['floor_us']:9.1f} {frac}  {r['variant'] or '-'}")
    return "\n".join(out)


def tuned_path(directory: Path, gpu: str) -> Path:
    return Path(directory) / f"{gpu.replace(' ', '_')}.jsonl"


# -- deployment: picks derived from the records, their text export, the build plan --------------

@dataclass(frozen=True)
class Pick:
    """The variant to run for one (workload, target, GPU, bucket), derived from the records by
    choose_pick, in the newest context (GPU, driver, toolchain) that holds a record of the
    default, so it is never slower than the default measured beside it (default_us; None when
    the default did not run correctly, which any valid record beats). median_us and default_us
    are medians over every counted measurement where a confirmation round re-measured them."""
    workload: str
    target: str
    gpu: str
    tokens: int
    variant: str
    median_us: float
    record_id: int | None
    toolchain: str
    default: str
    default_us: float | None


# Confirmation rounds (measure_worker.confirm_round): after a bucket's trials are measured, its
# best few candidates and its default are measured again, each twice in mirrored order (A B C D
# D C B A), and every one of those measurements is a record whose stats carry
# "confirm": {"round", "position", "size", "record"} (record: the id of the trial's record it
# measures again). One draw of an unstable variant can be low; a median of three resists it.
def confirmation(r: RecordRow) -> dict | None:
    """The round a record was measured in, or None for a trial's record."""
    c = r.stats.get("confirm") if isinstance(r.stats, dict) else None
    return c if isinstance(c, dict) else None


def complete_rounds(records) -> set[str]:
    """The rounds all of whose measurements are recorded. Only those count: an interrupted
    round lacks its mirrored half, so drift does not cancel in it."""
    sizes: dict[str, int] = {}
    seen: dict[str, int] = {}
    for r in records:
        c = confirmation(r)
        if c is not None:
            sizes[c["round"]] = c["size"]
            seen[c["round"]] = seen.get(c["round"], 0) + 1
    return {k for k, n in seen.items() if n == sizes[k]}


def _median_us(runs) -> float | None:
    vals = [r.median_us for r in runs if r.status == "ok" and r.median_us is not None]
    return statistics.median(vals) if vals else None


def _valid(runs) -> bool:
    return all(r.status == "ok" and r.median_us is not None for r in runs)


@dataclass
class _Bucket:
    """The records of one bucket as choose_pick and confirm_plan judge them: those in the
    context of the default's newest trial record, with the counted confirmation measurements."""
    is_default: Callable[[RecordRow], bool]
    base: RecordRow  # the default's newest trial record; its context is the bucket's
    trials: list[RecordRow]  # the trials' records in that context
    default_runs: list[RecordRow]  # the default's trial records and counted re-measurements
    runs: dict[tuple, list[RecordRow]]  # per other (variant, content): the same
    rounds: dict[tuple, set[str]]  # per other (variant, content): the counted rounds it was in


def _bucket(records, default: str, default_content: str | None, rounds: set[str] | None) -> _Bucket | None:
    is_default = ((lambda r: r.content == default_content) if default_content
                  else (lambda r: r.variant == default))
    trials = [r for r in records if confirmation(r) is None]
    defaults = [r for r in trials if is_default(r)]
    if not defaults:
        return None
    base = max(defaults, key=lambda r: r.id)  # the newest measurement of the default
    done = complete_rounds(records) if rounds is None else rounds
    ctx = [r for r in trials if r.context == base.context]
    again = [r for r in records if (c := confirmation(r)) is not None and c["round"] in done
             and r.context == base.context]
    beside = {confirmation(r)["round"] for r in again if is_default(r)}
    again = [r for r in again if confirmation(r)["round"] in beside]
    b = _Bucket(is_default, base, ctx, [], {}, {})
    for r in ctx + again:
        if is_default(r):
            b.default_runs.append(r)
            continue
        b.runs.setdefault((r.variant, r.content), []).append(r)
        if confirmation(r) is not None:
            b.rounds.setdefault((r.variant, r.content), set()).add(confirmation(r)["round"])
    return b


def _first(runs) -> RecordRow:
    """A candidate's trial record (the one its re-measurements point at)."""
    return min(runs, key=lambda r: (confirmation(r) is not None, r.id))


def choose_pick(records, default: str, default_content: str | None = None,
                rounds: set[str] | None = None) -> tuple[RecordRow, RecordRow] | None:
    """TVM's get_top_k with the default as the bar: records are of one (workload, target, GPU,
    bucket). The default's records are those of its content where known, else of its name.
    Without a confirmation round beside the default in the context, the fastest valid record,
    unless it is not faster than the default's. With one, only candidates measured in a round
    beside the default may beat it, each judged by the median of all its measurements (none of
    them failed) against the default's median over its trial and those rounds. `rounds`: the
    complete rounds (default: those complete in `records`). Returns (best, default's record),
    their median_us replaced by those medians where a round counted (the default's over its
    measurements that ran: a default whose trial failed, as DeepSeek-V3's backward out of memory
    on an H100, but ran in a round has that bar), the default's None where none of its
    measurements ran; or None when no context has both."""
    b = _bucket(records, default, default_content, rounds)
    if b is None:
        return None
    dall = _median_us(b.default_runs)
    if dall is not None and any(confirmation(r) is not None for r in b.default_runs):
        beating = []
        for key, runs in b.runs.items():
            if key not in b.rounds or not _valid(runs):
                continue
            bar = _median_us([r for r in b.default_runs
                              if confirmation(r) is None or confirmation(r)["round"] in b.rounds[key]])
            m = _median_us(runs)
            if bar is None or m < bar:
                beating.append((m, _first(runs).id, _first(runs), bar))
        if beating:
            m, _, first, bar = min(beating, key=lambda x: x[:2])
            return dataclasses.replace(first, median_us=m), dataclasses.replace(b.base, median_us=bar)
        base = dataclasses.replace(b.base, median_us=dall)
        return base, base
    ok = [r for r in b.trials if r.status == "ok" and r.median_us is not None]
    if not ok:
        return None
    best = min(ok, key=lambda r: (r.median_us, not b.is_default(r), r.id))
    base = b.base if b.base.status == "ok" else dataclasses.replace(b.base, median_us=None)
    if base.status == "ok" and best.median_us >= base.median_us:
        best = base
    return best, base


@dataclass(frozen=True)
class ConfirmPlan:
    """What a confirmation round of one bucket measures again: trial records, fastest first."""
    candidates: list[RecordRow]
    default: RecordRow  # the default's trial record
    due: bool  # some candidate has not been in a complete round beside the default


def confirm_plan(records, default: str, default_content: str | None = None, k: int = CONFIRM_K,
                 within: float = CONFIRM_WITHIN, rounds: set[str] | None = None) -> ConfirmPlan | None:
    """The candidates of a round: up to `k` other variants whose every measurement is valid and
    whose median (a single draw until confirmed) is within `within` of the fastest of the
    bucket's context, the default included. None when there is none (the pick is the default)."""
    b = _bucket(records, default, default_content, rounds)
    if b is None or k <= 0:
        return None
    ranked = sorted((_median_us(runs), _first(runs).id, key) for key, runs in b.runs.items() if _valid(runs))
    dall = _median_us(b.default_runs)
    if not ranked:
        return None
    fastest = min(ranked[0][0], dall if dall is not None else math.inf)
    chosen = [key for m, _, key in ranked if m <= fastest * (1 + within)][:k]
    if not chosen:
        return None
    return ConfirmPlan([_first(b.runs[key]) for key in chosen], b.base, any(key not in b.rounds for key in chosen))


def round_medians(records, default: str, default_content: str | None = None,
                  rounds: set[str] | None = None) -> dict[str, float | None]:
    """Per variant name in the bucket's context: the median of its counted measurements."""
    b = _bucket(records, default, default_content, rounds)
    if b is None:
        return {}
    out = {key[0]: _median_us(runs) for key, runs in b.runs.items()}
    out[b.base.variant] = _median_us(b.default_runs)
    return out


def current_contents(db: Database, spec: LayerSpec) -> Callable[[str], str | None]:
    """name -> the content the database would load for that variant (a layer's or, named
    moe_bwd_..., a backward's) today (None: it cannot, or today's rules refuse the variant, e.g.
    a tile or MMA family removed since it was measured: its records then never make a pick)."""
    from .variants import BackwardVariant, can_implement_backward

    contents: dict[str, str | None] = {}

    def current(name: str) -> str | None:
        if name not in contents:
            try:
                v = parse_variant(name)
                ok = (can_implement_backward if isinstance(v, BackwardVariant) else can_implement)(spec, v)[0]
                contents[name] = variant_content(db, spec, v)[0] if ok else None
            except (LookupError, ValueError):
                contents[name] = None
        return contents[name]
    return current


def live_records(db: Database, spec: LayerSpec, records, current=None) -> list[RecordRow]:
    """The records whose content is what the database would load for their variant today."""
    current = current or current_contents(db, spec)
    return [r for r in records if r.content is not None and r.content == current(r.variant)]


def bucket_default(spec: LayerSpec, tokens: int, backward: bool = False):
    """The variant a bucket runs without a pick: the layer's (variants.default_variant), or with
    ``backward`` the backward's (variants.default_backward; None where the layer has no fused one)."""
    from .variants import default_backward, default_variant

    return default_backward(spec, tokens) if backward else default_variant(spec, tokens)


def derive_picks(db: Database, spec: LayerSpec, gpu: str | None = None, buckets=None,
                 backward: bool = False) -> list[Pick]:
    """The picks of one layer (``backward``: of its backward, workload backward_workload(spec))
    per GPU and bucket from `db`'s records. A record counts only while its content is what the
    database would load for its variant today (a recompile that changed the cubins makes it
    stale); a bucket whose default has no such record gets no pick."""
    workload = workload_for(spec, backward)
    current = current_contents(db, spec)
    groups: dict[tuple, list[RecordRow]] = {}
    for r in db.records(workload, spec.target, gpu):
        if buckets is None or r.tokens in buckets:
            groups.setdefault((r.gpu, r.tokens), []).append(r)
    picks = []
    for (g, tokens), recs in sorted(groups.items()):
        dflt = bucket_default(spec, tokens, backward)
        if dflt is None:
            continue
        dname = dflt.name(spec)
        got = choose_pick(live_records(db, spec, recs, current), dname, current(dname), complete_rounds(recs))
        if got is None:
            continue
        best, base = got
        picks.append(Pick(workload, spec.target, g, tokens, best.variant, best.median_us, best.id,
                          best.toolchain, dname, base.median_us))
    return picks


def _record_specs(db: Database, gpu: str | None, specs=None) -> list[tuple[LayerSpec, bool]]:
    """(layer, backward) of every workload with records (or of `specs`: their forward and
    backward workloads): a backward's workload row holds its layer's fields."""
    if specs is not None:
        return [(s, b) for s in specs for b in (False, True)]
    out = []
    for w, t in sorted({(r.workload, r.target) for r in db.records(gpu=gpu)}):
        wd = db.workload(w)
        if wd is not None:
            out.append((LayerSpec(**wd, target=t), w.endswith(BACKWARD_SUFFIX)))
    return out


def commit_picks(db: Database, gpu: str, specs=None, backward: bool | None = None) -> int:
    """Deploy the derived picks for the runtime (the best table, which it reads): one toolchain
    per layer and GPU (the newest the picks were measured with; the runtime loads each kernel's
    newest usable build by name), replacing what was deployed there; ``backward`` True / False:
    only the backward's / the forward's picks. Returns how many."""
    n = 0
    for spec, bwd in _record_specs(db, gpu, specs):
        if backward is not None and bwd != backward:
            continue
        picks = derive_picks(db, spec, gpu, backward=bwd)
        if not picks:
            continue
        tc = max(picks, key=lambda p: p.record_id or 0).toolchain
        for p in picks:
            db.commit_best(workload=p.workload, target=p.target, gpu=p.gpu, toolchain=tc, tokens=p.tokens,
                           variant=p.variant, median_us=p.median_us, record_id=p.record_id, force=True)
            n += 1
    return n


TUNED_FIELDS = ("workload", "target", "gpu", "tokens", "variant", "median_us", "default", "default_us")


def pick_line(p: Pick) -> dict:
    return {"workload": p.workload, "target": p.target, "gpu": p.gpu, "tokens": p.tokens,
            "variant": p.variant, "median_us": round(p.median_us, 3), "default": p.default,
            "default_us": None if p.default_us is None else round(p.default_us, 3)}


def export_tuned(db: Database, directory: Path, gpu: str | None = None) -> list[Path]:
    """Write the picks derived from the records as reviewable text, one file per GPU, one JSON
    object per line with the default's record beside the pick, sorted so a re-export of
    unchanged results is byte-identical. Lines of other layers already in a file are kept.
    Stand-in targets (gemm_limits.STANDINS) are left out: their times are another GPU's, and
    these files are what deployments build from."""
    by_gpu: dict[str, list[dict]] = {}
    for spec, backward in _record_specs(db, gpu):
        if spec.target in STANDINS:
            continue
        for p in derive_picks(db, spec, gpu, backward=backward):
            by_gpu.setdefault(p.gpu, []).append(pick_line(p))
    return [write_tuned(directory, g, entries) for g, entries in sorted(by_gpu.items())]


def write_tuned(directory: Path, gpu: str, entries: list[dict]) -> Path:
    path = tuned_path(directory, gpu)
    path.parent.mkdir(parents=True, exist_ok=True)
    new = {(x["workload"], x["target"], x["tokens"]) for x in entries}
    keep = [e for e in read_tuned_file(path) if (e["workload"], e["target"], e["tokens"]) not in new] \
        if path.exists() else []
    merged = sorted(keep + entries, key=lambda e: (e["workload"], e["target"], e["tokens"]))
    tmp = path.with_suffix(".jsonl.tmp")
    tmp.write_text("".join(json.dumps(e, sort_keys=True) + "\n" for e in merged))
    os.replace(tmp, path)
    return path


def read_tuned_file(path: Path) -> list[dict]:
    out = []
    for i, text in enumerate(Path(path).read_text().splitlines(), 1):
        if not text.strip():
            continue
        try:
            e = json.loads(text)
            parse_variant(e["variant"])
            parse_variant(e["default"])
            entry = {k: e[k] for k in TUNED_FIELDS}
            if not (entry["median_us"] > 0 and (entry["default_us"] is None or entry["default_us"] > 0)):
                raise ValueError("times must be positive")
        except (ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"{path}:{i}: not a tuned pick ({exc}); expected one JSON object with "
                             f"{', '.join(TUNED_FIELDS)} (re-export it with `moe-aot export`)") from None
        if entry["default_us"] is not None and entry["median_us"] > entry["default_us"]:
            raise ValueError(f"{path}:{i}: the pick {entry['variant']} ({entry['median_us']} us) is slower than "
                             f"the default's record ({entry['default_us']} us); re-export it with `moe-aot export`")
        out.append(entry)
    return out


def read_tuned(directory: Path, gpu: str | None = None) -> list[dict]:
    files = [tuned_path(directory, gpu)] if gpu else sorted(Path(directory).glob("*.jsonl"))
    return [e for f in files if f.exists() for e in read_tuned_file(f)]


def _tuned_picks(db: Database, spec: LayerSpec, gpu: str | None, text: list[dict], backward: bool,
                 skipped: list | None) -> list[tuple]:
    """(gpu, tokens, variant, median_us) of every pick of one layer (or its backward) for the
    target: derived from the database's records where it has them, else from the text export's
    lines; a text pick measured against another default than today's is left out (appended to
    `skipped`); a pick the layer cannot implement is an error."""
    from .variants import can_implement_backward

    workload = workload_for(spec, backward)
    found = {(p.gpu, p.tokens): (p.variant, p.median_us) for p in derive_picks(db, spec, gpu, backward=backward)}
    for e in text:
        if e["workload"] != workload or e["target"] != spec.target or (e["gpu"], e["tokens"]) in found:
            continue
        dflt = bucket_default(spec, e["tokens"], backward)
        if dflt is None or e["default"] != dflt.name(spec):
            if skipped is not None:
                skipped.append(e)
            continue
        found[(e["gpu"], e["tokens"])] = (e["variant"], e["median_us"])
    out = []
    for (g, tokens), (name, us) in sorted(found.items()):
        v = parse_variant(name)
        ok, why = (can_implement_backward if backward else can_implement)(spec, v)
        if not ok:
            raise ValueError(f"tuned pick {name} for {g} cannot implement {spec.label()}: {why}")
        out.append((g, tokens, v, us))
    return out


def build_plan(db: Database, specs, buckets, gpu: str | None, tuned_dir: Path,
               skipped: list | None = None) -> tuple[list, list]:
    """What `moe-aot build` compiles: per spec and bucket the default variant, plus every tuned
    pick for the target (one GPU or all): derived from the database's records where it has them,
    else from the text export. Every pick is no slower than its default's record; a text pick
    measured against another default than today's is left out (appended to `skipped`).
    Returns (spec, variant) pairs to compile and the picks to deploy under the build's
    toolchain, as (spec, gpu, tokens, variant, median_us)."""
    from .variants import default_variant

    pairs, picks = [], []
    text = read_tuned(tuned_dir, gpu) if Path(tuned_dir).is_dir() else []
    for spec in specs:
        for tokens in buckets:
            pairs.append((spec, default_variant(spec, tokens)))
        for g, tokens, v, us in _tuned_picks(db, spec, gpu, text, False, skipped):
            pairs.append((spec, v))
            picks.append((spec, g, tokens, v, us))
    return list(dict.fromkeys(pairs)), picks


def backward_build_plan(db: Database, specs, buckets, gpu: str | None, tuned_dir: Path,
                        skipped: list | None = None) -> tuple[list, list]:
    """build_plan for the backward (`moe-aot build --backward`): (spec, KernelVariant) pairs of
    every bucket's default backward and every tuned backward pick, and those picks to deploy as
    (spec, gpu, tokens, BackwardVariant, median_us)."""
    kernels, picks = [], []
    text = read_tuned(tuned_dir, gpu) if Path(tuned_dir).is_dir() else []
    for spec in specs:
        for tokens in buckets:
            dflt = bucket_default(spec, tokens, backward=True)
            kernels += [(spec, kv) for kv in (dflt.kernels(spec) if dflt is not None else [])]
        for g, tokens, v, us in _tuned_picks(db, spec, gpu, text, True, skipped):
            kernels += [(spec, kv) for kv in v.kernels(spec)]
            picks.append((spec, g, tokens, v, us))
    return list(dict.fromkeys(kernels)), picks
