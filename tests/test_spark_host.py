"""sm_121a (DGX Spark) libraries are aarch64 code linked on this x86-64 machine: their ELF
(machine, needed libraries, entry points), a load under qemu-aarch64 far enough to prove that
they link and that their init and load entry points reach the driver, and the keys and refusals
that keep a library away from the wrong host. No Spark is involved: the load test's libcuda.so.1
is the recording stand-in of tests/cuda_standin.py, a test double used only for this load test."""
import json
import re
import subprocess

import cross_tools
import cuda_standin
import pytest

from moe_aot.hosts import HOSTS, TARGET_HOSTS, host_of_llvm_target, this_host
from moe_aot.runtime import store as store_mod
from moe_aot.runtime.library import KernelLaunchError, KernelLibrary
from moe_aot.runtime.store import KernelMissingError, KernelStore, usable

LIBC_FAMILY = re.compile(r"(libc|libdl|libpthread|librt|libm)\.so\.\d+|ld-linux[-\w.]*\.so\.\d+")
EM_AARCH64 = 183
SPARK_KEY = "nvidia-cutlass-dsl==4.8.1|cu13.0|sm_121a|aarch64|fmt2|srcabc"
NATIVE = this_host() == "aarch64"


def test_sm121a_is_built_for_an_aarch64_host_and_the_others_stay_x86():
    assert TARGET_HOSTS == {"sm_90a": "x86-64", "sm_100a": "x86-64", "sm_121a": "aarch64",
                            "sm_121a-standin": "x86-64"}  # the Spark layer's sm_90a stand-in runs beside an H200
    # the x86-64 host target is the one every existing artifact recorded
    assert HOSTS["x86-64"].llvm_target == "llvm -mtriple=x86_64-unknown-linux-gnu -mcpu=x86-64"
    assert HOSTS["aarch64"].llvm_target == "llvm -mtriple=aarch64-unknown-linux-gnu -mcpu=generic"
    assert host_of_llvm_target(HOSTS["aarch64"].llvm_target) == "aarch64"
    assert host_of_llvm_target("llvm -mtriple=riscv64-unknown-linux-gnu") is None


def test_toolchain_keys_name_the_host(monkeypatch):
    pytest.importorskip("cutlass")
    from moe_aot.compiler import toolchain_key
    from moe_aot.kernel_build import toolchain_fingerprint

    assert re.fullmatch(r"nvidia-cutlass-dsl==4\.8\.1\|cu13\.\d+\|sm_90a\|x86-64\|fmt2\|src\w{12}",
                        toolchain_key("sm_90a"))
    assert "|sm_100a|x86-64|fmt2|" in toolchain_key("sm_100a")
    assert "|sm_121a|aarch64|fmt2|" in toolchain_key("sm_121a")
    # the aarch64 baseline CPU is in the key too (x86-64's keys are those of existing databases)
    from moe_aot import compiler, hosts

    before = compiler.templates_hash("aarch64")
    assert before != compiler.templates_hash()
    spark = hosts.HOSTS["aarch64"]
    monkeypatch.setitem(hosts.HOSTS, "aarch64", spark._replace(llvm_target=spark.llvm_target.replace("generic", "x")))
    assert compiler.templates_hash("aarch64") != before
    assert toolchain_fingerprint("sm_90a")["host_target"] == HOSTS["x86-64"].llvm_target
    assert toolchain_fingerprint("sm_121a")["host_target"] == HOSTS["aarch64"].llvm_target


def test_the_runtime_uses_only_libraries_for_its_own_host(monkeypatch):
    x86_key = SPARK_KEY.replace("sm_121a|aarch64", "sm_90a|x86-64")
    monkeypatch.setattr(store_mod, "this_host", lambda: "x86-64")
    ok, why = usable(SPARK_KEY, "sm_121a", None)
    assert not ok and why.startswith("its host code was built for an aarch64 host and this host is ")
    assert usable(x86_key, "sm_90a", None) == (True, "ok")
    monkeypatch.setattr(store_mod, "this_host", lambda: "aarch64")
    assert usable(SPARK_KEY, "sm_121a", None) == (True, "ok")
    assert not usable(x86_key, "sm_90a", None)[0]


def test_a_missing_cross_compiler_stops_the_build_saying_what_to_install():
    from moe_aot.kernel_build import HostToolchainError, host_toolchain

    other = next(h for h in HOSTS.values() if h.name != this_host())
    with pytest.raises(HostToolchainError, match=r"needs the cross compiler no-such-gcc \(Debian: apt-get install"):
        host_toolchain(other._replace(cross_cc="no-such-gcc"))
    assert host_toolchain(HOSTS[this_host()]) == ("gcc", None)  # the native link, as before


def test_compile_without_the_cross_compiler_says_what_to_install_and_records_nothing(tmp_path, monkeypatch):
    pytest.importorskip("cutlass")
    from click.testing import CliRunner

    from moe_aot import hosts
    from moe_aot.cli import main
    from moe_aot.database import Database

    target = "sm_121a" if this_host() != "aarch64" else "sm_90a"
    other = hosts.host_for(target)
    monkeypatch.setitem(hosts.HOSTS, other.name, other._replace(cross_cc="no-such-gcc"))
    url = f"sqlite:///{tmp_path / 'k.sqlite'}"
    res = CliRunner().invoke(main, ["compile", "--experts", "8", "--top-k", "2", "--hidden", "256",
                                    "--intermediate", "128", "--target", target, "--tokens", "1", "--db", url])
    assert res.exit_code == 1 and f"apt-get install {other.cross_package}" in res.output, res.output
    with Database(url) as db:
        assert db.list_artifacts() == []  # no kernel recorded as failed


@pytest.fixture(scope="module")
def spark(tmp_path_factory):
    """The routing and combine kernels of a tiny layer for sm_121a, as `moe-aot compile` stores
    them (a database under the sm_121a toolchain key) and as artifact folders."""
    if not NATIVE:
        cross_tools.require(cross_tools.CROSS_CC)
    pytest.importorskip("cutlass")
    from moe_aot.compiler import compile_into, toolchain_key
    from moe_aot.database import Database
    from moe_aot.spec import make_spec
    from moe_aot.variants import default_variant

    spec = make_spec(experts=8, top_k=2, hidden=256, intermediate=128, target="sm_121a")
    kernels = [kv for kv in default_variant(spec, 16).kernels(spec) if kv.role in ("routing", "combine")]
    folder = tmp_path_factory.mktemp("spark")
    url = f"sqlite:///{folder / 'k.sqlite'}"
    with Database(url) as db, pytest.MonkeyPatch.context() as mp:
        import moe_aot.compiler as comp

        only, real = {kv.name for kv in kernels}, comp.kernels_for
        mp.setattr(comp, "kernels_for", lambda pairs: [(s, kv) for s, kv in real(pairs) if kv.name in only])
        results = compile_into(db, [(spec, default_variant(spec, 16))], jobs=1)
        assert len(results) == 2 and all(r.artifact is not None for r in results), [r.error for r in results]
        tool = toolchain_key("sm_121a")
        for r in results:
            r.artifact.write_dir(folder / r.kernel.role)
            assert db.get_artifact(r.kernel.name, tool).status == "ok"
    return url, folder, {r.kernel.role: r.artifact for r in results}


def _readelf(*args) -> str:
    return subprocess.run(["readelf", *args], capture_output=True, text=True, check=True).stdout


def test_sm121a_libraries_are_aarch64_needing_only_libc_with_their_entry_points(spark):
    _, folder, arts = spark
    for role, art in arts.items():
        lib = art.library
        assert lib[:4] == b"\x7fELF" and lib[4] == 2  # 64-bit
        assert int.from_bytes(lib[18:20], "little") == EM_AARCH64
        path = folder / role / f"lib{art.name}.so"
        needed = re.findall(r"\(NEEDED\)\s+Shared library: \[([^\]]+)\]", _readelf("-d", str(path)))
        assert needed and all(LIBC_FAMILY.fullmatch(n) for n in needed), needed
        syms = _readelf("--dyn-syms", "-W", str(path))
        defined = {ln.split()[-1] for ln in syms.splitlines() if " FUNC " in ln and " GLOBAL " in ln
                   and " UND " not in ln}
        assert set(art.meta["host_abi"].values()) <= defined, (art.meta["host_abi"], defined)
        assert not re.search(r"\b(cudaMalloc|cudaLaunchKernelExC|__cudaRegisterFatBinary)\b", syms)
        assert art.meta["toolchain"]["host_target"] == HOSTS["aarch64"].llvm_target
        # the cubin is still the GPU's: sm_121 in its ELF flags
        assert (int.from_bytes(art.cubin[48:52], "little") >> 8) & 0xFF == 121


def test_the_aarch64_runtime_archive_holds_only_aarch64_objects(spark):
    from moe_aot.kernel_build import cross_runtime_archive, elf_machines

    if NATIVE:
        pytest.skip("this machine is the aarch64 host: its DSL's own archive is linked")
    archive = cross_runtime_archive(HOSTS["aarch64"])
    assert elf_machines(archive.read_bytes()) == {EM_AARCH64}
    assert "nvidia-cutlass-dsl-libs-cu13-4.8.1" in str(archive)  # the installed DSL's version
    assert elf_machines(b"not an archive") == set()


LOADER = r"""
#include <dlfcn.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
typedef void (*packed_fn)(void **);
/* argv: stand-in libcuda.so.1, kernel library, init, load_to_device, run symbol, tensor structs' sizes */
int main(int argc, char **argv) {
    void *cuda = dlopen(argv[1], RTLD_NOW | RTLD_GLOBAL);
    if (!cuda) { printf("standin: %s\n", dlerror()); return 2; }
    void *lib = dlopen(argv[2], RTLD_NOW | RTLD_LOCAL);
    if (!lib) { printf("library: %s\n", dlerror()); return 3; }
    packed_fn init = (packed_fn)dlsym(lib, argv[3]), load = (packed_fn)dlsym(lib, argv[4]);
    void (*run)(void **, int32_t) = (void (*)(void **, int32_t))dlsym(lib, argv[5]);
    const char *(*log)(void) = (const char *(*)(void))dlsym(cuda, "standin_log");
    if (!init || !load || !run || !log) { printf("missing entry point\n"); return 4; }
    void *handle = 0, *handle_ptr = &handle;
    int32_t ret = -1, dev = 0;
    void *a[] = {&handle_ptr, &ret};
    init(a);
    printf("init %d\n", ret);
    void *b[] = {&handle_ptr, &dev, &ret};
    ret = -1;
    load(b);
    printf("load_to_device %d\n", ret);
    /* one launch: each tensor struct's bytes come in hex, packed by the runtime's own ctypes types */
    static int64_t structs[16][8];
    void *args[20];
    int n = 0;
    for (int i = 6; i < argc && n < 16; i++, n++) {
        unsigned char *bytes = (unsigned char *)structs[n];
        for (size_t j = 0; 2 * j + 1 < strlen(argv[i]) && j < sizeof structs[n]; j++)
            sscanf(argv[i] + 2 * j, "%2hhx", &bytes[j]);
        args[n] = structs[n];
    }
    void *stream = (void *)0x5151;
    args[n++] = &stream;
    ret = -1;
    args[n++] = &ret;
    run(args, n);
    printf("run %d\n", ret);
    printf("%s", log());
    return 0;
}
"""


def _packed_tensor(arg: dict) -> str:
    """A tensor argument's struct as the runtime fills it (LP64 lays it out alike on x86-64 and
    aarch64): a fake device pointer, every dynamic extent 64, every dynamic stride 64."""
    import ctypes

    from moe_aot.runtime.library import _struct_type

    s = _struct_type(arg)()
    s.data = 0x10000
    for j in range(len(arg["dynamic_shape_modes"])):
        s.shape[j] = 64
    for j in range(len(arg["dynamic_stride_modes"])):
        s.stride[j] = 64
    return ctypes.string_at(ctypes.addressof(s), ctypes.sizeof(s)).hex()


def test_sm121a_libraries_load_under_qemu_and_reach_the_driver(spark, tmp_path):
    """The library is dlopened by an aarch64 program beside the stand-in libcuda.so.1 (a test
    double: it only records calls), its init and load_to_device entry points run, and so does one
    launch: the DSL's aarch64 runtime and the shim were linked in and call the driver API."""
    cc = "gcc" if NATIVE else cross_tools.CROSS_CC
    prefix = [] if NATIVE else [cross_tools.QEMU, "-L", cross_tools.SYSROOT]
    if not NATIVE:
        cross_tools.require(cross_tools.CROSS_CC, cross_tools.QEMU)
    standin = cuda_standin.build(tmp_path, cc=cc)
    loader = tmp_path / "loader"
    (tmp_path / "loader.c").write_text(LOADER)
    subprocess.run([cc, "-O1", "-Wall", "-Werror", "-o", str(loader), str(tmp_path / "loader.c"), "-ldl"],
                   check=True, capture_output=True, text=True)
    assert int.from_bytes(loader.read_bytes()[18:20], "little") == EM_AARCH64
    _, folder, arts = spark
    for role, art in arts.items():
        abi = art.meta["host_abi"]
        tensors = [a for a in art.meta["args"] if a["kind"] == "tensor"]
        cmd = prefix + [str(loader), str(standin), str(folder / role / f"lib{art.name}.so"), abi["init"],
                        abi["load_to_device"], abi["run"]] + [_packed_tensor(a) for a in tensors]
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        out = res.stdout
        assert res.returncode == 0, (res.returncode, out, res.stderr)
        assert "init 0\n" in out and "load_to_device 0\n" in out and "run 0\n" in out, out
        # the fatbin handed to the driver (its magic), each kernel looked up by name
        assert re.search(r"^cuLibraryLoadData 0xba55ed50 ", out, re.M), out
        for kernel in art.meta["kernels"]:
            assert re.search(rf"^cuLibraryGetKernel 0x\w+ {re.escape(kernel)}$", out, re.M), out
        launches = [ln for ln in out.splitlines() if ln.startswith("cuLaunchKernelEx")]
        assert len(launches) == 1 and "stream=0x5151" in launches[0], out


def test_this_x86_runtime_refuses_the_spark_libraries_in_one_sentence(spark):
    if NATIVE:
        pytest.skip("on the aarch64 host these libraries are this host's own")
    url, folder, arts = spark
    art = arts["routing"]
    with pytest.raises(KernelMissingError, match=r"built for an aarch64 host and this host is x86-64, so it cannot "
                                                 r"be loaded here"):
        KernelStore(url).load(art.name, "sm_121a")
    # loading the folder directly is refused before dlopen (which would fail with an ELF error)
    with pytest.raises(KernelLaunchError) as exc:
        KernelLibrary.from_dir(folder / "routing", device=0)
    assert str(exc.value) == (f"{art.name}: its host code was built for an aarch64 host and this host is x86-64, "
                              "so it cannot be loaded here (sm_121a libraries are for the DGX Spark's aarch64 host)")
    assert json.loads((folder / "routing" / "meta.json").read_text())["toolchain"]["arch"] == "sm_121a"
