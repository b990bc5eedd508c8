// Programmatic dependent launch (sm_90 and later), put in front of attn.cu and select.cu by the
// Rust side. A kernel launched with the programmatic-serialization attribute
// (attn_op::cuda::Launch::dependent) may start while the kernel before it on the stream is
// still running; it must call pdl_wait() before it touches memory that kernel writes or
// reads, and pdl_wait() returns only once that kernel has finished and its writes are visible.
// Calling pdl_launch_dependents() right after lets the next such kernel start early in its
// turn. Since every kernel here signals only after its own wait, a kernel that starts early
// overlaps only the one kernel before it: every earlier one has finished. So it may read,
// before waiting, what that kernel never writes (pick_rows reads the batch's lengths this
// way), and write what that kernel neither reads nor writes (pick_rows, after its scoring
// launch, writes its rows' plan this way). pdl_wait() and pdl_launch_dependents() are no-ops in
// a kernel launched the ordinary way and on older architectures.
//
// One exception: the attention over a published selection (the tensor-core `attn_*_tc_pub`
// and the page walk's `walk_pages_pub_*`, after a pick_rows that publishes its rows). It
// signals first and never waits for pick_rows; each CTA waits instead for a flag that
// pick_rows sets once the CTA's row is written (below), to the step's value, a counter the
// scoring launch before pick_rows advanced after its wait. It still starts only after
// pick_rows has signalled, which pick_rows does after its own wait, so every kernel before
// pick_rows has finished. And the kernel after the attention (the walk's merge, or the next
// layer's) waits for the attention, whose CTAs each waited on their row's flag, set last by
// pick_rows: so no write of pick_rows is left in flight behind it.

__device__ __forceinline__ void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

__device__ __forceinline__ void pdl_launch_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// Both, at the top of a kernel: nothing before it reads or writes memory.
__device__ __forceinline__ void pdl_enter() {
    pdl_wait();
    pdl_launch_dependents();
}

// Flags between two launches that overlap on purpose (a published selection): the producer
// fences its writes of a row, then stores the row's flag (release); the consumer, started
// early, polls the flag (acquire) before it reads the row, and reads the row past L1
// (ld.global.cg), where other rows' reads may have left stale lines of it.
__device__ __forceinline__ unsigned int load_acquire(const unsigned int* p) {
    unsigned int v;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 700
    asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
#else
    v = *(volatile const unsigned int*)p;
    __threadfence();
#endif
    return v;
}

__device__ __forceinline__ void store_release(unsigned int* p, unsigned int v) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 700
    asm volatile("st.release.gpu.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
#else
    __threadfence();
    *(volatile unsigned int*)p = v;
#endif
}

// The calling thread waits until *flag holds `want` (acquire): it may then read what the
// flag published, and so may the threads that meet it at a barrier after.
__device__ __forceinline__ void poll_flag(const unsigned int* flag, unsigned int want) {
    while (load_acquire(flag) != want) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 700
        __nanosleep(128);
#endif
    }
}

// Thread 0 waits until *flag holds `want`, then the CTA meets: every thread may read what
// the flag published.
__device__ __forceinline__ void wait_flag(const unsigned int* flag, unsigned int want) {
    if (threadIdx.x == 0) poll_flag(flag, want);
    __syncthreads();
}
