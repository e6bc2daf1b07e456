"""The tuned picks committed as text (cache/tuned/*.jsonl): derived from the committed records,
never slower than the default measured beside them, turned back into binaries on a CPU machine,
and found by the runtime's lookup for that GPU."""
import json
from datetime import datetime
from pathlib import Path

import pytest
from click.testing import CliRunner

from moe_aot import picks
from moe_aot.cli import main
from moe_aot.database import RecordRow
from moe_aot.runtime.store import KernelStore
from moe_aot.spec import make_spec
from moe_aot.variants import (
    BACKWARD_SUFFIX,
    BackwardVariant,
    can_implement,
    can_implement_backward,
    default_variant,
    parse_variant,
)

ROOT = Path(__file__).resolve().parents[1]
TUNED = ROOT / "cache" / "tuned" / "NVIDIA_H200.jsonl"
H100 = "NVIDIA H100 80GB HBM3"
TUNED_H100 = picks.tuned_path(ROOT / "cache" / "tuned", H100)
# every record of the H200 tuning sessions of 2026-12-01 (`moe-aot tune --compile-only --seed-picks`
# + `moe-aot measure`), each dumped from its database, oldest first: a bucket's picks come from the
# newest session that measured it (the second re-measured the 256-16384-token buckets with the
# 2-CTA-cluster twins as seeds, the third the 14 buckets whose kernels the 16-byte GEMM2 epilogue
# changed, the fourth all 35 buckets after the ping-pong GEMMs and the 16-byte GEMM1 epilogue, with
# confirmation rounds, the fifth the 1-token buckets of four models with 128-wide k-tiles as seeds).
# tuning_2026-12-01d is not among them: it measured GEMM1 kernels that were changed before
# anything shipped (tools/results/NOTES.md). g, h and i are the first fp8 sessions (fp8 and
# fp8-block128 at 1, 16, 256 and 4096 tokens; g: the two Qwen3 models, h: DeepSeek-V3, i: Mixtral).
# j: gpt-oss-120b's seven buckets once the preset computed gpt-oss's clamped SwiGLU with expert
# biases (a new workload key; the plain-SwiGLU records of that shape stay, as a custom layer's).
# l: the 1- and 16-token buckets of the other four models, each with its shipped pick and the
# best of round k (128-wide k-tiles, 6 and 8 stages) beside the default. tuning_2026-12-01k is not
# among them: it left the shipped picks out, so it could not say whether its best beat them.
# 2026-12-02t: fp8 and fp8-block128 at 1, 16, 64 and 256 tokens for the four fp8 models, after
# the fp8 default at those buckets became 64-row cooperative tiles and the mma.sync fp8 kernels
# joined the space (8 trials per study, the committed picks as seeds, a confirmation round each).
# 2026-12-02u: bf16 Qwen3-235B and Mixtral at 16 and 64 tokens with 16-row 32x128 mma.sync tiles
# tried beside the committed picks (`tune --try`), a confirmation round each.
# 2026-12-02v: fp8 and fp8-block128 at 1024, 4096 and 16384 tokens (Mixtral also 256) after the fp8
# default there became 128x256 tiles promoted in column parts (4 trials per study: the default, the
# committed pick and both PDL twins; a confirmation round each). 2026-12-02w: fp8-block128 at the
# same buckets once its GEMM2 default became 128x256 too (the same 4 trials, a round each).
# 2026-12-02x: fp8 and fp8-block128 at 256, 1024, 4096 and 16384 tokens once the default above 16
# rows per expert wrote h's scales per 128 columns (h_block 128; 4 trials per study: the default,
# the committed pick and their PDL / h128 twins; a confirmation round each).
# 2026-12-02z: bf16 DeepSeek-V3, Mixtral, Qwen3-235B and gpt-oss at 1024, 4096 and 16384 tokens once
# the 2-CTA clusters paired one expert's M tiles (5 trials per study: the default, the committed pick
# and twins, the 2-CTA tiles on both GEMMs and on GEMM1 alone; a confirmation round each). Its
# database also measured Qwen3-30B's three defaults alone (no candidates), left out of the records.
# tuning_backward_2026-12-03: the fused backward (`moe-aot tune --backward`, workloads "<layer>_bwd")
# of the five bf16 presets at 1024, 4096 and 16384 tokens: every candidate, the combination of the parts
# that beat the default, a confirmation round each.
# 2026-12-03s and backward_2026-12-03s: the same bf16 buckets (1024, 4096, 16384 tokens, five presets)
# timed at the sustained clock (0.5 s of untimed replays first; their records' driver field ends in
# "; sustained 0.5 s", a context of their own): forward 4 trials per study (the default, the committed
# pick and both PDL twins) and a confirmation round each; backward every candidate (the 64-row
# routing tiles among them), the combination and a round each.
# 2026-12-03n: bf16 at 1024 and 4096 tokens (five presets) once a paired tile's all-padding
# warpgroup skipped its wgmmas (every kernel rebuilt): 7 trials per study (the default, the
# committed pick and both PDL twins, the 128-row paired tiles on both GEMMs and on GEMM2 alone,
# one sampled), sustained timing, a confirmation round each. 2026-12-03o: DeepSeek-V3 and Mixtral
# at 16384 tokens, whose picks' paired GEMM2 the skip had changed (4 trials: the default, the
# committed pick, its PDL twin, one sampled; a round each).
# 2026-12-04: fp8 and fp8-block128 at all seven buckets of the four fp8 models once the routing
# launch quantized x (every fp8 layer's routing kernel changed, so every fp8 pick's binaries did):
# 2 trials per study (the default and the committed pick, or its PDL twin where the pick is the
# default), sustained timing, a confirmation round each.
# 2026-12-05: the 1-token buckets of all 13 layers once the one-launch decode kernel joined them
# (5 trials per study: the default, the three decode candidates, the committed pick), sustained
# timing, two confirmation rounds. 2026-12-05b: the same 13 studies once the decode kernel's lanes
# went on by default (h lane-major for e4m3 weights, bf16 widened by integer ops; every decode
# kernel's binary changed): the same 5 trials per study, sustained timing, two confirmation rounds.
# 2026-12-06h and i: the H100's own bf16 picks ("NVIDIA H100 80GB HBM3"), five presets, all seven
# buckets (h: 256, 1024, 4096 tokens, 8 trials per study; i: 1, 16, 64, 16384, 5 trials), seeded by
# the H200's picks, sustained timing, two confirmation rounds each. 2026-12-06j: the H100's fp8 and
# fp8-block128 picks at 1024 and 4096 tokens (four presets; 3 trials per study: the default, the
# H200's pick and a twin), two confirmation rounds each. 2026-12-06k: the H100's fp8 and
# fp8-block128 picks at 1, 16, 64, 256 and 16384 tokens (the same studies), two rounds each.
# tuning_backward_2026-12-06h: the H100's backward (`tune --backward`, five presets, 1024, 4096 and
# 16384 tokens, every candidate, the combination and two rounds each); DeepSeek-V3 at 16384 ran out
# of memory on the 80 GB card in every trial. tuning_backward_2026-12-06i: that bucket again once
# the graph capture released the allocator's cache: the candidates with compiled weight gradients
# ran, those with torch's (the default among them) still ran out of memory.
# 2026-12-06l, m and n: the H200 again, the buckets whose picks the ping-pong turns rebuilt (REBUILT)
# and their neighbours, with the fast_act and 2-CTA twins as seeds (`tune --compile-only --trials 12
# --seed-picks cache/tuned`, sustained timing, two confirmation rounds each): l fp8 at 4096 tokens
# (four presets), m bf16 at 4096 and 16384, n bf16 at 256 and 1024 (five presets each).
# 2026-12-07h: the H100's fp8 picks at 1024, 4096 and 16384 tokens again (four presets; `tune
# --compile-only --trials 12 --seed-picks cache/tuned`, so the p2fa twins were measured), two rounds.
# tuning_backward_2026-12-07: the H100's backward at 4096 and 16384 tokens once torch's data GEMMs
# (variants.TORCH_DATA) joined the candidates: the database of backward_2026-12-06h / i, so only that
# candidate, the combinations and the rounds it made due were measured (the bucket's older records
# are in this file too, as the database held them).
# tuning_backward_2026-12-07d: the H100's backward at 1024 and 4096 tokens again (five presets, `build
# --backward` + `tune --backward --compile-only`), now with the 256x64x3 cooperative tiles.
SESSIONS = ("tuning_2026-12-01", "tuning_2026-12-01b", "tuning_2026-12-01c", "tuning_2026-12-01e",
            "tuning_2026-12-01f", "tuning_2026-12-01g", "tuning_2026-12-01h", "tuning_2026-12-01i",
            "tuning_2026-12-01j", "tuning_2026-12-01l", "tuning_2026-12-02t", "tuning_2026-12-02u",
            "tuning_2026-12-02v", "tuning_2026-12-02w", "tuning_2026-12-02x", "tuning_2026-12-02z",
            "tuning_2026-12-03", "tuning_backward_2026-12-03", "tuning_2026-12-03s",
            "tuning_backward_2026-12-03s", "tuning_2026-12-03t", "tuning_2026-12-03n", "tuning_2026-12-03o",
            "tuning_2026-12-04", "tuning_2026-12-05", "tuning_2026-12-05b",
            "tuning_2026-12-06", "tuning_2026-12-06b", "tuning_2026-12-06h",
            "tuning_2026-12-06i", "tuning_2026-12-06j", "tuning_2026-12-06k", "tuning_backward_2026-12-06h",
            "tuning_backward_2026-12-06i", "tuning_2026-12-06l", "tuning_2026-12-06m", "tuning_2026-12-06n",
            "tuning_2026-12-07h", "tuning_backward_2026-12-07", "tuning_backward_2026-12-07b",
            "tuning_backward_2026-12-07c", "tuning_2026-12-07t",
            "tuning_2026-12-07u", "tuning_backward_2026-12-07d")
BACKWARD_BUCKETS = (1024, 4096, 16384)
FP8_BUCKETS = (1, 16, 64, 256, 1024, 4096, 16384)
RECORD_FILES = [ROOT / "tools" / "results" / d / "all_records.json" for d in SESSIONS]
# Deliberate template changes that rebuilt committed picks' binaries after the H200 measured them:
# (the GEMM family in the picks' names whose binaries changed, the last session measured before
# the change, what changed). A pick of that family whose bucket was last measured by that session
# or an earlier one must now build to other binaries than its record's (the change reached it);
# once a later session re-measures the bucket, its binaries must match the record again.
REBUILT = (
    ("hoppp", "tuning_2026-12-06b",
     "2026-12-06: the ping-pong consumer warpgroups' mainloops take turns (pipeline.PipelineOrder), "
     "so no full-barrier parity wait passes a phase early (tools/results/NOTES.md, thirty-fifth "
     "session; measured on an H100 at the kernels, not yet on the H200)"),
)


def _records(files=tuple(RECORD_FILES), with_session=False) -> list[dict]:
    """Each bucket's records from the newest session that has it (ids are per session); with
    ``with_session``, (record, index of its session in ``files``) pairs."""
    sessions = [json.loads(p.read_text()) for p in files]
    out = []
    for i, recs in enumerate(sessions):
        later = {(r["workload"], r["gpu"], r["tokens"]) for s in sessions[i + 1:] for r in s}
        out += [(r, i) if with_session else r for r in recs if (r["workload"], r["gpu"], r["tokens"]) not in later]
    return out


def _assert_measured_binaries(db, spec, served, workload, gpu="NVIDIA H200"):
    """Each served pick builds to the binaries its record measured (same content digest), except
    the picks a REBUILT change reached since, which must build to other ones."""
    measured = {(r["variant"], r["tokens"]): (r["content"], i)
                for r, i in _records(with_session=True) if (r["workload"], r["gpu"]) == (workload, gpu)}
    for tokens, v in served.items():
        content, session = measured[(v.name(spec), tokens)]
        rebuilt = [why for family, last, why in REBUILT
                   if family in v.name(spec) and session <= SESSIONS.index(last)]
        built = picks.variant_content(db, spec, v)[0]
        if rebuilt:
            assert built != content, (tokens, v.name(spec), "REBUILT says this pick changed", rebuilt)
        else:
            assert built == content, (tokens, v.name(spec))
MODELS = ("qwen3-30b-a3b", "qwen3-235b-a22b", "gpt-oss-120b", "deepseek-v3", "mixtral-8x7b")


def _spec(workload):
    """The layer of a workload key (a backward's "<layer>_bwd": its layer's)."""
    workload = workload.removesuffix(BACKWARD_SUFFIX)
    for m in MODELS:
        for p in ("bf16", "fp8", "fp8-block128"):
            if m == "gpt-oss-120b" and p != "bf16":
                continue  # H = 2880: no fp8
            spec = make_spec(m, precision=p)
            if spec.workload_key == workload:
                return spec
    # gpt-oss's shape with plain SwiGLU and no biases: the preset before it computed gpt-oss's own
    # activation, tuned under that workload key
    spec = make_spec("gpt-oss-120b", activation="swiglu", bias=False)
    if spec.workload_key == workload:
        return spec
    raise KeyError(workload)


def derive_from_committed_records(records=None, gpu="NVIDIA H200") -> list[dict]:
    """`gpu`'s picks from the sessions' records, as `moe-aot export` writes them (here without
    the database, so the default's records are found by its name; in one session the name and
    the content of a variant go together)."""
    recs = [RecordRow(**{**r, "created_at": datetime.fromisoformat(r["created_at"])})
            for r in (_records() if records is None else records) if r["gpu"] == gpu]
    assert all(r.content for r in recs)
    for bucket in {(r.workload, r.gpu, r.tokens) for r in recs}:  # one session, one driver per bucket
        assert len({r.driver for r in recs if (r.workload, r.gpu, r.tokens) == bucket}) == 1
    lines = []
    for w, g, n in sorted({(r.workload, r.gpu, r.tokens) for r in recs}):
        spec = _spec(w)
        default = picks.bucket_default(spec, n, w.endswith(BACKWARD_SUFFIX)).name(spec)
        chosen = picks.choose_pick([r for r in recs if (r.workload, r.gpu, r.tokens) == (w, g, n)], default)
        if chosen is None:  # nothing measured there (every trial failed), so the tuner deployed nothing
            continue
        best, base = chosen
        lines.append(picks.pick_line(picks.Pick(w, "sm_90a", g, n, best.variant, best.median_us, best.id, "",
                                                default, base.median_us)))
    return lines


# per GPU with a committed file: (its file, how many picks it holds). The H200: bf16 five models x
# seven buckets and gpt-oss's shape with plain SwiGLU; fp8 and fp8-block128 four models x seven
# buckets; the backward five models x three buckets. The H100: bf16 five models x seven buckets;
# fp8 and fp8-block128 four models x seven buckets; the backward five models x three buckets.
SHIPPED = {"NVIDIA H200": (TUNED, 35 + 7 + 2 * 4 * len(FP8_BUCKETS) + len(MODELS) * len(BACKWARD_BUCKETS)),
           H100: (TUNED_H100, 35 + 2 * 4 * len(FP8_BUCKETS) + len(MODELS) * len(BACKWARD_BUCKETS))}


# the buckets whose default never ran in their records (so their pick has no default time): none
# since tuning_backward_2026-12-07, whose round ran the H100's DeepSeek-V3 16384 backward default
# (out of memory in its trials of 06h / 06i), so that bucket's pick has the round's default time
DEFAULT_FAILED: set = set()


@pytest.mark.parametrize("gpu", sorted(SHIPPED))
def test_committed_picks_are_derived_from_the_records_and_never_slower_than_the_default(gpu):
    path, count = SHIPPED[gpu]
    rows = picks.read_tuned_file(path)  # refuses a pick slower than its default's record
    assert rows == derive_from_committed_records(gpu=gpu)
    recs = _records()
    confirmed, failed_defaults = 0, []
    for r in rows:
        bucket = [x for x in recs if (x["workload"], x["gpu"], x["tokens"]) == (r["workload"], gpu, r["tokens"])
                  and x["status"] == "ok"]
        spec = _spec(r["workload"])
        backward = r["workload"].endswith(BACKWARD_SUFFIX)
        assert r["default"] == picks.bucket_default(spec, r["tokens"], backward).name(spec)
        default_us = [x["median_us"] for x in bucket if x["variant"] == r["default"]]
        if not default_us:  # the default failed every time (the H100's DeepSeek-V3 16384 backward: out of
            # memory): no bar, the pick is a measured candidate and the file says the default has no time
            assert r["default_us"] is None and r["variant"] != r["default"], r
            assert r["median_us"] in {round(x["median_us"], 3) for x in bucket if x["variant"] == r["variant"]}, r
            failed_defaults.append((gpu, r["workload"], r["tokens"]))
        elif len(default_us) == 1:  # no confirmation round: the fastest single record
            assert r["median_us"] == round(min(x["median_us"] for x in bucket), 3) <= round(default_us[0], 3), r
            # a round measures the candidates within 10% of the fastest with the default: none was
            # due only where the default was fastest by more than that
            others = [x["median_us"] for x in bucket if x["variant"] != r["default"]]
            assert r["variant"] == r["default"] and min(others) > 1.1 * default_us[0], r
        else:  # a round: the pick's and the default's medians over all their measurements
            confirmed += 1
            pick_us = sorted(x["median_us"] for x in bucket if x["variant"] == r["variant"])
            assert len(pick_us) >= 3 and round(pick_us[0], 3) <= r["median_us"] <= round(pick_us[-1], 3), r
            assert r["median_us"] <= r["default_us"] <= round(max(default_us), 3), r  # the file keeps 3 decimals
    assert len(rows) == count
    assert confirmed + len(failed_defaults) == len(rows)  # every other bucket had a confirmation round
    assert set(failed_defaults) <= DEFAULT_FAILED


def test_every_committed_picks_file_is_checked():
    assert sorted((ROOT / "cache" / "tuned").glob("*.jsonl")) == sorted(p for p, _ in SHIPPED.values())


@pytest.mark.parametrize("gpu", sorted(SHIPPED))
def test_committed_picks_are_valid_variants(gpu):
    path, count = SHIPPED[gpu]
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    assert len(rows) == count
    for r in rows:
        assert r["gpu"] == gpu and r["target"] == "sm_90a" and r["median_us"] > 0
        v = parse_variant(r["variant"])
        backward = r["workload"].endswith(BACKWARD_SUFFIX)
        assert isinstance(v, BackwardVariant) == backward
        assert (can_implement_backward if backward else can_implement)(_spec(r["workload"]), v)[0], r["variant"]


@pytest.mark.parametrize("gpu,precision", [("NVIDIA H200", "bf16"), ("NVIDIA H200", "fp8-block128"), (H100, "bf16"),
                                           (H100, "fp8-block128")])
def test_build_turns_the_committed_picks_into_binaries(tmp_path, gpu, precision):
    url = f"sqlite:///{tmp_path / 'deploy.sqlite'}"
    res = CliRunner().invoke(main, ["build", "--models", "qwen3-30b-a3b", "--target", "sm_90a", "--gpu",
                                    gpu, "--tuned-dir", str(TUNED.parent), "--db", url, "-j", "1",
                                    "--precision", precision])
    assert res.exit_code == 0, res.output
    spec = make_spec("qwen3-30b-a3b", precision=precision)
    served = KernelStore(url).picks(spec, gpu)
    committed = sorted(r["tokens"] for r in picks.read_tuned_file(SHIPPED[gpu][0])
                       if r["workload"] == spec.workload_key)
    assert sorted(served) == committed  # the H200's: all seven buckets (SHIPPED's counts)
    # the binaries built here are the ones that were measured: same content digest as the pick's
    # record (REBUILT: other binaries, for the picks a deliberate change rebuilt since)
    from moe_aot.database import Database

    with Database(url) as db:
        _assert_measured_binaries(db, spec, served, spec.workload_key, gpu)
    again = CliRunner().invoke(main, ["build", "--models", "qwen3-30b-a3b", "--target", "sm_90a", "--gpu",
                                      gpu, "--tuned-dir", str(TUNED.parent), "--db", url,
                                      "--precision", precision])
    assert again.exit_code == 0 and "0 compiled" in again.output


def test_the_re_derivation_uses_confirmation_rounds_in_the_records():
    """When a session's records JSON holds a confirmation round, the picks re-derived from it
    follow the median rule. The round here is made up in the shape of call 11's readings at
    Qwen3-30B 4096 (the pick, GEMM2 in 2-CTA clusters with PDL, read 725 and 747 µs beside the
    default's 698 and 704): that bucket's pick becomes the default, no other line changes."""
    committed = _records(tuple(RECORD_FILES[:3]))  # the sessions before confirmation rounds existed
    spec = make_spec("qwen3-30b-a3b")
    default = default_variant(spec, 4096).name(spec)
    bucket = {r["variant"]: r for r in committed if (r["workload"], r["tokens"]) == (spec.workload_key, 4096)}
    before = derive_from_committed_records(committed)
    pick = next(p for p in before if (p["workload"], p["tokens"]) == (spec.workload_key, 4096))
    assert pick["variant"] != default and pick["variant"].endswith("c2_pdl")
    c2 = pick["variant"][: -len("_pdl")]
    pdl = default + "_pdl"
    members = [(pick["variant"], 725.0, 747.0), (c2, 702.0, 704.0), (pdl, 699.0, 701.0), (default, 698.0, 704.0)]
    order = [(v, a) for v, a, _ in members] + [(v, b) for v, _, b in reversed(members)]
    top = max(r["id"] for r in committed)
    again = [{**bucket[v], "id": top + 1 + i, "median_us": us,
              "stats": {"median_us": us, "confirm": {"round": "r1", "position": i, "size": len(order),
                                                     "record": bucket[v]["id"]}}}
             for i, (v, us) in enumerate(order)]
    lines = derive_from_committed_records(committed + again)
    changed = [(a, b) for a, b in zip(before, lines) if a != b]
    assert len(lines) == len(before) and len(changed) == 1
    [(old, new)] = changed
    assert (old["variant"], new["variant"]) == (pick["variant"], default)
    # medians: the default 698.0 (692.3, 698, 704) beats the PDL twin's 699.0 (692.2, 699, 701)
    assert new["median_us"] == new["default_us"] == 698.0


@pytest.mark.parametrize("gpu", sorted(SHIPPED))
def test_build_backward_turns_the_committed_backward_picks_into_binaries(tmp_path, gpu):
    """`build --backward` compiles the committed backward picks and deploys them; the runtime's
    lookup serves them, and their binaries are the ones that were measured (REBUILT aside)."""
    from moe_aot.database import Database
    from moe_aot.variants import backward_workload

    url = f"sqlite:///{tmp_path / 'deploy.sqlite'}"
    res = CliRunner().invoke(main, ["build", "--models", "qwen3-30b-a3b", "--target", "sm_90a", "--gpu",
                                    gpu, "--tuned-dir", str(TUNED.parent), "--db", url, "-j", "2",
                                    "--tokens", "4096,16384", "--backward"])
    assert res.exit_code == 0, res.output
    assert f"{len(BACKWARD_BUCKETS)} backward pick(s)" in res.output
    spec = make_spec("qwen3-30b-a3b")
    served = KernelStore(url).picks(spec, gpu, backward=True)
    committed = {r["tokens"]: r["variant"] for r in picks.read_tuned_file(SHIPPED[gpu][0])
                 if r["workload"] == backward_workload(spec)}
    assert {t: v.name(spec) for t, v in served.items()} == committed
    with Database(url) as db:
        _assert_measured_binaries(db, spec, served, backward_workload(spec), gpu)
