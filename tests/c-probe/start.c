/* The cheapest CUDA start: dlopen the driver, cuInit, a context on device 0, one 1 MiB allocation,
 * then "ok" on stdout, an optional hold of HOLD_SECS, and exit. Nothing else runs in the process, so
 * its start is the driver's (and libvgpu.so's where preloaded). With CUDA_START_STAMP set, "ok" is
 * followed by the moment the allocation returned (CLOCK_MONOTONIC, ns): the moment sim-bench
 * times, taken in the process itself, so that how soon the reader of the line gets a CPU (on a
 * small machine, other processes' threads may hold them all) is not counted as the start's.
 *   cuda-start [HOLD_SECS]
 * The driver is VGPU_CLIENT_LIBCUDA where set, else libcuda.so.1. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
#include <unistd.h>

typedef int CUresult;
typedef void *CUcontext;
typedef unsigned long long CUdeviceptr;

static void *sym(void *h, const char *name) {
    void *p = dlsym(h, name);
    if (!p) {
        fprintf(stderr, "cuda-start: dlsym(%s): %s\n", name, dlerror());
        exit(2);
    }
    return p;
}

static void check(CUresult r, const char *what) {
    if (r != 0) {
        fprintf(stderr, "cuda-start: %s: CUresult %d\n", what, r);
        exit(1);
    }
}

int main(int argc, char **argv) {
    const char *lib = getenv("VGPU_CLIENT_LIBCUDA");
    void *h = dlopen(lib && *lib ? lib : "libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (!h) {
        fprintf(stderr, "cuda-start: dlopen: %s\n", dlerror());
        return 2;
    }
    CUresult (*init)(unsigned) = sym(h, "cuInit");
    CUresult (*retain)(CUcontext *, int) = sym(h, "cuDevicePrimaryCtxRetain");
    CUresult (*set_current)(CUcontext) = sym(h, "cuCtxSetCurrent");
    CUresult (*alloc)(CUdeviceptr *, size_t) = sym(h, "cuMemAlloc_v2");
    CUcontext ctx;
    CUdeviceptr p;
    check(init(0), "cuInit");
    check(retain(&ctx, 0), "cuDevicePrimaryCtxRetain");
    check(set_current(ctx), "cuCtxSetCurrent");
    check(alloc(&p, 1 << 20), "cuMemAlloc_v2");
    struct timespec at;
    clock_gettime(CLOCK_MONOTONIC, &at);
    const char *stamp = getenv("CUDA_START_STAMP");
    if (stamp && *stamp) {
        printf("ok %lld\n", (long long)at.tv_sec * 1000000000LL + at.tv_nsec);
    } else {
        fputs("ok\n", stdout);
    }
    fflush(stdout);
    if (argc > 1) {
        sleep((unsigned)atoi(argv[1]));
    }
    return 0;
}
