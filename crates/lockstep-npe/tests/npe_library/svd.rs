//! The SVD-initialized first embedding layer against a direct computation: the layer's basis
//! spans the same subspace as the top eigenvectors of the training inputs' Gram matrix
//! `Σ dᴴ d` (Eckart-Young), its forward pass on held-out inputs gives the reduced-basis
//! coefficients `c = d V` (the standardization folded into weight and bias), and held-out
//! inputs are reconstructed with a small mismatch.

use lockstep_npe::gw::GwChirp;
use lockstep_npe::params::{to_vec, Params};
use lockstep_npe::svd::{basis_rng, BasisLayout, ProjectionConfig, ReducedBasis, SvdSettings};
use lockstep_npe::{
    CpuBackend, EmbeddingConfig, FlowConfig, GaussianLinear, NetworkConfig, Norm, NpeNetwork, Task,
};
use nalgebra::{Complex, DMatrix, SymmetricEigen};

fn network(task: &dyn Task, size: usize) -> NpeNetwork {
    let config = NetworkConfig {
        embedding: EmbeddingConfig {
            hidden_dims: vec![16],
            output_dim: 4,
            norm: Norm::LayerNorm,
            projection: Some(ProjectionConfig {
                size,
                layout: task.basis_layout(),
            }),
        },
        flow: FlowConfig {
            num_flow_steps: 1,
            hidden_dim: 8,
            num_transform_blocks: 1,
            num_bins: 4,
            tail_bound: 3.0,
            norm: Norm::None,
        },
        batch_norm_eps: lockstep_npe::layers::DINGO_BATCH_NORM_EPS,
    };
    NpeNetwork::new(
        config,
        task.theta_dim(),
        task.x_dim(),
        task.standardization(),
        3,
    )
    .unwrap()
}

/// The orthogonal projector onto the top `size` eigenvectors of the Hermitian `g`.
fn top_projector(g: DMatrix<Complex<f64>>, size: usize) -> DMatrix<Complex<f64>> {
    let len = g.nrows();
    let eig = SymmetricEigen::new(g);
    let mut order: Vec<usize> = (0..len).collect();
    order.sort_by(|&a, &b| eig.eigenvalues[b].total_cmp(&eig.eigenvalues[a]));
    let e = DMatrix::from_fn(len, size, |j, c| eig.eigenvectors[(j, order[c])]);
    &e * e.adjoint()
}

#[test]
fn gw_layer_projects_onto_the_top_singular_vectors() {
    // A short band (20-40 Hz, 81 bins per detector) keeps the direct computation small; its
    // waveforms span about 25 dimensions (s_22 / s_1 ~ 1e-3), 22 elements leave mismatches
    // below 1e-5.
    let task = GwChirp {
        f_max: 40.0,
        ..GwChirp::default()
    };
    let BasisLayout::Complex { blocks, bins } = task.basis_layout() else {
        panic!("gw_chirp has complex blocks");
    };
    let (size, n_train) = (22, 300);
    let settings = SvdSettings {
        num_training_samples: n_train,
        num_validation_samples: 50,
        size,
    };
    let net = network(&task, size);
    let basis = ReducedBasis::compute(&task, 9, &settings, &net.standardization).unwrap();
    let (mut params, _) = net.initial_values(1);
    basis.initialize(&net, &mut params).unwrap();
    let report = basis.report().join("\n");
    assert!(report.contains("validation mismatch over 50"), "{report}");

    // The same training inputs, drawn again from their keyed stream.
    let xd = task.x_dim();
    let draw = |i: u64| {
        let mut x = vec![0.0; xd];
        task.basis_sample(&mut basis_rng(9, i), &mut x);
        x
    };
    let train: Vec<Vec<f64>> = (0..n_train as u64).map(draw).collect();
    let held_out: Vec<Vec<f64>> = (5000..5020).map(draw).collect();
    let block = |x: &[f64], b: usize| -> Vec<Complex<f64>> {
        let v = &x[2 * b * bins..2 * (b + 1) * bins];
        (0..bins).map(|j| Complex::new(v[j], v[bins + j])).collect()
    };

    // The layer's weights, undone back to V: W_raw = W diag(1/σ); Re V = W_raw[c, j],
    // Im V = W_raw[size + c, j].
    let layout = net.layout();
    let s = &net.standardization;
    let p = Params::<CpuBackend>::from_flat(layout, &params, &Default::default());
    let x32: Vec<f32> = held_out.iter().flatten().map(|&v| v as f32).collect();
    let out = to_vec(net.projection_output(&p, &x32, held_out.len()).unwrap());
    let outputs = blocks * 2 * size;
    for b in 0..blocks {
        let idx = layout
            .specs()
            .iter()
            .position(|sp| sp.name == format!("embedding_net.layers_rb.{b}.weight"))
            .unwrap();
        let w = layout.slice(&params, idx);
        let inputs = 2 * bins;
        let sigma = &s.x_std[b * inputs..(b + 1) * inputs];
        let v = DMatrix::from_fn(bins, size, |j, c| {
            Complex::new(
                w[c * inputs + j] as f64 / sigma[j],
                w[(size + c) * inputs + j] as f64 / sigma[j],
            )
        });
        // Orthonormal columns.
        let gram = v.adjoint() * &v;
        assert!(
            (gram - DMatrix::<Complex<f64>>::identity(size, size)).norm() < 1e-4,
            "block {b}: V is not orthonormal"
        );
        // Direct computation: the top eigenvectors of Σ dᴴ d.
        let mut g = DMatrix::<Complex<f64>>::zeros(bins, bins);
        for x in &train {
            let d = DMatrix::from_row_slice(1, bins, &block(x, b));
            g += d.adjoint() * d;
        }
        let p_direct = top_projector(g, size);
        let p_layer = &v * v.adjoint();
        let diff = (&p_layer - &p_direct).norm() / (size as f64).sqrt();
        assert!(diff < 1e-3, "block {b}: projectors differ by {diff}");
        // The forward pass gives c = d V (real parts, then imaginary parts) for held-out d,
        // and the basis reconstructs them: |c| = |P d| ≈ |d|.
        for (i, x) in held_out.iter().enumerate() {
            let d = block(x, b);
            let row = &out[i * outputs + b * 2 * size..i * outputs + (b + 1) * 2 * size];
            let mut norm_c = 0.0;
            for c in 0..size {
                let want: Complex<f64> = (0..bins).map(|j| d[j] * v[(j, c)]).sum();
                let got = Complex::new(row[c] as f64, row[size + c] as f64);
                assert!(
                    (got - want).norm() < 1e-3 * (1.0 + want.norm()),
                    "held-out {i} block {b} coefficient {c}: {got} vs {want}"
                );
                norm_c += got.norm_sqr();
            }
            // c = d V for the row d: |c| = |Vᴴ conj(d)ᵀ| = |P conj(d)ᵀ|.
            let dv = DMatrix::from_column_slice(bins, 1, &d).conjugate();
            let proj = (&p_direct * &dv).norm();
            let norm_d = dv.norm();
            assert!(
                (norm_c.sqrt() - proj).abs() < 1e-3 * norm_d,
                "held-out {i}: |c| {} vs |P d| {proj}",
                norm_c.sqrt()
            );
            let mismatch = 1.0 - proj / norm_d;
            assert!(
                mismatch < 1e-4,
                "held-out {i} block {b}: mismatch {mismatch}"
            );
        }
    }
}

#[test]
fn real_layer_is_the_top_principal_directions_of_the_standardized_inputs() {
    let task = GaussianLinear::new(6);
    let size = 3;
    let settings = SvdSettings {
        num_training_samples: 500,
        num_validation_samples: 0,
        size,
    };
    let net = network(&task, size);
    let s = net.standardization.clone();
    let basis = ReducedBasis::compute(&task, 2, &settings, &s).unwrap();
    let (mut params, _) = net.initial_values(1);
    basis.initialize(&net, &mut params).unwrap();
    let mut g = DMatrix::<Complex<f64>>::zeros(6, 6);
    for i in 0..500 {
        let mut x = vec![0.0; 6];
        task.basis_sample(&mut basis_rng(2, i), &mut x);
        let xs: Vec<Complex<f64>> = (0..6)
            .map(|j| Complex::new((x[j] - s.x_mean[j]) / s.x_std[j], 0.0))
            .collect();
        let d = DMatrix::from_row_slice(1, 6, &xs);
        g += d.adjoint() * d;
    }
    let layout = net.layout();
    let idx = layout
        .specs()
        .iter()
        .position(|sp| sp.name == "embedding_net.layers_rb.0.weight")
        .unwrap();
    let w = layout.slice(&params, idx);
    let v = DMatrix::from_fn(6, size, |j, c| Complex::new(w[c * 6 + j] as f64, 0.0));
    let diff = (&v * v.adjoint() - top_projector(g, size)).norm();
    assert!(diff < 1e-4, "projectors differ by {diff}");
}
