//! The error type of this crate.
//!
//! Every variant names the file, the dataset or key and the offending value, and most say
//! how to fix the input. Bad input never panics: every reader returns `Result<_, SonataError>`.

use std::path::PathBuf;

/// An error of this crate: a boxed [`SonataErrorKind`] (boxed so `Result`s stay small).
/// `Display` gives the full message naming file, dataset/key and value.
#[derive(Debug, thiserror::Error)]
#[error(transparent)]
pub struct SonataError(Box<SonataErrorKind>);

impl SonataError {
    /// What went wrong, with all details.
    pub fn kind(&self) -> &SonataErrorKind {
        &self.0
    }

    /// Unwraps the details.
    pub fn into_kind(self) -> SonataErrorKind {
        *self.0
    }
}

impl From<SonataErrorKind> for SonataError {
    fn from(k: SonataErrorKind) -> Self {
        SonataError(Box::new(k))
    }
}

/// Everything that can go wrong while reading, validating or writing SONATA files.
#[derive(Debug, thiserror::Error)]
pub enum SonataErrorKind {
    /// A file named by a config (or passed directly) does not exist or cannot be read.
    #[error("{what} '{path}' (from {origin}) cannot be read: {cause}; check the path and the manifest variables")]
    Io {
        /// What the file is (e.g. "nodes file", "config file").
        what: String,
        /// The path that failed.
        path: PathBuf,
        /// Where the path came from (config key, or "argument").
        origin: String,
        /// The underlying I/O error.
        cause: std::io::Error,
    },

    /// The circuit config named by a config's `network` key does not exist, and recipes of
    /// `lockstep build-network` lie beside the config: the network has not been built yet.
    #[error(
        "network '{path}' (from key 'network' of '{config}') does not exist: build it first with \
         `lockstep build-network RECIPE --output {dir}`, RECIPE being the recipe of this \
         network among those beside the config ({recipes})",
        dir = path.parent().map_or(std::path::Path::new("."), |d| d).display(),
        recipes = recipes.iter().map(|r| r.display().to_string()).collect::<Vec<_>>().join(", ")
    )]
    NetworkNotBuilt {
        /// The missing circuit config.
        path: PathBuf,
        /// The config whose `network` key names it.
        config: PathBuf,
        /// The `network_recipe*.json` files in the config's folder, sorted.
        recipes: Vec<PathBuf>,
    },

    /// A JSON file (config or component) is not valid JSON.
    #[error("'{path}' is not valid JSON: {cause}")]
    Json {
        /// The JSON file.
        path: PathBuf,
        /// The parser error (with line and column).
        cause: serde_json::Error,
    },

    /// A config key is missing or has the wrong JSON type.
    #[error("config '{path}': key '{key}' {problem}")]
    ConfigKey {
        /// The config file.
        path: PathBuf,
        /// Dotted key path, e.g. `networks.nodes[0].nodes_file`.
        key: String,
        /// What is wrong with it, e.g. "is missing" or "must be a string, found 3".
        problem: String,
    },

    /// A `$VARIABLE` is used but never defined in the manifest.
    #[error("config '{path}': key '{key}' uses ${variable}, which is not defined in the manifest (defined: {defined}); add \"${variable}\" to \"manifest\"")]
    UndefinedVariable {
        /// The config file.
        path: PathBuf,
        /// Dotted key path of the string that uses the variable.
        key: String,
        /// Variable name without the `$`.
        variable: String,
        /// Comma-separated list of the variables that are defined.
        defined: String,
    },

    /// Manifest variables refer to each other in a cycle.
    #[error("config '{path}': manifest variable ${variable} refers to itself through {chain}")]
    CyclicVariable {
        /// The config file.
        path: PathBuf,
        /// Variable name without the `$`.
        variable: String,
        /// The chain of references, e.g. `$A -> $B -> $A`.
        chain: String,
    },

    /// An HDF5 library call failed on an object.
    #[error("HDF5 file '{path}', object '{object}': {cause}")]
    Hdf5 {
        /// The HDF5 file.
        path: PathBuf,
        /// Group or dataset path inside the file.
        object: String,
        /// The HDF5 error.
        cause: hdf5::Error,
    },

    /// A required group or dataset is absent.
    #[error("HDF5 file '{path}' has no dataset or group '{object}' ({hint})")]
    MissingDataset {
        /// The HDF5 file.
        path: PathBuf,
        /// The missing object path inside the file.
        object: String,
        /// What it is needed for / how to fix.
        hint: String,
    },

    /// A dataset has a dtype or shape that cannot be used.
    #[error("HDF5 file '{path}', dataset '{object}' has dtype/shape {found}, expected {expected}")]
    WrongDtype {
        /// The HDF5 file.
        path: PathBuf,
        /// Dataset path inside the file.
        object: String,
        /// The dtype (and shape) found.
        found: String,
        /// What was expected.
        expected: String,
    },

    /// A dataset has a value that is out of range or inconsistent with another dataset.
    #[error("HDF5 file '{path}', dataset '{object}': {problem}")]
    BadValue {
        /// The HDF5 file.
        path: PathBuf,
        /// Dataset path inside the file.
        object: String,
        /// What is wrong, naming the offending value and its index.
        problem: String,
    },

    /// A CSV (node/edge types) file is malformed.
    #[error("CSV file '{path}', line {line}: {problem}")]
    Csv {
        /// The CSV file.
        path: PathBuf,
        /// 1-based line number.
        line: usize,
        /// What is wrong.
        problem: String,
    },

    /// A `node_type_id` or `edge_type_id` used in an HDF5 file has no row in its types CSV.
    #[error("HDF5 file '{h5}', dataset '{object}': {column} {id} (first at row {row}) is not in the types file '{csv}' (known ids: {known}); add a row for it or fix the id")]
    UnknownTypeId {
        /// The nodes or edges HDF5 file.
        h5: PathBuf,
        /// Dataset path, e.g. `/nodes/v1/node_type_id`.
        object: String,
        /// `node_type_id` or `edge_type_id`.
        column: String,
        /// The offending id.
        id: u64,
        /// First row (node or edge index) that uses it.
        row: usize,
        /// The types CSV.
        csv: PathBuf,
        /// The ids the CSV defines.
        known: String,
    },

    /// An edge refers to a node id that its node population does not have.
    #[error("edges file '{h5}', dataset '{object}': edge {edge} refers to node id {node_id}, which does not exist in node population '{population}' ({n_nodes} nodes, from '{nodes_file}')")]
    DanglingEdge {
        /// The edges HDF5 file.
        h5: PathBuf,
        /// `/edges/<pop>/source_node_id` or `target_node_id`.
        object: String,
        /// Edge index.
        edge: usize,
        /// The node id that does not exist.
        node_id: u64,
        /// The node population the edge refers to.
        population: String,
        /// How many nodes that population has.
        n_nodes: usize,
        /// The nodes file of the population.
        nodes_file: PathBuf,
    },

    /// An edge population refers to a node population that is not in the circuit.
    #[error("edges file '{h5}', dataset '{object}': attribute node_population = '{population}' names no node population of the circuit (known: {known}); add its nodes file to networks.nodes")]
    UnknownNodePopulation {
        /// The edges HDF5 file.
        h5: PathBuf,
        /// `/edges/<pop>/source_node_id` or `target_node_id`.
        object: String,
        /// The unknown population name.
        population: String,
        /// The populations that exist.
        known: String,
    },

    /// Two files (or one file twice) define the same population.
    #[error("duplicate {kind} population '{name}': defined in '{first}' and again in '{second}'; rename one of them or list the file once")]
    DuplicatePopulation {
        /// `node` or `edge`.
        kind: String,
        /// The population name.
        name: String,
        /// First file defining it.
        first: PathBuf,
        /// Second file defining it.
        second: PathBuf,
    },

    /// A value needed to resolve an edge or node (e.g. `syn_weight`, `delay`) is neither in the
    /// HDF5 group nor in the types CSV.
    #[error("{what} of {kind} type {type_id} in '{csv}' (population '{population}' in '{h5}'): {problem}")]
    MissingValue {
        /// The resolved property, e.g. `syn_weight`, `delay`, `dynamics_params`.
        what: String,
        /// `edge` or `node`.
        kind: String,
        /// The type id.
        type_id: u64,
        /// The types CSV.
        csv: PathBuf,
        /// The population.
        population: String,
        /// The HDF5 file.
        h5: PathBuf,
        /// What is wrong (missing / unparsable value ...).
        problem: String,
    },

    /// Data passed to a writer is inconsistent (lengths, group indices, ...).
    #[error("cannot write {what}: {problem}")]
    InvalidData {
        /// What was being written, e.g. "edges file 'x.h5' population 'v1_to_v1'".
        what: String,
        /// What is inconsistent.
        problem: String,
    },
}

/// Shorthand for results of this crate.
pub type Result<T, E = SonataError> = std::result::Result<T, E>;

impl SonataError {
    pub(crate) fn h5(
        path: impl Into<PathBuf>,
        object: impl Into<String>,
        cause: hdf5::Error,
    ) -> Self {
        SonataErrorKind::Hdf5 {
            path: path.into(),
            object: object.into(),
            cause,
        }
        .into()
    }
}
