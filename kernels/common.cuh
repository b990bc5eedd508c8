// Pieces shared by kernels/offload.cu and kernels/select.cu: the Rust side puts this file in
// front of each of them before NVRTC compiles it.

typedef int i32;
typedef unsigned int u32;

// Exclusive scan of one int per thread over a CTA of THREADS threads (a multiple of 32, at most
// 1024); returns the prefix and sets *total. Every thread of the CTA must call it.
template <int THREADS>
__device__ int block_scan(int x, int* total) {
    __shared__ int warp_sums[THREADS / 32];
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    int v = x;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        const int y = __shfl_up_sync(0xffffffffu, v, o);
        if (lane >= o) v += y;
    }
    if (lane == 31) warp_sums[warp] = v;
    __syncthreads();
    if (warp == 0) {
        int w = lane < THREADS / 32 ? warp_sums[lane] : 0;
#pragma unroll
        for (int o = 1; o < 32; o <<= 1) {
            const int y = __shfl_up_sync(0xffffffffu, w, o);
            if (lane >= o) w += y;
        }
        if (lane < THREADS / 32) warp_sums[lane] = w;
    }
    __syncthreads();
    const int before = (warp > 0 ? warp_sums[warp - 1] : 0) + v - x;
    *total = warp_sums[THREADS / 32 - 1];
    __syncthreads();
    return before;
}
