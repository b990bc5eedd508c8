//! The prototype's inputs and references: the likely pages drawn from a selection, and the
//! CPU's attention over the selection.

use attn_op::cuda::{DeviceSelection, Gpu};
use attn_op::{AttnOut, AttnParams, BatchMeta, PagedKv, Selection, sparse_page_attention};
use cudarc::driver::CudaSlice;
use half::bf16;
use sparse_algo::AlgoError;

use super::Walk;
use super::launch::int;
use crate::bench::{D, PS, Q_HEADS, Want};
use crate::cold::Shape;
use crate::rng::Rng;

/// Rows of likely pages for the selected rows `ids` (rows of `width`, ascending, -1 padded)
/// over `pages` pages, `count` wide: each keeps its row's last (current) page and `overlap` of
/// the others; the rest of the row, and every place past its pages, gets pages the row lacks.
/// Answers the rows (ascending, `count` wide), their lengths, and how many selected pages they
/// lack.
fn likely(
    ids: &[i32],
    width: usize,
    count: usize,
    pages: usize,
    overlap: f64,
    rng: &mut Rng,
) -> (Vec<i32>, Vec<i32>, usize) {
    let (mut out, mut lens, mut missing) = (Vec::new(), Vec::new(), 0);
    for row in ids.chunks(width) {
        let selected: Vec<i32> = row.iter().copied().filter(|&x| x >= 0).collect();
        let n = selected.len();
        let lack = (n.saturating_sub(1) as f64 * (1.0 - overlap)).round() as usize;
        let dropped = rng.subset(lack, n.saturating_sub(1));
        let mut have: Vec<i32> = selected
            .iter()
            .enumerate()
            .filter(|(i, _)| dropped.binary_search(&(*i as i32)).is_err())
            .map(|(_, &p)| p)
            .collect();
        // Other pages, below the current one, that the selection lacks.
        while have.len() < count.min(pages) {
            let p = rng.range(0, pages - 1) as i32;
            if !selected.contains(&p) && !have.contains(&p) {
                have.push(p);
            }
        }
        have.sort_unstable();
        missing += lack;
        lens.push(have.len() as i32);
        out.extend_from_slice(&have);
        out.resize(out.len() + count - have.len(), -1);
    }
    (out, lens, missing)
}

/// The largest |out - want| over the layers, relative to the largest |want|.
pub(super) fn worst_diff(
    gpu: &Gpu,
    outs: &[CudaSlice<f32>],
    wants: &[Vec<f32>],
) -> Result<f64, AlgoError> {
    let got = outs
        .iter()
        .map(|o| gpu.download(o))
        .collect::<Result<Vec<Vec<f32>>, _>>()?;
    Ok(worst_of(&got, wants))
}

pub(super) fn worst_of(got: &[Vec<f32>], wants: &[Vec<f32>]) -> f64 {
    let (mut diff, mut scale) = (0.0f64, 0.0f64);
    for (out, want) in got.iter().zip(wants) {
        for (a, b) in out.iter().zip(want) {
            diff = diff.max(f64::from((a - b).abs()));
            scale = scale.max(f64::from(b.abs()));
        }
    }
    if scale > 0.0 { diff / scale } else { diff }
}

/// The host's copies of a shape's inputs: the KV pool and the queries.
pub(crate) struct Host<'a> {
    pub kv: &'a PagedKv<bf16>,
    pub q: &'a [bf16],
}

/// Each layer's attention over its plain step's selection, on the CPU (the specification).
pub(super) fn cpu_reference(
    host: &Host<'_>,
    sh: &Shape<'_>,
    tables: &[Vec<i32>],
    wants: &[Want],
    width: usize,
) -> Result<Vec<Vec<f32>>, AlgoError> {
    let b = sh.b;
    let cu: Vec<i32> = (0..=b as i32).collect();
    let lens = vec![int(sh.ctx)?; b];
    let params = AttnParams::new(Q_HEADS, D);
    tables
        .iter()
        .zip(wants)
        .map(|(table, want)| {
            let sel_lens: Vec<i32> = want
                .ids
                .chunks(width)
                .map(|r| r.iter().filter(|&&x| x >= 0).count() as i32)
                .collect();
            let meta = BatchMeta {
                cu_seqlens_q: &cu,
                seq_lens_kv: &lens,
                block_table: table,
                max_blocks: sh.ctx / PS,
            };
            let sel = Selection {
                ids: &want.ids,
                lens: &sel_lens,
                max_len: width,
            };
            let mut out = vec![0.0f32; b * Q_HEADS * D];
            sparse_page_attention(
                host.q,
                host.kv,
                &meta,
                &sel,
                &params,
                AttnOut {
                    out: &mut out,
                    lse: None,
                },
            )?;
            Ok(out)
        })
        .collect()
}

/// Each layer's likely pages for `walk` (none for a late walk), drawn from its plain step's
/// selection (`want`, rows of `width`), and how many selected pages they lack over the layers.
pub(super) fn likely_sets(
    gpu: &Gpu,
    wants: &[Want],
    walk: Walk,
    width: usize,
    sh: &Shape<'_>,
) -> Result<(Vec<DeviceSelection>, usize), AlgoError> {
    let (Walk::Early { share, count } | Walk::Warm { share, count }) = walk else {
        let selected = wants
            .iter()
            .map(|w| w.ids.iter().filter(|&&x| x >= 0).count())
            .sum();
        return Ok((Vec::new(), selected));
    };
    let mut rng = Rng::new(41);
    let (mut sets, mut lack) = (Vec::with_capacity(wants.len()), 0);
    for want in wants {
        let (ids, lens, m) = likely(
            &want.ids,
            width,
            count * width,
            sh.ctx / PS,
            share,
            &mut rng,
        );
        lack += m;
        sets.push(DeviceSelection {
            rows: lens.len(),
            ids: gpu.upload(&ids)?,
            lens: gpu.upload(&lens)?,
            max_len: count * width,
        });
    }
    Ok((sets, lack))
}
