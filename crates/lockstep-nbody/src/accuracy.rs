//! Accuracy of approximate forces against a reference (docs/nbody.md, "Forces"): per-particle
//! relative errors `|a - a_ref| / |a_ref|` and `|phi - phi_ref| / |phi_ref|`, summarised by
//! percentiles.

use crate::Forces;

/// Percentiles of a relative error distribution.
#[derive(Debug, Clone, Copy, Default, PartialEq, serde::Serialize)]
pub struct ErrorPercentiles {
    /// Median.
    pub p50: f64,
    /// 90th percentile.
    pub p90: f64,
    /// 99th percentile.
    pub p99: f64,
    /// 99.9th percentile.
    pub p999: f64,
    /// Largest error.
    pub max: f64,
}

/// Relative acceleration and potential errors of one force evaluation.
#[derive(Debug, Clone, Copy, Default, PartialEq, serde::Serialize)]
pub struct Accuracy {
    /// `|a - a_ref| / |a_ref|` percentiles.
    pub acc: ErrorPercentiles,
    /// `|phi - phi_ref| / |phi_ref|` percentiles.
    pub pot: ErrorPercentiles,
}

/// Percentiles (nearest rank) of `v`; NaN is treated as the largest value.
pub fn percentiles(mut v: Vec<f64>) -> ErrorPercentiles {
    if v.is_empty() {
        return ErrorPercentiles::default();
    }
    v.sort_by(|a, b| a.total_cmp(b));
    let q = |f: f64| {
        let k = ((f * v.len() as f64).ceil() as usize).clamp(1, v.len()) - 1;
        v[k]
    };
    ErrorPercentiles {
        p50: q(0.5),
        p90: q(0.9),
        p99: q(0.99),
        p999: q(0.999),
        max: v[v.len() - 1],
    }
}

/// Compares `approx` with `reference` particle by particle (same order and length; only
/// the common prefix is compared). Particles with a zero reference value are skipped.
pub fn compare(approx: &Forces, reference: &Forces) -> Accuracy {
    let n = approx.acc.len().min(reference.acc.len());
    let mut ea = Vec::with_capacity(n);
    let mut ep = Vec::with_capacity(n);
    for i in 0..n {
        let a = approx.acc[i];
        let r = reference.acc[i];
        let rn = (r[0] * r[0] + r[1] * r[1] + r[2] * r[2]).sqrt();
        if rn > 0.0 {
            let d = ((a[0] - r[0]).powi(2) + (a[1] - r[1]).powi(2) + (a[2] - r[2]).powi(2)).sqrt();
            ea.push(if d.is_nan() { f64::INFINITY } else { d / rn });
        }
        let pr = reference.pot[i];
        if pr != 0.0 {
            let d = (approx.pot[i] - pr).abs();
            ep.push(if d.is_nan() {
                f64::INFINITY
            } else {
                d / pr.abs()
            });
        }
    }
    Accuracy {
        acc: percentiles(ea),
        pot: percentiles(ep),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentiles_nearest_rank() {
        let p = percentiles((1..=1000).map(|i| i as f64).collect());
        assert_eq!(p.p50, 500.0);
        assert_eq!(p.p90, 900.0);
        assert_eq!(p.p99, 990.0);
        assert_eq!(p.p999, 999.0);
        assert_eq!(p.max, 1000.0);
    }
}
