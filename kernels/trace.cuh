// Per-CTA timestamps of an instrumented launch, for the benches' traces (the kernels built
// with tracing on are attn.cu's `*_tct` and select.cu's `*_traced`; every other kernel compiles
// the marks away). Each module that includes this file has its own attn_trace. Thread 0 of each
// CTA writes one record of TRACE_WORDS words into attn_trace, at record `first` + its CTA:
//   words 0 .. TRACE_MARKS: %globaltimer (ns) at each mark, 0 where a mark was not reached;
//   word TRACE_MARKS: the SM id | whether this CTA merged its unit << 16 | rounds walked << 20;
//   word TRACE_MARKS + 1: %clock64 from the first mark to the last (cycles of the SM).
// A mark takes a value the thread has just loaded or computed and stores it to shared memory
// before it reads the timer, so the time is taken only once that value has arrived.

#define TRACE_MARKS 10
#define TRACE_WORDS (TRACE_MARKS + 2)
#define TRACE_CTAS 4096

__device__ unsigned long long attn_trace[TRACE_CTAS * TRACE_WORDS];

template <bool ON>
struct Trace {
    __device__ __forceinline__ explicit Trace(unsigned = 0) {}
    __device__ __forceinline__ void mark(int, unsigned) {}
    __device__ __forceinline__ void finish(int, unsigned) {}
};

template <>
struct Trace<true> {
    unsigned long long* rec;
    unsigned long long c0;

    __device__ __forceinline__ explicit Trace(unsigned first = 0) : rec(nullptr), c0(0) {
        const unsigned cta =
            first + blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z);
        if (threadIdx.x == 0 && cta < TRACE_CTAS) {
            rec = attn_trace + (size_t)cta * TRACE_WORDS;
            for (int i = 0; i < TRACE_WORDS; i++) rec[i] = 0ull;
            asm volatile("mov.u64 %0, %%clock64;" : "=l"(c0));
        }
    }

    // Mark `i` once `dep` is available.
    __device__ __forceinline__ void mark(int i, unsigned dep) {
        __shared__ volatile unsigned sink;
        if (rec == nullptr) return;
        sink = dep;
        unsigned long long t;
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t)::"memory");
        rec[i] = t;
    }

    // The last mark, with the record's SM, merge flag and round count.
    __device__ __forceinline__ void finish(int merged, unsigned rounds) {
        if (rec == nullptr) return;
        mark(TRACE_MARKS - 1, rounds);
        unsigned smid, c1;
        asm volatile("mov.u32 %0, %%smid;" : "=r"(smid));
        unsigned long long c;
        asm volatile("mov.u64 %0, %%clock64;" : "=l"(c));
        c1 = (unsigned)(c - c0);
        rec[TRACE_MARKS] = smid | ((unsigned long long)merged << 16) |
                           ((unsigned long long)rounds << 20);
        rec[TRACE_MARKS + 1] = c1;
    }
};
