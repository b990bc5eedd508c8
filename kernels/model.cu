// The small kernels of the engine's Llama forward on the GPU (crates/engine/src/gpu.rs): the
// embedding lookup, RMSNorm, RoPE on adjacent pairs, and SwiGLU. The GEMMs go to cuBLAS and the
// attention to kernels/attn.cu. The residual stream is f32; the inputs of every GEMM and of the
// attention are bf16, as the weights are. Each kernel computes what the CPU forward
// (crates/engine/src/model.rs) computes, in the same order where the order matters for f32.
#include <cuda_bf16.h>

// Threads of a row-wise kernel's block.
#define ROW_THREADS 256

// x[i, :] = table[tokens[i], :] widened to f32; one block per row.
extern "C" __global__ void embed_rows(const __nv_bfloat16* __restrict__ table,
                                      const int* __restrict__ tokens, float* __restrict__ x,
                                      int embed) {
  const size_t row = blockIdx.x;
  const size_t t = (size_t)tokens[row];
  for (int c = threadIdx.x; c < embed; c += blockDim.x) {
    x[row * embed + c] = __bfloat162float(table[t * embed + c]);
  }
}

// out[i, :] = bf16(x[rows[i], :] / rms(x[rows[i], :]) * w); one block of ROW_THREADS per output
// row. The mean of squares is summed in f32 by a tree over the block.
extern "C" __global__ void rms_norm_rows(const float* __restrict__ x, const int* __restrict__ rows,
                                         const float* __restrict__ w,
                                         __nv_bfloat16* __restrict__ out, int embed, float eps) {
  __shared__ float part[ROW_THREADS];
  const size_t src = (size_t)rows[blockIdx.x] * embed;
  const size_t dst = (size_t)blockIdx.x * embed;
  float ss = 0.0f;
  for (int c = threadIdx.x; c < embed; c += ROW_THREADS) {
    const float v = x[src + c];
    ss += v * v;
  }
  part[threadIdx.x] = ss;
  __syncthreads();
  for (int s = ROW_THREADS / 2; s > 0; s >>= 1) {
    if (threadIdx.x < s) part[threadIdx.x] += part[threadIdx.x + s];
    __syncthreads();
  }
  const float r = rsqrtf(part[0] / (float)embed + eps);
  for (int c = threadIdx.x; c < embed; c += ROW_THREADS) {
    out[dst + c] = __float2bfloat16(x[src + c] * r * w[c]);
  }
}

// Splits the fused projection qkv [n, (qh + 2 kvh) d] (f32) into bf16 q [n, qh, d], k and v
// [n, kvh, d], rotating each adjacent pair (2i, 2i + 1) of q's and k's heads by pos * freqs[i].
// One thread per pair of q, k or v.
extern "C" __global__ void rope_split(const float* __restrict__ qkv, const int* __restrict__ pos,
                                      const float* __restrict__ freqs,
                                      __nv_bfloat16* __restrict__ q, __nv_bfloat16* __restrict__ k,
                                      __nv_bfloat16* __restrict__ v, int n, int qh, int kvh,
                                      int d) {
  const int half = d / 2;
  const int width = (qh + 2 * kvh) * half;
  const size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= (size_t)n * width) return;
  const int row = (int)(i / width);
  const int j = (int)(i % width);
  const int head = j / half;
  const int pair = j % half;
  const float* src = qkv + (size_t)row * (qh + 2 * kvh) * d + (size_t)head * d + 2 * pair;
  const float a = src[0];
  const float b = src[1];
  if (head >= qh + kvh) {
    __nv_bfloat16* dst = v + ((size_t)row * kvh + (head - qh - kvh)) * d + 2 * pair;
    dst[0] = __float2bfloat16(a);
    dst[1] = __float2bfloat16(b);
    return;
  }
  float s, c;
  sincosf((float)pos[row] * freqs[pair], &s, &c);
  __nv_bfloat16* dst = head < qh ? q + ((size_t)row * qh + head) * d + 2 * pair
                                 : k + ((size_t)row * kvh + (head - qh)) * d + 2 * pair;
  dst[0] = __float2bfloat16(a * c - b * s);
  dst[1] = __float2bfloat16(a * s + b * c);
}

// out[i, j] = bf16(silu(gu[i, j]) * gu[i, ffn + j]) for the fused gate and up projections
// gu [n, 2 ffn] (f32).
extern "C" __global__ void swiglu(const float* __restrict__ gu, __nv_bfloat16* __restrict__ out,
                                  int n, int ffn) {
  const size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= (size_t)n * ffn) return;
  const size_t row = i / ffn;
  const size_t j = i % ffn;
  const float g = gu[row * 2 * ffn + j];
  const float u = gu[row * 2 * ffn + ffn + j];
  out[i] = __float2bfloat16(g / (1.0f + expf(-g)) * u);
}

// out[i] = bf16(x[i]) for `len` elements.
extern "C" __global__ void to_bf16(const float* __restrict__ x, __nv_bfloat16* __restrict__ out,
                                   int len) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < len) out[i] = __float2bfloat16(x[i]);
}
