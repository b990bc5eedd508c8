//! Keys read from the host pool, with the step's new tokens not yet backed up.

use attn_op::Element;
use kv_blocks::RequestId;
use offload::{HostPool, HostStore, SparseKvCacheManager};
use sparse_algo::KeySource;

use crate::CoordError;

/// One layer's keys of a batch of requests, read from the host pool by logical position; a
/// sequence's positions past what the host holds come from `pending` (the new tokens' keys of
/// the current forward, `[n, kv_heads, head_dim]`).
pub(crate) struct HostKeys<'a, T: Element> {
    pub(crate) host: &'a HostPool<T>,
    pub(crate) layer: usize,
    pub(crate) seqs: Vec<HostSeq<'a, T>>,
}

/// One sequence of [`HostKeys`].
pub(crate) struct HostSeq<'a, T> {
    /// Host pages in logical order.
    pub(crate) pages: &'a [u32],
    /// Tokens the host holds.
    pub(crate) on_host: usize,
    /// Keys of the tokens after them.
    pub(crate) pending: &'a [T],
}

/// The sequences of `reqs` (request, tokens on the host, pending keys) in `manager`.
pub(crate) fn host_seqs<'a, T: Element>(
    manager: &'a SparseKvCacheManager<T>,
    reqs: impl IntoIterator<Item = (RequestId, usize, &'a [T])>,
) -> Result<Vec<HostSeq<'a, T>>, CoordError> {
    reqs.into_iter()
        .map(|(id, on_host, pending)| {
            Ok(HostSeq {
                pages: manager.host_pages(id)?,
                on_host,
                pending,
            })
        })
        .collect()
}

impl<T: Element> KeySource for HostKeys<'_, T> {
    fn num_seqs(&self) -> usize {
        self.seqs.len()
    }

    fn kv_heads(&self) -> usize {
        self.host.shape().kv_heads
    }

    fn head_dim(&self) -> usize {
        self.host.shape().head_dim
    }

    fn seq_len(&self, seq: usize) -> usize {
        let s = &self.seqs[seq];
        s.on_host + s.pending.len() / (self.kv_heads() * self.head_dim())
    }

    fn read(&self, seq: usize, start: usize, dst: &mut [f32]) {
        let s = &self.seqs[seq];
        let ps = self.host.shape().page_size;
        let stride = self.kv_heads() * self.head_dim();
        let n = dst.len() / stride;
        let mut buf = vec![T::default(); ps * stride];
        let mut pos = start;
        while pos < start + n {
            let out = &mut dst[(pos - start) * stride..];
            if pos >= s.on_host {
                let from = (pos - s.on_host) * stride;
                let take = start + n - pos;
                T::slice_to_f32(
                    &s.pending[from..from + take * stride],
                    &mut out[..take * stride],
                );
                break;
            }
            let (page, off) = (pos / ps, pos % ps);
            let take = (ps - off).min(start + n - pos).min(s.on_host - pos);
            let b = &mut buf[..take * stride];
            self.host
                .read_keys(self.layer, s.pages[page] as usize, off, b);
            T::slice_to_f32(b, &mut out[..take * stride]);
            pos += take;
        }
    }
}
