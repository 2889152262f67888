/* No-device stand-ins for libcuda.so.1 and libcudart.so.12, so the Mooncake wheel's store client
 * (mooncake/store.so, which links both) loads on a machine without the NVIDIA driver. Built by
 * controller/tests/t2_probe_mooncake.rs: with -DDRIVER the driver API (libcuda.so.1), without
 * it the runtime API (libcudart.so.12, versioned symbols). Every call answers "no device"
 * (CUDA_ERROR_NO_DEVICE / cudaErrorNoDevice, both 100); the store's TCP transport and
 * host-memory segment never need more. The symbols are the ones store.so imports. */
#ifdef DRIVER
int cuInit(unsigned flags) { (void)flags; return 100; }
int cuDeviceGet(void *d, int o) { (void)d; (void)o; return 100; }
int cuDeviceGetAttribute(int *v, int a, int d) { (void)v; (void)a; (void)d; return 100; }
int cuDevicePrimaryCtxRetain(void *c, int d) { (void)c; (void)d; return 100; }
int cuDevicePrimaryCtxRelease_v2(int d) { (void)d; return 100; }
int cuCtxSetCurrent(void *c) { (void)c; return 100; }
int cuMemGetAddressRange_v2(void *b, void *s, unsigned long long p) { (void)b; (void)s; (void)p; return 100; }
int cuMemGetHandleForAddressRange(void *h, unsigned long long p, unsigned long s, int t, unsigned long long f) { (void)h; (void)p; (void)s; (void)t; (void)f; return 100; }
int cuPointerGetAttribute(void *d, int a, unsigned long long p) { (void)d; (void)a; (void)p; return 100; }
int cuGetErrorString(int e, const char **s) { (void)e; *s = "no CUDA device (stand-in driver)"; return 0; }
#else
int cudaGetDeviceCount(int *n) { *n = 0; return 100; }
int cudaSetDevice(int d) { (void)d; return 100; }
int cudaGetLastError(void) { return 0; }
const char *cudaGetErrorString(int e) { (void)e; return "no CUDA device (stand-in runtime)"; }
int cudaDeviceGetPCIBusId(char *b, int l, int d) { (void)b; (void)l; (void)d; return 100; }
int cudaMallocHost(void **p, unsigned long s) { (void)p; (void)s; return 100; }
int cudaFreeHost(void *p) { (void)p; return 100; }
int cudaMemcpy(void *d, const void *s, unsigned long n, int k) { (void)d; (void)s; (void)n; (void)k; return 100; }
int cudaPointerGetAttributes(void *a, const void *p) { (void)a; (void)p; return 100; }
#endif
