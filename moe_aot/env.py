"""The one module that owns moe-aot's environment variables and default paths.

MOE_AOT_DB         SQLAlchemy URL of the kernel database (default: SQLite in <repo>/cache/).
MOE_AOT_CACHE_DIR  folder of the default SQLite database, of unpacked kernel libraries and of
                   tuned/ (the tuned picks as text, one JSONL file per GPU); default <checkout>/cache
                   in a source checkout, else $XDG_CACHE_HOME/moe-aot (~/.cache/moe-aot).
MOE_AOT_NATIVE_LAUNCH  0 to launch a layer's four kernels from Python instead of through the
                   small C launcher built at first use (runtime/launch.py; default 1).
MOE_AOT_CUDA_HOME  CUDA toolkit root whose lib64/libcudart_static.a links kernel libraries
                   (default: the pinned nvidia-cuda-runtime wheel, then CUDA_HOME, then
                   /usr/local/cuda); only the compiler needs it.
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


def cudart_static() -> Path:
    """CUDA's static runtime, linked into every kernel library. The first that exists of: the
    toolkit MOE_AOT_CUDA_HOME names, the pinned wheel's copy, CUDA_HOME / CUDA_PATH, /usr/local/cuda;
    the first candidate when none exists (the compiler reports it missing)."""
    candidates = []
    if os.environ.get("MOE_AOT_CUDA_HOME"):
        candidates.append(Path(os.environ["MOE_AOT_CUDA_HOME"]) / "lib64" / "libcudart_static.a")
    import importlib.util

    spec = importlib.util.find_spec("nvidia")
    for root in (spec.submodule_search_locations or []) if spec else []:
        candidates.append(Path(root) / "cu13" / "lib" / "libcudart_static.a")
    for var in ("CUDA_HOME", "CUDA_PATH"):
        if os.environ.get(var):
            candidates.append(Path(os.environ[var]) / "lib64" / "libcudart_static.a")
    candidates.append(Path("/usr/local/cuda/lib64/libcudart_static.a"))
    return next((c for c in candidates if c.exists()), candidates[0])


def templates_dir() -> Path:
    """Kernel templates: the repo's templates/ in a checkout, moe_aot/_templates when installed."""
    installed = _PACKAGE_DIR / "_templates"
    return installed if installed.is_dir() else REPO_ROOT / "templates"


def tuned_dir() -> Path:
    """The tuned picks as reviewable text, one JSONL file per GPU (committed to the repository)."""
    return cache_dir() / "tuned"
