//! Network description (plain structs) and its compiled, simulation-ready form.
//!
//! [`NetworkSpec`] is what a reader (SONATA adapter, test, generator) fills in: cell types,
//! neurons with their type, virtual input nodes, recurrent and input edges with weight (pA),
//! NEST receptor type and delay (ms). [`NetworkSpec::compile`] validates it for a time step
//! and builds [`Network`]:
//! * neurons reordered so that each cell type is one contiguous [`Group`] (one set of
//!   constants, branch-free inner loops); `order`/`rank` map internal <-> external index;
//! * edges in CSR form per presynaptic source, grouped by (delay, port) into [`Segment`]s,
//!   so a spike touches only its out-edges and delivery costs spikes x fan-out.
//!
//! Edge weights are kept outside the CSR in flat buffers in CSR order (`weights_rec`,
//! `weights_in`), which are the trainable parameter buffers; `edge_id` maps a CSR slot back
//! to the edge's index in the spec.

use crate::error::{Result, SnnError};
use crate::simulation::model::{CellConsts, CellModel};
use crate::simulation::nest::TimeGrid;

/// One cell type (SONATA node type) with its model.
#[derive(Debug, Clone, PartialEq)]
pub struct CellType {
    /// Name used in messages and outputs, e.g. `"101 (Rorb)"`.
    pub name: String,
    /// The model and its parameters.
    pub model: CellModel,
}

/// One simulated (non-virtual) neuron.
#[derive(Debug, Clone, PartialEq)]
pub struct NeuronSpec {
    /// Population name (SONATA), e.g. `"v1"`.
    pub population: String,
    /// SONATA node id within the population.
    pub node_id: u64,
    /// Index into [`NetworkSpec::cell_types`].
    pub cell_type: usize,
}

/// One virtual (input) node.
#[derive(Debug, Clone, PartialEq)]
pub struct VirtualNodeSpec {
    /// Population name, e.g. `"lgn"`.
    pub population: String,
    /// SONATA node id within the population.
    pub node_id: u64,
}

/// One synaptic connection.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct EdgeSpec {
    /// Source index: a neuron index (recurrent edges) or virtual-node index (input edges).
    pub source: usize,
    /// Target neuron index.
    pub target: usize,
    /// Weight in pA (`syn_weight * nsyns`); sign kept.
    pub weight: f64,
    /// NEST receptor type (glif_psc: 1-based port; iaf_psc_alpha: 0).
    pub receptor: i64,
    /// Delay in ms.
    pub delay_ms: f64,
}

/// A network before compilation. Indices refer to the vectors of this struct.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct NetworkSpec {
    /// Cell types (parameter sets).
    pub cell_types: Vec<CellType>,
    /// Simulated neurons (external order = output order).
    pub neurons: Vec<NeuronSpec>,
    /// Virtual input nodes.
    pub virtual_nodes: Vec<VirtualNodeSpec>,
    /// Neuron -> neuron edges.
    pub recurrent_edges: Vec<EdgeSpec>,
    /// Virtual node -> neuron edges.
    pub input_edges: Vec<EdgeSpec>,
}

/// A contiguous range of internal neuron indices sharing one parameter set.
#[derive(Debug, Clone)]
pub struct Group {
    /// Index into [`NetworkSpec::cell_types`].
    pub cell_type: usize,
    /// Per-step constants.
    pub consts: CellConsts,
    /// First internal index.
    pub start: usize,
    /// One past the last internal index.
    pub end: usize,
}

/// Edges of one source with the same delay and port: CSR slots `start..end`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Segment {
    /// Delay in steps (>= 1).
    pub delay: u32,
    /// Receptor port (0-based).
    pub port: u32,
    /// First CSR slot.
    pub start: u32,
    /// One past the last CSR slot.
    pub end: u32,
}

/// Edges in CSR form per presynaptic source, grouped by (delay, port).
#[derive(Debug, Clone, Default)]
pub struct Csr {
    /// `[n_sources + 1]`: segments of source `s` are `seg_ptr[s]..seg_ptr[s+1]`.
    pub seg_ptr: Vec<u32>,
    /// Segments.
    pub segments: Vec<Segment>,
    /// `[n_edges]`: `target * n_ports` for the internal target neuron index `target`, the
    /// offset of the target within a `[neuron, port]` slot of the ring buffer (add the
    /// segment's port).
    pub target_off: Vec<u32>,
    /// `[n_edges]`: index of the edge in the spec's edge vector.
    pub edge_id: Vec<u32>,
}

impl Csr {
    /// Number of edges.
    pub fn len(&self) -> usize {
        self.target_off.len()
    }
    /// True when there are no edges.
    pub fn is_empty(&self) -> bool {
        self.target_off.is_empty()
    }
    /// Segments of source `s`.
    #[inline]
    pub fn segments_of(&self, s: usize) -> &[Segment] {
        &self.segments[self.seg_ptr[s] as usize..self.seg_ptr[s + 1] as usize]
    }

    /// First CSR slot of source `s` (the number of edges for `s == n_sources`): source
    /// `s`'s edges are the slots `edge_start(s) .. edge_start(s + 1)`.
    #[inline]
    pub fn edge_start(&self, s: usize) -> usize {
        self.segments
            .get(self.seg_ptr[s] as usize)
            .map_or(self.len(), |seg| seg.start as usize)
    }
}

/// A compiled network at one time step.
#[derive(Debug, Clone)]
pub struct Network {
    /// Time grid (dt in ms).
    pub grid: TimeGrid,
    /// Cell types (copied from the spec).
    pub cell_types: Vec<CellType>,
    /// Neurons (external order).
    pub neurons: Vec<NeuronSpec>,
    /// Virtual nodes.
    pub virtual_nodes: Vec<VirtualNodeSpec>,
    /// Groups of internal indices with one parameter set each, in order.
    pub groups: Vec<Group>,
    /// `order[internal] = external` neuron index.
    pub order: Vec<u32>,
    /// `rank[external] = internal` neuron index.
    pub rank: Vec<u32>,
    /// Ports per neuron in the state layout (max over cell types).
    pub n_ports: usize,
    /// After-spike currents per neuron in the state layout (max over cell types).
    pub n_asc: usize,
    /// Largest delay in steps (>= 1).
    pub max_delay: usize,
    /// Recurrent edges, sources are internal neuron indices.
    pub recurrent: Csr,
    /// Input edges, sources are virtual-node indices.
    pub input: Csr,
    /// `[n_recurrent_edges]` recurrent weights in CSR order (pA).
    pub weights_rec: Vec<f64>,
    /// `[n_input_edges]` input weights in CSR order (pA).
    pub weights_in: Vec<f64>,
}

impl NetworkSpec {
    /// The populations of the virtual nodes, each once, in the order of their first node.
    pub fn virtual_populations(&self) -> Vec<&str> {
        let mut pops: Vec<&str> = Vec::new();
        for vn in &self.virtual_nodes {
            if !pops.contains(&vn.population.as_str()) {
                pops.push(&vn.population);
            }
        }
        pops
    }

    /// Validate and compile for time step `dt` (ms).
    ///
    /// Errors: unknown indices, receptor types the target model lacks, delays shorter than
    /// one step (NEST: "delay must be >= resolution"), non-finite weights.
    pub fn compile(&self, dt: f64) -> Result<Network> {
        let grid = TimeGrid::new(dt)?;
        let n = self.neurons.len();
        for (i, nr) in self.neurons.iter().enumerate() {
            if nr.cell_type >= self.cell_types.len() {
                return Err(SnnError::InvalidNetwork(format!(
                    "neuron {i} (population {}, node {}) has cell type index {} but only {} cell types exist",
                    nr.population,
                    nr.node_id,
                    nr.cell_type,
                    self.cell_types.len()
                )));
            }
        }
        // Internal order: stable sort by cell type.
        let mut order: Vec<u32> = (0..n as u32).collect();
        order.sort_by_key(|&e| self.neurons[e as usize].cell_type);
        let mut rank = vec![0u32; n];
        for (i, &e) in order.iter().enumerate() {
            rank[e as usize] = i as u32;
        }
        let mut groups: Vec<Group> = Vec::new();
        for (i, &e) in order.iter().enumerate() {
            let ct = self.neurons[e as usize].cell_type;
            match groups.last_mut() {
                Some(g) if g.cell_type == ct => g.end = i + 1,
                _ => groups.push(Group {
                    cell_type: ct,
                    consts: self.cell_types[ct].model.constants(&grid),
                    start: i,
                    end: i + 1,
                }),
            }
        }
        let n_ports = self
            .cell_types
            .iter()
            .map(|c| c.model.n_ports())
            .max()
            .unwrap_or(1)
            .max(1);
        let n_asc = self
            .cell_types
            .iter()
            .map(|c| c.model.n_asc())
            .max()
            .unwrap_or(0);

        let mut max_delay = 1usize;
        let (mut recurrent, weights_rec) = self.build_csr(
            &self.recurrent_edges,
            n,
            "recurrent",
            &grid,
            &rank,
            &mut max_delay,
            true,
        )?;
        let (mut input, weights_in) = self.build_csr(
            &self.input_edges,
            self.virtual_nodes.len(),
            "input",
            &grid,
            &rank,
            &mut max_delay,
            false,
        )?;
        if (n as u64) * (n_ports as u64) > u32::MAX as u64 {
            return Err(SnnError::InvalidNetwork(format!(
                "{n} neurons x {n_ports} ports exceed the 32-bit state index"
            )));
        }
        for csr in [&mut recurrent, &mut input] {
            for t in &mut csr.target_off {
                *t *= n_ports as u32;
            }
        }
        Ok(Network {
            grid,
            cell_types: self.cell_types.clone(),
            neurons: self.neurons.clone(),
            virtual_nodes: self.virtual_nodes.clone(),
            groups,
            order,
            rank,
            n_ports,
            n_asc,
            max_delay,
            recurrent,
            input,
            weights_rec,
            weights_in,
        })
    }

    #[allow(clippy::too_many_arguments)]
    fn build_csr(
        &self,
        edges: &[EdgeSpec],
        n_sources: usize,
        kind: &str,
        grid: &TimeGrid,
        rank: &[u32],
        max_delay: &mut usize,
        sources_are_neurons: bool,
    ) -> Result<(Csr, Vec<f64>)> {
        let n = self.neurons.len();
        let describe = |i: usize, e: &EdgeSpec| -> String {
            let src = if sources_are_neurons {
                self.neurons
                    .get(e.source)
                    .map(|s| format!("{}:{}", s.population, s.node_id))
            } else {
                self.virtual_nodes
                    .get(e.source)
                    .map(|s| format!("{}:{}", s.population, s.node_id))
            };
            let tgt = self
                .neurons
                .get(e.target)
                .map(|s| format!("{}:{}", s.population, s.node_id));
            format!(
                "{kind} edge {i} ({} -> {})",
                src.unwrap_or_else(|| format!("#{}", e.source)),
                tgt.unwrap_or_else(|| format!("#{}", e.target))
            )
        };
        // (source, delay, port, target_internal, edge index)
        let mut keyed: Vec<(u32, u32, u32, u32, u32)> = Vec::with_capacity(edges.len());
        for (i, e) in edges.iter().enumerate() {
            if e.source >= n_sources || e.target >= n {
                return Err(SnnError::InvalidNetwork(format!(
                    "{}: source index {} (of {n_sources}) or target index {} (of {n}) out of range",
                    describe(i, e),
                    e.source,
                    e.target
                )));
            }
            if !e.weight.is_finite() {
                return Err(SnnError::InvalidNetwork(format!(
                    "{}: weight {} is not finite",
                    describe(i, e),
                    e.weight
                )));
            }
            if !(e.delay_ms.is_finite() && e.delay_ms >= grid.dt) {
                return Err(SnnError::DelayTooShort {
                    edges: describe(i, e),
                    delay_ms: e.delay_ms,
                    dt: grid.dt,
                });
            }
            let d = grid.delay_ms_to_steps(e.delay_ms);
            if d < 1 {
                return Err(SnnError::DelayTooShort {
                    edges: describe(i, e),
                    delay_ms: e.delay_ms,
                    dt: grid.dt,
                });
            }
            let ct = &self.cell_types[self.neurons[e.target].cell_type];
            let port = ct.model.port_of(e.receptor, e.weight).map_err(|reason| {
                SnnError::InvalidReceptor {
                    edges: describe(i, e),
                    receptor: e.receptor,
                    node_type: ct.name.clone(),
                    model: ct.model.template().into(),
                    reason: reason.to_string(),
                }
            })?;
            *max_delay = (*max_delay).max(d as usize);
            let src = if sources_are_neurons {
                rank[e.source]
            } else {
                e.source as u32
            };
            keyed.push((src, d as u32, port as u32, rank[e.target], i as u32));
        }
        keyed.sort_unstable();
        let mut csr = Csr {
            seg_ptr: Vec::with_capacity(n_sources + 1),
            segments: Vec::new(),
            target_off: Vec::with_capacity(keyed.len()),
            edge_id: Vec::with_capacity(keyed.len()),
        };
        let mut weights = Vec::with_capacity(keyed.len());
        let mut k = 0usize;
        for s in 0..n_sources as u32 {
            csr.seg_ptr.push(csr.segments.len() as u32);
            while k < keyed.len() && keyed[k].0 == s {
                let (_, d, p, _, _) = keyed[k];
                let start = k;
                while k < keyed.len() && keyed[k].0 == s && keyed[k].1 == d && keyed[k].2 == p {
                    // The target index; scaled by the port count once it is known.
                    csr.target_off.push(keyed[k].3);
                    csr.edge_id.push(keyed[k].4);
                    weights.push(edges[keyed[k].4 as usize].weight);
                    k += 1;
                }
                csr.segments.push(Segment {
                    delay: d,
                    port: p,
                    start: start as u32,
                    end: k as u32,
                });
            }
        }
        csr.seg_ptr.push(csr.segments.len() as u32);
        Ok((csr, weights))
    }
}

impl Network {
    /// Number of simulated neurons.
    pub fn n_neurons(&self) -> usize {
        self.neurons.len()
    }
    /// Number of virtual input nodes.
    pub fn n_virtual(&self) -> usize {
        self.virtual_nodes.len()
    }
    /// Ring-buffer length in steps (`max_delay + 1`).
    pub fn ring_len(&self) -> usize {
        self.max_delay + 1
    }
    /// Cell constants of the group containing internal neuron `i`.
    ///
    /// # Panics
    /// If `i >= n_neurons()`.
    pub fn consts_of(&self, i: usize) -> &CellConsts {
        let g = self
            .groups
            .iter()
            .find(|g| g.start <= i && i < g.end)
            .expect("internal index in range");
        &g.consts
    }

    /// `[group][live port]` each group's live receptor ports: the 0-based ports (ascending)
    /// on which at least one recurrent or input edge reaches a neuron of the group.
    ///
    /// A port no edge reaches keeps its PSC state at zero for a whole trial (NEST starts it
    /// at zero), so the kernels skip it: its share of the membrane update is `+0.0` (BMTK's
    /// GLIF3 cells declare 4 receptor types; excitatory V1 cells receive on 2 of them).
    pub fn live_ports(&self) -> Vec<Vec<usize>> {
        let np = self.n_ports.max(1) as u32;
        // Bit k of `live[i]`: some edge reaches neuron i on port k (ports beyond 63 are
        // always kept).
        let mut live = vec![0u64; self.n_neurons()];
        for csr in [&self.recurrent, &self.input] {
            for seg in &csr.segments {
                let bit = 1u64.checked_shl(seg.port).unwrap_or(0);
                for &o in &csr.target_off[seg.start as usize..seg.end as usize] {
                    live[(o / np) as usize] |= bit;
                }
            }
        }
        self.groups
            .iter()
            .map(|g| {
                let mask = live[g.start..g.end].iter().fold(0u64, |m, &l| m | l);
                (0..g.consts.ports.len())
                    .filter(|&k| k >= 64 || mask & (1u64 << k) != 0)
                    .collect()
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn csr_groups_by_source_delay_and_port_and_maps_back() {
        let glif = CellModel::from_template("nest:glif_psc", &json!({"tau_syn": [2.0, 3.0]}), "g")
            .unwrap();
        let iaf = CellModel::from_template("nest:iaf_psc_alpha", &json!({}), "i").unwrap();
        let e = |source, target, weight, receptor, delay_ms| EdgeSpec {
            source,
            target,
            weight,
            receptor,
            delay_ms,
        };
        let spec = NetworkSpec {
            cell_types: vec![
                CellType {
                    name: "i".into(),
                    model: iaf,
                },
                CellType {
                    name: "g".into(),
                    model: glif,
                },
            ],
            // external order: glif, iaf, glif -> internal order: iaf (type 0) first
            neurons: vec![
                NeuronSpec {
                    population: "p".into(),
                    node_id: 0,
                    cell_type: 1,
                },
                NeuronSpec {
                    population: "p".into(),
                    node_id: 1,
                    cell_type: 0,
                },
                NeuronSpec {
                    population: "p".into(),
                    node_id: 2,
                    cell_type: 1,
                },
            ],
            virtual_nodes: vec![],
            recurrent_edges: vec![
                e(0, 2, 1.0, 2, 0.3),  // 0: delay 3, port 1
                e(0, 1, -2.0, 0, 0.1), // 1: iaf, negative -> port 1, delay 1
                e(0, 2, 3.0, 1, 0.1),  // 2: delay 1, port 0
                e(2, 0, 4.0, 1, 0.2),  // 3
                e(0, 1, 5.0, 0, 0.1),  // 4: iaf, positive -> port 0, delay 1
            ],
            input_edges: vec![],
        };
        let net = spec.compile(0.1).unwrap();
        assert_eq!(net.order, vec![1, 0, 2]);
        assert_eq!(net.rank, vec![1, 0, 2]);
        assert_eq!(net.groups.len(), 2);
        assert_eq!(
            (
                net.groups[0].start,
                net.groups[0].end,
                net.groups[1].start,
                net.groups[1].end
            ),
            (0, 1, 1, 3)
        );
        assert_eq!(net.n_ports, 2);
        assert_eq!(net.max_delay, 3);
        // Source external 0 = internal 1: segments sorted by (delay, port).
        let segs = net.recurrent.segments_of(1);
        let keys: Vec<(u32, u32)> = segs.iter().map(|s| (s.delay, s.port)).collect();
        assert_eq!(keys, vec![(1, 0), (1, 1), (3, 1)]);
        // Delay 1, port 0 holds edge 4 (to iaf, internal 0) and edge 2 (to glif, internal 2).
        let s0 = segs[0];
        let ids: Vec<u32> = net.recurrent.edge_id[s0.start as usize..s0.end as usize].to_vec();
        assert_eq!(ids, vec![4, 2]);
        for (slot, &id) in net.recurrent.edge_id.iter().enumerate() {
            let ed = &spec.recurrent_edges[id as usize];
            assert_eq!(net.weights_rec[slot], ed.weight);
            assert_eq!(net.recurrent.target_off[slot], net.rank[ed.target] * 2);
        }
        assert!(net.recurrent.segments_of(0).is_empty());
        assert_eq!(net.recurrent.segments_of(2).len(), 1);
    }
}
