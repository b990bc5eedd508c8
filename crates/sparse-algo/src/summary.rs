//! How Quest stores a page's `[kmax ‖ kmin]`: exactly, or in 8 bits a value (FP8 E4M3) with one
//! power-of-two scale per (page, KV head), each bound rounded outward so it still bounds every
//! key of the page.
//!
//! A page's summary is metadata the device reads on every decode step: in 16-bit elements it is
//! an eighth of the page's keys, and Quest's scoring streams all of it. [`Summary::E4m3`] halves
//! both the memory and the bytes scored. Rounding `kmax` up and `kmin` down keeps Quest's
//! guarantee: for every query, `sum_d max(q_d kmin'_d, q_d kmax'_d)` with the rounded bounds is
//! at least the exact bound, hence at least `q · k` for every key of the page. Only the
//! ranking between pages loosens.
//!
//! The format: for a (page, KV head) whose finite bounds reach `amax` in magnitude, the scale
//! is `2^e` with `e` the smallest integer such that `amax <= 448 * 2^e` (clamped to
//! [`SCALE_EXP_MIN`]..=[`SCALE_EXP_MAX`]; 0 for an all-zero row). Each bound `x` is stored as
//! the E4M3 value `y` (OCP FP8, the `fn` variant: 3 mantissa bits, exponent bias 7, largest
//! finite 448, subnormals down to `2^-9`) next to `x / 2^e` in its direction: the least `y >=
//! x / 2^e` for `kmax`, the greatest `y <= x / 2^e` for `kmin`. The representation pool keeps
//! the values `y * 2^e` as f32 (exact), so scoring is unchanged; [`encode_row`] gives a row's
//! codes and exponent, as a device pool stores them. A non-finite bound (a page of NaN keys)
//! becomes `±448 * 2^e` and bounds nothing.

use serde::{Deserialize, Serialize};

/// How Quest stores its per-page bounds.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Summary {
    /// The keys' own minimum and maximum (exact in f32 for f32, f16 and bf16 keys).
    #[default]
    Exact,
    /// FP8 E4M3 bounds rounded outward, with a power-of-two scale per (page, KV head).
    E4m3,
}

/// The largest finite E4M3 value.
pub const E4M3_MAX: f32 = 448.0;
/// The smallest scale exponent a (page, KV head) takes.
pub const SCALE_EXP_MIN: i32 = -64;
/// The largest scale exponent a (page, KV head) takes.
pub const SCALE_EXP_MAX: i32 = 63;

/// `2^e` for `e` in -126..=127, exactly.
fn pow2(e: i32) -> f32 {
    debug_assert!((-126..=127).contains(&e), "2^{e} is not a normal f32");
    f32::from_bits(((e + 127) as u32) << 23)
}

/// The scale exponent of a row of bounds: the smallest `e` in the clamp range with every
/// finite `|x| <= 448 * 2^e`, or 0 where the row has no finite nonzero value.
pub fn scale_exp(row: &[f32]) -> i32 {
    let amax = row
        .iter()
        .filter(|x| x.is_finite())
        .fold(0.0f32, |m, x| m.max(x.abs()));
    if amax == 0.0 {
        return 0;
    }
    // floor(log2(amax)) from the bits (subnormal amax: below every clamp anyway).
    let k = ((amax.to_bits() >> 23) & 0xff) as i32 - 127;
    // 448 * 2^(k - 8) = 1.75 * 2^k: amax in [2^k, 2^(k+1)) needs e = k - 8 or k - 7.
    let mut e = k - 8;
    if (SCALE_EXP_MIN..=SCALE_EXP_MAX).contains(&e) && amax > E4M3_MAX * pow2(e) {
        e += 1;
    }
    e.clamp(SCALE_EXP_MIN, SCALE_EXP_MAX)
}

/// The E4M3 value next to `y` (|y| <= 448) away from zero (`up` for y >= 0 and `!up` for y < 0)
/// or toward zero otherwise: rounds `y` up where `up`, down where not.
fn round_dir(y: f32, up: bool) -> f32 {
    if y.is_nan() {
        return if up { E4M3_MAX } else { -E4M3_MAX };
    }
    let a = y.abs();
    if a >= E4M3_MAX {
        return E4M3_MAX.copysign(y);
    }
    let away = up == (y >= 0.0);
    // The spacing of E4M3 values at |y|: 2^-9 below 2^-6 (subnormals), 2^(k-3) in [2^k, 2^(k+1)).
    let k = ((a.to_bits() >> 23) & 0xff) as i32 - 127;
    let quantum = pow2(k.max(-6) - 3);
    let steps = a / quantum; // exact: a power-of-two divisor
    let m = if away { steps.ceil() } else { steps.floor() };
    let v = m * quantum; // exact: at most 16 steps of a power of two
    // +0 for a zero result, whatever the sign of y.
    if v == 0.0 { 0.0 } else { v.copysign(y) }
}

/// Rounds a page's `[kmax ‖ kmin]` row (`2 * d` values, one KV head) outward to E4M3 with its
/// scale in place (`kmax` up, `kmin` down); returns the scale exponent.
pub(crate) fn round_row(row: &mut [f32]) -> i32 {
    let e = scale_exp(row);
    let (s, inv, d) = (pow2(e), pow2(-e), row.len() / 2);
    for (i, x) in row.iter_mut().enumerate() {
        *x = round_dir(*x * inv, i < d) * s;
    }
    e
}

/// The value of E4M3 code `c` (0x7f and 0xff, NaN in the format, are never produced here).
pub fn e4m3_value(c: u8) -> f32 {
    let (e, m) = (i32::from((c >> 3) & 0xf), f32::from(c & 7));
    let v = if e == 0 {
        m * pow2(-9)
    } else {
        (1.0 + m / 8.0) * pow2(e - 7)
    };
    if c & 0x80 != 0 { -v } else { v }
}

/// The code of an E4M3 value (a value this module produced); 0 for either zero.
fn e4m3_code(v: f32) -> u8 {
    let a = v.abs();
    let sign = if v < 0.0 { 0x80 } else { 0 };
    if a < pow2(-6) {
        return if a == 0.0 {
            0
        } else {
            sign | (a * 512.0) as u8
        };
    }
    let k = ((a.to_bits() >> 23) & 0xff) as i32 - 127;
    let m = ((a / pow2(k) - 1.0) * 8.0) as u8;
    sign | (((k + 7) as u8) << 3) | m
}

/// A row as a device pool stores it: one E4M3 code per value and the row's scale exponent.
/// A row from the pool of a Quest with E4M3 summaries is already rounded (rounding it again
/// changes neither its values nor its scale); other values are rounded outward.
pub fn encode_row(row: &[f32], codes: &mut [u8]) -> i32 {
    let e = scale_exp(row);
    let (inv, d) = (pow2(-e), row.len() / 2);
    for (i, (c, &x)) in codes.iter_mut().zip(row).enumerate() {
        *c = e4m3_code(round_dir(x * inv, i < d));
    }
    e
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every finite E4M3 value, ascending.
    fn values() -> Vec<f32> {
        let mut v: Vec<f32> = (0u8..0x7f)
            .flat_map(|c| [e4m3_value(c), e4m3_value(c | 0x80)])
            .collect();
        v.sort_by(f32::total_cmp);
        v.dedup();
        v
    }

    fn check(y: f32) {
        let all = values();
        let up = all.iter().copied().find(|&v| v >= y).expect("y <= 448");
        let down = all
            .iter()
            .rev()
            .copied()
            .find(|&v| v <= y)
            .expect("y >= -448");
        assert_eq!(round_dir(y, true).to_bits(), (up + 0.0).to_bits(), "up {y}");
        assert_eq!(
            round_dir(y, false).to_bits(),
            (down + 0.0).to_bits(),
            "down {y}"
        );
        for v in [up, down] {
            assert_eq!(e4m3_value(e4m3_code(v)), v + 0.0, "code of {v}");
        }
    }

    #[test]
    fn directed_rounding_finds_the_nearest_value_in_its_direction() {
        let all = values();
        assert_eq!(all.len(), 253);
        for w in all.windows(2) {
            for y in [
                w[0],
                (w[0] + w[1]) / 2.0,
                w[1],
                w[0].next_up(),
                w[1].next_down(),
            ] {
                check(y);
            }
        }
        let mut next = crate::xorshift(0x9e37_79b9);
        for _ in 0..20_000 {
            let x = next();
            check((x as f32 / u32::MAX as f32 - 0.5) * 2.0 * 448.0 * (x % 7) as f32 / 6.0);
        }
    }

    #[test]
    fn a_rounded_row_encodes_to_its_own_values() {
        let mut next = crate::xorshift(0x2545_f491);
        for round in 0..200 {
            let row: Vec<f32> = (0..64)
                .map(|_| {
                    let x = next();
                    (x as f32 / u32::MAX as f32 - 0.5) * (1 << (round % 20)) as f32 / 64.0
                })
                .collect();
            let mut rounded = row.clone();
            let e = round_row(&mut rounded);
            let (mut codes, mut again) = (vec![0u8; 64], vec![0u8; 64]);
            assert_eq!(encode_row(&rounded, &mut codes), e);
            assert_eq!(encode_row(&row, &mut again), e);
            assert_eq!(
                codes, again,
                "round {round}: the row and its rounding encode alike"
            );
            for (&c, &v) in codes.iter().zip(&rounded) {
                assert_eq!(
                    (e4m3_value(c) * pow2(e)).to_bits(),
                    v.to_bits(),
                    "round {round}"
                );
            }
        }
    }

    #[test]
    fn the_scale_is_the_least_power_of_two_that_fits() {
        for amax in [1e-3f32, 0.5, 1.0, 3.0, 448.0, 449.0, 896.0, 897.0, 1e6] {
            let e = scale_exp(&[amax, -amax / 3.0]);
            assert!(amax <= E4M3_MAX * pow2(e), "{amax}: {e}");
            assert!(
                amax > E4M3_MAX * pow2(e - 1),
                "{amax}: {e} is not the least"
            );
        }
        assert_eq!(scale_exp(&[0.0, -0.0]), 0);
        assert_eq!(scale_exp(&[f32::INFINITY, 2.0]), scale_exp(&[2.0]));
        assert_eq!(scale_exp(&[1e-30]), SCALE_EXP_MIN);
    }
}
