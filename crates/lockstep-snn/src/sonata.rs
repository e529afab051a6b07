//! Adapter from a [`lockstep_sonata::Circuit`] to a [`NetworkSpec`], following BMTK's
//! `pointnet` mapping onto NEST (see `../shared/data/reference/README.md`):
//! cells from `model_template` + `dynamics_params`; edge weight `syn_weight * nsyns` (pA,
//! sign kept); receptor from the synapse JSON's `receptor_type` (0 when absent); delay (ms)
//! from the edge (type).

use std::collections::HashMap;

use lockstep_sonata::{Circuit, SpikeTrains};

use crate::error::{Result, SnnError};
use crate::model::CellModel;
use crate::network::{CellType, EdgeSpec, NetworkSpec, NeuronSpec, VirtualNodeSpec};

/// Builds the network description of every population of `circuit`.
///
/// Non-virtual populations become neurons (circuit order, file order within a population),
/// virtual populations become input nodes. Edges from virtual populations are input edges,
/// the others recurrent; edges into a virtual population are an error.
#[allow(clippy::needless_range_loop)]
pub fn network_spec_from_circuit(circuit: &Circuit) -> Result<NetworkSpec> {
    let mut spec = NetworkSpec::default();
    // (population index, node index) -> neuron / virtual index
    let mut neuron_base: HashMap<&str, usize> = HashMap::new();
    let mut virtual_base: HashMap<&str, usize> = HashMap::new();
    let mut type_index: HashMap<(usize, u32), usize> = HashMap::new();
    for (pi, pop) in circuit.nodes.iter().enumerate() {
        if pop.is_virtual {
            virtual_base.insert(pop.name.as_str(), spec.virtual_nodes.len());
            for &id in &pop.node_id {
                spec.virtual_nodes.push(VirtualNodeSpec {
                    population: pop.name.clone(),
                    node_id: id,
                });
            }
            continue;
        }
        neuron_base.insert(pop.name.as_str(), spec.neurons.len());
        for i in 0..pop.len() {
            let row = pop.type_row[i];
            let ct = match type_index.get(&(pi, row)) {
                Some(&ct) => ct,
                None => {
                    let table = &pop.types.table;
                    let type_id = pop.node_type_id[i];
                    let label = table
                        .get(row as usize, "model_name")
                        .or_else(|| table.get(row as usize, "pop_name"))
                        .map(|n| format!("{type_id} ({n})"))
                        .unwrap_or_else(|| type_id.to_string());
                    let name = format!("{label} of population '{}'", pop.name);
                    let template = pop.model_template(i).ok_or_else(|| SnnError::UnsupportedModel {
                        node_type: name.clone(),
                        model: "<none>".into(),
                        reason: "the node type has no model_template; point neurons need e.g. nest:glif_psc".into(),
                    })?;
                    let params = pop
                        .dynamics_params(i)
                        .map(|a| (**a).clone())
                        .unwrap_or(serde_json::Value::Null);
                    let model = CellModel::from_template(template, &params, &name)?;
                    spec.cell_types.push(CellType { name: label, model });
                    let ct = spec.cell_types.len() - 1;
                    type_index.insert((pi, row), ct);
                    ct
                }
            };
            spec.neurons.push(NeuronSpec {
                population: pop.name.clone(),
                node_id: pop.node_id[i],
                cell_type: ct,
            });
        }
    }
    for ep in &circuit.edges {
        let src_pop = circuit
            .node_population(&ep.source_population)
            .ok_or_else(|| {
                SnnError::InvalidNetwork(format!(
                    "edges '{}': unknown source population '{}'",
                    ep.name, ep.source_population
                ))
            })?;
        let tgt_pop = circuit
            .node_population(&ep.target_population)
            .ok_or_else(|| {
                SnnError::InvalidNetwork(format!(
                    "edges '{}': unknown target population '{}'",
                    ep.name, ep.target_population
                ))
            })?;
        let Some(&tbase) = neuron_base.get(tgt_pop.name.as_str()) else {
            return Err(SnnError::InvalidNetwork(format!(
                "edges '{}' ({}) target the virtual population '{}'; virtual nodes cannot receive spikes",
                ep.name,
                ep.file.display(),
                tgt_pop.name
            )));
        };
        let weights = ep.weights();
        let (is_input, sbase) = match virtual_base.get(src_pop.name.as_str()) {
            Some(&b) => (true, b),
            None => (false, neuron_base[src_pop.name.as_str()]),
        };
        for i in 0..ep.len() {
            let s = src_pop.index_of(ep.source_node_id[i]).ok_or_else(|| {
                SnnError::InvalidNetwork(format!(
                    "edges '{}' edge {i}: source node id {} not in population '{}'",
                    ep.name, ep.source_node_id[i], src_pop.name
                ))
            })?;
            let t = tgt_pop.index_of(ep.target_node_id[i]).ok_or_else(|| {
                SnnError::InvalidNetwork(format!(
                    "edges '{}' edge {i}: target node id {} not in population '{}'",
                    ep.name, ep.target_node_id[i], tgt_pop.name
                ))
            })?;
            let receptor = ep.synapse(i).receptor_type().map(|r| r as i64).unwrap_or(0);
            let e = EdgeSpec {
                source: sbase + s,
                target: tbase + t,
                weight: weights[i],
                receptor,
                delay_ms: ep.delay[i],
            };
            if is_input {
                spec.input_edges.push(e);
            } else {
                spec.recurrent_edges.push(e);
            }
        }
    }
    Ok(spec)
}

/// Spike trains (ms) per virtual node of `spec` from a SONATA spike file.
///
/// Every population of the file must be a virtual population of the network (its spikes go
/// to those nodes); `file` names the source in errors. When `node_set` is given, the file
/// must contain spikes of that population.
pub fn spike_trains_for_virtual_nodes(
    spec: &NetworkSpec,
    spikes: &SpikeTrains,
    file: &str,
    node_set: Option<&str>,
) -> Result<Vec<Vec<f64>>> {
    let mut index: HashMap<(&str, u64), usize> = HashMap::new();
    for (v, vn) in spec.virtual_nodes.iter().enumerate() {
        index.insert((vn.population.as_str(), vn.node_id), v);
    }
    let virtual_pops: Vec<&str> = {
        let mut p: Vec<&str> = spec
            .virtual_nodes
            .iter()
            .map(|v| v.population.as_str())
            .collect();
        p.dedup();
        p
    };
    let mut trains = vec![Vec::new(); spec.virtual_nodes.len()];
    let mut used_node_set = false;
    for pop in &spikes.populations {
        // Old single-population files name no population: map them to the node set.
        let name: &str = if pop.population.is_empty() {
            node_set.unwrap_or("")
        } else {
            pop.population.as_str()
        };
        if let Some(ns) = node_set {
            if ns != name {
                continue;
            }
            used_node_set = true;
        }
        if !virtual_pops.contains(&name) {
            return Err(SnnError::InvalidInput {
                input: file.into(),
                reason: format!(
                    "spikes of population '{name}', which is not a virtual population of the network (virtual: {})",
                    virtual_pops.join(", ")
                ),
            });
        }
        for (k, (&id, &t)) in pop.node_ids.iter().zip(&pop.timestamps).enumerate() {
            let v = *index.get(&(name, id)).ok_or_else(|| SnnError::InvalidInput {
                input: file.into(),
                reason: format!("spike {k} of population '{name}' has node id {id}, which the population lacks"),
            })?;
            trains[v].push(t);
        }
    }
    if let (Some(ns), false) = (node_set, used_node_set) {
        return Err(SnnError::InvalidInput {
            input: file.into(),
            reason: format!(
                "no spikes for node_set '{ns}' (file populations: {})",
                spikes
                    .populations
                    .iter()
                    .map(|p| p.population.as_str())
                    .collect::<Vec<_>>()
                    .join(", ")
            ),
        });
    }
    for t in &mut trains {
        t.sort_by(f64::total_cmp);
    }
    Ok(trains)
}

/// Writes trained weights as SONATA edges files into `dir`, one per edges file of `circuit`
/// (same file name), readable by BMTK and NEST: each edge gets a per-edge `syn_weight` of
/// `w / nsyns` (so that BMTK's `syn_weight * nsyns` is the trained weight `w`, pA).
///
/// `recurrent` and `input` are the weights in the spec order of
/// [`network_spec_from_circuit`] (e.g. from [`crate::SnnModel::weights_in_spec_order`]).
/// Returns the files written.
pub fn export_trained_weights(
    circuit: &Circuit,
    recurrent: &[f64],
    input: &[f64],
    dir: &std::path::Path,
) -> Result<Vec<std::path::PathBuf>> {
    let mut written: Vec<std::path::PathBuf> = Vec::new();
    let (mut r, mut i) = (0usize, 0usize);
    let n_rec: usize = circuit
        .edges
        .iter()
        .filter(|e| {
            circuit
                .node_population(&e.source_population)
                .is_some_and(|p| !p.is_virtual)
        })
        .map(|e| e.len())
        .sum();
    let n_in: usize = circuit.edges.iter().map(|e| e.len()).sum::<usize>() - n_rec;
    if recurrent.len() != n_rec || input.len() != n_in {
        return Err(SnnError::Shape(format!(
            "{} recurrent and {} input weights given; the circuit has {n_rec} and {n_in}",
            recurrent.len(),
            input.len()
        )));
    }
    for ep in &circuit.edges {
        let is_input = circuit
            .node_population(&ep.source_population)
            .is_some_and(|p| p.is_virtual);
        let w = if is_input {
            i += ep.len();
            &input[i - ep.len()..i]
        } else {
            r += ep.len();
            &recurrent[r - ep.len()..r]
        };
        let syn_weight: Vec<f64> = match &ep.nsyns {
            Some(ns) => w
                .iter()
                .zip(ns)
                .map(|(&w, &k)| if k > 0 { w / k as f64 } else { w })
                .collect(),
            None => w.to_vec(),
        };
        let name = ep.file.file_name().ok_or_else(|| {
            SnnError::InvalidNetwork(format!(
                "edges file '{}' has no file name",
                ep.file.display()
            ))
        })?;
        let dst = dir.join(name);
        let src = if written.contains(&dst) {
            dst.clone()
        } else {
            ep.file.clone()
        };
        lockstep_sonata::rewrite_syn_weights(&src, &dst, &ep.name, &syn_weight)?;
        if !written.contains(&dst) {
            written.push(dst);
        }
    }
    Ok(written)
}
