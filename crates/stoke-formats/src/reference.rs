//! Plain f64 references for Stoke's kernels.

/// RMSNorm of each row: `x * 1/sqrt(mean(x^2) + eps) * gamma`, all in f64.
/// `x` is `[rows, hidden]` row-major, `gamma` is `[hidden]`.
pub fn rms_norm(x: &[f64], gamma: &[f64], hidden: usize, eps: f64) -> Vec<f64> {
    assert_eq!(gamma.len(), hidden, "gamma length");
    assert_eq!(x.len() % hidden, 0, "x is not a whole number of rows");
    let mut out = Vec::with_capacity(x.len());
    for row in x.chunks_exact(hidden) {
        let mean_sq = row.iter().map(|v| v * v).sum::<f64>() / hidden as f64;
        let inv = 1.0 / (mean_sq + eps).sqrt();
        out.extend(row.iter().zip(gamma).map(|(v, g)| v * inv * g));
    }
    out
}

/// `‖a − b‖₂ / ‖b‖₂`, the relative error of `a` against the reference `b`.
pub fn relative_error(a: &[f64], b: &[f64]) -> f64 {
    assert_eq!(a.len(), b.len());
    let num: f64 = a.iter().zip(b).map(|(x, y)| (x - y) * (x - y)).sum();
    let den: f64 = b.iter().map(|y| y * y).sum();
    (num / den.max(f64::MIN_POSITIVE)).sqrt()
}

/// Largest `|a − b| / (atol + rtol·|b|)`; at most 1 means every element is within tolerance.
pub fn max_tolerance_ratio(a: &[f64], b: &[f64], atol: f64, rtol: f64) -> f64 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| {
            if x.is_nan() || y.is_nan() {
                f64::INFINITY
            } else {
                (x - y).abs() / (atol + rtol * y.abs())
            }
        })
        .fold(0.0, f64::max)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rms_norm_of_constant_row_is_gamma() {
        let out = rms_norm(&[3.0, 3.0, -3.0, 3.0], &[1.0, 2.0, 3.0, 4.0], 4, 0.0);
        assert_eq!(out, vec![1.0, 2.0, -3.0, 4.0]);
    }

    #[test]
    fn relative_error_is_scale_free() {
        let b = [1.0, 2.0, 3.0];
        let a = [1.1, 2.2, 3.3];
        assert!((relative_error(&a, &b) - 0.1).abs() < 1e-12);
    }

    #[test]
    fn nan_is_never_within_tolerance() {
        assert!(max_tolerance_ratio(&[f64::NAN], &[1.0], 1.0, 1.0).is_infinite());
    }
}
