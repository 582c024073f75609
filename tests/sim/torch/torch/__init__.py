"""A stand-in for PyTorch on the simulated GPU.

The part of torch's API that tests/gpu/torch_worker.py uses, over the CUDA driver API (the simulated
libcuda.so.1, through ctypes), so that the real-GPU suite's PyTorch checks run without a GPU
(tests/sim/clients/tests/gpu_suite.rs puts this directory first on PYTHONPATH). It proves the suite's
handling of those checks and libvgpu.so's limits under the driver calls PyTorch makes; it computes
nothing, and proves nothing about PyTorch itself (docs/gpu-validation.md).

What it does as PyTorch does, because the suite's checks depend on it:
- entry points resolved with cuGetProcAddress, CUDA initialised lazily on device 0's primary context;
- the caching allocator: freed blocks kept for reuse until empty_cache(); a refused allocation
  empties the cache and is tried once more before OutOfMemoryError;
- PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True: memory made with cuMemCreate and mapped into a
  reserved address range (one per segment here; PyTorch grows one range per stream), given back with
  cuMemUnmap and cuMemRelease;
- PYTORCH_CUDA_ALLOC_CONF=backend:cudaMallocAsync: cuMemAllocAsync and cuMemFreeAsync on the
  device's default pool, its release threshold at the maximum; empty_cache() synchronises and trims
  the pool to nothing;
- CUDA graphs captured on a side stream, instantiated, and replayed with cuGraphLaunch.

Kernels are the simulator's timed kernels (`wave_<N>ns`: N ns per wave of blocks): a matmul is one
block per 128 x 128 tile of its output and takes, per wave, that tile's multiply-adds at 3.8 TFLOP/s
per SM (an H100's bf16 rate per SM, roughly); elementwise kernels one block per 2048 elements.
Tensors hold no data: a tensor whose elements are all equal knows that value, any other the
expression that made it (so that a replayed graph's result compares equal to the eager one only if
the same operations made both). There is no autograd, nn or optim: the suite's `train` check needs
the real PyTorch.
"""
import contextlib
import ctypes
import math
import os
from ctypes import POINTER, byref, c_char_p, c_int, c_size_t, c_uint, c_uint64, c_void_p

__version__ = "0.0.0+vgpu.sim"

_OOM = 2  # CUDA_ERROR_OUT_OF_MEMORY
_TILE = 128
_SM_FLOPS = 3.8e12


class dtype:
    def __init__(self, name, itemsize):
        self.name, self.itemsize = name, itemsize

    def __repr__(self):
        return "torch." + self.name


uint8 = dtype("uint8", 1)
bfloat16 = dtype("bfloat16", 2)
float32 = dtype("float32", 4)


class OutOfMemoryError(RuntimeError):
    pass


class _Prop(ctypes.Structure):
    """CUmemAllocationProp: pinned device memory on one device."""
    _fields_ = [("type", c_int), ("handle_types", c_int), ("loc_type", c_int), ("loc_id", c_int),
                ("win32", c_void_p), ("compression", ctypes.c_ubyte), ("rdma", ctypes.c_ubyte),
                ("usage", ctypes.c_ushort), ("reserved", ctypes.c_ubyte * 4)]


class _Access(ctypes.Structure):
    """CUmemAccessDesc."""
    _fields_ = [("loc_type", c_int), ("loc_id", c_int), ("flags", c_int)]


_P = POINTER
_SIGNATURES = {
    "cuInit": [c_uint],
    "cuDriverGetVersion": [_P(c_int)],
    "cuDeviceGet": [_P(c_int), c_int],
    "cuDeviceGetName": [c_char_p, c_int, c_int],
    "cuDeviceTotalMem": [_P(c_size_t), c_int],
    "cuDevicePrimaryCtxRetain": [_P(c_void_p), c_int],
    "cuCtxSetCurrent": [c_void_p],
    "cuCtxSynchronize": [],
    "cuMemGetInfo": [_P(c_size_t), _P(c_size_t)],
    "cuMemAlloc": [_P(c_uint64), c_size_t],
    "cuMemFree": [c_uint64],
    "cuModuleLoadData": [_P(c_void_p), c_void_p],
    "cuModuleGetFunction": [_P(c_void_p), c_void_p, c_char_p],
    "cuLaunchKernel": [c_void_p, c_uint, c_uint, c_uint, c_uint, c_uint, c_uint, c_uint, c_void_p, c_void_p, c_void_p],
    "cuStreamCreate": [_P(c_void_p), c_uint],
    "cuStreamSynchronize": [c_void_p],
    "cuStreamBeginCapture": [c_void_p, c_int],
    "cuStreamEndCapture": [c_void_p, _P(c_void_p)],
    "cuGraphInstantiate": [_P(c_void_p), c_void_p, c_uint64],
    "cuGraphLaunch": [c_void_p, c_void_p],
    "cuGraphExecDestroy": [c_void_p],
    "cuGraphDestroy": [c_void_p],
    "cuMemGetAllocationGranularity": [_P(c_size_t), _P(_Prop), c_int],
    "cuMemCreate": [_P(c_uint64), c_size_t, _P(_Prop), c_uint64],
    "cuMemAddressReserve": [_P(c_uint64), c_size_t, c_size_t, c_uint64, c_uint64],
    "cuMemAddressFree": [c_uint64, c_size_t],
    "cuMemMap": [c_uint64, c_size_t, c_size_t, c_uint64, c_uint64],
    "cuMemSetAccess": [c_uint64, c_size_t, _P(_Access), c_size_t],
    "cuMemUnmap": [c_uint64, c_size_t],
    "cuMemRelease": [c_uint64],
    "cuDeviceGetDefaultMemPool": [_P(c_void_p), c_int],
    "cuMemPoolSetAttribute": [c_void_p, c_int, c_void_p],
    "cuMemPoolTrimTo": [c_void_p, c_size_t],
    "cuMemAllocAsync": [_P(c_uint64), c_size_t, c_void_p],
    "cuMemFreeAsync": [c_uint64, c_void_p],
}


class _Driver:
    """The driver's entry points, resolved as the CUDA runtime does (cuGetProcAddress, CUDA 12.0)."""

    def __init__(self):
        lib = ctypes.CDLL("libcuda.so.1")
        gpa = lib.cuGetProcAddress_v2
        gpa.argtypes = [c_char_p, _P(c_void_p), c_int, c_uint64, _P(c_int)]
        self.fn = {}
        for name, args in _SIGNATURES.items():
            p, status = c_void_p(), c_int()
            r = gpa(name.encode(), byref(p), 12000, 0, byref(status))
            if r != 0 or not p.value:
                raise RuntimeError("cuGetProcAddress(%s) returned %d" % (name, r))
            self.fn[name] = ctypes.CFUNCTYPE(c_int, *args)(p.value)

    def __call__(self, name, *args):
        return self.fn[name](*args)

    def ck(self, name, *args):
        r = self.fn[name](*args)
        if r != 0:
            raise RuntimeError("CUDA error: %s returned %d" % (name, r))


class _State:
    def __init__(self):
        d = self.d = _Driver()
        d.ck("cuInit", 0)
        dev, ctx, mod = c_int(), c_void_p(), c_void_p()
        d.ck("cuDeviceGet", byref(dev), 0)
        self.dev = dev.value
        d.ck("cuDevicePrimaryCtxRetain", byref(ctx), self.dev)
        d.ck("cuCtxSetCurrent", ctx)
        self.image = ctypes.create_string_buffer(b"// vgpu stand-in kernels: the simulator times them by name\n")
        d.ck("cuModuleLoadData", byref(mod), self.image)
        self.module, self.funcs = mod, {}
        self.stream = None  # the current stream; None is the legacy default stream
        conf = dict(kv.split(":", 1) for kv in os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "").split(",") if ":" in kv)
        if conf.get("backend") == "cudaMallocAsync":
            self.alloc = _AsyncAllocator(self)
        elif conf.get("expandable_segments", "").lower() == "true":
            self.alloc = _ExpandableAllocator(self)
        else:
            self.alloc = _CachingAllocator(self)

    def launch(self, ns, blocks):
        """One kernel of `ns` per wave of `blocks` blocks on the current stream."""
        name = "wave_%dns" % max(1, int(ns))
        f = self.funcs.get(name)
        if f is None:
            f = c_void_p()
            self.d.ck("cuModuleGetFunction", byref(f), self.module, name.encode())
            self.funcs[name] = f
        self.d.ck("cuLaunchKernel", f, max(1, int(blocks)), 1, 1, 256, 1, 1, 0, self.stream, None, None)


_state = None
_seed = [0, 0]


def _s():
    global _state
    if _state is None:
        _state = _State()
    return _state


class _CachingAllocator:
    """cuMemAlloc'd blocks, kept for reuse when freed until empty_cache()."""
    backend = "native"

    def __init__(self, st):
        self.st, self.cache, self.reserved, self.max_reserved = st, {}, 0, 0

    @staticmethod
    def round(n):
        return max(512, -(-n // 512) * 512) if n < (1 << 20) else -(-n // (2 << 20)) * (2 << 20)

    def malloc(self, n):
        size = self.round(n)
        free = self.cache.get(size)
        if free:
            return free.pop(), size, self.st.stream
        ptr = self.create(size)
        if ptr is None:
            self.empty()
            ptr = self.create(size)
        if ptr is None:
            f, t = mem_get_info_raw()
            raise OutOfMemoryError("CUDA out of memory. Tried to allocate %.2f MiB. GPU 0 has a total capacity of "
                                   "%.2f GiB of which %.2f GiB is free." % (size / 2**20, t / 2**30, f / 2**30))
        self.reserved += size
        self.max_reserved = max(self.max_reserved, self.reserved)
        return ptr, size, self.st.stream

    def create(self, size):
        p = c_uint64()
        r = self.st.d("cuMemAlloc", byref(p), size)
        if r == _OOM:
            return None
        if r != 0:
            raise RuntimeError("CUDA error: cuMemAlloc returned %d" % r)
        return p.value

    def destroy(self, ptr, size):
        self.st.d.ck("cuMemFree", ptr)

    def free(self, block):
        ptr, size, _ = block
        self.cache.setdefault(size, []).append(ptr)

    def empty(self):
        self.st.d.ck("cuCtxSynchronize")
        for size, ptrs in self.cache.items():
            for p in ptrs:
                self.destroy(p, size)
                self.reserved -= size
        self.cache.clear()


class _ExpandableAllocator(_CachingAllocator):
    """Segments made with cuMemCreate and mapped into reserved address ranges."""

    def __init__(self, st):
        super().__init__(st)
        self.prop = _Prop(type=1, loc_type=1, loc_id=st.dev)  # pinned, on the device
        g = c_size_t()
        st.d.ck("cuMemGetAllocationGranularity", byref(g), byref(self.prop), 0)
        self.gran, self.handles = max(1, g.value), {}

    def create(self, size):
        size = -(-size // self.gran) * self.gran
        d, h, va = self.st.d, c_uint64(), c_uint64()
        r = d("cuMemCreate", byref(h), size, byref(self.prop), 0)
        if r == _OOM:
            return None
        if r != 0:
            raise RuntimeError("CUDA error: cuMemCreate returned %d" % r)
        d.ck("cuMemAddressReserve", byref(va), size, 0, 0, 0)
        d.ck("cuMemMap", va, size, 0, h, 0)
        acc = _Access(loc_type=1, loc_id=self.st.dev, flags=3)  # read-write
        d.ck("cuMemSetAccess", va, size, byref(acc), 1)
        self.handles[va.value] = (h.value, size)
        return va.value

    def destroy(self, ptr, size):
        h, mapped = self.handles.pop(ptr)
        d = self.st.d
        d.ck("cuMemUnmap", ptr, mapped)
        d.ck("cuMemRelease", h)
        d.ck("cuMemAddressFree", ptr, mapped)


class _AsyncAllocator:
    """cuMemAllocAsync on the device's default pool, which keeps what is freed (threshold: the maximum)."""
    backend = "cudaMallocAsync"

    def __init__(self, st):
        self.st, self.pool, self.reserved, self.max_reserved = st, c_void_p(), 0, 0
        st.d.ck("cuDeviceGetDefaultMemPool", byref(self.pool), st.dev)
        most = c_uint64(2**64 - 1)
        st.d.ck("cuMemPoolSetAttribute", self.pool, 4, byref(most))  # CU_MEMPOOL_ATTR_RELEASE_THRESHOLD

    def malloc(self, n):
        p, s = c_uint64(), self.st.stream
        r = self.st.d("cuMemAllocAsync", byref(p), n, s)
        if r == _OOM:
            self.empty()
            r = self.st.d("cuMemAllocAsync", byref(p), n, s)
        if r == _OOM:
            raise OutOfMemoryError("CUDA out of memory. Tried to allocate %.2f MiB (cudaMallocAsync)" % (n / 2**20))
        if r != 0:
            raise RuntimeError("CUDA error: cuMemAllocAsync returned %d" % r)
        return p.value, n, s

    def free(self, block):
        ptr, _, s = block
        self.st.d.ck("cuMemFreeAsync", ptr, s)

    def empty(self):
        self.st.d.ck("cuCtxSynchronize")
        self.st.d.ck("cuMemPoolTrimTo", self.pool, 0)


def _check_device(device):
    if device != "cuda" and not str(device).startswith("cuda"):
        raise RuntimeError("the stand-in has CUDA tensors only, not %r" % (device,))


class Tensor:
    def __init__(self, shape, dt, value):
        self.shape, self.dtype, self.value = tuple(shape), dt, value
        self._block = None
        self._block = _s().alloc.malloc(max(1, self.numel() * dt.itemsize))

    def numel(self):
        return math.prod(self.shape)

    def __del__(self):
        b, self._block = getattr(self, "_block", None), None
        if b is not None and _state is not None:
            try:
                _state.alloc.free(b)
            except Exception:
                pass  # at interpreter exit

    def _elementwise(self, value, dt=None):
        out = Tensor(self.shape, dt or self.dtype, value)
        _s().launch(400, -(-self.numel() // 2048))
        return out

    def _set(self, value):
        self.value = value
        _s().launch(400, -(-self.numel() // 2048))
        return self

    def fill_(self, v):
        return self._set(float(v))

    def add_(self, v):
        return self._set(self.value + v if isinstance(self.value, float) else "(%s+%r)" % (self.value, v))

    def __mul__(self, v):
        return self._elementwise(self.value * v if isinstance(self.value, float) else "(%s*%r)" % (self.value, v))

    def __truediv__(self, v):
        return self._elementwise(self.value / v if isinstance(self.value, float) else "(%s/%r)" % (self.value, v))

    def float(self):
        return self._elementwise(self.value, float32)

    def sum(self):
        out = Tensor((), float32, self.value * self.numel() if isinstance(self.value, float) else "sum(%s)" % self.value)
        _s().launch(2000, 1)
        return out

    def item(self):
        st = _s()
        st.d.ck("cuStreamSynchronize", st.stream)
        if not isinstance(self.value, float):
            raise RuntimeError("the stand-in knows only uniform values, not %s" % self.value)
        return self.value

    def __matmul__(self, other):
        return matmul(self, other)


def _make(shape, dt, device, value):
    _check_device(device)
    if len(shape) == 1 and isinstance(shape[0], (tuple, list)):
        shape = shape[0]
    return Tensor([int(x) for x in shape], dt, value)


def empty(*shape, device="cpu", dtype=float32):
    return _make(shape, dtype, device, 0.0)


def zeros(*shape, device="cpu", dtype=float32):
    return _make(shape, dtype, device, 0.0)._set(0.0)


def ones(*shape, device="cpu", dtype=float32):
    return _make(shape, dtype, device, 1.0)._set(1.0)


def randn(*shape, device="cpu", dtype=float32):
    _seed[1] += 1
    return _make(shape, dtype, device, "randn(%d,%d)" % tuple(_seed))._set("randn(%d,%d)" % tuple(_seed))


def manual_seed(seed):
    _seed[:] = [int(seed), 0]


def matmul(a, b, out=None):
    if len(a.shape) != 2 or len(b.shape) != 2 or a.shape[1] != b.shape[0]:
        raise RuntimeError("mat1 and mat2 shapes cannot be multiplied (%s and %s)" % (a.shape, b.shape))
    m, k, n = a.shape[0], a.shape[1], b.shape[1]
    value = "(%s@%s)" % (a.value, b.value)
    if out is None:
        out = Tensor((m, n), a.dtype, value)
    else:
        out.value = value
    tiles = -(-m // _TILE) * -(-n // _TILE)
    _s().launch(1e9 * 2 * _TILE * _TILE * k / _SM_FLOPS, tiles)
    return out


def tanh(x):
    return x._elementwise("tanh(%s)" % x.value if not isinstance(x.value, float) else math.tanh(x.value))


def allclose(a, b, rtol=1e-5, atol=1e-8):
    st = _s()
    st.d.ck("cuCtxSynchronize")
    if a.shape != b.shape:
        return False
    if isinstance(a.value, float) and isinstance(b.value, float):
        return abs(a.value - b.value) <= atol + rtol * abs(b.value)
    return a.value == b.value


def mem_get_info_raw():
    f, t = c_size_t(), c_size_t()
    _s().d.ck("cuMemGetInfo", byref(f), byref(t))
    return f.value, t.value


class _Version:
    @property
    def cuda(self):
        v = c_int()
        _s().d.ck("cuDriverGetVersion", byref(v))
        return "%d.%d" % (v.value // 1000, v.value % 1000 // 10)


version = _Version()


class _Props:
    def __init__(self, name, total_memory):
        self.name, self.total_memory = name, total_memory


class _CudaModule:
    """torch.cuda"""
    OutOfMemoryError = OutOfMemoryError

    @staticmethod
    def init():
        _s()

    @staticmethod
    def is_available():
        try:
            _s()
            return True
        except Exception:
            return False

    @staticmethod
    def current_device():
        _s()
        return 0

    @staticmethod
    def mem_get_info(device=None):
        return mem_get_info_raw()

    @staticmethod
    def get_device_name(device=None):
        buf = ctypes.create_string_buffer(256)
        st = _s()
        st.d.ck("cuDeviceGetName", buf, 256, st.dev)
        return buf.value.decode()

    def get_device_properties(self, device=None):
        st, t = _s(), c_size_t()
        st.d.ck("cuDeviceTotalMem", byref(t), st.dev)
        return _Props(self.get_device_name(device), t.value)

    @staticmethod
    def synchronize():
        _s().d.ck("cuCtxSynchronize")

    @staticmethod
    def empty_cache():
        _s().alloc.empty()

    @staticmethod
    def max_memory_reserved():
        return _s().alloc.max_reserved

    @staticmethod
    def get_allocator_backend():
        return _s().alloc.backend

    class Stream:
        def __init__(self, handle=False):
            if handle is False:
                h = c_void_p()
                _s().d.ck("cuStreamCreate", byref(h), 1)  # non-blocking
                handle = h.value
            self.handle = handle

        def wait_stream(self, other):
            # No events in the stand-in: the host waits for the other stream instead.
            _s().d.ck("cuStreamSynchronize", other.handle)

    @staticmethod
    def current_stream():
        return _CudaModule.Stream(_s().stream)

    @staticmethod
    @contextlib.contextmanager
    def stream(s):
        st = _s()
        before, st.stream = st.stream, s.handle
        try:
            yield
        finally:
            st.stream = before

    class CUDAGraph:
        def __init__(self):
            self.graph, self.exec = None, None

        def replay(self):
            st = _s()
            st.d.ck("cuGraphLaunch", self.exec, st.stream)

        def reset(self):
            st = _state
            if st is not None and self.exec is not None:
                st.d.ck("cuGraphExecDestroy", self.exec)
                st.d.ck("cuGraphDestroy", self.graph)
            self.graph, self.exec = None, None

        def __del__(self):
            try:
                self.reset()
            except Exception:
                pass  # at interpreter exit

    @staticmethod
    @contextlib.contextmanager
    def graph(g):
        """Captures on a side stream (as PyTorch: not the legacy default stream)."""
        st = _s()
        st.d.ck("cuCtxSynchronize")
        side = _CudaModule.Stream()
        before, st.stream = st.stream, side.handle
        st.d.ck("cuStreamBeginCapture", side.handle, 0)  # global mode
        try:
            yield
        finally:
            gr, ex = c_void_p(), c_void_p()
            st.d.ck("cuStreamEndCapture", side.handle, byref(gr))
            st.stream = before
        st.d.ck("cuGraphInstantiate", byref(ex), gr, 0)
        g.graph, g.exec = gr.value, ex.value


cuda = _CudaModule()
