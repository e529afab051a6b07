//! BPTT gradient against the forward-mode dual-number oracle (the same single-step code on
//! `num_dual::Dual64`), and segmented == unsegmented BPTT bit for bit.
//!
//! Small networks cover both cell models (GLIF3 with ASC, GLIF1, iaf_psc_alpha), delays of
//! 1..4 steps, refractory periods of several steps, all glif ports and both iaf ports,
//! both pseudo-derivatives, both losses, and trainable input weights.

#![allow(clippy::needless_range_loop)] // index loops over parallel arrays read clearer here

use lockstep_snn::CellModel;
use lockstep_snn::{
    BpttOptions, CellType, EdgeSpec, InputSpec, Loss, NetworkSpec, NeuronSpec, PoissonSpec,
    PseudoDerivative, RateUnits, SnnModel, Surrogate, VirtualNodeSpec,
};
use serde_json::json;

/// Small deterministic generator for the test network.
struct Lcg(u64);
impl Lcg {
    fn next(&mut self) -> f64 {
        self.0 = self
            .0
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        (self.0 >> 11) as f64 / (1u64 << 53) as f64
    }
}

fn small_network(seed: u64) -> NetworkSpec {
    let glif3 = CellModel::from_template(
        "nest:glif_psc",
        &json!({"V_m": -70.0, "V_th": -50.0, "g": 4.0, "E_L": -70.0, "C_m": 40.0, "t_ref": 3.0, "V_reset": -70.0,
                "asc_init": [0.0, 0.0], "asc_decay": [0.1, 0.3], "asc_amps": [-10.0, -30.0],
                "tau_syn": [5.5, 8.5, 2.8, 5.8], "after_spike_currents": true}),
        "glif3",
    )
    .unwrap();
    let glif1 = CellModel::from_template(
        "nest:glif_psc",
        &json!({"V_m": -65.0, "V_th": -45.0, "g": 5.0, "E_L": -65.0, "C_m": 50.0, "t_ref": 2.0, "V_reset": -60.0,
                "tau_syn": [3.0, 6.0]}),
        "glif1",
    )
    .unwrap();
    let iaf = CellModel::from_template(
        "nest:iaf_psc_alpha",
        &json!({"tau_m": 15.0, "C_m": 60.0, "t_ref": 2.0, "E_L": -70.0, "V_th": -52.0, "V_reset": -62.0,
                "tau_syn_ex": 2.0, "tau_syn_in": 4.0}),
        "iaf",
    )
    .unwrap();
    let cell_types = vec![
        CellType {
            name: "glif3".into(),
            model: glif3,
        },
        CellType {
            name: "glif1".into(),
            model: glif1,
        },
        CellType {
            name: "iaf".into(),
            model: iaf,
        },
    ];
    let types = [0usize, 2, 1, 0, 2, 1, 0, 2, 0];
    let neurons: Vec<NeuronSpec> = types
        .iter()
        .enumerate()
        .map(|(i, &c)| NeuronSpec {
            population: "net".into(),
            node_id: i as u64,
            cell_type: c,
        })
        .collect();
    let mut rng = Lcg(seed);
    let ports = |c: usize| match c {
        0 => 4,
        1 => 2,
        _ => 0,
    };
    let mut recurrent_edges = Vec::new();
    for s in 0..neurons.len() {
        for t in 0..neurons.len() {
            if s == t || rng.next() < 0.4 {
                continue;
            }
            let inhibitory = rng.next() < 0.3;
            let weight = if inhibitory {
                -(15.0 + 30.0 * rng.next())
            } else {
                2.0 + 6.0 * rng.next()
            };
            let np = ports(types[t]);
            let receptor = if np == 0 {
                0
            } else {
                1 + (rng.next() * np as f64) as i64
            };
            let delay_ms = 1.0 + (rng.next() * 4.0).floor(); // 1..4 steps at dt = 1 ms
            recurrent_edges.push(EdgeSpec {
                source: s,
                target: t,
                weight,
                receptor,
                delay_ms,
            });
        }
    }
    let virtual_nodes: Vec<VirtualNodeSpec> = (0..6)
        .map(|i| VirtualNodeSpec {
            population: "in".into(),
            node_id: i,
        })
        .collect();
    let mut input_edges = Vec::new();
    for v in 0..virtual_nodes.len() {
        for t in 0..neurons.len() {
            if rng.next() < 0.3 {
                continue;
            }
            let np = ports(types[t]);
            let receptor = if np == 0 {
                0
            } else {
                1 + (rng.next() * np as f64) as i64
            };
            let delay_ms = 1.0 + (rng.next() * 2.0).floor();
            input_edges.push(EdgeSpec {
                source: v,
                target: t,
                weight: 30.0 + 40.0 * rng.next(),
                receptor,
                delay_ms,
            });
        }
    }
    NetworkSpec {
        cell_types,
        neurons,
        virtual_nodes,
        recurrent_edges,
        input_edges,
    }
}

fn model(
    spec: &NetworkSpec,
    surrogate: Surrogate,
    losses: Vec<Loss>,
    chunk: Option<usize>,
) -> SnnModel {
    let input = InputSpec {
        spike_trains: Some(
            (0..6)
                .map(|v| vec![3.5 + v as f64, 20.2 + 2.0 * v as f64])
                .collect(),
        ),
        poisson: Some(PoissonSpec {
            rates_hz: vec![60.0; 6],
            seed: 11,
        }),
    };
    let opts = BpttOptions {
        seq_len: 120,
        surrogate,
        train_input_weights: true,
        gradient_checkpointing: chunk,
        losses,
        parallel: false,
        ..Default::default()
    };
    SnnModel::new(spec, 1.0, &input, opts).unwrap()
}

fn losses(n: usize) -> Vec<Loss> {
    vec![
        Loss::TargetFiringRate {
            target: (0..n).map(|i| 5.0 + i as f64).collect(),
            units: RateUnits::Hz,
        },
        Loss::VoltageRegularization { cost: 0.7 },
    ]
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
