//! Element types of the KV cache and queries: f32, f16 and bf16, all computed in f32.

use half::slice::HalfFloatSliceExt;
use half::{bf16, f16};

/// The element types attention reads. Arithmetic always happens in f32; an element only says
/// how it is stored and converted. The trait is sealed: f32, [`struct@f16`] and [`bf16`] are all.
pub trait Element:
    Copy + Send + Sync + Default + PartialEq + std::fmt::Debug + 'static + sealed::Sealed
{
    /// The runtime tag of the type.
    const DTYPE: DType;
    /// Widens one element.
    fn to_f32(self) -> f32;
    /// Narrows one value (round to nearest even).
    fn from_f32(x: f32) -> Self;
    /// Widens a slice into `dst` (same length); uses SIMD conversions where the CPU has them.
    fn slice_to_f32(src: &[Self], dst: &mut [f32]);
    /// `n` zeros, from zeroed memory: the allocator's fresh pages stay unmapped (not resident)
    /// until written, so capacity that is never used costs no memory. `None` where the
    /// allocator cannot give `n` elements (or their bytes overflow `isize`), instead of the
    /// process's abort that `vec!` would take.
    fn zeros(n: usize) -> Option<Vec<Self>>;
}

/// A runtime tag for an [`Element`] type.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum DType {
    /// IEEE single precision.
    F32,
    /// IEEE half precision.
    F16,
    /// bfloat16.
    BF16,
}

impl DType {
    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            DType::F32 => 4,
            DType::F16 | DType::BF16 => 2,
        }
    }

    /// Unit roundoff of the storage type: half the distance from 1.0 to the next value.
    pub fn epsilon(self) -> f64 {
        match self {
            DType::F32 => f64::from(f32::EPSILON) / 2.0,
            DType::F16 => 2f64.powi(-11),
            DType::BF16 => 2f64.powi(-8),
        }
    }
}

impl Element for f32 {
    const DTYPE: DType = DType::F32;
    fn to_f32(self) -> f32 {
        self
    }
    fn from_f32(x: f32) -> Self {
        x
    }
    #[inline(always)]
    fn slice_to_f32(src: &[Self], dst: &mut [f32]) {
        dst.copy_from_slice(src);
    }
    fn zeros(n: usize) -> Option<Vec<Self>> {
        zeroed(n)
    }
}

impl Element for f16 {
    const DTYPE: DType = DType::F16;
    fn to_f32(self) -> f32 {
        f16::to_f32(self)
    }
    fn from_f32(x: f32) -> Self {
        f16::from_f32(x)
    }
    #[inline(always)]
    fn slice_to_f32(src: &[Self], dst: &mut [f32]) {
        #[cfg(target_arch = "x86_64")]
        if std::is_x86_feature_detected!("f16c") {
            // SAFETY: the CPU has F16C (and so AVX), checked just above.
            unsafe { f16c_to_f32(src, dst) };
            return;
        }
        src.convert_to_f32_slice(dst);
    }
    fn zeros(n: usize) -> Option<Vec<Self>> {
        zeroed(n)
    }
}

impl Element for bf16 {
    const DTYPE: DType = DType::BF16;
    fn to_f32(self) -> f32 {
        bf16::to_f32(self)
    }
    fn from_f32(x: f32) -> Self {
        bf16::from_f32(x)
    }
    #[inline(always)]
    fn slice_to_f32(src: &[Self], dst: &mut [f32]) {
        // bf16 is the top half of an f32: a shift the compiler vectorizes.
        for (d, s) in dst.iter_mut().zip(src) {
            *d = f32::from_bits(u32::from(s.to_bits()) << 16);
        }
    }
    fn zeros(n: usize) -> Option<Vec<Self>> {
        zeroed(n)
    }
}

/// `dst[i] = src[i]` as f32 through F16C, eight at a time: `half`'s own slice conversion made
/// sparse-algo's scoring of f16 bounds slower than of f32 ones (7.6 against 7.0 ms for Quest
/// at 128K; 5.7 with this).
///
/// # Safety
/// The CPU must support AVX and F16C.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx,f16c")]
unsafe fn f16c_to_f32(src: &[f16], dst: &mut [f32]) {
    use std::arch::x86_64::{__m128i, _mm_loadu_si128, _mm256_cvtph_ps, _mm256_storeu_ps};
    assert_eq!(src.len(), dst.len(), "slice_to_f32: slices of one length");
    let n = src.len();
    let mut i = 0;
    while i + 8 <= n {
        // SAFETY: `i + 8 <= n`: 8 halves readable at `src[i..]` and 8 floats writable at
        // `dst[i..]`; unaligned loads and stores.
        unsafe {
            let h = _mm_loadu_si128(src.as_ptr().add(i).cast::<__m128i>());
            _mm256_storeu_ps(dst.as_mut_ptr().add(i), _mm256_cvtph_ps(h));
        }
        i += 8;
    }
    for (d, s) in dst[i..].iter_mut().zip(&src[i..]) {
        *d = s.to_f32();
    }
}

/// `n` elements of all-zero bits from the allocator's zeroed memory (`calloc`, whose fresh pages
/// stay unmapped until written), or `None` where the allocator cannot give them or their bytes
/// overflow `isize`.
fn zeroed<T: Element>(n: usize) -> Option<Vec<T>> {
    let layout = std::alloc::Layout::array::<T>(n).ok()?;
    if layout.size() == 0 {
        return Some(Vec::new());
    }
    // SAFETY: the layout's size is not zero, as `alloc_zeroed` requires.
    let ptr = unsafe { std::alloc::alloc_zeroed(layout) }.cast::<T>();
    if ptr.is_null() {
        return None;
    }
    // SAFETY: `ptr` comes from the global allocator with the layout of `n` elements of `T`
    // (so with `T`'s alignment and `n * size_of::<T>()` bytes), and every byte is zero. The
    // trait is sealed over f32, f16 and bf16, plain bits in which all zeros is +0.0, so all `n`
    // elements are initialized; the vector owns the allocation from here on.
    Some(unsafe { Vec::from_raw_parts(ptr, n, n) })
}

mod sealed {
    /// Keeps [`Element`](super::Element) closed, so that `DTYPE` identifies the type (the SIMD
    /// widening relies on it).
    pub trait Sealed {}
    impl Sealed for f32 {}
    impl Sealed for half::f16 {}
    impl Sealed for half::bf16 {}
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every f16 bit pattern (NaNs included, compared by bits) widens through the slice
    /// conversion as it does one at a time, over lengths that leave a tail past the 8-wide
    /// steps.
    #[test]
    fn f16_slices_widen_as_single_values() {
        let all: Vec<f16> = (0..=u16::MAX).map(f16::from_bits).collect();
        for len in [all.len(), 8 * 1000 + 5, 7, 1, 0] {
            let src = &all[all.len() - len..];
            let mut dst = vec![0.0f32; len];
            f16::slice_to_f32(src, &mut dst);
            for (x, y) in src.iter().zip(&dst) {
                assert_eq!(
                    y.to_bits(),
                    x.to_f32().to_bits(),
                    "{:#06x} over {len}",
                    x.to_bits()
                );
            }
        }
    }
}
