//! `gpu_select check`'s StreamingLLM and DSA indexer cases: the device rows against the CPU's.

use std::sync::Arc;

use attn_op::cuda::{CudaElement, DeviceBatch, Gpu};
use attn_op::{AttnError, KvLayout};
use sparse_algo::cuda::{DeviceRepPool, DeviceTopK, SelectKernels};
use sparse_algo::{
    AlgoError, AlwaysInclude, Decode, Dsa, DsaConfig, Indexer, KeySource, RepPool, SparseAlgorithm,
    StreamingConfig, StreamingLlm,
};

use crate::check::{LAYERS, compare_rows, keys, meta_for, poison};
use crate::rng::Rng;

/// One checked StreamingLLM configuration.
pub(crate) struct StreamingCase {
    pub(crate) name: &'static str,
    kv_heads: usize,
    lens: &'static [usize],
    sink: u32,
    window: u32,
    page_size: usize,
    per_sequence: bool,
}

pub(crate) const STREAMING: &[StreamingCase] = &[
    StreamingCase {
        name: "StreamingLLM 4 + 2044 tokens, kvh 8",
        kv_heads: 8,
        lens: &[5000, 1000, 2049, 1, 2048],
        sink: 4,
        window: 2044,
        page_size: 1,
        per_sequence: false,
    },
    StreamingCase {
        name: "StreamingLLM pages of 16, per sequence",
        kv_heads: 2,
        lens: &[40_000, 777, 16, 17],
        sink: 64,
        window: 1000,
        page_size: 16,
        per_sequence: true,
    },
    StreamingCase {
        name: "StreamingLLM no sinks, window 1, MQA",
        kv_heads: 1,
        lens: &[33, 16, 3],
        sink: 0,
        window: 1,
        page_size: 16,
        per_sequence: false,
    },
];

/// A batch's metadata over an identity block table of blocks of 16 (for the selections that
/// read no KV).
fn plain_meta(gpu: &Gpu, kv_heads: usize, lens: &[usize]) -> Result<DeviceBatch, AlgoError> {
    let max_blocks = lens.iter().copied().max().unwrap_or(0).div_ceil(16).max(1);
    let layout = KvLayout {
        num_blocks: lens.len() * max_blocks,
        block_size: 16,
        kv_heads,
        head_dim: 16,
    };
    let table: Vec<i32> = (0..(lens.len() * max_blocks) as i32).collect();
    meta_for(gpu, &layout, lens, &vec![1; lens.len()], &table, max_blocks)
}

/// A decode step's inputs for the selections that read neither queries nor keys.
fn plain_decode<'a>(
    kv_heads: usize,
    lens: &'a [usize],
    slots: &'a [usize],
    q: &'a [f32],
) -> Decode<'a> {
    Decode {
        layer: 1,
        q,
        q_heads: kv_heads,
        kv_heads,
        head_dim: 16,
        seq_lens: lens,
        slots,
        keys: None,
    }
}

pub(crate) fn check_streaming(
    gpu: &Gpu,
    sk: &SelectKernels,
    c: &StreamingCase,
    seed: u64,
) -> Result<Vec<(String, bool)>, AlgoError> {
    let mut rng = Rng::new(seed);
    let n = c.lens.len();
    let algo = StreamingLlm::new(StreamingConfig {
        sink_tokens: c.sink,
        window_tokens: c.window,
        page_size: c.page_size,
    })?;
    let max_len = c.lens.iter().copied().max().unwrap_or(1);
    let pool = RepPool::new(algo.rep_shape(c.kv_heads, 16), LAYERS, n, max_len)?;
    let slots: Vec<usize> = (0..n).collect();
    let q: Vec<f32> = (0..n * c.kv_heads * 16).map(|_| rng.unit()).collect();
    let want = algo.retrieve_topk(&plain_decode(c.kv_heads, c.lens, &slots, &q), &pool)?;
    let meta = plain_meta(gpu, c.kv_heads, c.lens)?;
    let mut out = DeviceTopK::streaming(gpu, &algo, n, c.kv_heads, c.per_sequence)?;
    poison(gpu, &mut out)?;
    sk.streaming_topk(&algo, &meta, &mut out)?;
    compare_rows(gpu, &want, &out, c.lens, None)
}

/// One checked DSA configuration (a trained indexer; the selection is per sequence).
pub(crate) struct DsaCase {
    pub(crate) name: &'static str,
    heads: usize,
    dim: usize,
    kv_heads: usize,
    lens: &'static [usize],
    topk: usize,
    sink: u32,
    recent: u32,
    /// Keys drawn from this many levels (tied scores), or uniform.
    levels: Option<usize>,
    /// Only this many distinct keys, repeated along each sequence (scores tied exactly).
    distinct: Option<usize>,
    per_sequence: bool,
}

pub(crate) const DSA_CASES: &[DsaCase] = &[
    DsaCase {
        name: "DSA 4 heads of 64, top-256, kvh 2",
        heads: 4,
        dim: 64,
        kv_heads: 2,
        lens: &[3000, 700, 100, 257],
        topk: 256,
        sink: 0,
        recent: 1,
        levels: None,
        distinct: None,
        per_sequence: false,
    },
    DsaCase {
        name: "DSA 16 heads of 128, top-2048, sinks + recent",
        heads: 16,
        dim: 128,
        kv_heads: 1,
        lens: &[40_000, 5000],
        topk: 2048,
        sink: 4,
        recent: 64,
        levels: None,
        distinct: None,
        per_sequence: true,
    },
    DsaCase {
        name: "DSA 8 heads of 32, tied scores (3 levels)",
        heads: 8,
        dim: 32,
        kv_heads: 4,
        lens: &[1500, 2500],
        topk: 100,
        sink: 0,
        recent: 1,
        levels: Some(3),
        distinct: None,
        per_sequence: true,
    },
    DsaCase {
        // 1500 keys tie at the top: more candidates than the selecting CTA keeps.
        name: "DSA 4 heads of 32, 4 distinct keys, 6000 tokens",
        heads: 4,
        dim: 32,
        kv_heads: 2,
        lens: &[6000, 4000],
        topk: 300,
        sink: 0,
        recent: 1,
        levels: None,
        distinct: Some(4),
        per_sequence: false,
    },
    DsaCase {
        // 750 keys tie at the top: all of them candidates.
        name: "DSA 4 heads of 32, 8 distinct keys, 6000 tokens",
        heads: 4,
        dim: 32,
        kv_heads: 1,
        lens: &[6000],
        topk: 300,
        sink: 16,
        recent: 1,
        levels: None,
        distinct: Some(8),
        per_sequence: true,
    },
    DsaCase {
        // Every score, the pick-th largest too, shared by 28 to 38 tokens: ties at the threshold.
        name: "DSA 4 heads of 32, 160 distinct keys, 6000 tokens",
        heads: 4,
        dim: 32,
        kv_heads: 2,
        lens: &[6000, 4500],
        topk: 300,
        sink: 0,
        recent: 1,
        levels: None,
        distinct: Some(160),
        per_sequence: false,
    },
    DsaCase {
        // The same, by 8 to 32 tokens, with sink pages.
        name: "DSA 4 heads of 32, 256 distinct keys, 8000 tokens",
        heads: 4,
        dim: 32,
        kv_heads: 1,
        lens: &[8000, 2100],
        topk: 200,
        sink: 16,
        recent: 1,
        levels: None,
        distinct: Some(256),
        per_sequence: true,
    },
    DsaCase {
        name: "DSA 2 heads of 16, 70K tokens (keys past smem)",
        heads: 2,
        dim: 16,
        kv_heads: 1,
        lens: &[70_000],
        topk: 512,
        sink: 16,
        recent: 1,
        levels: None,
        distinct: None,
        per_sequence: false,
    },
];

/// A trained indexer held in tables: keys `[len, dim]` per sequence, one query `[heads, dim]`
/// and weights `[heads]` per sequence (every layer the same).
pub(crate) struct TableIndexer {
    pub(crate) heads: usize,
    pub(crate) dim: usize,
    pub(crate) keys: Vec<Vec<f32>>,
    pub(crate) q: Vec<f32>,
    pub(crate) w: Vec<f32>,
}

impl Indexer for TableIndexer {
    fn heads(&self) -> usize {
        self.heads
    }
    fn dim(&self) -> usize {
        self.dim
    }
    fn keys(&self, _layer: usize, seq: usize, start: usize, dst: &mut [f32]) {
        dst.copy_from_slice(&self.keys[seq][start * self.dim..start * self.dim + dst.len()]);
    }
    fn queries(&self, _layer: usize, seq: usize, q: &mut [f32], weights: &mut [f32]) {
        let hd = self.heads * self.dim;
        q.copy_from_slice(&self.q[seq * hd..(seq + 1) * hd]);
        weights.copy_from_slice(&self.w[seq * self.heads..(seq + 1) * self.heads]);
    }
}

/// Sequence lengths only: what a trained indexer's representation update asks of the keys.
struct Lengths<'a>(&'a [usize]);

impl KeySource for Lengths<'_> {
    fn num_seqs(&self) -> usize {
        self.0.len()
    }
    fn kv_heads(&self) -> usize {
        1
    }
    fn head_dim(&self) -> usize {
        16
    }
    fn seq_len(&self, seq: usize) -> usize {
        self.0[seq]
    }
    fn read(&self, _seq: usize, _start: usize, dst: &mut [f32]) {
        // A trained indexer builds its representations from its own keys, never these.
        dst.fill(f32::NAN);
    }
}

pub(crate) fn check_dsa<T: CudaElement>(
    gpu: &Gpu,
    sk: &SelectKernels,
    c: &DsaCase,
    seed: u64,
) -> Result<Vec<(String, bool)>, AlgoError> {
    let mut rng = Rng::new(seed);
    let n = c.lens.len();
    // Keys the element type holds exactly, so the CPU's f32 pool and the device's agree.
    let keys_of = |rng: &mut Rng, len: usize| -> Vec<f32> {
        let rows = c.distinct.map_or(len, |d| d.min(len));
        let k: Vec<f32> = keys::<T>(rng, rows * c.dim, c.levels)
            .iter()
            .map(|x| x.to_f32())
            .collect();
        (0..len)
            .flat_map(|t| &k[(t % rows) * c.dim..][..c.dim])
            .copied()
            .collect()
    };
    let ix = TableIndexer {
        heads: c.heads,
        dim: c.dim,
        keys: c.lens.iter().map(|&l| keys_of(&mut rng, l)).collect(),
        q: (0..n * c.heads * c.dim).map(|_| rng.unit()).collect(),
        w: (0..n * c.heads).map(|_| rng.unit()).collect(),
    };
    let (q, w) = (gpu.upload(&ix.q)?, gpu.upload(&ix.w)?);
    let dsa = Dsa::new(
        DsaConfig {
            topk: c.topk,
            always: AlwaysInclude {
                sink_tokens: c.sink,
                recent_tokens: c.recent,
            },
        },
        Some(Arc::new(ix)),
    )?;
    let max_len = c.lens.iter().copied().max().unwrap_or(1);
    let shape = dsa.rep_shape(c.kv_heads, 16);
    let slots: Vec<usize> = (0..n).map(|s| n - 1 - s).collect();
    let mut pool = RepPool::new(shape, LAYERS, n, max_len)?;
    let layer = 1;
    dsa.update_representations(layer, &Lengths(c.lens), &slots, &mut pool)?;
    let mut dev_pool = DeviceRepPool::<T>::new(gpu, shape, LAYERS, n, max_len)?;
    let host: Vec<T> = pool
        .data()
        .to_f32()
        .iter()
        .map(|&x| T::from_f32(x))
        .collect();
    gpu.stream()
        .memcpy_htod(&host, dev_pool.data_mut())
        .map_err(AttnError::from)?;
    let attn_q: Vec<f32> = (0..n * c.kv_heads * 16).map(|_| rng.unit()).collect();
    let step = plain_decode(c.kv_heads, c.lens, &slots, &attn_q);
    let want = dsa.retrieve_topk(&step, &pool)?;
    let meta = plain_meta(gpu, c.kv_heads, c.lens)?;
    let dslots = gpu.upload(&slots.iter().map(|&s| s as i32).collect::<Vec<_>>())?;
    let mut out = DeviceTopK::dsa(gpu, &dsa, n, c.kv_heads, max_len, c.per_sequence)?;
    poison(gpu, &mut out)?;
    // Twice: the second launch finds the score keys the first left.
    for _ in 0..2 {
        sk.dsa_topk(&dsa, &q, &w, &meta, layer, &dslots, &dev_pool, &mut out)?;
    }
    compare_rows(gpu, &want, &out, c.lens, None)
}
