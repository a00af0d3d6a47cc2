// Host emulation of polyamp's cupy kernels for tests on machines without a GPU.
// Runs every (block, thread) of a launch in turn through the same __host__ __device__
// bodies the __global__ kernels call; the block's __syncthreads_or becomes a plain OR.
// Built by tests/backends/test_cupy_kernels_host.py with -DPOLYAMP_HOST_ONLY.
#include "polyamp_cupy_kernels.cu"

template <typename T>
static void run_unscale(const long long* table, int n_tensors, long long n_chunks, int chunk,
                        const float* scale, float* found_inf, int check_only,
                        long long n_blocks, long long n_threads) {
  for (long long b = 0; b < n_blocks; ++b) {
    bool bad = false;
    for (long long t = 0; t < n_threads; ++t) {
      bad |= polyamp::unscale_thread<T>(table, n_tensors, n_chunks, chunk, scale, check_only,
                                        b, n_blocks, t, n_threads);
    }
    polyamp::publish_flag(bad, true, found_inf);
  }
}

// kind: 0 float32, 1 float64, 2 float16, 3 bfloat16. Returns 0, or -1 for an unknown kind.
extern "C" int polyamp_host_unscale(int kind, const long long* table, int n_tensors,
                                    long long n_chunks, int chunk, const float* scale,
                                    float* found_inf, int check_only, long long n_blocks,
                                    long long n_threads) {
  switch (kind) {
    case 0: run_unscale<float>(table, n_tensors, n_chunks, chunk, scale, found_inf, check_only, n_blocks, n_threads); return 0;
    case 1: run_unscale<double>(table, n_tensors, n_chunks, chunk, scale, found_inf, check_only, n_blocks, n_threads); return 0;
    case 2: run_unscale<__half>(table, n_tensors, n_chunks, chunk, scale, found_inf, check_only, n_blocks, n_threads); return 0;
    case 3: run_unscale<__nv_bfloat16>(table, n_tensors, n_chunks, chunk, scale, found_inf, check_only, n_blocks, n_threads); return 0;
  }
  return -1;
}

// The unscale-and-count kernel's loop (polyamp::unscale_count_kernel) on the host: per chunk
// every thread's phase-0 pass, their counts combined as the block's shared atomics combine them,
// then each target's pass of every thread. Same __host__ __device__ bodies as the device.
template <typename T>
static void run_unscale_count(const long long* table, int n_tensors, long long n_chunks,
                              int chunk, const float* scale, float* found_inf,
                              const double* targets, int n_targets, int phase,
                              unsigned long long* raw, unsigned long long* extremes,
                              long long n_blocks, long long n_threads) {
  const float inv = polyamp::inv_scale_of(scale);
  const bool multiply = inv != 1.0f;
  const bool store = multiply || !polyamp::Elem<T>::kExactStore;
  const int per = 2 + 3 * n_targets;
  const long long* sizes = table + n_tensors;
  const long long* chunks = table + 2 * (long long)n_tensors;
  for (long long b = 0; b < n_blocks; ++b) {
    bool bad = false;
    for (long long c = b; c < n_chunks; c += n_blocks) {
      const long long entry = chunks[c];
      const int t = (int)(entry >> 32);
      const long long start = (entry & 0xffffffffLL) * chunk;
      const long long stop = start + chunk < sizes[t] ? start + chunk : sizes[t];
      T* data = reinterpret_cast<T*>(table[t]);
      if (phase == 0) {
        for (long long th = 0; th < n_threads; ++th) {
          polyamp::Base base = {0, 0, 0.0, polyamp::double_of(0x7FF0000000000000ULL)};
          bad |= polyamp::for_range<T, 1>(data, start, stop, store, th, n_threads,
                                          polyamp::UnscaleCount{inv, multiply, store, base});
          raw[(long long)t * per] += base.nonfinite;
          raw[(long long)t * per + 1] += base.zeros;
          unsigned long long top = polyamp::bits_of(base.amax), low = polyamp::bits_of(base.amin);
          if (top > extremes[2 * t]) extremes[2 * t] = top;
          if (low < extremes[2 * t + 1]) extremes[2 * t + 1] = low;
        }
      }
      for (int j = 0; j < n_targets; ++j) {
        if (!polyamp::in_phase(targets, j, phase)) continue;
        const double* target = targets + 6 * j;
        const double s = polyamp::target_scale(
            target, scale, phase == 1 ? polyamp::double_of(extremes[2 * t]) : 0.0);
        for (long long th = 0; th < n_threads; ++th) {
          polyamp::Three k = {0, 0, 0};
          polyamp::count_target_range<T>(data, start, stop, s, target, th, n_threads, k);
          unsigned long long* row = raw + (long long)t * per + 2 + 3 * j;
          row[0] += k.low;
          row[1] += k.below;
          row[2] += k.over;
        }
      }
    }
    if (phase == 0) polyamp::publish_flag(bad, true, found_inf);
  }
}

extern "C" int polyamp_host_unscale_count(int kind, const long long* table, int n_tensors,
                                          long long n_chunks, int chunk, const float* scale,
                                          float* found_inf, const double* targets, int n_targets,
                                          int phase, unsigned long long* raw,
                                          unsigned long long* extremes, long long n_blocks,
                                          long long n_threads) {
#define POLYAMP_RUN(T) run_unscale_count<T>(table, n_tensors, n_chunks, chunk, scale, found_inf, \
    targets, n_targets, phase, raw, extremes, n_blocks, n_threads); return 0
  switch (kind) {
    case 0: POLYAMP_RUN(float);
    case 1: POLYAMP_RUN(double);
    case 2: POLYAMP_RUN(__half);
    case 3: POLYAMP_RUN(__nv_bfloat16);
  }
#undef POLYAMP_RUN
  return -1;
}

extern "C" void polyamp_host_update(float* scale, int* growth, int* backoff,
                                    const float* found_inf, double growth_factor,
                                    double backoff_factor, int growth_interval,
                                    int backoff_interval, float min_scale, float max_scale,
                                    int flags) {
  polyamp::update_state(scale, growth, backoff, found_inf, growth_factor, backoff_factor,
                        growth_interval, backoff_interval, min_scale, max_scale, flags);
}
