//! `BpttOptions::record_first_sample` (behind `output.training_spikes`): the spikes kept from
//! a training pass are those of the batch's first sample, exactly as the forward simulation
//! computes that trial, in both precisions, with and without segmented recompute, for any
//! thread count.

#![allow(clippy::needless_range_loop)] // the shared test network (tests/common) indexes by cell

use lockstep_snn::{simulate, BpttOptions, Dtype, InitialState, NetworkSpec, SimOptions, SnnModel};

mod common;
use common::{losses, small_input, small_network};

/// The small test network with every weight rounded to f32, so the trainable f32 parameters
/// and the network's own f64 weights (which `simulate` uses) are the same numbers.
fn f32_exact_network() -> NetworkSpec {
    let mut spec = small_network(5);
    for e in spec
        .recurrent_edges
        .iter_mut()
        .chain(spec.input_edges.iter_mut())
    {
        e.weight = e.weight as f32 as f64;
    }
    spec
}

fn model(spec: &NetworkSpec, dtype: Dtype, chunk: Option<usize>, parallel: bool) -> SnnModel {
    let opts = BpttOptions {
        seq_len: 120,
        losses: losses(spec.neurons.len()),
        gradient_checkpointing: chunk,
        parallel,
        dtype,
        record_first_sample: true,
        ..Default::default()
    };
    SnnModel::new(spec, 1.0, &small_input(), opts).unwrap()
}

#[test]
fn recorded_training_trial_is_the_simulated_first_sample() {
    let spec = f32_exact_network();
    let m = model(&spec, Dtype::Float64, None, false);
    let p = m.initial_params();
    let sim = |first: u64| {
        let opts = SimOptions {
            initial: InitialState::Rest,
            parallel: false,
            ..Default::default()
        };
        simulate(&m.net, &m.inputs, 120, 1, first, &opts).trials[0]
            .spikes
            .clone()
    };
    let (want, other) = (sim(3), sim(4));
    assert!(want.len() >= 10, "too few spikes to compare: {want:?}");
    assert_ne!(
        want, other,
        "samples 3 and 4 must differ for the test to mean anything"
    );

    // float64, stored tape and segmented recompute, serial and parallel: the spikes of sample
    // 3 (the first of the batch 3..7), exactly.
    for (chunk, parallel) in [(None, false), (Some(25), false), (None, true)] {
        let m = model(&spec, Dtype::Float64, chunk, parallel);
        let r = m.loss_and_grad(&p, 3, 4).unwrap();
        assert_eq!(
            r.first_spikes.as_deref(),
            Some(&want[..]),
            "float64, chunk {chunk:?}, parallel {parallel}"
        );
    }

    // float32: the batched kernels keep lane 0, which equals the per-sample float32 pass of
    // the same sample (and, in this network, the float64 trial).
    let f32_reference = model(&spec, Dtype::Float32, None, false)
        .loss_and_grad_reference(&p, 3, 4, Dtype::Float32)
        .unwrap()
        .first_spikes
        .unwrap();
    assert_eq!(f32_reference, want, "per-sample float32 against float64");
    for (chunk, parallel) in [
        (None, false),
        (Some(25), false),
        (Some(7), true),
        (None, true),
    ] {
        let m = model(&spec, Dtype::Float32, chunk, parallel);
        let r = m.loss_and_grad(&p, 3, 4).unwrap();
        assert_eq!(
            r.first_spikes.as_deref(),
            Some(&f32_reference[..]),
            "float32 batched, chunk {chunk:?}, parallel {parallel}"
        );
    }

    // Not asked for: nothing is kept.
    let mut m = model(&spec, Dtype::Float32, None, false);
    m.opts.record_first_sample = false;
    assert_eq!(m.loss_and_grad(&p, 3, 4).unwrap().first_spikes, None);
}
