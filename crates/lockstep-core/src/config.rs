//! The one config idiom of lockstep.
//!
//! Every crate declares typed [`serde`] sections for the keys it owns, next to the code that
//! uses them, with `#[serde(deny_unknown_fields)]` (and tagged enums for choices such as the
//! optimizer). This module turns those sections into user-facing errors:
//!
//! - [`from_value`] / [`from_json_file`] deserialize a section and report failures as one
//!   [`ConfigError`] `{file, key, problem}`, where `key` is the full dotted key path
//!   (`run.distribution.strategy`, `networks.nodes[1].nodes_file`) and an unknown key or value
//!   comes with the nearest known one ("did you mean `strategy`?").
//! - [`check_keys`] does the same for the few places that still walk a JSON object by hand
//!   (tables keyed by user-chosen names, sections shared by several crates).
//! - [`resolve_path`] is the one rule for relative paths: relative to the config file's folder,
//!   absolute paths unchanged.
//!
//! Guarantees: every error names the file (when known), the key and what is wrong with it;
//! suggestions are only made when a known key is close (edit distance at most 3, and less
//! than the key's length), otherwise the known keys are listed.

use std::fmt;
use std::path::{Path, PathBuf};

use serde::de::DeserializeOwned;
use serde_json::{Map, Value};

/// A problem with one key of a config file.
///
/// Displayed as `FILE: KEY: PROBLEM` (or `KEY: PROBLEM` when the file is not known), e.g.
/// `config.json: run.distribution.stratgy: unknown key; did you mean `strategy`?`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub struct ConfigError {
    /// The config file, when known.
    pub file: Option<PathBuf>,
    /// The dotted key path, e.g. `training.optimizer.beta1` (empty for the whole file).
    pub key: String,
    /// What is wrong and, where possible, how to fix it.
    pub problem: String,
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if let Some(file) = &self.file {
            write!(f, "{}: ", file.display())?;
        }
        if self.key.is_empty() {
            write!(f, "{}", self.problem)
        } else {
            write!(f, "{}: {}", self.key, self.problem)
        }
    }
}

impl ConfigError {
    /// An error for `key` (no file yet; see [`ConfigError::in_file`]).
    pub fn new(key: impl Into<String>, problem: impl Into<String>) -> Self {
        ConfigError {
            file: None,
            key: key.into(),
            problem: problem.into(),
        }
    }

    /// Sets the file the key was read from (keeps a file that is already set).
    #[must_use]
    pub fn in_file(mut self, file: impl AsRef<Path>) -> Self {
        if self.file.is_none() {
            self.file = Some(file.as_ref().to_path_buf());
        }
        self
    }

    /// Prefixes the key path with `section` (`"run"` + `"seed"` -> `"run.seed"`), for errors
    /// raised by code that only saw a sub-section.
    #[must_use]
    pub fn under(mut self, section: &str) -> Self {
        if !section.is_empty() {
            self.key = join_key(section, &self.key);
        }
        self
    }
}

/// `a` + `b` as a dotted key path (`b` may start with an index such as `[2]`).
pub fn join_key(a: &str, b: &str) -> String {
    match (a.is_empty(), b.is_empty()) {
        (true, _) => b.to_string(),
        (_, true) => a.to_string(),
        _ if b.starts_with('[') => format!("{a}{b}"),
        _ => format!("{a}.{b}"),
    }
}

/// Levenshtein distance between two keys (characters, not bytes).
pub fn edit_distance(a: &str, b: &str) -> usize {
    let b: Vec<char> = b.chars().collect();
    let mut prev: Vec<usize> = (0..=b.len()).collect();
    for (i, ca) in a.chars().enumerate() {
        let mut cur = vec![i + 1; b.len() + 1];
        for (j, &cb) in b.iter().enumerate() {
            cur[j + 1] = (prev[j] + usize::from(ca != cb))
                .min(prev[j + 1] + 1)
                .min(cur[j] + 1);
        }
        prev = cur;
    }
    prev[b.len()]
}

/// The known key closest to `key`, if it is close enough to be a likely typo (edit distance
/// at most 3 and less than the length of `key`; case-insensitive equality always counts).
pub fn nearest_key<'a>(key: &str, known: &[&'a str]) -> Option<&'a str> {
    if let Some(k) = known.iter().find(|k| k.eq_ignore_ascii_case(key)) {
        return Some(k);
    }
    let (best, d) = known
        .iter()
        .map(|k| (*k, edit_distance(key, k)))
        .min_by_key(|&(_, d)| d)?;
    (d <= 3 && d < key.chars().count()).then_some(best)
}

/// The problem text for an unknown key or value: `unknown key; did you mean `x`?` when a known
/// one is close, else `unknown key; known keys: a, b, c`. `what` is `"key"` or `"value"`.
pub fn unknown_problem(what: &str, given: &str, known: &[&str]) -> String {
    match nearest_key(given, known) {
        Some(n) => format!("unknown {what} `{given}`; did you mean `{n}`?"),
        None if known.is_empty() => format!("unknown {what} `{given}`"),
        None => format!(
            "unknown {what} `{given}`; known {what}s: {}",
            known.join(", ")
        ),
    }
}

/// Rejects keys of `obj` not in `allowed`, suggesting the nearest known key.
///
/// `section` is the dotted path of `obj` (`""` for the top level). Errors: a [`ConfigError`]
/// whose key is `section.key` of the first unknown key (in the object's order).
pub fn check_keys(
    obj: &Map<String, Value>,
    allowed: &[&str],
    section: &str,
) -> Result<(), ConfigError> {
    match obj.keys().find(|k| !allowed.contains(&k.as_str())) {
        None => Ok(()),
        Some(key) => Err(ConfigError::new(
            join_key(section, key),
            unknown_problem("key", key, allowed),
        )),
    }
}

/// The keys a serde struct accepts (serde's `FIELDS`, aliases included, in serde's order),
/// for sections shared by several crates: each crate deserializes its own typed struct from
/// the section (without `deny_unknown_fields`), and the caller that knows every part refuses
/// the rest with [`check_keys`] over the union of their `field_names`.
///
/// Returns an empty list for types that are not structs with named fields.
pub fn field_names<T: DeserializeOwned>() -> &'static [&'static str] {
    use serde::de::{self, Visitor};
    struct Catch<'a>(&'a mut &'static [&'static str]);
    impl<'de> de::Deserializer<'de> for Catch<'_> {
        type Error = de::value::Error;
        fn deserialize_any<V: Visitor<'de>>(self, _: V) -> Result<V::Value, Self::Error> {
            Err(de::Error::custom("not a struct"))
        }
        fn deserialize_struct<V: Visitor<'de>>(
            self,
            _name: &'static str,
            fields: &'static [&'static str],
            _visitor: V,
        ) -> Result<V::Value, Self::Error> {
            *self.0 = fields;
            Err(de::Error::custom("fields caught"))
        }
        serde::forward_to_deserialize_any! {
            bool i8 i16 i32 i64 i128 u8 u16 u32 u64 u128 f32 f64 char str string bytes
            byte_buf option unit unit_struct newtype_struct seq tuple tuple_struct map enum
            identifier ignored_any
        }
    }
    let mut fields: &'static [&'static str] = &[];
    let _ = T::deserialize(Catch(&mut fields));
    fields
}

/// Deserializes a config section from a JSON value.
///
/// `section` is the dotted path of `value` inside its file (`""` for the whole file); error
/// keys are reported under it. Unknown keys (`deny_unknown_fields`) and unknown enum
/// variants get the nearest known name suggested; type errors keep serde's description
/// ("invalid type: string \"x\", expected u64").
///
/// Errors: [`ConfigError`] naming the full key path; its `file` is unset (add it with
/// [`ConfigError::in_file`]).
pub fn from_value<T: DeserializeOwned>(value: &Value, section: &str) -> Result<T, ConfigError> {
    serde_path_to_error::deserialize(value).map_err(|e| {
        let path = e.path().to_string();
        let path = if path == "." { String::new() } else { path };
        let (key, problem) = explain(&path, &e.into_inner().to_string());
        ConfigError::new(join_key(section, &key), problem)
    })
}

/// Reads a JSON file and deserializes it as `T`.
///
/// Errors: the file cannot be read (the OS cause, once), is not JSON (line and column), or
/// [`from_value`] fails; every error names `path`.
pub fn from_json_file<T: DeserializeOwned>(path: &Path) -> Result<T, ConfigError> {
    from_value(&read_json(path)?, "").map_err(|e| e.in_file(path))
}

/// Reads a JSON file into a [`Value`].
///
/// Errors: the file cannot be read (the OS cause) or is not valid JSON (line and column).
pub fn read_json(path: &Path) -> Result<Value, ConfigError> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| ConfigError::new("", format!("cannot read the file: {e}")).in_file(path))?;
    serde_json::from_str(&text)
        .map_err(|e| ConfigError::new("", format!("not valid JSON: {e}")).in_file(path))
}

/// Resolves a path written in a config file: relative paths are relative to `base_dir` (the
/// config file's folder), absolute paths are kept ([`Path::join`] semantics).
pub fn resolve_path(base_dir: &Path, path: impl AsRef<Path>) -> PathBuf {
    base_dir.join(path)
}

/// The folder of a config file, for [`resolve_path`]: its parent, or `.` for a bare file name.
pub fn config_dir(config_file: &Path) -> PathBuf {
    match config_file.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
        _ => PathBuf::from("."),
    }
}

/// Turns serde's message for the value at `path` into (key path, problem), adding "did you
/// mean" to serde's `unknown field` / `unknown variant` messages (whose format serde's
/// `de::Error::unknown_field` / `unknown_variant` fix: the offending name and the expected
/// names in backticks).
fn explain(path: &str, msg: &str) -> (String, String) {
    // serde_json appends " at line L column C" to errors from text; values have none.
    let msg = msg.split(" at line ").next().unwrap_or(msg);
    let ticks: Vec<&str> = msg.split('`').skip(1).step_by(2).collect();
    let kind = if msg.starts_with("unknown field") {
        Some("key")
    } else if msg.starts_with("unknown variant") {
        Some("value")
    } else {
        None
    };
    match (kind, ticks.split_first()) {
        (Some("key"), Some((bad, known))) => {
            // serde_path_to_error's path already ends with the unknown key; other callers'
            // paths point at the struct that holds it.
            let key = if path == *bad || path.ends_with(&format!(".{bad}")) {
                path.to_string()
            } else {
                join_key(path, bad)
            };
            (key, unknown_problem("key", bad, known))
        }
        (Some(what), Some((bad, known))) => (path.to_string(), unknown_problem(what, bad, known)),
        _ => (path.to_string(), msg.to_string()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde::Deserialize;
    use serde_json::json;

    #[derive(Debug, Deserialize)]
    #[serde(deny_unknown_fields)]
    #[allow(dead_code)]
    struct Distribution {
        strategy: Strategy,
        #[serde(default)]
        global_batch_size: Option<u64>,
    }

    #[derive(Debug, Deserialize)]
    #[serde(rename_all = "lowercase")]
    enum Strategy {
        Mpi,
        Threads,
    }

    #[derive(Debug, Deserialize)]
    #[serde(deny_unknown_fields)]
    #[allow(dead_code)]
    struct Run {
        seed: u64,
        #[serde(default)]
        distribution: Option<Distribution>,
    }

    #[test]
    fn unknown_key_names_the_full_path_and_the_nearest_key() {
        let v = json!({"seed": 1, "distribution": {"stratgy": "mpi"}});
        let e = from_value::<Run>(&v, "run").unwrap_err();
        assert_eq!(e.key, "run.distribution.stratgy");
        assert!(e.problem.contains("did you mean `strategy`"), "{e}");
        let e = e.in_file("config.json");
        assert_eq!(
            e.to_string(),
            "config.json: run.distribution.stratgy: unknown key `stratgy`; did you mean `strategy`?"
        );
    }

    #[test]
    fn unknown_variant_suggests_the_nearest_value() {
        let v = json!({"seed": 1, "distribution": {"strategy": "mpii"}});
        let e = from_value::<Run>(&v, "run").unwrap_err();
        assert_eq!(e.key, "run.distribution.strategy");
        assert!(e.problem.contains("did you mean `mpi`"), "{e}");
    }

    #[test]
    fn far_keys_list_the_known_keys_and_types_keep_serdes_text() {
        let v = json!({"seed": 1, "zzzzzzzz": 2});
        let e = from_value::<Run>(&v, "").unwrap_err();
        assert_eq!(e.key, "zzzzzzzz");
        assert!(e.problem.contains("known keys: seed, distribution"), "{e}");
        let e = from_value::<Run>(&json!({"seed": "x"}), "run").unwrap_err();
        assert_eq!(e.key, "run.seed");
        assert!(e.problem.contains("invalid type"), "{e}");
    }

    #[derive(Debug, Deserialize)]
    #[allow(dead_code)]
    struct ModelRun {
        dt: f64,
        #[serde(alias = "n_steps")]
        seq_len: u64,
    }

    #[test]
    fn shared_sections_check_the_union_of_their_parts() {
        let mut names = field_names::<ModelRun>().to_vec();
        names.sort_unstable();
        assert_eq!(names, ["dt", "n_steps", "seq_len"]);
        assert_eq!(field_names::<Run>(), &["seed", "distribution"]);
        assert!(field_names::<u64>().is_empty());
        let keys = [field_names::<Run>(), field_names::<ModelRun>()].concat();
        let v = json!({"seed": 1, "dt": 1.0, "seq_len": 5, "sed": 2});
        let e = check_keys(v.as_object().unwrap(), &keys, "run").unwrap_err();
        assert_eq!(e.key, "run.sed");
        assert!(e.problem.contains("did you mean `seed`"), "{e}");
    }

    #[test]
    fn check_keys_on_a_hand_walked_object() {
        let v = json!({"tsop": 1.0});
        let e = check_keys(v.as_object().unwrap(), &["tstop", "dt"], "run").unwrap_err();
        assert_eq!(e.key, "run.tsop");
        assert!(e.problem.contains("did you mean `tstop`"), "{e}");
        assert!(check_keys(v.as_object().unwrap(), &["tsop"], "run").is_ok());
    }

    #[test]
    fn nearest_key_only_for_likely_typos() {
        assert_eq!(nearest_key("bta1", &["beta1", "beta2"]), Some("beta1"));
        assert_eq!(nearest_key("LR", &["lr"]), Some("lr"));
        assert_eq!(nearest_key("x", &["dt"]), None);
        assert_eq!(nearest_key("completely_else", &["dt", "seed"]), None);
    }

    #[test]
    fn paths_are_relative_to_the_config_folder() {
        let dir = config_dir(Path::new("examples/a/config.json"));
        assert_eq!(dir, Path::new("examples/a"));
        assert_eq!(config_dir(Path::new("config.json")), Path::new("."));
        assert_eq!(
            resolve_path(&dir, "net/x.h5"),
            Path::new("examples/a/net/x.h5")
        );
        assert_eq!(resolve_path(&dir, "/abs/x.h5"), Path::new("/abs/x.h5"));
    }

    #[test]
    fn unreadable_and_invalid_files_name_the_file() {
        let e = read_json(Path::new("/nonexistent/c.json")).unwrap_err();
        assert!(
            e.to_string()
                .starts_with("/nonexistent/c.json: cannot read"),
            "{e}"
        );
    }
}
