/* Loaded after libvgpu.so and before libprobe-b.so: asks dlsym for the next "marker" after itself. */
#define _GNU_SOURCE
#include <dlfcn.h>

int marker(void) { return 1; }

int next_marker(void) {
    int (*f)(void) = (int (*)(void))dlsym(RTLD_NEXT, "marker");
    return f ? f() : -1;
}
