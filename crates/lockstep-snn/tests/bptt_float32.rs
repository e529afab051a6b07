//! The batch-innermost float32 BPTT kernels (`run.dtype: float32`) against the
//! straightforward per-sample float32 implementation of the same equations
//! (`SnnModel::loss_and_grad_reference`): same spikes, same losses, gradients within 1e-5
//! relative L2, for any thread count, any batch split (1 vs 2 replicas) and with segmented
//! BPTT bitwise equal to unsegmented; and float32 against float64 on the 300-cell example.

#![allow(clippy::needless_range_loop)] // index loops over parallel arrays read clearer here

use lockstep_snn::{
    BpttOptions, Dtype, LossAndGrad, NetworkSpec, PseudoDerivative, SnnModel, SnnReplica, SpmvForm,
    Surrogate,
};
use serde_json::json;

mod common;
use common::{losses, small_input, small_network};

fn model(
    spec: &NetworkSpec,
    surrogate: Surrogate,
    chunk: Option<usize>,
    parallel: bool,
) -> SnnModel {
    model_in_passes(spec, surrogate, chunk, parallel, None)
}

/// [`model`] whose adjoint SpMV takes the form `form`.
fn model_in_form(
    spec: &NetworkSpec,
    chunk: Option<usize>,
    parallel: bool,
    form: SpmvForm,
) -> SnnModel {
    let mut m = model(spec, Surrogate::default(), chunk, parallel);
    m.opts.adjoint_spmv = form;
    m
}

/// [`model`] whose adjoint SpMV gathers from `pass` target neurons at a time (`None`: the
/// default, one pass over these small networks).
fn model_in_passes(
    spec: &NetworkSpec,
    surrogate: Surrogate,
    chunk: Option<usize>,
    parallel: bool,
    pass: Option<usize>,
) -> SnnModel {
    let input = small_input();
    let opts = BpttOptions {
        seq_len: 120,
        surrogate,
        train_input_weights: true,
        gradient_checkpointing: chunk,
        losses: losses(spec.neurons.len()),
        parallel,
        dtype: Dtype::Float32,
        spmv_pass_targets: pass,
        ..Default::default()
    };
    SnnModel::new(spec, 1.0, &input, opts).unwrap()
}

fn rel_l2(a: &[f32], b: &[f32]) -> f64 {
    let num: f64 = a
        .iter()
        .zip(b)
        .map(|(&x, &y)| (x as f64 - y as f64).powi(2))
        .sum();
    let den: f64 = b.iter().map(|&y| (y as f64).powi(2)).sum();
    assert!(den > 0.0, "the reference gradient is zero");
    (num / den).sqrt()
}

/// The batched kernel matches the reference: same spikes (count and every loss term, the
/// rate loss being a function of each neuron's count), gradient within 1e-5.
fn assert_matches(fast: &LossAndGrad, reference: &LossAndGrad, what: &str) {
    assert_eq!(fast.n_spikes, reference.n_spikes, "{what}: spikes differ");
    for ((name, a), (_, b)) in fast.terms.iter().zip(&reference.terms) {
        assert!(
            (a - b).abs() <= 1e-12 * b.abs().max(1e-30),
            "{what}: {name} {a} vs reference {b}"
        );
    }
    let r = rel_l2(&fast.grad, &reference.grad);
    eprintln!("{what}: {} spikes, gradient rel L2 {r:.2e}", fast.n_spikes);
    assert!(r <= 1e-5, "{what}: gradient relative L2 {r}");
}

fn bits(g: &[f32]) -> Vec<u32> {
    g.iter().map(|x| x.to_bits()).collect()
}

#[test]
fn batched_f32_kernel_equals_the_per_sample_f32_reference() {
    let spec = small_network(5);
    for sg in [
        Surrogate::default(),
        Surrogate {
            kind: PseudoDerivative::Triangle,
            gain: 0.4,
            width: 1.0,
        },
    ] {
        let m = model(&spec, sg, None, false);
        let p = m.initial_params();
        let reference = m.loss_and_grad_reference(&p, 3, 5, Dtype::Float32).unwrap();
        assert!(reference.n_spikes > 50, "the test network must spike");
        let fast = m.loss_and_grad(&p, 3, 5).unwrap();
        assert_matches(&fast, &reference, &format!("{:?}", sg.kind));
        // The input weights are trained too: their gradient is part of the comparison.
        assert!(fast.grad[m.n_recurrent_params()..]
            .iter()
            .any(|&g| g != 0.0));
    }
}

#[test]
fn batched_f32_kernel_is_independent_of_threads_and_batch_split() {
    let spec = small_network(7);
    let serial = model(&spec, Surrogate::default(), None, false);
    let p = serial.initial_params();
    let a = serial.loss_and_grad(&p, 10, 6).unwrap();
    for threads in [1, 2, 3, 4] {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .build()
            .unwrap();
        let par = model(&spec, Surrogate::default(), None, true);
        let b = pool.install(|| par.loss_and_grad(&p, 10, 6).unwrap());
        assert_eq!(
            a.loss.to_bits(),
            b.loss.to_bits(),
            "{threads} threads: loss"
        );
        assert_eq!(bits(&a.grad), bits(&b.grad), "{threads} threads: gradient");
    }
    // Two replicas of 3 samples == one replica of 6 samples.
    let h1 = serial.loss_and_grad(&p, 10, 3).unwrap();
    let h2 = serial.loss_and_grad(&p, 13, 3).unwrap();
    let mean: Vec<f32> = h1
        .grad
        .iter()
        .zip(&h2.grad)
        .map(|(&x, &y)| ((x as f64 + y as f64) / 2.0) as f32)
        .collect();
    let r = rel_l2(&mean, &a.grad);
    assert!(r <= 1e-6, "1 vs 2 replicas: relative L2 {r}");
    assert!(((h1.loss + h2.loss) / 2.0 - a.loss).abs() <= 1e-12 * a.loss.abs());
    assert_eq!(h1.n_spikes + h2.n_spikes, a.n_spikes);
}

#[test]
fn batched_f32_segmented_equals_unsegmented_bitwise() {
    let spec = small_network(8);
    let full = model(&spec, Surrogate::default(), None, true);
    let p = full.initial_params();
    let a = full.loss_and_grad(&p, 0, 3).unwrap();
    for chunk in [1usize, 7, 25, 120, 500] {
        let seg = model(&spec, Surrogate::default(), Some(chunk), true);
        let b = seg.loss_and_grad(&p, 0, 3).unwrap();
        assert_eq!(a.loss.to_bits(), b.loss.to_bits(), "chunk {chunk}");
        assert_eq!(
            bits(&a.grad),
            bits(&b.grad),
            "chunk {chunk}: gradients differ"
        );
    }
}

/// A model keeps its tapes, chunk boundaries and (unsegmented, scatter form) scatter order
/// from one call to the next: a call after calls with other parameters, samples and batch
/// sizes gives the bits of a fresh model's, unsegmented (the tape keeps the after-spike
/// currents every 25 steps only) and segmented, in both forms of the SpMV.
#[test]
fn batched_f32_reused_buffers_give_a_fresh_models_bits() {
    let spec = small_network(6);
    for form in [SpmvForm::Gather, SpmvForm::Scatter] {
        for chunk in [None, Some(7)] {
            let used = model_in_form(&spec, chunk, true, form);
            let p = used.initial_params();
            let other: Vec<f32> = p.iter().map(|w| w * 1.5).collect();
            used.loss_and_grad(&other, 40, 5).unwrap();
            used.loss_and_grad(&other, 7, 3).unwrap();
            let again = used.loss_and_grad(&p, 0, 3).unwrap();
            let fresh = model_in_form(&spec, chunk, true, form)
                .loss_and_grad(&p, 0, 3)
                .unwrap();
            assert!(fresh.n_spikes > 0, "the run spikes");
            let what = format!("{form:?}, chunk {chunk:?}");
            assert_eq!(again.loss.to_bits(), fresh.loss.to_bits(), "{what}: loss");
            assert_eq!(bits(&again.grad), bits(&fresh.grad), "{what}: gradient");
        }
    }
}

/// The adjoint SpMV in several passes over the targets (as on networks larger than one pass,
/// e.g. full V1) still matches the per-sample reference, bitwise for any thread count and
/// with segmented BPTT (9 neurons in passes of 3); and it differs from one pass only by rounding (so the passes are
/// really taken).
#[test]
fn batched_f32_spmv_in_target_passes_matches_the_reference() {
    let spec = small_network(5);
    let n = spec.neurons.len();
    assert!(n >= 7, "the test network needs several passes of 3 targets");
    let one = model(&spec, Surrogate::default(), None, false);
    let p = one.initial_params();
    let single = one.loss_and_grad(&p, 3, 5).unwrap();
    let reference = one
        .loss_and_grad_reference(&p, 3, 5, Dtype::Float32)
        .unwrap();
    let serial = model_in_passes(&spec, Surrogate::default(), None, false, Some(3));
    let a = serial.loss_and_grad(&p, 3, 5).unwrap();
    assert_matches(&a, &reference, "passes of 3 targets");
    assert_ne!(
        bits(&a.grad),
        bits(&single.grad),
        "passes of 3 targets sum in another order than one pass"
    );
    for threads in [2, 3] {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .build()
            .unwrap();
        for chunk in [None, Some(7)] {
            let par = model_in_passes(&spec, Surrogate::default(), chunk, true, Some(3));
            let b = pool.install(|| par.loss_and_grad(&p, 3, 5).unwrap());
            assert_eq!(
                a.loss.to_bits(),
                b.loss.to_bits(),
                "{threads} threads, {chunk:?}"
            );
            assert_eq!(
                bits(&a.grad),
                bits(&b.grad),
                "{threads} threads, chunk {chunk:?}: gradient"
            );
        }
    }
}

/// The scatter form of the adjoint SpMV (per target row into blocks of sources, as on
/// networks above 32,768 neurons) matches the per-sample reference, bitwise for any thread
/// count (which changes the blocks) and with segmented BPTT; and it differs from the gather
/// form only by rounding (so it is really taken).
#[test]
fn batched_f32_scatter_spmv_matches_the_reference() {
    let spec = small_network(5);
    let gather = model_in_form(&spec, None, false, SpmvForm::Gather);
    let p = gather.initial_params();
    let g = gather.loss_and_grad(&p, 3, 5).unwrap();
    let reference = gather
        .loss_and_grad_reference(&p, 3, 5, Dtype::Float32)
        .unwrap();
    let serial = model_in_form(&spec, None, false, SpmvForm::Scatter);
    let a = serial.loss_and_grad(&p, 3, 5).unwrap();
    assert_matches(&a, &reference, "scatter form");
    // The timing says which form ran and what part of the SpMV the windowed gradient took.
    let (_, ts) = serial.loss_and_grad_timed(&p, 3, 5).unwrap();
    let (_, tg) = gather.loss_and_grad_timed(&p, 3, 5).unwrap();
    assert!(ts.adjoint_scatter && !tg.adjoint_scatter);
    assert!(
        ts.weight_grad_s > 0.0 && ts.weight_grad_s <= ts.adjoint_spmv_s,
        "windowed gradient {} s of an SpMV of {} s",
        ts.weight_grad_s,
        ts.adjoint_spmv_s
    );
    assert_eq!(
        tg.weight_grad_s, 0.0,
        "the gather form has no windowed gradient"
    );
    assert_eq!(ts.adjoint_edges, tg.adjoint_edges, "the same edge visits");
    assert_eq!(
        a.loss.to_bits(),
        g.loss.to_bits(),
        "the forward pass is the same"
    );
    assert_ne!(
        bits(&a.grad),
        bits(&g.grad),
        "the scatter form sums in another order than the gather form"
    );
    for threads in [1, 2, 3] {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .build()
            .unwrap();
        for chunk in [None, Some(7)] {
            let par = model_in_form(&spec, chunk, true, SpmvForm::Scatter);
            let b = pool.install(|| par.loss_and_grad(&p, 3, 5).unwrap());
            assert_eq!(
                bits(&a.grad),
                bits(&b.grad),
                "{threads} threads, chunk {chunk:?}: gradient"
            );
        }
    }
}

/// The scatter form on a run whose length is no multiple of the segment length and with
/// 67 samples (lanes in blocks of 16 and single lanes, not only whole 16-lane rows): matches the
/// reference, and segmented equals unsegmented bitwise on 2 threads.
#[test]
fn batched_f32_scatter_spmv_with_odd_lengths_and_67_samples_matches_the_reference() {
    let spec = small_network(5);
    let with_len = |chunk, parallel| {
        let mut m = model_in_form(&spec, chunk, parallel, SpmvForm::Scatter);
        m.opts.seq_len = 101;
        m
    };
    let batch = 67;
    let serial = with_len(None, false);
    let p = serial.initial_params();
    let a = serial.loss_and_grad(&p, 11, batch).unwrap();
    let reference = serial
        .loss_and_grad_reference(&p, 11, batch, Dtype::Float32)
        .unwrap();
    assert!(a.n_spikes > 0, "the run spikes");
    assert_matches(&a, &reference, "scatter form, 101 steps, 67 samples");
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(2)
        .build()
        .unwrap();
    for chunk in [Some(5), Some(12)] {
        let b = pool.install(|| with_len(chunk, true).loss_and_grad(&p, 11, batch).unwrap());
        assert_eq!(bits(&a.grad), bits(&b.grad), "chunk {chunk:?}: gradient");
    }
}

/// A receptor port that no edge reaches (here port 3 of the 4-port cells: its edges moved
/// to port 4) is skipped by the kernels' updates and adjoints: both forms of the SpMV still
/// match the per-sample reference, which updates every port, and segmented BPTT stays
/// bitwise equal to unsegmented.
#[test]
fn batched_f32_kernels_skip_ports_no_edge_reaches_and_match_the_reference() {
    let mut spec = small_network(5);
    let four_ports = |spec: &NetworkSpec, t: usize| spec.neurons[t].cell_type == 0;
    for k in 0..spec.recurrent_edges.len() {
        let e = spec.recurrent_edges[k];
        if four_ports(&spec, e.target) && e.receptor == 3 {
            spec.recurrent_edges[k].receptor = 4;
        }
    }
    for k in 0..spec.input_edges.len() {
        let e = spec.input_edges[k];
        if four_ports(&spec, e.target) && e.receptor == 3 {
            spec.input_edges[k].receptor = 4;
        }
    }
    let net = spec.compile(1.0).unwrap();
    let live = net.live_ports();
    let g = net.groups.iter().position(|g| g.cell_type == 0).unwrap();
    assert_eq!(
        live[g],
        vec![0, 1, 3],
        "port 3 (index 2) is reached by no edge"
    );
    for form in [SpmvForm::Gather, SpmvForm::Scatter] {
        let m = model_in_form(&spec, None, false, form);
        let p = m.initial_params();
        let reference = m.loss_and_grad_reference(&p, 3, 5, Dtype::Float32).unwrap();
        assert!(reference.n_spikes > 50, "the test network must spike");
        let a = m.loss_and_grad(&p, 3, 5).unwrap();
        assert_matches(&a, &reference, &format!("{form:?} form, a dead port"));
        let seg = model_in_form(&spec, Some(7), true, form);
        let b = seg.loss_and_grad(&p, 3, 5).unwrap();
        assert_eq!(bits(&a.grad), bits(&b.grad), "{form:?}: segmented gradient");
    }
}

/// The bundled 300-cell all-to-all example with its training config, in `dtype`.
fn example_replica(dtype: &str, dir: &std::path::Path) -> SnnReplica {
    let example = std::fs::canonicalize(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../examples/glif_all2all"
    ))
    .unwrap();
    let mut cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(example.join("config.train.json")).unwrap())
            .unwrap();
    cfg["manifest"]["$BASE_DIR"] = json!(example.to_str().unwrap());
    cfg["network"] = json!(example.join("config.circuit.json").to_str().unwrap());
    cfg["training"]["losses"][0]["firing_rate"] =
        json!(example.join("target_rates.csv").to_str().unwrap());
    cfg["run"]["dtype"] = json!(dtype);
    let path = dir.join(format!("config.{dtype}.json"));
    std::fs::write(&path, cfg.to_string()).unwrap();
    SnnReplica::from_config(&path, true).unwrap()
}

#[test]
fn example_300_cells_f32_kernel_matches_reference_and_f64_losses() {
    let dir = tempfile::tempdir().unwrap();
    let r32 = example_replica("float32", dir.path());
    let r64 = example_replica("float64", dir.path());
    assert_eq!(r32.model().options().dtype, Dtype::Float32);
    assert_eq!(r64.model().options().dtype, Dtype::Float64);
    let (m32, m64) = (r32.model(), r64.model());
    let p = m32.initial_params();
    let batch = 4;
    let fast = m32.loss_and_grad(&p, 0, batch).unwrap();
    let reference = m32
        .loss_and_grad_reference(&p, 0, batch, Dtype::Float32)
        .unwrap();
    assert_matches(&fast, &reference, "300 cells");
    let f64_run = m64.loss_and_grad(&p, 0, batch).unwrap();
    eprintln!(
        "300 cells: f32 loss {} ({} spikes), f64 loss {} ({} spikes)",
        fast.loss, fast.n_spikes, f64_run.loss, f64_run.n_spikes
    );
    let rel = (fast.loss - f64_run.loss).abs() / f64_run.loss.abs();
    assert!(rel <= 1e-3, "f32 vs f64 loss: relative difference {rel}");
    let spikes_rel =
        (fast.n_spikes as f64 - f64_run.n_spikes as f64).abs() / f64_run.n_spikes as f64;
    assert!(
        spikes_rel <= 1e-3,
        "f32 vs f64 spikes: {} vs {}",
        fast.n_spikes,
        f64_run.n_spikes
    );
}
