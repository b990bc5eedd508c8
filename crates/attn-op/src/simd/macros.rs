//! The loops every SIMD build shares, as macros each build expands with its own vector type
//! and intrinsics: Q·K over a block of keys (`qk_block`) and the chunked P·V (`chunk_axpy`).

/// The Q·K of one SIMD build over a block of keys, inside its module (`$w` f32 lanes of vector
/// type `$v`; the build's intrinsics and widening load `$load`; the module's `load_pair` from
/// [`chunk_axpy`]; `$few`, the most keys whose widened pairs stay in registers with the
/// block's accumulators). `block_dots` adds `q_r · key_t` to accumulator `[r][t]`: `2 * $w`
/// elements a step in `load_pair`'s order (so the rows in [`pair_order`](super::pair_order) for bf16 keys), each
/// accumulator its key's first vector, then its second; then one vector where one is left.
/// Per-key dot products (`dot_rows`) and the chunk kernels (`qk_chunk`) both go through it, so
/// their sums are the same bits.
macro_rules! qk_block {
    ($w:literal, $v:ty, $zero:ident, $fma:ident, $ldu:ident, $load:ident, $few:literal) => {
        #[doc = concat!("Adds each key's dot products with the `R` rows of `q` (`n` f32 each) to ")]
        #[doc = concat!("`acc`, over the elements whole vectors of ", $w, " cover; returns where ")]
        #[doc = "they end."]
        ///
        /// # Safety
        /// The CPU must support the build; `q` must hold `R` rows of `n` floats and each of the
        /// `B` keys `n` elements of `dtype`.
        #[inline(always)]
        unsafe fn block_dots<const R: usize, const B: usize, const N: usize>(
            (q, n): (*const f32, usize),
            (keys, dtype): (&[*const u8], DType),
            acc: &mut [[$v; B]; R],
        ) -> usize {
            debug_assert!(keys.len() == B && (N == 0 || N == n));
            let n = if N == 0 { n } else { N };
            let mut i = 0;
            while i + 2 * $w <= n {
                // SAFETY: `i + 2 * $w <= n`: within every key and each of the `R` rows of `q`.
                unsafe {
                    if B <= $few {
                        // Every key's pair in registers, each query vector loaded once.
                        let mut ks = [($zero(), $zero()); B];
                        for (k, &key) in ks.iter_mut().zip(keys) {
                            *k = load_pair(key, dtype, i);
                        }
                        for (r, row) in acc.iter_mut().enumerate() {
                            let q0 = $ldu(q.add(r * n + i));
                            for (a, k) in row.iter_mut().zip(&ks) {
                                *a = $fma(q0, k.0, *a);
                            }
                            let q1 = $ldu(q.add(r * n + i + $w));
                            for (a, k) in row.iter_mut().zip(&ks) {
                                *a = $fma(q1, k.1, *a);
                            }
                        }
                    } else {
                        // Many keys (few rows): a key's pair at a time.
                        for (t, &key) in keys.iter().enumerate() {
                            let (k0, k1) = load_pair(key, dtype, i);
                            for (r, row) in acc.iter_mut().enumerate() {
                                row[t] = $fma($ldu(q.add(r * n + i)), k0, row[t]);
                                row[t] = $fma($ldu(q.add(r * n + i + $w)), k1, row[t]);
                            }
                        }
                    }
                }
                i += 2 * $w;
            }
            if i + $w <= n {
                for (t, &key) in keys.iter().enumerate() {
                    // SAFETY: `i + $w <= n`: within every key and each of the `R` rows of `q`.
                    unsafe {
                        let kv = $load(key, dtype, i);
                        for (r, row) in acc.iter_mut().enumerate() {
                            row[t] = $fma($ldu(q.add(r * n + i)), kv, row[t]);
                        }
                    }
                }
                i += $w;
            }
            i
        }
    };
}

/// The builds expand it by path (`super::qk_block`), as [`chunk_axpy`].
#[cfg(target_arch = "x86_64")]
pub(super) use qk_block;

/// The chunked PV step of one SIMD build, inside its module (`$feat`: its target features,
/// `$isa`: their names for the docs; `$w` f32 lanes of vector type `$v`; the build's
/// intrinsics, its widening load `$load` and the module's `in_order`; `$blocks` the function
/// that cuts rows into blocks whose accumulators its registers hold, and `[$r, ...]` the
/// block sizes above 1 that it yields): `load_pair` widens two
/// vectors' worth of a value, `axpy_rows_r` keeps two vectors of each of `R` rows in
/// registers over a chunk's tokens, and `axpy_rows` runs it over row blocks.
macro_rules! chunk_axpy {
    ($feat:literal, $isa:literal, $blocks:ident, [$($r:literal),+],
     [$(($fr:literal, $fd:path)),+],
     $w:literal, $v:ty, $zero:ident, $set1:ident, $fma:ident,
     $ldu:ident, $stu:ident, $add:ident, $load:ident,
     ($vi:ty, $ldi:ident, $andi:ident, $set1i:ident, $slli:ident, $cast:ident)) => {
        #[doc = concat!("Elements `i .. i + 2 * ", $w, "` of a buffer of `dtype`, widened to f32")]
        /// as two vectors: in order, except for bf16, whose even elements come first and odd
        /// ones second (one load whose 32-bit lanes each hold a pair, split by a shift and a
        /// mask); `in_order` puts sums of them back in order.
        ///
        /// # Safety
        #[doc = concat!("The CPU must support ", $isa, "; `p` must point at `i + 2 * ", $w, "`")]
        /// or more elements of `dtype`.
        #[inline(always)]
        unsafe fn load_pair(p: *const u8, dtype: DType, i: usize) -> ($v, $v) {
            // SAFETY: the caller's contract; unaligned loads.
            unsafe {
                if dtype == DType::BF16 {
                    let x = $ldi(p.cast::<u16>().add(i).cast::<$vi>());
                    let odd = $andi(x, $set1i(0xffff_0000_u32 as i32));
                    ($cast($slli::<16>(x)), $cast(odd))
                } else {
                    ($load(p, dtype, i), $load(p, dtype, i + $w))
                }
            }
        }

        /// Adds each value of `vs`, the `j`-th weighted by `w[r * stride + j]`, to the sums
        /// `(a0, a1)` of row `r` (the two vectors from element `i`, in `load_pair`'s order),
        /// token by token in order; tokens go `G` a loop step.
        ///
        /// # Safety
        /// Every value of `vs` must hold the two vectors from element `i` of `T`, and `w`
        /// rows `R` of `stride >= vs.len()` weights.
        #[inline(always)]
        unsafe fn weigh<T: Element, const R: usize, const G: usize>(
            vs: &[*const u8],
            (w, stride): (*const f32, usize),
            i: usize,
            (a0, a1): (&mut [$v; R], &mut [$v; R]),
        ) {
            // Tokens `G` at a time (one loop step for all), then the rest, each row's sums
            // token by token in order.
            let mut groups = vs.chunks_exact(G);
            let mut j = 0;
            for group in groups.by_ref() {
                for (t, &v) in group.iter().enumerate() {
                    // SAFETY: the caller's contract, for value `j + t`.
                    unsafe { weigh_one::<T, R>(v, (w.add(j + t), stride), i, (a0, a1)) };
                }
                j += G;
            }
            for (t, &v) in groups.remainder().iter().enumerate() {
                // SAFETY: as above.
                unsafe { weigh_one::<T, R>(v, (w.add(j + t), stride), i, (a0, a1)) };
            }
        }

        /// Adds value `v`, weighted by `w[r * stride]` in row `r`, to the sums `(a0, a1)` of
        /// the `R` rows (the two vectors from element `i`, in `load_pair`'s order).
        ///
        /// # Safety
        /// `v` must hold the two vectors from element `i` of `T`, and `w` rows `R` of
        /// `stride` weights.
        #[inline(always)]
        unsafe fn weigh_one<T: Element, const R: usize>(
            v: *const u8,
            (w, stride): (*const f32, usize),
            i: usize,
            (a0, a1): (&mut [$v; R], &mut [$v; R]),
        ) {
            // SAFETY: the caller's contract.
            unsafe {
                let (v0, v1) = load_pair(v, T::DTYPE, i);
                for r in 0..R {
                    let wr = $set1(*w.add(r * stride));
                    a0[r] = $fma(wr, v0, a0[r]);
                    a1[r] = $fma(wr, v1, a1[r]);
                }
            }
        }

        /// Adds each chunk value's weighted rows to `acc` (`R` rows of `n`), two vectors of
        /// each row at a time; `N` and `S` are `n` and `stride` where they are constants, else
        /// 0 (the arguments then).
        ///
        #[doc = concat!("# Safety\nThe CPU must support ", $isa, "; `acc` must hold `R * n` f32, ")]
        #[doc = "`w` rows `R` of `stride >= vs.len()` weights (the `j`-th value's in column `j`),"]
        #[doc = "and each value of `vs` `n` elements of `T`."]
        #[target_feature(enable = $feat)]
        unsafe fn axpy_rows_r<T: Element, const R: usize, const N: usize, const S: usize>(
            acc: *mut f32,
            n: usize,
            (w, stride): (*const f32, usize),
            vs: &[*const u8],
            ahead: &super::Ahead<'_>,
        ) {
            debug_assert!((N == 0 || N == n) && (S == 0 || S == stride));
            let (n, stride) = (if N == 0 { n } else { N }, if S == 0 { stride } else { S });
            let dtype = T::DTYPE;
            let per = super::Ahead::per_step(n / (2 * $w));
            // Two vectors of each row at a time, summed over the tokens in registers.
            let mut i = 0;
            while i + 2 * $w <= n {
                let mut a0 = [$zero(); R];
                let mut a1 = [$zero(); R];
                ahead.part(i / (2 * $w), per, n * size_of::<T>());
                // A full chunk's 16 tokens go eight a loop step, a slice of constant length
                // (two steps, no count to keep); 16 a step spilled registers. Fewer go two a
                // step. The sums are the same.
                // SAFETY: the caller's contract.
                unsafe {
                    if let Some(all) = vs.first_chunk::<16>() {
                        weigh::<T, R, 8>(all, (w, stride), i, (&mut a0, &mut a1));
                    } else {
                        weigh::<T, R, 2>(vs, (w, stride), i, (&mut a0, &mut a1));
                    }
                }
                for r in 0..R {
                    let (x0, x1) = in_order(dtype, a0[r], a1[r]);
                    // SAFETY: `i + 2 * $w <= n`: within row `r` of `acc`.
                    unsafe {
                        let p = acc.add(r * n + i);
                        $stu(p, $add($ldu(p), x0));
                        $stu(p.add($w), $add($ldu(p.add($w)), x1));
                    }
                }
                i += 2 * $w;
            }
            for j in i..n {
                for r in 0..R {
                    let mut x = 0.0f32;
                    for (t, &v) in vs.iter().enumerate() {
                        // SAFETY: `j < n`, `r < R`, `t < stride`.
                        x += unsafe {
                            *w.add(r * stride + t) * super::load_one(v, dtype, j)
                        };
                    }
                    // SAFETY: `j < n`, `r < R`.
                    unsafe { *acc.add(r * n + j) += x };
                }
            }
        }

        /// # Safety
        /// As `axpy_rows_r`, for `rows` rows.
        #[target_feature(enable = $feat)]
        pub(super) unsafe fn axpy_rows<T: Element>(
            acc: *mut f32,
            n: usize,
            (w, stride): (*const f32, usize),
            vs: &[*const u8],
            rows: usize,
            ahead: &super::Ahead<'_>,
        ) {
            super::$blocks(rows, |r, block| {
                let ahead = ahead.for_rows_from(r);
                // SAFETY: rows `r..r + block` are within the `rows` rows of the caller's
                // contract.
                unsafe {
                    let (acc, w) = (acc.add(r * n), (w.add(r * stride), stride));
                    // The weights' stride is a constant too where it is the kernel's (16).
                    match (block, n, stride) {
                        $(($fr, $fd, 16) => {
                            axpy_rows_r::<T, $fr, { $fd }, 16>(acc, n, w, vs, ahead);
                        })+
                        $(($r, _, _) => axpy_rows_r::<T, $r, 0, 0>(acc, n, w, vs, ahead),)+
                        _ => axpy_rows_r::<T, 1, 0, 0>(acc, n, w, vs, ahead),
                    }
                }
            });
        }
    };
}

/// The builds expand it by path (`super::chunk_axpy`), so their modules may be declared first.
#[cfg(target_arch = "x86_64")]
pub(super) use chunk_axpy;
