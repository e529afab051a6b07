//! Node populations: `/nodes/<population>/{node_id, node_type_id, node_group_id,
//! node_group_index, <group>/...}` of a nodes HDF5 file joined with its node-types CSV
//! (SONATA spec, "Nodes").

use std::borrow::Cow;
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use serde_json::{Map, Value};

use crate::column::{check_group_refs, open_dataset, read_groups, read_ids, PopulationGroup};
use crate::components::{ComponentKind, ComponentStore};
use crate::config::Components;
use crate::error::{Result, SonataError, SonataErrorKind};
use crate::types_csv::TypeTable;

/// A node-types table with each row's cell `dynamics_params` JSON loaded.
#[derive(Debug, Clone)]
pub struct NodeTypes {
    /// The CSV table (`node_type_id`, `model_type`, `model_template`, `dynamics_params`, ...).
    pub table: TypeTable,
    /// Per row: the parsed `dynamics_params` JSON (from `point_neuron_models_dir`), `None`
    /// when the row has none (virtual cells) or it is not a `.json` file.
    pub dynamics_params: Vec<Option<Arc<Value>>>,
}

impl NodeTypes {
    /// Loads every row's `dynamics_params` JSON through `store` (each file once).
    pub fn new(
        table: TypeTable,
        components: &Components,
        store: &mut ComponentStore,
    ) -> Result<Self> {
        let mut dynamics_params = Vec::with_capacity(table.len());
        for row in 0..table.len() {
            let dp = match table.get(row, "dynamics_params") {
                Some(name) if name.ends_with(".json") => Some(store.load(
                    components.point_neuron_models_dir.as_deref(),
                    ComponentKind::Cell,
                    name,
                    &format!(
                        "dynamics_params of node type {} in '{}'",
                        table.ids[row],
                        table.shown_path().display()
                    ),
                )?),
                _ => None,
            };
            dynamics_params.push(dp);
        }
        Ok(NodeTypes {
            table,
            dynamics_params,
        })
    }

    /// `model_type` of a row (`point_neuron`, `virtual`, `biophysical`, ...).
    pub fn model_type(&self, row: usize) -> Option<&str> {
        self.table.get(row, "model_type")
    }

    /// `model_template` of a row (e.g. `nest:glif_psc`).
    pub fn model_template(&self, row: usize) -> Option<&str> {
        self.table.get(row, "model_template")
    }
}

/// Lookup node id -> row.
#[derive(Debug, Clone)]
enum IdLookup {
    /// `node_id[i] == i` for all rows.
    Contiguous(usize),
    Map(HashMap<u64, usize>),
}

/// The raw content of one node population, as stored in the HDF5 file.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct NodeParts {
    /// Population name (`/nodes/<name>`).
    pub name: String,
    /// `node_id`, `[node]`, unique.
    pub node_id: Vec<u64>,
    /// `node_type_id`, `[node]`, each a row of the node-types CSV.
    pub node_type_id: Vec<u64>,
    /// `node_group_id`, `[node]`.
    pub node_group_id: Vec<u32>,
    /// `node_group_index`, `[node]`: row inside the node's group.
    pub node_group_index: Vec<u64>,
    /// The groups (`/nodes/<name>/<id>/...`), sorted by id.
    pub groups: Vec<PopulationGroup>,
}

/// One node population joined with its node types (struct of arrays, one entry per node).
#[derive(Debug, Clone)]
pub struct NodePopulation {
    /// Population name (`/nodes/<name>`).
    pub name: String,
    /// The nodes HDF5 file (or `<in-memory>` for built populations).
    pub file: PathBuf,
    /// True for virtual (input) populations: every node type has `model_type == "virtual"`,
    /// or the config's `populations.<name>.type` is `"virtual"`.
    pub is_virtual: bool,
    /// `node_id`, `[node]`.
    pub node_id: Vec<u64>,
    /// `node_type_id`, `[node]`.
    pub node_type_id: Vec<u64>,
    /// `node_group_id`, `[node]`.
    pub node_group_id: Vec<u32>,
    /// `node_group_index`, `[node]`.
    pub node_group_index: Vec<u64>,
    /// Groups with their columns (`x`, `y`, `z`, ...), sorted by id.
    pub groups: Vec<PopulationGroup>,
    /// The node-types table (shared by the populations of one file).
    pub types: Arc<NodeTypes>,
    /// Per node, the row of its type in `types`, `[node]`.
    pub type_row: Vec<u32>,
    lookup: IdLookup,
}

impl NodePopulation {
    /// Joins raw parts with a types table, validating ids, types and group references.
    /// `file` is used in error messages.
    pub fn from_parts(
        parts: NodeParts,
        types: Arc<NodeTypes>,
        file: &Path,
        force_virtual: bool,
    ) -> Result<Self> {
        let mut parts = parts;
        parts.groups.sort_by_key(|g| g.id);
        parts
            .groups
            .iter_mut()
            .for_each(PopulationGroup::sort_columns);
        let obj = format!("/nodes/{}", parts.name);
        let n = parts.node_id.len();
        for (ds, len) in [
            ("node_type_id", parts.node_type_id.len()),
            ("node_group_id", parts.node_group_id.len()),
            ("node_group_index", parts.node_group_index.len()),
        ] {
            if len != n {
                return Err(SonataErrorKind::BadValue {
                    path: file.to_path_buf(),
                    object: format!("{obj}/{ds}"),
                    problem: format!("has {len} rows but {obj}/node_id has {n}"),
                }
                .into());
            }
        }
        check_group_refs(
            file,
            &obj,
            "node",
            &parts.node_group_id,
            &parts.node_group_index,
            &parts.groups,
        )?;
        let mut type_row = Vec::with_capacity(n);
        let mut cache: Option<(u64, u32)> = None;
        for (i, &t) in parts.node_type_id.iter().enumerate() {
            let row = match cache {
                Some((ct, cr)) if ct == t => cr,
                _ => {
                    let r = types.table.row_of(t).ok_or_else(|| {
                        SonataError::from(SonataErrorKind::UnknownTypeId {
                            h5: file.to_path_buf(),
                            object: format!("{obj}/node_type_id"),
                            column: "node_type_id".into(),
                            id: t,
                            row: i,
                            csv: types.table.shown_path(),
                            known: types.table.known_ids(),
                        })
                    })? as u32;
                    cache = Some((t, r));
                    r
                }
            };
            type_row.push(row);
        }
        let lookup = if parts
            .node_id
            .iter()
            .enumerate()
            .all(|(i, &id)| id == i as u64)
        {
            IdLookup::Contiguous(n)
        } else {
            let mut m = HashMap::with_capacity(n);
            for (i, &id) in parts.node_id.iter().enumerate() {
                if let Some(prev) = m.insert(id, i) {
                    return Err(SonataErrorKind::BadValue {
                        path: file.to_path_buf(),
                        object: format!("{obj}/node_id"),
                        problem: format!("node id {id} appears twice (rows {prev} and {i})"),
                    }
                    .into());
                }
            }
            IdLookup::Map(m)
        };
        let all_virtual = n > 0
            && type_row
                .iter()
                .all(|&r| types.model_type(r as usize) == Some("virtual"));
        Ok(NodePopulation {
            name: parts.name,
            file: file.to_path_buf(),
            is_virtual: force_virtual || all_virtual,
            node_id: parts.node_id,
            node_type_id: parts.node_type_id,
            node_group_id: parts.node_group_id,
            node_group_index: parts.node_group_index,
            groups: parts.groups,
            types,
            type_row,
            lookup,
        })
    }

    /// Number of nodes.
    pub fn len(&self) -> usize {
        self.node_id.len()
    }

    /// True when the population has no nodes.
    pub fn is_empty(&self) -> bool {
        self.node_id.is_empty()
    }

    /// Row of the node with id `node_id`, if it exists.
    pub fn index_of(&self, node_id: u64) -> Option<usize> {
        match &self.lookup {
            IdLookup::Contiguous(n) => usize::try_from(node_id).ok().filter(|&i| i < *n),
            IdLookup::Map(m) => m.get(&node_id).copied(),
        }
    }

    /// The cell `dynamics_params` JSON of node row `i` (shared per node type).
    pub fn dynamics_params(&self, i: usize) -> Option<&Arc<Value>> {
        self.types.dynamics_params[self.type_row[i] as usize].as_ref()
    }

    /// The node's own `dynamics_params` values (SONATA per-node overrides): one `(name, value)`
    /// per dataset of its group's `dynamics_params` subgroup, in name order; a 1-D dataset
    /// gives a number (or string), a `[node, k]` dataset an array of `k` values (e.g.
    /// `asc_amps`). Empty when the node has none.
    pub fn dynamics_params_overrides(&self, i: usize) -> Vec<(&str, Value)> {
        let gid = self.node_group_id[i];
        let Some(g) = self.groups.iter().find(|g| g.id == gid) else {
            return Vec::new();
        };
        let row = self.node_group_index[i] as usize;
        g.dynamics_params
            .iter()
            .filter_map(|c| {
                let v = if c.width == 1 {
                    c.data.get_json(row)?
                } else {
                    let vals: Option<Vec<Value>> = (0..c.width)
                        .map(|k| c.data.get_json(row * c.width + k))
                        .collect();
                    Value::Array(vals?)
                };
                Some((c.name.as_str(), v))
            })
            .collect()
    }

    /// BMTK's per-node parameter file: the value of the node's group column
    /// `dynamics_params` (a JSON file name in `point_neuron_models_dir`), when its group has
    /// such a string column and the value is neither empty nor `NULL`.
    pub fn dynamics_params_file(&self, i: usize) -> Option<&str> {
        let gid = self.node_group_id[i];
        let g = self.groups.iter().find(|g| g.id == gid)?;
        let c = g.column("dynamics_params")?;
        match &c.data {
            crate::column::ColumnData::Str(v) => v
                .get(self.node_group_index[i] as usize)
                .map(String::as_str)
                .filter(|s| !s.is_empty() && *s != "NULL"),
            _ => None,
        }
    }

    /// The cell parameters of node row `i`: its type's `dynamics_params` JSON with the
    /// node's own values ([`NodePopulation::dynamics_params_overrides`]) replacing the keys
    /// they name. Borrowed when the node has no overrides; `None` when the type has no JSON
    /// and the node no overrides. (A per-node parameter file,
    /// [`NodePopulation::dynamics_params_file`], is the caller's to load.)
    pub fn cell_params(&self, i: usize) -> Option<Cow<'_, Value>> {
        let base = self.dynamics_params(i);
        let overrides = self.dynamics_params_overrides(i);
        if overrides.is_empty() {
            return base.map(|b| Cow::Borrowed(b.as_ref()));
        }
        let mut merged = match base.map(|b| b.as_ref()) {
            Some(Value::Object(m)) => m.clone(),
            _ => Map::new(),
        };
        for (k, v) in overrides {
            merged.insert(k.to_string(), v);
        }
        Some(Cow::Owned(Value::Object(merged)))
    }

    /// `model_template` of node row `i`.
    pub fn model_template(&self, i: usize) -> Option<&str> {
        self.types.model_template(self.type_row[i] as usize)
    }

    /// The value of property `name` for every node, as f64: the node's group column wins,
    /// else the node-types CSV column. `None` for a node where neither has a numeric value.
    pub fn property_f64(&self, name: &str) -> Vec<Option<f64>> {
        let gcols: Vec<Option<&crate::column::Column>> =
            self.groups.iter().map(|g| g.column(name)).collect();
        (0..self.len())
            .map(|i| {
                let g = self
                    .groups
                    .iter()
                    .position(|g| g.id == self.node_group_id[i]);
                if let Some(Some(c)) = g.map(|g| gcols[g]) {
                    if let Some(v) = c.data.get_f64(self.node_group_index[i] as usize * c.width) {
                        return Some(v);
                    }
                }
                self.types
                    .table
                    .get(self.type_row[i] as usize, name)
                    .and_then(|s| s.parse().ok())
            })
            .collect()
    }

    /// Number of nodes of each node type id, sorted by type id.
    pub fn count_by_type(&self) -> Vec<(u64, usize)> {
        let mut m = std::collections::BTreeMap::new();
        for &t in &self.node_type_id {
            *m.entry(t).or_insert(0usize) += 1;
        }
        m.into_iter().collect()
    }

    /// The raw parts (for writing a copy).
    pub fn parts(&self) -> NodeParts {
        NodeParts {
            name: self.name.clone(),
            node_id: self.node_id.clone(),
            node_type_id: self.node_type_id.clone(),
            node_group_id: self.node_group_id.clone(),
            node_group_index: self.node_group_index.clone(),
            groups: self.groups.clone(),
        }
    }
}

/// Reads the raw parts of every population of a nodes file (no types join).
pub fn read_node_parts(path: &Path) -> Result<Vec<NodeParts>> {
    let file = crate::open_h5(path, "nodes file")?;
    let root = file.group("nodes").map_err(|_| {
        SonataError::from(SonataErrorKind::MissingDataset {
            path: path.to_path_buf(),
            object: "/nodes".into(),
            hint:
                "a SONATA nodes file has a top-level 'nodes' group with one subgroup per population"
                    .into(),
        })
    })?;
    let names = root
        .member_names()
        .map_err(|e| SonataError::h5(path, "/nodes", e))?;
    let mut out = Vec::with_capacity(names.len());
    for name in names {
        let obj = format!("/nodes/{name}");
        let pop = root
            .group(&name)
            .map_err(|e| SonataError::h5(path, &obj, e))?;
        let hint = |ds: &str| format!("every node population needs '{ds}'");
        let node_id = read_ids(
            path,
            &open_dataset(path, &pop, "node_id", &hint("node_id"))?,
        )?;
        let node_type_id = read_ids(
            path,
            &open_dataset(path, &pop, "node_type_id", &hint("node_type_id"))?,
        )?;
        let node_group_id = read_ids(
            path,
            &open_dataset(path, &pop, "node_group_id", &hint("node_group_id"))?,
        )?;
        let node_group_index = read_ids(
            path,
            &open_dataset(path, &pop, "node_group_index", &hint("node_group_index"))?,
        )?;
        let node_group_id = to_u32(path, &format!("{obj}/node_group_id"), node_group_id)?;
        let groups = read_groups(path, &pop, &[])?;
        out.push(NodeParts {
            name,
            node_id,
            node_type_id,
            node_group_id,
            node_group_index,
            groups,
        });
    }
    Ok(out)
}

pub(crate) fn to_u32(path: &Path, object: &str, v: Vec<u64>) -> Result<Vec<u32>> {
    v.iter()
        .enumerate()
        .map(|(i, &x)| {
            u32::try_from(x).map_err(|_| {
                SonataError::from(SonataErrorKind::BadValue {
                    path: path.to_path_buf(),
                    object: object.to_string(),
                    problem: format!("row {i} holds {x}, larger than a group id can be (u32)"),
                })
            })
        })
        .collect()
}

/// Reads every population of a nodes file joined with its node-types CSV.
/// `populations` is the config entry's optional `populations` object (`type: "virtual"`).
pub fn read_nodes(
    nodes_file: &Path,
    node_types_file: &Path,
    populations: &Map<String, Value>,
    components: &Components,
    store: &mut ComponentStore,
) -> Result<Vec<NodePopulation>> {
    let parts = read_node_parts(nodes_file)?;
    join_nodes(
        parts,
        nodes_file,
        node_types_file,
        populations,
        components,
        store,
    )
}

/// Joins the raw populations of `nodes_file` with the node-types CSV `node_types_file`
/// (see [`read_nodes`]).
pub fn join_nodes(
    parts: Vec<NodeParts>,
    nodes_file: &Path,
    node_types_file: &Path,
    populations: &Map<String, Value>,
    components: &Components,
    store: &mut ComponentStore,
) -> Result<Vec<NodePopulation>> {
    let table = TypeTable::read(node_types_file, "node_type_id")?;
    let types = Arc::new(NodeTypes::new(table, components, store)?);
    parts
        .into_iter()
        .map(|p| {
            let forced = populations
                .get(&p.name)
                .and_then(|v| v.get("type"))
                .and_then(Value::as_str)
                == Some("virtual");
            NodePopulation::from_parts(p, types.clone(), nodes_file, forced)
        })
        .collect()
}
