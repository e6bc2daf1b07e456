"""The tuned picks committed as text (cache/tuned/*.jsonl) turn back into binaries on a CPU
machine, and the runtime's lookup then finds them for that GPU."""
import json
from pathlib import Path

from click.testing import CliRunner

from moe_aot.cli import main
from moe_aot.runtime.store import KernelStore
from moe_aot.spec import make_spec
from moe_aot.variants import LayerVariant, can_implement

TUNED = Path(__file__).resolve().parents[1] / "cache" / "tuned" / "NVIDIA_H200.jsonl"


def test_committed_picks_are_valid_variants():
    rows = [json.loads(line) for line in TUNED.read_text().splitlines() if line.strip()]
    assert len(rows) == 35  # five models x seven buckets
    for r in rows:
        assert r["gpu"] == "NVIDIA H200" and r["target"] == "sm_90a" and r["median_us"] > 0
        v = LayerVariant.parse(r["variant"])
        spec = next(make_spec(m) for m in ("qwen3-30b-a3b", "qwen3-235b-a22b", "gpt-oss-120b", "deepseek-v3",
                                           "mixtral-8x7b") if make_spec(m).workload_key == r["workload"])
        assert can_implement(spec, v)[0], r["variant"]


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
