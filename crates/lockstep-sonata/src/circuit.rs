//! A whole circuit: every node and edge population named by a config, validated together.

use std::path::{Path, PathBuf};

use crate::components::ComponentStore;
use crate::config::SonataConfig;
use crate::edges::{join_edges, read_edge_parts, EdgePopulation};
use crate::error::{Result, SonataError, SonataErrorKind};
use crate::nodes::{join_nodes, read_node_parts, NodePopulation};

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
        // 1. raw populations of every file, so duplicates are reported before anything else
        let mut seen: Vec<(String, PathBuf)> = Vec::new();
        let mut dup = |kind: &str, name: &str, file: &Path| -> Result<()> {
            if let Some((_, first)) = seen.iter().find(|(n, _)| n == &format!("{kind}/{name}")) {
                return Err(SonataErrorKind::DuplicatePopulation {
                    kind: kind.into(),
                    name: name.to_string(),
                    first: first.clone(),
                    second: file.to_path_buf(),
                }
                .into());
            }
            seen.push((format!("{kind}/{name}"), file.to_path_buf()));
            Ok(())
        };
        let mut node_parts = Vec::with_capacity(config.nodes.len());
        for e in &config.nodes {
            check_exists(&e.config_file, &e.key, "nodes_file", &e.nodes_file)?;
            check_exists(
                &e.config_file,
                &e.key,
                "node_types_file",
                &e.node_types_file,
            )?;
            let parts = read_node_parts(&e.nodes_file)?;
            for p in &parts {
                dup("node", &p.name, &e.nodes_file)?;
            }
            node_parts.push(parts);
        }
        let mut edge_parts = Vec::with_capacity(config.edges.len());
        for e in &config.edges {
            check_exists(&e.config_file, &e.key, "edges_file", &e.edges_file)?;
            check_exists(
                &e.config_file,
                &e.key,
                "edge_types_file",
                &e.edge_types_file,
            )?;
            let parts = read_edge_parts(&e.edges_file)?;
            for p in &parts {
                dup("edge", &p.name, &e.edges_file)?;
            }
            edge_parts.push(parts);
        }
        // 2. join with types and components
        let mut nodes: Vec<NodePopulation> = Vec::new();
        for (e, parts) in config.nodes.iter().zip(node_parts) {
            nodes.extend(join_nodes(
                parts,
                &e.nodes_file,
                &e.node_types_file,
                &e.populations,
                &config.components,
                &mut store,
            )?);
        }
        let mut edges: Vec<EdgePopulation> = Vec::new();
        for (e, parts) in config.edges.iter().zip(edge_parts) {
            edges.extend(join_edges(
                parts,
                &e.edges_file,
                &e.edge_types_file,
                &config.components,
                &mut store,
            )?);
        }
        // 3. cross-checks
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
fn check_exists(config_file: &Path, key: &str, field: &str, path: &Path) -> Result<()> {
    match std::fs::metadata(path) {
        Ok(_) => Ok(()),
        Err(source) => Err(SonataErrorKind::Io {
            what: field.replace('_', " "),
            path: path.to_path_buf(),
            origin: format!("{key}.{field} in '{}'", config_file.display()),
            cause: source,
        }
        .into()),
    }
}
