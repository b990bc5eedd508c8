//! Weight matrices in their file encoding (quantized or float), and `x · Wᵀ` over them.
//!
//! A few rows (decode) run a fused kernel that reads the weights once, at their quantized
//! size: against quantized weights the rows are quantized to 8 bits and meet each weight
//! block in integer dot products (`qdot`, as ggml does); float weight rows are widened into
//! an L1-sized buffer and dotted with every input row. Many rows (prefill) dequantize a tile
//! of weight rows at a time and hand it to the `gemm` crate. Both are parallel over tiles of
//! output features with rayon and built for AVX-512F or AVX2 + FMA where the CPU has them.

use rayon::prelude::*;

use crate::EngineError;
use crate::gguf::{DType, Gguf, dequantize};

/// A weight matrix `[rows, cols]`: `rows` output features, each a row of `cols` inputs.
#[derive(Clone, Debug)]
pub struct Linear {
    dtype: DType,
    rows: usize,
    cols: usize,
    row_bytes: usize,
    data: Vec<u8>,
}

/// Output features per parallel task.
const TILE: usize = 64;
/// Input rows from which the `gemm` path runs.
const GEMM_ROWS: usize = 8;

impl Linear {
    /// The tensor `name`, which must be `[rows, cols]` (GGUF dims `[cols, rows]`).
    pub fn from_gguf(
        g: &Gguf,
        name: &str,
        rows: usize,
        cols: usize,
    ) -> Result<Linear, EngineError> {
        let t = g.tensor(name)?;
        if t.dims != [cols, rows] {
            return Err(EngineError::Malformed(format!(
                "{name}: dimensions {:?}, expected [{cols}, {rows}]",
                t.dims
            )));
        }
        Linear::from_raw(t.dtype, rows, cols, g.raw(name)?.to_vec())
    }

    /// A matrix `[rows, cols]` of `dtype` from its raw bytes, row after row (each row whole
    /// blocks of `dtype`).
    pub fn from_raw(
        dtype: DType,
        rows: usize,
        cols: usize,
        data: Vec<u8>,
    ) -> Result<Linear, EngineError> {
        let (per, bytes) = dtype.block();
        let row_bytes = cols / per * bytes;
        if rows == 0 || cols == 0 || !cols.is_multiple_of(per) || data.len() != rows * row_bytes {
            return Err(EngineError::Malformed(format!(
                "{} bytes of {dtype:?} for a [{rows}, {cols}] matrix",
                data.len()
            )));
        }
        Ok(Linear {
            dtype,
            rows,
            cols,
            row_bytes,
            data,
        })
    }

    /// Output features.
    pub fn rows(&self) -> usize {
        self.rows
    }

    /// Input features.
    pub fn cols(&self) -> usize {
        self.cols
    }

    /// Row `r` dequantized into `out` (`cols` elements); an embedding lookup.
    pub fn row(&self, r: usize, out: &mut [f32]) {
        let b = &self.data[r * self.row_bytes..(r + 1) * self.row_bytes];
        dequantize(self.dtype, b, &mut out[..self.cols]);
    }

    /// The whole matrix dequantized, `[rows, cols]` row-major (the GPU path's upload).
    #[cfg_attr(
        not(feature = "cuda"),
        allow(dead_code, reason = "only the GPU path uploads")
    )]
    pub(crate) fn to_f32(&self) -> Vec<f32> {
        let mut out = vec![0.0f32; self.rows * self.cols];
        out.par_chunks_mut(self.cols)
            .enumerate()
            .for_each(|(r, row)| self.row(r, row));
        out
    }

    /// The same matrix stored as the float type `dtype` (F32, F16 or BF16), each weight
    /// rounded once (to nearest even) from its exact value.
    pub fn to_float(&self, dtype: DType) -> Result<Linear, EngineError> {
        let data = float_bytes(&self.to_f32(), dtype)?;
        Linear::from_raw(dtype, self.rows, self.cols, data)
    }

    /// `out [n, rows] = x [n, cols] · Wᵀ` (nothing when `n` is 0).
    pub fn forward(&self, x: &[f32], n: usize, out: &mut [f32]) {
        self.forward_rounding(x, n, out, false);
    }

    /// [`Linear::forward`] as ggml rounds it (for [`crate::Model::like_llama_cpp`]): a
    /// quantized matrix meets its input rows quantized to 8 bits with ggml's rounding at every
    /// row count, [`MAX_ROWS`](crate::qdot::MAX_ROWS) rows at a time; a float matrix takes the
    /// usual path.
    pub(crate) fn forward_like_ggml(&self, x: &[f32], n: usize, out: &mut [f32]) {
        assert!(
            x.len() == n * self.cols && out.len() == n * self.rows,
            "Linear::forward_like_ggml: callers size x and out from the model's own shapes"
        );
        if !crate::qdot::supports(self.dtype) {
            return self.forward(x, n, out);
        }
        let rows = crate::qdot::MAX_ROWS;
        for (x, out) in x
            .chunks(rows * self.cols)
            .zip(out.chunks_mut(rows * self.rows))
        {
            self.forward_rounding(x, x.len() / self.cols, out, true);
        }
    }

    /// [`Linear::forward`], its 8-bit rows (fewer than [`GEMM_ROWS`]) rounded as ggml rounds
    /// them where `like_ggml`.
    fn forward_rounding(&self, x: &[f32], n: usize, out: &mut [f32], like_ggml: bool) {
        assert!(
            x.len() == n * self.cols && out.len() == n * self.rows,
            "Linear::forward: callers size x and out from the model's own shapes"
        );
        if n == 0 {
            return;
        }
        let isa = isa();
        // Quantized weights meet the few decode rows as 8-bit blocks, quantized once here.
        let q8 = (n < GEMM_ROWS && crate::qdot::supports(self.dtype))
            .then(|| crate::qdot::Q8Rows::new(x, n, self.cols, like_ggml));
        let q8 = q8.as_ref();
        let weights = |t: usize| {
            let r0 = t * TILE;
            let nr = TILE.min(self.rows - r0);
            (
                nr,
                &self.data[r0 * self.row_bytes..(r0 + nr) * self.row_bytes],
            )
        };
        if n == 1 {
            // One input row (decode): each tile's results are a contiguous run of `out`.
            out.par_chunks_mut(TILE)
                .enumerate()
                .for_each(|(t, dst)| tile_dot(isa, self, weights(t).1, x, q8, 1, dst));
            return;
        }
        // Per tile of output features, the results [n, TILE], then scattered into out.
        let mut tiles = vec![0.0f32; self.rows.div_ceil(TILE) * TILE * n];
        tiles
            .par_chunks_mut(TILE * n)
            .enumerate()
            .for_each(|(t, dst)| {
                let (nr, w) = weights(t);
                if n < GEMM_ROWS {
                    tile_dot(isa, self, w, x, q8, n, dst);
                } else {
                    tile_gemm(self, w, nr, x, n, dst);
                }
            });
        for (t, src) in tiles.chunks(TILE * n).enumerate() {
            let r0 = t * TILE;
            let nr = TILE.min(self.rows - r0);
            for i in 0..n {
                out[i * self.rows + r0..][..nr].copy_from_slice(&src[i * TILE..][..nr]);
            }
        }
    }
}

/// Dequantizes a tile and multiplies it with `gemm`: `dst [n, TILE]` (first `nr` columns).
fn tile_gemm(l: &Linear, w: &[u8], nr: usize, x: &[f32], n: usize, dst: &mut [f32]) {
    let mut buf = vec![0.0f32; nr * l.cols];
    for (r, out) in buf.chunks_exact_mut(l.cols).enumerate() {
        dequantize(l.dtype, &w[r * l.row_bytes..(r + 1) * l.row_bytes], out);
    }
    // dst[i][j] = Σ_k x[i][k] · buf[j][k]: lhs x (row stride cols), rhs bufᵀ (column stride
    // cols), dst row stride TILE.
    // SAFETY: every pointer comes from a live slice whose length covers the strided extent:
    // x holds n × cols, buf nr × cols, dst n × TILE with nr ≤ TILE; nothing aliases.
    unsafe {
        gemm::gemm(
            n,
            nr,
            l.cols,
            dst.as_mut_ptr(),
            1,
            TILE as isize,
            false,
            x.as_ptr(),
            1,
            l.cols as isize,
            buf.as_ptr(),
            l.cols as isize,
            1,
            0.0,
            1.0,
            false,
            false,
            false,
            gemm::Parallelism::None,
        );
    }
}

/// The fused decode kernel over one tile, in the widest build the CPU runs: `q8` holds the
/// input rows quantized when the weights are (integer dot products), else `x` is used.
fn tile_dot(
    isa: u8,
    l: &Linear,
    w: &[u8],
    x: &[f32],
    q8: Option<&crate::qdot::Q8Rows>,
    n: usize,
    dst: &mut [f32],
) {
    if let Some(q8) = q8 {
        #[cfg(target_arch = "x86_64")]
        if isa != PORTABLE {
            // SAFETY: `isa()` returned AVX2 or AVX512 only after detecting avx2, fma and
            // f16c; `q8` exists only for dtypes qdot supports, with the n rows of `x`; `dst`
            // holds n rows of TILE (n > 1) or the tile's rows (n = 1).
            unsafe { crate::qdot::tile_dot(l.dtype, w, l.row_bytes, q8, n, dst, TILE) };
            return;
        }
        return crate::qdot::tile_dot_portable(l.dtype, w, l.row_bytes, q8, n, dst, TILE);
    }
    #[cfg(target_arch = "x86_64")]
    {
        if isa == AVX512 {
            // SAFETY: `isa()` returned AVX512 only after detecting avx512f, avx2, fma and f16c.
            return unsafe { tile_dot_avx512(l, w, x, n, dst) };
        }
        if isa == AVX2 {
            // SAFETY: `isa()` returned AVX2 only after detecting avx2, fma and f16c.
            return unsafe { tile_dot_avx2(l, w, x, n, dst) };
        }
    }
    let _ = isa;
    tile_dot_impl::<false>(l, w, x, n, dst);
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx2,fma,f16c")]
fn tile_dot_avx512(l: &Linear, w: &[u8], x: &[f32], n: usize, dst: &mut [f32]) {
    tile_dot_impl::<true>(l, w, x, n, dst);
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
fn tile_dot_avx2(l: &Linear, w: &[u8], x: &[f32], n: usize, dst: &mut [f32]) {
    tile_dot_impl::<true>(l, w, x, n, dst);
}

/// Each weight row of the tile dequantized once, dotted with the `n` input rows.
#[inline(always)]
fn tile_dot_impl<const FMA: bool>(l: &Linear, w: &[u8], x: &[f32], n: usize, dst: &mut [f32]) {
    let mut buf = vec![0.0f32; l.cols];
    for (r, wr) in w.chunks_exact(l.row_bytes).enumerate() {
        dequantize(l.dtype, wr, &mut buf);
        for (i, xr) in x.chunks_exact(l.cols).enumerate().take(n) {
            dst[i * TILE + r] = dot::<FMA>(&buf, xr);
        }
    }
}

/// `a · b` with 16 independent accumulators (fused multiply-adds where the build has them).
#[inline(always)]
fn dot<const FMA: bool>(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0.0f32; 16];
    let (ca, cb) = (a.chunks_exact(16), b.chunks_exact(16));
    let tail: f32 = ca
        .remainder()
        .iter()
        .zip(cb.remainder())
        .map(|(x, y)| x * y)
        .sum();
    for (x, y) in ca.zip(cb) {
        for i in 0..16 {
            acc[i] = if FMA {
                x[i].mul_add(y[i], acc[i])
            } else {
                acc[i] + x[i] * y[i]
            };
        }
    }
    let mut s = 0.0;
    for h in 0..8 {
        s += acc[h] + acc[h + 8];
    }
    s + tail
}

const PORTABLE: u8 = 0;
const AVX2: u8 = 1;
const AVX512: u8 = 2;

/// The widest build this CPU runs.
fn isa() -> u8 {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::is_x86_feature_detected as has;
        if has!("avx2") && has!("fma") && has!("f16c") {
            return if has!("avx512f") { AVX512 } else { AVX2 };
        }
    }
    PORTABLE
}

/// `values` stored as the float type `dtype` (F32, F16 or BF16; little-endian), each rounded
/// once to nearest even; other types are refused.
pub(crate) fn float_bytes(values: &[f32], dtype: DType) -> Result<Vec<u8>, EngineError> {
    Ok(match dtype {
        DType::F32 => values.iter().flat_map(|x| x.to_le_bytes()).collect(),
        DType::F16 => values
            .iter()
            .flat_map(|&x| half::f16::from_f32(x).to_le_bytes())
            .collect(),
        DType::BF16 => values
            .iter()
            .flat_map(|&x| half::bf16::from_f32(x).to_le_bytes())
            .collect(),
        other => {
            return Err(EngineError::Invalid(format!(
                "{other:?} is not a float type to store values in"
            )));
        }
    })
}
