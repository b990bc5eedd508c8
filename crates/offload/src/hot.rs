//! One (request, layer) hot buffer and the sparse diff.

/// The device-resident pages of one (request, layer): `hot` LRU slots plus one reserved slot
/// for the current (newest, possibly partial) page. Slots are indices `0..hot` into the
/// request's device blocks; the reserved slot is index `hot`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HotBuffer {
    /// LRU order of the slots, oldest first; always a permutation of `0..hot`.
    lru: Vec<u32>,
    /// Logical page held by each slot, -1 for none.
    slot_page: Vec<i32>,
    /// The page in the reserved slot, -1 for none, and how many of its tokens are valid.
    pub(crate) reserved_page: i32,
    pub(crate) reserved_tokens: usize,
}

/// What the diff decided for one step.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Diff {
    /// For each selected page, in selection order, the slot index that holds it.
    pub slots: Vec<u32>,
    /// Pages to load: (logical page, slot index), in selection order.
    pub misses: Vec<(u32, u32)>,
    /// Selected pages already resident (the current page's reserved slot included).
    pub hits: u32,
}

impl HotBuffer {
    /// An empty buffer of `hot` slots.
    pub fn new(hot: usize) -> Self {
        HotBuffer {
            lru: (0..hot as u32).collect(),
            slot_page: vec![-1; hot],
            reserved_page: -1,
            reserved_tokens: 0,
        }
    }

    /// The LRU order, oldest first.
    pub fn lru(&self) -> &[u32] {
        &self.lru
    }

    /// The logical page each slot holds (-1: none).
    pub fn slot_pages(&self) -> &[i32] {
        &self.slot_page
    }

    /// The page in the reserved slot (-1: none).
    pub fn reserved_page(&self) -> i32 {
        self.reserved_page
    }

    /// The HiSparse swap-in for a selection of ascending, unique logical pages. `current` is the
    /// page in the reserved slot, which is a hit without touching the LRU. Walks the LRU oldest
    /// first: a slot holding a selected page is a hit; the others are evictable, oldest first,
    /// and the m-th miss takes the m-th evictable. The new LRU order is the untouched evictables,
    /// then the slots just filled, then the hits (newest last).
    ///
    /// The selection, current page aside, must fit in the buffer (at most `hot` pages);
    /// [`SparseKvCacheManager::step`](crate::SparseKvCacheManager::step) checks that and
    /// everything else before calling this.
    pub fn diff(&mut self, pages: &[i32], current: i32) -> Diff {
        let hot = self.lru.len();
        let mut out = Diff {
            slots: vec![u32::MAX; pages.len()],
            misses: Vec::new(),
            hits: 0,
        };
        // Selection index of each page, found by binary search (the selection is sorted; this
        // stands in for the kernel's shared-memory hash).
        let mut hit_slots = Vec::with_capacity(pages.len());
        let mut evictable = Vec::with_capacity(hot);
        for &slot in &self.lru {
            let page = self.slot_page[slot as usize];
            match (page >= 0 && page != current)
                .then(|| pages.binary_search(&page).ok())
                .flatten()
            {
                Some(i) => {
                    out.slots[i] = slot;
                    out.hits += 1;
                    hit_slots.push(slot);
                }
                None => evictable.push(slot),
            }
        }
        assert!(
            pages.iter().filter(|&&p| p != current).count() <= hot,
            "the selection must fit in the hot buffer (the caller checks it)"
        );
        let mut next = 0;
        for (i, &page) in pages.iter().enumerate() {
            if page == current {
                out.slots[i] = hot as u32;
                out.hits += 1;
            } else if out.slots[i] == u32::MAX {
                let slot = evictable[next];
                next += 1;
                self.slot_page[slot as usize] = page;
                out.slots[i] = slot;
                out.misses.push((page as u32, slot));
            }
        }
        let mut lru = Vec::with_capacity(hot);
        lru.extend_from_slice(&evictable[next..]);
        lru.extend_from_slice(&evictable[..next]);
        lru.extend_from_slice(&hit_slots);
        self.lru = lru;
        out
    }
}
