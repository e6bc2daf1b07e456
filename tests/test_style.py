"""The house-style check: `ruff check` over the code with the configuration in pyproject.toml
(pyflakes, pycodestyle, import order). The `test` extra installs ruff, so CI runs it."""
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _ruff() -> list[str]:
    exe = shutil.which("ruff", path=str(Path(sys.executable).parent)) or shutil.which("ruff")
    assert exe, "ruff is not installed: pip install -e '.[test]' installs it"
    return [exe]


def test_ruff_passes_on_the_code():
    res = subprocess.run(_ruff() + ["check", "moe_aot", "templates", "tools", "tests"], cwd=ROOT,
                         capture_output=True, text=True)
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-2000:]


def test_ruff_would_catch_an_unused_import(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("import os\n")
    res = subprocess.run(_ruff() + ["check", "--config", str(ROOT / "pyproject.toml"), str(bad)],
                         capture_output=True, text=True)
    assert res.returncode != 0 and "F401" in res.stdout
