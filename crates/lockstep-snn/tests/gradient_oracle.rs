//! BPTT gradient against the forward-mode dual-number oracle (the same single-step code on
//! `num_dual::Dual64`), and segmented == unsegmented BPTT bit for bit.
//!
//! Small networks cover both cell models (GLIF3 with ASC, GLIF1, iaf_psc_alpha), delays of
//! 1..4 steps, refractory periods of several steps, all glif ports and both iaf ports,
//! both pseudo-derivatives, both losses, and trainable input weights.

#![allow(clippy::needless_range_loop)] // index loops over parallel arrays read clearer here

use lockstep_snn::{
    BpttOptions, Dtype, Loss, NetworkSpec, PseudoDerivative, RateUnits, SnnModel, Surrogate,
};

mod common;
use common::{losses, small_input, small_network, Lcg};

fn model(
    spec: &NetworkSpec,
    surrogate: Surrogate,
    losses: Vec<Loss>,
    chunk: Option<usize>,
) -> SnnModel {
    let input = small_input();
    let opts = BpttOptions {
        seq_len: 120,
        surrogate,
        train_input_weights: true,
        gradient_checkpointing: chunk,
        losses,
        parallel: false,
        // The float64 reference engine: the oracle runs the same f64 forward code.
        dtype: Dtype::Float64,
        ..Default::default()
    };
    SnnModel::new(spec, 1.0, &input, opts).unwrap()
}

#[test]
fn bptt_gradient_equals_dual_number_directional_derivatives() {
    let spec = small_network(5);
    let n = spec.neurons.len();
    let surrogates = [
        Surrogate {
            kind: PseudoDerivative::Gauss,
            gain: 0.3,
            width: 0.5,
        },
        Surrogate {
            kind: PseudoDerivative::Triangle,
            gain: 0.4,
            width: 1.0,
        },
    ];
    let loss_sets = [
        losses(n),
        vec![Loss::TargetFiringRate {
            target: vec![0.05; n],
            units: RateUnits::SpikesPerStep,
        }],
        vec![Loss::VoltageRegularization { cost: 2.0 }],
    ];
    let mut checked = 0;
    for sg in surrogates {
        for ls in &loss_sets {
            let m = model(&spec, sg, ls.clone(), None);
            let params = m.initial_params();
            let lg = m.loss_and_grad(&params, 3, 2).unwrap();
            assert!(
                lg.n_spikes > 20,
                "the test network must spike ({} spikes)",
                lg.n_spikes
            );
            eprintln!(
                "{:?} {:?} loss {} spikes {} nonzero {}",
                sg.kind,
                ls.iter().map(|l| l.name()).collect::<Vec<_>>(),
                lg.loss,
                lg.n_spikes,
                lg.grad.iter().filter(|&&g| g != 0.0).count()
            );
            assert!(lg.grad.iter().any(|&g| g != 0.0));
            let mut rng = Lcg(99 + checked);
            for _ in 0..3 {
                let dir: Vec<f64> = (0..m.n_params()).map(|_| rng.next() * 2.0 - 1.0).collect();
                let (loss_dual, dd) = m.loss_directional_dual(&params, &dir, 3, 2).unwrap();
                let bptt: f64 = lg.grad.iter().zip(&dir).map(|(&g, &d)| g as f64 * d).sum();
                assert!(
                    (loss_dual - lg.loss).abs() <= 1e-9 * lg.loss.abs().max(1e-12),
                    "{loss_dual} vs {}",
                    lg.loss
                );
                // 1e-5 relative (the BPTT gradient is returned as f32, ~1e-7 relative rounding).
                let tol = 1e-5 * dd.abs().max(bptt.abs());
                assert!(
                    (dd - bptt).abs() <= tol,
                    "{:?} {:?}: dual {dd} vs BPTT {bptt} (diff {})",
                    sg.kind,
                    ls.iter().map(|l| l.name()).collect::<Vec<_>>(),
                    (dd - bptt).abs()
                );
                assert!(dd.abs() > 0.0);
                eprintln!(
                    "  dual {dd:.12e} BPTT {bptt:.12e} rel diff {:.2e}",
                    (dd - bptt).abs() / dd.abs()
                );
                checked += 1;
            }
        }
    }
    assert_eq!(checked, 18);
}

#[test]
fn segmented_bptt_is_bitwise_identical() {
    let spec = small_network(8);
    let n = spec.neurons.len();
    let full = model(&spec, Surrogate::default(), losses(n), None);
    let params = full.initial_params();
    let a = full.loss_and_grad(&params, 0, 3).unwrap();
    for chunk in [1usize, 7, 25, 120, 500] {
        let seg = model(&spec, Surrogate::default(), losses(n), Some(chunk));
        let b = seg.loss_and_grad(&params, 0, 3).unwrap();
        assert_eq!(a.loss.to_bits(), b.loss.to_bits(), "chunk {chunk}");
        let bits = |g: &[f32]| g.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(
            bits(&a.grad),
            bits(&b.grad),
            "chunk {chunk}: gradients differ"
        );
    }
    let (full_b, seg_b) =
        model(&spec, Surrogate::default(), losses(n), Some(25)).tape_bytes_per_sample();
    assert!(seg_b < full_b);
}

#[test]
fn sign_constraint_clips_to_zero_and_losses_are_sample_separable() {
    let spec = small_network(5);
    let m = model(
        &spec,
        Surrogate::default(),
        losses(spec.neurons.len()),
        None,
    );
    assert!(m.losses_sample_separable());
    let mut p = m.initial_params();
    let signs = m.param_signs().to_vec();
    for x in p.iter_mut() {
        *x = -*x;
    }
    m.constrain(&mut p);
    for (x, s) in p.iter().zip(&signs) {
        if *s != 0 {
            assert_eq!(*x, 0.0);
        }
    }
}

#[test]
fn threads_and_batch_split_do_not_change_the_gradient() {
    let spec = small_network(5);
    let n = spec.neurons.len();
    let serial = model(&spec, Surrogate::default(), losses(n), None);
    let mut par = model(&spec, Surrogate::default(), losses(n), None);
    par.set_parallel(true);
    let p = serial.initial_params();
    let a = serial.loss_and_grad(&p, 10, 4).unwrap();
    let b = par.loss_and_grad(&p, 10, 4).unwrap();
    assert_eq!(a, b, "rayon over samples must not change any bit");
    // Two replicas of 2 samples == one replica of 4 samples (docs/design.md invariant 5).
    let h1 = serial.loss_and_grad(&p, 10, 2).unwrap();
    let h2 = serial.loss_and_grad(&p, 12, 2).unwrap();
    let mean: Vec<f64> = h1
        .grad
        .iter()
        .zip(&h2.grad)
        .map(|(&x, &y)| (x as f64 + y as f64) / 2.0)
        .collect();
    let num: f64 = mean
        .iter()
        .zip(&a.grad)
        .map(|(m, &g)| (m - g as f64).powi(2))
        .sum::<f64>()
        .sqrt();
    let den: f64 = a
        .grad
        .iter()
        .map(|&g| (g as f64).powi(2))
        .sum::<f64>()
        .sqrt();
    assert!(num / den <= 1e-6, "relative L2 difference {}", num / den);
    assert!(((h1.loss + h2.loss) / 2.0 - a.loss).abs() <= 1e-12 * a.loss.abs());
}
