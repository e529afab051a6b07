//! SONATA frame-oriented node reports (membrane potential of point neurons) and the `reports`
//! block of a simulation config.
//!
//! File layout (SONATA spec, "Output file formats: frame oriented, node element recordings";
//! the same layout BMTK's `CompartmentReport` writes and libsonata's `SomaReportReader`
//! reads), per node population `<pop>`:
//!
//! | object | dtype, shape | content |
//! |---|---|---|
//! | `/report/<pop>/mapping/node_ids` | uint64 `[node]` | recorded node ids; attribute `sorted` (uint8, 1 when ascending) |
//! | `/report/<pop>/mapping/index_pointers` | uint64 `[node + 1]` | node `i` owns columns `index_pointers[i]..index_pointers[i+1]` of `data` |
//! | `/report/<pop>/mapping/index_pointer` | (hard link to the above) | the name BMTK reads and writes |
//! | `/report/<pop>/mapping/element_ids` | uint32 `[element]` | 0 for the single compartment of a point neuron |
//! | `/report/<pop>/mapping/element_pos` | float64 `[element]` | 0.0 (as BMTK's pointnet writes) |
//! | `/report/<pop>/mapping/time` | float64 `[3]` | `[start, stop, step]` in ms (attribute `units = "ms"`); frame `k` is at `start + k step`, and the interval is open on the right: `stop = start + n_frames step` |
//! | `/report/<pop>/data` | float32 (or float64) `[frame, element]` | the values; attributes `units` (`"mV"`) and `variable` (`"V_m"`) |
//!
//! The file root carries `magic` and `version` like every SONATA file lockstep writes.
//!
//! Readers: BMTK (`bmtk.utils.reports.CompartmentReport`) reads float32 and float64 data and
//! derives the frame count as `(stop - start) / step`; libsonata 0.2 reads the same mapping but
//! only float32 data (`"DataType of dataset 'data' should be Float32"`), the SONATA report
//! spec's type. So the default is float32 (about 7 significant digits, 1e-5 mV at -70 mV);
//! `dtype: "float64"` keeps every value exact, for comparisons against NEST.
//!
//! The config side ([`ReportConfig`], [`MembraneReportSettings`], [`NodeSelection`]) reads one
//! entry of the `reports` block (SONATA spec, "Simulation output - Reports"; BMTK
//! `simulation_reports.py`): the module, variable, cells, sections, file name, format, unit,
//! and the recording window, which is left to the simulator that knows the time grid.

use std::path::Path;

use lockstep_core::config::{self, ConfigError};
use serde::Deserialize;
use serde_json::{Map, Value};

use crate::column::{dtype_of, open_dataset, read_f64, read_ids, read_str_attr, write_str_attr};
use crate::error::{Result, SonataError, SonataErrorKind};

/// The recordings of one node population: `n_frames x n_elements` values.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct ReportPopulation {
    /// Node population name.
    pub population: String,
    /// `[node]` recorded node ids (file order).
    pub node_ids: Vec<u64>,
    /// `[node + 1]`: node `i` owns the elements (data columns) `index_pointers[i]..index_pointers[i + 1]`.
    pub index_pointers: Vec<u64>,
    /// `[element]` element (compartment) id of each data column.
    pub element_ids: Vec<u32>,
    /// `[element]` position of each element along its section (0.0 for point neurons).
    pub element_pos: Vec<f64>,
    /// `[start, stop, step]` in ms: frame `k` is at `start + k step`; `stop` is exclusive.
    pub time: [f64; 3],
    /// `[frame, element]` row-major values, in `units`.
    pub data: Vec<f64>,
    /// Unit of `data`, e.g. `"mV"`.
    pub units: String,
}

impl ReportPopulation {
    /// A report with one element (the soma) per node: `data` is `[frame, node]` row-major,
    /// frame `k` at `start + k step` ms. `time` becomes `[start, start + n_frames step, step]`.
    pub fn single_compartment(
        population: impl Into<String>,
        node_ids: Vec<u64>,
        start: f64,
        step: f64,
        data: Vec<f64>,
        units: impl Into<String>,
    ) -> Self {
        let n = node_ids.len();
        let frames = data.len().checked_div(n).unwrap_or(0);
        ReportPopulation {
            population: population.into(),
            index_pointers: (0..=n as u64).collect(),
            element_ids: vec![0; n],
            element_pos: vec![0.0; n],
            node_ids,
            time: [start, start + frames as f64 * step, step],
            data,
            units: units.into(),
        }
    }

    /// Number of data columns (elements).
    pub fn n_elements(&self) -> usize {
        self.element_ids.len()
    }

    /// Number of frames (data rows).
    pub fn n_frames(&self) -> usize {
        self.data.len().checked_div(self.n_elements()).unwrap_or(0)
    }

    /// `[frame]` time of each frame in ms (`start + k step`).
    pub fn times(&self) -> Vec<f64> {
        (0..self.n_frames())
            .map(|k| self.time[0] + k as f64 * self.time[2])
            .collect()
    }

    /// `[frame]` values of the first element of node `node_id`, or `None` when it is not
    /// recorded.
    pub fn trace(&self, node_id: u64) -> Option<Vec<f64>> {
        let i = self.node_ids.iter().position(|&n| n == node_id)?;
        let col = usize::try_from(*self.index_pointers.get(i)?).ok()?;
        let ne = self.n_elements();
        (col < ne).then(|| self.data.iter().skip(col).step_by(ne).copied().collect())
    }

    fn check(&self, what: &str) -> Result<()> {
        let bad = |problem: String| -> Result<()> {
            Err(SonataErrorKind::InvalidData {
                what: what.to_string(),
                problem: format!("population '{}': {problem}", self.population),
            }
            .into())
        };
        let (n, ne) = (self.node_ids.len(), self.element_ids.len());
        if self.index_pointers.len() != n + 1 {
            return bad(format!(
                "{} index pointers for {n} nodes (need nodes + 1)",
                self.index_pointers.len()
            ));
        }
        if self.index_pointers[0] != 0
            || self.index_pointers.windows(2).any(|w| w[1] < w[0])
            || self.index_pointers[n] != ne as u64
        {
            return bad(format!(
                "index pointers must rise from 0 to the {ne} elements"
            ));
        }
        if self.element_pos.len() != ne {
            return bad(format!(
                "{} element positions for {ne} elements",
                self.element_pos.len()
            ));
        }
        if ne == 0 || !self.data.len().is_multiple_of(ne) {
            return bad(format!(
                "{} values do not fill whole frames of {ne} elements",
                self.data.len()
            ));
        }
        let mut seen = self.node_ids.clone();
        seen.sort_unstable();
        if let Some(w) = seen.windows(2).find(|w| w[0] == w[1]) {
            return bad(format!("node id {} is listed twice", w[0]));
        }
        let [start, stop, step] = self.time;
        if !(start.is_finite() && stop.is_finite() && step.is_finite() && step > 0.0) {
            return bad(format!(
                "time [{start}, {stop}, {step}] must be finite with a positive step"
            ));
        }
        Ok(())
    }
}

/// A SONATA report file: the variable and one block per node population.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Report {
    /// The recorded variable (`data@variable`), e.g. `"V_m"`.
    pub variable: String,
    /// One entry per population (file order when read).
    pub populations: Vec<ReportPopulation>,
}

impl Report {
    /// The block of population `name`.
    pub fn population(&self, name: &str) -> Option<&ReportPopulation> {
        self.populations.iter().find(|p| p.population == name)
    }
}

/// Floating-point type of the `data` dataset.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
pub enum ReportDtype {
    /// Double precision: every value exactly as simulated (the opt-in for exact comparisons,
    /// e.g. against NEST's multimeter).
    #[serde(rename = "float64")]
    Float64,
    /// Single precision: the SONATA report spec's type, the only one libsonata's report
    /// readers accept (the default).
    #[default]
    #[serde(rename = "float32")]
    Float32,
}

/// Writes a report file (layout in the module docs), replacing an existing file.
///
/// Errors: [`SonataErrorKind::InvalidData`] when a population is inconsistent (index
/// pointers, element or value counts, duplicate node ids or population names, a bad time
/// triple), [`SonataErrorKind::Hdf5`] when the file cannot be written.
pub fn write_report(path: impl AsRef<Path>, report: &Report, dtype: ReportDtype) -> Result<()> {
    let path = path.as_ref();
    let what = format!("report file '{}'", path.display());
    for (i, p) in report.populations.iter().enumerate() {
        if p.population.is_empty() || p.population.contains('/') {
            return Err(SonataErrorKind::InvalidData {
                what,
                problem: format!(
                    "population name '{}' must be non-empty and without '/'",
                    p.population
                ),
            }
            .into());
        }
        if report.populations[..i]
            .iter()
            .any(|q| q.population == p.population)
        {
            return Err(SonataErrorKind::InvalidData {
                what,
                problem: format!("population '{}' is listed twice", p.population),
            }
            .into());
        }
        p.check(&what)?;
    }
    let file = hdf5::File::create(path).map_err(|e| SonataError::h5(path, "/", e))?;
    crate::write::write_root_attrs(path, &file)?;
    let root = file
        .create_group("report")
        .map_err(|e| SonataError::h5(path, "/report", e))?;
    for p in &report.populations {
        let obj = format!("/report/{}", p.population);
        let g = root
            .create_group(&p.population)
            .map_err(|e| SonataError::h5(path, &obj, e))?;
        let m = g
            .create_group("mapping")
            .map_err(|e| SonataError::h5(path, format!("{obj}/mapping"), e))?;
        let ids = crate::column::write_vec(path, &m, "node_ids", &p.node_ids)?;
        let sorted = u8::from(p.node_ids.windows(2).all(|w| w[0] < w[1]));
        ids.new_attr::<u8>()
            .create("sorted")
            .and_then(|a| a.write_scalar(&sorted))
            .map_err(|e| SonataError::h5(path, format!("{obj}/mapping/node_ids@sorted"), e))?;
        crate::column::write_vec(path, &m, "index_pointers", &p.index_pointers)?;
        m.link_hard("index_pointers", "index_pointer")
            .map_err(|e| SonataError::h5(path, format!("{obj}/mapping/index_pointer"), e))?;
        crate::column::write_vec(path, &m, "element_ids", &p.element_ids)?;
        crate::column::write_vec(path, &m, "element_pos", &p.element_pos)?;
        let t = crate::column::write_vec(path, &m, "time", &p.time)?;
        write_str_attr(path, &t, "units", "ms")?;
        let shape = [p.n_frames(), p.n_elements()];
        let dobj = format!("{obj}/data");
        let data = match dtype {
            ReportDtype::Float64 => {
                let ds = g
                    .new_dataset::<f64>()
                    .shape(shape)
                    .create("data")
                    .map_err(|e| SonataError::h5(path, &dobj, e))?;
                ds.write_raw(&p.data)
                    .map_err(|e| SonataError::h5(path, &dobj, e))?;
                ds
            }
            ReportDtype::Float32 => {
                let v: Vec<f32> = p.data.iter().map(|&x| x as f32).collect();
                let ds = g
                    .new_dataset::<f32>()
                    .shape(shape)
                    .create("data")
                    .map_err(|e| SonataError::h5(path, &dobj, e))?;
                ds.write_raw(&v)
                    .map_err(|e| SonataError::h5(path, &dobj, e))?;
                ds
            }
        };
        write_str_attr(path, &data, "units", &p.units)?;
        write_str_attr(path, &data, "variable", &report.variable)?;
    }
    Ok(())
}

/// Reads a report file written by lockstep, BMTK or another SONATA writer: `index_pointers`
/// (SONATA, libsonata) or `index_pointer` (BMTK), float32 or float64 data, `time` in ms
/// (`units` "ms" or absent) or s. The frame count is the number of data rows (BMTK's pointnet
/// writes `stop` as the last frame's time, the spec one step later).
///
/// Errors: [`SonataErrorKind::MissingDataset`] for an absent group or dataset,
/// [`SonataErrorKind::WrongDtype`] / [`SonataErrorKind::BadValue`] for inconsistent shapes,
/// pointers or units, [`SonataErrorKind::Io`] when the file cannot be opened.
pub fn read_report(path: impl AsRef<Path>) -> Result<Report> {
    let path = path.as_ref();
    let file = crate::open_h5(path, "report file")?;
    let root = file.group("report").map_err(|_| {
        SonataError::from(SonataErrorKind::MissingDataset {
            path: path.to_path_buf(),
            object: "/report".into(),
            hint: "a SONATA report file has a top-level 'report' group".into(),
        })
    })?;
    let bad = |object: String, problem: String| -> SonataError {
        SonataErrorKind::BadValue {
            path: path.to_path_buf(),
            object,
            problem,
        }
        .into()
    };
    let mut report = Report::default();
    let names = root
        .member_names()
        .map_err(|e| SonataError::h5(path, "/report", e))?;
    for name in names {
        let obj = format!("/report/{name}");
        let g = root
            .group(&name)
            .map_err(|e| SonataError::h5(path, &obj, e))?;
        let hint =
            "SONATA reports store mapping/{node_ids, index_pointers, element_ids, time} and data";
        let mapping_ds = |ds: &str| -> Result<hdf5::Dataset> {
            let m = g.group("mapping").map_err(|_| {
                SonataError::from(SonataErrorKind::MissingDataset {
                    path: path.to_path_buf(),
                    object: format!("{obj}/mapping"),
                    hint: hint.into(),
                })
            })?;
            open_dataset(path, &m, ds, hint)
        };
        let node_ids = read_ids(path, &mapping_ds("node_ids")?)?;
        let ptr_name = if g
            .group("mapping")
            .is_ok_and(|m| m.link_exists("index_pointers"))
        {
            "index_pointers"
        } else {
            "index_pointer"
        };
        let index_pointers = read_ids(path, &mapping_ds(ptr_name)?)?;
        let element_ids: Vec<u32> = read_ids(path, &mapping_ds("element_ids")?)?
            .into_iter()
            .map(|e| u32::try_from(e).unwrap_or(u32::MAX))
            .collect();
        let element_pos = match mapping_ds("element_pos") {
            Ok(ds) => read_f64(path, &ds)?,
            Err(_) => vec![0.0; element_ids.len()],
        };
        let tds = mapping_ds("time")?;
        let mut t = read_f64(path, &tds)?;
        if t.len() != 3 {
            return Err(bad(
                tds.name(),
                format!("holds {} values; expected [start, stop, step]", t.len()),
            ));
        }
        match read_str_attr(path, &tds, "units")?.as_deref() {
            None | Some("ms") => {}
            Some("s") => t.iter_mut().for_each(|x| *x *= 1000.0),
            Some(u) => {
                return Err(bad(
                    format!("{}@units", tds.name()),
                    format!("units '{u}' is not 'ms' or 's'"),
                ))
            }
        }
        let dds = open_dataset(path, &g, "data", hint)?;
        let shape = dds.shape();
        let td = dtype_of(path, &dds)?;
        if shape.len() != 2 || !matches!(td, hdf5::types::TypeDescriptor::Float(_)) {
            return Err(SonataErrorKind::WrongDtype {
                path: path.to_path_buf(),
                object: dds.name(),
                found: format!("{} with shape {shape:?}", crate::column::describe(&td)),
                expected: "a 2-D float dataset [time, element]".into(),
            }
            .into());
        }
        if shape[1] != element_ids.len() {
            return Err(bad(
                dds.name(),
                format!(
                    "has {} columns but the mapping lists {} elements",
                    shape[1],
                    element_ids.len()
                ),
            ));
        }
        let data = dds
            .read_raw::<f64>()
            .map_err(|e| SonataError::h5(path, dds.name(), e))?;
        let p = ReportPopulation {
            population: name.clone(),
            node_ids,
            index_pointers,
            element_ids,
            element_pos,
            time: [t[0], t[1], t[2]],
            data,
            units: read_str_attr(path, &dds, "units")?.unwrap_or_default(),
        };
        p.check(&format!("report '{}'", path.display()))
            .map_err(|e| bad(obj.clone(), e.to_string()))?;
        if report.variable.is_empty() {
            report.variable = read_str_attr(path, &dds, "variable")?.unwrap_or_default();
        }
        report.populations.push(p);
    }
    Ok(report)
}

/// One entry of a simulation config's `reports` block, as written.
///
/// Keys: SONATA's reserved report attributes (`cells`, `variable_name`, `sections`,
/// `file_name`, `unit`, `format`), BMTK's `module` and `enabled`, the recording window in BMTK
/// pointnet's names (`tstart`, `tstop`, `interval`: the documented keys, which BMTK's
/// multimeter reads), and lockstep's `dtype` (see [`ReportDtype`]). The SONATA spec's names
/// for the window (`start_time`, `end_time`, `dt`) are accepted as aliases, but BMTK's pointnet
/// ignores them, so [`membrane_reports`] warns where they are used
/// ([`MembraneReportSettings::warnings`]). Any other key is an error that names the nearest
/// known key.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ReportConfig {
    /// The report kind: `"multimeter_report"` (also `"multimeter"`, `"membrane_report"`).
    pub module: String,
    /// The recorded variable: `"V_m"` or `["V_m"]`.
    pub variable_name: Value,
    /// The node set to record (a population name, a node set name, or
    /// `{"population": ..., "node_id": [...]}`).
    #[serde(default)]
    pub cells: Option<Value>,
    /// Compartments: `"soma"` or `"all"` (a point neuron has one).
    #[serde(default)]
    pub sections: Option<String>,
    /// Output file name (default `<report name>.h5`), inside `output.output_dir`.
    #[serde(default)]
    pub file_name: Option<String>,
    /// `tstart`: recording starts after this time (ms; default 0; alias `start_time`).
    #[serde(default, rename = "tstart", alias = "start_time")]
    pub start_time: Option<f64>,
    /// `tstop`: recording ends at this time (ms; default `run.tstop`; alias `end_time`).
    #[serde(default, rename = "tstop", alias = "end_time")]
    pub end_time: Option<f64>,
    /// `interval`: the recording interval (ms; default `run.dt`; alias `dt`).
    #[serde(default, rename = "interval", alias = "dt")]
    pub dt: Option<f64>,
    /// `false` skips the report (BMTK).
    #[serde(default)]
    pub enabled: Option<bool>,
    /// Unit text; only `"mV"` for `V_m`.
    #[serde(default)]
    pub unit: Option<String>,
    /// Output format; only `"HDF5"`.
    #[serde(default)]
    pub format: Option<String>,
    /// Data type of `data` (lockstep; default `"float32"`, the spec's; `"float64"` keeps
    /// values exact).
    #[serde(default)]
    pub dtype: Option<ReportDtype>,
}

/// The modules that record a membrane variable of point neurons (BMTK's pointnet treats
/// them alike).
pub const MEMBRANE_REPORT_MODULES: &[&str] =
    &["multimeter_report", "multimeter", "membrane_report"];

/// A membrane report entry with its names checked; the recording window (`tstart`, `tstop`,
/// `interval`) is left as written for the simulator to place on its time grid.
#[derive(Debug, Clone, PartialEq)]
pub struct MembraneReportSettings {
    /// The report's name (its key in `reports`).
    pub name: String,
    /// The variable, `"V_m"`.
    pub variable: String,
    /// The cells to record.
    pub cells: NodeSelection,
    /// File name inside the output folder.
    pub file_name: String,
    /// `tstart` (or `start_time`, ms), if given.
    pub start_time: Option<f64>,
    /// `tstop` (or `end_time`, ms), if given.
    pub end_time: Option<f64>,
    /// `interval` (or `dt`, ms), if given.
    pub dt: Option<f64>,
    /// Data type of the written values.
    pub dtype: ReportDtype,
    /// Keys of this entry that lockstep honours but BMTK's pointnet would ignore (the SONATA
    /// names of the window), one message each naming `reports.<name>.<key>` and the key BMTK
    /// reads.
    pub warnings: Vec<String>,
    /// The names the entry gives its window keys, for messages: `[start, stop, interval]`,
    /// each the SONATA name where the entry used it (`start_time`, `end_time`, `dt`), else
    /// BMTK's (`tstart`, `tstop`, `interval`).
    pub window_keys: [&'static str; 3],
}

/// The window keys lockstep accepts under their SONATA names, which BMTK's pointnet
/// multimeter ignores, with the names it reads: `(accepted, BMTK's)`.
pub const BMTK_IGNORED_REPORT_KEYS: &[(&str, &str)] = &[
    ("start_time", "tstart"),
    ("end_time", "tstop"),
    ("dt", "interval"),
];

/// One warning per key of the report entry `entry` (named `section`) that BMTK's pointnet
/// would ignore (see [`BMTK_IGNORED_REPORT_KEYS`]).
fn bmtk_ignored_keys(section: &str, entry: &Value) -> Vec<String> {
    BMTK_IGNORED_REPORT_KEYS
        .iter()
        .filter(|(k, _)| entry.get(k).is_some())
        .map(|(k, bmtk)| {
            let default = match *k {
                "dt" => "every run.dt",
                "start_time" => "from the start",
                _ => "to the end of the run",
            };
            format!(
                "{section}.{k} is honoured by lockstep but ignored by BMTK's pointnet, which records {default} unless the key is \"{bmtk}\"; write \"{bmtk}\" so both record the same frames"
            )
        })
        .collect()
}

/// Which nodes a report records.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NodeSelection {
    /// The node population.
    pub population: String,
    /// The node ids, or `None` for every node of the population.
    pub node_ids: Option<Vec<u64>>,
}

/// Reads the `reports` block of a resolved simulation config: every enabled entry, checked.
///
/// `node_sets` are the config's named node sets (see [`node_sets`]); `output_dir` is the
/// resolved output folder, used to accept an absolute `file_name` that lies directly in it.
/// Entries with `enabled: false` are skipped. Two reports writing the same file are refused.
///
/// Errors: [`ConfigError`] naming `reports.<name>.<key>`: an unknown key (nearest key
/// suggested), a module other than a membrane report ("only membrane reports of V_m"), a
/// variable other than `V_m`, sections other than `soma`/`all`, a unit other than `mV`, a
/// format other than HDF5, a `cells` value lockstep cannot resolve, or a file name that is not
/// a plain `.h5` name inside `output_dir`.
pub fn membrane_reports(
    reports: Option<&Value>,
    node_sets: &Map<String, Value>,
    output_dir: &Path,
) -> std::result::Result<Vec<MembraneReportSettings>, ConfigError> {
    let Some(reports) = reports else {
        return Ok(Vec::new());
    };
    let Value::Object(map) = reports else {
        return Err(ConfigError::new(
            "reports",
            format!("must be an object of named reports, found {reports}"),
        ));
    };
    let mut out: Vec<MembraneReportSettings> = Vec::new();
    for (name, v) in map {
        let section = format!("reports.{name}");
        let key = |k: &str| format!("{section}.{k}");
        let rc: ReportConfig = config::from_value(v, &section)?;
        if rc.enabled == Some(false) {
            continue;
        }
        if !MEMBRANE_REPORT_MODULES.contains(&rc.module.as_str()) {
            return Err(ConfigError::new(
                key("module"),
                format!(
                    "module '{}' is not supported by lockstep simulate; it writes membrane reports of point neurons (module \"multimeter_report\", also \"membrane_report\"), and spikes through output.spikes_file",
                    rc.module
                ),
            ));
        }
        let variable = match &rc.variable_name {
            Value::String(s) => s.clone(),
            Value::Array(a) if a.len() == 1 && a[0].is_string() => {
                a[0].as_str().unwrap_or_default().to_string()
            }
            other => {
                return Err(ConfigError::new(
                    key("variable_name"),
                    format!("must be \"V_m\" (or [\"V_m\"]), found {other}; lockstep records the membrane potential only"),
                ))
            }
        };
        if variable != "V_m" {
            return Err(ConfigError::new(
                key("variable_name"),
                format!("variable '{variable}' is not recorded by lockstep; point neurons report \"V_m\" (membrane potential, mV)"),
            ));
        }
        if let Some(s) = rc.sections.as_deref() {
            if s != "soma" && s != "all" {
                return Err(ConfigError::new(
                    key("sections"),
                    format!("'{s}' is not a section of a point neuron; use \"soma\" (a point neuron has one compartment)"),
                ));
            }
        }
        if let Some(u) = rc.unit.as_deref() {
            if u != "mV" {
                return Err(ConfigError::new(
                    key("unit"),
                    format!("V_m is reported in mV, not '{u}'; drop the key or write \"mV\""),
                ));
            }
        }
        if let Some(f) = rc.format.as_deref() {
            if !f.eq_ignore_ascii_case("hdf5") {
                return Err(ConfigError::new(
                    key("format"),
                    format!("format '{f}' is not supported; lockstep writes SONATA HDF5 reports (\"HDF5\")"),
                ));
            }
        }
        let cells_value = rc.cells.as_ref().ok_or_else(|| {
            ConfigError::new(
                key("cells"),
                "is missing: name the cells to record (a node population, a node set, or {\"population\": ..., \"node_id\": [...]})",
            )
        })?;
        let cells = node_selection(cells_value, node_sets, &key("cells"))?;
        let file_name = report_file_name(name, rc.file_name.as_deref(), output_dir)
            .map_err(|p| ConfigError::new(key("file_name"), p))?;
        if let Some(other) = out.iter().find(|r| r.file_name == file_name) {
            return Err(ConfigError::new(
                key("file_name"),
                format!(
                    "'{file_name}' is also written by report '{}'; give each report its own file_name",
                    other.name
                ),
            ));
        }
        out.push(MembraneReportSettings {
            name: name.clone(),
            variable,
            cells,
            file_name,
            start_time: rc.start_time,
            end_time: rc.end_time,
            dt: rc.dt,
            dtype: rc.dtype.unwrap_or_default(),
            warnings: bmtk_ignored_keys(&section, v),
            window_keys: [0, 1, 2].map(|i| {
                let (sonata, bmtk) = BMTK_IGNORED_REPORT_KEYS[i];
                if v.get(sonata).is_some() {
                    sonata
                } else {
                    bmtk
                }
            }),
        });
    }
    Ok(out)
}

/// The file a report writes, as BMTK names it: `file_name` when given, else
/// `<name>.h5` (or `name` itself when it already ends in `.h5`, `.hdf` or `.hdf5`). A plain
/// name is inside `output_dir`; a path (the config resolved it against its folder) must lie
/// directly in `output_dir` (as `"$OUTPUT_DIR/v.h5"` does). Returns the plain file name.
fn report_file_name(
    name: &str,
    file_name: Option<&str>,
    output_dir: &Path,
) -> std::result::Result<String, String> {
    let given = match file_name {
        Some(f) => f.to_string(),
        None if [".h5", ".hdf", ".hdf5"].iter().any(|e| name.ends_with(e)) => name.to_string(),
        None => format!("{name}.h5"),
    };
    let p = Path::new(&given);
    let absolute = |p: &Path| std::path::absolute(p).unwrap_or(p.to_path_buf());
    let inside = if p.components().count() == 1 {
        p.file_name()
    } else {
        p.parent()
            .filter(|d| lexical(&absolute(d)) == lexical(&absolute(output_dir)))
            .and(p.file_name())
    };
    match inside.and_then(|f| f.to_str()) {
        Some(f) => Ok(f.to_string()),
        None => Err(format!(
            "'{given}' must be a file name inside output_dir ('{}')",
            output_dir.display()
        )),
    }
}

/// `p` without `.` components and with `..` applied (no file system access).
fn lexical(p: &Path) -> std::path::PathBuf {
    let mut out = std::path::PathBuf::new();
    for c in p.components() {
        match c {
            std::path::Component::CurDir => {}
            std::path::Component::ParentDir => {
                out.pop();
            }
            other => out.push(other),
        }
    }
    out
}

/// The named node sets of a resolved simulation config: the inline `node_sets` object and the
/// JSON file `node_sets_file` (already resolved against the config's folder), the inline ones
/// winning.
///
/// Errors: [`ConfigError`] for `node_sets`/`node_sets_file` that are not objects, or a file
/// that cannot be read or is not JSON.
pub fn node_sets(config: &Value) -> std::result::Result<Map<String, Value>, ConfigError> {
    let mut sets = Map::new();
    if let Some(f) = config.get("node_sets_file") {
        let Value::String(f) = f else {
            return Err(ConfigError::new(
                "node_sets_file",
                format!("must be a path, found {f}"),
            ));
        };
        match config::read_json(Path::new(f))? {
            Value::Object(m) => sets.extend(m),
            other => {
                return Err(ConfigError::new(
                    "",
                    format!(
                    "a node sets file must hold a JSON object of named node sets, found {other}"
                ),
                )
                .in_file(f))
            }
        }
    }
    if let Some(v) = config.get("node_sets") {
        let Value::Object(m) = v else {
            return Err(ConfigError::new(
                "node_sets",
                format!("must be an object of named node sets, found {v}"),
            ));
        };
        sets.extend(m.clone());
    }
    Ok(sets)
}

/// Resolves a report's `cells`: a node set name (looked up in `node_sets`), a node population
/// name, or a node set object `{"population": P}` with optional `"node_id"` / `"node_ids"`
/// (a list of ids or one id). Node sets that filter by other attributes are refused by name.
///
/// Errors: [`ConfigError`] naming `key`.
pub fn node_selection(
    value: &Value,
    node_sets: &Map<String, Value>,
    key: &str,
) -> std::result::Result<NodeSelection, ConfigError> {
    match value {
        Value::String(s) => match node_sets.get(s) {
            Some(set) => node_selection(set, &Map::new(), &format!("node_sets.{s}"))
                .map_err(|e| ConfigError::new(key, format!("node set '{s}': {}: {}", e.key, e.problem))),
            None => Ok(NodeSelection {
                population: s.clone(),
                node_ids: None,
            }),
        },
        Value::Object(m) => {
            config::check_keys(m, &["population", "node_id", "node_ids"], key).map_err(|e| {
                ConfigError::new(
                    e.key,
                    format!("{}; lockstep selects cells by population and node ids only", e.problem),
                )
            })?;
            let population = m
                .get("population")
                .and_then(Value::as_str)
                .ok_or_else(|| {
                    ConfigError::new(
                        format!("{key}.population"),
                        "is missing or not a string: name the node population to record",
                    )
                })?
                .to_string();
            let ids = match (m.get("node_id"), m.get("node_ids")) {
                (Some(_), Some(_)) => {
                    return Err(ConfigError::new(
                        format!("{key}.node_ids"),
                        "give node_id or node_ids, not both",
                    ))
                }
                (Some(v), None) => Some(("node_id", v)),
                (None, Some(v)) => Some(("node_ids", v)),
                (None, None) => None,
            };
            let node_ids = match ids {
                None => None,
                Some((k, v)) => {
                    let list: Vec<&Value> = match v {
                        Value::Array(a) => a.iter().collect(),
                        one => vec![one],
                    };
                    let mut out = Vec::with_capacity(list.len());
                    for x in list {
                        out.push(x.as_u64().ok_or_else(|| {
                            ConfigError::new(
                                format!("{key}.{k}"),
                                format!("must hold non-negative integer node ids, found {x}"),
                            )
                        })?);
                    }
                    Some(out)
                }
            };
            Ok(NodeSelection {
                population,
                node_ids,
            })
        }
        other => Err(ConfigError::new(
            key,
            format!("must be a node population or node set name, or {{\"population\": ..., \"node_id\": [...]}}, found {other}"),
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn sample() -> Report {
        Report {
            variable: "V_m".into(),
            populations: vec![ReportPopulation::single_compartment(
                "v1",
                vec![3, 0, 7],
                1.0,
                0.5,
                vec![-70.0, -65.25, 1e-300, -69.0, f64::MIN_POSITIVE, -0.1],
                "mV",
            )],
        }
    }

    #[test]
    fn round_trip_is_exact_and_time_is_open_on_the_right() {
        let dir = tempfile::tempdir().unwrap();
        let f = dir.path().join("r.h5");
        let r = sample();
        write_report(&f, &r, ReportDtype::Float64).unwrap();
        let back = read_report(&f).unwrap();
        assert_eq!(back, r);
        let p = back.population("v1").unwrap();
        assert_eq!(p.time, [1.0, 2.0, 0.5]);
        assert_eq!(p.times(), [1.0, 1.5]);
        assert_eq!(p.trace(0).unwrap(), [-65.25, f64::MIN_POSITIVE]);
        assert_eq!(p.trace(7).unwrap(), [1e-300, -0.1]);
        assert!(p.trace(1).is_none());
    }

    #[test]
    fn float32_data_is_rounded_to_single_precision() {
        let dir = tempfile::tempdir().unwrap();
        let f = dir.path().join("r.h5");
        write_report(&f, &sample(), ReportDtype::Float32).unwrap();
        let back = read_report(&f).unwrap();
        let p = back.population("v1").unwrap();
        assert_eq!(p.trace(0).unwrap(), [-65.25, 0.0]);
        assert_eq!(p.trace(7).unwrap()[1], -0.1f32 as f64);
    }

    #[test]
    fn inconsistent_populations_are_refused() {
        let dir = tempfile::tempdir().unwrap();
        let f = dir.path().join("r.h5");
        let mut r = sample();
        r.populations[0].data.pop();
        let e = write_report(&f, &r, ReportDtype::Float64).unwrap_err();
        assert!(e.to_string().contains("whole frames of 3 elements"), "{e}");
        let mut r = sample();
        r.populations[0].node_ids[1] = 3;
        let e = write_report(&f, &r, ReportDtype::Float64).unwrap_err();
        assert!(e.to_string().contains("node id 3 is listed twice"), "{e}");
        assert!(!f.exists());
    }

    #[test]
    fn output_dir_variable_in_file_name_with_a_relative_manifest() {
        // BMTK's usual layout: "$OUTPUT_DIR/v.h5" with $OUTPUT_DIR relative to the config.
        let dir = tempfile::tempdir().unwrap();
        let cfg = dir.path().join("config.json");
        let json = json!({
            "manifest": {"$BASE_DIR": ".", "$OUTPUT_DIR": "$BASE_DIR/output"},
            "output": {"output_dir": "$OUTPUT_DIR"},
            "reports": {"membrane_potential": {"cells": "v1", "variable_name": "V_m",
                "module": "multimeter_report", "file_name": "$OUTPUT_DIR/v.h5"}}
        });
        std::fs::write(&cfg, json.to_string()).unwrap();
        for path in [cfg.clone(), std::path::absolute(&cfg).unwrap()] {
            let c = crate::SonataConfig::from_file(&path).unwrap();
            let out = Path::new(c.json["output"]["output_dir"].as_str().unwrap());
            let r = membrane_reports(c.json.get("reports"), &Map::new(), out).unwrap();
            assert_eq!(r[0].file_name, "v.h5");
        }
        // A folder other than output_dir is still refused.
        let mut other = json.clone();
        other["reports"]["membrane_potential"]["file_name"] = json!("$BASE_DIR/v.h5");
        std::fs::write(&cfg, other.to_string()).unwrap();
        let c = crate::SonataConfig::from_file(&cfg).unwrap();
        let out = Path::new(c.json["output"]["output_dir"].as_str().unwrap());
        let e = membrane_reports(c.json.get("reports"), &Map::new(), out).unwrap_err();
        assert!(
            e.to_string()
                .contains("must be a file name inside output_dir"),
            "{e}"
        );
    }

    fn settings(v: Value) -> std::result::Result<Vec<MembraneReportSettings>, ConfigError> {
        membrane_reports(Some(&v), &Map::new(), Path::new("/out"))
    }

    #[test]
    fn bmtk_report_entries_are_read_with_bmtk_defaults() {
        let r = settings(json!({"membrane_potential": {
            "cells": {"population": "cortex", "node_id": [0, 20]},
            "variable_name": "V_m", "module": "multimeter_report", "sections": "soma"}}))
        .unwrap();
        assert_eq!(r.len(), 1);
        assert_eq!(r[0].file_name, "membrane_potential.h5");
        assert_eq!(
            r[0].cells,
            NodeSelection {
                population: "cortex".into(),
                node_ids: Some(vec![0, 20])
            }
        );
        assert_eq!(r[0].dtype, ReportDtype::Float32);
        let r = settings(json!({"v.h5": {"cells": "v1", "variable_name": ["V_m"],
            "module": "membrane_report", "file_name": "/out/./x.h5", "interval": 2.0, "tstart": 1.0}}))
        .unwrap();
        assert_eq!(r[0].file_name, "x.h5");
        assert_eq!(
            (r[0].dt, r[0].start_time, r[0].end_time),
            (Some(2.0), Some(1.0), None)
        );
        let r = settings(json!({"v.h5": {"cells": "v1", "variable_name": "V_m",
            "module": "multimeter", "enabled": false}}))
        .unwrap();
        assert!(r.is_empty());
    }

    #[test]
    fn unsupported_reports_are_refused_by_name() {
        let base = json!({"cells": "v1", "variable_name": "V_m", "module": "multimeter_report"});
        let with = |k: &str, v: Value| {
            let mut b = base.clone();
            b[k] = v;
            settings(json!({"m": b})).unwrap_err()
        };
        let e = with("module", json!("extracellular"));
        assert_eq!(e.key, "reports.m.module");
        assert!(
            e.problem.contains("'extracellular' is not supported"),
            "{e}"
        );
        let e = with("variable_name", json!("i_syn"));
        assert_eq!(e.key, "reports.m.variable_name");
        assert!(e.problem.contains("'i_syn' is not recorded"), "{e}");
        let e = with("sections", json!("dend"));
        assert_eq!(e.key, "reports.m.sections");
        let e = with("file_name", json!("sub/v.h5"));
        assert!(e.problem.contains("inside output_dir"), "{e}");
        let e = with("file_name", json!("/elsewhere/v.h5"));
        assert!(e.problem.contains("inside output_dir"), "{e}");
        let e = with("start_tme", json!(1.0));
        assert_eq!(e.key, "reports.m.start_tme");
        assert!(e.problem.contains("did you mean `start_time`"), "{e}");
        let e = with("cells", json!({"population": "v1", "model_type": "point"}));
        assert_eq!(e.key, "reports.m.cells.model_type");
        let e = with("dtype", json!("float16"));
        assert_eq!(e.key, "reports.m.dtype");
        let mut b = base.clone();
        b.as_object_mut().unwrap().remove("cells");
        let e = settings(json!({"m": b})).unwrap_err();
        assert_eq!(e.key, "reports.m.cells");
        let e = settings(
            json!({"a": base.clone(), "b": {"cells": "v1", "variable_name": "V_m",
            "module": "multimeter_report", "file_name": "a.h5"}}),
        )
        .unwrap_err();
        assert!(e.problem.contains("also written by report 'a'"), "{e}");
    }

    #[test]
    fn named_node_sets_resolve_to_populations_and_ids() {
        let cfg = json!({"node_sets": {"some": {"population": "v1", "node_ids": 4}}});
        let sets = node_sets(&cfg).unwrap();
        let s = node_selection(&json!("some"), &sets, "reports.m.cells").unwrap();
        assert_eq!(s.node_ids, Some(vec![4]));
        let s = node_selection(&json!("lgn"), &sets, "reports.m.cells").unwrap();
        assert_eq!((s.population.as_str(), s.node_ids), ("lgn", None));
    }
}
