"""The one module that owns moe-aot's environment variables and default paths.

MOE_AOT_DB         SQLAlchemy URL of the kernel database (default: SQLite in <repo>/cache/).
MOE_AOT_CACHE_DIR  folder of the default SQLite database, of unpacked kernel libraries and of
                   tuned/ (the tuned picks as text, one JSONL file per GPU); default <checkout>/cache
                   in a source checkout, else $XDG_CACHE_HOME/moe-aot (~/.cache/moe-aot).
                   The DSL's runtime archive for another host (aarch64 for sm_121a, the DGX
                   Spark) is fetched into <cache>/host-runtime/ at the first build for that host.
MOE_AOT_NATIVE_LAUNCH  0 to launch a layer's four kernels from Python instead of through the
                   small C launcher built at first use (runtime/launch.py; default 1).
MOE_AOT_EAGER_GRAPHS  0 to keep the native launcher from replaying repeated eager calls as CUDA
                   graphs of their four launches (runtime/launch.py; default 1).
MOE_AOT_SHIM_STATS 1 to have each kernel library's CUDA runtime shim count its calls and time its
                   launches (read by the shim itself; KernelLibrary.shim_stats reads them back).
"""
from __future__ import annotations

import os
from pathlib import Path

_PACKAGE_DIR = Path(__file__).resolve().parent
REPO_ROOT = _PACKAGE_DIR.parent


def cache_dir() -> Path:
    """MOE_AOT_CACHE_DIR, else <checkout>/cache in a source checkout (editable install), else the
    per-user cache ($XDG_CACHE_HOME or ~/.cache)/moe-aot: an installed package must not write
    into site-packages."""
    raw = os.environ.get("MOE_AOT_CACHE_DIR")
    if raw:
        return Path(raw).expanduser().resolve()
    if (REPO_ROOT / "pyproject.toml").is_file() and (REPO_ROOT / "moe_aot").is_dir():
        return REPO_ROOT / "cache"
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base).expanduser().resolve() / "moe-aot"


def default_db_url() -> str:
    url = os.environ.get("MOE_AOT_DB")
    if url:
        return url
    return f"sqlite:///{cache_dir() / 'moe_aot.sqlite'}"


def native_launch() -> bool:
    return os.environ.get("MOE_AOT_NATIVE_LAUNCH", "1") != "0"


def eager_graphs() -> bool:
    return os.environ.get("MOE_AOT_EAGER_GRAPHS", "1") != "0"


def templates_dir() -> Path:
    """Kernel templates: the repo's templates/ in a checkout, moe_aot/_templates when installed."""
    installed = _PACKAGE_DIR / "_templates"
    return installed if installed.is_dir() else REPO_ROOT / "templates"


def host_runtime_dir() -> Path:
    """The DSL's static runtime archives for hosts other than the build machine's, one folder per
    DSL wheel version and host triple (kernel_build.cross_runtime_archive fills it)."""
    return cache_dir() / "host-runtime"


def tuned_dir() -> Path:
    """The tuned picks as reviewable text, one JSONL file per GPU (committed to the repository)."""
    return cache_dir() / "tuned"
