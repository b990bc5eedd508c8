//! A toy engine around the coordinator: every request's full KV in memory (the engine's own
//! dense cache and the reference), deterministic q/k/v, and the hooks called as an engine does.

use attn_op::{
    AttnOut, AttnParams, BatchMeta, KvCache, KvLayout, PagedKv, paged_attention,
    sparse_page_attention, token_sparse_attention,
};
use coordinator::{Capacity, ModelShape, Route, SparseConfig, SparseCoordinator};
use kv_blocks::RequestId;
use offload::{HostAlloc, StepStats};
use rustc_hash::FxHashMap;
use sparse_algo::{Decode, PagedKeys, RepPool, TopK};

pub(crate) const MODEL: ModelShape = ModelShape {
    layers: 3,
    q_heads: 4,
    kv_heads: 2,
    head_dim: 16,
};
/// The longest sequence of the tests.
pub(crate) const MAX: usize = 160;
const QS: usize = 4 * 16;
const KVS: usize = 2 * 16;

/// A value in [-1, 1) for (kind, request, layer, position, element): never all zero.
fn val(kind: u64, req: u64, layer: usize, pos: usize, i: usize) -> f32 {
    let mut x = kind
        .wrapping_mul(0x9e37_79b9_7f4a_7c15)
        .wrapping_add(req << 40)
        .wrapping_add((layer as u64) << 32)
        .wrapping_add((pos as u64) << 12)
        .wrapping_add(i as u64);
    x ^= x >> 31;
    x = x.wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x ^= x >> 29;
    ((x >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
}

/// Rows `[n, width]` of `kind` for positions `start..start + n`.
pub(crate) fn rows(
    kind: u64,
    req: u64,
    layer: usize,
    start: usize,
    n: usize,
    width: usize,
) -> Vec<f32> {
    (start..start + n)
        .flat_map(|p| (0..width).map(move |i| val(kind, req, layer, p, i)))
        .collect()
}

/// The engine's own KV of one request, every layer (block `i` holds page `i`).
pub(crate) struct Own {
    pub(crate) kv: Vec<PagedKv<f32>>,
    pub(crate) len: usize,
}

/// The toy engine.
pub(crate) struct Engine {
    pub(crate) coord: SparseCoordinator<f32>,
    pub(crate) own: FxHashMap<RequestId, Own>,
    pub(crate) page: usize,
    /// Every step's stats, and how many sparse rows were checked.
    pub(crate) stats: StepStats,
    pub(crate) checked: usize,
    /// Also compare sparse rows with dense attention (a budget that covers the context).
    pub(crate) expect_dense: bool,
    /// Whose KV values a request's positions take (a request that reuses another's prefix
    /// shares its stream).
    pub(crate) stream: FxHashMap<RequestId, u64>,
    /// Before each layer's step, a prefetch with these queries (the layer's own, or others).
    pub(crate) prefetch: Option<Estimate>,
    /// What the prefetches loaded.
    pub(crate) prefetched: StepStats,
    /// The layers whose `attention_begin` and `attention_end` succeeded in the last forward.
    pub(crate) began: Vec<usize>,
    pub(crate) ended: Vec<usize>,
}

/// The queries a prefetch of the toy engine selects with.
#[derive(Clone, Copy)]
pub(crate) enum Estimate {
    /// The layer's own queries: the prefetch loads exactly what the step then selects.
    Exact,
    /// Other queries (another stream of values): the step's selection differs.
    Other,
}

impl Engine {
    pub(crate) fn new(config: &SparseConfig, host_alloc: HostAlloc, host_pages: usize) -> Self {
        let coord = SparseCoordinator::from_config(
            MODEL,
            config,
            Capacity {
                max_requests: 3,
                max_tokens: MAX,
                host_pages,
                host_alloc,
            },
        )
        .expect("a valid configuration");
        let page = coord.lowered().page_size;
        Engine {
            coord,
            own: FxHashMap::default(),
            page,
            stats: StepStats::default(),
            checked: 0,
            expect_dense: false,
            stream: FxHashMap::default(),
            prefetch: None,
            prefetched: StepStats::default(),
            began: Vec::new(),
            ended: Vec::new(),
        }
    }

    /// Registers a request's own KV.
    pub(crate) fn add(&mut self, id: RequestId) {
        let layout = KvLayout {
            num_blocks: MAX.div_ceil(self.page),
            block_size: self.page,
            kv_heads: MODEL.kv_heads,
            head_dim: MODEL.head_dim,
        };
        let kv = (0..MODEL.layers)
            .map(|_| PagedKv::new(layout).expect("valid layout"))
            .collect();
        self.own.insert(id, Own { kv, len: 0 });
    }

    fn stream(&self, id: RequestId) -> u64 {
        self.stream.get(&id).copied().unwrap_or(id.0)
    }

    /// Writes positions `0..n` of `id` into its own KV without a forward (a prefix reused from
    /// the host tier, which the engine did not recompute).
    pub(crate) fn fill_own(&mut self, id: RequestId, n: usize) {
        let stream = self.stream(id);
        let own = self.own.get_mut(&id).expect("added");
        for (layer, kv) in own.kv.iter_mut().enumerate() {
            let slots: Vec<i32> = (0..n as i32).collect();
            let (k, v) = (
                rows(1, stream, layer, 0, n, KVS),
                rows(2, stream, layer, 0, n, KVS),
            );
            kv.set_kv(&slots, &k, &v).expect("in range");
        }
        own.len = n;
    }

    /// One forward over `batch` (request, new tokens), checking every sparse row.
    pub(crate) fn forward(&mut self, batch: &[(RequestId, usize)]) {
        self.try_forward(batch, None).expect("a valid forward");
    }

    /// [`forward`](Self::forward), answering the first hook's error instead of panicking,
    /// and with `stop` at `Some(l)` leaving the forward in progress as an engine whose model
    /// failed in layer `l` would: the layers before it whole, and `l`'s `attention_begin`
    /// only. Lengths advance only when the forward ends.
    pub(crate) fn try_forward(
        &mut self,
        batch: &[(RequestId, usize)],
        stop: Option<usize>,
    ) -> Result<(), coordinator::CoordError> {
        self.began.clear();
        self.ended.clear();
        self.coord.forward_begin(batch)?;
        let params = AttnParams::new(MODEL.q_heads, MODEL.head_dim);
        for layer in 0..MODEL.layers {
            let (mut q, mut k, mut v) = (Vec::new(), Vec::new(), Vec::new());
            for &(id, n) in batch {
                let (start, s) = (self.own[&id].len, self.stream(id));
                q.extend(rows(0, s, layer, start, n, QS));
                k.extend(rows(1, s, layer, start, n, KVS));
                v.extend(rows(2, s, layer, start, n, KVS));
            }
            // The engine's own cache gets every token (it is also the reference).
            let mut off = 0;
            for &(id, n) in batch {
                let own = self.own.get_mut(&id).expect("added");
                let slots: Vec<i32> = (own.len..own.len + n).map(|p| p as i32).collect();
                own.kv[layer]
                    .set_kv(
                        &slots,
                        &k[off * KVS..(off + n) * KVS],
                        &v[off * KVS..(off + n) * KVS],
                    )
                    .expect("in range");
                off += n;
            }
            if let Some(estimate) = self.prefetch {
                let guess = match estimate {
                    Estimate::Exact => q.clone(),
                    Estimate::Other => batch
                        .iter()
                        .flat_map(|&(id, n)| {
                            let (start, s) = (self.own[&id].len, self.stream(id));
                            rows(7, s, layer, start, n, QS)
                        })
                        .collect(),
                };
                let loaded = self.coord.prefetch(layer, &guess)?;
                self.prefetched.add(&loaded);
            }
            let plan = self.coord.attention_begin(layer, &q, &k, &v)?;
            self.began.push(layer);
            self.stats.add(&plan.stats);
            let mut off = 0;
            for (i, &(id, n)) in batch.iter().enumerate() {
                if let Route::Sparse(row) = plan.routes[i] {
                    let meta = plan.meta.as_ref().expect("sparse rows have metadata");
                    let sel = plan.selection.as_ref().expect("and a selection");
                    let qrow = &q[off * QS..(off + 1) * QS];
                    self.check_row(id, layer, qrow, meta, sel, row, &params);
                }
                off += n;
            }
            if stop == Some(layer) {
                return Ok(());
            }
            self.coord.attention_end(layer, &k, &v)?;
            self.ended.push(layer);
        }
        self.coord.forward_end()?;
        for &(id, n) in batch {
            self.own.get_mut(&id).expect("added").len += n;
        }
        Ok(())
    }

    /// A sparse row: hierarchical attention over the device pool equals in-memory sparse
    /// attention over the request's full KV with the same selection, and the selection equals
    /// the algorithm's own over the full KV.
    #[allow(clippy::too_many_arguments, reason = "a test helper with one caller")]
    fn check_row(
        &mut self,
        id: RequestId,
        layer: usize,
        q: &[f32],
        meta: &coordinator::AttentionMeta,
        sel: &TopK,
        row: usize,
        params: &AttnParams,
    ) {
        let own = &self.own[&id];
        let len = own.len + 1;
        let heads = MODEL.kv_heads;
        let logical: Vec<Vec<i32>> = (0..heads).map(|h| sel.row(row, h).to_vec()).collect();
        let logical = TopK::from_rows(&logical, heads, sel.page_size);
        // The algorithm's own selection over the full KV.
        let params_l = self.coord.lowered().layers[layer]
            .as_ref()
            .expect("a sparse layer");
        let lens = [len as i32];
        let table: Vec<i32> = (0..MAX.div_ceil(self.page) as i32).collect();
        let keys = PagedKeys::new(&own.kv[layer], &lens, &table, table.len()).expect("valid");
        let mut pool =
            RepPool::new(params_l.algo.rep_shape(heads, MODEL.head_dim), 1, 1, MAX).expect("pool");
        params_l
            .algo
            .construct_representations(0, &keys, &[0], &mut pool)
            .expect("construct");
        let step = Decode {
            layer: 0,
            q,
            q_heads: MODEL.q_heads,
            kv_heads: heads,
            head_dim: MODEL.head_dim,
            seq_lens: &[len],
            slots: &[0],
            keys: Some(&keys),
        };
        let theirs = params_l.algo.retrieve_topk(&step, &pool).expect("select");
        assert_eq!(theirs, logical, "{id:?} layer {layer}: selections differ");
        // Hierarchical attention, this row alone.
        let device = self.coord.device(layer).expect("a sparse layer");
        let device = device.read();
        let w = meta.max_blocks;
        let one_table = &meta.block_table[row * w..(row + 1) * w];
        let one_len = [meta.seq_lens_kv[row]];
        let ids: Vec<Vec<i32>> = (0..heads).map(|h| meta.ids.row(row, h).to_vec()).collect();
        let one = coordinator::AttentionMeta {
            kind: meta.kind,
            cu_seqlens_q: vec![0, 1],
            seq_lens_kv: one_len.to_vec(),
            block_table: one_table.to_vec(),
            max_blocks: w,
            ids: TopK::from_rows(&ids, heads, meta.ids.page_size),
        };
        let mut ours = vec![0.0f32; QS];
        let mut ours_lse = vec![0.0f32; MODEL.q_heads];
        one.attend(
            q,
            &device,
            params,
            AttnOut {
                out: &mut ours,
                lse: Some(&mut ours_lse),
            },
        )
        .expect("valid metadata");
        // In memory, over the full KV.
        let full = BatchMeta {
            cu_seqlens_q: &[0, 1],
            seq_lens_kv: &lens,
            block_table: &table,
            max_blocks: table.len(),
        };
        let mut want = vec![0.0f32; QS];
        let mut want_lse = vec![0.0f32; MODEL.q_heads];
        let out = AttnOut {
            out: &mut want,
            lse: Some(&mut want_lse),
        };
        let s = logical.as_selection();
        if logical.page_size == 1 {
            token_sparse_attention(q, &own.kv[layer], &full, &s, params, out).expect("valid");
        } else {
            sparse_page_attention(q, &own.kv[layer], &full, &s, params, out).expect("valid");
        }
        assert_eq!(
            ours, want,
            "{id:?} layer {layer} at {len}: hierarchical differs"
        );
        assert_eq!(ours_lse, want_lse);
        if self.expect_dense {
            let mut dense = vec![0.0f32; QS];
            paged_attention(
                q,
                &own.kv[layer],
                &full,
                params,
                AttnOut {
                    out: &mut dense,
                    lse: None,
                },
            )
            .expect("valid");
            assert_eq!(
                ours, dense,
                "{id:?} layer {layer}: a full budget differs from dense"
            );
        }
        self.checked += 1;
    }
}
