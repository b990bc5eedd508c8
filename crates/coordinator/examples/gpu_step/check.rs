//! `gpu_step check`: the device step against the CPU's, step by step.

use attn_op::cuda::Gpu;
use attn_op::{AttnOut, BatchMeta, PagedKv, Selection, sparse_page_attention};
use offload::HotBuffer;
use sparse_algo::Summary;

use crate::pipeline::check_pipeline;
use crate::rng::Rng;
use crate::{Cache, Kernels, Res, Shape, Step, coord, drift, err, to_bf16};

pub(crate) fn check(gpu: &Gpu, k: &Kernels) -> Res<i32> {
    let mut failed = 0;
    for (shape, steps) in [
        (
            Shape {
                seqs: 3,
                len: 1000,
                kv_heads: 2,
                q_heads: 8,
                dim: 64,
                page: 16,
                budget: 160,
                hot: 16,
            },
            5,
        ),
        (
            Shape {
                seqs: 2,
                len: 4099,
                kv_heads: 8,
                q_heads: 32,
                dim: 128,
                page: 16,
                budget: 512,
                hot: 48,
            },
            4,
        ),
    ] {
        let cache = Cache::new(gpu, k, shape, 7, Summary::Exact)?;
        let mut step = Step::new(gpu, &cache)?;
        let mut cpu = vec![HotBuffer::new(shape.hot); shape.seqs];
        let mut rng = Rng::new(3);
        let n_q = shape.seqs * shape.q_heads * shape.dim;
        let mut qf: Vec<f32> = (0..n_q).map(|_| rng.unit()).collect();
        let pages = shape.pages();
        let full =
            PagedKv::from_tensors(shape.layout(), cache.k.clone(), cache.v.clone()).map_err(err)?;
        let table: Vec<i32> = (0..(shape.seqs * pages) as i32).collect();
        let lens = vec![shape.len as i32; shape.seqs];
        let cu: Vec<i32> = (0..=shape.seqs as i32).collect();
        let meta = BatchMeta {
            cu_seqlens_q: &cu,
            seq_lens_kv: &lens,
            block_table: &table,
            max_blocks: pages,
        };
        for t in 0..steps {
            let qb = to_bf16(&qf);
            let q = gpu.upload(&qb).map_err(err)?;
            step.run(gpu, k, &q, None)?;
            let width = cache.quest.row_width();
            let ids = gpu.download(&step.top.sel.ids).map_err(err)?;
            let sel_lens = gpu.download(&step.top.sel.lens).map_err(err)?;
            let misses = gpu.download(&step.diff.miss_counts).map_err(err)?;
            let slots = gpu.download(&step.diff.slots).map_err(err)?;
            let got = gpu.download(&step.out).map_err(err)?;
            let mut same = true;
            let (mut n_miss, mut n_sel) = (0, 0);
            for s in 0..shape.seqs {
                let row = &ids[s * width..s * width + sel_lens[s] as usize];
                let want = cpu[s].diff(row, pages as i32 - 1);
                same &= misses[s] as usize == want.misses.len()
                    && want
                        .slots
                        .iter()
                        .zip(&slots[s * width..])
                        .all(|(&a, &b)| a as i32 == b);
                n_miss += want.misses.len();
                n_sel += row.len();
            }
            // The CPU reads the selected pages from the whole cache, one row per KV head.
            let mut rows_ids = Vec::new();
            let mut rows_lens = Vec::new();
            for s in 0..shape.seqs {
                for _ in 0..shape.kv_heads {
                    rows_ids.extend_from_slice(&ids[s * width..(s + 1) * width]);
                    rows_lens.push(sel_lens[s]);
                }
            }
            let mut want = vec![0f32; n_q];
            sparse_page_attention(
                &qb,
                &full,
                &meta,
                &Selection {
                    ids: &rows_ids,
                    lens: &rows_lens,
                    max_len: width,
                },
                &step.params,
                AttnOut {
                    out: &mut want,
                    lse: None,
                },
            )
            .map_err(err)?;
            let scale = want.iter().fold(0f32, |m, x| m.max(x.abs())).max(1e-6);
            let worst = got
                .iter()
                .zip(&want)
                .fold(0f32, |m, (a, b)| m.max((a - b).abs() / scale));
            let ok = same && worst <= 1e-2;
            failed += usize::from(!ok);
            println!(
                "{} step B{} L{} kvh {} D {} HOT {} step {t}: {n_miss} of {n_sel} pages missed; \
                 diff equals the CPU's: {same}; attention max rel err {worst:.2e}",
                if ok { "ok  " } else { "FAIL" },
                shape.seqs,
                shape.len,
                shape.kv_heads,
                shape.dim,
                shape.hot,
            );
            qf = drift(&qf, &mut rng, 0.3);
        }
    }
    failed += check_pipeline(gpu, k)?;
    failed += coord::check(gpu)?;
    println!("gpu_step check: {failed} failed");
    Ok(i32::from(failed > 0))
}
