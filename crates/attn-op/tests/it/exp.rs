//! `exp_nonpositive`: close to `exp`, and its edges.

use attn_op::exp_nonpositive;

use crate::oracle::Rng;

/// Within 2 ulp of f64's `exp` over `[-87.3, 0]` (a sweep at even steps, then random points),
/// 1 at 0, 0 below the range and at -inf, NaN for NaN.
#[test]
fn the_fixed_exponential_is_within_two_ulp() {
    let mut rng = Rng::new(0x51f1_5eed);
    for i in 0..200_000 {
        let x = if i < 1000 {
            -(i as f32) * 0.0873
        } else {
            -87.3 * (rng.unit() * 0.5 + 0.5)
        };
        let want = f64::from(x).exp();
        let got = f64::from(exp_nonpositive(x));
        let ulp = f64::from(f32::EPSILON) * want;
        assert!(
            (got - want).abs() <= 2.0 * ulp,
            "exp({x}): {got} against {want}"
        );
    }
    assert_eq!(exp_nonpositive(0.0), 1.0);
    assert_eq!(exp_nonpositive(-87.4), 0.0);
    assert_eq!(exp_nonpositive(f32::NEG_INFINITY), 0.0);
    assert!(exp_nonpositive(f32::NAN).is_nan());
}
