"""A test double of the CUDA driver: a stand-in libcuda.so.1 (soname libcuda.so.1, built with gcc)
that records every call with its arguments, for checking the CUDA runtime shim on a CPU machine.

It is loaded RTLD_GLOBAL into a fresh process before a kernel library, so the shim's
dlopen("libcuda.so.1") finds it by its soname. It resolves functions by cuGetProcAddress_v2
from its own table, answers out-parameters with recognisable fake handles (0x1000 + the number
of the call) and keeps one current context, so the primary-context path can be checked too.
`standin_log()` returns the calls as text lines, `name arg arg ...`; `standin_reset()` clears
them. Nothing in it talks to a GPU.
"""
from __future__ import annotations

import subprocess
from pathlib import Path

# name -> argument kinds: p pointer/handle (printed %p), i int, u unsigned, z size_t, U unsigned
# long long, b unsigned char, P out-handle (written 0x1000 + call number), I out-int (written 7), F out-float.
SIMPLE = {
    "cuInit": "u", "cuDriverGetVersion": "I", "cuDeviceGet": "Ii", "cuDeviceGetCount": "I",
    "cuCtxGetDevice": "I", "cuDevicePrimaryCtxRetain": "Pi", "cuCtxSynchronize": "",
    "cuKernelSetAttribute": "iipi", "cuKernelGetAttribute": "Iipi", "cuKernelGetFunction": "Pp",
    "cuOccupancyMaxActiveBlocksPerMultiprocessor": "Ipiz",
    "cuLibraryLoadFromFile": "Ppppuppu", "cuLibraryUnload": "p", "cuLibraryGetKernelCount": "Ip",
    "cuLibraryGetGlobal": "PPpp", "cuLibraryGetManaged": "PPpp", "cuLibraryGetUnifiedFunction": "Ppp",
    "cuMemAlloc": "Pz", "cuMemFree": "p", "cuMemAllocAsync": "Pzp", "cuMemFreeAsync": "pp",
    "cuMemAllocHost": "Pz", "cuMemFreeHost": "p", "cuMemAllocManaged": "Pzu", "cuMemcpy": "ppz",
    "cuMemcpyAsync": "ppzp", "cuMemsetD8": "pbz", "cuMemsetD8Async": "pbzp",
    "cuStreamCreate": "Pu", "cuStreamDestroy": "p", "cuStreamSynchronize": "p", "cuStreamWaitEvent": "ppu",
    "cuStreamAddCallback": "pppu", "cuStreamBeginCapture": "pi", "cuStreamBeginCapture_v2": "pi",
    "cuStreamEndCapture": "pP",
    "cuEventCreate": "Pu", "cuEventDestroy": "p", "cuEventRecord": "pp", "cuEventElapsedTime": "Fpp",
    "cuGraphInstantiateWithFlags": "PpU", "cuGraphLaunch": "pp", "cuGraphDestroy": "p",
    "cuGraphExecDestroy": "p", "cuProfilerStart": "", "cuProfilerStop": "",
}
_C = {"b": "unsigned char", "p": "void *", "i": "int", "u": "unsigned", "z": "size_t", "U": "unsigned long long",
      "P": "void **", "I": "int *", "F": "float *"}
_FMT = {"b": "%u", "p": "%p", "i": "%d", "u": "%u", "z": "%zu", "U": "%llu", "P": "%p", "I": "%p", "F": "%p"}

_HEAD = r"""
#include <stdarg.h>
#include <stdio.h>
#include <string.h>
static char log_buf[1 << 20];
static size_t log_len;
static int calls;
static void *current_ctx;
int standin_fail = 0; /* a CUresult every recorded call returns, for the error paths */
int standin_fail_launch_once = 0; /* a CUresult the next cuLaunchKernelEx alone returns */
int standin_ctx_queries = 0; /* cuCtxGetCurrent calls (not in the log: every context check makes one) */
static void rec(const char *fmt, ...) {
    va_list ap; va_start(ap, fmt);
    log_len += vsnprintf(log_buf + log_len, sizeof log_buf - log_len, fmt, ap);
    va_end(ap);
    if (log_len < sizeof log_buf - 1) log_buf[log_len++] = '\n';
    calls++;
}
const char *standin_log(void) { log_buf[log_len] = 0; return log_buf; }
void standin_reset(void) { log_len = 0; }
void standin_set_ctx(void *ctx) { current_ctx = ctx; }
int standin_capturing = 0; /* the capture status cuStreamIsCapturing answers */
int cuStreamIsCapturing(void *stream, int *status) { rec("cuStreamIsCapturing %p", stream);
    *status = standin_capturing; return 0; }
int cuCtxGetCurrent(void **ctx) { standin_ctx_queries++; *ctx = current_ctx; return 0; }
int cuCtxSetCurrent(void *ctx) { rec("cuCtxSetCurrent %p", ctx); current_ctx = ctx; return 0; }
int cuDeviceGetAttribute(int *v, int attr, int dev) {
    rec("cuDeviceGetAttribute %d %d", attr, dev); *v = attr == 97 ? 232448 : 1; return standin_fail; }
int cuLibraryLoadData(void **lib, const void *code, int *jo, void **jv, unsigned nj, int *lo, void **lv,
                      unsigned nl) {
    unsigned magic; memcpy(&magic, code, 4);
    rec("cuLibraryLoadData %#x %p %p %u %p %p %u", magic, jo, jv, nj, lo, lv, nl);
    *lib = (void *)(0x1000L + calls); return standin_fail; }
int cuLibraryGetKernel(void **k, void *lib, const char *name) {
    rec("cuLibraryGetKernel %p %s", lib, name); *k = (void *)(0x1000L + calls); return standin_fail; }
typedef struct { int id; int pad; unsigned v[16]; } attr_t;
typedef struct { unsigned g[3], b[3], smem; void *stream; attr_t *attrs; unsigned n; } cfg_t;
int cuLaunchKernelEx(const cfg_t *c, void *f, void **args, void **extra) {
    char a[512] = ""; size_t o = 0;
    for (unsigned i = 0; i < c->n; i++)
        o += snprintf(a + o, sizeof a - o, " attr%d=%u,%u,%u", c->attrs[i].id, c->attrs[i].v[0], c->attrs[i].v[1],
                      c->attrs[i].v[2]);
    rec("cuLaunchKernelEx grid=%u,%u,%u block=%u,%u,%u smem=%u stream=%p f=%p args=%p extra=%p n=%u%s",
        c->g[0], c->g[1], c->g[2], c->b[0], c->b[1], c->b[2], c->smem, c->stream, f, args, extra, c->n, a);
    if (standin_fail_launch_once) { int e = standin_fail_launch_once; standin_fail_launch_once = 0; return e; }
    return standin_fail; }
int cuGetErrorName(int e, const char **s) { if (e == 1) { *s = "CUDA_ERROR_INVALID_VALUE"; return 0; } return 1; }
int cuGetErrorString(int e, const char **s) { if (e == 1) { *s = "invalid argument"; return 0; } return 1; }
"""


def _simple(name: str, kinds: str) -> str:
    params = ", ".join(f"{_C[k]} a{i}" for i, k in enumerate(kinds)) or "void"
    fmt = " ".join(_FMT[k] for k in kinds)
    args = "".join(f", ({'void *' if _FMT[k] == '%p' else _C[k]})a{i}" for i, k in enumerate(kinds))
    outs = "".join(
        f" *a{i} = (void *)(0x1000L + calls);" if k == "P" else f" *a{i} = 7;" if k == "I" else
        f" *a{i} = 1.5f;" if k == "F" else "" for i, k in enumerate(kinds))
    return (f"int {name}({params}) {{ rec(\"{name}{' ' if kinds else ''}{fmt}\"{args});{outs} "
            f"return standin_fail; }}\n")


def source() -> str:
    names = list(SIMPLE) + ["cuCtxGetCurrent", "cuCtxSetCurrent", "cuStreamIsCapturing", "cuDeviceGetAttribute",
                            "cuLibraryLoadData",
                            "cuLibraryGetKernel", "cuLaunchKernelEx", "cuGetErrorName", "cuGetErrorString"]
    table = ",\n".join(f'    {{"{n}", (void *){n}}}' for n in names)
    return (_HEAD + "".join(_simple(n, k) for n, k in SIMPLE.items())
            + f"static struct {{ const char *name; void *fn; }} table[] = {{\n{table}\n}};\n"
            + r"""
int cuGetProcAddress_v2(const char *sym, void **fn, int version, unsigned long long flags, int *status) {
    rec("cuGetProcAddress_v2 %s %d %llu", sym, version, flags);
    for (size_t i = 0; i < sizeof table / sizeof table[0]; i++)
        if (!strcmp(table[i].name, sym)) { *fn = table[i].fn; if (status) *status = 0; return 0; }
    *fn = 0; if (status) *status = 1; return 500;
}
""")


def build(folder: Path, cc: str = "gcc") -> Path:
    """Compile the stand-in into folder/libcuda.so.1 with `cc` (a cross compiler for another
    host's load test); its path."""
    src, so = Path(folder) / "cuda_standin.c", Path(folder) / "libcuda.so.1"
    src.write_text(source())
    subprocess.run([cc, "-shared", "-fPIC", "-O1", "-Wl,-soname,libcuda.so.1", "-o", str(so), str(src)],
                   check=True, capture_output=True, text=True)
    return so
