//! SONATA / BMTK circuit and simulation configs (`config.circuit.json`,
//! `config.simulation.json`).
//!
//! Resolution (SONATA spec, "Configuration files"; BMTK `SonataConfig`):
//! 1. `manifest` maps `$NAME` to a string that may use other variables (`$NAME` or `${NAME}`);
//!    references are resolved recursively (cycles are an error). `${configdir}` is predefined
//!    as the config file's folder.
//! 2. Every string of the file is substituted with the manifest; an undefined `$NAME` is an
//!    error naming the key that uses it.
//! 3. The path-valued keys (`components.*`, `networks.nodes[].nodes_file` / `node_types_file`,
//!    `networks.edges[].edges_file` / `edge_types_file`, `network`, `node_sets_file`,
//!    `inputs.*.input_file`, `output.output_dir`) are resolved against the config file's folder
//!    when relative. Other strings (e.g. `output.log_file`, relative to `output_dir` in BMTK)
//!    are left as written; [`SonataConfig::resolve_path`] resolves any of them on demand.
//! 4. A `network` key names a circuit config that is read the same way (with its own
//!    manifest and folder) and merged: keys of the including file win, `components` are merged
//!    key by key, `networks.nodes` / `networks.edges` come from the including file when it has
//!    them, else from the circuit file.

use std::collections::BTreeMap;
use std::path::{Component, Path, PathBuf};

use lockstep_core::config::{self, ConfigError};
use serde::de::DeserializeOwned;
use serde::Deserialize;
use serde_json::{Map, Value};

use crate::error::{Result, SonataError, SonataErrorKind};

/// The manifest value of `$BASE_DIR` in every config lockstep writes for others to run: the
/// config file's own folder, which BMTK and lockstep both predefine as `${configdir}`. (BMTK
/// resolves relative paths, `"."` included, against the working directory; lockstep against
/// the config's folder; `${configdir}` means the same in both.)
pub const CONFIG_DIR_MANIFEST: &str = "${configdir}";

/// One `networks.nodes[]` entry.
#[derive(Debug, Clone, PartialEq)]
pub struct NodesEntry {
    /// The nodes HDF5 file (resolved path).
    pub nodes_file: PathBuf,
    /// The node-types CSV (resolved path).
    pub node_types_file: PathBuf,
    /// Optional per-population settings of the entry (`populations` object, e.g. `type`).
    pub populations: Map<String, Value>,
    /// Key path in the config, e.g. `networks.nodes[1]` (for messages).
    pub key: String,
    /// The config file the entry is written in (the circuit file for an included `network`).
    pub config_file: PathBuf,
}

/// One `networks.edges[]` entry.
#[derive(Debug, Clone, PartialEq)]
pub struct EdgesEntry {
    /// The edges HDF5 file (resolved path).
    pub edges_file: PathBuf,
    /// The edge-types CSV (resolved path).
    pub edge_types_file: PathBuf,
    /// Optional per-population settings of the entry (`populations` object).
    pub populations: Map<String, Value>,
    /// Key path in the config, e.g. `networks.edges[0]` (for messages).
    pub key: String,
    /// The config file the entry is written in (the circuit file for an included `network`).
    pub config_file: PathBuf,
}

/// The `components` folders.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Components {
    /// `point_neuron_models_dir`: cell `dynamics_params` JSON files.
    pub point_neuron_models_dir: Option<PathBuf>,
    /// `synaptic_models_dir`: synapse `dynamics_params` JSON files.
    pub synaptic_models_dir: Option<PathBuf>,
    /// Every `components` entry (including the two above), resolved.
    pub dirs: BTreeMap<String, PathBuf>,
}

/// A resolved SONATA config (simulation config with its circuit merged in, or a circuit config).
#[derive(Debug, Clone, PartialEq)]
pub struct SonataConfig {
    /// The config file that was opened.
    pub path: PathBuf,
    /// Its folder: relative paths are resolved against it.
    pub dir: PathBuf,
    /// Resolved manifest, variable name (without `$`) -> value.
    pub manifest: BTreeMap<String, String>,
    /// `components` folders.
    pub components: Components,
    /// `networks.nodes[]` in file order.
    pub nodes: Vec<NodesEntry>,
    /// `networks.edges[]` in file order.
    pub edges: Vec<EdgesEntry>,
    /// The whole resolved JSON (variables substituted, path keys resolved, circuit merged):
    /// `run`, `inputs`, `output`, ... for the simulate/train commands, which read them as
    /// typed sections with [`SonataConfig::section`].
    pub json: Value,
}

/// The `network_recipe*.json` files (recipes of `lockstep build-network`) in the folder of
/// `config`, sorted; empty when there are none or the folder cannot be listed.
fn recipes_beside(config: &Path) -> Vec<PathBuf> {
    let dir = match config.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => Path::new("."),
    };
    let mut found: Vec<PathBuf> = std::fs::read_dir(dir)
        .into_iter()
        .flatten()
        .flatten()
        .map(|e| e.path())
        .filter(|p| {
            p.file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.starts_with("network_recipe") && n.ends_with(".json"))
        })
        .collect();
    found.sort();
    found
}

impl SonataConfig {
    /// Reads and resolves a config file (see the module docs).
    pub fn from_file(path: impl AsRef<Path>) -> Result<Self> {
        Self::from_file_inner(path.as_ref(), &mut Vec::new())
    }

    fn from_file_inner(path: &Path, stack: &mut Vec<PathBuf>) -> Result<Self> {
        let text = std::fs::read_to_string(path).map_err(|source| {
            if let (Some(config), std::io::ErrorKind::NotFound) = (stack.last(), source.kind()) {
                let recipes = recipes_beside(config);
                if !recipes.is_empty() {
                    return SonataError::from(SonataErrorKind::NetworkNotBuilt {
                        path: path.to_path_buf(),
                        config: config.clone(),
                        recipes,
                    });
                }
            }
            SonataError::from(SonataErrorKind::Io {
                what: "config file".into(),
                path: path.to_path_buf(),
                origin: stack.last().map_or("argument".into(), |p| {
                    format!("key 'network' of '{}'", p.display())
                }),
                cause: source,
            })
        })?;
        let value: Value = serde_json::from_str(&text).map_err(|source| {
            SonataError::from(SonataErrorKind::Json {
                path: path.to_path_buf(),
                cause: source,
            })
        })?;
        let dir = path
            .parent()
            .map(|p| {
                if p.as_os_str().is_empty() {
                    Path::new(".")
                } else {
                    p
                }
            })
            .unwrap_or(Path::new("."))
            .to_path_buf();
        // Absolute, so resolved paths stay valid whatever resolves them again later.
        let dir = std::path::absolute(&dir).unwrap_or(dir);
        Self::from_value_inner(value, path, &dir, stack)
    }

    /// Resolves an already parsed config as if it were the file `path` (used for in-memory
    /// configs; `path`'s folder is the base of relative paths).
    pub fn from_value(value: Value, path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref();
        let dir = match path.parent() {
            Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
            _ => PathBuf::from("."),
        };
        let dir = std::path::absolute(&dir).unwrap_or(dir);
        Self::from_value_inner(value, path, &dir, &mut Vec::new())
    }

    fn from_value_inner(
        mut value: Value,
        path: &Path,
        dir: &Path,
        stack: &mut Vec<PathBuf>,
    ) -> Result<Self> {
        let key_err = |key: &str, problem: String| {
            SonataError::from(SonataErrorKind::ConfigKey {
                path: path.to_path_buf(),
                key: key.to_string(),
                problem,
            })
        };
        let Value::Object(root) = &mut value else {
            return Err(key_err(
                "<root>",
                format!("must be a JSON object, found {}", brief(&value)),
            ));
        };
        // 1. manifest
        let mut raw = BTreeMap::new();
        if let Some(m) = root.get("manifest") {
            let Value::Object(m) = m else {
                return Err(key_err(
                    "manifest",
                    format!("must be an object, found {}", brief(m)),
                ));
            };
            for (k, v) in m {
                let Value::String(s) = v else {
                    return Err(key_err(
                        &format!("manifest.{k}"),
                        format!("must be a string, found {}", brief(v)),
                    ));
                };
                let name = k.strip_prefix('$').unwrap_or(k);
                let name = name
                    .strip_prefix('{')
                    .and_then(|n| n.strip_suffix('}'))
                    .unwrap_or(name);
                raw.insert(name.to_string(), s.clone());
            }
        }
        let user_keys: Vec<String> = raw.keys().cloned().collect();
        raw.entry("configdir".to_string())
            .or_insert_with(|| dir.to_string_lossy().into_owned());
        let manifest = resolve_manifest(&raw, path)?;
        // 2. substitution everywhere (except the manifest itself, replaced by its resolution)
        for (k, v) in root.iter_mut() {
            if k != "manifest" {
                substitute(v, k, &manifest, path)?;
            }
        }
        if root.contains_key("manifest") {
            let m: Map<String, Value> = user_keys
                .iter()
                .map(|k| (format!("${k}"), Value::String(manifest[k].clone())))
                .collect();
            root.insert("manifest".into(), Value::Object(m));
        }
        // 3. path keys
        resolve_path_keys(root, dir);
        // typed entries of this file (their errors name this file)
        let (mut nodes, mut edges) = parse_networks(root, path)?;
        let has = |list: &str| root.get("networks").and_then(|n| n.get(list)).is_some();
        let (own_nodes, own_edges) = (has("nodes"), has("edges"));
        // 4. network include
        if let Some(net) = root.get("network").cloned() {
            let Value::String(net) = net else {
                return Err(key_err(
                    "network",
                    format!("must be a path string, found {}", brief(&net)),
                ));
            };
            let net_path = PathBuf::from(net);
            let key = |p: &Path| {
                resolve_against(
                    Path::new("/"),
                    &std::path::absolute(p)
                        .unwrap_or(p.to_path_buf())
                        .to_string_lossy(),
                )
            };
            if stack.iter().any(|p| key(p) == key(&net_path)) || key(&net_path) == key(path) {
                return Err(key_err(
                    "network",
                    format!(
                        "'{}' includes itself (directly or through other configs)",
                        net_path.display()
                    ),
                ));
            }
            stack.push(path.to_path_buf());
            let circuit = Self::from_file_inner(&net_path, stack)?;
            stack.pop();
            if !own_nodes {
                nodes = circuit.nodes;
            }
            if !own_edges {
                edges = circuit.edges;
            }
            merge_circuit(root, circuit.json);
        }
        let components = parse_components(root, path)?;
        Ok(SonataConfig {
            path: path.to_path_buf(),
            dir: dir.to_path_buf(),
            manifest,
            components,
            nodes,
            edges,
            json: value,
        })
    }

    /// Resolves a (substituted) path string against the config's folder; absolute paths are
    /// returned unchanged.
    pub fn resolve_path(&self, p: &str) -> PathBuf {
        resolve_against(&self.dir, p)
    }

    /// Deserializes the top-level section `key` (`run`, `output`, `training`, ...) as the
    /// typed section `T` of the crate that owns those keys; an absent or `null` section reads
    /// as an empty object.
    ///
    /// Errors: [`ConfigError`] naming this file and the full key (`run.dt`).
    pub fn section<T: DeserializeOwned>(&self, key: &str) -> std::result::Result<T, ConfigError> {
        let empty = Value::Object(Map::new());
        let value = match self.json.get(key) {
            None | Some(Value::Null) => &empty,
            Some(v) => v,
        };
        config::from_value(value, key).map_err(|e| e.in_file(&self.path))
    }

    /// `run.dt` in ms, if present and numeric.
    pub fn dt(&self) -> Option<f64> {
        self.section::<RunClock>("run").ok()?.dt
    }

    /// `run.tstop` (BMTK also reads it as `duration`) in ms, if present and numeric.
    pub fn tstop(&self) -> Option<f64> {
        self.section::<RunClock>("run").ok()?.tstop
    }
}

/// The top-level keys [`SonataConfig`] reads itself: the variables, the circuit and its node
/// sets, and BMTK's `target_simulator` (accepted, not used). A command adds its own sections
/// (`run`, `inputs`, `output`, ...) and refuses every other key with
/// [`lockstep_core::config::check_keys`] over the union of both lists.
pub const CIRCUIT_KEYS: &[&str] = &[
    "manifest",
    "target_simulator",
    "network",
    "networks",
    "components",
    "node_sets",
    "node_sets_file",
];

/// The simulation clock of `run` (other keys belong to the commands).
#[derive(Debug, Default, Deserialize)]
struct RunClock {
    /// Simulated time (ms).
    #[serde(default, alias = "duration")]
    tstop: Option<f64>,
    /// Time step (ms).
    #[serde(default)]
    dt: Option<f64>,
}

fn brief(v: &Value) -> String {
    let s = v.to_string();
    if s.len() > 60 {
        format!(
            "{}...",
            &s[..s.char_indices().nth(57).map_or(s.len(), |(i, _)| i)]
        )
    } else {
        s
    }
}

/// Substitutes `$NAME` / `${NAME}` in `s`; `Err(name)` for the first undefined variable.
fn substitute_str(s: &str, vars: &BTreeMap<String, String>) -> std::result::Result<String, String> {
    let mut out = String::with_capacity(s.len());
    let mut rest = s;
    while let Some(pos) = rest.find('$') {
        out.push_str(&rest[..pos]);
        let after = &rest[pos + 1..];
        let (name, len) = if let Some(inner) = after.strip_prefix('{') {
            match inner.find('}') {
                Some(end) => (&inner[..end], end + 2),
                None => return Err(format!("{{{inner} (missing closing brace)")),
            }
        } else {
            let end = after
                .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
                .unwrap_or(after.len());
            (&after[..end], end)
        };
        if name.is_empty() {
            out.push('$');
            rest = after;
            continue;
        }
        match vars.get(name) {
            Some(v) => out.push_str(v),
            None => return Err(name.to_string()),
        }
        rest = &after[len..];
    }
    out.push_str(rest);
    Ok(out)
}

fn resolve_manifest(
    raw: &BTreeMap<String, String>,
    path: &Path,
) -> Result<BTreeMap<String, String>> {
    fn resolve(
        name: &str,
        raw: &BTreeMap<String, String>,
        done: &mut BTreeMap<String, String>,
        chain: &mut Vec<String>,
        path: &Path,
    ) -> Result<String> {
        if let Some(v) = done.get(name) {
            return Ok(v.clone());
        }
        if chain.iter().any(|c| c == name) {
            chain.push(name.to_string());
            return Err(SonataErrorKind::CyclicVariable {
                path: path.to_path_buf(),
                variable: chain[0].clone(),
                chain: chain
                    .iter()
                    .map(|c| format!("${c}"))
                    .collect::<Vec<_>>()
                    .join(" -> "),
            }
            .into());
        }
        chain.push(name.to_string());
        let mut value = raw[name].clone();
        // substitute one variable at a time so nested references resolve recursively
        loop {
            let probe = substitute_str(&value, done);
            match probe {
                Ok(v) => {
                    value = v;
                    break;
                }
                Err(missing) => {
                    if !raw.contains_key(&missing) {
                        return Err(SonataErrorKind::UndefinedVariable {
                            path: path.to_path_buf(),
                            key: format!("manifest.${name}"),
                            variable: missing,
                            defined: raw
                                .keys()
                                .map(|k| format!("${k}"))
                                .collect::<Vec<_>>()
                                .join(", "),
                        }
                        .into());
                    }
                    resolve(&missing, raw, done, chain, path)?;
                }
            }
        }
        chain.pop();
        done.insert(name.to_string(), value.clone());
        Ok(value)
    }
    let mut done = BTreeMap::new();
    for name in raw.keys() {
        resolve(name, raw, &mut done, &mut Vec::new(), path)?;
    }
    Ok(done)
}

fn substitute(
    v: &mut Value,
    key: &str,
    vars: &BTreeMap<String, String>,
    path: &Path,
) -> Result<()> {
    match v {
        Value::String(s) if s.contains('$') => {
            *s = substitute_str(s, vars).map_err(|variable| {
                SonataError::from(SonataErrorKind::UndefinedVariable {
                    path: path.to_path_buf(),
                    key: key.to_string(),
                    variable,
                    defined: vars
                        .keys()
                        .map(|k| format!("${k}"))
                        .collect::<Vec<_>>()
                        .join(", "),
                })
            })?;
        }
        Value::Array(a) => {
            for (i, x) in a.iter_mut().enumerate() {
                substitute(x, &format!("{key}[{i}]"), vars, path)?;
            }
        }
        Value::Object(o) => {
            for (k, x) in o.iter_mut() {
                substitute(x, &format!("{key}.{k}"), vars, path)?;
            }
        }
        _ => {}
    }
    Ok(())
}

/// Joins a relative path onto `dir` and removes `.` components and `x/..` pairs lexically.
pub(crate) fn resolve_against(dir: &Path, p: &str) -> PathBuf {
    let joined = lockstep_core::config::resolve_path(dir, p);
    let mut out = PathBuf::new();
    for c in joined.components() {
        match c {
            Component::CurDir => {}
            Component::ParentDir => {
                let last_normal =
                    matches!(out.components().next_back(), Some(Component::Normal(_)));
                if last_normal {
                    out.pop();
                } else {
                    out.push("..");
                }
            }
            other => out.push(other),
        }
    }
    if out.as_os_str().is_empty() {
        out.push(".");
    }
    out
}

fn resolve_str_in(v: Option<&mut Value>, dir: &Path) {
    if let Some(Value::String(s)) = v {
        *s = resolve_against(dir, s).to_string_lossy().into_owned();
    }
}

fn resolve_path_keys(root: &mut Map<String, Value>, dir: &Path) {
    if let Some(Value::Object(c)) = root.get_mut("components") {
        for v in c.values_mut() {
            resolve_str_in(Some(v), dir);
        }
    }
    if let Some(Value::Object(n)) = root.get_mut("networks") {
        for (list, keys) in [
            ("nodes", ["nodes_file", "node_types_file"]),
            ("edges", ["edges_file", "edge_types_file"]),
        ] {
            if let Some(Value::Array(a)) = n.get_mut(list) {
                for e in a.iter_mut() {
                    if let Value::Object(e) = e {
                        for k in keys {
                            resolve_str_in(e.get_mut(k), dir);
                        }
                    }
                }
            }
        }
    }
    resolve_str_in(root.get_mut("network"), dir);
    resolve_str_in(root.get_mut("node_sets_file"), dir);
    if let Some(Value::Object(inputs)) = root.get_mut("inputs") {
        for i in inputs.values_mut() {
            if let Value::Object(i) = i {
                resolve_str_in(i.get_mut("input_file"), dir);
            }
        }
    }
    if let Some(Value::Object(o)) = root.get_mut("output") {
        resolve_str_in(o.get_mut("output_dir"), dir);
    }
    // A report's plain file name lies in output_dir (BMTK); one with a folder part, such as
    // "$OUTPUT_DIR/v.h5" under a relative manifest, is a path like the others.
    if let Some(Value::Object(reports)) = root.get_mut("reports") {
        for r in reports.values_mut() {
            if let Some(Value::String(f)) = r.get_mut("file_name") {
                if Path::new(f.as_str()).components().count() > 1 {
                    *f = resolve_against(dir, f).to_string_lossy().into_owned();
                }
            }
        }
    }
}

fn merge_circuit(root: &mut Map<String, Value>, circuit: Value) {
    let Value::Object(circuit) = circuit else {
        return;
    };
    for (k, v) in circuit {
        match (k.as_str(), root.get_mut(&k)) {
            ("manifest", _) => {}
            (_, None) => {
                root.insert(k, v);
            }
            ("components", Some(Value::Object(mine))) | ("networks", Some(Value::Object(mine))) => {
                if let Value::Object(theirs) = v {
                    for (ck, cv) in theirs {
                        mine.entry(ck).or_insert(cv);
                    }
                }
            }
            _ => {}
        }
    }
}

fn parse_components(root: &Map<String, Value>, path: &Path) -> Result<Components> {
    let mut c = Components::default();
    if let Some(v) = root.get("components") {
        let Value::Object(m) = v else {
            return Err(SonataErrorKind::ConfigKey {
                path: path.to_path_buf(),
                key: "components".into(),
                problem: format!("must be an object of folder paths, found {}", brief(v)),
            }
            .into());
        };
        for (k, v) in m {
            let Value::String(s) = v else {
                return Err(SonataErrorKind::ConfigKey {
                    path: path.to_path_buf(),
                    key: format!("components.{k}"),
                    problem: format!("must be a path string, found {}", brief(v)),
                }
                .into());
            };
            c.dirs.insert(k.clone(), PathBuf::from(s));
        }
    }
    c.point_neuron_models_dir = c.dirs.get("point_neuron_models_dir").cloned();
    c.synaptic_models_dir = c.dirs.get("synaptic_models_dir").cloned();
    Ok(c)
}

fn parse_networks(
    root: &Map<String, Value>,
    path: &Path,
) -> Result<(Vec<NodesEntry>, Vec<EdgesEntry>)> {
    let err = |key: String, problem: String| {
        SonataError::from(SonataErrorKind::ConfigKey {
            path: path.to_path_buf(),
            key,
            problem,
        })
    };
    let Some(net) = root.get("networks") else {
        return Ok((Vec::new(), Vec::new()));
    };
    let Value::Object(net) = net else {
        return Err(err(
            "networks".into(),
            format!("must be an object, found {}", brief(net)),
        ));
    };
    let list = |name: &str| -> Result<Vec<(String, Map<String, Value>)>> {
        match net.get(name) {
            None => Ok(Vec::new()),
            Some(Value::Array(a)) => a
                .iter()
                .enumerate()
                .map(|(i, e)| match e {
                    Value::Object(o) => Ok((format!("networks.{name}[{i}]"), o.clone())),
                    other => Err(err(
                        format!("networks.{name}[{i}]"),
                        format!("must be an object, found {}", brief(other)),
                    )),
                })
                .collect(),
            Some(other) => Err(err(
                format!("networks.{name}"),
                format!("must be an array, found {}", brief(other)),
            )),
        }
    };
    let get_path = |key: &str, o: &Map<String, Value>, field: &str| -> Result<PathBuf> {
        match o.get(field) {
            Some(Value::String(s)) => Ok(PathBuf::from(s)),
            Some(other) => Err(err(
                format!("{key}.{field}"),
                format!("must be a path string, found {}", brief(other)),
            )),
            None => Err(err(format!("{key}.{field}"), "is missing".into())),
        }
    };
    let pops = |o: &Map<String, Value>| match o.get("populations") {
        Some(Value::Object(p)) => p.clone(),
        _ => Map::new(),
    };
    let mut nodes = Vec::new();
    for (key, o) in list("nodes")? {
        nodes.push(NodesEntry {
            nodes_file: get_path(&key, &o, "nodes_file")?,
            node_types_file: get_path(&key, &o, "node_types_file")?,
            populations: pops(&o),
            key,
            config_file: path.to_path_buf(),
        });
    }
    let mut edges = Vec::new();
    for (key, o) in list("edges")? {
        edges.push(EdgesEntry {
            edges_file: get_path(&key, &o, "edges_file")?,
            edge_types_file: get_path(&key, &o, "edge_types_file")?,
            populations: pops(&o),
            key,
            config_file: path.to_path_buf(),
        });
    }
    Ok((nodes, edges))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn nested_manifest_and_paths() {
        let v = json!({
            "manifest": {"$BASE_DIR": ".", "$NET": "$BASE_DIR/network", "$DEEP": "${NET}/x"},
            "components": {"synaptic_models_dir": "$BASE_DIR/../comp/syn"},
            "networks": {"nodes": [{"nodes_file": "$DEEP/n.h5", "node_types_file": "/abs/t.csv"}]},
            "output": {"log_file": "log.txt", "output_dir": "$BASE_DIR/out"},
            "run": {"tstop": 10.0, "note": "cost $5 is not a variable? no: $ followed by digit"}
        });
        // "$5" is a variable reference of name "5", undefined -> error naming run.note
        let e = SonataConfig::from_value(v.clone(), "/cfg/dir/c.json")
            .unwrap_err()
            .to_string();
        assert!(e.contains("run.note") && e.contains("$5"), "{e}");
        let mut v = v;
        v["run"]["note"] = json!("plain");
        let c = SonataConfig::from_value(v, "/cfg/dir/c.json").unwrap();
        assert_eq!(
            c.nodes[0].nodes_file,
            PathBuf::from("/cfg/dir/network/x/n.h5")
        );
        assert_eq!(c.nodes[0].node_types_file, PathBuf::from("/abs/t.csv"));
        assert_eq!(
            c.components.synaptic_models_dir,
            Some(PathBuf::from("/cfg/comp/syn"))
        );
        assert_eq!(c.json["output"]["log_file"], "log.txt");
        assert_eq!(c.json["output"]["output_dir"], "/cfg/dir/out");
        assert_eq!(c.tstop(), Some(10.0));
        assert_eq!(c.manifest["DEEP"], "./network/x");
    }

    #[test]
    fn cycles_and_undefined_in_manifest() {
        let v = json!({"manifest": {"$A": "$B/x", "$B": "$A/y"}});
        let e = SonataConfig::from_value(v, "/c.json")
            .unwrap_err()
            .to_string();
        assert!(e.contains("$A -> $B -> $A"), "{e}");
        let v = json!({"manifest": {"$A": "$NOPE/x"}});
        let e = SonataConfig::from_value(v, "/c.json")
            .unwrap_err()
            .to_string();
        assert!(e.contains("$NOPE") && e.contains("manifest.$A"), "{e}");
    }

    #[test]
    fn network_include_cycle_is_an_error() {
        let dir = tempfile::tempdir().unwrap();
        let a = dir.path().join("a.json");
        let b = dir.path().join("b.json");
        std::fs::write(&a, r#"{"network": "./b.json", "run": {"dt": 0.1}}"#).unwrap();
        std::fs::write(
            &b,
            r#"{"network": "$D/a.json", "manifest": {"$D": "${configdir}"}}"#,
        )
        .unwrap();
        let e = SonataConfig::from_file(&a).unwrap_err().to_string();
        assert!(e.contains("includes itself") && e.contains("a.json"), "{e}");
        std::fs::write(
            &b,
            r#"{"networks": {"nodes": []}, "components": {"x_dir": "x"}}"#,
        )
        .unwrap();
        let c = SonataConfig::from_file(&a).unwrap();
        assert_eq!(c.components.dirs["x_dir"], dir.path().join("x"));
        assert_eq!(c.dt(), Some(0.1));
    }

    #[test]
    fn lexical_resolution() {
        assert_eq!(
            resolve_against(Path::new("a/b"), "../c/./d"),
            PathBuf::from("a/c/d")
        );
        assert_eq!(
            resolve_against(Path::new("."), "../x"),
            PathBuf::from("../x")
        );
        assert_eq!(
            resolve_against(Path::new("/r"), "/abs"),
            PathBuf::from("/abs")
        );
    }
}
