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
// scoring launch before pick_rows advanced after its wait (the walk's CTAs wait instead for
// their ids' tags to hold that value: tagged rows, below). It still starts only after
// pick_rows has signalled, which pick_rows does after its own wait, so every kernel before
// pick_rows has finished. And the kernel after the attention waits for CTAs that each saw
// their row's flag, set last by pick_rows: the tensor-core kernel's own, or `walk_merge_pub`'s
// after the walk's. So no write of pick_rows is left in flight behind it.

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

// The acquire pattern split in two: a relaxed load of a flag, issued early, and where it saw
// the value, an acquire fence after (what follows it is ordered after the flag's store).
__device__ __forceinline__ unsigned int load_relaxed(const unsigned int* p) {
    unsigned int v;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 700
    asm volatile("ld.relaxed.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
#else
    v = *(volatile const unsigned int*)p;
#endif
    return v;
}

__device__ __forceinline__ void acquire_fence() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 700
    asm volatile("fence.acq_rel.gpu;" ::: "memory");
#else
    __threadfence();
#endif
}

// Tagged rows: a published selection row's place as one 64-bit word, the step's value (high
// half) beside the page id (low half), stored (relaxed, single-copy atomic) once the id is
// final. A reader polling a place sees this step's value only with this step's id, so the
// page walk reads its ids without waiting for the row's flag. Nothing else is published
// through a tag: whatever needs the rest of pick_rows' writes still waits for the flag.
__device__ __forceinline__ void store_tagged(unsigned long long* p, unsigned int step, int id) {
    const unsigned long long w = ((unsigned long long)step << 32) | (unsigned int)id;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 700
    asm volatile("st.relaxed.gpu.global.u64 [%0], %1;" ::"l"(p), "l"(w) : "memory");
#else
    *(volatile unsigned long long*)p = w;
#endif
}

__device__ __forceinline__ unsigned long long load_tagged(const unsigned long long* p) {
    unsigned long long w;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 700
    asm volatile("ld.relaxed.gpu.global.u64 %0, [%1];" : "=l"(w) : "l"(p) : "memory");
#else
    w = *(volatile const unsigned long long*)p;
#endif
    return w;
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
