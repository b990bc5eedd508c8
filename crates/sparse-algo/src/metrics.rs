//! Fidelity metrics: what a selection loses against dense attention.

use attn_op::{
    AttnOut, AttnParams, BatchMeta, Element, PagedKv, paged_attention, token_sparse_attention,
};

use crate::exact::{logits, softmax_rows};
use crate::{AlgoError, Decode, TopK};

/// Attention-mass recall of a decode selection: for every (sequence, query head), the share of
/// the head's softmax probability (over every visible key, scale `scale`) that falls on the
/// tokens its KV head's row selects. 1 means nothing was lost. Reads keys from `step.keys`.
pub fn mass_recall(step: &Decode<'_>, sel: &TopK, scale: f32) -> Result<Vec<f64>, AlgoError> {
    let g = step.validate()?;
    let keys = step.need_keys("mass recall")?;
    check_sel(step, sel)?;
    let d = step.head_dim;
    let mut out = Vec::with_capacity(step.num_seqs() * step.q_heads);
    for (s, &len) in step.seq_lens.iter().enumerate() {
        let q = &step.q[s * step.q_heads * d..(s + 1) * step.q_heads * d];
        let mut p = logits(keys, s, len, q, scale);
        softmax_rows(&mut p, len);
        for j in 0..step.q_heads {
            let row = &p[j * len..(j + 1) * len];
            let ps = sel.page_size;
            let m: f64 = sel
                .row(s, j / g)
                .iter()
                .map(|&pg| {
                    let a = pg as usize * ps;
                    row[a..(a + ps).min(len)]
                        .iter()
                        .map(|&x| f64::from(x))
                        .sum::<f64>()
                })
                .sum();
            out.push(m);
        }
    }
    Ok(out)
}

/// Top-k recall against a reference selection (usually the oracle's): for every (sequence, KV
/// head), the share of the reference's tokens that `sel` also selects. Both are compared in
/// tokens, so their page sizes may differ.
pub fn topk_recall(
    sel: &TopK,
    reference: &TopK,
    seq_lens: &[usize],
) -> Result<Vec<f64>, AlgoError> {
    for (what, t) in [("selection", sel), ("reference", reference)] {
        crate::error::check_len(what, t.lens.len(), &[seq_lens.len(), t.kv_heads])?;
        check_ids(t, seq_lens)?;
    }
    if sel.kv_heads != reference.kv_heads {
        return Err(AlgoError::Invalid(format!(
            "selection has {} KV heads, the reference {}",
            sel.kv_heads, reference.kv_heads
        )));
    }
    let (a, b) = (sel.to_tokens(seq_lens), reference.to_tokens(seq_lens));
    Ok((0..a.lens.len())
        .map(|r| {
            let (s, h) = (r / a.kv_heads, r % a.kv_heads);
            let (x, y) = (a.row(s, h), b.row(s, h));
            if y.is_empty() {
                return 1.0;
            }
            let (mut i, mut common) = (0, 0usize);
            for &t in y {
                while i < x.len() && x[i] < t {
                    i += 1;
                }
                if i < x.len() && x[i] == t {
                    common += 1;
                }
            }
            common as f64 / y.len() as f64
        })
        .collect())
}

/// Relative output error of a decode selection: for every (sequence, query head),
/// `|o_sparse - o_dense| / |o_dense|` (L2 over the head dimension), both computed by attn-op
/// (dense [`paged_attention`], sparse [`token_sparse_attention`] over the selected tokens).
/// `meta` must describe a decode batch (one query per sequence).
pub fn output_error<T: Element>(
    q: &[T],
    kv: &PagedKv<T>,
    meta: &BatchMeta<'_>,
    sel: &TopK,
    params: &AttnParams,
) -> Result<Vec<f64>, AlgoError> {
    let n = meta.seq_lens_kv.len();
    if meta
        .cu_seqlens_q
        .iter()
        .enumerate()
        .any(|(i, &c)| c != i as i32)
    {
        return Err(AlgoError::Invalid(
            "output_error needs a decode batch (one query per sequence)".to_owned(),
        ));
    }
    let lens: Vec<usize> = meta
        .seq_lens_kv
        .iter()
        .map(|&l| usize::try_from(l).map_err(|_| AlgoError::Invalid(format!("KV length {l}"))))
        .collect::<Result<_, _>>()?;
    crate::error::check_len("selection rows", sel.lens.len(), &[n, sel.kv_heads])?;
    check_ids(sel, &lens)?;
    let tokens = sel.to_tokens(&lens);
    let len = q.len();
    let (mut dense, mut sparse) = (vec![0.0f32; len], vec![0.0f32; len]);
    paged_attention(
        q,
        kv,
        meta,
        params,
        AttnOut {
            out: &mut dense,
            lse: None,
        },
    )?;
    token_sparse_attention(
        q,
        kv,
        meta,
        &tokens.as_selection(),
        params,
        AttnOut {
            out: &mut sparse,
            lse: None,
        },
    )?;
    let d = len / (n * params.q_heads).max(1);
    Ok(dense
        .chunks_exact(d.max(1))
        .zip(sparse.chunks_exact(d.max(1)))
        .map(|(a, b)| {
            let diff: f64 = a
                .iter()
                .zip(b)
                .map(|(&x, &y)| f64::from(x - y).powi(2))
                .sum();
            let norm: f64 = a.iter().map(|&x| f64::from(x).powi(2)).sum();
            (diff / norm.max(f64::MIN_POSITIVE)).sqrt()
        })
        .collect())
}

/// The mean of a metric's values (0 for none).
pub fn mean(values: &[f64]) -> f64 {
    if values.is_empty() {
        0.0
    } else {
        values.iter().sum::<f64>() / values.len() as f64
    }
}

/// Checks a selection against a decode step's shapes.
fn check_sel(step: &Decode<'_>, sel: &TopK) -> Result<(), AlgoError> {
    if sel.kv_heads != step.kv_heads {
        return Err(AlgoError::Invalid(format!(
            "selection has {} KV heads, the step {}",
            sel.kv_heads, step.kv_heads
        )));
    }
    crate::error::check_len(
        "selection rows",
        sel.lens.len(),
        &[step.num_seqs(), step.kv_heads],
    )?;
    check_ids(sel, step.seq_lens)
}

/// Checks that every id of a selection lies inside its sequence.
fn check_ids(sel: &TopK, seq_lens: &[usize]) -> Result<(), AlgoError> {
    if sel.page_size == 0 || sel.kv_heads == 0 {
        return Err(AlgoError::Invalid(
            "selection with page size or KV heads 0".to_owned(),
        ));
    }
    crate::error::check_len(
        "selection ids",
        sel.ids.len(),
        &[sel.lens.len(), sel.max_len],
    )?;
    for r in 0..sel.lens.len() {
        let len = sel.lens[r];
        if len < 0 || len as usize > sel.max_len {
            return Err(AlgoError::Invalid(format!(
                "selection row {r}: length {len}"
            )));
        }
        let pages = seq_lens[r / sel.kv_heads].div_ceil(sel.page_size);
        let row = sel.row(r / sel.kv_heads, r % sel.kv_heads);
        if let Some(&bad) = row.iter().find(|&&p| p < 0 || p as usize >= pages) {
            return Err(AlgoError::Invalid(format!(
                "selection row {r}: id {bad} outside the sequence's {pages} pages"
            )));
        }
        if row.windows(2).any(|w| w[0] >= w[1]) {
            return Err(AlgoError::Invalid(format!(
                "selection row {r} is not strictly ascending"
            )));
        }
    }
    Ok(())
}
