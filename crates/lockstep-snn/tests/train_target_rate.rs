//! Training a 300-cell all-to-all GLIF3 network toward a target firing rate with BPTT and
//! Adam: the loss must fall below half its initial value within 50 updates (fixed seed).

use lockstep_snn::all_to_all_glif3;
use lockstep_snn::{BpttOptions, InputSpec, Loss, PoissonSpec, RateUnits, SnnModel};
use lockstep_train::optim::{Optimizer, OptimizerConfig};

#[test]
fn all_to_all_glif3_halves_target_rate_loss_in_50_adam_updates() {
    let spec = all_to_all_glif3(300, 50, 2024);
    assert_eq!(spec.recurrent_edges.len(), 300 * 299);
    let n = spec.neurons.len();
    let input = InputSpec {
        spike_trains: None,
        poisson: Some(PoissonSpec {
            rates_hz: vec![20.0; 50],
            seed: 7,
        }),
    };
    let opts = BpttOptions {
        seq_len: 200,
        losses: vec![Loss::TargetFiringRate {
            target: vec![10.0; n],
            units: RateUnits::Hz,
        }],
        gradient_checkpointing: Some(25),
        ..Default::default()
    };
    let model = SnnModel::new(&spec, 1.0, &input, opts).unwrap();
    let mut params = model.initial_params();
    // The engine's Adam (bias-corrected, betas 0.9/0.999, epsilon 1e-8).
    let adam_cfg = OptimizerConfig::from_json(Some(
        &serde_json::json!({"name": "adam", "learning_rate": 0.05}),
    ))
    .unwrap();
    let mut adam = Optimizer::new(adam_cfg, params.len());
    let mut first = None;
    let mut best = f64::INFINITY;
    let mut last = Vec::new();
    for update in 0..50u64 {
        // A fresh batch of samples every update (global sample indices keep the noise).
        let lg = model.loss_and_grad(&params, update * 4, 4).unwrap();
        first.get_or_insert(lg.loss);
        best = best.min(lg.loss);
        eprintln!(
            "update {update:2}: loss {:10.4} rate {:6.2} Hz",
            lg.loss, lg.mean_rate_hz
        );
        last.push(lg.loss);
        adam.update(&mut params, &lg.grad);
        model.constrain(&mut params);
    }
    let l0 = first.unwrap();
    assert!(
        l0 > 10.0,
        "the initial rate must be far from the target (loss {l0})"
    );
    assert!(
        best < 0.5 * l0,
        "loss {best} did not fall below half of {l0} in 50 updates"
    );
    // And it stays there: the mean of the last 10 losses is below half the initial loss.
    let tail: f64 = last[last.len() - 10..].iter().sum::<f64>() / 10.0;
    assert!(tail < 0.5 * l0, "late losses average {tail}, initial {l0}");
}
