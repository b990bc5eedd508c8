// Programmatic dependent launch (sm_90 and later), put in front of attn.cu and select.cu by the
// Rust side. A kernel launched with the programmatic-serialization attribute
// (attn_op::cuda::Launch::dependent) may start while the kernel before it on the stream is
// still running; it must call pdl_wait() before it touches memory that kernel writes or
// reads, and pdl_wait() returns only once that kernel has finished and its writes are visible.
// Calling pdl_launch_dependents() right after lets the next such kernel start early in its
// turn. Since every kernel here signals only after its own wait, a kernel that starts early
// overlaps only the one kernel before it: every earlier one has finished. So it may read,
// before waiting, what that kernel never writes (pick_rows reads the batch's lengths this
// way). Both are no-ops in a kernel launched the ordinary way and on older architectures.

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
