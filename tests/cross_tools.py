"""The aarch64 tools that sm_121a (DGX Spark) builds and their load test need on an x86-64
machine: Debian's gcc-aarch64-linux-gnu (the link) and qemu-user (running aarch64 code). Without
them those tests skip, naming what to install; in CI, where .ci/run installs both, a missing one
fails the test instead, so a green CI never means the Spark path went untested."""
import os
import shutil

import pytest

from moe_aot.hosts import HOSTS, this_host

CROSS_CC = HOSTS["aarch64"].cross_cc
QEMU = "qemu-aarch64"
SYSROOT = "/usr/aarch64-linux-gnu"  # Debian's aarch64 libc, for qemu's -L
PACKAGES = {CROSS_CC: "gcc-aarch64-linux-gnu", QEMU: "qemu-user"}


def require(*tools: str) -> None:
    """Skip (fail in CI) unless every tool is on PATH; on an aarch64 machine nothing is needed."""
    if this_host() == "aarch64":
        return
    missing = [t for t in tools if shutil.which(t) is None]
    if missing:
        why = "needs " + ", ".join(f"{t} (apt-get install {PACKAGES[t]})" for t in missing)
        if os.environ.get("CI"):
            pytest.fail(f"{why}: .ci/run installs it")
        pytest.skip(why)
