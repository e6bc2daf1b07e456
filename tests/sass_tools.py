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
