"""The CPUs a kernel library's host code is built for, and which one each GPU target sits beside.

A kernel library is the GPU code plus a host launcher, and the launcher is machine code for one
CPU: an H100/H200 or B200 server is x86-64, a DGX Spark (GB10) is aarch64. A host's `name` is its
field in toolchain keys (`dsl|cu13.0|sm_121a|aarch64|fmt2|src...`), so libraries for two hosts
never share a key and the runtime refuses a library for another host before it opens it.

DSL-free (the standard library and gemm_limits' stand-in table): the runtime imports it.
"""
from __future__ import annotations

import os
from typing import NamedTuple

from .gemm_limits import STANDINS


class Host(NamedTuple):  # a frozen value; a NamedTuple compiles next to nothing at import
    name: str          # in toolchain keys
    triple: str        # LLVM target triple of the exported launcher object
    llvm_target: str   # the DSL's --host-target
    cross_cc: str      # Debian's cross compiler driver, used when the build machine is another host
    cross_package: str  # the Debian package that has it
    wheel_platform: str  # pip --platform of the DSL's wheels for this host
    elf_machine: int   # e_machine of its ELF files


HOSTS = {
    # Baseline x86-64: the DSL's default host target is the build CPU (AVX-512 code can SIGILL elsewhere).
    "x86-64": Host("x86-64", "x86_64-unknown-linux-gnu", "llvm -mtriple=x86_64-unknown-linux-gnu -mcpu=x86-64",
                   "x86_64-linux-gnu-gcc", "gcc-x86-64-linux-gnu", "manylinux_2_28_x86_64", 62),
    # Baseline Armv8.0-A (LLVM's `generic`): GB10's cores (Cortex-X925/A725, Armv9.2-A) run it, and
    # so does every other aarch64 Linux (Grace, Graviton, qemu). The launcher only packs arguments
    # and calls the driver, so newer ISA extensions would buy nothing and could only SIGILL.
    "aarch64": Host("aarch64", "aarch64-unknown-linux-gnu", "llvm -mtriple=aarch64-unknown-linux-gnu -mcpu=generic",
                    "aarch64-linux-gnu-gcc", "gcc-aarch64-linux-gnu", "manylinux_2_28_aarch64", 183),
}

# The host CPU beside each target's GPU: GB10 exists only in the DGX Spark, an aarch64 machine.
TARGET_HOSTS = {"sm_90a": "x86-64", "sm_100a": "x86-64", "sm_121a": "aarch64"}
# A stand-in runs on its arch's GPU, so beside that GPU's host (sm_121a-standin: an H200's x86-64).
TARGET_HOSTS.update({t: TARGET_HOSTS[s.arch] for t, s in STANDINS.items()})

_MACHINES = {"x86_64": "x86-64", "amd64": "x86-64", "aarch64": "aarch64", "arm64": "aarch64"}


def host_for(target: str) -> Host:
    """The host whose libraries a build for GPU `target` links."""
    return HOSTS[TARGET_HOSTS[target]]


def this_host() -> str:
    """This machine's host name as toolchain keys spell it (an unknown CPU: uname's machine)."""
    machine = os.uname().machine
    return _MACHINES.get(machine.lower(), machine)


def host_of_llvm_target(llvm_target: str) -> str | None:
    """The host name of an artifact's recorded --host-target, None if it names no known host."""
    return next((h.name for h in HOSTS.values() if h.llvm_target == llvm_target), None)
