//! Single-thread cost of the expansion kernels (M2L, M2P, derivatives) per order.
use lockstep_nbody::fmm::expansion::Tables;
fn main() {
    for p in 1..=6 {
        let t = Tables::new(p);
        let nt = t.nterms;
        let mp: Vec<f64> = (0..nt).map(|i| 1.0 / (1.0 + i as f64)).collect();
        let mut loc = vec![0.0; nt];
        let (mut d, mut s) = (vec![0.0; nt], vec![0.0; nt]);
        let reps = 200_000;
        let t0 = std::time::Instant::now();
        for k in 0..reps {
            let za = [3.0 + k as f64 * 1e-6, 1.0, 0.5];
            t.m2l(&mp, [0.0; 3], za, 1e-4, &mut loc, &mut d, &mut s);
        }
        let m2l = t0.elapsed().as_secs_f64() / reps as f64;
        let t0 = std::time::Instant::now();
        let mut acc = 0.0;
        for k in 0..reps {
            let x = [3.0 + k as f64 * 1e-6, 1.0, 0.5];
            t.derivatives(x, 1e-4, &mut d, &mut s);
            acc += d[nt - 1];
        }
        let der = t0.elapsed().as_secs_f64() / reps as f64;
        println!(
            "p={p}: nterms {nt}, M2L {:.0} ns, derivatives {:.0} ns ({acc:e} {:e})",
            m2l * 1e9,
            der * 1e9,
            loc[0]
        );
    }
}
