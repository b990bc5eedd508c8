//! Every device kernel against the CPU implementation (the specification), on fresh random
//! inputs with poisoned outputs; all elements compared.

use attn_op::cuda::{CudaElement, DeviceBatch, DevicePagedKv, DeviceSelection, Gpu};
use attn_op::{
    AttnError, AttnOut, AttnParams, AttnPart, BatchMeta, DType, KvCache, KvLayout, PagedKv,
    Selection, compact_kv, gather_page_offsets, merge_attention, paged_attention,
    sparse_page_attention, token_sparse_attention,
};
use half::{bf16, f16};

use crate::Rng;

/// One batch shape: (q_len, kv_len) per sequence and the attention parameters.
struct Shape {
    name: &'static str,
    head_dim: usize,
    q_heads: usize,
    kv_heads: usize,
    block_size: usize,
    seqs: &'static [(usize, usize)],
    window: Option<u32>,
    sink_tokens: u32,
    sink_logits: bool,
    /// Queries are drawn from `[-q_scale, q_scale)`: large values make the softmax peaked.
    q_scale: f32,
}

const SHAPES: &[Shape] = &[
    Shape {
        name: "peaked GQA 16/4 D128",
        head_dim: 128,
        q_heads: 16,
        kv_heads: 4,
        block_size: 16,
        seqs: &[(1, 3000), (9, 900)],
        window: None,
        sink_tokens: 0,
        sink_logits: false,
        q_scale: 12.0,
    },
    Shape {
        name: "decode B4 32/8 D128",
        head_dim: 128,
        q_heads: 32,
        kv_heads: 8,
        block_size: 16,
        seqs: &[(1, 1), (1, 17), (1, 300), (1, 5000)],
        window: None,
        sink_tokens: 0,
        sink_logits: false,
        q_scale: 1.0,
    },
    Shape {
        name: "mixed 9/3 D64",
        head_dim: 64,
        q_heads: 9,
        kv_heads: 3,
        block_size: 16,
        seqs: &[(1, 700), (37, 37), (5, 129)],
        window: None,
        sink_tokens: 0,
        sink_logits: false,
        q_scale: 1.0,
    },
    Shape {
        name: "window+sinks MHA D128",
        head_dim: 128,
        q_heads: 8,
        kv_heads: 8,
        block_size: 8,
        seqs: &[(64, 64), (1, 2000)],
        window: Some(50),
        sink_tokens: 4,
        sink_logits: true,
        q_scale: 1.0,
    },
    Shape {
        name: "MQA 8/1 D256",
        head_dim: 256,
        q_heads: 8,
        kv_heads: 1,
        block_size: 32,
        seqs: &[(3, 1000), (1, 1)],
        window: None,
        sink_tokens: 0,
        sink_logits: true,
        q_scale: 1.0,
    },
    Shape {
        // 256 (sequence, KV head) units: more than half a wave, so the planner picks the
        // split count that fills the last wave best (3 on an H200) instead of one a unit.
        name: "wide decode B32 32/8 D128",
        head_dim: 128,
        q_heads: 32,
        kv_heads: 8,
        block_size: 16,
        seqs: &[(1, 1500); 32],
        window: None,
        sink_tokens: 0,
        sink_logits: false,
        q_scale: 1.0,
    },
    Shape {
        // One unit and 8000 keys: the planner makes 63 splits, so the last split's merge
        // takes the partials in several batches, rescaling between them (merge_dims).
        name: "many splits MQA 8/1 D128",
        head_dim: 128,
        q_heads: 8,
        kv_heads: 1,
        block_size: 16,
        seqs: &[(1, 8000)],
        window: None,
        sink_tokens: 0,
        sink_logits: true,
        q_scale: 1.0,
    },
    Shape {
        // Two decode rows of 8 KV heads: page lists of up to 48 pages take the page walk
        // (`Gpu::page_walk_fits`) in the 16-bit types; every page (256) does not. A table row
        // of 256 blocks is staged in 16-byte loads, and 1001 tokens end in a page of one.
        name: "walk decode B2 32/8 D128",
        head_dim: 128,
        q_heads: 32,
        kv_heads: 8,
        block_size: 16,
        seqs: &[(1, 4096), (1, 1001)],
        window: None,
        sink_tokens: 0,
        sink_logits: false,
        q_scale: 1.0,
    },
    Shape {
        name: "long decode 32/8 D128",
        head_dim: 128,
        q_heads: 32,
        kv_heads: 8,
        block_size: 16,
        seqs: &[(1, 40_000), (2, 3000)],
        window: None,
        sink_tokens: 0,
        sink_logits: false,
        q_scale: 1.0,
    },
];

/// Runs every check for every dtype and prints one line each; returns the exit code.
/// With `small`, shapes longer than 10K tokens are left out (for the sanitizers, which run the
/// kernels far slower).
pub(crate) fn all(gpu: &mut Gpu, small: bool) -> Result<i32, AttnError> {
    let mut failed = 0;
    let mut seed = 1;
    for shape in SHAPES {
        if small && shape.seqs.iter().any(|&(_, kv)| kv > 10_000) {
            continue;
        }
        for dtype in [DType::F32, DType::F16, DType::BF16] {
            // The 16-bit types run on tensor cores by default; their CUDA-core kernels are
            // checked too, and bf16's sweep-only two-tile kernel (not built for f16).
            let kernels: &[Option<&'static str>] = match dtype {
                DType::F32 => &[None],
                DType::F16 => &[None, Some("r4"), Some("r8")],
                DType::BF16 => &[None, Some("tc2"), Some("r4"), Some("r8")],
            };
            for &kernel in kernels {
                seed += 1;
                gpu.set_variant(kernel)?;
                let results = match dtype {
                    DType::F32 => Case::<f32>::run(gpu, shape, seed)?,
                    DType::F16 => Case::<f16>::run(gpu, shape, seed)?,
                    DType::BF16 => Case::<bf16>::run(gpu, shape, seed)?,
                };
                for (what, err, tol) in results {
                    let ok = err <= tol;
                    failed += usize::from(!ok);
                    println!(
                        "{} {:<24} {dtype:<5?} {:<7} {what:<28} err {err:.2e} (tol {tol:.0e})",
                        if ok { "ok  " } else { "FAIL" },
                        shape.name,
                        kernel.unwrap_or("default"),
                    );
                }
            }
        }
    }
    gpu.set_variant(None)?;
    failed += merge_check(gpu)?;
    println!("check: {failed} failed");
    Ok(i32::from(failed > 0))
}

/// A random case of one dtype: the host cache, its device copy, metadata and queries.
struct Case<T: CudaElement> {
    layout: KvLayout,
    host: PagedKv<T>,
    q: Vec<T>,
    cu: Vec<i32>,
    kv_lens: Vec<i32>,
    table: Vec<i32>,
    max_blocks: usize,
    params: AttnParams,
}

/// (what, error, tolerance) of each comparison.
type Results = Vec<(String, f64, f64)>;

impl<T: CudaElement> Case<T> {
    fn new(shape: &Shape, rng: &mut Rng) -> Result<Self, AttnError> {
        let bs = shape.block_size;
        let max_blocks = shape
            .seqs
            .iter()
            .map(|&(_, kv)| kv.div_ceil(bs))
            .max()
            .unwrap_or(0);
        let used: usize = shape.seqs.iter().map(|&(_, kv)| kv.div_ceil(bs)).sum();
        let layout = KvLayout {
            num_blocks: used + 3,
            block_size: bs,
            kv_heads: shape.kv_heads,
            head_dim: shape.head_dim,
        };
        // Sequences own shuffled blocks, so block tables are not the identity.
        let perm = rng.permutation(layout.num_blocks);
        let mut table = vec![-1; shape.seqs.len() * max_blocks];
        let mut next = 0;
        for (s, &(_, kv)) in shape.seqs.iter().enumerate() {
            for b in 0..kv.div_ceil(bs) {
                table[s * max_blocks + b] = perm[next] as i32;
                next += 1;
            }
        }
        let rand = |n: usize, rng: &mut Rng| -> Vec<T> {
            (0..n).map(|_| T::from_f32(rng.unit())).collect()
        };
        let k = rand(layout.len(), rng);
        let v = rand(layout.len(), rng);
        let host = PagedKv::from_tensors(layout, k, v)?;
        let mut cu = vec![0i32];
        for &(ql, _) in shape.seqs {
            cu.push(cu[cu.len() - 1] + ql as i32);
        }
        let total_q = cu[cu.len() - 1] as usize;
        let q = (0..total_q * shape.q_heads * shape.head_dim)
            .map(|_| T::from_f32(rng.unit() * shape.q_scale))
            .collect();
        let mut params = AttnParams::new(shape.q_heads, shape.head_dim);
        params.window = shape.window;
        params.sink_tokens = shape.sink_tokens;
        if shape.sink_logits {
            params.sink_logits = Some((0..shape.q_heads).map(|_| rng.unit()).collect());
        }
        Ok(Case {
            layout,
            host,
            q,
            cu,
            kv_lens: shape.seqs.iter().map(|&(_, kv)| kv as i32).collect(),
            table,
            max_blocks,
            params,
        })
    }

    fn meta(&self) -> BatchMeta<'_> {
        BatchMeta {
            cu_seqlens_q: &self.cu,
            seq_lens_kv: &self.kv_lens,
            block_table: &self.table,
            max_blocks: self.max_blocks,
        }
    }

    fn rows(&self) -> usize {
        self.cu[self.cu.len() - 1] as usize * self.params.q_heads
    }

    fn tolerance() -> f64 {
        if T::DTYPE == DType::F32 { 1e-4 } else { 1e-2 }
    }

    fn run(gpu: &mut Gpu, shape: &Shape, seed: u64) -> Result<Results, AttnError> {
        let mut rng = Rng::new(seed);
        let case = Self::new(shape, &mut rng)?;
        let tol = Self::tolerance();
        let mut res = Results::new();

        // set_kv: fill a device pool token by token through the slot mapping (with padding
        // slots of -1), from a poisoned start; it must equal the host pool bit for bit.
        let dev = case.set_kv_copy(gpu, &mut rng)?;
        let kd = gpu.download(dev.k())?;
        let vd = gpu.download(dev.v())?;
        let same = kd == case.host.k() && vd == case.host.v();
        res.push((
            "set_kv (bit-exact)".to_owned(),
            f64::from(u8::from(!same)),
            0.0,
        ));

        let meta = DeviceBatch::upload(gpu, &case.meta(), &case.layout)?;
        let q = gpu.upload(&case.q)?;
        let (want, want_lse) = case.cpu(|q, kv, m, p, o| paged_attention(q, kv, m, p, o))?;
        let (got, got_lse) = case.gpu_out(gpu, |o, l| {
            gpu.paged_attention(&q, &dev, &meta, &case.params, o, Some(l))
        })?;
        res.push(("dense out".to_owned(), rel_err(&got, &want), tol));
        res.push(("dense lse".to_owned(), rel_err(&got_lse, &want_lse), tol));

        // Sparse page-list: random blocks at half and twice the page size, with duplicates.
        let bs = case.layout.block_size;
        let rows = case.kv_lens.len() * case.layout.kv_heads;
        for sel_bs in [bs / 2, bs * 2] {
            let (ids, lens, max_len) = case.random_blocks(sel_bs, &mut rng);
            let sel = Selection {
                ids: &ids,
                lens: &lens,
                max_len,
            };
            let cpu_g = gather_page_offsets(&sel, sel_bs, &case.kv_lens, bs, case.layout.kv_heads)?;
            let dsel = DeviceSelection::upload(gpu, &sel, rows)?;
            let dev_g = gpu.gather_page_offsets(&dsel, sel_bs, &meta)?;
            let same = gpu.download(&dev_g.pages.ids)? == cpu_g.pages
                && gpu.download(&dev_g.pages.lens)? == cpu_g.counts
                && gpu.download(&dev_g.kv_lens)? == cpu_g.kv_lens
                && gpu.download(&dev_g.invalid)? == [0];
            res.push((
                format!("gather sel_bs {sel_bs} (exact)"),
                f64::from(u8::from(!same)),
                0.0,
            ));
            let (want, want_lse) = case.cpu(|q, kv, m, p, o| {
                sparse_page_attention(q, kv, m, &cpu_g.as_selection(), p, o)
            })?;
            // The gathered rows are as wide as the table; a top-k's are as wide as its budget.
            // Rows of the gathered pages as wide as the longest (-1 padded, as a top-k writes
            // them) are attended to as well: where they fit the page walk, by the walk, and
            // by the attention kernel.
            let tight = tighten(gpu, &dev_g.pages)?;
            let walked = gpu.page_walk_fits(&dev, &meta, &tight, &case.params);
            let runs = [
                (&dev_g.pages, true, "sparse"),
                (&tight, true, if walked { "walk" } else { "sparse tight" }),
                (&tight, false, "sparse tight"),
            ];
            for (pages, walk, label) in runs {
                if !walk && !walked {
                    continue;
                }
                gpu.set_page_walk(walk);
                let got = case.gpu_out(gpu, |o, l| {
                    gpu.sparse_page_attention(&q, &dev, &meta, pages, &case.params, o, Some(l))
                });
                gpu.set_page_walk(true);
                let (got, got_lse) = got?;
                res.push((
                    format!("{label} sel_bs {sel_bs} out"),
                    rel_err(&got, &want),
                    tol,
                ));
                res.push((
                    format!("{label} sel_bs {sel_bs} lse"),
                    rel_err(&got_lse, &want_lse),
                    tol,
                ));
            }
        }

        // Every page selected equals dense, bit for bit, on the device too.
        let max_pages = case.max_blocks;
        let mut all = vec![-1; rows * max_pages];
        let mut counts = vec![0; rows];
        for r in 0..rows {
            let n = (case.kv_lens[r / case.layout.kv_heads] as usize).div_ceil(bs);
            for p in 0..n {
                all[r * max_pages + p] = p as i32;
            }
            counts[r] = n as i32;
        }
        let all_sel = Selection {
            ids: &all,
            lens: &counts,
            max_len: max_pages,
        };
        let dall = DeviceSelection::upload(gpu, &all_sel, rows)?;
        let (full, full_lse) = case.gpu_out(gpu, |o, l| {
            gpu.sparse_page_attention(&q, &dev, &meta, &dall, &case.params, o, Some(l))
        })?;
        let (dense, dense_lse) = case.gpu_out(gpu, |o, l| {
            gpu.paged_attention(&q, &dev, &meta, &case.params, o, Some(l))
        })?;
        // The page walk does not repeat the attention kernel's bits: where it takes every
        // page, it equals dense within rounding.
        if gpu.page_walk_fits(&dev, &meta, &dall, &case.params) {
            res.push((
                "all pages (walk) = dense out".to_owned(),
                rel_err(&full, &dense),
                tol,
            ));
            res.push((
                "all pages (walk) = dense lse".to_owned(),
                rel_err(&full_lse, &dense_lse),
                tol,
            ));
        } else {
            let same = bits(&full) == bits(&dense) && bits(&full_lse) == bits(&dense_lse);
            res.push((
                "all pages = dense (bits)".to_owned(),
                f64::from(u8::from(!same)),
                0.0,
            ));
        }

        // Token-level: a random unique subset of each row's positions, in random order.
        let (ids, lens, max_len) = case.random_tokens(&mut rng);
        let tok = Selection {
            ids: &ids,
            lens: &lens,
            max_len,
        };
        let (want, want_lse) =
            case.cpu(|q, kv, m, p, o| token_sparse_attention(q, kv, m, &tok, p, o))?;
        let dtok = DeviceSelection::upload(gpu, &tok, rows)?;
        let (got, got_lse) = case.gpu_out(gpu, |o, l| {
            gpu.token_sparse_attention(&q, &dev, &meta, &dtok, &case.params, o, Some(l))
        })?;
        res.push(("token out".to_owned(), rel_err(&got, &want), tol));
        res.push(("token lse".to_owned(), rel_err(&got_lse, &want_lse), tol));

        // Compaction: each sequence keeps a random ascending subset, the same count per head.
        let (ids, lens, max_len) = case.random_keep(&mut rng);
        let keep = Selection {
            ids: &ids,
            lens: &lens,
            max_len,
        };
        let mut host = case.host.clone();
        let want_lens = compact_kv(
            &mut host,
            &case.kv_lens,
            &case.table,
            case.max_blocks,
            &keep,
        )?;
        let mut dev = dev;
        let got_lens =
            gpu.compact_kv(&mut dev, &case.kv_lens, &case.table, case.max_blocks, &keep)?;
        let same = got_lens == want_lens
            && gpu.download(dev.k())? == host.k()
            && gpu.download(dev.v())? == host.v();
        res.push((
            "compact (bit-exact)".to_owned(),
            f64::from(u8::from(!same)),
            0.0,
        ));
        Ok(res)
    }

    /// A device pool written through `set_kv` in two batches of shuffled tokens with padding.
    fn set_kv_copy(&self, gpu: &Gpu, rng: &mut Rng) -> Result<DevicePagedKv<T>, AttnError> {
        let poison = vec![T::from_f32(f32::NAN); self.layout.len()];
        let mut dev = DevicePagedKv::from_host(gpu, self.layout, &poison, &poison)?;
        let stride = self.layout.token_stride();
        let order = rng.permutation(self.layout.num_slots());
        for part in order.chunks(order.len().div_ceil(2)) {
            let mut slots = Vec::new();
            let (mut k, mut v) = (Vec::new(), Vec::new());
            for &s in part {
                if rng.range(0, 8) == 0 {
                    slots.push(-1);
                    k.extend((0..stride).map(|_| T::from_f32(rng.unit())));
                    v.extend((0..stride).map(|_| T::from_f32(rng.unit())));
                }
                slots.push(s as i32);
                k.extend_from_slice(&self.host.k()[s * stride..(s + 1) * stride]);
                v.extend_from_slice(&self.host.v()[s * stride..(s + 1) * stride]);
            }
            let (ds, dk, dv) = (gpu.upload(&slots)?, gpu.upload(&k)?, gpu.upload(&v)?);
            dev.set_kv(&ds, &dk, &dv)?;
        }
        Ok(dev)
    }

    /// The CPU result of one entry point.
    fn cpu(
        &self,
        f: impl Fn(&[T], &PagedKv<T>, &BatchMeta<'_>, &AttnParams, AttnOut<'_>) -> Result<(), AttnError>,
    ) -> Result<(Vec<f32>, Vec<f32>), AttnError> {
        let d = self.layout.head_dim;
        let mut out = vec![0.0; self.rows() * d];
        let mut lse = vec![0.0; self.rows()];
        f(
            &self.q,
            &self.host,
            &self.meta(),
            &self.params,
            AttnOut {
                out: &mut out,
                lse: Some(&mut lse),
            },
        )?;
        Ok((out, lse))
    }

    /// The device result of one launch, into outputs poisoned with NaN.
    fn gpu_out(
        &self,
        gpu: &Gpu,
        f: impl FnOnce(
            &mut cudarc::driver::CudaSlice<f32>,
            &mut cudarc::driver::CudaSlice<f32>,
        ) -> Result<(), AttnError>,
    ) -> Result<(Vec<f32>, Vec<f32>), AttnError> {
        let d = self.layout.head_dim;
        let mut out = gpu.upload(&vec![f32::NAN; self.rows() * d])?;
        let mut lse = gpu.upload(&vec![f32::NAN; self.rows()])?;
        f(&mut out, &mut lse)?;
        Ok((gpu.download(&out)?, gpu.download(&lse)?))
    }

    /// Random blocks of `sel_bs` tokens per (sequence, KV head), with duplicates.
    fn random_blocks(&self, sel_bs: usize, rng: &mut Rng) -> (Vec<i32>, Vec<i32>, usize) {
        let rows = self.kv_lens.len() * self.layout.kv_heads;
        let max_len = 24;
        let mut ids = vec![-1; rows * max_len];
        let mut lens = vec![0; rows];
        for r in 0..rows {
            let n_sel = (self.kv_lens[r / self.layout.kv_heads] as usize).div_ceil(sel_bs);
            let n = rng.range(1, max_len + 1);
            for i in 0..n {
                ids[r * max_len + i] = rng.range(0, n_sel) as i32;
            }
            lens[r] = n as i32;
        }
        (ids, lens, max_len)
    }

    /// A random unique subset of each row's positions (about a third), shuffled.
    fn random_tokens(&self, rng: &mut Rng) -> (Vec<i32>, Vec<i32>, usize) {
        let kvh = self.layout.kv_heads;
        let rows = self.kv_lens.len() * kvh;
        let max_len = self.kv_lens.iter().copied().max().unwrap_or(0) as usize;
        let mut ids = vec![-1; rows * max_len];
        let mut lens = vec![0; rows];
        for r in 0..rows {
            let kv = self.kv_lens[r / kvh] as usize;
            let mut n = 0;
            for p in rng.permutation(kv) {
                if rng.range(0, 3) == 0 || p == kv - 1 {
                    ids[r * max_len + n] = p as i32;
                    n += 1;
                }
            }
            lens[r] = n as i32;
        }
        (ids, lens, max_len)
    }

    /// Per sequence a keep count, then per head a random ascending subset of that size.
    fn random_keep(&self, rng: &mut Rng) -> (Vec<i32>, Vec<i32>, usize) {
        let kvh = self.layout.kv_heads;
        let rows = self.kv_lens.len() * kvh;
        let max_len = self.kv_lens.iter().copied().max().unwrap_or(0) as usize;
        let mut ids = vec![-1; rows * max_len];
        let mut lens = vec![0; rows];
        for (s, &kv) in self.kv_lens.iter().enumerate() {
            let kv = kv as usize;
            let n = rng.range(1, kv + 1);
            for h in 0..kvh {
                let r = s * kvh + h;
                let mut pick: Vec<usize> = rng.permutation(kv)[..n].to_vec();
                pick.sort_unstable();
                for (i, p) in pick.into_iter().enumerate() {
                    ids[r * max_len + i] = p as i32;
                }
                lens[r] = n as i32;
            }
        }
        (ids, lens, max_len)
    }
}

/// The device merge against the CPU merge: three parts of random rows, some empty (-inf).
fn merge_check(gpu: &Gpu) -> Result<usize, AttnError> {
    let mut rng = Rng::new(99);
    let (rows, d, n) = (300, 128, 3);
    let outs: Vec<f32> = (0..n * rows * d).map(|_| rng.unit()).collect();
    let lses: Vec<f32> = (0..n * rows)
        .map(|_| {
            if rng.range(0, 5) == 0 {
                f32::NEG_INFINITY
            } else {
                rng.unit() * 8.0
            }
        })
        .collect();
    let parts: Vec<AttnPart<'_>> = (0..n)
        .map(|p| AttnPart {
            out: &outs[p * rows * d..(p + 1) * rows * d],
            lse: &lses[p * rows..(p + 1) * rows],
        })
        .collect();
    let mut want = vec![0.0; rows * d];
    let mut want_lse = vec![0.0; rows];
    merge_attention(&parts, d, &mut want, &mut want_lse)?;
    let (po, pl) = (gpu.upload(&outs)?, gpu.upload(&lses)?);
    let mut out = gpu.upload(&vec![f32::NAN; rows * d])?;
    let mut lse = gpu.upload(&vec![f32::NAN; rows])?;
    gpu.merge_attention(&po, &pl, n, d, &mut out, &mut lse)?;
    let err = rel_err(&gpu.download(&out)?, &want).max(rel_err(&gpu.download(&lse)?, &want_lse));
    let ok = err <= 1e-5;
    println!(
        "{} merge 3 parts f32 err {err:.2e} (tol 1e-5)",
        if ok { "ok  " } else { "FAIL" }
    );
    Ok(usize::from(!ok))
}

/// The largest elementwise difference over the largest reference magnitude; -inf must match
/// -inf exactly and a NaN (an unwritten element) is an infinite error.
fn rel_err(got: &[f32], want: &[f32]) -> f64 {
    if got.len() != want.len() {
        return f64::INFINITY;
    }
    let scale = want
        .iter()
        .filter(|x| x.is_finite())
        .fold(0.0f64, |m, &x| m.max(f64::from(x.abs())))
        .max(1e-30);
    let mut worst = 0.0f64;
    for (&g, &w) in got.iter().zip(want) {
        let e = if g.is_nan() || w.is_nan() {
            f64::INFINITY
        } else if w.is_infinite() || g.is_infinite() {
            if g == w { 0.0 } else { f64::INFINITY }
        } else {
            f64::from((g - w).abs()) / scale
        };
        worst = worst.max(e);
    }
    worst
}

fn bits(x: &[f32]) -> Vec<u32> {
    x.iter().map(|v| v.to_bits()).collect()
}

/// `pages` with rows as wide as its longest row: the ids past each row's length are -1.
fn tighten(gpu: &Gpu, pages: &DeviceSelection) -> Result<DeviceSelection, AttnError> {
    let (ids, lens) = (gpu.download(&pages.ids)?, gpu.download(&pages.lens)?);
    let width = lens
        .iter()
        .map(|&n| n.max(0) as usize)
        .max()
        .unwrap_or(0)
        .max(1);
    let mut tight = vec![-1; pages.rows * width];
    for (r, &n) in lens.iter().enumerate() {
        let n = (n.max(0) as usize).min(pages.max_len);
        tight[r * width..r * width + n]
            .copy_from_slice(&ids[r * pages.max_len..r * pages.max_len + n]);
    }
    let sel = Selection {
        ids: &tight,
        lens: &lens,
        max_len: width,
    };
    DeviceSelection::upload(gpu, &sel, pages.rows)
}
