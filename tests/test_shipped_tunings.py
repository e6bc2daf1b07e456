"""The tuned picks committed as text (cache/tuned/*.jsonl): derived from the committed records,
never slower than the default measured beside them, turned back into binaries on a CPU machine,
and found by the runtime's lookup for that GPU."""
import json
from datetime import datetime
from pathlib import Path

from click.testing import CliRunner

from moe_aot import tuner
from moe_aot.cli import main
from moe_aot.database import RecordRow
from moe_aot.runtime.store import KernelStore
from moe_aot.spec import make_spec
from moe_aot.variants import LayerVariant, can_implement, default_variant

ROOT = Path(__file__).resolve().parents[1]
TUNED = ROOT / "cache" / "tuned" / "NVIDIA_H200.jsonl"
RECORDS = ROOT / "tools" / "results" / "tuning_2026-11-29" / "all_records.json"
MODELS = ("qwen3-30b-a3b", "qwen3-235b-a22b", "gpt-oss-120b", "deepseek-v3", "mixtral-8x7b")


def _spec(workload):
    return next(make_spec(m) for m in MODELS if make_spec(m).workload_key == workload)


def derive_from_committed_records() -> list[dict]:
    """The H200 picks from the session's records (which predate content keys: the default is
    found by its name), as `moe-aot export` writes them."""
    recs = [RecordRow(id=r["id"], workload=r["workload"], target="sm_90a", toolchain="", gpu=r["gpu"],
                      driver=r["driver"], tokens=r["tokens"], variant=r["variant"], content=None,
                      status=r["status"], median_us=r["median_us"], stats={}, rel_err=r["rel_err"], error=None,
                      created_at=datetime.fromisoformat(r["created_at"]))
            for r in json.loads(RECORDS.read_text())]
    lines = []
    for w, g, n in sorted({(r.workload, r.gpu, r.tokens) for r in recs}):
        spec = _spec(w)
        default = default_variant(spec, n).name(spec)
        best, base = tuner.choose_pick([r for r in recs if (r.workload, r.gpu, r.tokens) == (w, g, n)], default)
        lines.append(tuner.pick_line(tuner.Pick(w, "sm_90a", g, n, best.variant, best.median_us, best.id, "",
                                                default, base.median_us if base.status == "ok" else None)))
    return lines


def test_committed_picks_are_derived_from_the_records_and_never_slower_than_the_default():
    rows = tuner.read_tuned_file(TUNED)  # refuses a pick slower than its default's record
    assert rows == derive_from_committed_records()
    recs = json.loads(RECORDS.read_text())
    for r in rows:
        bucket = [x for x in recs if (x["workload"], x["tokens"]) == (r["workload"], r["tokens"]) and x["status"] == "ok"]
        spec = _spec(r["workload"])
        assert r["default"] == default_variant(spec, r["tokens"]).name(spec)
        [default_us] = [x["median_us"] for x in bucket if x["variant"] == r["default"]]
        assert r["median_us"] == round(min(x["median_us"] for x in bucket), 3) <= round(default_us, 3), r


def test_committed_picks_are_valid_variants():
    rows = [json.loads(line) for line in TUNED.read_text().splitlines() if line.strip()]
    assert len(rows) == 35  # five models x seven buckets
    for r in rows:
        assert r["gpu"] == "NVIDIA H200" and r["target"] == "sm_90a" and r["median_us"] > 0
        v = LayerVariant.parse(r["variant"])
        assert can_implement(_spec(r["workload"]), v)[0], r["variant"]


def test_build_turns_the_committed_picks_into_binaries(tmp_path):
    url = f"sqlite:///{tmp_path / 'deploy.sqlite'}"
    res = CliRunner().invoke(main, ["build", "--models", "qwen3-30b-a3b", "--target", "sm_90a", "--gpu",
                                    "NVIDIA H200", "--tuned-dir", str(TUNED.parent), "--db", url, "-j", "1"])
    assert res.exit_code == 0, res.output
    picks = KernelStore(url).picks(make_spec("qwen3-30b-a3b"), "NVIDIA H200")
    assert sorted(picks) == [1, 16, 64, 256, 1024, 4096, 16384]
    again = CliRunner().invoke(main, ["build", "--models", "qwen3-30b-a3b", "--target", "sm_90a", "--gpu",
                                      "NVIDIA H200", "--tuned-dir", str(TUNED.parent), "--db", url])
    assert again.exit_code == 0 and "0 compiled" in again.output
