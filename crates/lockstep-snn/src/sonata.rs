//! Adapter from a [`lockstep_sonata::Circuit`] to a [`NetworkSpec`], following BMTK's
//! `pointnet` mapping onto NEST (BMTK `pointnet`, NEST 3.x):
//! cells from `model_template` + `dynamics_params`; edge weight `syn_weight * nsyns` (pA,
//! sign kept); receptor from the synapse JSON's `receptor_type` (0 when absent); delay (ms)
//! from the edge (type).

use std::collections::HashMap;

use lockstep_sonata::{
    Circuit, ComponentKind, ComponentStore, EdgePopulation, NodePopulation, SpikeTrains,
};
use serde_json::Value;

use crate::error::{Result, SnnError};
use crate::network::{CellType, EdgeSpec, NetworkSpec, NeuronSpec, VirtualNodeSpec};
use crate::simulation::model::CellModel;

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
    // (population, type row, per-node parameters as JSON text or "") -> cell type
    let mut type_index: HashMap<(usize, u32, String), usize> = HashMap::new();
    let mut store = circuit.components.clone();
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
        refuse_per_node_model_columns(pop)?;
        neuron_base.insert(pop.name.as_str(), spec.neurons.len());
        for i in 0..pop.len() {
            let row = pop.type_row[i];
            let own = node_own_params(circuit, &mut store, pop, i)?;
            let key = (
                pi,
                row,
                own.as_ref().map(|v| v.to_string()).unwrap_or_default(),
            );
            let ct = match type_index.get(&key) {
                Some(&ct) => ct,
                None => {
                    let ct = add_cell_type(&mut spec, pop, i, own.as_ref())?;
                    type_index.insert(key, ct);
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
        add_edges(circuit, ep, &neuron_base, &virtual_base, &mut spec)?;
    }
    Ok(spec)
}

/// Adds the cell type of node row `i` of `pop` (with its own parameters `own`, when they
/// differ from its type's) to `spec`; returns its index.
///
/// Errors: a node type without `model_template`, and the errors of
/// [`CellModel::from_template`].
fn add_cell_type(
    spec: &mut NetworkSpec,
    pop: &NodePopulation,
    i: usize,
    own: Option<&Value>,
) -> Result<usize> {
    let row = pop.type_row[i];
    let table = &pop.types.table;
    let type_id = pop.node_type_id[i];
    let mut label = table
        .get(row as usize, "model_name")
        .or_else(|| table.get(row as usize, "pop_name"))
        .map(|n| format!("{type_id} ({n})"))
        .unwrap_or_else(|| type_id.to_string());
    if own.is_some() {
        label = format!(
            "{label}, node {} with its own dynamics_params",
            pop.node_id[i]
        );
    }
    let name = format!("{label} of population '{}'", pop.name);
    let template = pop
        .model_template(i)
        .ok_or_else(|| SnnError::UnsupportedModel {
            node_type: name.clone(),
            model: "<none>".into(),
            reason: "the node type has no model_template; point neurons need e.g. nest:glif_psc"
                .into(),
        })?;
    let params = match own {
        Some(v) => v.clone(),
        None => pop
            .dynamics_params(i)
            .map(|a| (**a).clone())
            .unwrap_or(Value::Null),
    };
    let model = CellModel::from_template(template, &params, &name)?;
    spec.cell_types.push(CellType { name: label, model });
    Ok(spec.cell_types.len() - 1)
}

/// Adds the edges of `ep` to `spec`: input edges from a virtual population, recurrent ones
/// otherwise (`neuron_base` / `virtual_base`: first neuron / virtual-node index of each
/// population).
///
/// Errors: [`SnnError::InvalidNetwork`] for unknown populations or node ids and edges into a
/// virtual population; the errors of edge columns lockstep does not apply.
#[allow(clippy::needless_range_loop)]
fn add_edges(
    circuit: &Circuit,
    ep: &EdgePopulation,
    neuron_base: &HashMap<&str, usize>,
    virtual_base: &HashMap<&str, usize>,
    spec: &mut NetworkSpec,
) -> Result<()> {
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
    refuse_unapplied_edge_columns(ep)?;
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
    Ok(())
}

/// The parameters of node row `i` when they differ from its type's: BMTK's per-node
/// parameter file (group column `dynamics_params`, loaded from `point_neuron_models_dir`)
/// or the type's JSON, with the node's SONATA per-node values (its group's
/// `dynamics_params/<name>` datasets) on top. `None` when the node uses its type's JSON as is.
fn node_own_params(
    circuit: &Circuit,
    store: &mut ComponentStore,
    pop: &NodePopulation,
    i: usize,
) -> Result<Option<Value>> {
    let file = pop.dynamics_params_file(i);
    let overrides = pop.dynamics_params_overrides(i);
    if file.is_none() && overrides.is_empty() {
        return Ok(None);
    }
    let base = match file {
        Some(name) => Some(store.load(
            circuit.config.components.point_neuron_models_dir.as_deref(),
            ComponentKind::Cell,
            name,
            &format!(
                "the per-node dynamics_params of node {} of population '{}' in '{}'",
                pop.node_id[i],
                pop.name,
                pop.file.display()
            ),
        )?),
        None => pop.dynamics_params(i).cloned(),
    };
    let mut merged = match base.as_deref() {
        Some(Value::Object(m)) => m.clone(),
        _ => serde_json::Map::new(),
    };
    for (k, v) in overrides {
        merged.insert(k.to_string(), v);
    }
    Ok(Some(Value::Object(merged)))
}

/// Node group columns that would change a node's model per node, which lockstep-snn does not
/// apply: refused by name instead of ignored.
const PER_NODE_MODEL_COLUMNS: &[&str] = &["model_template", "model_type"];

/// Refuses per-node `model_template` / `model_type` columns (the model is chosen per node
/// type here; BMTK reads them per node).
fn refuse_per_node_model_columns(pop: &NodePopulation) -> Result<()> {
    for g in &pop.groups {
        for &col in PER_NODE_MODEL_COLUMNS {
            if g.column(col).is_some() {
                return Err(SnnError::InvalidNetwork(format!(
                    "nodes '{}' ({}): group {} has a per-node '{col}' column; lockstep-snn takes {col} from the node types CSV only. Give such nodes their own node type instead",
                    pop.name,
                    pop.file.display(),
                    g.id
                )));
            }
        }
    }
    Ok(())
}

/// Edge group columns and edge-type columns that BMTK's point simulator applies per edge and
/// lockstep-snn does not: refused by name instead of ignored.
fn refuse_unapplied_edge_columns(ep: &EdgePopulation) -> Result<()> {
    for g in &ep.groups {
        for col in [
            "dynamics_params",
            "model_template",
            "weight_function",
            "receptor_type",
        ] {
            if g.column(col).is_some() {
                return Err(SnnError::InvalidNetwork(format!(
                    "edges '{}' ({}): group {} has a per-edge '{col}' column, which lockstep-snn does not apply; put it in the edge types CSV (one edge type per value)",
                    ep.name,
                    ep.file.display(),
                    g.id
                )));
            }
        }
        if let Some(c) = g.dynamics_params.first() {
            return Err(SnnError::InvalidNetwork(format!(
                "edges '{}' ({}): group {} has per-edge synapse parameters (dynamics_params/{}), which lockstep-snn does not apply; use one edge type per synapse model",
                ep.name,
                ep.file.display(),
                g.id,
                c.name
            )));
        }
    }
    let table = &ep.types.table;
    for row in 0..table.len() {
        if let Some(f) = table
            .get(row, "weight_function")
            .filter(|f| !f.is_empty() && *f != "NULL")
        {
            return Err(SnnError::InvalidNetwork(format!(
                "edges '{}': edge type {} has weight_function '{f}' ({}), a BMTK Python function lockstep-snn cannot run; write the weights it computes into syn_weight instead",
                ep.name,
                table.ids[row],
                table.shown_path().display()
            )));
        }
        if let Some(m) = table
            .get(row, "model_template")
            .filter(|m| !m.is_empty() && *m != "NULL" && *m != "static_synapse")
        {
            return Err(SnnError::InvalidNetwork(format!(
                "edges '{}': edge type {} has model_template '{m}' ({}); lockstep-snn simulates static_synapse only",
                ep.name,
                table.ids[row],
                table.shown_path().display()
            )));
        }
    }
    Ok(())
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
    let virtual_pops = spec.virtual_populations();
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
