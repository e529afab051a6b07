//! Edge cases of the spiking model, each run on every engine `lockstep train` can choose
//! (`common::engines`: the float64 reference, the float32 CPU kernels, ...). A fixed bug
//! came back once because a new default engine was not covered: a network without recurrent
//! edges panicked in the float32 kernels while the float64 tests passed.
//!
//! Every case checks that the engine neither panics nor returns non-finite values, and
//! that its loss and gradient agree with the per-sample float32 reference (the float32
//! engines) or are the float64 reference itself.

#![allow(clippy::needless_range_loop)] // the shared test network indexes parallel arrays

use lockstep_snn::{BpttOptions, Dtype, InputSpec, LossAndGrad, NetworkSpec, SnnModel};

mod common;
use common::{engines, losses, small_input, small_network, Engine};

/// Builds the model of `spec` on `engine` with the given knobs.
fn model(
    spec: &NetworkSpec,
    input: &InputSpec,
    engine: Engine,
    seq_len: usize,
    chunk: Option<usize>,
    train_input_weights: bool,
) -> SnnModel {
    let opts = BpttOptions {
        seq_len,
        train_input_weights,
        gradient_checkpointing: chunk,
        losses: losses(spec.neurons.len()),
        parallel: false,
        ..engine.options()
    };
    SnnModel::new(spec, 1.0, input, opts).unwrap()
}

/// Relative L2 distance of two gradients (0 when both are zero).
fn rel_l2(a: &[f32], b: &[f32]) -> f64 {
    assert_eq!(a.len(), b.len());
    let num: f64 = a
        .iter()
        .zip(b)
        .map(|(&x, &y)| (x as f64 - y as f64).powi(2))
        .sum();
    let den: f64 = b.iter().map(|&y| (y as f64).powi(2)).sum();
    if den == 0.0 {
        num.sqrt()
    } else {
        (num / den).sqrt()
    }
}

/// Runs `m` on a batch of `batch` samples and checks it against the per-sample reference of
/// its precision: same spikes and loss (1e-6 relative), gradient within 1e-5 relative L2.
fn check(m: &SnnModel, engine: Engine, batch: usize, what: &str) -> LossAndGrad {
    let p = m.initial_params();
    let got = m
        .loss_and_grad(&p, 5, batch)
        .unwrap_or_else(|e| panic!("{what} on {engine:?}: {e}"));
    assert!(
        got.loss.is_finite(),
        "{what} on {engine:?}: loss {}",
        got.loss
    );
    assert!(
        got.grad.iter().all(|g| g.is_finite()),
        "{what} on {engine:?}: non-finite gradient"
    );
    assert_eq!(got.grad.len(), m.n_params(), "{what} on {engine:?}");
    let reference = m
        .loss_and_grad_reference(&p, 5, batch, engine.reference_dtype())
        .unwrap();
    assert_eq!(got.n_spikes, reference.n_spikes, "{what} on {engine:?}");
    assert!(
        (got.loss - reference.loss).abs() <= 1e-6 * reference.loss.abs().max(1e-12),
        "{what} on {engine:?}: loss {} vs reference {}",
        got.loss,
        reference.loss
    );
    let d = rel_l2(&got.grad, &reference.grad);
    assert!(d <= 1e-5, "{what} on {engine:?}: gradient rel. L2 {d:e}");
    got
}

/// A network without recurrent edges, training its input weights: every engine computes the
/// gradient of the input weights alone (the recurrent part of the buffer is empty).
#[test]
fn no_recurrent_edges_with_trained_input_weights() {
    let mut spec = small_network(5);
    spec.recurrent_edges.clear();
    for engine in engines() {
        for chunk in [None, Some(7)] {
            let m = model(&spec, &small_input(), engine, 40, chunk, true);
            assert_eq!(m.n_recurrent_params(), 0);
            let r = check(&m, engine, 3, "no recurrent edges");
            assert!(r.n_spikes > 0, "the inputs drive the cells on {engine:?}");
            assert!(r.grad.iter().any(|&g| g != 0.0), "{engine:?}");
        }
    }
}

/// A network without recurrent edges, training recurrent weights only: the model has no
/// parameters; every engine still runs its forward pass and returns the loss and an empty
/// gradient (the trainer refuses such a run before it starts, by name).
#[test]
fn no_recurrent_edges_and_no_trained_inputs_gives_an_empty_gradient() {
    let mut spec = small_network(5);
    spec.recurrent_edges.clear();
    for engine in engines() {
        for chunk in [None, Some(9)] {
            let m = model(&spec, &small_input(), engine, 30, chunk, false);
            assert_eq!(m.n_params(), 0);
            let r = check(&m, engine, 2, "no parameters");
            assert!(r.grad.is_empty());
        }
    }
}

/// No inputs at all (no virtual nodes, no input edges): the cells stay at rest, and every
/// engine gives the same loss and a finite gradient.
#[test]
fn no_inputs() {
    let mut spec = small_network(6);
    spec.virtual_nodes.clear();
    spec.input_edges.clear();
    for engine in engines() {
        let m = model(&spec, &InputSpec::default(), engine, 25, None, false);
        let r = check(&m, engine, 2, "no inputs");
        assert_eq!(r.n_spikes, 0, "{engine:?}");
    }
}

/// One step, one sample, chunks of one step and chunks longer than the run: the smallest
/// shapes each engine accepts.
#[test]
fn one_step_one_sample_and_extreme_chunks() {
    let spec = small_network(7);
    for engine in engines() {
        for (seq_len, chunk) in [(1, None), (1, Some(1)), (13, Some(1)), (13, Some(100))] {
            let m = model(&spec, &small_input(), engine, seq_len, chunk, true);
            check(&m, engine, 1, &format!("seq_len {seq_len} chunk {chunk:?}"));
        }
    }
}

/// A single neuron without any edge.
#[test]
fn single_neuron_without_edges() {
    let mut spec = small_network(8);
    spec.neurons.truncate(1);
    spec.recurrent_edges.clear();
    spec.input_edges.clear();
    spec.virtual_nodes.clear();
    for engine in engines() {
        let opts = BpttOptions {
            seq_len: 10,
            losses: losses(1),
            parallel: false,
            ..engine.options()
        };
        let m = SnnModel::new(&spec, 1.0, &InputSpec::default(), opts).unwrap();
        check(&m, engine, 2, "one neuron");
    }
}

/// The engine list covers every precision the config accepts.
#[test]
fn every_dtype_has_an_engine_under_test() {
    for dtype in [Dtype::Float64, Dtype::Float32] {
        assert!(
            engines().iter().any(|e| e.options().dtype == dtype),
            "{dtype} untested"
        );
    }
}
