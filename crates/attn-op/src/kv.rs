//! Paged KV storage in the shared block-tensor layout.

use crate::aligned::Aligned;
use crate::error::check_len;
use crate::{AttnError, Element};

/// The shape of one layer's K (or V) block tensor: `[num_blocks, block_size, kv_heads, head_dim]`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KvLayout {
    /// Blocks in the pool.
    pub num_blocks: usize,
    /// Tokens per block.
    pub block_size: usize,
    /// KV heads.
    pub kv_heads: usize,
    /// Elements per head.
    pub head_dim: usize,
}

impl KvLayout {
    /// Elements of one block tensor; `usize::MAX` for a layout too large to address, which no
    /// cache accepts.
    pub fn len(&self) -> usize {
        self.checked_len().unwrap_or(usize::MAX)
    }

    /// Elements of one block tensor, or `None` where the count overflows `usize`.
    fn checked_len(&self) -> Option<usize> {
        [self.block_size, self.kv_heads, self.head_dim]
            .into_iter()
            .try_fold(self.num_blocks, usize::checked_mul)
    }

    /// Whether the tensor has no elements.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Slots in the flat view (`num_blocks * block_size`; saturating, as [`KvLayout::len`]).
    pub fn num_slots(&self) -> usize {
        self.num_blocks.saturating_mul(self.block_size)
    }

    /// Elements per token (all heads; saturating, as [`KvLayout::len`]).
    pub fn token_stride(&self) -> usize {
        self.kv_heads.saturating_mul(self.head_dim)
    }

    /// Offset of (slot, head) in the flat view.
    pub(crate) fn offset(&self, slot: usize, head: usize) -> usize {
        (slot * self.kv_heads + head) * self.head_dim
    }

    /// Checks that every extent but the block count is above 0 and that a tensor of elements
    /// of `elem` bytes fits the address space; returns its element count.
    pub(crate) fn validate(&self, elem: usize) -> Result<usize, AttnError> {
        if self.block_size == 0 || self.kv_heads == 0 || self.head_dim == 0 {
            return Err(AttnError::Invalid(format!(
                "a KV layout needs block_size, kv_heads and head_dim above 0, got {self:?}"
            )));
        }
        self.checked_len()
            .filter(|n| {
                n.checked_mul(elem)
                    .is_some_and(|b| b <= isize::MAX as usize)
            })
            .ok_or_else(|| {
                AttnError::Invalid(format!("a KV layout too large to address: {self:?}"))
            })
    }
}

/// Where a KV cache's memory lives, as types: the slices and index arrays its operations take.
/// [`Host`] is CPU memory; a CUDA backend names device buffers here.
pub trait Memory {
    /// A contiguous run of elements in this memory.
    type Slice<T: Element>: ?Sized;
    /// An `i32` index array in this memory.
    type Indices: ?Sized;
}

/// CPU memory: plain slices.
#[derive(Clone, Copy, Debug)]
pub struct Host;

impl Memory for Host {
    type Slice<T: Element> = [T];
    type Indices = [i32];
}

/// One layer's paged K and V, wherever they live.
pub trait KvCache<M: Memory> {
    /// The element type stored.
    type Elem: Element;

    /// The block-tensor shape of K (and of V).
    fn layout(&self) -> KvLayout;

    /// Writes tokens through the flat slot view: token `i` of `k` and `v` (each
    /// `[slot_mapping.len(), kv_heads, head_dim]`) goes to slot `slot_mapping[i]`, which is
    /// `block * block_size + offset`. A slot of -1 skips its token (padding).
    fn set_kv(
        &mut self,
        slot_mapping: &M::Indices,
        k: &M::Slice<Self::Elem>,
        v: &M::Slice<Self::Elem>,
    ) -> Result<(), AttnError>;
}

/// K and V block tensors of one layer in host memory. Each tensor starts on a 64-byte
/// boundary, so that the kernels' 64-byte loads of a row never span two cache lines.
#[derive(Clone, Debug, PartialEq)]
pub struct PagedKv<T: Element> {
    layout: KvLayout,
    k: Aligned<T>,
    v: Aligned<T>,
}

impl<T: Element> PagedKv<T> {
    /// A zero-filled cache of the given shape. Its memory becomes resident as it is written; on
    /// Linux, in 2 MiB huge pages where the kernel allows them (fewer TLB misses for the
    /// scattered rows attention reads).
    /// A cache the allocator cannot give is [`AttnError::OutOfMemory`].
    pub fn new(layout: KvLayout) -> Result<Self, AttnError> {
        let len = layout.validate(size_of::<T>())?;
        let tensor = || {
            Aligned::try_with(len, T::zeros).ok_or(AttnError::OutOfMemory {
                bytes: len.saturating_mul(size_of::<T>()),
            })
        };
        Ok(PagedKv {
            layout,
            k: tensor()?,
            v: tensor()?,
        })
    }

    /// A cache over existing tensors, each `[num_blocks, block_size, kv_heads, head_dim]`. A
    /// tensor that does not start on a 64-byte boundary is moved up to one within its own
    /// allocation (grown by 64 bytes), so it is copied once but never held twice.
    pub fn from_tensors(layout: KvLayout, k: Vec<T>, v: Vec<T>) -> Result<Self, AttnError> {
        let len = layout.validate(size_of::<T>())?;
        check_len("k", k.len(), &[len])?;
        check_len("v", v.len(), &[len])?;
        Ok(PagedKv {
            layout,
            k: Aligned::from_vec(k),
            v: Aligned::from_vec(v),
        })
    }

    /// The K tensor.
    pub fn k(&self) -> &[T] {
        &self.k
    }

    /// The V tensor.
    pub fn v(&self) -> &[T] {
        &self.v
    }

    /// Both tensors, mutably (for moving tokens around, as compaction does).
    pub fn tensors_mut(&mut self) -> (&mut [T], &mut [T]) {
        (&mut self.k, &mut self.v)
    }

    /// The layout, without going through the trait.
    pub(crate) fn layout_ref(&self) -> &KvLayout {
        &self.layout
    }

    /// K and V of `len` consecutive slots from `slot`, all heads (`[len, kv_heads, head_dim]`).
    pub(crate) fn run_all_heads(&self, slot: usize, len: usize) -> (&[T], &[T]) {
        let stride = self.layout.token_stride();
        let r = slot * stride..(slot + len) * stride;
        (&self.k[r.clone()], &self.v[r])
    }

    /// The head vector of K at (slot, head).
    pub(crate) fn k_at(&self, slot: usize, head: usize) -> &[T] {
        let o = self.layout.offset(slot, head);
        &self.k[o..o + self.layout.head_dim]
    }

    /// The head vector of V at (slot, head).
    pub(crate) fn v_at(&self, slot: usize, head: usize) -> &[T] {
        let o = self.layout.offset(slot, head);
        &self.v[o..o + self.layout.head_dim]
    }
}

impl<T: Element> KvCache<Host> for PagedKv<T> {
    type Elem = T;

    fn layout(&self) -> KvLayout {
        self.layout
    }

    fn set_kv(&mut self, slot_mapping: &[i32], k: &[T], v: &[T]) -> Result<(), AttnError> {
        let stride = self.layout.token_stride();
        check_len("k", k.len(), &[slot_mapping.len(), stride])?;
        check_len("v", v.len(), &[slot_mapping.len(), stride])?;
        let slots = self.layout.num_slots();
        for &s in slot_mapping {
            if s < -1 || (s >= 0 && s as usize >= slots) {
                return Err(AttnError::IndexOutOfRange {
                    what: "slot",
                    index: i64::from(s),
                    limit: slots as i64,
                });
            }
        }
        for (i, &s) in slot_mapping.iter().enumerate() {
            if s < 0 {
                continue;
            }
            let dst = s as usize * stride;
            let src = i * stride;
            self.k[dst..dst + stride].copy_from_slice(&k[src..src + stride]);
            self.v[dst..dst + stride].copy_from_slice(&v[src..src + stride]);
        }
        Ok(())
    }
}
