"""The CLI through click's test runner, on a real SQLite database with real compiles."""
import cross_tools
import pytest
from click.testing import CliRunner

from moe_aot.cli import main


@pytest.fixture()
def runner(tmp_path, monkeypatch):
    monkeypatch.setenv("MOE_AOT_DB", f"sqlite:///{tmp_path / 'cli.sqlite'}")
    return CliRunner()


def test_every_command_has_help(runner):
    for cmd in ([], ["compile"], ["ls"], ["show"], ["verify"]):
        res = runner.invoke(main, cmd + ["--help"])
        assert res.exit_code == 0 and "Usage" in res.output


def test_compile_ls_show_with_env_default(runner, tmp_path):
    spec = tmp_path / "layer.toml"
    spec.write_text("[[layer]]\nexperts = 8\ntop_k = 2\nhidden = 256\nintermediate = 128\n")
    res = runner.invoke(main, ["compile", "--spec", str(spec), "--tokens", "16", "--jobs", "1"])
    assert res.exit_code == 0, res.output
    assert "4 compiled, 0 failed" in res.output
    res = runner.invoke(main, ["ls"])
    lines = res.output.strip().splitlines()
    assert res.exit_code == 0 and len(lines) == 4
    assert all(line.startswith("moe_") for line in lines)
    name = next(line.split("\t")[0] for line in lines if line.startswith("moe_glu"))
    res = runner.invoke(main, ["show", name])
    assert res.exit_code == 0 and "toolchain:  nvidia-cutlass-dsl==4.8.1" in res.output
    assert "x: BFloat16[?,256] align 16" in res.output
    again = runner.invoke(main, ["compile", "--spec", str(spec), "--tokens", "16"])
    assert again.exit_code == 0 and "already in the database" in again.output


def test_explicit_db_flag(runner, tmp_path):
    cross_tools.require(cross_tools.CROSS_CC)  # sm_121a: the DGX Spark's aarch64 libraries
    url = f"sqlite:///{tmp_path / 'other.sqlite'}"
    res = runner.invoke(main, ["compile", "--experts", "8", "--top-k", "2", "--hidden", "256",
                               "--intermediate", "128", "--target", "sm_121a", "--tokens", "1", "--db", url, "-j", "1"])
    assert res.exit_code == 0, res.output
    res = runner.invoke(main, ["ls", "--db", url, "--target", "sm_121a"])
    assert len(res.output.strip().splitlines()) == 4 and "sm121a" in res.output


@pytest.mark.parametrize("args, message", [
    (["compile", "--model", "llama"], "model must be one of"),
    (["compile", "--model", "qwen3-30b-a3b", "--target", "sm_75"], "target must be one of"),
    (["compile", "--model", "qwen3-30b-a3b", "--precision", "nvfp4"], "not yet supported for sm_90a"),
    (["compile", "--model", "gpt-oss-120b", "--precision", "fp8"], "multiple of 128 for precision fp8"),
    (["compile", "--model", "gpt-oss-120b", "--precision", "mxfp4-w", "--target", "sm_121a"],
     "not yet supported for sm_121a"),
    (["compile", "--experts", "8", "--top-k", "9", "--hidden", "64", "--intermediate", "64"], "must not exceed"),
    (["compile", "--model", "qwen3-30b-a3b", "--tokens", "0,x"], "comma-separated positive integers"),
    (["compile", "--model", "qwen3-30b-a3b", "--variant", "bogus"], "not a layer variant name"),
    (["compile", "--model", "gpt-oss-120b", "--variant",
      "moe_layer_sm90a_bf16_x_swiglu_m64r1_glun64k64s3warp_downn256k64s3warp"], "2880"),
    (["compile"], "say which layers"),
    (["show", "nope"], "no kernel database"),
])
def test_errors_are_one_actionable_sentence(runner, args, message):
    res = runner.invoke(main, args)
    assert res.exit_code != 0
    assert message in res.output
    assert "Traceback" not in res.output


def test_ls_on_missing_and_corrupt_database(runner, tmp_path):
    res = runner.invoke(main, ["ls", "--db", f"sqlite:///{tmp_path / 'missing.sqlite'}"])
    assert res.exit_code != 0 and "no kernel database" in res.output and "Traceback" not in res.output
    bad = tmp_path / "bad.sqlite"
    bad.write_bytes(b"this is not a database" * 100)
    res = runner.invoke(main, ["ls", "--db", f"sqlite:///{bad}"])
    assert res.exit_code != 0 and "Traceback" not in res.output and str(bad) in res.output


def test_verify_without_gpu_says_so(runner):
    import torch

    if torch.cuda.is_available():
        pytest.skip("has a GPU")
    res = runner.invoke(main, ["verify", "--model", "qwen3-30b-a3b"])
    assert res.exit_code != 0 and "needs a CUDA GPU" in res.output


def test_size_flags_override_a_preset_instead_of_adding_a_layer():
    from moe_aot.cli import _specs

    [spec] = _specs(("mixtral-8x7b",), None, "sm_90a", None, 4, None, None, None, None)
    assert (spec.experts, spec.top_k, spec.hidden, spec.intermediate) == (8, 4, 4096, 14336)
    specs = _specs(("qwen3-30b-a3b,mixtral-8x7b",), None, "sm_90a", None, None, 1024, None, None, None)
    assert [(s.experts, s.hidden) for s in specs] == [(128, 1024), (8, 1024)]
    [alone] = _specs((), None, "sm_90a", 8, 2, 256, 128, None, None)  # no preset: the sizes are the layer
    assert (alone.experts, alone.top_k, alone.hidden, alone.intermediate) == (8, 2, 256, 128)


def test_compile_refuses_a_variant_name_of_another_layer(runner):
    other = ("moe_layer_sm90a_bf16_e8k2h4096i14336_swiglu_m64r1_glun128k64s4warp_downn128k64s4warp")
    res = runner.invoke(main, ["compile", "--model", "qwen3-30b-a3b", "--variant", other])
    assert res.exit_code == 1 and "is not one of" in res.output and "e128k8h2048i768" in res.output
    res = runner.invoke(main, ["compile", "--model", "qwen3-30b-a3b", "--target", "sm_121a", "--variant",
                               other.replace("e8k2h4096i14336", "e128k8h2048i768")])
    assert res.exit_code == 1 and "sm121a" in res.output  # a name for another target


def test_ls_refuses_an_unknown_target(runner):
    res = runner.invoke(main, ["ls", "--target", "sm_75"])
    assert res.exit_code == 2 and "sm_75" in res.output and "sm_90a" in res.output


def test_ls_failed_lists_only_failed_kernels(runner, tmp_path):
    from moe_aot.database import Database

    db = Database()  # the runner's MOE_AOT_DB
    db.put_workload("w", {"experts": 8})
    db.put_artifact(name="moe_glu_bad", workload="w", role="glu", target="sm_90a", toolchain="tc",
                    status="failed", error="ptxas: too many resources")
    db.commit_best(workload="w", target="sm_90a", gpu="NVIDIA H200", toolchain="tc", tokens=16,
                   variant="moe_layer_x", median_us=10.0)
    db.close()
    assert "tuned\tw" in runner.invoke(main, ["ls"]).output  # picks are listed without --failed
    res = runner.invoke(main, ["ls", "--failed"])
    assert res.exit_code == 0, res.output
    lines = res.output.strip().splitlines()
    assert lines and all(line.startswith("moe_glu_bad") for line in lines) and "too many resources" in lines[0]


def test_export_to_an_unwritable_folder_is_one_sentence(runner, tmp_path, monkeypatch):
    """export --dir into a folder that cannot be written ends in one sentence naming it, not a
    traceback (root ignores permissions: the write is made to fail)."""
    from moe_aot import picks
    from moe_aot.database import Database

    def refuse(db, directory, gpu=None):
        raise PermissionError(13, "Permission denied", str(directory))

    monkeypatch.setattr(picks, "export_tuned", refuse)
    url = f"sqlite:///{tmp_path / 'k.sqlite'}"
    Database(url).close()
    res = runner.invoke(main, ["export", "--dir", str(tmp_path / "ro"), "--db", url])
    assert res.exit_code == 1, res.output
    assert f"cannot write the tuned picks to {tmp_path / 'ro'}: Permission denied" in res.output
    assert "Traceback" not in res.output
