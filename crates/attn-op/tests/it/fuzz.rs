//! Arbitrary inputs, valid or not: every entry point answers with a result or a typed error,
//! never a panic, and leaves its outputs (and, for compaction, the cache) untouched on error.
//!
//! Each case is a valid call of every entry point, drawn from a seed, with up to three edits
//! that a caller's bug could make: an entry set to -1, `i32::MIN` or `i32::MAX`, an array one
//! entry short or long, a row width near `usize::MAX` whose products overflow, a buffer of the
//! wrong length, a parameter out of its domain. A case without edits must succeed, so the
//! calls reach the kernels, not only the first check.

use attn_op::{
    AttnOut, AttnParams, AttnPart, BatchMeta, KvLayout, PagedKv, Selection, Simd, compact_kv,
    gather_page_offsets, merge_attention, paged_attention, sparse_page_attention,
    token_sparse_attention,
};
use proptest::prelude::*;

use crate::oracle::Rng;

proptest! {
    /// Dense, page-list and token-level attention, the gather and compaction.
    #[test]
    fn every_entry_point_answers_every_call(seed in any::<u64>(), edits in prop::collection::vec(edit(), 0..4)) {
        let mut c = Call::valid(seed);
        for e in &edits {
            c.apply(e);
        }
        for op in [Op::Dense, Op::Pages, Op::Tokens, Op::Gather, Op::Compact] {
            let ok = c.run(op);
            prop_assert!(ok || !edits.is_empty(), "{op:?} refused a valid call: {c:?}");
        }
    }

    /// Merges of arbitrary part shapes.
    #[test]
    fn merge_answers_every_call(
        shapes in prop::collection::vec((0..20usize, 0..6usize), 0..4),
        head_dim in width(),
        out_len in 0..20usize,
        lse_len in 0..6usize,
    ) {
        let parts: Vec<(Vec<f32>, Vec<f32>)> = shapes
            .iter()
            .map(|&(o, l)| {
                let out = (0..o).map(|i| i as f32 * 0.1 + 0.05).collect();
                let lse = (0..l)
                    .map(|i| if i % 3 == 2 { f32::NEG_INFINITY } else { i as f32 - 1.5 })
                    .collect();
                (out, lse)
            })
            .collect();
        let parts: Vec<AttnPart<'_>> =
            parts.iter().map(|(out, lse)| AttnPart { out, lse }).collect();
        let mut out = vec![7.5f32; out_len];
        let mut lse = vec![-3.5f32; lse_len];
        if merge_attention(&parts, head_dim, &mut out, &mut lse).is_err() {
            prop_assert!(out.iter().all(|&x| x == 7.5) && lse.iter().all(|&x| x == -3.5));
        }
    }

    /// Layouts of any size: a cache is made, or refused with an error where an extent is 0 or
    /// its bytes overflow the address space. (Valid layouts past 1 MiB are not asked for here;
    /// `errors.rs` asks for one the allocator cannot give.)
    #[test]
    fn layouts_of_any_size_are_made_or_refused(
        num_blocks in width(),
        block_size in width(),
        kv_heads in width(),
        head_dim in width(),
    ) {
        let layout = KvLayout { num_blocks, block_size, kv_heads, head_dim };
        let bytes = [block_size, kv_heads, head_dim, 4]
            .into_iter()
            .try_fold(num_blocks, usize::checked_mul);
        let zero = block_size == 0 || kv_heads == 0 || head_dim == 0;
        let huge = bytes.is_none_or(|b| b > isize::MAX as usize);
        if zero || huge || bytes.is_some_and(|b| b <= 1 << 20) {
            let made = PagedKv::<f32>::new(layout);
            prop_assert_eq!(made.is_ok(), !(zero || huge), "{:?}: {:?}", layout, made);
        }
    }
}

/// An `i32` a caller's bug could put in a metadata array.
fn nasty() -> impl Strategy<Value = i32> {
    prop_oneof![0..12i32, Just(-1), Just(i32::MIN), Just(i32::MAX)]
}

/// A row width or count: small, or large enough that products with it overflow.
fn width() -> impl Strategy<Value = usize> {
    prop_oneof![
        8 => 0..6usize,
        1 => Just(usize::MAX),
        1 => Just(usize::MAX / 2 + 1),
        1 => Just(1usize << 40),
    ]
}

/// One edit of a valid call.
#[derive(Clone, Debug)]
enum Edit {
    /// Entry `at` (modulo the length) of array `which` set to `to`.
    Entry { which: usize, at: usize, to: i32 },
    /// Array `which` one entry longer (`to` appended) or shorter.
    Resize { which: usize, to: Option<i32> },
    /// A row width (`max_blocks`, either selection's `max_len`) or the gather's granularity.
    Width { which: usize, to: usize },
    /// The length of q, out or lse moved by `by`; or lse dropped.
    Buffer { which: usize, by: isize },
    /// A parameter out of its domain.
    Param(usize),
}

fn edit() -> impl Strategy<Value = Edit> {
    prop_oneof![
        (0..ARRAYS, any::<usize>(), nasty()).prop_map(|(which, at, to)| Edit::Entry {
            which,
            at,
            to
        }),
        (0..ARRAYS, prop::option::of(nasty())).prop_map(|(which, to)| Edit::Resize { which, to }),
        (0..4usize, width()).prop_map(|(which, to)| Edit::Width { which, to }),
        (0..4usize, prop_oneof![Just(-1isize), Just(1)])
            .prop_map(|(which, by)| Edit::Buffer { which, by }),
        (0..6usize).prop_map(Edit::Param),
    ]
}

/// The i32 arrays an edit can touch: cu, lens, table, page ids, page lens, token ids, token
/// lens.
const ARRAYS: usize = 7;

/// A selection in the shared format.
#[derive(Clone, Debug)]
struct Sel {
    ids: Vec<i32>,
    lens: Vec<i32>,
    max_len: usize,
}

impl Sel {
    /// Rows of strictly ascending ids drawn from `0..limit(row)`, `count(row)` of them, padded
    /// with -1 to the widest row.
    fn new(
        rng: &mut Rng,
        rows: usize,
        limit: impl Fn(usize) -> usize,
        count: impl Fn(&mut Rng, usize) -> usize,
    ) -> Sel {
        let lists: Vec<Vec<i32>> = (0..rows)
            .map(|r| {
                let n = count(rng, r);
                let mut all: Vec<i32> = (0..limit(r) as i32).collect();
                for i in 0..n {
                    let j = rng.range(i, all.len());
                    all.swap(i, j);
                }
                all.truncate(n);
                all.sort_unstable();
                all
            })
            .collect();
        let max_len = lists.iter().map(Vec::len).max().unwrap_or(0) + 1;
        let mut ids = vec![-1; rows * max_len];
        for (r, l) in lists.iter().enumerate() {
            ids[r * max_len..r * max_len + l.len()].copy_from_slice(l);
        }
        Sel {
            ids,
            lens: lists.iter().map(|l| l.len() as i32).collect(),
            max_len,
        }
    }

    fn as_selection(&self) -> Selection<'_> {
        Selection {
            ids: &self.ids,
            lens: &self.lens,
            max_len: self.max_len,
        }
    }
}

/// A call of every entry point over one small pool.
#[derive(Clone, Debug)]
struct Call {
    layout: KvLayout,
    params: AttnParams,
    cu: Vec<i32>,
    lens: Vec<i32>,
    table: Vec<i32>,
    max_blocks: usize,
    pages: Sel,
    tokens: Sel,
    sel_block: usize,
    q_len: usize,
    out_len: usize,
    lse_len: Option<usize>,
}

/// Which entry point a run takes.
#[derive(Clone, Copy, Debug)]
enum Op {
    Dense,
    Pages,
    Tokens,
    Gather,
    Compact,
}

impl Call {
    /// A valid call: up to 3 sequences of up to 12 tokens over shuffled blocks, up to 3 queries
    /// each, random page and token selections (equal token counts across a sequence's heads, as
    /// compaction needs), and sometimes a window, sinks and sink logits.
    fn valid(seed: u64) -> Call {
        let mut rng = Rng::new(seed);
        let block_size = [1, 2, 4][rng.range(0, 3)];
        let kv_heads = rng.range(1, 3);
        let layout = KvLayout {
            num_blocks: 12,
            block_size,
            kv_heads,
            head_dim: [1, 4, 8, 16][rng.range(0, 4)],
        };
        let mut params = AttnParams::new(kv_heads * rng.range(1, 4), layout.head_dim);
        params.simd = [Simd::Portable, Simd::Avx2, Simd::Auto][rng.range(0, 3)];
        if rng.range(0, 2) == 0 {
            params.window = Some(rng.range(1, 6) as u32);
            params.sink_tokens = rng.range(0, 3) as u32;
        }
        if rng.range(0, 3) == 0 {
            params.sink_logits = Some((0..params.q_heads).map(|_| rng.unit()).collect());
        }
        let seqs = rng.range(0, 4);
        let lens: Vec<usize> = (0..seqs).map(|_| rng.range(0, 13)).collect();
        let max_blocks = lens
            .iter()
            .map(|l| l.div_ceil(block_size))
            .max()
            .unwrap_or(0)
            + rng.range(0, 2);
        let mut table = vec![-1; seqs * max_blocks];
        for (s, &l) in lens.iter().enumerate() {
            for b in 0..l.div_ceil(block_size) {
                table[s * max_blocks + b] = rng.range(0, layout.num_blocks) as i32;
            }
        }
        let mut cu = vec![0];
        for &l in &lens {
            let q = rng.range(0, l.min(3) + 1) as i32;
            cu.push(cu[cu.len() - 1] + q);
        }
        let rows = seqs * kv_heads;
        let pages = Sel::new(
            &mut rng,
            rows,
            |r| lens[r / kv_heads].div_ceil(block_size),
            |rng, r| rng.range(0, lens[r / kv_heads].div_ceil(block_size) + 1),
        );
        let keep: Vec<usize> = lens.iter().map(|&l| rng.range(0, l + 1)).collect();
        let tokens = Sel::new(
            &mut rng,
            rows,
            |r| lens[r / kv_heads],
            |_, r| keep[r / kv_heads],
        );
        let total = cu[seqs] as usize;
        Call {
            layout,
            cu,
            lens: lens.iter().map(|&l| l as i32).collect(),
            table,
            max_blocks,
            pages,
            tokens,
            sel_block: block_size,
            q_len: total * params.q_heads * layout.head_dim,
            out_len: total * params.q_heads * layout.head_dim,
            lse_len: (rng.range(0, 2) == 0).then_some(total * params.q_heads),
            params,
        }
    }

    fn apply(&mut self, edit: &Edit) {
        match *edit {
            Edit::Entry { which, at, to } => {
                let v = field(self, which);
                let n = v.len();
                if n > 0 {
                    v[at % n] = to;
                }
            }
            Edit::Resize { which, to } => {
                let v = field(self, which);
                match to {
                    Some(x) => v.push(x),
                    None => {
                        v.pop();
                    }
                }
            }
            Edit::Width { which, to } => match which {
                0 => self.max_blocks = to,
                1 => self.pages.max_len = to,
                2 => self.tokens.max_len = to,
                _ => self.sel_block = to,
            },
            Edit::Buffer { which, by } => {
                let moved = |n: usize| n.saturating_add_signed(by);
                match which {
                    0 => self.q_len = moved(self.q_len),
                    1 => self.out_len = moved(self.out_len),
                    2 => self.lse_len = Some(moved(self.lse_len.unwrap_or(0))),
                    _ => self.lse_len = None,
                }
            }
            Edit::Param(which) => match which {
                0 => self.params.q_heads = usize::MAX,
                1 => self.params.q_heads = self.params.q_heads.wrapping_add(1),
                2 => self.params.window = Some(0),
                3 => self.params.scale = f32::NAN,
                4 => self.params.sink_logits = Some(vec![0.5]),
                _ => {
                    self.params.window = Some(u32::MAX);
                    self.params.sink_tokens = u32::MAX;
                }
            },
        }
    }

    /// Runs one entry point; on error, checks that its outputs (or the cache) are untouched.
    /// Returns whether it succeeded.
    fn run(&self, op: Op) -> bool {
        let mut kv = pool(self.layout);
        let meta = BatchMeta {
            cu_seqlens_q: &self.cu,
            seq_lens_kv: &self.lens,
            block_table: &self.table,
            max_blocks: self.max_blocks,
        };
        let (pages, tokens) = (self.pages.as_selection(), self.tokens.as_selection());
        let (block_size, kv_heads) = (self.layout.block_size, self.layout.kv_heads);
        match op {
            Op::Gather => {
                // The gather's output is as wide as the longest sequence's pages, so a length
                // near `i32::MAX` would only make it gigabytes; such lengths become 4096 here.
                let lens: Vec<i32> = self.lens.iter().map(|&l| l.min(4096)).collect();
                return gather_page_offsets(&pages, self.sel_block, &lens, block_size, kv_heads)
                    .is_ok();
            }
            Op::Compact => {
                let before = kv.clone();
                let got = compact_kv(&mut kv, &self.lens, &self.table, self.max_blocks, &tokens);
                assert!(
                    got.is_ok() || kv == before,
                    "compaction moved tokens on {got:?}"
                );
                return got.is_ok();
            }
            Op::Dense | Op::Pages | Op::Tokens => {}
        }
        let q: Vec<f32> = (0..self.q_len)
            .map(|i| (i % 9) as f32 * 0.2 - 0.7)
            .collect();
        let mut out = vec![7.5f32; self.out_len];
        let mut lse = self.lse_len.map(|n| vec![-3.5f32; n]);
        let dst = AttnOut {
            out: &mut out,
            lse: lse.as_deref_mut(),
        };
        let p = &self.params;
        let got = match op {
            Op::Dense => paged_attention(&q, &kv, &meta, p, dst),
            Op::Pages => sparse_page_attention(&q, &kv, &meta, &pages, p, dst),
            _ => token_sparse_attention(&q, &kv, &meta, &tokens, p, dst),
        };
        if got.is_err() {
            assert!(
                out.iter().all(|&x| x == 7.5),
                "{op:?}: out written on {got:?}"
            );
            let lse = lse.iter().flatten();
            assert!(
                lse.clone().all(|&x| x == -3.5),
                "{op:?}: lse written on {got:?}"
            );
        }
        got.is_ok()
    }
}

/// Array `which` of the call (see [`ARRAYS`]).
fn field(c: &mut Call, which: usize) -> &mut Vec<i32> {
    match which {
        0 => &mut c.cu,
        1 => &mut c.lens,
        2 => &mut c.table,
        3 => &mut c.pages.ids,
        4 => &mut c.pages.lens,
        5 => &mut c.tokens.ids,
        _ => &mut c.tokens.lens,
    }
}

/// A pool whose values are never zero.
fn pool(layout: KvLayout) -> PagedKv<f32> {
    let n = layout.len();
    let k = (0..n).map(|i| (i % 7) as f32 * 0.25 - 0.6).collect();
    let v = (0..n).map(|i| (i % 5) as f32 * 0.3 + 0.1).collect();
    PagedKv::from_tensors(layout, k, v).expect("the calls' layouts are valid")
}
