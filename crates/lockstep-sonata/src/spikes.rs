//! SONATA spike files (SONATA spec, "Spike file"; BMTK `SpikeTrains`):
//! `/spikes/<population>/node_ids` (uint64) and `/spikes/<population>/timestamps`
//! (float64, ms, attribute `units = "ms"`), with the attribute `sorting` on the population
//! group. The spec's `sorting` is a uint8 HDF5 enum (`none` 0, `by_id` 1, `by_time` 2), the
//! form libsonata's `SpikeReader` requires; lockstep writes that. BMTK writes a string
//! (`"by_time"`) and reads both; lockstep reads the enum, the string and a plain integer
//! 0/1/2. Files of the older single-population layout (`/spikes/gids` and
//! `/spikes/timestamps`, `sorting` on `/spikes`) are read too.

use std::path::Path;

use hdf5::types::{EnumMember, EnumType, H5Type, IntSize, TypeDescriptor};

use crate::column::{describe, read_f64, read_ids, read_str_attr, write_str_attr, write_vec};
use crate::error::{Result, SonataError, SonataErrorKind};

/// Population name given to the spikes of an old single-population file (which names none).
pub const LEGACY_POPULATION: &str = "";

/// Order of the spikes in a file (the `sorting` attribute).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum SpikeSorting {
    /// No particular order (`"none"`, also used when the attribute is absent).
    #[default]
    None,
    /// Ordered by node id, then time (`"by_id"`).
    ById,
    /// Ordered by time (`"by_time"`).
    ByTime,
}

impl SpikeSorting {
    /// The attribute value.
    pub fn as_str(self) -> &'static str {
        match self {
            SpikeSorting::None => "none",
            SpikeSorting::ById => "by_id",
            SpikeSorting::ByTime => "by_time",
        }
    }

    /// The value of the SONATA enum (`none` 0, `by_id` 1, `by_time` 2).
    pub fn code(self) -> u8 {
        match self {
            SpikeSorting::None => 0,
            SpikeSorting::ById => 1,
            SpikeSorting::ByTime => 2,
        }
    }

    fn from_code(code: u64) -> Option<Self> {
        match code {
            0 => Some(SpikeSorting::None),
            1 => Some(SpikeSorting::ById),
            2 => Some(SpikeSorting::ByTime),
            _ => None,
        }
    }

    fn parse(s: &str) -> Option<Self> {
        match s {
            "none" => Some(SpikeSorting::None),
            "by_id" | "by_gid" | "by_node_id" => Some(SpikeSorting::ById),
            "by_time" => Some(SpikeSorting::ByTime),
            _ => None,
        }
    }
}

/// The spikes of one node population, `[spike]` each.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct PopulationSpikes {
    /// Node population name ([`LEGACY_POPULATION`] for old single-population files).
    pub population: String,
    /// Node id of each spike.
    pub node_ids: Vec<u64>,
    /// Time of each spike in ms.
    pub timestamps: Vec<f64>,
    /// The order the spikes are in.
    pub sorting: SpikeSorting,
}

impl PopulationSpikes {
    /// Number of spikes.
    pub fn len(&self) -> usize {
        self.node_ids.len()
    }

    /// True when there are no spikes.
    pub fn is_empty(&self) -> bool {
        self.node_ids.is_empty()
    }

    /// Sorts the spikes by time (ties by node id) and marks them `by_time`.
    pub fn sort_by_time(&mut self) {
        let mut idx: Vec<usize> = (0..self.len()).collect();
        idx.sort_by(|&a, &b| {
            self.timestamps[a]
                .total_cmp(&self.timestamps[b])
                .then(self.node_ids[a].cmp(&self.node_ids[b]))
        });
        self.node_ids = idx.iter().map(|&i| self.node_ids[i]).collect();
        self.timestamps = idx.iter().map(|&i| self.timestamps[i]).collect();
        self.sorting = SpikeSorting::ByTime;
    }

    /// Sorts the spikes by node id (ties by time) and marks them `by_id`.
    pub fn sort_by_id(&mut self) {
        let mut idx: Vec<usize> = (0..self.len()).collect();
        idx.sort_by(|&a, &b| {
            self.node_ids[a]
                .cmp(&self.node_ids[b])
                .then(self.timestamps[a].total_cmp(&self.timestamps[b]))
        });
        self.node_ids = idx.iter().map(|&i| self.node_ids[i]).collect();
        self.timestamps = idx.iter().map(|&i| self.timestamps[i]).collect();
        self.sorting = SpikeSorting::ById;
    }
}

/// The spikes of a spike file, one entry per population (file order).
#[derive(Debug, Clone, PartialEq, Default)]
pub struct SpikeTrains {
    /// Per-population spikes.
    pub populations: Vec<PopulationSpikes>,
}

impl SpikeTrains {
    /// The spikes of population `name`; falls back to the unnamed population of an old
    /// single-population file when no population has that name.
    pub fn get(&self, name: &str) -> Option<&PopulationSpikes> {
        self.populations
            .iter()
            .find(|p| p.population == name)
            .or_else(|| {
                self.populations
                    .iter()
                    .find(|p| p.population == LEGACY_POPULATION)
            })
    }

    /// Total number of spikes.
    pub fn total(&self) -> usize {
        self.populations.iter().map(|p| p.len()).sum()
    }
}

/// The `sorting` attribute in the SONATA spec's form: a uint8 HDF5 enum with the members
/// `none` 0, `by_id` 1, `by_time` 2 (libsonata's `SpikeReader` reads it by member name).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(transparent)]
struct SortingEnum(u8);

// SAFETY: `SortingEnum` is a `repr(transparent)` u8, the size and layout of the 1-byte
// unsigned enum it describes.
unsafe impl H5Type for SortingEnum {
    fn type_descriptor() -> TypeDescriptor {
        let member = |name: &str, value: u64| EnumMember {
            name: name.to_string(),
            value,
        };
        TypeDescriptor::Enum(EnumType {
            size: IntSize::U1,
            signed: false,
            members: vec![member("none", 0), member("by_id", 1), member("by_time", 2)],
        })
    }
}

/// Reads the `sorting` attribute of `loc`: the spec's enum (converted by member name), a
/// string (BMTK), or a plain integer 0/1/2; absent is `none`.
fn read_sorting(path: &Path, loc: &hdf5::Location) -> Result<SpikeSorting> {
    let obj = format!("{}@sorting", loc.name());
    let bad = |problem: String| {
        SonataError::from(SonataErrorKind::BadValue {
            path: path.to_path_buf(),
            object: obj.clone(),
            problem,
        })
    };
    if !loc
        .attr_names()
        .is_ok_and(|names| names.iter().any(|n| n == "sorting"))
    {
        return Ok(SpikeSorting::None);
    }
    let attr = loc
        .attr("sorting")
        .map_err(|e| SonataError::h5(path, &obj, e))?;
    let td = attr
        .dtype()
        .and_then(|t| t.to_descriptor())
        .map_err(|e| SonataError::h5(path, &obj, e))?;
    match td {
        TypeDescriptor::Enum(e) => {
            let names: Vec<&str> = e.members.iter().map(|m| m.name.as_str()).collect();
            if let Some(extra) = names
                .iter()
                .find(|n| !["none", "by_id", "by_time"].contains(n))
            {
                return Err(bad(format!(
                    "enum member '{extra}' is not one of none, by_id, by_time (members: {})",
                    names.join(", ")
                )));
            }
            let v = attr
                .read_scalar::<SortingEnum>()
                .map_err(|e| SonataError::h5(path, &obj, e))?;
            SpikeSorting::from_code(v.0 as u64)
                .ok_or_else(|| bad(format!("enum value {} is not 0, 1 or 2", v.0)))
        }
        TypeDescriptor::Integer(_) | TypeDescriptor::Unsigned(_) => {
            let v = attr
                .read_scalar::<i64>()
                .map_err(|e| SonataError::h5(path, &obj, e))?;
            u64::try_from(v)
                .ok()
                .and_then(SpikeSorting::from_code)
                .ok_or_else(|| bad(format!("{v} is not 0 (none), 1 (by_id) or 2 (by_time)")))
        }
        TypeDescriptor::VarLenUnicode
        | TypeDescriptor::VarLenAscii
        | TypeDescriptor::FixedAscii(_)
        | TypeDescriptor::FixedUnicode(_) => {
            let s = read_str_attr(path, loc, "sorting")?.unwrap_or_default();
            SpikeSorting::parse(&s)
                .ok_or_else(|| bad(format!("'{s}' is not one of none, by_id, by_time")))
        }
        other => Err(bad(format!(
            "is {}; expected the SONATA enum (uint8: none 0, by_id 1, by_time 2) or a string",
            describe(&other)
        ))),
    }
}

/// Writes the `sorting` attribute of `g` as the SONATA spec's uint8 enum.
fn write_sorting(path: &Path, g: &hdf5::Group, sorting: SpikeSorting) -> Result<()> {
    let obj = format!("{}@sorting", g.name());
    g.new_attr::<SortingEnum>()
        .create("sorting")
        .and_then(|a| a.write_scalar(&SortingEnum(sorting.code())))
        .map_err(|e| SonataError::h5(path, obj, e))
}

/// Reads timestamps and converts them to ms according to their `units` attribute
/// (`ms` or absent: unchanged; `s`: x1000).
fn read_times(path: &Path, ds: &hdf5::Dataset) -> Result<Vec<f64>> {
    let mut t = read_f64(path, ds)?;
    match read_str_attr(path, ds, "units")?.as_deref() {
        None | Some("ms") => {}
        Some("s") => t.iter_mut().for_each(|x| *x *= 1000.0),
        Some(other) => {
            return Err(SonataErrorKind::BadValue {
                path: path.to_path_buf(),
                object: format!("{}@units", ds.name()),
                problem: format!("units '{other}' is not 'ms' or 's'"),
            }
            .into())
        }
    }
    Ok(t)
}

/// Reads a SONATA spike file (both layouts, see the module docs).
pub fn read_spikes(path: impl AsRef<Path>) -> Result<SpikeTrains> {
    let path = path.as_ref();
    let file = crate::open_h5(path, "spikes file")?;
    let root = file.group("spikes").map_err(|_| {
        SonataError::from(SonataErrorKind::MissingDataset {
            path: path.to_path_buf(),
            object: "/spikes".into(),
            hint: "a SONATA spike file has a top-level 'spikes' group".into(),
        })
    })?;
    let ds = |g: &hdf5::Group, name: &str| {
        crate::column::open_dataset(
            path,
            g,
            name,
            "spike files store node_ids (or gids) and timestamps",
        )
    };
    let mut out = SpikeTrains::default();
    if root.link_exists("gids")
        || (root.link_exists("timestamps") && root.dataset("timestamps").is_ok())
    {
        let ids = read_ids(path, &ds(&root, "gids")?)?;
        let times = read_times(path, &ds(&root, "timestamps")?)?;
        check_same_len(path, "/spikes", ids.len(), times.len())?;
        out.populations.push(PopulationSpikes {
            population: LEGACY_POPULATION.to_string(),
            node_ids: ids,
            timestamps: times,
            sorting: read_sorting(path, &root)?,
        });
        return Ok(out);
    }
    for name in root
        .member_names()
        .map_err(|e| SonataError::h5(path, "/spikes", e))?
    {
        let obj = format!("/spikes/{name}");
        let Ok(g) = root.group(&name) else {
            return Err(SonataErrorKind::WrongDtype {
                path: path.to_path_buf(),
                object: obj,
                found: "a dataset".into(),
                expected: "a population group with node_ids and timestamps".into(),
            }
            .into());
        };
        let ids_ds = ds(&g, "node_ids")?;
        let ids = read_ids(path, &ids_ds)?;
        let times = read_times(path, &ds(&g, "timestamps")?)?;
        check_same_len(path, &obj, ids.len(), times.len())?;
        out.populations.push(PopulationSpikes {
            population: name,
            node_ids: ids,
            timestamps: times,
            sorting: read_sorting(path, &g)?,
        });
    }
    Ok(out)
}

fn check_same_len(path: &Path, obj: &str, ids: usize, times: usize) -> Result<()> {
    if ids != times {
        return Err(SonataErrorKind::BadValue {
            path: path.to_path_buf(),
            object: obj.to_string(),
            problem: format!("{ids} node ids but {times} timestamps"),
        }
        .into());
    }
    Ok(())
}

/// Writes a SONATA spike file in the current layout: per population `node_ids` (uint64),
/// `timestamps` (float64, `units="ms"`) and the `sorting` attribute (the spec's uint8 enum,
/// see the module docs); root attributes `magic`
/// and `version` as BMTK writes them. The spikes are written in the order given; the
/// `sorting` attribute is written as stated (use [`PopulationSpikes::sort_by_time`] first to
/// make it true). An existing file is replaced.
pub fn write_spikes(path: impl AsRef<Path>, spikes: &SpikeTrains) -> Result<()> {
    let path = path.as_ref();
    let what = || format!("spikes file '{}'", path.display());
    for (i, p) in spikes.populations.iter().enumerate() {
        if p.node_ids.len() != p.timestamps.len() {
            return Err(SonataErrorKind::InvalidData {
                what: what(),
                problem: format!(
                    "population '{}' has {} node ids but {} timestamps",
                    p.population,
                    p.node_ids.len(),
                    p.timestamps.len()
                ),
            }
            .into());
        }
        if p.population.is_empty() || p.population.contains('/') {
            return Err(SonataErrorKind::InvalidData {
                what: what(),
                problem: format!(
                    "population name '{}' must be non-empty and without '/'",
                    p.population
                ),
            }
            .into());
        }
        let out_of_order = match p.sorting {
            SpikeSorting::None => None,
            SpikeSorting::ByTime => (1..p.len()).find(|&k| p.timestamps[k] < p.timestamps[k - 1]),
            SpikeSorting::ById => (1..p.len()).find(|&k| {
                (p.node_ids[k], p.timestamps[k]) < (p.node_ids[k - 1], p.timestamps[k - 1])
            }),
        };
        if let Some(k) = out_of_order {
            return Err(SonataErrorKind::InvalidData {
                what: what(),
                problem: format!(
                    "population '{}' says sorting = {} but spike {k} (node {}, {} ms) comes after (node {}, {} ms); sort it first or write sorting none",
                    p.population,
                    p.sorting.as_str(),
                    p.node_ids[k],
                    p.timestamps[k],
                    p.node_ids[k - 1],
                    p.timestamps[k - 1]
                ),
            }
            .into());
        }
        if spikes.populations[..i]
            .iter()
            .any(|q| q.population == p.population)
        {
            return Err(SonataErrorKind::InvalidData {
                what: what(),
                problem: format!("population '{}' is listed twice", p.population),
            }
            .into());
        }
    }
    let file = hdf5::File::create(path).map_err(|e| SonataError::h5(path, "/", e))?;
    crate::write::write_root_attrs(path, &file)?;
    let root = file
        .create_group("spikes")
        .map_err(|e| SonataError::h5(path, "/spikes", e))?;
    for p in &spikes.populations {
        let obj = format!("/spikes/{}", p.population);
        let g = root
            .create_group(&p.population)
            .map_err(|e| SonataError::h5(path, &obj, e))?;
        write_sorting(path, &g, p.sorting)?;
        write_vec(path, &g, "node_ids", &p.node_ids)?;
        let t = write_vec(path, &g, "timestamps", &p.timestamps)?;
        write_str_attr(path, &t, "units", "ms")?;
    }
    Ok(())
}
