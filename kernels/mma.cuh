// The m16n8k16 tensor-core MMA with f32 accumulators for the two 16-bit types, shared by
// kernels/attn.cu and kernels/select.cu: the Rust side puts this file in front of each of them
// before NVRTC compiles it. Fragments are 32-bit words of two elements; `pack` rounds two f32
// into one word of the type.

#include <cuda_fp16.h>
#include <cuda_bf16.h>

template <typename T>
struct Mma;

// One specialization per type: its PTX type name, its pair type and the pair's rounding.
#define MMA_FOR(T, PTX, PAIR, TO_PAIR)                                                           \
    template <>                                                                                 \
    struct Mma<T> {                                                                             \
        static __device__ __forceinline__ void run(float (&c)[4], unsigned int a0,             \
                                                   unsigned int a1, unsigned int a2,           \
                                                   unsigned int a3, unsigned int b0,           \
                                                   unsigned int b1) {                          \
            asm("mma.sync.aligned.m16n8k16.row.col.f32." PTX "." PTX ".f32 {%0,%1,%2,%3}, "    \
                "{%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"                                      \
                : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])                               \
                : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));                       \
        }                                                                                       \
        static __device__ __forceinline__ unsigned int pack(float lo, float hi) {              \
            const PAIR v = TO_PAIR(lo, hi);                                                     \
            return *reinterpret_cast<const unsigned int*>(&v);                                  \
        }                                                                                       \
    };

MMA_FOR(__nv_bfloat16, "bf16", __nv_bfloat162, __floats2bfloat162_rn)
MMA_FOR(__half, "f16", __half2, __floats2half2_rn)

// The transpose of an 8x8 matrix of 16-bit elements held as a warp fragment (row lane / 4,
// columns 2 (lane % 4) and 2 (lane % 4) + 1).
__device__ __forceinline__ unsigned int transpose8x8(unsigned int x) {
    unsigned int y;
    asm("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;\n" : "=r"(y) : "r"(x));
    return y;
}

__device__ __forceinline__ unsigned int word(const uint4& v, int i) {
    return i == 0 ? v.x : i == 1 ? v.y : i == 2 ? v.z : v.w;
}
