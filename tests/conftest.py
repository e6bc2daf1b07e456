"""Fixtures shared by the test modules."""
from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def store():
    """The GPU tests' kernel database (MOE_AOT_DB, else the default location), opened by the
    runtime: a module skips when nothing was compiled for this machine; a broken database fails."""
    from moe_aot.dbread import NoDatabaseError
    from moe_aot.runtime.store import KernelStore

    try:
        return KernelStore()
    except NoDatabaseError as exc:
        pytest.skip(f"no kernel database: {exc}")
