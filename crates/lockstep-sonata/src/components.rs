//! Component files: the cell and synapse `dynamics_params` JSON files named by the types
//! CSVs and found in `components.point_neuron_models_dir` / `synaptic_models_dir`.
//! Each file is parsed once and shared (`Arc<serde_json::Value>`).

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use serde_json::Value;

use crate::error::{Result, SonataError, SonataErrorKind};

/// Which components folder a `dynamics_params` file lives in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ComponentKind {
    /// `components.point_neuron_models_dir` (node types).
    Cell,
    /// `components.synaptic_models_dir` (edge types).
    Synapse,
}

impl ComponentKind {
    /// The config key of the folder.
    pub fn config_key(self) -> &'static str {
        match self {
            ComponentKind::Cell => "point_neuron_models_dir",
            ComponentKind::Synapse => "synaptic_models_dir",
        }
    }
}

/// Cache of parsed component JSON files, keyed by resolved path.
#[derive(Debug, Clone, Default)]
pub struct ComponentStore {
    cache: HashMap<PathBuf, Arc<Value>>,
}

impl ComponentStore {
    /// An empty store.
    pub fn new() -> Self {
        Self::default()
    }

    /// Number of distinct files loaded so far.
    pub fn len(&self) -> usize {
        self.cache.len()
    }

    /// True when nothing has been loaded.
    pub fn is_empty(&self) -> bool {
        self.cache.is_empty()
    }

    /// Loads (once) the JSON file `name` from `dir` (or `name` itself when absolute).
    /// `origin` says who needs it, for the error message (e.g. "dynamics_params of node
    /// type 100 in 'v1_node_types.csv'").
    pub fn load(
        &mut self,
        dir: Option<&Path>,
        kind: ComponentKind,
        name: &str,
        origin: &str,
    ) -> Result<Arc<Value>> {
        let path = if Path::new(name).is_absolute() {
            PathBuf::from(name)
        } else {
            match dir {
                Some(d) => d.join(name),
                None => {
                    return Err(SonataErrorKind::Io {
                        what: format!("component file '{name}'"),
                        path: PathBuf::from(name),
                        origin: origin.to_string(),
                        cause: std::io::Error::new(
                            std::io::ErrorKind::NotFound,
                            format!("components.{} is not set in the config", kind.config_key()),
                        ),
                    }
                    .into())
                }
            }
        };
        if let Some(v) = self.cache.get(&path) {
            return Ok(v.clone());
        }
        let text = std::fs::read_to_string(&path).map_err(|source| {
            SonataError::from(SonataErrorKind::Io {
                what: format!("{} component", kind.config_key()),
                path: path.clone(),
                origin: origin.to_string(),
                cause: source,
            })
        })?;
        let v: Value = serde_json::from_str(&text).map_err(|source| {
            SonataError::from(SonataErrorKind::Json {
                path: path.clone(),
                cause: source,
            })
        })?;
        let v = Arc::new(v);
        self.cache.insert(path, v.clone());
        Ok(v)
    }
}
