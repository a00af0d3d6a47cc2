"""CUDA sources of the cupy backend (plain strings), the chunk-table builder and the compile cache.

Importing this module imports no cupy, so ``tools/check_cuda_kernels.py`` can compile every
source with nvcc on a machine without a GPU; :func:`kernel` compiles with ``cupy.RawModule``
(NVRTC) on first use, once per module and device. docs/backends/cupy.md describes the kernels (the
chunk table, 16-byte vector loads, torch's arithmetic, one flag store per block). The per-thread
bodies are ``__host__ __device__`` so the tests can run them on the CPU (``POLYAMP_HOST_ONLY``
leaves the ``__global__`` wrappers out).
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np

BLOCK_THREADS = 256
UNROLL = 4
CHUNK = 16384  # elements per block-sized piece of a tensor; a multiple of every vector width
MAX_BLOCKS_PER_SM = 32  # grid cap (blocks grid-stride over the chunk table beyond it)

DTYPES = ("float32", "float64", "float16", "bfloat16")
UNSCALE_KERNELS = {dtype: f"polyamp_unscale_{dtype}" for dtype in DTYPES}
UPDATE_KERNEL = "polyamp_update_scale"
#: Unscale and a precision meter's counts (polyamp._precision_counts) in one kernel per dtype.
COUNT_KERNELS = {dtype: f"polyamp_unscale_count_{dtype}" for dtype in DTYPES}
#: The count kernels' ``targets``: per target these float64 values; ``kind`` 0 the loss scale,
#: 1 the number ``scale``, 2 ``max_finite / amax`` (polyamp._precision_targets.Bounds).
TARGET_SLOTS = ("kind", "scale", "underflow_max", "subnormal_below", "overflow_from", "max_finite")
#: The count kernels' ``raw`` per tensor: nonfinite, zeros, then per target #(v <= m/2),
#: #(v < n - m/2), #(v >= M + ulp/2); ``extremes`` per tensor: amax's bits, amin's bits.
RAW_FIELDS = 2
INF_BITS = 0x7FF0000000000000
# update_scale's flags argument; the last three are polyamp.policy.RuleParams
HAS_MIN, HAS_MAX, FLOAT32_PRODUCT = 1, 2, 4
KEEPS_COUNT, FINITE_REFILLS, GROWTH_DELAY = 8, 16, 32
# polyamp.config.SCALE_FLOOR, repeated so that tools/check_cuda_kernels.py can load this file
# without polyamp installed; tests/backends/test_cupy_kernels_host.py holds the two equal.
SCALE_FLOOR = 2.0**-126

_COMMON = r"""
// polyamp cupy backend: fused multi-tensor unscale-and-check. Shared part.
namespace polyamp {

typedef long long i64;
typedef unsigned long long u64;

// Elem<T>: op_t is the type arithmetic runs in (torch's opmath type); load() widens and
// store() rounds back to T exactly as torch's static_cast<scalar_t> does.
template <typename T> struct Elem;

__host__ __device__ inline bool is_finite(float v) {
  return v >= -3.4028234663852886e+38f && v <= 3.4028234663852886e+38f;  // false for nan
}
__host__ __device__ inline bool is_finite(double v) {
  return v >= -1.7976931348623157e+308 && v <= 1.7976931348623157e+308;
}

// 16 bytes of T: copied with one vector load/store when 16-byte aligned.
template <typename T> struct alignas(16) Pack { T v[16 / sizeof(T)]; };

__host__ __device__ inline float inv_scale_of(const float* scale) {
  return (float)(1.0 / (double)(*scale));  // torch: scale.double().reciprocal().float()
}

template <typename T>
__host__ __device__ inline bool unscale_one(T& x, float inv, bool multiply, bool store) {
  typedef typename Elem<T>::op_t op_t;
  const op_t v = Elem<T>::load(x);
  const bool bad = !is_finite(v);
  if (store) x = Elem<T>::store(multiply ? v * (op_t)inv : v);
  return bad;
}

// Elements [start, stop) of one tensor, strided over the threads of one block: any op(x) true.
// 16-byte vector loads (kUnroll in flight per thread) and stores where aligned, else one by one.
template <typename T, int kUnroll, typename Op>
__host__ __device__ inline bool for_range(T* data, i64 start, i64 stop, bool store, i64 thread,
                                          i64 n_threads, Op op) {
  const int kVec = 16 / sizeof(T);
  bool bad = false;
  i64 scalar_from = start;
  if ((((u64)(data + start)) & 15) == 0) {
    const i64 n_vec = (stop - start) / kVec;
    Pack<T>* vec = reinterpret_cast<Pack<T>*>(data + start);
    for (i64 base = thread; base < n_vec; base += n_threads * kUnroll) {
      Pack<T> p[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const i64 i = base + u * n_threads;
        if (i < n_vec) p[u] = vec[i];
      }
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const i64 i = base + u * n_threads;
        if (i < n_vec) {
#pragma unroll
          for (int k = 0; k < kVec; ++k) bad |= op(p[u].v[k]);
          if (store) vec[i] = p[u];
        }
      }
    }
    scalar_from = start + n_vec * kVec;
  }
  for (i64 i = scalar_from + thread; i < stop; i += n_threads) bad |= op(data[i]);
  return bad;
}

struct Unscale {
  float inv;
  bool multiply, store;
  template <typename T> __host__ __device__ bool operator()(T& x) const {
    return unscale_one<T>(x, inv, multiply, store);
  }
};

// One thread's whole share of a launch: chunks block, block + n_blocks, ... of the table.
template <typename T>
__host__ __device__ inline bool unscale_thread(const i64* table, int n_tensors, i64 n_chunks,
                                               int chunk, const float* scale, int check_only,
                                               i64 block, i64 n_blocks, i64 thread,
                                               i64 n_threads) {
  const float inv = inv_scale_of(scale);
  const bool multiply = inv != 1.0f;
  const bool store = !check_only && (multiply || !Elem<T>::kExactStore);
  const i64* sizes = table + n_tensors;
  const i64* chunks = table + 2 * (i64)n_tensors;
  bool bad = false;
  for (i64 c = block; c < n_chunks; c += n_blocks) {
    const i64 entry = chunks[c];
    const int t = (int)(entry >> 32);
    const i64 start = (entry & 0xffffffffLL) * chunk;
    const i64 stop = start + chunk < sizes[t] ? start + chunk : sizes[t];
    T* data = reinterpret_cast<T*>(table[t]);
    bad |= for_range<T, @UNROLL@>(data, start, stop, store, thread, n_threads,
                                  Unscale{inv, multiply, store});
  }
  return bad;
}

// After the block's OR: one store of 1.0 by the leader thread; the flag is never cleared.
__host__ __device__ inline void publish_flag(bool block_bad, bool leader, float* found_inf) {
  if (block_bad && leader) *found_inf = 1.0f;
}

}  // namespace polyamp

#ifndef POLYAMP_HOST_ONLY
#define POLYAMP_UNSCALE_KERNEL(NAME, T)                                                     \
  extern "C" __global__ void __launch_bounds__(@BLOCK@) NAME(                                 \
      const long long* table, int n_tensors, long long n_chunks, int chunk,                 \
      const float* scale, float* found_inf, int check_only) {                               \
    const bool bad = polyamp::unscale_thread<T>(table, n_tensors, n_chunks, chunk, scale,   \
                                                check_only, blockIdx.x, gridDim.x,          \
                                                threadIdx.x, blockDim.x);                   \
    polyamp::publish_flag(__syncthreads_or(bad), threadIdx.x == 0, found_inf);              \
  }
#else
#define POLYAMP_UNSCALE_KERNEL(NAME, T)
#endif
"""

_COUNT = r"""
// polyamp cupy backend: unscale and a precision meter's counts, fused (polyamp._precision_counts).
// Phase 0 unscales each chunk as unscale_thread does (16-byte vectors), counts its stored values
// (nonfinite, zeros, amax, amin), then, while the chunk is in L1/L2, each target not scaled by
// amax; phase 1 (a second launch, only with such targets) counts the amax targets, their scale
// M / amax read from phase 0's amax. Counts are exact: v = |g| * s in float64 per value.
namespace polyamp {

struct Base {
  u64 nonfinite, zeros;
  double amax, amin;
};
struct Three {
  u64 low, below, over;
};

__host__ __device__ inline u64 bits_of(double v) {
#ifdef __CUDA_ARCH__
  return (u64)__double_as_longlong(v);
#else
  u64 b;
  __builtin_memcpy(&b, &v, sizeof b);
  return b;
#endif
}
__host__ __device__ inline double double_of(u64 b) {
#ifdef __CUDA_ARCH__
  return __longlong_as_double((i64)b);
#else
  double v;
  __builtin_memcpy(&v, &b, sizeof v);
  return v;
#endif
}

__host__ __device__ inline void tally(Base& c, double y) {
  const bool fin = is_finite(y);
  const double a = fin ? (y < 0.0 ? -y : y) : 0.0;
  c.nonfinite += !fin;
  c.zeros += fin && a == 0.0;
  if (a > c.amax) c.amax = a;
  if (a > 0.0 && a < c.amin) c.amin = a;
}

// unscale_one with the stored value counted; for_range with it takes one load in flight per
// thread (the counts take registers: no spills).
struct UnscaleCount {
  float inv;
  bool multiply, store;
  Base& c;
  template <typename T> __host__ __device__ bool operator()(T& x) const {
    const bool bad = unscale_one<T>(x, inv, multiply, store);
    tally(c, (double)Elem<T>::load(x));
    return bad;
  }
};

// A target's multiplier s in float64: the loss scale, the number, or M / amax (1 when amax is 0,
// the largest float64 where the quotient overflows).
__host__ __device__ inline double target_scale(const double* target, const float* scale,
                                               double amax) {
  if (target[0] == 0.0) return (double)*scale;
  if (target[0] == 1.0) return target[1];
  const double s = target[5] / (amax > 0.0 ? amax : target[5]);
  return is_finite(s) ? s : 1.7976931348623157e+308;
}

// One target's counts over [start, stop) of one tensor, strided over a block's threads.
template <typename T>
__host__ __device__ inline void count_target_range(const T* data, i64 start, i64 stop, double s,
                                                   const double* target, i64 thread,
                                                   i64 n_threads, Three& c) {
  const double under = target[2], below = target[3], over = target[4];
  for (i64 i = start + thread; i < stop; i += n_threads) {
    const double y = (double)Elem<T>::load(data[i]);
    const double v = (is_finite(y) ? (y < 0.0 ? -y : y) : 0.0) * s;
    c.low += v <= under;
    c.below += v < below;
    c.over += v >= over;
  }
}

// Whether target j is counted in ``phase`` (0: all but the amax targets; 1: the amax targets).
__host__ __device__ inline bool in_phase(const double* targets, int j, int phase) {
  return (targets[@SLOTS@ * j] == 2.0) == (phase == 1);
}

}  // namespace polyamp

#ifndef POLYAMP_HOST_ONLY
namespace polyamp {
template <typename T>
__device__ inline void unscale_count_kernel(const i64* table, int n_tensors, i64 n_chunks,
                                            int chunk, const float* scale, float* found_inf,
                                            const double* targets, int n_targets, int phase,
                                            u64* raw, u64* extremes) {
  __shared__ u64 sums[3];
  __shared__ u64 top, low;
  const float inv = inv_scale_of(scale);
  const bool multiply = inv != 1.0f;
  const bool store = multiply || !Elem<T>::kExactStore;
  const int per = @RAW@ + 3 * n_targets;
  const i64* sizes = table + n_tensors;
  const i64* chunks = table + 2 * (i64)n_tensors;
  bool bad = false;
  for (i64 c = blockIdx.x; c < n_chunks; c += gridDim.x) {
    const i64 entry = chunks[c];
    const int t = (int)(entry >> 32);
    const i64 start = (entry & 0xffffffffLL) * chunk;
    const i64 stop = start + chunk < sizes[t] ? start + chunk : sizes[t];
    T* data = reinterpret_cast<T*>(table[t]);
    if (phase == 0) {
      if (threadIdx.x == 0) {
        sums[0] = sums[1] = 0;
        top = 0;
        low = @INF_BITS@ULL;
      }
      __syncthreads();
      Base b = {0, 0, 0.0, double_of(@INF_BITS@ULL)};
      bad |= for_range<T, 1>(data, start, stop, store, threadIdx.x, blockDim.x,
                             UnscaleCount{inv, multiply, store, b});
      atomicAdd(&sums[0], (unsigned long long)b.nonfinite);
      atomicAdd(&sums[1], (unsigned long long)b.zeros);
      atomicMax(&top, (unsigned long long)bits_of(b.amax));
      atomicMin(&low, (unsigned long long)bits_of(b.amin));
      __syncthreads();  // the sums, and the block's stores seen by the target passes below
      if (threadIdx.x == 0) {
        atomicAdd(&raw[(i64)t * per], (unsigned long long)sums[0]);
        atomicAdd(&raw[(i64)t * per + 1], (unsigned long long)sums[1]);
        atomicMax(&extremes[2 * (i64)t], (unsigned long long)top);
        atomicMin(&extremes[2 * (i64)t + 1], (unsigned long long)low);
      }
    }
    for (int j = 0; j < n_targets; ++j) {
      if (!in_phase(targets, j, phase)) continue;  // the same for every thread of the block
      const double* target = targets + @SLOTS@ * j;
      const double s = target_scale(target, scale, phase == 1 ? double_of(extremes[2 * (i64)t]) : 0.0);
      __syncthreads();
      if (threadIdx.x == 0) sums[0] = sums[1] = sums[2] = 0;
      __syncthreads();
      Three k = {0, 0, 0};
      count_target_range<T>(data, start, stop, s, target, threadIdx.x, blockDim.x, k);
      atomicAdd(&sums[0], (unsigned long long)k.low);
      atomicAdd(&sums[1], (unsigned long long)k.below);
      atomicAdd(&sums[2], (unsigned long long)k.over);
      __syncthreads();
      if (threadIdx.x == 0) {
        u64* row = raw + (i64)t * per + @RAW@ + 3 * j;
        atomicAdd(&row[0], (unsigned long long)sums[0]);
        atomicAdd(&row[1], (unsigned long long)sums[1]);
        atomicAdd(&row[2], (unsigned long long)sums[2]);
      }
    }
    __syncthreads();
  }
  if (phase == 0) publish_flag(__syncthreads_or(bad), threadIdx.x == 0, found_inf);
}
}  // namespace polyamp
#define POLYAMP_COUNT_KERNEL(NAME, T)                                                       \
  extern "C" __global__ void __launch_bounds__(@BLOCK@) NAME(                                 \
      const long long* table, int n_tensors, long long n_chunks, int chunk,                 \
      const float* scale, float* found_inf, const double* targets, int n_targets,           \
      int phase, unsigned long long* raw, unsigned long long* extremes) {                   \
    polyamp::unscale_count_kernel<T>(table, n_tensors, n_chunks, chunk, scale, found_inf,   \
                                     targets, n_targets, phase, raw, extremes);             \
  }
#else
#define POLYAMP_COUNT_KERNEL(NAME, T)
#endif
"""

# Per dtype: C type, header, Elem<T> (opmath type, load, store, kExactStore), its two kernels.
# kExactStore: writing back an unmultiplied float/double changes no bit; torch rounds half and
# bfloat16 back even when inv == 1 (nan bits), so those are always stored.
_ELEM = r"""
@INCLUDE@
namespace polyamp {
template <> struct Elem<@T@> {
  typedef @OP@ op_t;
  static const bool kExactStore = @EXACT@;
  __host__ __device__ static @OP@ load(@T@ v) { return @LOAD@; }
  __host__ __device__ static @T@ store(@OP@ v) { return @STORE@; }
};
}  // namespace polyamp
POLYAMP_UNSCALE_KERNEL(@UNSCALE@, @T@)
POLYAMP_COUNT_KERNEL(@COUNT@, @T@)
"""
_ELEMS = {
    "float32": ("float", "", "float", "v", "v", "true"),
    "float64": ("double", "", "double", "v", "v", "true"),
    "float16": ("__half", "#include <cuda_fp16.h>", "float", "__half2float(v)", "__float2half(v)", "false"),
    "bfloat16": ("__nv_bfloat16", "#include <cuda_bf16.h>", "float", "__bfloat162float(v)",
                 "__float2bfloat16(v)", "false"),
}


def _elem(dtype: str) -> str:
    """Elem<T> for ``dtype`` and its unscale and count kernels."""
    names = ("@T@", "@INCLUDE@", "@OP@", "@LOAD@", "@STORE@", "@EXACT@")
    values = dict(zip(names, _ELEMS[dtype]), **{"@UNSCALE@": UNSCALE_KERNELS[dtype],
                                                "@COUNT@": COUNT_KERNELS[dtype]})
    return _fill(_ELEM, values)


_UPDATE = r"""
// polyamp cupy backend: the loss-scale rules of polyamp.policy.next_host_state, on the device.
namespace polyamp {

// scale * factor formed in float32 (paddle) or float64 (torch), rounded to float32.
__host__ __device__ inline float scaled(float s, double factor, bool float32_product) {
  return float32_product ? s * (float)factor : (float)((double)s * factor);
}

__host__ __device__ inline void update_state(float* scale, int* growth, int* backoff,
                                             const float* found_inf, double growth_factor,
                                             double backoff_factor, int growth_interval,
                                             int backoff_interval, float min_scale,
                                             float max_scale, int flags) {
  const bool f32 = (flags & @FLOAT32_PRODUCT@) != 0;
  float s = *scale;
  if (*found_inf != 0.0f) {  // nan counts as an overflow, as in the policy
    // >= as in the policy: a tracker past the limit (a shortened interval) is spent, not stuck
    unsigned b = (unsigned)*backoff + 1u;
    if (b >= (unsigned)backoff_interval) {
      s = scaled(s, backoff_factor, f32);
      // The floor: min_scale when set (never below SCALE_FLOOR), else SCALE_FLOOR = 2**-126,
      // so the scale never turns subnormal or 0. Python max(s, floor).
      const float floor = (flags & @HAS_MIN@) ? min_scale : @SCALE_FLOOR@;
      if (floor > s) s = floor;
      // a spent hysteresis stays spent with KEEPS_COUNT (megatron, deepspeed)
      b = (flags & @KEEPS_COUNT@) ? (unsigned)backoff_interval - 1u : 0u;
    }
    *growth = 0;
    *backoff = (int)b;
  } else {
    // unsigned: growth_interval + delay may be 2**31, beyond int
    const unsigned delay = (flags & @GROWTH_DELAY@) ? 1u : 0u;
    unsigned g = (unsigned)*growth + 1u;
    int b = (flags & @FINITE_REFILLS@) ? 0 : *backoff;
    if (g >= (unsigned)growth_interval + delay) {  // >=: see the backoff above
      float grown = scaled(s, growth_factor, f32);
      if (is_finite(grown)) {
        if ((flags & @HAS_MAX@) && max_scale < grown) grown = max_scale;
        s = grown;
      }
      g = delay;
      b = 0;
    }
    *growth = (int)g;
    *backoff = b;
  }
  *scale = s;
}

}  // namespace polyamp

#ifndef POLYAMP_HOST_ONLY
extern "C" __global__ void polyamp_update_scale(
    float* scale, int* growth, int* backoff, const float* found_inf, double growth_factor,
    double backoff_factor, int growth_interval, int backoff_interval, float min_scale,
    float max_scale, int flags) {
  if (blockIdx.x == 0 && threadIdx.x == 0) {
    polyamp::update_state(scale, growth, backoff, found_inf, growth_factor, backoff_factor,
                          growth_interval, backoff_interval, min_scale, max_scale, flags);
  }
}
#endif
"""


def _fill(source: str, values: dict[str, Any] | None = None) -> str:
    """Substitute the Python-side constants (and ``values``) into a source template."""
    values = {
        **(values or {}),
        "@BLOCK@": BLOCK_THREADS, "@UNROLL@": UNROLL, "@HAS_MIN@": HAS_MIN,
        "@HAS_MAX@": HAS_MAX, "@FLOAT32_PRODUCT@": FLOAT32_PRODUCT, "@KEEPS_COUNT@": KEEPS_COUNT,
        "@FINITE_REFILLS@": FINITE_REFILLS, "@GROWTH_DELAY@": GROWTH_DELAY,
        "@SCALE_FLOOR@": f"{SCALE_FLOOR!r}f",  # 2**-126: its shortest repr rounds back exactly
        "@SLOTS@": len(TARGET_SLOTS), "@RAW@": RAW_FIELDS, "@INF_BITS@": hex(INF_BITS),
    }
    for key, value in values.items():
        source = source.replace(key, str(value))
    return source


# Two NVRTC modules: bfloat16 apart, so a toolkit without cuda_bf16.h still runs the rest.
_MAIN = ("float32", "float64", "float16")
MODULE_SOURCES: dict[str, str] = {
    "main": _fill(_COMMON + _COUNT + "".join(map(_elem, _MAIN)) + _UPDATE),
    "bfloat16": _fill(_COMMON + _COUNT + _elem("bfloat16")),
}
MODULE_KERNELS: dict[str, tuple[str, ...]] = {
    "main": (*(UNSCALE_KERNELS[d] for d in _MAIN), UPDATE_KERNEL, *(COUNT_KERNELS[d] for d in _MAIN)),
    "bfloat16": (UNSCALE_KERNELS["bfloat16"], COUNT_KERNELS["bfloat16"]),
}
# Every kernel in one translation unit: what the nvcc check and the host-emulation tests build.
ALL_SOURCE = _fill(_COMMON + _COUNT + "".join(map(_elem, DTYPES)) + _UPDATE)
_MODULE_OF = {name: mod for mod, names in MODULE_KERNELS.items() for name in names}


def build_table(ptrs: list[int], sizes: list[int], chunk: int = CHUNK) -> tuple[np.ndarray, int]:
    """The int64 host table ``[ptrs, sizes, chunk entries]`` and its number of chunks.

    Empty tensors get no chunk. Costs O(tensors + chunks) NumPy work; cached by the caller.
    """
    if chunk <= 0 or chunk % 8 or chunk >= 2**31:
        raise ValueError(f"chunk must be a positive multiple of 8 below 2**31, got chunk={chunk!r}")
    ptr_arr = np.asarray(ptrs, dtype=np.uint64).view(np.int64)
    size_arr = np.asarray(sizes, dtype=np.int64)
    per_tensor = (size_arr + (chunk - 1)) // chunk
    if len(size_arr) and per_tensor.max() >= 2**32:
        raise ValueError(f"a tensor of {int(size_arr.max())} elements needs over 2**32 chunks")
    n_chunks = int(per_tensor.sum())
    owner = np.repeat(np.arange(len(size_arr), dtype=np.int64), per_tensor)
    first = np.repeat(np.cumsum(per_tensor) - per_tensor, per_tensor)
    entries = (owner << 32) | (np.arange(n_chunks, dtype=np.int64) - first)
    return np.concatenate([ptr_arr, size_arr, entries]), n_chunks


_compiled: dict[tuple[str, int], Any] = {}
_compile_lock = threading.Lock()


def kernel(name: str, device: int) -> Any:
    """The ``cupy.RawKernel`` called ``name`` on ``device``, compiling its module on first use.

    The first call per module and device runs NVRTC (about a second; cupy caches it on disk).
    """
    module_name = _MODULE_OF[name]
    key = (module_name, device)
    module = _compiled.get(key)
    if module is None:
        with _compile_lock:
            module = _compiled.get(key)
            if module is None:
                module = _compiled[key] = _compile(module_name, device)
    return module.get_function(name)


def _compile(module_name: str, device: int) -> Any:
    """Compile one module with NVRTC on ``device``; a failure names the module and the fix."""
    import cupy

    from polyamp._errors import BackendError

    with cupy.cuda.Device(device):
        try:
            module = cupy.RawModule(code=MODULE_SOURCES[module_name])
            module.get_function(MODULE_KERNELS[module_name][0])  # compile and load now
        except Exception as exc:
            raise BackendError(
                f"polyamp's cupy kernels ({module_name!r} module) failed to compile with NVRTC "
                f"on device {device}: {type(exc).__name__}: {exc}. Fix: install a CUDA toolkit or "
                "NVRTC matching your cupy build, or use backend='torch' / 'numpy'."
            ) from exc
    return module
