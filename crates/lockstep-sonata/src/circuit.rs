//! A whole circuit: every node and edge population named by a config, validated together.

use std::path::{Path, PathBuf};

use crate::components::ComponentStore;
use crate::config::SonataConfig;
use crate::edges::{read_edges, EdgePopulation};
use crate::error::{Result, SonataError, SonataErrorKind};
use crate::nodes::{read_nodes, NodePopulation};

/// Every node and edge population of a config, with types and components resolved.
///
/// Checks on load: unique population names (nodes and edges separately), every edge's
/// `node_population` attributes name a node population, every source/target id exists.
#[derive(Debug, Clone)]
pub struct Circuit {
    /// The resolved config (its `json` keeps `run`, `inputs`, `output`, ...).
    pub config: SonataConfig,
    /// Node populations in config order (file order within a file).
    pub nodes: Vec<NodePopulation>,
    /// Edge populations in config order (file order within a file).
    pub edges: Vec<EdgePopulation>,
    /// The component JSON files loaded (each once).
    pub components: ComponentStore,
}

impl Circuit {
    /// Reads a circuit or simulation config and everything it names.
    pub fn from_config(path: impl AsRef<Path>) -> Result<Self> {
        Self::from_sonata_config(SonataConfig::from_file(path)?)
    }

    /// Reads everything an already resolved config names.
    pub fn from_sonata_config(config: SonataConfig) -> Result<Self> {
        let mut store = ComponentStore::new();
        let mut nodes: Vec<NodePopulation> = Vec::new();
        for e in &config.nodes {
            check_exists(&config, &e.key, "nodes_file", &e.nodes_file)?;
            check_exists(&config, &e.key, "node_types_file", &e.node_types_file)?;
            for p in read_nodes(
                &e.nodes_file,
                &e.node_types_file,
                &e.populations,
                &config.components,
                &mut store,
            )? {
                if let Some(prev) = nodes.iter().find(|q| q.name == p.name) {
                    return Err(SonataErrorKind::DuplicatePopulation {
                        kind: "node".into(),
                        name: p.name.clone(),
                        first: prev.file.clone(),
                        second: p.file.clone(),
                    }
                    .into());
                }
                nodes.push(p);
            }
        }
        let mut edges: Vec<EdgePopulation> = Vec::new();
        for e in &config.edges {
            check_exists(&config, &e.key, "edges_file", &e.edges_file)?;
            check_exists(&config, &e.key, "edge_types_file", &e.edge_types_file)?;
            for p in read_edges(
                &e.edges_file,
                &e.edge_types_file,
                &config.components,
                &mut store,
            )? {
                if let Some(prev) = edges.iter().find(|q| q.name == p.name) {
                    return Err(SonataErrorKind::DuplicatePopulation {
                        kind: "edge".into(),
                        name: p.name.clone(),
                        first: prev.file.clone(),
                        second: p.file.clone(),
                    }
                    .into());
                }
                edges.push(p);
            }
        }
        let known = || {
            nodes
                .iter()
                .map(|n| n.name.as_str())
                .collect::<Vec<_>>()
                .join(", ")
        };
        for e in &edges {
            let find = |name: &str, ds: &str| {
                nodes.iter().find(|n| n.name == name).ok_or_else(|| {
                    SonataError::from(SonataErrorKind::UnknownNodePopulation {
                        h5: e.file.clone(),
                        object: format!("/edges/{}/{ds}", e.name),
                        population: name.to_string(),
                        known: known(),
                    })
                })
            };
            let s = find(&e.source_population, "source_node_id")?;
            let t = find(&e.target_population, "target_node_id")?;
            e.check_node_ids(s, t)?;
        }
        Ok(Circuit {
            config,
            nodes,
            edges,
            components: store,
        })
    }

    /// The node population called `name`.
    pub fn node_population(&self, name: &str) -> Option<&NodePopulation> {
        self.nodes.iter().find(|n| n.name == name)
    }

    /// The edge population called `name`.
    pub fn edge_population(&self, name: &str) -> Option<&EdgePopulation> {
        self.edges.iter().find(|n| n.name == name)
    }

    /// Edge populations whose targets are in node population `target`.
    pub fn edges_into<'a>(
        &'a self,
        target: &'a str,
    ) -> impl Iterator<Item = &'a EdgePopulation> + 'a {
        self.edges
            .iter()
            .filter(move |e| e.target_population == target)
    }

    /// The folder of the config file.
    pub fn base_dir(&self) -> PathBuf {
        self.config.dir.clone()
    }
}

/// A clear "missing file" error naming the config key before any reader touches the file.
fn check_exists(config: &SonataConfig, key: &str, field: &str, path: &Path) -> Result<()> {
    match std::fs::metadata(path) {
        Ok(_) => Ok(()),
        Err(source) => Err(SonataErrorKind::Io {
            what: field.replace('_', " "),
            path: path.to_path_buf(),
            origin: format!("{key}.{field} in '{}'", config.path.display()),
            source,
        }
        .into()),
    }
}
