//! Shared helpers: a small manager configuration and the expected value of every token.

use offload::{HostAlloc, HostLayout, OffloadConfig};

/// A small configuration: pages of 4, 2 layers, 2 KV heads of 4.
pub(crate) fn config(hot_pages: usize, host_pages: usize, layout: HostLayout) -> OffloadConfig {
    OffloadConfig {
        page_size: 4,
        hot_pages,
        layers: 2,
        kv_heads: 2,
        head_dim: 4,
        host_pages,
        max_requests: 3,
        layout,
        host_alloc: HostAlloc::Own,
    }
}

/// The K (`which` 0) or V (1) of token `pos` of `layer` of request `req`, `[heads, dim]`:
/// distinct for every coordinate, never zero, exact in f32.
pub(crate) fn token(req: u64, layer: usize, pos: usize, which: usize, stride: usize) -> Vec<f32> {
    (0..stride)
        .map(|i| {
            1.0 + (req as usize * 1_000_003 + layer * 10_007 + pos * 101 + which * 53 + i) as f32
                % 8191.0
        })
        .collect()
}

/// Tokens `start..start + n` as one `[n, heads, dim]` slice.
pub(crate) fn tokens(
    req: u64,
    layer: usize,
    start: usize,
    n: usize,
    which: usize,
    stride: usize,
) -> Vec<f32> {
    (start..start + n)
        .flat_map(|p| token(req, layer, p, which, stride))
        .collect()
}
