"""Locating CUDA's binary tools for the SASS and resource-usage checks of the compile tests."""
import shutil
from pathlib import Path


def cuobjdump():
    """cuobjdump of the CUDA wheels the DSL installs (nvidia/cu*/bin), else from PATH, else None."""
    try:
        import nvidia

        for base in nvidia.__path__:
            for path in sorted(Path(base).glob("cu*/bin/cuobjdump")):
                return str(path)
    except ImportError:
        pass
    return shutil.which("cuobjdump")


def sass_of(cubin: bytes, path: Path):
    """The SASS of a cubin (written to ``path`` first), or None where no cuobjdump is installed."""
    import subprocess

    tool = cuobjdump()
    if not tool:
        return None
    Path(path).write_bytes(cubin)
    return subprocess.run([tool, "-sass", str(path)], capture_output=True, text=True, check=True).stdout
