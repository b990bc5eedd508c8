//! The host KV pool: every token of every request, per layer, in one of three layouts.

use attn_op::Element;
use serde::{Deserialize, Serialize};

/// Where a (layer, page, token, head) vector lives in host memory. Shapes follow SGLang's
/// HiCache host pools (per K and per V; `L` layers, `P` pages of `ps` tokens, `H` heads, `D`):
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum HostLayout {
    /// `[L, P, ps, H, D]`: one layer's pages together, the device pool's own order.
    #[default]
    LayerFirst,
    /// `[P, L, ps, H, D]`: one page's layers together (one contiguous write per page backup).
    PageFirst,
    /// `[P, H, ps, L, D]`: one page's heads outermost, layers innermost (for head-sharded loads).
    PageHead,
}

/// The shape of a host pool.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HostShape {
    /// Layers.
    pub layers: usize,
    /// Pages.
    pub pages: usize,
    /// Tokens per page.
    pub page_size: usize,
    /// KV heads.
    pub kv_heads: usize,
    /// Elements per head.
    pub head_dim: usize,
}

/// Host KV storage behind one interface, whatever its layout or memory (pageable now, pinned
/// for the CUDA zero-copy kernel later). Reads and writes move one token's every head at a time
/// (`[kv_heads, head_dim]`), or a page's tokens, always in the device's `[tokens, heads, dim]`
/// order.
pub trait HostStore<T: Element>: Send + Sync {
    /// The pool's shape.
    fn shape(&self) -> HostShape;
    /// Writes token `offset` of `page` in `layer` (`k` and `v` are `[kv_heads, head_dim]`).
    fn write_token(&mut self, layer: usize, page: usize, offset: usize, k: &[T], v: &[T]);
    /// Reads tokens `0..n` of `page` in `layer` into `k` and `v` (`[n, kv_heads, head_dim]`).
    fn read_page(&self, layer: usize, page: usize, k: &mut [T], v: &mut [T]);
    /// Reads the keys of tokens `first..first + n` of `page` in `layer` into `k`
    /// (`[n, kv_heads, head_dim]`): what algorithms build representations from.
    fn read_keys(&self, layer: usize, page: usize, first: usize, k: &mut [T]);
}

/// A host pool in plain memory with a chosen [`HostLayout`].
#[derive(Clone, Debug)]
pub struct HostPool<T: Element> {
    shape: HostShape,
    layout: HostLayout,
    k: Vec<T>,
    v: Vec<T>,
}

impl<T: Element> HostPool<T> {
    /// A zeroed pool; `None` if its size overflows or the allocator cannot give it.
    pub fn new(shape: HostShape, layout: HostLayout) -> Option<Self> {
        let len = [
            shape.layers,
            shape.pages,
            shape.page_size,
            shape.kv_heads,
            shape.head_dim,
        ]
        .into_iter()
        .try_fold(1usize, usize::checked_mul)?;
        Some(HostPool {
            shape,
            layout,
            k: T::zeros(len)?,
            v: T::zeros(len)?,
        })
    }

    /// The layout.
    pub fn layout(&self) -> HostLayout {
        self.layout
    }

    /// K and V as stored, in the pool's layout (for copies into other memory, such as a pinned
    /// pool).
    pub fn tensors(&self) -> (&[T], &[T]) {
        (&self.k, &self.v)
    }

    /// Bytes held (K and V).
    pub fn bytes(&self) -> usize {
        2 * self.k.len() * size_of::<T>()
    }

    /// Offset of the head vector (layer, page, token, head).
    fn offset(&self, l: usize, p: usize, t: usize, h: usize) -> usize {
        let HostShape {
            layers,
            page_size: ps,
            kv_heads,
            head_dim: d,
            ..
        } = self.shape;
        let pages = self.shape.pages;
        match self.layout {
            HostLayout::LayerFirst => (((l * pages + p) * ps + t) * kv_heads + h) * d,
            HostLayout::PageFirst => (((p * layers + l) * ps + t) * kv_heads + h) * d,
            HostLayout::PageHead => (((p * kv_heads + h) * ps + t) * layers + l) * d,
        }
    }
}

impl<T: Element> HostStore<T> for HostPool<T> {
    fn shape(&self) -> HostShape {
        self.shape
    }

    fn write_token(&mut self, layer: usize, page: usize, offset: usize, k: &[T], v: &[T]) {
        let d = self.shape.head_dim;
        for h in 0..self.shape.kv_heads {
            let o = self.offset(layer, page, offset, h);
            self.k[o..o + d].copy_from_slice(&k[h * d..(h + 1) * d]);
            self.v[o..o + d].copy_from_slice(&v[h * d..(h + 1) * d]);
        }
    }

    fn read_keys(&self, layer: usize, page: usize, first: usize, k: &mut [T]) {
        let (hh, d) = (self.shape.kv_heads, self.shape.head_dim);
        for (t, dst) in k.chunks_exact_mut(hh * d).enumerate() {
            for (h, dst) in dst.chunks_exact_mut(d).enumerate() {
                let o = self.offset(layer, page, first + t, h);
                dst.copy_from_slice(&self.k[o..o + d]);
            }
        }
    }

    fn read_page(&self, layer: usize, page: usize, k: &mut [T], v: &mut [T]) {
        let (hh, d) = (self.shape.kv_heads, self.shape.head_dim);
        if self.layout != HostLayout::PageHead {
            // Tokens and heads are contiguous: one copy per page.
            let o = self.offset(layer, page, 0, 0);
            k.copy_from_slice(&self.k[o..o + k.len()]);
            v.copy_from_slice(&self.v[o..o + v.len()]);
            return;
        }
        for t in 0..k.len() / (hh * d) {
            for h in 0..hh {
                let o = self.offset(layer, page, t, h);
                let dst = (t * hh + h) * d;
                k[dst..dst + d].copy_from_slice(&self.k[o..o + d]);
                v[dst..dst + d].copy_from_slice(&self.v[o..o + d]);
            }
        }
    }
}
