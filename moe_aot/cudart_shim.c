/* The CUDA runtime entry points a kernel library needs, over the CUDA driver API.
 *
 * A kernel library is the DSL's exported host launcher plus the two members of the DSL's static
 * runtime (libcuda_dialect_runtime_static.a) that it pulls in, CudaDialectRuntime.c.o and
 * cudaLibrarys_generated.c.o. Those call the 50 `cuda*` functions below; this file is all of
 * them, so the library needs no cudart (CUDA's static runtime is ~700 KB of every library).
 * The link uses -z defs: a future DSL that needs one more function fails the build, it does not
 * produce a library that breaks at run time.
 *
 * Semantics follow cudart where a kernel library can observe them:
 * - the driver (libcuda.so.1) is opened at the first call, as cudart does, so a library loads
 *   (dlopen) on a machine without a driver and its first call returns cudaErrorInsufficientDriver;
 *   driver functions are resolved by cuGetProcAddress at CUDA 13.0 (their 13.0 signatures);
 * - calls that need a context use the thread's current one, else retain the current device's
 *   primary context and make it current (cudart's lazy init); the current device is per thread,
 *   0 until cudaSetDevice;
 * - cudaStream_t, cudaEvent_t, cudaGraph_t, cudaGraphExec_t, cudaLibrary_t and cudaKernel_t are
 *   the driver's handles; cudaLaunchConfig_t's attributes have the driver's layout and ids, so
 *   they pass through (PDL's programmatic stream serialization, cluster dimensions);
 * - a cudaError_t is the CUresult of the failing driver call (the runtime's codes equal the
 *   driver's for every error the driver returns); every failure is the thread's last error
 *   (cudaGetLastError returns and clears it); names and strings come from cuGetErrorName /
 *   cuGetErrorString, with the runtime's own for the codes only the runtime has.
 *
 * What a kernel library's host code asks of it, read from the DSL's exported objects (nm, objdump):
 * its load (cuda_init, load_to_device) calls cudaLibraryLoadData, cudaLibraryGetKernel,
 * cudaGetDevice, cudaDeviceGetAttribute, cudaFuncSetAttribute / cudaKernelSetAttributeForDevice and
 * cuKernelGetAttribute (through cudaGetDriverEntryPointByVersion, resolved once); a launch calls
 * cudaLaunchKernelExC and nothing else (TMA descriptors are bit-packed by the host code itself, no
 * cuTensorMapEncode*). So a launch is one cuLaunchKernelEx, plus a cuCtxGetCurrent only where the
 * stream needs a current context. With MOE_AOT_SHIM_STATS=1 in the environment every entry point
 * counts its calls and the launches time themselves (moe_aot_shim_stats below, one copy per library).
 *
 * tests/test_cudart_shim.py checks each function's driver call and arguments against a
 * recording stand-in libcuda.so.1, and the types below against CUDA's headers where present.
 */
#include <dlfcn.h>
#include <pthread.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define SHIM_CUDA_VERSION 13000 /* the driver API version whose signatures are declared here */
#define EXPORT /* visible in a test build; the kernel link compiles with -fvisibility=hidden */

/* -- the driver's types, as far as these calls need them (checked against cuda.h by a test) -- */
typedef int shim_result;          /* CUresult; 0 = CUDA_SUCCESS */
typedef int shim_device;          /* CUdevice */
typedef void *shim_handle;        /* CUcontext, CUstream, CUevent, CUgraph, CUgraphExec, CUlibrary, CUkernel */
typedef unsigned long long shim_devptr; /* CUdeviceptr */

typedef struct { unsigned x, y, z; } shim_dim3;
typedef struct {  /* cudaLaunchAttribute == CUlaunchAttribute: id, padding, a 64-byte value union */
    int id;
    char pad[8 - sizeof(int)];
    char value[64];
} shim_launch_attribute;
typedef struct {  /* cudaLaunchConfig_t */
    shim_dim3 gridDim, blockDim;
    size_t dynamicSmemBytes;
    shim_handle stream;
    shim_launch_attribute *attrs;
    unsigned numAttrs;
} shim_runtime_launch_config;
typedef struct {  /* CUlaunchConfig */
    unsigned gridDimX, gridDimY, gridDimZ, blockDimX, blockDimY, blockDimZ, sharedMemBytes;
    shim_handle hStream;
    shim_launch_attribute *attrs;
    unsigned numAttrs;
} shim_driver_launch_config;

enum {
    cudaSuccess = 0, cudaErrorInvalidValue = 1, cudaErrorInitializationError = 3,
    cudaErrorStubLibrary = 34, cudaErrorInsufficientDriver = 35, cudaErrorInvalidDeviceFunction = 98,
    cudaErrorUnknown = 999,
};
#define CU_GET_PROC_ADDRESS_DEFAULT 0ULL

/* -- the driver, opened and resolved lazily -------------------------------------------------- */
typedef shim_result (*get_proc_fn)(const char *, void **, int, unsigned long long, int *);
static pthread_once_t driver_once = PTHREAD_ONCE_INIT;
static get_proc_fn driver_get_proc;
static int driver_status = cudaErrorInsufficientDriver; /* cudaSuccess once cuInit(0) succeeded */

static void open_driver(void) {
    void *lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (!lib) return;
    driver_get_proc = (get_proc_fn)dlsym(lib, "cuGetProcAddress_v2");
    if (!driver_get_proc) return;
    shim_result (*init)(unsigned) = NULL;
    int found = 0;
    if (driver_get_proc("cuInit", (void **)&init, SHIM_CUDA_VERSION, CU_GET_PROC_ADDRESS_DEFAULT, &found) || !init)
        return;
    driver_status = init(0);
}

static int driver(void) {
    pthread_once(&driver_once, open_driver);
    return driver_status;
}

/* A driver function by its CUDA 13.0 name, resolved once (threads racing store the same value). */
static void *resolve(void *volatile *slot, const char *name) {
    void *fn = __atomic_load_n(slot, __ATOMIC_ACQUIRE);
    if (fn) return fn;
    int found = 0;
    if (driver() != cudaSuccess || driver_get_proc(name, &fn, SHIM_CUDA_VERSION, CU_GET_PROC_ADDRESS_DEFAULT, &found)
        || !fn)
        return NULL;
    __atomic_store_n(slot, fn, __ATOMIC_RELEASE);
    return fn;
}

static __thread int last_error;
static __thread int current_device; /* the thread's device until a context is current */

static int fail(int err) {
    if (err != cudaSuccess) last_error = err;
    return err;
}

/* DRV(type, name): a static pointer to driver function `name` of function type `type`, or a
   return of the reason it is missing from the calling shim function. */
#define DRV(type, name)                                                              \
    static void *volatile slot_##name;                                               \
    __typeof__(type) name = (__typeof__(type))resolve(&slot_##name, #name);          \
    if (!name) return fail(driver() != cudaSuccess ? driver() : cudaErrorStubLibrary)

#define CALL(expr) return fail((int)(expr))

static int device_handle(int ordinal, shim_device *dev) {
    DRV(shim_result (*)(shim_device *, int), cuDeviceGet);
    return fail(cuDeviceGet(dev, ordinal));
}

/* The primary context of device `ordinal`, retained once per device for the process's life
   (cudart keeps it until exit too) and made current. */
static shim_handle primary[64];
static pthread_mutex_t primary_lock = PTHREAD_MUTEX_INITIALIZER;

static int set_primary(int ordinal) {
    DRV(shim_result (*)(shim_handle *, shim_device), cuDevicePrimaryCtxRetain);
    DRV(shim_result (*)(shim_handle), cuCtxSetCurrent);
    if (ordinal < 0 || ordinal >= 64) return fail(101 /* cudaErrorInvalidDevice */);
    shim_handle ctx = __atomic_load_n(&primary[ordinal], __ATOMIC_ACQUIRE);
    if (!ctx) {
        shim_device dev;
        int err = device_handle(ordinal, &dev);
        if (err) return err;
        pthread_mutex_lock(&primary_lock);
        if (!primary[ordinal]) err = cuDevicePrimaryCtxRetain(&ctx, dev);
        if (!err && !primary[ordinal]) __atomic_store_n(&primary[ordinal], ctx, __ATOMIC_RELEASE);
        ctx = primary[ordinal];
        pthread_mutex_unlock(&primary_lock);
        if (err) return fail(err);
    }
    return fail(cuCtxSetCurrent(ctx));
}

/* A current context for calls that need one: the thread's, else the current device's primary. */
static int context(void) {
    DRV(shim_result (*)(shim_handle *), cuCtxGetCurrent);
    shim_handle ctx = NULL;
    int err = cuCtxGetCurrent(&ctx);
    if (err) return fail(err);
    return ctx ? cudaSuccess : set_primary(current_device);
}

#define NEED_CONTEXT() do { int e_ = context(); if (e_) return e_; } while (0)

/* -- statistics, off unless MOE_AOT_SHIM_STATS is set (and not "0") when first asked ------------- */
struct shim_stat { const char *name; unsigned long long calls; struct shim_stat *next; int linked; };
static struct shim_stat *stats_head;
static pthread_mutex_t stats_lock = PTHREAD_MUTEX_INITIALIZER;
static int stats_on = -1;
static unsigned long long stat_launch_ns, stat_driver_launch_ns, stat_context_checks;

static int stats_enabled(void) {
    int on = __atomic_load_n(&stats_on, __ATOMIC_RELAXED);
    if (on < 0) {
        const char *v = getenv("MOE_AOT_SHIM_STATS");
        on = v && *v && strcmp(v, "0") != 0;
        __atomic_store_n(&stats_on, on, __ATOMIC_RELAXED);
    }
    return on;
}

static void count_call(struct shim_stat *s) {
    if (!__atomic_load_n(&s->linked, __ATOMIC_ACQUIRE)) {
        pthread_mutex_lock(&stats_lock);
        if (!s->linked) {
            s->next = stats_head;
            stats_head = s;
            __atomic_store_n(&s->linked, 1, __ATOMIC_RELEASE);
        }
        pthread_mutex_unlock(&stats_lock);
    }
    __atomic_fetch_add(&s->calls, 1, __ATOMIC_RELAXED);
}

static unsigned long long now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (unsigned long long)t.tv_sec * 1000000000ull + (unsigned long long)t.tv_nsec;
}

/* each cuda* entry point: its own counter, linked into the list at its first counted call */
#define TRACE()                                                                  \
    static struct shim_stat stat_ = {__func__, 0, NULL, 0};                      \
    if (stats_enabled()) count_call(&stat_)

/* The counts as text, one "name value" a line (entry points by name; launch_ns: time in
   cudaLaunchKernelExC, driver_launch_ns: of which in cuLaunchKernelEx; context_checks:
   cuCtxGetCurrent calls made for launches); zeroed after reading when `reset`. Returns the length
   the whole text needs (it is cut at `cap` - 1), or -1 with the statistics off. Visible in every
   library build (the link hides everything else), found by the runtime with dlsym. */
__attribute__((visibility("default"))) int moe_aot_shim_stats(char *buf, size_t cap, int reset) {
    if (!stats_enabled()) return -1;
    char line[160];
    size_t len = 0;
#define EMIT(fmt, ...) do {                                                       \
        int n_ = snprintf(line, sizeof line, fmt, __VA_ARGS__);                   \
        if (buf && len + 1 < cap)                                                 \
            memcpy(buf + len, line, len + (size_t)n_ < cap - 1 ? (size_t)n_ : cap - 1 - len); \
        len += (size_t)n_;                                                        \
    } while (0)
    pthread_mutex_lock(&stats_lock);
    for (struct shim_stat *s = stats_head; s; s = s->next) {
        EMIT("%s %llu\n", s->name, __atomic_load_n(&s->calls, __ATOMIC_RELAXED));
        if (reset) __atomic_store_n(&s->calls, 0, __ATOMIC_RELAXED);
    }
    pthread_mutex_unlock(&stats_lock);
    EMIT("launch_ns %llu\n", __atomic_load_n(&stat_launch_ns, __ATOMIC_RELAXED));
    EMIT("driver_launch_ns %llu\n", __atomic_load_n(&stat_driver_launch_ns, __ATOMIC_RELAXED));
    EMIT("context_checks %llu\n", __atomic_load_n(&stat_context_checks, __ATOMIC_RELAXED));
#undef EMIT
    if (reset) {
        __atomic_store_n(&stat_launch_ns, 0, __ATOMIC_RELAXED);
        __atomic_store_n(&stat_driver_launch_ns, 0, __ATOMIC_RELAXED);
        __atomic_store_n(&stat_context_checks, 0, __ATOMIC_RELAXED);
    }
    if (buf && cap) buf[len < cap ? len : cap - 1] = 0;
    return (int)len;
}
#define NEED_DRIVER() do { int e_ = driver(); if (e_) return fail(e_); } while (0)

/* -- errors ------------------------------------------------------------------------------------ */
static const char *own_error(int err, int want_name) {
    switch (err) {
    case cudaSuccess: return want_name ? "cudaSuccess" : "no error";
    case cudaErrorStubLibrary:
        return want_name ? "cudaErrorStubLibrary" : "the CUDA driver lacks a function this kernel library needs";
    case cudaErrorInsufficientDriver:
        return want_name ? "cudaErrorInsufficientDriver" : "no CUDA driver (libcuda.so.1) could be loaded and initialised";
    case cudaErrorInvalidDeviceFunction:
        return want_name ? "cudaErrorInvalidDeviceFunction" : "invalid device function";
    default: return NULL;
    }
}

static const char *error_text(int err, int want_name) {
    const char *s = own_error(err, want_name);
    if (s && err != cudaSuccess) return s;
    if (driver_get_proc) {
        static void *volatile slot_name, *volatile slot_string;
        shim_result (*get)(int, const char **) =
            (shim_result (*)(int, const char **))resolve(want_name ? &slot_name : &slot_string,
                                                          want_name ? "cuGetErrorName" : "cuGetErrorString");
        const char *text = NULL;
        if (get && get(err, &text) == 0 && text) return text;
    }
    if (s) return s;
    return want_name ? "cudaErrorUnknown" : "unrecognized error code";
}

EXPORT const char *cudaGetErrorName(int err) { return error_text(err, 1); }
EXPORT const char *cudaGetErrorString(int err) { return error_text(err, 0); }

EXPORT int cudaGetLastError(void) {
    TRACE();
    int err = last_error;
    last_error = cudaSuccess;
    return err;
}

/* -- driver, devices ---------------------------------------------------------------------------- */
EXPORT int cudaDriverGetVersion(int *version) {
    TRACE();
    if (!version) return fail(cudaErrorInvalidValue);
    *version = 0;
    pthread_once(&driver_once, open_driver);
    if (!driver_get_proc) return cudaSuccess; /* cudart: 0 and success without a driver */
    static void *volatile slot;
    shim_result (*get)(int *) = (shim_result (*)(int *))resolve(&slot, "cuDriverGetVersion");
    return get ? fail(get(version)) : cudaSuccess;
}

EXPORT int cudaGetDriverEntryPointByVersion(const char *symbol, void **fn, unsigned version,
                                            unsigned long long flags, int *status) {
    TRACE();
    NEED_DRIVER();
    CALL(driver_get_proc(symbol, fn, (int)version, flags, status));
}

EXPORT int cudaGetDeviceCount(int *count) {
    TRACE();
    DRV(shim_result (*)(int *), cuDeviceGetCount);
    CALL(cuDeviceGetCount(count));
}

EXPORT int cudaGetDevice(int *device) {
    TRACE();
    DRV(shim_result (*)(shim_handle *), cuCtxGetCurrent);
    DRV(shim_result (*)(shim_device *), cuCtxGetDevice);
    if (!device) return fail(cudaErrorInvalidValue);
    shim_handle ctx = NULL;
    int err = cuCtxGetCurrent(&ctx);
    if (err) return fail(err);
    if (!ctx) {
        *device = current_device;
        return cudaSuccess;
    }
    shim_device dev;
    err = cuCtxGetDevice(&dev);
    if (!err) *device = dev; /* a CUdevice is its ordinal */
    return fail(err);
}

EXPORT int cudaSetDevice(int device) {
    TRACE();
    int err = set_primary(device);
    if (!err) current_device = device;
    return err;
}

EXPORT int cudaDeviceGetAttribute(int *value, int attr, int device) {
    TRACE();
    DRV(shim_result (*)(int *, int, shim_device), cuDeviceGetAttribute);
    shim_device dev;
    int err = device_handle(device, &dev);
    if (err) return err;
    CALL(cuDeviceGetAttribute(value, attr, dev)); /* cudaDeviceAttr == CUdevice_attribute */
}

EXPORT int cudaDeviceSynchronize(void) {
    TRACE();
    DRV(shim_result (*)(void), cuCtxSynchronize);
    NEED_CONTEXT();
    CALL(cuCtxSynchronize());
}

/* -- kernels ---------------------------------------------------------------------------------- */
/* `func` is always a cudaKernel_t here (a kernel library registers no host stubs), i.e. a CUkernel;
   cudaFuncAttribute's values are CUfunction_attribute's. */
EXPORT int cudaKernelSetAttributeForDevice(void *kernel, int attr, int value, int device) {
    TRACE();
    DRV(shim_result (*)(int, int, shim_handle, shim_device), cuKernelSetAttribute);
    shim_device dev;
    int err = device_handle(device, &dev);
    if (err) return err;
    CALL(cuKernelSetAttribute(attr, value, kernel, dev));
}

EXPORT int cudaFuncSetAttribute(const void *func, int attr, int value) {
    TRACE();
    int device = 0;
    int err = cudaGetDevice(&device);
    if (err) return err;
    return cudaKernelSetAttributeForDevice((void *)func, attr, value, device);
}

EXPORT int cudaOccupancyMaxActiveBlocksPerMultiprocessor(int *blocks, const void *func, int block_size,
                                                          size_t smem) {
    TRACE();
    DRV(shim_result (*)(shim_handle *, shim_handle), cuKernelGetFunction);
    DRV(shim_result (*)(int *, shim_handle, int, size_t), cuOccupancyMaxActiveBlocksPerMultiprocessor);
    NEED_CONTEXT();
    shim_handle fn = NULL;
    if (cuKernelGetFunction(&fn, (shim_handle)func)) return fail(cudaErrorInvalidDeviceFunction);
    CALL(cuOccupancyMaxActiveBlocksPerMultiprocessor(blocks, fn, block_size, smem));
}

/* The launch of every kernel: cuLaunchKernelEx, attributes passed as they are. A CUkernel runs in
   the context of the stream it is launched on, so only the NULL stream and the legacy and
   per-thread handles (1, 2) need the thread's current context first (cudart's lazy primary
   context); a real stream costs no cuCtxGetCurrent. Should a driver still answer
   CUDA_ERROR_INVALID_CONTEXT there, the context is made current and the launch tried once more. */
#define CUDA_ERROR_INVALID_CONTEXT 201
EXPORT int cudaLaunchKernelExC(const shim_runtime_launch_config *config, const void *func, void **args) {
    TRACE();
    DRV(shim_result (*)(const shim_driver_launch_config *, shim_handle, void **, void **), cuLaunchKernelEx);
    if (!config || config->dynamicSmemBytes > 0xffffffffu) return fail(cudaErrorInvalidValue);
    int timed = stats_enabled();
    unsigned long long t0 = timed ? now_ns() : 0, t1 = 0;
    int special = (uintptr_t)config->stream <= 2;
    if (special) {
        if (timed) __atomic_fetch_add(&stat_context_checks, 1, __ATOMIC_RELAXED);
        NEED_CONTEXT();
    }
    shim_driver_launch_config c = {
        config->gridDim.x, config->gridDim.y, config->gridDim.z,
        config->blockDim.x, config->blockDim.y, config->blockDim.z,
        (unsigned)config->dynamicSmemBytes, config->stream, config->attrs, config->numAttrs,
    };
    if (timed) t1 = now_ns();
    int err = cuLaunchKernelEx(&c, (shim_handle)func, args, NULL); /* a CUkernel is launched as a CUfunction */
    if (timed) {
        unsigned long long t2 = now_ns();
        __atomic_fetch_add(&stat_driver_launch_ns, t2 - t1, __ATOMIC_RELAXED);
        __atomic_fetch_add(&stat_launch_ns, t2 - t0, __ATOMIC_RELAXED);
    }
    if (err == CUDA_ERROR_INVALID_CONTEXT && !special) {
        if (timed) __atomic_fetch_add(&stat_context_checks, 1, __ATOMIC_RELAXED);
        NEED_CONTEXT();
        err = cuLaunchKernelEx(&c, (shim_handle)func, args, NULL);
    }
    return fail(err);
}

/* -- libraries (context-independent loading: no context needed but for globals) ---------------- */
EXPORT int cudaLibraryLoadData(shim_handle *library, const void *code, int *jit_options, void **jit_values,
                               unsigned n_jit, int *lib_options, void **lib_values, unsigned n_lib) {
    TRACE();
    DRV(shim_result (*)(shim_handle *, const void *, int *, void **, unsigned, int *, void **, unsigned),
        cuLibraryLoadData);
    CALL(cuLibraryLoadData(library, code, jit_options, jit_values, n_jit, lib_options, lib_values, n_lib));
}

EXPORT int cudaLibraryLoadFromFile(shim_handle *library, const char *path, int *jit_options, void **jit_values,
                                   unsigned n_jit, int *lib_options, void **lib_values, unsigned n_lib) {
    TRACE();
    DRV(shim_result (*)(shim_handle *, const char *, int *, void **, unsigned, int *, void **, unsigned),
        cuLibraryLoadFromFile);
    CALL(cuLibraryLoadFromFile(library, path, jit_options, jit_values, n_jit, lib_options, lib_values, n_lib));
}

EXPORT int cudaLibraryUnload(shim_handle library) {
    TRACE();
    DRV(shim_result (*)(shim_handle), cuLibraryUnload);
    CALL(cuLibraryUnload(library));
}

EXPORT int cudaLibraryGetKernel(shim_handle *kernel, shim_handle library, const char *name) {
    TRACE();
    DRV(shim_result (*)(shim_handle *, shim_handle, const char *), cuLibraryGetKernel);
    CALL(cuLibraryGetKernel(kernel, library, name));
}

EXPORT int cudaLibraryGetKernelCount(unsigned *count, shim_handle library) {
    TRACE();
    DRV(shim_result (*)(unsigned *, shim_handle), cuLibraryGetKernelCount);
    CALL(cuLibraryGetKernelCount(count, library));
}

EXPORT int cudaLibraryGetGlobal(void **ptr, size_t *bytes, shim_handle library, const char *name) {
    TRACE();
    DRV(shim_result (*)(shim_devptr *, size_t *, shim_handle, const char *), cuLibraryGetGlobal);
    NEED_CONTEXT();
    CALL(cuLibraryGetGlobal((shim_devptr *)ptr, bytes, library, name));
}

EXPORT int cudaLibraryGetManaged(void **ptr, size_t *bytes, shim_handle library, const char *name) {
    TRACE();
    DRV(shim_result (*)(shim_devptr *, size_t *, shim_handle, const char *), cuLibraryGetManaged);
    NEED_CONTEXT();
    CALL(cuLibraryGetManaged((shim_devptr *)ptr, bytes, library, name));
}

EXPORT int cudaLibraryGetUnifiedFunction(void **fn, shim_handle library, const char *name) {
    TRACE();
    DRV(shim_result (*)(void **, shim_handle, const char *), cuLibraryGetUnifiedFunction);
    CALL(cuLibraryGetUnifiedFunction(fn, library, name));
}

/* -- memory ---------------------------------------------------------------------------------- */
EXPORT int cudaMalloc(void **ptr, size_t size) {
    TRACE();
    DRV(shim_result (*)(shim_devptr *, size_t), cuMemAlloc);
    if (!ptr) return fail(cudaErrorInvalidValue);
    NEED_CONTEXT();
    *ptr = NULL;
    if (size == 0) return cudaSuccess; /* cudart: a null pointer, no error */
    CALL(cuMemAlloc((shim_devptr *)ptr, size));
}

EXPORT int cudaFree(void *ptr) {
    TRACE();
    DRV(shim_result (*)(shim_devptr), cuMemFree);
    NEED_CONTEXT();
    if (!ptr) return cudaSuccess; /* cudaFree(0): only the context */
    CALL(cuMemFree((shim_devptr)(uintptr_t)ptr));
}

EXPORT int cudaMallocAsync(void **ptr, size_t size, shim_handle stream) {
    TRACE();
    DRV(shim_result (*)(shim_devptr *, size_t, shim_handle), cuMemAllocAsync);
    NEED_CONTEXT();
    CALL(cuMemAllocAsync((shim_devptr *)ptr, size, stream));
}

EXPORT int cudaFreeAsync(void *ptr, shim_handle stream) {
    TRACE();
    DRV(shim_result (*)(shim_devptr, shim_handle), cuMemFreeAsync);
    NEED_CONTEXT();
    CALL(cuMemFreeAsync((shim_devptr)(uintptr_t)ptr, stream));
}

EXPORT int cudaMallocHost(void **ptr, size_t size) {
    TRACE();
    DRV(shim_result (*)(void **, size_t), cuMemAllocHost);
    NEED_CONTEXT();
    CALL(cuMemAllocHost(ptr, size));
}

EXPORT int cudaFreeHost(void *ptr) {
    TRACE();
    DRV(shim_result (*)(void *), cuMemFreeHost);
    NEED_CONTEXT();
    CALL(cuMemFreeHost(ptr));
}

EXPORT int cudaMallocManaged(void **ptr, size_t size, unsigned flags) {
    TRACE();
    DRV(shim_result (*)(shim_devptr *, size_t, unsigned), cuMemAllocManaged);
    NEED_CONTEXT();
    CALL(cuMemAllocManaged((shim_devptr *)ptr, size, flags)); /* cudaMemAttach* == CU_MEM_ATTACH_* */
}

/* With unified addressing the driver infers the direction from the pointers: `kind` is not needed. */
EXPORT int cudaMemcpy(void *dst, const void *src, size_t count, int kind) {
    TRACE();
    DRV(shim_result (*)(shim_devptr, shim_devptr, size_t), cuMemcpy);
    (void)kind;
    NEED_CONTEXT();
    CALL(cuMemcpy((shim_devptr)(uintptr_t)dst, (shim_devptr)(uintptr_t)src, count));
}

EXPORT int cudaMemcpyAsync(void *dst, const void *src, size_t count, int kind, shim_handle stream) {
    TRACE();
    DRV(shim_result (*)(shim_devptr, shim_devptr, size_t, shim_handle), cuMemcpyAsync);
    (void)kind;
    NEED_CONTEXT();
    CALL(cuMemcpyAsync((shim_devptr)(uintptr_t)dst, (shim_devptr)(uintptr_t)src, count, stream));
}

EXPORT int cudaMemset(void *ptr, int value, size_t count) {
    TRACE();
    DRV(shim_result (*)(shim_devptr, unsigned char, size_t), cuMemsetD8);
    NEED_CONTEXT();
    CALL(cuMemsetD8((shim_devptr)(uintptr_t)ptr, (unsigned char)value, count));
}

EXPORT int cudaMemsetAsync(void *ptr, int value, size_t count, shim_handle stream) {
    TRACE();
    DRV(shim_result (*)(shim_devptr, unsigned char, size_t, shim_handle), cuMemsetD8Async);
    NEED_CONTEXT();
    CALL(cuMemsetD8Async((shim_devptr)(uintptr_t)ptr, (unsigned char)value, count, stream));
}

/* -- streams, events, graphs, profiler ----------------------------------------------------------- */
EXPORT int cudaStreamCreate(shim_handle *stream) {
    TRACE();
    DRV(shim_result (*)(shim_handle *, unsigned), cuStreamCreate);
    NEED_CONTEXT();
    CALL(cuStreamCreate(stream, 0)); /* cudaStreamDefault */
}

EXPORT int cudaStreamDestroy(shim_handle stream) {
    TRACE();
    DRV(shim_result (*)(shim_handle), cuStreamDestroy);
    NEED_CONTEXT();
    CALL(cuStreamDestroy(stream));
}

EXPORT int cudaStreamSynchronize(shim_handle stream) {
    TRACE();
    DRV(shim_result (*)(shim_handle), cuStreamSynchronize);
    NEED_CONTEXT();
    CALL(cuStreamSynchronize(stream));
}

EXPORT int cudaStreamWaitEvent(shim_handle stream, shim_handle event, unsigned flags) {
    TRACE();
    DRV(shim_result (*)(shim_handle, shim_handle, unsigned), cuStreamWaitEvent);
    NEED_CONTEXT();
    CALL(cuStreamWaitEvent(stream, event, flags));
}

/* cudart's callback gets a cudaError_t where the driver's gets a CUresult: the same codes. */
typedef void (*shim_stream_callback)(shim_handle stream, int status, void *data);
EXPORT int cudaStreamAddCallback(shim_handle stream, shim_stream_callback callback, void *data, unsigned flags) {
    TRACE();
    DRV(shim_result (*)(shim_handle, shim_stream_callback, void *, unsigned), cuStreamAddCallback);
    NEED_CONTEXT();
    CALL(cuStreamAddCallback(stream, callback, data, flags));
}

EXPORT int cudaStreamBeginCapture(shim_handle stream, int mode) {
    TRACE();
    DRV(shim_result (*)(shim_handle, int), cuStreamBeginCapture); /* the _v2 with a mode */
    NEED_CONTEXT();
    CALL(cuStreamBeginCapture(stream, mode)); /* cudaStreamCaptureMode == CUstreamCaptureMode */
}

EXPORT int cudaStreamEndCapture(shim_handle stream, shim_handle *graph) {
    TRACE();
    DRV(shim_result (*)(shim_handle, shim_handle *), cuStreamEndCapture);
    NEED_CONTEXT();
    CALL(cuStreamEndCapture(stream, graph));
}

EXPORT int cudaEventCreate(shim_handle *event) {
    TRACE();
    DRV(shim_result (*)(shim_handle *, unsigned), cuEventCreate);
    NEED_CONTEXT();
    CALL(cuEventCreate(event, 0)); /* cudaEventDefault */
}

EXPORT int cudaEventDestroy(shim_handle event) {
    TRACE();
    DRV(shim_result (*)(shim_handle), cuEventDestroy);
    NEED_CONTEXT();
    CALL(cuEventDestroy(event));
}

EXPORT int cudaEventRecord(shim_handle event, shim_handle stream) {
    TRACE();
    DRV(shim_result (*)(shim_handle, shim_handle), cuEventRecord);
    NEED_CONTEXT();
    CALL(cuEventRecord(event, stream));
}

EXPORT int cudaEventElapsedTime(float *ms, shim_handle start, shim_handle end) {
    TRACE();
    DRV(shim_result (*)(float *, shim_handle, shim_handle), cuEventElapsedTime);
    NEED_CONTEXT();
    CALL(cuEventElapsedTime(ms, start, end));
}

EXPORT int cudaGraphInstantiate(shim_handle *exec, shim_handle graph, unsigned long long flags) {
    TRACE();
    DRV(shim_result (*)(shim_handle *, shim_handle, unsigned long long), cuGraphInstantiateWithFlags);
    NEED_CONTEXT();
    CALL(cuGraphInstantiateWithFlags(exec, graph, flags)); /* cudaGraphInstantiateFlag* == CUDA_GRAPH_INSTANTIATE_FLAG_* */
}

EXPORT int cudaGraphLaunch(shim_handle exec, shim_handle stream) {
    TRACE();
    DRV(shim_result (*)(shim_handle, shim_handle), cuGraphLaunch);
    NEED_CONTEXT();
    CALL(cuGraphLaunch(exec, stream));
}

EXPORT int cudaGraphDestroy(shim_handle graph) {
    TRACE();
    DRV(shim_result (*)(shim_handle), cuGraphDestroy);
    CALL(cuGraphDestroy(graph));
}

EXPORT int cudaGraphExecDestroy(shim_handle exec) {
    TRACE();
    DRV(shim_result (*)(shim_handle), cuGraphExecDestroy);
    CALL(cuGraphExecDestroy(exec));
}

EXPORT int cudaProfilerStart(void) {
    TRACE();
    DRV(shim_result (*)(void), cuProfilerStart);
    NEED_CONTEXT();
    CALL(cuProfilerStart());
}

EXPORT int cudaProfilerStop(void) {
    TRACE();
    DRV(shim_result (*)(void), cuProfilerStop);
    NEED_CONTEXT();
    CALL(cuProfilerStop());
}
