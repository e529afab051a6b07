//! The GW chirp task against LALSuite: TaylorF2 polarizations (mismatch < 1e-6, noise-weighted
//! with the task's design PSD, no maximization over time or phase), antenna patterns and
//! arrival-time offsets, from values stored by `scripts/taylorf2_lal_reference.py` (so the
//! test needs no LALSuite).

use lockstep_npe::gw::{design_psd, taylor_f2, Detector, GwChirp, H1, L1};
use serde_json::Value;

fn reference() -> Value {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/data/taylorf2_lal.json");
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

fn floats(v: &Value) -> Vec<f64> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_f64().unwrap())
        .collect()
}

/// `1 - Re<a, b> / sqrt(<a, a><b, b>)` with `<a, b> = Σ a b* / S(f)`.
fn mismatch(freqs: &[f64], a: &[[f64; 2]], b: &[[f64; 2]]) -> f64 {
    let (mut ab, mut aa, mut bb) = (0.0, 0.0, 0.0);
    for ((f, x), y) in freqs.iter().zip(a).zip(b) {
        let w = 1.0 / design_psd(*f);
        ab += w * (x[0] * y[0] + x[1] * y[1]);
        aa += w * (x[0] * x[0] + x[1] * x[1]);
        bb += w * (y[0] * y[0] + y[1] * y[1]);
    }
    1.0 - ab / (aa * bb).sqrt()
}

#[test]
fn taylor_f2_matches_lalsimulation() {
    let r = reference();
    let task = GwChirp {
        f_min: r["f_min"].as_f64().unwrap(),
        f_max: r["f_max"].as_f64().unwrap(),
        delta_f: r["delta_f"].as_f64().unwrap(),
        ..GwChirp::default()
    };
    let freqs = task.frequencies();
    for case in r["cases"].as_array().unwrap() {
        let g = |k: &str| case[k].as_f64().unwrap();
        let h = taylor_f2(
            &freqs,
            g("m1"),
            g("m2"),
            g("distance_mpc"),
            g("inclination"),
            g("phi_c"),
        );
        for (pol, name) in ["hp", "hc"].iter().enumerate() {
            let (re, im) = (
                floats(&case[format!("{name}_re")]),
                floats(&case[format!("{name}_im")]),
            );
            assert_eq!(re.len(), freqs.len());
            let lal: Vec<[f64; 2]> = re.iter().zip(&im).map(|(a, b)| [*a, *b]).collect();
            let ours: Vec<[f64; 2]> = h.iter().map(|x| x[pol]).collect();
            let mm = mismatch(&freqs, &ours, &lal);
            // The amplitudes agree too (the mismatch is blind to a common scale).
            let norm = |v: &[[f64; 2]]| {
                v.iter()
                    .map(|x| x[0] * x[0] + x[1] * x[1])
                    .sum::<f64>()
                    .sqrt()
            };
            let scale = norm(&ours) / norm(&lal);
            eprintln!(
                "{name} m1 {} m2 {}: mismatch {mm:e}, amplitude ratio {scale}",
                g("m1"),
                g("m2")
            );
            assert!(mm.abs() < 1e-6, "{name}: mismatch {mm:e}");
            assert!(
                (scale - 1.0).abs() < 1e-6,
                "{name}: amplitude ratio {scale}"
            );
            // Zero above the ISCO, as LAL's TaylorF2 with f_max = 0.
            let f_isco = 1.0
                / (6f64.powf(1.5)
                    * std::f64::consts::PI
                    * (g("m1") + g("m2"))
                    * lockstep_npe::gw::MTSUN_SI);
            for (k, f) in freqs.iter().enumerate() {
                if *f > f_isco {
                    assert_eq!(ours[k], [0.0, 0.0]);
                    assert_eq!(lal[k], [0.0, 0.0]);
                }
            }
        }
    }
}

#[test]
fn antenna_patterns_and_delays_match_lal() {
    let r = reference();
    for s in r["sky"].as_array().unwrap() {
        let g = |k: &str| s[k].as_f64().unwrap();
        let det: Detector = match s["detector"].as_str().unwrap() {
            "H1" => H1,
            _ => L1,
        };
        let (fp, fc) = det.antenna_pattern(g("ra"), g("dec"), g("psi"), g("gmst"));
        let dt = det.time_delay_from_earth_center(g("ra"), g("dec"), g("gmst"));
        // LAL stores the detector tensor in single precision.
        assert!(
            (fp - g("fplus")).abs() < 1e-6,
            "{}: F+ {fp} vs {}",
            det.name,
            g("fplus")
        );
        assert!(
            (fc - g("fcross")).abs() < 1e-6,
            "{}: Fx {fc} vs {}",
            det.name,
            g("fcross")
        );
        assert!(
            (dt - g("time_delay")).abs() < 1e-9,
            "{}: delay {dt} vs {}",
            det.name,
            g("time_delay")
        );
    }
}
