//! The bundled sbibm reference posteriors fit lockstep's `two_moons` and `slcp` simulators:
//! the observations and reference samples obey the parameterization the tasks implement
//! (sbibm's), so a C2ST against them measures the posterior of the same model. (The
//! simulators themselves are checked against the same parameterization in `tasks.rs`.)

use lockstep_npe::sbibm::{reference, OBSERVATIONS};
use lockstep_npe::tasks::sample_rng;
use lockstep_npe::{Slcp, Task};

#[test]
fn two_moons_reference_samples_put_the_observation_on_the_crescent() {
    // Given θ, x - (-|θ₀ + θ₁|/√2, (θ₁ - θ₀)/√2) is p = (r cos a + 0.25, r sin a) with
    // r ~ N(0.1, 0.01²) and |a| ≤ π/2. With the rotation's sign flipped this fails.
    let s = std::f64::consts::FRAC_1_SQRT_2;
    for obs in OBSERVATIONS {
        let r = reference("two_moons", obs).unwrap();
        assert_eq!((r.theta_dim, r.x.len(), r.samples.len()), (2, 2, 20_000));
        let (x0, x1) = (r.x[0] as f64, r.x[1] as f64);
        let mut on = 0;
        for t in r.samples.chunks_exact(2).chain([&r.true_theta[..]]) {
            let (t0, t1) = (t[0] as f64, t[1] as f64);
            assert!(
                t0.abs() <= 1.0 && t1.abs() <= 1.0,
                "outside the prior: {t:?}"
            );
            let p0 = x0 + (s * (t0 + t1)).abs();
            let p1 = x1 - s * (t1 - t0);
            let radius = ((p0 - 0.25).powi(2) + p1 * p1).sqrt();
            if (radius - 0.1).abs() < 0.05 && p0 >= 0.25 - 0.01 {
                on += 1;
            }
        }
        assert!(
            on >= 9_990,
            "observation {obs}: {on} of 10001 samples on the crescent"
        );
    }
}

#[test]
fn slcp_reference_samples_explain_the_observation() {
    // x holds 4 draws of N(m, S) as (x₀₀, x₀₁, x₁₀, ...); at posterior samples the summed
    // squared Mahalanobis distance of the 4 points is small (χ²₈-like, median ≈ 7.3), while
    // prior draws give far larger values. A different flattening or scale convention fails.
    for obs in OBSERVATIONS {
        let r = reference("slcp", obs).unwrap();
        assert_eq!((r.theta_dim, r.x.len(), r.samples.len()), (5, 8, 50_000));
        let maha = |t: &[f64]| -> f64 {
            let (s1, s2, rho) = (t[2] * t[2], t[3] * t[3], t[4].tanh());
            let (a, b, c) = (s1 * s1, rho * s1 * s2, s2 * s2);
            let det = a * c - b * b;
            r.x.chunks_exact(2)
                .map(|p| {
                    let (u, v) = (p[0] as f64 - t[0], p[1] as f64 - t[1]);
                    (c * u * u - 2.0 * b * u * v + a * v * v) / det
                })
                .sum()
        };
        let mut post: Vec<f64> = r
            .samples
            .chunks_exact(5)
            .map(|t| {
                let t: Vec<f64> = t.iter().map(|&v| v as f64).collect();
                assert!(t.iter().all(|v| v.abs() <= 3.0), "outside the prior: {t:?}");
                maha(&t)
            })
            .collect();
        post.sort_by(f64::total_cmp);
        let median_post = post[post.len() / 2];
        assert!(
            median_post < 12.0,
            "observation {obs}: median {median_post}"
        );
        let (mut theta, mut x) = ([0.0; 5], [0.0; 8]);
        let mut prior: Vec<f64> = (0..2000)
            .map(|i| {
                Slcp.simulate(&mut sample_rng(9, i), &mut theta, &mut x);
                maha(&theta)
            })
            .collect();
        prior.sort_by(f64::total_cmp);
        assert!(
            prior[1000] > 10.0 * median_post,
            "observation {obs}: prior median {} vs posterior {median_post}",
            prior[1000]
        );
        // The data of our simulator at the true θ have the same statistic's distribution.
        let truth: Vec<f64> = r.true_theta.iter().map(|&v| v as f64).collect();
        let mut rng = sample_rng(11, obs as u64);
        let mut sim = Vec::new();
        for _ in 0..2000 {
            Slcp::data(&truth, &mut rng, &mut x);
            let (s1, s2, rho) = (truth[2].powi(2), truth[3].powi(2), truth[4].tanh());
            let (a, b, c) = (s1 * s1, rho * s1 * s2, s2 * s2);
            let det = a * c - b * b;
            sim.push(
                x.chunks_exact(2)
                    .map(|p| {
                        let (u, v) = (p[0] - truth[0], p[1] - truth[1]);
                        (c * u * u - 2.0 * b * u * v + a * v * v) / det
                    })
                    .sum::<f64>(),
            );
        }
        // χ²₈: mean 8.
        let mean = sim.iter().sum::<f64>() / sim.len() as f64;
        assert!((mean - 8.0).abs() < 0.6, "observation {obs}: mean {mean}");
    }
}

#[test]
fn unbundled_observations_are_refused_with_the_list() {
    let e = reference("slcp", 7).unwrap_err().to_string();
    assert!(
        e.contains("observation 7") && e.contains("[1, 2, 3]"),
        "{e}"
    );
    let e = reference("gaussian_mixture", 1).unwrap_err().to_string();
    assert!(e.contains("two_moons"), "{e}");
}
