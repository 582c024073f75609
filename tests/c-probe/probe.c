/* An application in C that binds the CUDA driver with dlopen + dlsym (as the CUDA runtime and most
 * frameworks do), to check what is architecture-specific in libvgpu.so: its dlsym override (a
 * trampoline that must keep the caller's return address for glibc) and the hooks it hands out. Run
 * natively by the interposer tests (x86-64) and under qemu by tests/aarch64/run.sh. Prints one JSON
 * line:
 *   probe CHUNK_MIB MAX_CHUNKS
 * total/free: cuMemGetInfo after context creation; granted: CHUNK_MIB allocations that succeeded
 * (at most MAX_CHUNKS); refused: the result of the first refused one (0: none); proc_address: the
 * result of one more allocation through the pointer cuGetProcAddress gave; next: what
 * libprobe-a.so's dlsym(RTLD_NEXT, "marker") found (2: libprobe-b.so's, the right one); dlvsym: whether
 * dlvsym, which libvgpu.so does not override, found cuMemAlloc_v2 under the driver's soname as a
 * version (glibc's dlvsym refuses a symbol defined without a version, as the driver's entry points
 * are, from a library that has version information, as the simulated driver has). */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>

typedef int CUresult;
typedef int CUdevice;
typedef void *CUcontext;
typedef unsigned long long CUdeviceptr;

int next_marker(void); /* libprobe-a.so */

static void *must(void *h, const char *name) {
    void *p = dlsym(h, name);
    if (!p) {
        fprintf(stderr, "probe: dlsym(%s): %s\n", name, dlerror());
        exit(2);
    }
    return p;
}

int main(int argc, char **argv) {
    if (argc != 3) {
        fprintf(stderr, "usage: probe CHUNK_MIB MAX_CHUNKS\n");
        return 2;
    }
    size_t chunk = strtoull(argv[1], NULL, 10) << 20;
    int max = atoi(argv[2]);
    void *h = dlopen("libcuda.so.1", RTLD_NOW);
    if (!h) {
        fprintf(stderr, "probe: dlopen(libcuda.so.1): %s\n", dlerror());
        return 2;
    }
    CUresult (*init)(unsigned) = must(h, "cuInit");
    CUresult (*device_get)(CUdevice *, int) = must(h, "cuDeviceGet");
    CUresult (*ctx_create)(CUcontext *, unsigned, CUdevice) = must(h, "cuCtxCreate_v2");
    CUresult (*get_info)(size_t *, size_t *) = must(h, "cuMemGetInfo_v2");
    CUresult (*alloc)(CUdeviceptr *, size_t) = must(h, "cuMemAlloc_v2");
    CUresult (*proc)(const char *, void **, int, unsigned long long, int *) = must(h, "cuGetProcAddress_v2");
    CUdevice dev;
    CUcontext ctx;
    CUresult r;
    if ((r = init(0)) || (r = device_get(&dev, 0)) || (r = ctx_create(&ctx, 0, dev))) {
        fprintf(stderr, "probe: driver set-up failed: %d\n", r);
        return 1;
    }
    size_t free_b = 0, total_b = 0;
    if ((r = get_info(&free_b, &total_b))) {
        fprintf(stderr, "probe: cuMemGetInfo_v2: %d\n", r);
        return 1;
    }
    int granted = 0;
    CUresult refused = 0;
    CUdeviceptr p;
    while (granted < max) {
        if ((r = alloc(&p, chunk))) {
            refused = r;
            break;
        }
        granted++;
    }
    void *via = NULL;
    int status = 0;
    if ((r = proc("cuMemAlloc", &via, 12000, 0, &status)) || !via) {
        fprintf(stderr, "probe: cuGetProcAddress_v2(cuMemAlloc): %d status %d\n", r, status);
        return 1;
    }
    CUresult more = ((CUresult(*)(CUdeviceptr *, size_t))via)(&p, chunk);
    int versioned = dlvsym(h, "cuMemAlloc_v2", "libcuda.so.1") != NULL;
    printf("{\"total\":%zu,\"free\":%zu,\"granted\":%d,\"refused\":%d,\"proc_address\":%d,\"next\":%d,"
           "\"dlvsym\":%d}\n",
           total_b, free_b, granted, refused, more, next_marker(), versioned);
    return 0;
}
