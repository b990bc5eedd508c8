// The small kernels of the engine's Llama forward on the GPU (crates/engine/src/gpu.rs): the
// embedding lookup, RMSNorm, RoPE on adjacent pairs, SwiGLU, and the synthetic model's random
// weights. The GEMMs go to cuBLAS and the attention to kernels/attn.cu. The residual stream is
// f32; the inputs of every GEMM and of the attention have the weights' type T (f16 or bf16).
// Each kernel computes what the CPU forward (crates/engine/src/model.rs) computes, in the same
// order where the order matters for f32. Every kernel is instantiated for both types under the
// names `NAME_f16` and `NAME_bf16`.
#include <cuda_fp16.h>
#include <cuda_bf16.h>

// Threads of a row-wise kernel's block.
#define ROW_THREADS 256

__device__ inline float widen(__half x) { return __half2float(x); }
__device__ inline float widen(__nv_bfloat16 x) { return __bfloat162float(x); }

template <typename T> __device__ T narrow(float x);
template <> __device__ inline __half narrow<__half>(float x) { return __float2half_rn(x); }
template <> __device__ inline __nv_bfloat16 narrow<__nv_bfloat16>(float x) {
  return __float2bfloat16_rn(x);
}

// x[i, :] = table[tokens[i], :] widened to f32; one block per row.
template <typename T>
__device__ void embed_rows(const T* __restrict__ table, const int* __restrict__ tokens,
                           float* __restrict__ x, int embed) {
  const size_t row = blockIdx.x;
  const size_t t = (size_t)tokens[row];
  for (int c = threadIdx.x; c < embed; c += blockDim.x) {
    x[row * embed + c] = widen(table[t * embed + c]);
  }
}

// out[i, :] = T(x[rows[i], :] / rms(x[rows[i], :]) * w); one block of ROW_THREADS per output
// row. The mean of squares is summed in f32 by a tree over the block.
template <typename T>
__device__ void rms_norm_rows(const float* __restrict__ x, const int* __restrict__ rows,
                              const float* __restrict__ w, T* __restrict__ out, int embed,
                              float eps) {
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
    out[dst + c] = narrow<T>(x[src + c] * r * w[c]);
  }
}

// Splits the fused projection qkv [n, (qh + 2 kvh) d] (f32) into q [n, qh, d], k and v
// [n, kvh, d] of T, rotating each adjacent pair (2i, 2i + 1) of q's and k's heads by
// pos * freqs[i]. One thread per pair of q, k or v.
template <typename T>
__device__ void rope_split(const float* __restrict__ qkv, const int* __restrict__ pos,
                           const float* __restrict__ freqs, T* __restrict__ q,
                           T* __restrict__ k, T* __restrict__ v, int n, int qh, int kvh, int d) {
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
    T* dst = v + ((size_t)row * kvh + (head - qh - kvh)) * d + 2 * pair;
    dst[0] = narrow<T>(a);
    dst[1] = narrow<T>(b);
    return;
  }
  float s, c;
  sincosf((float)pos[row] * freqs[pair], &s, &c);
  T* dst = head < qh ? q + ((size_t)row * qh + head) * d + 2 * pair
                     : k + ((size_t)row * kvh + (head - qh)) * d + 2 * pair;
  dst[0] = narrow<T>(a * c - b * s);
  dst[1] = narrow<T>(a * s + b * c);
}

// out[i, j] = T(silu(gu[i, j]) * gu[i, ffn + j]) for the fused gate and up projections
// gu [n, 2 ffn] (f32).
template <typename T>
__device__ void swiglu(const float* __restrict__ gu, T* __restrict__ out, int n, int ffn) {
  const size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= (size_t)n * ffn) return;
  const size_t row = i / ffn;
  const size_t j = i % ffn;
  const float g = gu[row * 2 * ffn + j];
  const float u = gu[row * 2 * ffn + ffn + j];
  out[i] = narrow<T>(g / (1.0f + expf(-g)) * u);
}

// out[i] = T(x[i]) for `len` elements.
template <typename T>
__device__ void narrow_all(const float* __restrict__ x, T* __restrict__ out, int len) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < len) out[i] = narrow<T>(x[i]);
}

// out[i] = T(scale * u) for `len` elements, u uniform in [-1, 1) drawn from a hash of (seed, i)
// (splitmix64's finalizer): the synthetic model's weights, made where they live. Grid-stride.
template <typename T>
__device__ void fill_uniform(T* __restrict__ out, unsigned long long len,
                             unsigned long long seed, float scale) {
  for (unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x; i < len;
       i += (unsigned long long)gridDim.x * blockDim.x) {
    unsigned long long z = seed + (i + 1) * 0x9E3779B97F4A7C15ull;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    z ^= z >> 31;
    const float u = (float)(z >> 40) * (1.0f / 16777216.0f);
    out[i] = narrow<T>(scale * (2.0f * u - 1.0f));
  }
}

// out[i] = the index of the largest of logits[i, :] (the first of equals, as the CPU's argmax);
// one block of ROW_THREADS per row. Greedy sampling without moving the logits to the host.
extern "C" __global__ void argmax_rows(const float* __restrict__ logits, int* __restrict__ out,
                                       int vocab) {
  __shared__ float best[ROW_THREADS];
  __shared__ int at[ROW_THREADS];
  const float* row = logits + (size_t)blockIdx.x * vocab;
  float b = -__int_as_float(0x7f800000);
  int a = vocab;
  for (int c = threadIdx.x; c < vocab; c += ROW_THREADS) {
    const float x = row[c];
    if (x > b) {
      b = x;
      a = c;
    }
  }
  best[threadIdx.x] = b;
  at[threadIdx.x] = a;
  __syncthreads();
  for (int s = ROW_THREADS / 2; s > 0; s >>= 1) {
    if (threadIdx.x < s) {
      const float o = best[threadIdx.x + s];
      const int oa = at[threadIdx.x + s];
      if (o > best[threadIdx.x] || (o == best[threadIdx.x] && oa < at[threadIdx.x])) {
        best[threadIdx.x] = o;
        at[threadIdx.x] = oa;
      }
    }
    __syncthreads();
  }
  if (threadIdx.x == 0) out[blockIdx.x] = at[0] < vocab ? at[0] : 0;
}

#define INSTANTIATE(T, S)                                                                       \
  extern "C" __global__ void embed_rows_##S(const T* table, const int* tokens, float* x,      \
                                            int embed) {                                      \
    embed_rows<T>(table, tokens, x, embed);                                                   \
  }                                                                                           \
  extern "C" __global__ void rms_norm_rows_##S(const float* x, const int* rows, const float* w, \
                                               T* out, int embed, float eps) {                 \
    rms_norm_rows<T>(x, rows, w, out, embed, eps);                                             \
  }                                                                                           \
  extern "C" __global__ void rope_split_##S(const float* qkv, const int* pos,                 \
                                            const float* freqs, T* q, T* k, T* v, int n,      \
                                            int qh, int kvh, int d) {                         \
    rope_split<T>(qkv, pos, freqs, q, k, v, n, qh, kvh, d);                                   \
  }                                                                                           \
  extern "C" __global__ void swiglu_##S(const float* gu, T* out, int n, int ffn) {            \
    swiglu<T>(gu, out, n, ffn);                                                               \
  }                                                                                           \
  extern "C" __global__ void narrow_##S(const float* x, T* out, int len) {                    \
    narrow_all<T>(x, out, len);                                                               \
  }                                                                                           \
  extern "C" __global__ void fill_uniform_##S(T* out, unsigned long long len,                 \
                                              unsigned long long seed, float scale) {         \
    fill_uniform<T>(out, len, seed, scale);                                                   \
  }

INSTANTIATE(__half, f16)
INSTANTIATE(__nv_bfloat16, bf16)
