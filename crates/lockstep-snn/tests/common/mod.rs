//! The small test networks shared by the BPTT test files: a deterministic mix of GLIF3 (with
//! after-spike currents), GLIF1 and iaf_psc_alpha cells, delays of 1..4 steps, several
//! refractory steps, every receptor port, and six virtual input nodes.

#![allow(dead_code)] // each test file uses its own subset

use lockstep_snn::CellModel;
use lockstep_snn::{
    BpttOptions, CellType, DeviceRequest, Dtype, EdgeSpec, InputSpec, Loss, NetworkSpec,
    NeuronSpec, PoissonSpec, RateUnits, VirtualNodeSpec,
};
use serde_json::json;

/// Small deterministic generator for the test network.
pub struct Lcg(pub u64);
impl Lcg {
    pub fn next(&mut self) -> f64 {
        self.0 = self
            .0
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        (self.0 >> 11) as f64 / (1u64 << 53) as f64
    }
}

/// A 9-cell network (GLIF3, GLIF1, iaf_psc_alpha) with 6 virtual inputs, weights and delays drawn from `seed`.
pub fn small_network(seed: u64) -> NetworkSpec {
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

/// The input of [`small_network`]'s 6 virtual nodes: two fixed spikes each (ms) plus
/// 60 Hz Poisson trains (seed 11).
pub fn small_input() -> InputSpec {
    InputSpec {
        spike_trains: Some(
            (0..6)
                .map(|v| vec![3.5 + v as f64, 20.2 + 2.0 * v as f64])
                .collect(),
        ),
        poisson: Some(PoissonSpec {
            rates_hz: vec![60.0; 6],
            seed: 11,
        }),
    }
}

/// The losses of the BPTT tests for `n` cells: per-cell target rates 5, 6, ... Hz and a
/// voltage regularization of cost 0.7.
pub fn losses(n: usize) -> Vec<Loss> {
    vec![
        Loss::TargetFiringRate {
            target: (0..n).map(|i| 5.0 + i as f64).collect(),
            units: RateUnits::Hz,
        },
        Loss::VoltageRegularization { cost: 0.7 },
    ]
}

/// An engine `lockstep train` can choose (`run.dtype`, `run.device`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Engine {
    /// `run.dtype: float64`: the per-sample NEST-exact reference.
    Float64,
    /// `run.dtype: float32` on CPU cores (the default).
    Float32Cpu,
    /// `run.dtype: float32`, `run.device: "gpu"` (lavapipe in CI).
    Float32Gpu,
}

impl Engine {
    /// The options that select this engine (the rest at their defaults).
    pub fn options(self) -> BpttOptions {
        let (dtype, device) = match self {
            Engine::Float64 => (Dtype::Float64, DeviceRequest::Cpu),
            Engine::Float32Cpu => (Dtype::Float32, DeviceRequest::Cpu),
            Engine::Float32Gpu => (Dtype::Float32, DeviceRequest::Gpu(None)),
        };
        BpttOptions {
            dtype,
            device,
            ..Default::default()
        }
    }

    /// The precision of the per-sample reference this engine reproduces.
    pub fn reference_dtype(self) -> Dtype {
        match self {
            Engine::Float64 => Dtype::Float64,
            Engine::Float32Cpu | Engine::Float32Gpu => Dtype::Float32,
        }
    }
}

/// Every engine `lockstep train` can choose: each edge-case test runs on all of them.
pub fn engines() -> Vec<Engine> {
    vec![Engine::Float64, Engine::Float32Cpu, Engine::Float32Gpu]
}
