//! Generated benchmark/test networks.

use crate::network::{CellType, EdgeSpec, NetworkSpec, NeuronSpec, VirtualNodeSpec};
use crate::simulation::model::CellModel;

/// Deterministic 64-bit LCG (Knuth MMIX constants) for network generation.
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

/// The all-to-all GLIF3 network of the training test and benchmark (issue 5).
///
/// `n_cells` GLIF3 cells with the Scnn1a parameters of `point_450glifs`
/// (`593618144_glif_lif_asc_psc.json`), every ordered pair connected (no autapses): every
/// fifth cell inhibitory (port 2, -1..-3 pA), the others excitatory (port 1, 0.5..1.5 pA),
/// delays 1..4 ms. `n_inputs` virtual nodes (population `lgn`) each reach a random 20% of the
/// cells (port 1, 35..50 pA, 1 ms). Weights are drawn from `seed`.
pub fn all_to_all_glif3(n_cells: usize, n_inputs: usize, seed: u64) -> NetworkSpec {
    let params = serde_json::json!({
        "V_m": -69.4755859375, "V_th": -46.40370561385434, "g": 5.875377136608159,
        "E_L": -69.4755859375, "C_m": 58.60769058316611, "t_ref": 2.6000000000000005,
        "V_reset": -69.4755859375, "asc_init": [0.0, 0.0], "asc_decay": [0.1, 0.3],
        "asc_amps": [-36.93387266, -65.30848816], "tau_syn": [5.5, 8.5, 2.8, 5.8],
        "spike_dependent_threshold": false, "after_spike_currents": true, "adapting_threshold": false
    });
    let model = CellModel::from_template("nest:glif_psc", &params, "100 (Scnn1a)")
        .expect("the built-in Scnn1a parameters are valid");
    let mut rng = Lcg(seed);
    let neurons = (0..n_cells)
        .map(|i| NeuronSpec {
            population: "v1".into(),
            node_id: i as u64,
            cell_type: 0,
        })
        .collect();
    let mut recurrent_edges = Vec::with_capacity(n_cells * n_cells.saturating_sub(1));
    for s in 0..n_cells {
        let inhibitory = s % 5 == 4;
        for t in 0..n_cells {
            if s == t {
                continue;
            }
            let (weight, receptor) = if inhibitory {
                (-(1.0 + 2.0 * rng.next()), 2)
            } else {
                (0.5 + rng.next(), 1)
            };
            let delay_ms = 1.0 + (rng.next() * 4.0).floor();
            recurrent_edges.push(EdgeSpec {
                source: s,
                target: t,
                weight,
                receptor,
                delay_ms,
            });
        }
    }
    let virtual_nodes = (0..n_inputs)
        .map(|i| VirtualNodeSpec {
            population: "lgn".into(),
            node_id: i as u64,
        })
        .collect();
    let mut input_edges = Vec::new();
    for v in 0..n_inputs {
        for t in 0..n_cells {
            if rng.next() < 0.2 {
                input_edges.push(EdgeSpec {
                    source: v,
                    target: t,
                    weight: 35.0 + 15.0 * rng.next(),
                    receptor: 1,
                    delay_ms: 1.0,
                });
            }
        }
    }
    NetworkSpec {
        cell_types: vec![CellType {
            name: "100 (Scnn1a)".into(),
            model,
        }],
        neurons,
        virtual_nodes,
        recurrent_edges,
        input_edges,
    }
}
