/* The "marker" that dlsym(RTLD_NEXT) from libprobe-a.so must find. */
int marker(void) { return 2; }
