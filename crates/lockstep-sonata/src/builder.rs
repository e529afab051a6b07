//! A small network builder: a JSON *recipe* in, SONATA files with BMTK's layout out
//! (the same files BMTK's `NetworkBuilder.save` writes, readable by BMTK and by
//! [`Circuit::from_config`](crate::Circuit::from_config)).
//!
//! # Recipe format
//!
//! ```json
//! {
//!   "seed": 1234,
//!   "network_dir": "network",
//!   "components": {
//!     "point_neuron_models_dir": "../point_components/cell_models",
//!     "synaptic_models_dir": "../point_components/synaptic_models"
//!   },
//!   "nodes": [
//!     {"population": "v1", "types": [
//!       {"node_type_id": 100, "count": 200, "model_type": "point_neuron",
//!        "model_template": "nest:glif_psc", "dynamics_params": "593618144_glif_lif_asc_psc.json",
//!        "ei": "e", "pop_name": "Scnn1a", "target_rate_hz": 10.0}
//!     ]},
//!     {"population": "lgn", "virtual": true, "types": [
//!       {"node_type_id": 100, "count": 100, "ei": "e", "pop_name": "lgn"}
//!     ]}
//!   ],
//!   "edges": [
//!     {"source": "v1", "target": "v1", "types": [
//!       {"edge_type_id": 100, "source_query": {"ei": "e"}, "target_query": {"ei": "e"},
//!        "connection": {"rule": "all_to_all", "allow_self": false},
//!        "syn_weight": 2.5, "delay": 1.5, "dynamics_params": "e2e.json", "nsyns": 1},
//!       {"edge_type_id": 101, "source_query": {"ei": "i"},
//!        "connection": {"rule": "random", "p": 0.2},
//!        "syn_weight": {"distribution": "normal", "mean": -3.0, "std": 0.5},
//!        "delay": 2.0, "dynamics_params": "i2e.json"}
//!     ]}
//!   ]
//! }
//! ```
//!
//! * `seed` (default 0): every random choice (random connections, per-edge weights) is drawn
//!   from SplitMix64 streams (Steele, Lea & Flood 2014) seeded from it, the edge population's
//!   position and the edge type's position, so a recipe builds the same files every time.
//! * `network_dir` (default `network`): folder of the HDF5/CSV files, relative to the output.
//! * `components`: `components` folders of the circuit config, relative to the recipe file's
//!   folder. Cell `dynamics_params` files must exist in `point_neuron_models_dir` and synapse
//!   ones in `synaptic_models_dir` when those are given.
//! * `nodes[]`: one node population each. `virtual: true` makes an input population (its types
//!   get `model_type = "virtual"`). Each type has a `node_type_id`, a `count` (> 0) and any
//!   further node-type columns (strings, numbers or booleans, written to
//!   `<pop>_node_types.csv`): `model_type` (default `point_neuron`, or `virtual`),
//!   `model_template`, `dynamics_params`, `ei`, `pop_name`, ... Node ids are `0..n` in type
//!   order. The optional `target_rate_hz` (Hz) is not a column: it goes to `target_rates.csv`.
//! * `edges[]`: one edge population `<source>_to_<target>` per (source, target) pair. Each
//!   edge type selects its source and target nodes with `source_query` / `target_query`
//!   (node-type column = value; all must match; absent = every node) and connects them by
//!   `connection`: `{"rule": "all_to_all", "allow_self": false}` (every pair) or
//!   `{"rule": "random", "p": 0.1, "allow_self": false, "seed": n}` (each pair independently
//!   with probability `p`; `seed` replaces the derived seed). `allow_self` (default false) only
//!   matters when source and target population are the same. `syn_weight` (pA for current
//!   synapses, NEST convention) is a number (a column of the edge-types CSV) or a per-edge
//!   distribution `{"distribution": "uniform", "low": a, "high": b}` /
//!   `{"distribution": "normal", "mean": m, "std": s}` (a `syn_weight` dataset in the edges
//!   file). `delay` (ms, > 0), `dynamics_params` (synapse JSON, e.g. with the 1-based
//!   `receptor_type` port of `glif_psc`), `model_template` (default `static_synapse`) and
//!   `nsyns` (integer >= 1, optional; NEST weight = `syn_weight * nsyns`) are edge-type
//!   columns. Pairs selected by two edge types get one edge of each type.
//!
//! # Output (see [`BuiltNetwork::save`])
//!
//! `<out>/config.circuit.json` (BMTK-style manifest `"$BASE_DIR": "${configdir}"`, so BMTK
//! finds the files from any working directory, and `$NETWORK_DIR`), and in
//! `<out>/<network_dir>/`: `<pop>_nodes.h5`, `<pop>_node_types.csv`, `<src>_<tgt>_edges.h5`,
//! `<src>_<tgt>_edge_types.csv`; `<out>/target_rates.csv` (`node_id,population,firing_rate`, Hz; the column `lockstep train` reads)
//! when any node type has `target_rate_hz`. Edges are sorted by target, then source node id.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

use lockstep_core::rng::SplitMix64;
use serde::Deserialize;
use serde_json::{json, Value};

use crate::column::{Column, ColumnData, PopulationGroup};
use crate::edges::EdgeParts;
use crate::error::SonataError;
use crate::nodes::NodeParts;
use crate::types_csv::TypeTable;
use crate::write::{write_edges, write_nodes, EdgesView, NodesView};

/// Errors of the network builder. Messages name the recipe, the key and the offending value.
#[derive(Debug, thiserror::Error)]
pub enum BuildError {
    /// The recipe file cannot be read.
    #[error("recipe '{path}' cannot be read: {cause}")]
    Io {
        /// The recipe file.
        path: PathBuf,
        /// The I/O error.
        cause: std::io::Error,
    },
    /// The recipe is not valid JSON.
    #[error("recipe '{path}' is not a valid network recipe: {cause} (see the lockstep_sonata::builder docs for the format)")]
    Parse {
        /// The recipe file.
        path: PathBuf,
        /// The JSON error (with line and column).
        cause: serde_json::Error,
    },
    /// A value of the recipe is invalid.
    #[error("recipe '{recipe}', key '{key}': {problem}")]
    Invalid {
        /// The recipe file (or `<in-memory recipe>`).
        recipe: PathBuf,
        /// Key path of the offending value, e.g. `edges[0].types[1].connection.p`.
        key: String,
        /// What is wrong and how to fix it.
        problem: String,
    },
    /// An output file exists and overwriting was not requested.
    #[error("output file '{path}' already exists; pass --overwrite (overwrite = true) to replace it, or choose another output folder")]
    Exists {
        /// The existing file.
        path: PathBuf,
    },
    /// An output file or folder cannot be written.
    #[error("cannot write '{path}': {cause}")]
    Write {
        /// The file or folder.
        path: PathBuf,
        /// The I/O error.
        cause: std::io::Error,
    },
    /// Writing a SONATA file failed.
    #[error(transparent)]
    Sonata(#[from] SonataError),
}

type BResult<T> = std::result::Result<T, BuildError>;

/// A parsed network recipe (see the module docs for the JSON format).
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Recipe {
    /// Seed of every random choice (default 0).
    #[serde(default)]
    pub seed: u64,
    /// Folder of the network files, relative to the output folder (default `network`).
    #[serde(default = "default_network_dir")]
    pub network_dir: String,
    /// `components` folders (config key -> folder relative to [`Recipe::base_dir`]).
    #[serde(default)]
    pub components: BTreeMap<String, String>,
    /// Node populations.
    pub nodes: Vec<NodePopulationSpec>,
    /// Edge populations.
    #[serde(default)]
    pub edges: Vec<EdgePopulationSpec>,
    /// Folder that relative `components` paths resolve against (the recipe file's folder).
    #[serde(skip)]
    pub base_dir: PathBuf,
    /// The recipe file, for messages (`<in-memory recipe>` when parsed from a string).
    #[serde(skip)]
    pub file: PathBuf,
}

fn default_network_dir() -> String {
    "network".into()
}

/// One node population of a recipe.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NodePopulationSpec {
    /// Population name (`/nodes/<population>`, file prefix).
    pub population: String,
    /// Virtual (input) population: no cell model, only spike sources.
    #[serde(default, rename = "virtual")]
    pub is_virtual: bool,
    /// Node types, in node-id order.
    pub types: Vec<NodeTypeSpec>,
}

/// One node type: how many nodes, and its node-types CSV columns.
#[derive(Debug, Clone, Deserialize)]
pub struct NodeTypeSpec {
    /// `node_type_id`.
    pub node_type_id: u64,
    /// Number of nodes of this type (> 0).
    pub count: usize,
    /// Target firing rate of these nodes (Hz) for `target_rates.csv`; not a CSV column.
    #[serde(default)]
    pub target_rate_hz: Option<f64>,
    /// Every other key: a node-types CSV column (`model_type`, `model_template`,
    /// `dynamics_params`, `ei`, `pop_name`, ...).
    #[serde(flatten)]
    pub columns: BTreeMap<String, Value>,
}

/// The edges from one node population to another.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EdgePopulationSpec {
    /// Source node population.
    pub source: String,
    /// Target node population (not virtual).
    pub target: String,
    /// Edge types.
    pub types: Vec<EdgeTypeSpec>,
}

/// One edge type: which pairs it connects and its synapse.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EdgeTypeSpec {
    /// `edge_type_id` (fits uint32).
    pub edge_type_id: u64,
    /// Source node selection: node-type column = value (all must match; empty = all nodes).
    #[serde(default)]
    pub source_query: BTreeMap<String, Value>,
    /// Target node selection, like `source_query`.
    #[serde(default)]
    pub target_query: BTreeMap<String, Value>,
    /// Connection rule.
    pub connection: Connection,
    /// Weight (pA for current synapses): a number or a per-edge distribution object.
    pub syn_weight: SynWeight,
    /// Transmission delay, ms (> 0).
    pub delay: f64,
    /// Synapse model JSON file (in `synaptic_models_dir`).
    #[serde(default)]
    pub dynamics_params: Option<String>,
    /// Synapse template (default `static_synapse`).
    #[serde(default)]
    pub model_template: Option<String>,
    /// Synapses per edge (>= 1), optional.
    #[serde(default)]
    pub nsyns: Option<u32>,
}

/// A connection rule between the selected source and target nodes.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(tag = "rule", rename_all = "snake_case", deny_unknown_fields)]
pub enum Connection {
    /// Every (source, target) pair.
    AllToAll {
        /// Connect a node to itself (same population only; default false).
        #[serde(default)]
        allow_self: bool,
    },
    /// Each pair independently with probability `p`.
    Random {
        /// Connection probability, `[0, 1]`.
        p: f64,
        /// Connect a node to itself (same population only; default false).
        #[serde(default)]
        allow_self: bool,
        /// Seed of this edge type's stream (default: derived from the recipe seed).
        #[serde(default)]
        seed: Option<u64>,
    },
}

/// `syn_weight` of an edge type (pA for current synapses): a number, the same for every
/// edge, or `{"distribution": "uniform", "low": a, "high": b}` /
/// `{"distribution": "normal", "mean": m, "std": s}`, drawn per edge.
///
/// Deserialization refuses an unknown distribution (at key `syn_weight.distribution`), a key
/// the distribution does not take, a missing or non-numeric parameter; the builder checks
/// `low <= high` and `std >= 0`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum SynWeight {
    /// The same weight for every edge.
    Fixed(f64),
    /// Uniform on `[low, high]`.
    Uniform {
        /// Lower bound.
        low: f64,
        /// Upper bound (>= `low`).
        high: f64,
    },
    /// Normal with mean `mean` and standard deviation `std` (>= 0).
    Normal {
        /// Mean.
        mean: f64,
        /// Standard deviation.
        std: f64,
    },
}

/// The distributions of [`SynWeight`] and the keys each takes.
const WEIGHT_DISTRIBUTIONS: [(&str, &[&str]); 2] = [
    ("uniform", &["distribution", "low", "high"]),
    ("normal", &["distribution", "mean", "std"]),
];

impl<'de> Deserialize<'de> for SynWeight {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        use serde::de::{self, DeserializeSeed, MapAccess, Visitor};
        /// The value of `distribution`: the index of a known distribution.
        struct Distribution;
        impl<'de> DeserializeSeed<'de> for Distribution {
            type Value = usize;
            fn deserialize<D: serde::Deserializer<'de>>(self, d: D) -> Result<usize, D::Error> {
                let name = String::deserialize(d)?;
                WEIGHT_DISTRIBUTIONS
                    .iter()
                    .position(|(n, _)| *n == name)
                    .ok_or_else(|| {
                        de::Error::custom(format!(
                            "unknown distribution '{name}'; use \"uniform\" (low, high) or \"normal\" (mean, std)"
                        ))
                    })
            }
        }
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = SynWeight;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("a number (pA) or a distribution object {\"distribution\": \"uniform\" (low, high) or \"normal\" (mean, std)}")
            }
            fn visit_f64<E: de::Error>(self, w: f64) -> Result<SynWeight, E> {
                Ok(SynWeight::Fixed(w))
            }
            fn visit_i64<E: de::Error>(self, w: i64) -> Result<SynWeight, E> {
                Ok(SynWeight::Fixed(w as f64))
            }
            fn visit_u64<E: de::Error>(self, w: u64) -> Result<SynWeight, E> {
                Ok(SynWeight::Fixed(w as f64))
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<SynWeight, A::Error> {
                const KEYS: &[&str] = &["distribution", "low", "high", "mean", "std"];
                let mut dist: Option<usize> = None;
                let mut params: Vec<(String, f64)> = Vec::new();
                while let Some(key) = map.next_key::<String>()? {
                    if key == "distribution" {
                        dist = Some(map.next_value_seed(Distribution)?);
                        continue;
                    }
                    // A key no distribution takes, or not the one given before it.
                    let allowed = dist.map_or(KEYS, |d| WEIGHT_DISTRIBUTIONS[d].1);
                    if !allowed.contains(&key.as_str()) {
                        return Err(de::Error::unknown_field(&key, allowed));
                    }
                    params.push((key, map.next_value::<f64>()?));
                }
                let d = dist.ok_or_else(|| de::Error::missing_field("distribution"))?;
                let (name, keys) = WEIGHT_DISTRIBUTIONS[d];
                if let Some((k, _)) = params.iter().find(|(k, _)| !keys.contains(&k.as_str())) {
                    return Err(de::Error::custom(format!(
                        "key `{k}` does not belong to a {name} distribution (keys: {})",
                        keys.join(", ")
                    )));
                }
                let get = |k: &'static str| -> Result<f64, A::Error> {
                    params
                        .iter()
                        .find(|(p, _)| p == k)
                        .map(|p| p.1)
                        .ok_or_else(|| de::Error::missing_field(k))
                };
                Ok(match d {
                    0 => SynWeight::Uniform {
                        low: get("low")?,
                        high: get("high")?,
                    },
                    _ => SynWeight::Normal {
                        mean: get("mean")?,
                        std: get("std")?,
                    },
                })
            }
        }
        d.deserialize_any(V)
    }
}

/// One built node population with its types table.
#[derive(Debug, Clone)]
pub struct BuiltNodes {
    /// Node ids `0..n`, types, one group `0` without columns.
    pub parts: NodeParts,
    /// The node-types table (`<pop>_node_types.csv`).
    pub types: TypeTable,
    /// True for a virtual (input) population.
    pub is_virtual: bool,
    /// Target rate per node (Hz), `[node]`, when the recipe gives one for every type.
    pub target_rate_hz: Vec<Option<f64>>,
}

/// One built edge population with its types table.
#[derive(Debug, Clone)]
pub struct BuiltEdges {
    /// The edges (sorted by target, then source), one group `0` (with a `syn_weight`
    /// column when some edge type draws per-edge weights).
    pub parts: EdgeParts,
    /// The edge-types table (`<src>_<tgt>_edge_types.csv`).
    pub types: TypeTable,
}

/// A network built in memory from a [`Recipe`]; [`BuiltNetwork::save`] writes it.
#[derive(Debug, Clone)]
pub struct BuiltNetwork {
    /// Node populations in recipe order.
    pub nodes: Vec<BuiltNodes>,
    /// Edge populations in recipe order.
    pub edges: Vec<BuiltEdges>,
    /// `components` folders (config key -> absolute or recipe-relative folder).
    pub components: BTreeMap<String, PathBuf>,
    /// Folder of the network files relative to the output folder.
    pub network_dir: String,
}

impl Recipe {
    /// Reads a recipe file; relative `components` folders resolve against its folder.
    pub fn from_file(path: impl AsRef<Path>) -> BResult<Self> {
        let path = path.as_ref();
        let text = std::fs::read_to_string(path).map_err(|source| BuildError::Io {
            path: path.to_path_buf(),
            cause: source,
        })?;
        let base = path.parent().map(Path::to_path_buf).unwrap_or_default();
        Self::from_json_str(&text, path, &base)
    }

    /// Parses recipe JSON text; `file` is used in messages, `base_dir` resolves `components`.
    ///
    /// Errors: [`BuildError::Parse`] for text that is not JSON; [`BuildError::Invalid`]
    /// naming the key path for JSON without the recipe's shape (an unknown key or value, with
    /// the nearest known one; a missing key; a value of the wrong type).
    pub fn from_json_str(text: &str, file: &Path, base_dir: &Path) -> BResult<Self> {
        let value: Value = serde_json::from_str(text).map_err(|source| BuildError::Parse {
            path: file.to_path_buf(),
            cause: source,
        })?;
        let mut r = lockstep_core::config::from_value::<Recipe>(&value, "")
            .map_err(|e| invalid_in(file, e.key, e.problem))?;
        r.file = file.to_path_buf();
        r.base_dir = base_dir.to_path_buf();
        Ok(r)
    }

    fn invalid(&self, key: impl Into<String>, problem: impl Into<String>) -> BuildError {
        invalid_in(&self.file, key, problem)
    }
}

/// [`BuildError::Invalid`] of the recipe `file` (empty: `<in-memory recipe>`).
fn invalid_in(file: &Path, key: impl Into<String>, problem: impl Into<String>) -> BuildError {
    BuildError::Invalid {
        recipe: if file.as_os_str().is_empty() {
            PathBuf::from("<in-memory recipe>")
        } else {
            file.to_path_buf()
        },
        key: key.into(),
        problem: problem.into(),
    }
}

/// Seed of edge type `t` of edge population `e`: a hash of (seed, e, t).
fn stream_seed(seed: u64, e: usize, t: usize) -> u64 {
    let mut s = SplitMix64::new(seed ^ 0x6C6F_636B_7374_6570); // "lockstep"
    let a = s.next_u64();
    let mut s = SplitMix64::new(a ^ (e as u64).wrapping_mul(0xA24B_AED4_963E_E407));
    let b = s.next_u64();
    let mut s = SplitMix64::new(b ^ (t as u64).wrapping_mul(0x9FB2_1C65_1E98_DF25));
    s.next_u64()
}

fn valid_name(name: &str) -> bool {
    !name.is_empty()
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '-' | '.'))
        && name != "."
        && name != ".."
}

/// A CSV cell from a JSON scalar (`None` for arrays, objects, null).
fn cell(v: &Value) -> Option<String> {
    match v {
        Value::String(s) => Some(s.clone()),
        Value::Number(n) => Some(n.to_string()),
        Value::Bool(b) => Some(b.to_string()),
        _ => None,
    }
}

/// Node-type columns in BMTK's usual order, then the rest by name.
fn ordered_columns(keys: &BTreeSet<String>, id: &str) -> Vec<String> {
    const FIRST: &[&str] = &[
        "model_type",
        "model_template",
        "model_name",
        "pop_name",
        "ei",
        "dynamics_params",
    ];
    let mut cols = vec![id.to_string()];
    cols.extend(
        FIRST
            .iter()
            .filter(|c| keys.contains(**c))
            .map(|c| c.to_string()),
    );
    cols.extend(
        keys.iter()
            .filter(|k| !FIRST.contains(&k.as_str()))
            .cloned(),
    );
    cols
}

/// Builds the network a recipe describes (validating it first).
///
/// Phases: `validate_recipe` (folders and the recipe's top level), `build_nodes` per node
/// population, `build_edges` per edge population (which selects the nodes each edge
/// type connects and connects them, drawing connections and weights).
///
/// Errors: [`BuildError::Invalid`] naming the recipe key of the first invalid value.
pub fn build(recipe: &Recipe) -> BResult<BuiltNetwork> {
    let components = validate_recipe(recipe)?;
    let mut nodes: Vec<BuiltNodes> = Vec::new();
    // per population: node type row of each node
    let mut type_of_node: Vec<Vec<usize>> = Vec::new();
    for (pi, pop) in recipe.nodes.iter().enumerate() {
        let (built, tof) = build_nodes(recipe, pi, pop, &nodes, &components)?;
        nodes.push(built);
        type_of_node.push(tof);
    }
    let edges = recipe
        .edges
        .iter()
        .enumerate()
        .map(|(ei, spec)| build_edges(recipe, ei, spec, &nodes, &type_of_node, &components))
        .collect::<BResult<Vec<_>>>()?;
    Ok(BuiltNetwork {
        nodes,
        edges,
        components,
        network_dir: recipe.network_dir.clone(),
    })
}

/// Checks the recipe's top level (`network_dir`, `components` folders, at least one node
/// population); returns the `components` folders resolved against the recipe's folder.
fn validate_recipe(recipe: &Recipe) -> BResult<BTreeMap<String, PathBuf>> {
    if !valid_name(&recipe.network_dir) && recipe.network_dir != "." {
        return Err(recipe.invalid(
            "network_dir",
            format!(
                "'{}' must be a plain folder name (letters, digits, '_', '-', '.')",
                recipe.network_dir
            ),
        ));
    }
    let mut components = BTreeMap::new();
    for (k, v) in &recipe.components {
        let dir = lockstep_core::config::resolve_path(&recipe.base_dir, v);
        if !dir.is_dir() {
            return Err(recipe.invalid(
                format!("components.{k}"),
                format!(
                    "folder '{}' does not exist (relative paths are relative to the recipe's folder)",
                    dir.display()
                ),
            ));
        }
        components.insert(k.clone(), dir);
    }
    if recipe.nodes.is_empty() {
        return Err(recipe.invalid("nodes", "no node populations; add at least one"));
    }
    Ok(components)
}

/// Builds node population `pi` (`earlier`: the populations built before it); returns it
/// with the node-type row of each node.
fn build_nodes(
    recipe: &Recipe,
    pi: usize,
    pop: &NodePopulationSpec,
    earlier: &[BuiltNodes],
    components: &BTreeMap<String, PathBuf>,
) -> BResult<(BuiltNodes, Vec<usize>)> {
    let pkey = format!("nodes[{pi}]");
    if !valid_name(&pop.population) {
        return Err(recipe.invalid(
            format!("{pkey}.population"),
            format!(
                "'{}' is not a valid population name (letters, digits, '_', '-', '.')",
                pop.population
            ),
        ));
    }
    if earlier.iter().any(|n| n.parts.name == pop.population) {
        return Err(recipe.invalid(
            format!("{pkey}.population"),
            format!("population '{}' is defined twice", pop.population),
        ));
    }
    if pop.types.is_empty() {
        return Err(recipe.invalid(format!("{pkey}.types"), "no node types; add at least one"));
    }
    let mut keys = BTreeSet::new();
    keys.insert("model_type".to_string());
    let mut seen_ids = BTreeSet::new();
    for (ti, t) in pop.types.iter().enumerate() {
        let tkey = format!("{pkey}.types[{ti}]");
        if !seen_ids.insert(t.node_type_id) {
            return Err(recipe.invalid(
                format!("{tkey}.node_type_id"),
                format!(
                    "node_type_id {} appears twice in population '{}'",
                    t.node_type_id, pop.population
                ),
            ));
        }
        validate_node_type(recipe, &tkey, pop.is_virtual, t, components)?;
        keys.extend(t.columns.keys().cloned());
    }
    let columns = ordered_columns(&keys, "node_type_id");
    let mut rows = Vec::new();
    let mut node_type_id = Vec::new();
    let mut target_rate_hz = Vec::new();
    let mut tof = Vec::new();
    for (ti, t) in pop.types.iter().enumerate() {
        let row: Vec<String> = columns
            .iter()
            .map(|c| match c.as_str() {
                "node_type_id" => t.node_type_id.to_string(),
                "model_type" => t.columns.get(c).and_then(cell).unwrap_or_else(|| {
                    if pop.is_virtual {
                        "virtual"
                    } else {
                        "point_neuron"
                    }
                    .to_string()
                }),
                _ => t
                    .columns
                    .get(c)
                    .and_then(cell)
                    .unwrap_or_else(|| "NULL".into()),
            })
            .collect();
        rows.push(row);
        node_type_id.extend(std::iter::repeat_n(t.node_type_id, t.count));
        target_rate_hz.extend(std::iter::repeat_n(t.target_rate_hz, t.count));
        tof.extend(std::iter::repeat_n(ti, t.count));
    }
    let n = node_type_id.len();
    let types = TypeTable::new("node_type_id", columns, rows)?;
    let built = BuiltNodes {
        parts: NodeParts {
            name: pop.population.clone(),
            node_id: (0..n as u64).collect(),
            node_type_id,
            node_group_id: vec![0; n],
            node_group_index: (0..n as u64).collect(),
            groups: vec![PopulationGroup {
                id: 0,
                ..Default::default()
            }],
        },
        types,
        is_virtual: pop.is_virtual,
        target_rate_hz,
    };
    Ok((built, tof))
}

/// Checks one node type `t` (at recipe key `tkey`) of a population (`is_virtual`): count,
/// target rate, columns, model type and cell `dynamics_params` file.
fn validate_node_type(
    recipe: &Recipe,
    tkey: &str,
    is_virtual: bool,
    t: &NodeTypeSpec,
    components: &BTreeMap<String, PathBuf>,
) -> BResult<()> {
    if t.count == 0 {
        return Err(recipe.invalid(
            format!("{tkey}.count"),
            "count is 0; every node type needs at least one node (remove the type instead)",
        ));
    }
    if let Some(r) = t.target_rate_hz {
        if !(r.is_finite() && r >= 0.0) {
            return Err(recipe.invalid(
                format!("{tkey}.target_rate_hz"),
                format!("{r} Hz must be finite and >= 0"),
            ));
        }
    }
    for (k, v) in &t.columns {
        if k == "node_type_id" || k.is_empty() || k.contains([' ', '"']) {
            return Err(recipe.invalid(format!("{tkey}.{k}"), "invalid column name"));
        }
        if cell(v).is_none() {
            return Err(recipe.invalid(
                format!("{tkey}.{k}"),
                format!(
                    "{v} is not a string, number or boolean (node-types CSV cells are scalars)"
                ),
            ));
        }
    }
    let model_type = t.columns.get("model_type").and_then(cell);
    if is_virtual {
        if let Some(m) = model_type.as_deref().filter(|m| *m != "virtual") {
            return Err(recipe.invalid(
                format!("{tkey}.model_type"),
                format!("'{m}' in a virtual population; remove it or use \"virtual\""),
            ));
        }
    } else if model_type.as_deref() == Some("virtual") {
        return Err(recipe.invalid(
            format!("{tkey}.model_type"),
            "'virtual' in a population without \"virtual\": true; set it on the population",
        ));
    }
    if let (Some(dp), Some(dir)) = (
        t.columns.get("dynamics_params").and_then(cell),
        components.get("point_neuron_models_dir"),
    ) {
        if dp.ends_with(".json") && !dir.join(&dp).is_file() {
            return Err(recipe.invalid(
                format!("{tkey}.dynamics_params"),
                format!(
                    "'{dp}' is not a file in point_neuron_models_dir '{}'",
                    dir.display()
                ),
            ));
        }
    }
    Ok(())
}

/// Builds edge population `ei` between the built `nodes` (`type_of_node`: node-type row of
/// each node, per population).
fn build_edges(
    recipe: &Recipe,
    ei: usize,
    spec: &EdgePopulationSpec,
    nodes: &[BuiltNodes],
    type_of_node: &[Vec<usize>],
    components: &BTreeMap<String, PathBuf>,
) -> BResult<BuiltEdges> {
    let ekey = format!("edges[{ei}]");
    let (si, ti) = validate_edge_population(recipe, ei, spec)?;
    // (target, source, type row, weight)
    let mut list: Vec<(u64, u64, usize, f64)> = Vec::new();
    let mut weights = Vec::new();
    let mut seen_ids = BTreeSet::new();
    for (k, t) in spec.types.iter().enumerate() {
        let tkey = format!("{ekey}.types[{k}]");
        if t.edge_type_id > u32::MAX as u64 || !seen_ids.insert(t.edge_type_id) {
            return Err(recipe.invalid(
                format!("{tkey}.edge_type_id"),
                format!(
                    "edge_type_id {} is repeated or does not fit uint32",
                    t.edge_type_id
                ),
            ));
        }
        let w = validate_edge_type(recipe, &tkey, t, components)?;
        weights.push(w);
        let src = select(
            recipe,
            &tkey,
            "source_query",
            &nodes[si],
            &type_of_node[si],
            &t.source_query,
        )?;
        let tgt = select(
            recipe,
            &tkey,
            "target_query",
            &nodes[ti],
            &type_of_node[ti],
            &t.target_query,
        )?;
        let (p, allow_self, seed) = match &t.connection {
            Connection::AllToAll { allow_self } => (1.0, *allow_self, None),
            Connection::Random {
                p,
                allow_self,
                seed,
            } => {
                if !(0.0..=1.0).contains(p) {
                    return Err(recipe.invalid(
                        format!("{tkey}.connection.p"),
                        format!("{p} is not a probability in [0, 1]"),
                    ));
                }
                (*p, *allow_self, *seed)
            }
        };
        let rng = SplitMix64::new(seed.unwrap_or_else(|| stream_seed(recipe.seed, ei, k)));
        let allow_self = allow_self || si != ti;
        connect(&src, &tgt, p, allow_self, w, rng, |tg, s, wv| {
            list.push((tg, s, k, wv))
        });
    }
    list.sort_by_key(|e| (e.0, e.1, e.2));
    let types = edge_types_table(spec, &weights)?;
    let n = list.len();
    let mut group = PopulationGroup {
        id: 0,
        ..Default::default()
    };
    if weights.iter().any(|w| !matches!(w, SynWeight::Fixed(_))) {
        group.columns.push(Column::new(
            "syn_weight",
            ColumnData::F64(list.iter().map(|e| e.3).collect()),
        ));
    }
    Ok(BuiltEdges {
        parts: EdgeParts {
            name: format!("{}_to_{}", spec.source, spec.target),
            source_population: spec.source.clone(),
            target_population: spec.target.clone(),
            source_node_id: list.iter().map(|e| e.1).collect(),
            target_node_id: list.iter().map(|e| e.0).collect(),
            edge_type_id: list.iter().map(|e| spec.types[e.2].edge_type_id).collect(),
            edge_group_id: vec![0; n],
            edge_group_index: (0..n as u64).collect(),
            groups: vec![group],
        },
        types,
    })
}

/// Checks edge population `ei` (its populations exist, the target is not virtual, it is the
/// only entry of its pair, it has types); returns the source and target population indices.
fn validate_edge_population(
    recipe: &Recipe,
    ei: usize,
    spec: &EdgePopulationSpec,
) -> BResult<(usize, usize)> {
    let ekey = format!("edges[{ei}]");
    let find = |name: &str, field: &str| -> BResult<usize> {
        recipe
            .nodes
            .iter()
            .position(|p| p.population == name)
            .ok_or_else(|| {
                recipe.invalid(
                    format!("{ekey}.{field}"),
                    format!(
                        "unknown node population '{name}' (known: {})",
                        recipe
                            .nodes
                            .iter()
                            .map(|p| p.population.as_str())
                            .collect::<Vec<_>>()
                            .join(", ")
                    ),
                )
            })
    };
    let si = find(&spec.source, "source")?;
    let ti = find(&spec.target, "target")?;
    if recipe.nodes[ti].is_virtual {
        return Err(recipe.invalid(
            format!("{ekey}.target"),
            format!(
                "population '{}' is virtual; virtual nodes cannot receive edges",
                spec.target
            ),
        ));
    }
    if recipe.edges[..ei]
        .iter()
        .any(|e| e.source == spec.source && e.target == spec.target)
    {
        return Err(recipe.invalid(
            ekey.clone(),
            format!(
                "a second edge population from '{}' to '{}'; put all its edge types in one entry",
                spec.source, spec.target
            ),
        ));
    }
    if spec.types.is_empty() {
        return Err(recipe.invalid(format!("{ekey}.types"), "no edge types; add at least one"));
    }
    Ok((si, ti))
}

/// Checks one edge type `t` (at recipe key `tkey`): delay, `nsyns`, synapse
/// `dynamics_params` file; returns its weight.
fn validate_edge_type(
    recipe: &Recipe,
    tkey: &str,
    t: &EdgeTypeSpec,
    components: &BTreeMap<String, PathBuf>,
) -> BResult<SynWeight> {
    if !(t.delay.is_finite() && t.delay > 0.0) {
        return Err(recipe.invalid(
            format!("{tkey}.delay"),
            format!("{} ms; delays must be finite and > 0 ms", t.delay),
        ));
    }
    if t.nsyns == Some(0) {
        return Err(recipe.invalid(format!("{tkey}.nsyns"), "nsyns must be >= 1"));
    }
    if let (Some(dp), Some(dir)) = (&t.dynamics_params, components.get("synaptic_models_dir")) {
        if !dir.join(dp).is_file() {
            return Err(recipe.invalid(
                format!("{tkey}.dynamics_params"),
                format!(
                    "'{dp}' is not a file in synaptic_models_dir '{}'",
                    dir.display()
                ),
            ));
        }
    }
    match t.syn_weight {
        SynWeight::Uniform { low, high } if low > high => Err(recipe.invalid(
            format!("{tkey}.syn_weight.low"),
            format!("low = {low} exceeds high = {high}"),
        )),
        SynWeight::Normal { std, .. } if std < 0.0 => Err(recipe.invalid(
            format!("{tkey}.syn_weight.std"),
            format!("std = {std} must be >= 0"),
        )),
        w => Ok(w),
    }
}

/// The node ids of `built` (node-type row of each node: `type_of_node`) whose node type
/// matches every `column = value` of the query `q` (recipe key `tkey.field`).
///
/// Errors: a column the population's types lack, a non-scalar value, an empty selection.
fn select(
    recipe: &Recipe,
    tkey: &str,
    field: &str,
    built: &BuiltNodes,
    type_of_node: &[usize],
    q: &BTreeMap<String, Value>,
) -> BResult<Vec<u64>> {
    for (col, v) in q {
        if built.types.column_index(col).is_none() {
            return Err(recipe.invalid(
                format!("{tkey}.{field}.{col}"),
                format!(
                    "population '{}' has no node-type column '{col}' (columns: {})",
                    built.parts.name,
                    built.types.columns.join(", ")
                ),
            ));
        }
        if cell(v).is_none() {
            return Err(recipe.invalid(
                format!("{tkey}.{field}.{col}"),
                format!("{v} is not a string, number or boolean"),
            ));
        }
    }
    let ok_rows: Vec<bool> = (0..built.types.len())
        .map(|r| {
            q.iter()
                .all(|(col, v)| built.types.get(r, col) == cell(v).as_deref())
        })
        .collect();
    let ids: Vec<u64> = type_of_node
        .iter()
        .enumerate()
        .filter(|(_, &r)| ok_rows[r])
        .map(|(i, _)| i as u64)
        .collect();
    if ids.is_empty() {
        return Err(recipe.invalid(
            format!("{tkey}.{field}"),
            format!("selects no node of population '{}'", built.parts.name),
        ));
    }
    Ok(ids)
}

/// Connects the selected sources `src` to the targets `tgt`, target-major: each pair (but a
/// node to itself unless `allow_self`) with probability `p`, and draws its weight from `w`;
/// both draws come from `rng`, in that order, so a recipe always builds the same edges.
/// Calls `edge(target, source, weight)` for each edge.
fn connect(
    src: &[u64],
    tgt: &[u64],
    p: f64,
    allow_self: bool,
    w: SynWeight,
    mut rng: SplitMix64,
    mut edge: impl FnMut(u64, u64, f64),
) {
    for &tg in tgt {
        for &s in src {
            if s == tg && !allow_self {
                continue;
            }
            if p < 1.0 && rng.uniform() >= p {
                continue;
            }
            let wv = match w {
                SynWeight::Fixed(x) => x,
                SynWeight::Uniform { low, high } => low + (high - low) * rng.uniform(),
                SynWeight::Normal { mean, std } => mean + std * rng.normal(),
            };
            edge(tg, s, wv);
        }
    }
}

/// The edge-types table (`<src>_<tgt>_edge_types.csv`) of an edge population: fixed weights
/// as a column, drawn ones as `NULL` (their values are per edge).
fn edge_types_table(spec: &EdgePopulationSpec, weights: &[SynWeight]) -> BResult<TypeTable> {
    let has_nsyns = spec.types.iter().any(|t| t.nsyns.is_some());
    let mut columns: Vec<String> = [
        "edge_type_id",
        "target_query",
        "source_query",
        "model_template",
        "syn_weight",
        "dynamics_params",
        "delay",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    if has_nsyns {
        columns.push("nsyns".into());
    }
    let query_str = |q: &BTreeMap<String, Value>| -> String {
        if q.is_empty() {
            "*".into()
        } else {
            q.iter()
                .map(|(c, v)| format!("{c}=='{}'", cell(v).unwrap_or_default()))
                .collect::<Vec<_>>()
                .join("&")
        }
    };
    let rows: Vec<Vec<String>> = spec
        .types
        .iter()
        .zip(weights)
        .map(|(t, w)| {
            let mut r = vec![
                t.edge_type_id.to_string(),
                query_str(&t.target_query),
                query_str(&t.source_query),
                t.model_template
                    .clone()
                    .unwrap_or_else(|| "static_synapse".into()),
                match w {
                    SynWeight::Fixed(x) => format!("{x}"),
                    _ => "NULL".into(),
                },
                t.dynamics_params.clone().unwrap_or_else(|| "NULL".into()),
                format!("{}", t.delay),
            ];
            if has_nsyns {
                r.push(t.nsyns.map_or_else(|| "NULL".into(), |n| n.to_string()));
            }
            r
        })
        .collect();
    Ok(TypeTable::new("edge_type_id", columns, rows)?)
}

/// `path` relative to `from` (both absolute, canonical), with `..` steps; `None` when they
/// share no prefix (different roots).
fn relative_to(path: &Path, from: &Path) -> Option<PathBuf> {
    let p: Vec<_> = path.components().collect();
    let f: Vec<_> = from.components().collect();
    let common = p.iter().zip(&f).take_while(|(a, b)| a == b).count();
    if common == 0 {
        return None;
    }
    let mut out = PathBuf::new();
    for _ in common..f.len() {
        out.push("..");
    }
    for c in &p[common..] {
        out.push(c.as_os_str());
    }
    Some(out)
}

impl BuiltNetwork {
    /// The files [`BuiltNetwork::save`] writes into `dir`, in writing order.
    pub fn output_files(&self, dir: &Path) -> Vec<PathBuf> {
        let net = dir.join(&self.network_dir);
        let mut files = Vec::new();
        for n in &self.nodes {
            files.push(net.join(format!("{}_nodes.h5", n.parts.name)));
            files.push(net.join(format!("{}_node_types.csv", n.parts.name)));
        }
        for e in &self.edges {
            let stem = format!(
                "{}_{}",
                e.parts.source_population, e.parts.target_population
            );
            files.push(net.join(format!("{stem}_edges.h5")));
            files.push(net.join(format!("{stem}_edge_types.csv")));
        }
        if self.has_target_rates() {
            files.push(dir.join("target_rates.csv"));
        }
        files.push(dir.join("config.circuit.json"));
        files
    }

    fn has_target_rates(&self) -> bool {
        self.nodes
            .iter()
            .any(|n| n.target_rate_hz.iter().any(Option::is_some))
    }

    /// Total number of edges.
    pub fn n_edges(&self) -> usize {
        self.edges
            .iter()
            .map(|e| e.parts.source_node_id.len())
            .sum()
    }

    /// Writes the network into `dir` (created if needed): the files of
    /// [`BuiltNetwork::output_files`]. Refuses (before writing anything) when one of them
    /// exists, unless `overwrite`. Component folders are written relative to `dir` when
    /// possible. Returns the written files.
    pub fn save(&self, dir: impl AsRef<Path>, overwrite: bool) -> BResult<Vec<PathBuf>> {
        let dir = dir.as_ref();
        let files = self.output_files(dir);
        if !overwrite {
            if let Some(f) = files.iter().find(|f| f.exists()) {
                return Err(BuildError::Exists { path: f.clone() });
            }
        }
        let net = dir.join(&self.network_dir);
        std::fs::create_dir_all(&net).map_err(|source| BuildError::Write {
            path: net.clone(),
            cause: source,
        })?;
        let mut i = 0;
        for n in &self.nodes {
            write_nodes(&files[i], &[NodesView::from(&n.parts)])?;
            n.types.write(&files[i + 1])?;
            i += 2;
        }
        for e in &self.edges {
            write_edges(&files[i], &[EdgesView::from(&e.parts)])?;
            e.types.write(&files[i + 1])?;
            i += 2;
        }
        if self.has_target_rates() {
            let mut csv = String::from("node_id,population,firing_rate\n");
            for n in &self.nodes {
                for (id, r) in n.parts.node_id.iter().zip(&n.target_rate_hz) {
                    if let Some(r) = r {
                        csv.push_str(&format!("{id},{},{r}\n", n.parts.name));
                    }
                }
            }
            std::fs::write(&files[i], csv).map_err(|source| BuildError::Write {
                path: files[i].clone(),
                cause: source,
            })?;
        }
        let abs_dir = std::fs::canonicalize(dir).map_err(|source| BuildError::Write {
            path: dir.to_path_buf(),
            cause: source,
        })?;
        let mut comps = serde_json::Map::new();
        for (k, p) in &self.components {
            let shown = std::fs::canonicalize(p)
                .ok()
                .and_then(|abs| relative_to(&abs, &abs_dir))
                .map(|rel| {
                    if rel.as_os_str().is_empty() {
                        "$BASE_DIR".to_string()
                    } else {
                        format!("$BASE_DIR/{}", rel.display())
                    }
                })
                .unwrap_or_else(|| p.display().to_string());
            comps.insert(k.clone(), Value::String(shown));
        }
        let nodes: Vec<Value> = self
            .nodes
            .iter()
            .map(|n| {
                json!({
                    "nodes_file": format!("$NETWORK_DIR/{}_nodes.h5", n.parts.name),
                    "node_types_file": format!("$NETWORK_DIR/{}_node_types.csv", n.parts.name),
                })
            })
            .collect();
        let edges: Vec<Value> = self
            .edges
            .iter()
            .map(|e| {
                let stem = format!(
                    "{}_{}",
                    e.parts.source_population, e.parts.target_population
                );
                json!({
                    "edges_file": format!("$NETWORK_DIR/{stem}_edges.h5"),
                    "edge_types_file": format!("$NETWORK_DIR/{stem}_edge_types.csv"),
                })
            })
            .collect();
        let cfg = json!({
            "manifest": {
                "$BASE_DIR": crate::config::CONFIG_DIR_MANIFEST,
                "$NETWORK_DIR": format!("$BASE_DIR/{}", self.network_dir),
            },
            "components": comps,
            "networks": {"nodes": nodes, "edges": edges},
        });
        let cfg_path = files.last().expect("config is always written");
        let text = serde_json::to_string_pretty(&cfg).expect("JSON values serialise") + "\n";
        std::fs::write(cfg_path, text).map_err(|source| BuildError::Write {
            path: cfg_path.clone(),
            cause: source,
        })?;
        Ok(files)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn splitmix_reference_values() {
        // First outputs of SplitMix64 seeded with 0 (reference implementation by Vigna).
        let mut r = SplitMix64::new(0);
        assert_eq!(r.next_u64(), 0xE220_A839_7B1D_CDAF);
        assert_eq!(r.next_u64(), 0x6E78_9E6A_A1B9_65F4);
    }

    #[test]
    fn normal_moments() {
        let mut r = SplitMix64::new(7);
        let n = 20_000;
        let xs: Vec<f64> = (0..n).map(|_| r.normal()).collect();
        let m = xs.iter().sum::<f64>() / n as f64;
        let v = xs.iter().map(|x| (x - m) * (x - m)).sum::<f64>() / n as f64;
        assert!(m.abs() < 0.03, "{m}");
        assert!((v - 1.0).abs() < 0.05, "{v}");
    }

    #[test]
    fn relative_paths() {
        let r = relative_to(Path::new("/a/b/c"), Path::new("/a/d")).unwrap();
        assert_eq!(r, PathBuf::from("../b/c"));
        assert_eq!(
            relative_to(Path::new("/a/b"), Path::new("/a/b")).unwrap(),
            PathBuf::new()
        );
    }
}
