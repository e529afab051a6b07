//! Edge populations: `/edges/<population>/{source_node_id, target_node_id, edge_type_id,
//! edge_group_id, edge_group_index, <group>/...}` joined with the edge-types CSV
//! (SONATA spec, "Edges"), with the per-edge values BMTK's point simulator uses resolved into
//! columns: `syn_weight`, `nsyns`, `delay` and the synapse model (`dynamics_params` JSON of
//! the edge type, e.g. its NEST `receptor_type`).
//!
//! Resolution rule (SONATA spec and BMTK): a value stored per edge in the edge's HDF5 group
//! wins over the edge type's CSV column. NEST weight = `syn_weight * nsyns` (pA for current
//! synapses), delay in ms.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use serde_json::Value;

use crate::column::{
    check_group_refs, open_dataset, read_groups, read_ids, read_str_attr, PopulationGroup,
};
use crate::components::{ComponentKind, ComponentStore};
use crate::config::Components;
use crate::error::{Result, SonataError, SonataErrorKind};
use crate::nodes::{to_u32, NodePopulation};
use crate::types_csv::TypeTable;

/// A synapse model: one edge type's `dynamics_params` JSON from `synaptic_models_dir`.
#[derive(Debug, Clone, PartialEq)]
pub struct SynapseModel {
    /// The file name as written in the CSV (`None` when the edge type has no
    /// `dynamics_params`; then `params` is the empty object).
    pub name: Option<String>,
    /// The parsed JSON (shared with every other user of the same file).
    pub params: Arc<Value>,
}

impl SynapseModel {
    /// NEST `receptor_type` (1-based receptor port of `glif_psc`); `None` when the JSON has
    /// none (BMTK then uses receptor 0).
    pub fn receptor_type(&self) -> Option<u64> {
        self.params.get("receptor_type").and_then(Value::as_u64)
    }
}

/// An edge-types table with the synapse model of each row loaded.
#[derive(Debug, Clone)]
pub struct EdgeTypes {
    /// The CSV table (`edge_type_id`, `syn_weight`, `delay`, `dynamics_params`,
    /// `model_template`, ...).
    pub table: TypeTable,
    /// Distinct synapse models used by the rows (by file name).
    pub synapses: Vec<SynapseModel>,
    /// Per row, index into `synapses`.
    pub synapse_of_row: Vec<u32>,
}

impl EdgeTypes {
    /// Loads every row's `dynamics_params` JSON through `store` (each file once).
    pub fn new(
        table: TypeTable,
        components: &Components,
        store: &mut ComponentStore,
    ) -> Result<Self> {
        let mut synapses: Vec<SynapseModel> = Vec::new();
        let mut by_name: HashMap<Option<String>, u32> = HashMap::new();
        let mut synapse_of_row = Vec::with_capacity(table.len());
        for row in 0..table.len() {
            let name = table.get(row, "dynamics_params").map(str::to_string);
            let idx = match by_name.get(&name) {
                Some(&i) => i,
                None => {
                    let params = match &name {
                        Some(n) => store.load(
                            components.synaptic_models_dir.as_deref(),
                            ComponentKind::Synapse,
                            n,
                            &format!(
                                "dynamics_params of edge type {} in '{}'",
                                table.ids[row],
                                table.shown_path().display()
                            ),
                        )?,
                        None => Arc::new(Value::Object(Default::default())),
                    };
                    let i = synapses.len() as u32;
                    synapses.push(SynapseModel {
                        name: name.clone(),
                        params,
                    });
                    by_name.insert(name, i);
                    i
                }
            };
            synapse_of_row.push(idx);
        }
        Ok(EdgeTypes {
            table,
            synapses,
            synapse_of_row,
        })
    }
}

/// The raw content of one edge population, as stored in the HDF5 file.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct EdgeParts {
    /// Population name (`/edges/<name>`).
    pub name: String,
    /// `node_population` attribute of `source_node_id`.
    pub source_population: String,
    /// `node_population` attribute of `target_node_id`.
    pub target_population: String,
    /// `source_node_id`, `[edge]`.
    pub source_node_id: Vec<u64>,
    /// `target_node_id`, `[edge]`.
    pub target_node_id: Vec<u64>,
    /// `edge_type_id`, `[edge]`.
    pub edge_type_id: Vec<u64>,
    /// `edge_group_id`, `[edge]`.
    pub edge_group_id: Vec<u32>,
    /// `edge_group_index`, `[edge]`.
    pub edge_group_index: Vec<u64>,
    /// Groups (`/edges/<name>/<id>/...`: `nsyns`, `syn_weight`, ...), sorted by id.
    pub groups: Vec<PopulationGroup>,
}

/// One edge population with per-edge resolved values (struct of arrays, `[edge]` each),
/// ready for building CSR connectivity.
#[derive(Debug, Clone)]
pub struct EdgePopulation {
    /// Population name (`/edges/<name>`).
    pub name: String,
    /// The edges HDF5 file.
    pub file: PathBuf,
    /// Node population of the sources.
    pub source_population: String,
    /// Node population of the targets.
    pub target_population: String,
    /// `source_node_id`, `[edge]`.
    pub source_node_id: Vec<u64>,
    /// `target_node_id`, `[edge]`.
    pub target_node_id: Vec<u64>,
    /// `edge_type_id`, `[edge]`.
    pub edge_type_id: Vec<u64>,
    /// `edge_group_id`, `[edge]`.
    pub edge_group_id: Vec<u32>,
    /// `edge_group_index`, `[edge]`.
    pub edge_group_index: Vec<u64>,
    /// Groups with their raw columns.
    pub groups: Vec<PopulationGroup>,
    /// The edge-types table (shared by the populations of one file).
    pub types: Arc<EdgeTypes>,
    /// Per edge, row of its type in `types.table`, `[edge]`.
    pub type_row: Vec<u32>,
    /// Resolved `syn_weight` per edge (group column, else edge-type CSV), `[edge]`.
    pub syn_weight: Vec<f64>,
    /// Resolved `nsyns` per edge (group column, else CSV, else 1); `None` when neither the
    /// groups nor the CSV have an `nsyns` column.
    pub nsyns: Option<Vec<u32>>,
    /// Resolved `delay` per edge in ms (group column, else CSV), `[edge]`.
    pub delay: Vec<f64>,
    /// Per edge, index into `types.synapses` (the synapse model JSON), `[edge]`.
    pub synapse_index: Vec<u32>,
}

impl EdgePopulation {
    /// Joins raw parts with a types table, validating and resolving every edge.
    /// `file` is used in error messages.
    ///
    /// Errors: datasets of different lengths, group references that name no group or row,
    /// an `edge_type_id` absent from the CSV, a value (`syn_weight`, `delay`) neither the
    /// edge's group nor its type has, a non-numeric CSV value, a non-integer `nsyns`.
    pub fn from_parts(parts: EdgeParts, types: Arc<EdgeTypes>, file: &Path) -> Result<Self> {
        let mut parts = parts;
        parts.groups.sort_by_key(|g| g.id);
        parts
            .groups
            .iter_mut()
            .for_each(PopulationGroup::sort_columns);
        let obj = format!("/edges/{}", parts.name);
        check_lengths(&parts, file, &obj)?;
        check_group_refs(
            file,
            &obj,
            "edge",
            &parts.edge_group_id,
            &parts.edge_group_index,
            &parts.groups,
        )?;
        let resolved = resolve_edges(&parts, &types, file, &obj)?;
        Ok(EdgePopulation {
            name: parts.name,
            file: file.to_path_buf(),
            source_population: parts.source_population,
            target_population: parts.target_population,
            source_node_id: parts.source_node_id,
            target_node_id: parts.target_node_id,
            edge_type_id: parts.edge_type_id,
            edge_group_id: parts.edge_group_id,
            edge_group_index: parts.edge_group_index,
            groups: parts.groups,
            types,
            type_row: resolved.type_row,
            syn_weight: resolved.syn_weight,
            nsyns: resolved.nsyns,
            delay: resolved.delay,
            synapse_index: resolved.synapse_index,
        })
    }

    /// Number of edges.
    pub fn len(&self) -> usize {
        self.source_node_id.len()
    }

    /// Frees the per-edge values that only building a network reads (targets, types, group
    /// columns, resolved weights and delays, synapse models), keeping what identifies the
    /// population and its edges for writing trained weights back: name, file, node
    /// populations, `source_node_id` (the edge count) and `nsyns`. A trainer that keeps the
    /// circuit for export calls this once the network is compiled (full V1: about 1.4 GB
    /// of 24.4M edges' columns); the population cannot be compiled again afterwards.
    pub fn release_build_columns(&mut self) {
        self.target_node_id = Vec::new();
        self.edge_type_id = Vec::new();
        self.edge_group_id = Vec::new();
        self.edge_group_index = Vec::new();
        self.groups = Vec::new();
        self.type_row = Vec::new();
        self.syn_weight = Vec::new();
        self.delay = Vec::new();
        self.synapse_index = Vec::new();
    }

    /// True when the population has no edges.
    pub fn is_empty(&self) -> bool {
        self.source_node_id.is_empty()
    }

    /// NEST weight of every edge: `syn_weight * nsyns` (BMTK pointnet), `[edge]`, pA for
    /// current-based synapses.
    pub fn weights(&self) -> Vec<f64> {
        match &self.nsyns {
            Some(ns) => self
                .syn_weight
                .iter()
                .zip(ns)
                .map(|(w, &k)| w * k as f64)
                .collect(),
            None => self.syn_weight.clone(),
        }
    }

    /// The synapse model of edge `i`.
    pub fn synapse(&self, i: usize) -> &SynapseModel {
        &self.types.synapses[self.synapse_index[i] as usize]
    }

    /// Number of edges of each edge type id, sorted by type id.
    pub fn count_by_type(&self) -> Vec<(u64, usize)> {
        let mut m = std::collections::BTreeMap::new();
        for &t in &self.edge_type_id {
            *m.entry(t).or_insert(0usize) += 1;
        }
        m.into_iter().collect()
    }

    /// Checks that every source and target id exists in the given node populations
    /// (which must be the ones named by `source_population` / `target_population`).
    pub fn check_node_ids(&self, source: &NodePopulation, target: &NodePopulation) -> Result<()> {
        for (ds, ids, pop) in [
            ("source_node_id", &self.source_node_id, source),
            ("target_node_id", &self.target_node_id, target),
        ] {
            for (i, &id) in ids.iter().enumerate() {
                if pop.index_of(id).is_none() {
                    return Err(SonataErrorKind::DanglingEdge {
                        h5: self.file.clone(),
                        object: format!("/edges/{}/{ds}", self.name),
                        edge: i,
                        node_id: id,
                        population: pop.name.clone(),
                        n_nodes: pop.len(),
                        nodes_file: pop.file.clone(),
                    }
                    .into());
                }
            }
        }
        Ok(())
    }

    /// The raw parts (for writing a copy).
    pub fn parts(&self) -> EdgeParts {
        EdgeParts {
            name: self.name.clone(),
            source_population: self.source_population.clone(),
            target_population: self.target_population.clone(),
            source_node_id: self.source_node_id.clone(),
            target_node_id: self.target_node_id.clone(),
            edge_type_id: self.edge_type_id.clone(),
            edge_group_id: self.edge_group_id.clone(),
            edge_group_index: self.edge_group_index.clone(),
            groups: self.groups.clone(),
        }
    }
}

/// Every per-edge dataset has as many rows as `source_node_id`.
fn check_lengths(parts: &EdgeParts, file: &Path, obj: &str) -> Result<()> {
    let n = parts.source_node_id.len();
    for (ds, len) in [
        ("target_node_id", parts.target_node_id.len()),
        ("edge_type_id", parts.edge_type_id.len()),
        ("edge_group_id", parts.edge_group_id.len()),
        ("edge_group_index", parts.edge_group_index.len()),
    ] {
        if len != n {
            return Err(SonataErrorKind::BadValue {
                path: file.to_path_buf(),
                object: format!("{obj}/{ds}"),
                problem: format!("has {len} rows but {obj}/source_node_id has {n}"),
            }
            .into());
        }
    }
    Ok(())
}

/// The per-edge values of one population resolved from its groups and its types CSV,
/// `[edge]` each (see [`EdgePopulation`]).
struct ResolvedEdges {
    type_row: Vec<u32>,
    syn_weight: Vec<f64>,
    nsyns: Option<Vec<u32>>,
    delay: Vec<f64>,
    synapse_index: Vec<u32>,
}

/// Where one value (`syn_weight`, `delay`, `nsyns`) comes from: a dataset in each group
/// (`None` where a group has none) and a column of the types CSV (`None` per empty cell).
struct ValueSource {
    groups: Vec<Option<Vec<f64>>>,
    csv: Vec<Option<f64>>,
}

impl ValueSource {
    /// Reads column `name` of every group of `parts` and of the types `table`.
    ///
    /// Errors: a group dataset that is not 1-D numeric, a CSV cell that is not a number.
    fn read(
        name: &str,
        parts: &EdgeParts,
        table: &TypeTable,
        file: &Path,
        obj: &str,
    ) -> Result<Self> {
        let csv = (0..table.len())
            .map(|r| match table.get(r, name) {
                None => Ok(None),
                Some(s) => s.parse::<f64>().map(Some).map_err(|_| {
                    SonataError::from(SonataErrorKind::MissingValue {
                        what: name.to_string(),
                        kind: "edge".into(),
                        type_id: table.ids[r],
                        csv: table.shown_path(),
                        population: parts.name.clone(),
                        h5: file.to_path_buf(),
                        problem: format!("'{s}' is not a number"),
                    })
                }),
            })
            .collect::<Result<_>>()?;
        let groups = parts
            .groups
            .iter()
            .map(|g| match g.column(name) {
                None => Ok(None),
                Some(c) => match c.data.to_f64() {
                    Some(v) if c.width == 1 => Ok(Some(v)),
                    _ => Err(SonataErrorKind::WrongDtype {
                        path: file.to_path_buf(),
                        object: format!("{obj}/{}/{name}", g.id),
                        found: format!("{} with width {}", c.data.dtype_name(), c.width),
                        expected: "a 1-D numeric dataset".into(),
                    }
                    .into()),
                },
            })
            .collect::<Result<_>>()?;
        Ok(ValueSource { groups, csv })
    }

    /// True when some group or some CSV row has a value.
    fn is_present(&self) -> bool {
        self.csv.iter().any(Option::is_some) || self.groups.iter().any(Option::is_some)
    }

    /// The value of the edge at `index` of group position `group` (if any) whose type is
    /// CSV `row`: the group's value wins over the type's (SONATA, BMTK).
    fn get(&self, group: Option<usize>, index: usize, row: usize) -> Option<f64> {
        group
            .and_then(|g| self.groups[g].as_ref())
            .and_then(|v| v.get(index).copied())
            .or(self.csv[row])
    }
}

/// Resolves every edge's type row, synapse model, `syn_weight`, `delay` and `nsyns`.
///
/// Errors: see [`EdgePopulation::from_parts`].
fn resolve_edges(
    parts: &EdgeParts,
    types: &EdgeTypes,
    file: &Path,
    obj: &str,
) -> Result<ResolvedEdges> {
    let table = &types.table;
    let weight = ValueSource::read("syn_weight", parts, table, file, obj)?;
    let delay = ValueSource::read("delay", parts, table, file, obj)?;
    let nsyns = ValueSource::read("nsyns", parts, table, file, obj)?;
    let has_nsyns = nsyns.is_present();
    let group_pos: HashMap<u32, usize> = parts
        .groups
        .iter()
        .enumerate()
        .map(|(i, g)| (g.id, i))
        .collect();
    let n = parts.source_node_id.len();
    let mut out = ResolvedEdges {
        type_row: Vec::with_capacity(n),
        syn_weight: Vec::with_capacity(n),
        nsyns: has_nsyns.then(|| Vec::with_capacity(n)),
        delay: Vec::with_capacity(n),
        synapse_index: Vec::with_capacity(n),
    };
    let mut cache: Option<(u64, usize)> = None;
    for i in 0..n {
        let t = parts.edge_type_id[i];
        let row = match cache {
            Some((ct, cr)) if ct == t => cr,
            _ => {
                let r = table.row_of(t).ok_or_else(|| {
                    SonataError::from(SonataErrorKind::UnknownTypeId {
                        h5: file.to_path_buf(),
                        object: format!("{obj}/edge_type_id"),
                        column: "edge_type_id".into(),
                        id: t,
                        row: i,
                        csv: table.shown_path(),
                        known: table.known_ids(),
                    })
                })?;
                cache = Some((t, r));
                r
            }
        };
        out.type_row.push(row as u32);
        out.synapse_index.push(types.synapse_of_row[row]);
        let g = group_pos.get(&parts.edge_group_id[i]).copied();
        let gi = parts.edge_group_index[i] as usize;
        let missing = |what: &str| {
            SonataError::from(SonataErrorKind::MissingValue {
                what: what.to_string(),
                kind: "edge".into(),
                type_id: t,
                csv: table.shown_path(),
                population: parts.name.clone(),
                h5: file.to_path_buf(),
                problem: format!(
                    "edge {i} has no '{what}': neither its group {obj}/{} nor the edge-types CSV has a value; add a '{what}' column",
                    parts.edge_group_id[i]
                ),
            })
        };
        out.syn_weight.push(
            weight
                .get(g, gi, row)
                .ok_or_else(|| missing("syn_weight"))?,
        );
        out.delay
            .push(delay.get(g, gi, row).ok_or_else(|| missing("delay"))?);
        if let Some(ns) = out.nsyns.as_mut() {
            let v = nsyns.get(g, gi, row).unwrap_or(1.0);
            if !(v >= 0.0 && v.fract() == 0.0 && v <= u32::MAX as f64) {
                return Err(SonataErrorKind::BadValue {
                    path: file.to_path_buf(),
                    object: format!("{obj} nsyns"),
                    problem: format!("edge {i} has nsyns = {v}, expected a non-negative integer"),
                }
                .into());
            }
            ns.push(v as u32);
        }
    }
    Ok(out)
}

/// Reads the raw parts of every population of an edges file (no types join).
pub fn read_edge_parts(path: &Path) -> Result<Vec<EdgeParts>> {
    let file = crate::open_h5(path, "edges file")?;
    let root = file.group("edges").map_err(|_| {
        SonataError::from(SonataErrorKind::MissingDataset {
            path: path.to_path_buf(),
            object: "/edges".into(),
            hint:
                "a SONATA edges file has a top-level 'edges' group with one subgroup per population"
                    .into(),
        })
    })?;
    let names = root
        .member_names()
        .map_err(|e| SonataError::h5(path, "/edges", e))?;
    let mut out = Vec::with_capacity(names.len());
    for name in names {
        let obj = format!("/edges/{name}");
        let pop = root
            .group(&name)
            .map_err(|e| SonataError::h5(path, &obj, e))?;
        let hint = |ds: &str| format!("every edge population needs '{ds}'");
        let src = open_dataset(path, &pop, "source_node_id", &hint("source_node_id"))?;
        let tgt = open_dataset(path, &pop, "target_node_id", &hint("target_node_id"))?;
        let pop_attr = |ds: &hdf5::Dataset, which: &str| -> Result<String> {
            read_str_attr(path, ds, "node_population")?.ok_or_else(|| {
                SonataError::from(SonataErrorKind::MissingDataset {
                    path: path.to_path_buf(),
                    object: format!("{obj}/{which}@node_population"),
                    hint: "the attribute naming the node population of the ids is required".into(),
                })
            })
        };
        let source_population = pop_attr(&src, "source_node_id")?;
        let target_population = pop_attr(&tgt, "target_node_id")?;
        let source_node_id = read_ids(path, &src)?;
        let target_node_id = read_ids(path, &tgt)?;
        let edge_type_id = read_ids(
            path,
            &open_dataset(path, &pop, "edge_type_id", &hint("edge_type_id"))?,
        )?;
        let edge_group_id = read_ids(
            path,
            &open_dataset(path, &pop, "edge_group_id", &hint("edge_group_id"))?,
        )?;
        let edge_group_index = read_ids(
            path,
            &open_dataset(path, &pop, "edge_group_index", &hint("edge_group_index"))?,
        )?;
        let edge_group_id = to_u32(path, &format!("{obj}/edge_group_id"), edge_group_id)?;
        let groups = read_groups(path, &pop, &["indices"])?;
        out.push(EdgeParts {
            name,
            source_population,
            target_population,
            source_node_id,
            target_node_id,
            edge_type_id,
            edge_group_id,
            edge_group_index,
            groups,
        });
    }
    Ok(out)
}

/// Reads every population of an edges file joined with its edge-types CSV (node ids are not
/// checked here; [`crate::Circuit`] checks them against the node populations).
pub fn read_edges(
    edges_file: &Path,
    edge_types_file: &Path,
    components: &Components,
    store: &mut ComponentStore,
) -> Result<Vec<EdgePopulation>> {
    let parts = read_edge_parts(edges_file)?;
    join_edges(parts, edges_file, edge_types_file, components, store)
}

/// Joins the raw populations of `edges_file` with the edge-types CSV `edge_types_file`
/// (see [`read_edges`]).
pub fn join_edges(
    parts: Vec<EdgeParts>,
    edges_file: &Path,
    edge_types_file: &Path,
    components: &Components,
    store: &mut ComponentStore,
) -> Result<Vec<EdgePopulation>> {
    let table = TypeTable::read(edge_types_file, "edge_type_id")?;
    let types = Arc::new(EdgeTypes::new(table, components, store)?);
    parts
        .into_iter()
        .map(|p| EdgePopulation::from_parts(p, types.clone(), edges_file))
        .collect()
}

/// The name of the node-to-ranges dataset of an edge index group in the SONATA spec (and
/// libsonata's index queries).
pub const NODE_ID_TO_RANGES: &str = "node_id_to_ranges";
/// The name BMTK's network builder gives the same dataset (and BMTK reads).
pub const NODE_ID_TO_RANGE_BMTK: &str = "node_id_to_range";

/// Which lookup index of an edge population (`indices/<direction>`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EdgeIndexDirection {
    /// `indices/source_to_target`: the edges of each source node.
    SourceToTarget,
    /// `indices/target_to_source`: the edges of each target node.
    TargetToSource,
}

impl EdgeIndexDirection {
    /// The index group's name.
    pub fn as_str(self) -> &'static str {
        match self {
            EdgeIndexDirection::SourceToTarget => "source_to_target",
            EdgeIndexDirection::TargetToSource => "target_to_source",
        }
    }
}

/// One lookup index of an edge population (SONATA spec, "Edges", indices).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct EdgeIndex {
    /// Per node id, the half-open range of rows of [`EdgeIndex::range_to_edge_id`] that
    /// belong to it.
    pub node_id_to_ranges: Vec<[u64; 2]>,
    /// Half-open ranges of edge rows.
    pub range_to_edge_id: Vec<[u64; 2]>,
}

impl EdgeIndex {
    /// The edge rows of node `node` in index order (empty for a node the index lacks).
    pub fn edges_of(&self, node: u64) -> Vec<u64> {
        let Some(&[a, b]) = self.node_id_to_ranges.get(node as usize) else {
            return Vec::new();
        };
        self.range_to_edge_id[a as usize..b as usize]
            .iter()
            .flat_map(|&[s, e]| s..e)
            .collect()
    }
}

/// Reads an `[rows, 2]` uint64 dataset of an index group.
fn read_pairs(path: &Path, g: &hdf5::Group, name: &str) -> Result<Vec<[u64; 2]>> {
    let obj = format!("{}/{name}", g.name());
    let ds = g
        .dataset(name)
        .map_err(|e| SonataError::h5(path, &obj, e))?;
    let shape = ds.shape();
    if !matches!(shape.as_slice(), [_, 2] | [0]) {
        return Err(SonataErrorKind::WrongDtype {
            path: path.to_path_buf(),
            object: obj,
            found: format!("shape {shape:?}"),
            expected: "an integer dataset of shape [rows, 2]".into(),
        }
        .into());
    }
    let flat: Vec<u64> = ds.read_raw().map_err(|e| SonataError::h5(path, &obj, e))?;
    Ok(flat.chunks_exact(2).map(|c| [c[0], c[1]]).collect())
}

/// Reads the lookup index `direction` of edge population `population` in the edges file
/// `path`. The node-to-ranges dataset is read under either name: `node_id_to_ranges` (the
/// SONATA spec's, libsonata's) or `node_id_to_range` (BMTK's builder's).
///
/// Errors: the file, population or index group is missing, neither name exists, a dataset
/// is not `[rows, 2]` integers, or a range points outside the dataset it indexes.
pub fn read_edge_index(
    path: impl AsRef<Path>,
    population: &str,
    direction: EdgeIndexDirection,
) -> Result<EdgeIndex> {
    let path = path.as_ref();
    let file = crate::open_h5(path, "edges file")?;
    let obj = format!("/edges/{population}/indices/{}", direction.as_str());
    let g = file.group(&obj).map_err(|_| {
        SonataError::from(SonataErrorKind::MissingDataset {
            path: path.to_path_buf(),
            object: obj.clone(),
            hint: "the edge population has no such lookup index".into(),
        })
    })?;
    let name = [NODE_ID_TO_RANGES, NODE_ID_TO_RANGE_BMTK]
        .into_iter()
        .find(|n| g.link_exists(n))
        .ok_or_else(|| {
            SonataError::from(SonataErrorKind::MissingDataset {
                path: path.to_path_buf(),
                object: format!("{obj}/{NODE_ID_TO_RANGES}"),
                hint: format!(
                    "an index group holds {NODE_ID_TO_RANGES} (or BMTK's {NODE_ID_TO_RANGE_BMTK})"
                ),
            })
        })?;
    let index = EdgeIndex {
        node_id_to_ranges: read_pairs(path, &g, name)?,
        range_to_edge_id: read_pairs(path, &g, "range_to_edge_id")?,
    };
    let bad = |what: &str, row: usize, [a, b]: [u64; 2], len: usize| {
        SonataError::from(SonataErrorKind::BadValue {
            path: path.to_path_buf(),
            object: format!("{obj}/{what}"),
            problem: format!("row {row} is [{a}, {b}], not a range within 0..{len}"),
        })
    };
    let rows = index.range_to_edge_id.len();
    for (i, &r) in index.node_id_to_ranges.iter().enumerate() {
        if r[0] > r[1] || r[1] as usize > rows {
            return Err(bad(name, i, r, rows));
        }
    }
    let edges = file
        .dataset(&format!("/edges/{population}/source_node_id"))
        .ok()
        .map(|d| d.size());
    for (i, &r) in index.range_to_edge_id.iter().enumerate() {
        if r[0] > r[1] || edges.is_some_and(|n| r[1] as usize > n) {
            return Err(bad("range_to_edge_id", i, r, edges.unwrap_or(0)));
        }
    }
    Ok(index)
}
