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

extern "C" void polyamp_host_update(float* scale, int* growth, int* backoff,
                                    const float* found_inf, double growth_factor,
                                    double backoff_factor, int growth_interval,
                                    int backoff_interval, float min_scale, float max_scale,
                                    int flags) {
  polyamp::update_state(scale, growth, backoff, found_inf, growth_factor, backoff_factor,
                        growth_interval, backoff_interval, min_scale, max_scale, flags);
}
