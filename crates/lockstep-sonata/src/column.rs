//! Typed columns of HDF5 groups (node/edge group attributes) and the HDF5 helpers that read
//! and write them with their on-disk dtype preserved.

use std::path::Path;

use hdf5::types::{
    FixedAscii, FixedUnicode, FloatSize, IntSize, TypeDescriptor, VarLenAscii, VarLenUnicode,
};

/// Longest fixed-length string (bytes) read from files (read through HDF5's string conversion).
const MAX_FIXED_STR: usize = 1024;
use hdf5::{Dataset, H5Type};

use crate::error::{Result, SonataError, SonataErrorKind};

/// The values of one column, in the dtype it has (or will have) on disk.
#[derive(Debug, Clone, PartialEq)]
pub enum ColumnData {
    /// int8
    I8(Vec<i8>),
    /// int16
    I16(Vec<i16>),
    /// int32
    I32(Vec<i32>),
    /// int64
    I64(Vec<i64>),
    /// uint8
    U8(Vec<u8>),
    /// uint16
    U16(Vec<u16>),
    /// uint32
    U32(Vec<u32>),
    /// uint64
    U64(Vec<u64>),
    /// float32
    F32(Vec<f32>),
    /// float64
    F64(Vec<f64>),
    /// variable-length UTF-8 string (h5py's `str` dtype).
    Str(Vec<String>),
}

macro_rules! each_numeric {
    ($self:expr, $v:ident => $body:expr, $s:ident => $sbody:expr) => {
        match $self {
            ColumnData::I8($v) => $body,
            ColumnData::I16($v) => $body,
            ColumnData::I32($v) => $body,
            ColumnData::I64($v) => $body,
            ColumnData::U8($v) => $body,
            ColumnData::U16($v) => $body,
            ColumnData::U32($v) => $body,
            ColumnData::U64($v) => $body,
            ColumnData::F32($v) => $body,
            ColumnData::F64($v) => $body,
            ColumnData::Str($s) => $sbody,
        }
    };
}

impl ColumnData {
    /// Number of stored values (rows x width).
    pub fn len(&self) -> usize {
        each_numeric!(self, v => v.len(), s => s.len())
    }

    /// True when no values are stored.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The value at flat index `i` as f64 (`None` for strings or out of range).
    #[allow(clippy::unnecessary_cast)] // the macro also expands to the f64 variant
    pub fn get_f64(&self, i: usize) -> Option<f64> {
        each_numeric!(self, v => v.get(i).map(|x| *x as f64), _s => None)
    }

    /// The value at flat index `i` as JSON (integers stay integers).
    pub fn get_json(&self, i: usize) -> Option<serde_json::Value> {
        use serde_json::Value;
        match self {
            ColumnData::I8(v) => v.get(i).map(|x| Value::from(*x)),
            ColumnData::I16(v) => v.get(i).map(|x| Value::from(*x)),
            ColumnData::I32(v) => v.get(i).map(|x| Value::from(*x)),
            ColumnData::I64(v) => v.get(i).map(|x| Value::from(*x)),
            ColumnData::U8(v) => v.get(i).map(|x| Value::from(*x)),
            ColumnData::U16(v) => v.get(i).map(|x| Value::from(*x)),
            ColumnData::U32(v) => v.get(i).map(|x| Value::from(*x)),
            ColumnData::U64(v) => v.get(i).map(|x| Value::from(*x)),
            ColumnData::F32(v) => v.get(i).map(|x| Value::from(*x as f64)),
            ColumnData::F64(v) => v.get(i).map(|x| Value::from(*x)),
            ColumnData::Str(v) => v.get(i).map(|x| Value::from(x.as_str())),
        }
    }

    /// All values as f64 (`None` for string columns).
    #[allow(clippy::unnecessary_cast)] // the macro also expands to the f64 variant
    pub fn to_f64(&self) -> Option<Vec<f64>> {
        each_numeric!(self, v => Some(v.iter().map(|x| *x as f64).collect()), _s => None)
    }

    /// The numpy-style dtype name (`uint32`, `float64`, `str`, ...).
    pub fn dtype_name(&self) -> &'static str {
        match self {
            ColumnData::I8(_) => "int8",
            ColumnData::I16(_) => "int16",
            ColumnData::I32(_) => "int32",
            ColumnData::I64(_) => "int64",
            ColumnData::U8(_) => "uint8",
            ColumnData::U16(_) => "uint16",
            ColumnData::U32(_) => "uint32",
            ColumnData::U64(_) => "uint64",
            ColumnData::F32(_) => "float32",
            ColumnData::F64(_) => "float64",
            ColumnData::Str(_) => "str",
        }
    }
}

/// One named column of a node or edge group: `shape = [rows]` (width 1) or `[rows, width]`.
#[derive(Debug, Clone, PartialEq)]
pub struct Column {
    /// Dataset name inside the group (e.g. `x`, `syn_weight`, `nsyns`).
    pub name: String,
    /// Values per row: 1 for a 1-D dataset, `k` for a `[rows, k]` dataset.
    pub width: usize,
    /// Row-major values, `[rows * width]`.
    pub data: ColumnData,
}

impl Column {
    /// A 1-D column.
    pub fn new(name: impl Into<String>, data: ColumnData) -> Self {
        Column {
            name: name.into(),
            width: 1,
            data,
        }
    }

    /// Number of rows.
    pub fn rows(&self) -> usize {
        self.data.len() / self.width.max(1)
    }
}

/// A node or edge group (`/nodes/<pop>/<id>` or `/edges/<pop>/<id>`): the columns of the
/// nodes/edges whose `*_group_id` equals `id`, indexed by `*_group_index`.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct PopulationGroup {
    /// The group id (the HDF5 group's name, a non-negative integer).
    pub id: u32,
    /// The group's datasets, in name order.
    pub columns: Vec<Column>,
    /// Datasets of the optional `dynamics_params` subgroup (per-row parameter overrides).
    pub dynamics_params: Vec<Column>,
}

impl PopulationGroup {
    /// Sorts the columns (and `dynamics_params` columns) by name, the order HDF5 lists them in.
    pub fn sort_columns(&mut self) {
        self.columns.sort_by(|a, b| a.name.cmp(&b.name));
        self.dynamics_params.sort_by(|a, b| a.name.cmp(&b.name));
    }

    /// The column named `name`, if present.
    pub fn column(&self, name: &str) -> Option<&Column> {
        self.columns.iter().find(|c| c.name == name)
    }

    /// Number of rows: the length of its columns (0 for a group without columns; then
    /// the caller derives the size from the `*_group_index` values).
    pub fn rows(&self) -> Option<usize> {
        self.columns
            .iter()
            .chain(self.dynamics_params.iter())
            .map(|c| c.rows())
            .next()
    }
}

pub(crate) fn describe(td: &TypeDescriptor) -> String {
    match td {
        TypeDescriptor::Integer(s) => format!("int{}", (*s as usize) * 8),
        TypeDescriptor::Unsigned(s) => format!("uint{}", (*s as usize) * 8),
        TypeDescriptor::Float(s) => format!("float{}", (*s as usize) * 8),
        TypeDescriptor::Boolean => "bool".into(),
        TypeDescriptor::VarLenUnicode => "variable-length utf-8 string".into(),
        TypeDescriptor::VarLenAscii => "variable-length ascii string".into(),
        TypeDescriptor::FixedAscii(n) => format!("fixed-length ascii string[{n}]"),
        TypeDescriptor::FixedUnicode(n) => format!("fixed-length utf-8 string[{n}]"),
        other => format!("{other}"),
    }
}

/// Opens a dataset, turning "absent" into [`SonataErrorKind::MissingDataset`].
pub(crate) fn open_dataset(
    path: &Path,
    group: &hdf5::Group,
    name: &str,
    hint: &str,
) -> Result<Dataset> {
    if !group.link_exists(name) {
        return Err(SonataErrorKind::MissingDataset {
            path: path.to_path_buf(),
            object: format!("{}/{name}", group.name().trim_end_matches('/')),
            hint: hint.to_string(),
        }
        .into());
    }
    group
        .dataset(name)
        .map_err(|e| SonataError::h5(path, format!("{}/{name}", group.name()), e))
}

pub(crate) fn dtype_of(path: &Path, ds: &Dataset) -> Result<TypeDescriptor> {
    ds.dtype()
        .and_then(|t| t.to_descriptor())
        .map_err(|e| SonataError::h5(path, ds.name(), e))
}

fn read_raw<T: H5Type>(path: &Path, ds: &Dataset) -> Result<Vec<T>> {
    ds.read_raw::<T>()
        .map_err(|e| SonataError::h5(path, ds.name(), e))
}

/// Reads a 1-D integer dataset (any signed or unsigned width) as u64, rejecting floats,
/// strings, other ranks and negative values.
pub(crate) fn read_ids(path: &Path, ds: &Dataset) -> Result<Vec<u64>> {
    let td = dtype_of(path, ds)?;
    let shape = ds.shape();
    let wrong = |found: String| {
        SonataError::from(SonataErrorKind::WrongDtype {
            path: path.to_path_buf(),
            object: ds.name(),
            found,
            expected: "a 1-D integer dataset (SONATA writes uint64/uint32/uint16)".into(),
        })
    };
    if shape.len() != 1 {
        return Err(wrong(format!("{} with shape {shape:?}", describe(&td))));
    }
    match td {
        TypeDescriptor::Unsigned(_) => read_raw::<u64>(path, ds),
        TypeDescriptor::Integer(_) => {
            let v = read_raw::<i64>(path, ds)?;
            if let Some((i, x)) = v.iter().enumerate().find(|(_, x)| **x < 0) {
                return Err(SonataErrorKind::BadValue {
                    path: path.to_path_buf(),
                    object: ds.name(),
                    problem: format!("row {i} holds {x}; ids and indices must be non-negative"),
                }
                .into());
            }
            Ok(v.into_iter().map(|x| x as u64).collect())
        }
        other => Err(wrong(describe(&other))),
    }
}

/// Reads any supported dataset into a [`Column`], keeping its dtype.
pub(crate) fn read_column(path: &Path, ds: &Dataset, name: &str) -> Result<Column> {
    let td = dtype_of(path, ds)?;
    let shape = ds.shape();
    let width = match shape.len() {
        1 => 1,
        2 => shape[1],
        _ => {
            return Err(SonataErrorKind::WrongDtype {
                path: path.to_path_buf(),
                object: ds.name(),
                found: format!("{} with shape {shape:?}", describe(&td)),
                expected: "a 1-D or 2-D dataset".into(),
            }
            .into())
        }
    };
    let data = match td {
        TypeDescriptor::Integer(IntSize::U1) => ColumnData::I8(read_raw(path, ds)?),
        TypeDescriptor::Integer(IntSize::U2) => ColumnData::I16(read_raw(path, ds)?),
        TypeDescriptor::Integer(IntSize::U4) => ColumnData::I32(read_raw(path, ds)?),
        TypeDescriptor::Integer(IntSize::U8) => ColumnData::I64(read_raw(path, ds)?),
        TypeDescriptor::Unsigned(IntSize::U1) => ColumnData::U8(read_raw(path, ds)?),
        TypeDescriptor::Unsigned(IntSize::U2) => ColumnData::U16(read_raw(path, ds)?),
        TypeDescriptor::Unsigned(IntSize::U4) => ColumnData::U32(read_raw(path, ds)?),
        TypeDescriptor::Unsigned(IntSize::U8) => ColumnData::U64(read_raw(path, ds)?),
        TypeDescriptor::Float(FloatSize::U4) => ColumnData::F32(read_raw(path, ds)?),
        TypeDescriptor::Float(FloatSize::U8) => ColumnData::F64(read_raw(path, ds)?),
        TypeDescriptor::VarLenUnicode => ColumnData::Str(
            read_raw::<VarLenUnicode>(path, ds)?
                .into_iter()
                .map(|s| s.as_str().to_string())
                .collect(),
        ),
        TypeDescriptor::VarLenAscii => ColumnData::Str(
            read_raw::<VarLenAscii>(path, ds)?
                .into_iter()
                .map(|s| s.as_str().to_string())
                .collect(),
        ),
        TypeDescriptor::FixedAscii(n) if n <= MAX_FIXED_STR => ColumnData::Str(
            read_raw::<FixedAscii<MAX_FIXED_STR>>(path, ds)?
                .into_iter()
                .map(|s| s.as_str().to_string())
                .collect(),
        ),
        TypeDescriptor::FixedUnicode(n) if n <= MAX_FIXED_STR => ColumnData::Str(
            read_raw::<FixedUnicode<MAX_FIXED_STR>>(path, ds)?
                .into_iter()
                .map(|s| s.as_str().to_string())
                .collect(),
        ),
        other => {
            return Err(SonataErrorKind::WrongDtype {
                path: path.to_path_buf(),
                object: ds.name(),
                found: describe(&other),
                expected: format!(
                    "an integer, float32/float64 or string (variable length, or fixed up to {MAX_FIXED_STR} bytes) dataset"
                ),
            }
            .into())
        }
    };
    Ok(Column {
        name: name.to_string(),
        width,
        data,
    })
}

/// Reads a 1-D numeric dataset as f64 (rejecting strings).
pub(crate) fn read_f64(path: &Path, ds: &Dataset) -> Result<Vec<f64>> {
    let td = dtype_of(path, ds)?;
    let shape = ds.shape();
    match td {
        TypeDescriptor::Float(_) | TypeDescriptor::Integer(_) | TypeDescriptor::Unsigned(_)
            if shape.len() == 1 =>
        {
            read_raw::<f64>(path, ds)
        }
        other => Err(SonataErrorKind::WrongDtype {
            path: path.to_path_buf(),
            object: ds.name(),
            found: format!("{} with shape {shape:?}", describe(&other)),
            expected: "a 1-D numeric dataset".into(),
        }
        .into()),
    }
}

/// Reads a string attribute (variable- or fixed-length).
pub(crate) fn read_str_attr(
    path: &Path,
    loc: &hdf5::Location,
    name: &str,
) -> Result<Option<String>> {
    let Ok(names) = loc.attr_names() else {
        return Ok(None);
    };
    if !names.iter().any(|n| n == name) {
        return Ok(None);
    }
    let obj = format!("{}@{name}", loc.name());
    let attr = loc.attr(name).map_err(|e| SonataError::h5(path, &obj, e))?;
    let td = attr
        .dtype()
        .and_then(|t| t.to_descriptor())
        .map_err(|e| SonataError::h5(path, &obj, e))?;
    let s = match td {
        TypeDescriptor::VarLenUnicode => attr
            .read_scalar::<VarLenUnicode>()
            .map(|s| s.as_str().to_string()),
        TypeDescriptor::VarLenAscii => attr
            .read_scalar::<VarLenAscii>()
            .map(|s| s.as_str().to_string()),
        TypeDescriptor::FixedAscii(n) if n <= MAX_FIXED_STR => attr
            .read_scalar::<FixedAscii<MAX_FIXED_STR>>()
            .map(|s| s.as_str().to_string()),
        TypeDescriptor::FixedUnicode(n) if n <= MAX_FIXED_STR => attr
            .read_scalar::<FixedUnicode<MAX_FIXED_STR>>()
            .map(|s| s.as_str().to_string()),
        other => {
            return Err(SonataErrorKind::WrongDtype {
                path: path.to_path_buf(),
                object: obj,
                found: describe(&other),
                expected: "a string attribute".into(),
            }
            .into())
        }
    };
    s.map(Some).map_err(|e| SonataError::h5(path, obj, e))
}

/// Writes a scalar variable-length UTF-8 string attribute (what h5py writes for `str`).
pub(crate) fn write_str_attr(
    path: &Path,
    loc: &hdf5::Location,
    name: &str,
    value: &str,
) -> Result<()> {
    let obj = format!("{}@{name}", loc.name());
    let v: VarLenUnicode = value.parse().map_err(|e| {
        SonataError::from(SonataErrorKind::InvalidData {
            what: format!("attribute {obj} in '{}'", path.display()),
            problem: format!("value '{value}' is not a valid HDF5 string: {e}"),
        })
    })?;
    loc.new_attr::<VarLenUnicode>()
        .create(name)
        .and_then(|a| a.write_scalar(&v))
        .map_err(|e| SonataError::h5(path, obj, e))
}

/// Creates a contiguous 1-D dataset from a slice (the layout h5py/BMTK use).
pub(crate) fn write_vec<T: H5Type>(
    path: &Path,
    group: &hdf5::Group,
    name: &str,
    data: &[T],
) -> Result<Dataset> {
    group
        .new_dataset_builder()
        .with_data(data)
        .create(name)
        .map_err(|e| SonataError::h5(path, format!("{}/{name}", group.name()), e))
}

fn write_shaped<T: H5Type>(
    path: &Path,
    group: &hdf5::Group,
    name: &str,
    data: &[T],
    width: usize,
) -> Result<Dataset> {
    if width == 1 {
        return write_vec(path, group, name, data);
    }
    let obj = format!("{}/{name}", group.name());
    let ds = group
        .new_dataset::<T>()
        .shape([data.len() / width, width])
        .create(name)
        .map_err(|e| SonataError::h5(path, &obj, e))?;
    ds.write_raw(data)
        .map_err(|e| SonataError::h5(path, obj, e))?;
    Ok(ds)
}

/// Writes a column with its dtype.
pub(crate) fn write_column(path: &Path, group: &hdf5::Group, col: &Column) -> Result<()> {
    let (n, w) = (col.name.as_str(), col.width.max(1));
    match &col.data {
        ColumnData::I8(v) => write_shaped(path, group, n, v, w)?,
        ColumnData::I16(v) => write_shaped(path, group, n, v, w)?,
        ColumnData::I32(v) => write_shaped(path, group, n, v, w)?,
        ColumnData::I64(v) => write_shaped(path, group, n, v, w)?,
        ColumnData::U8(v) => write_shaped(path, group, n, v, w)?,
        ColumnData::U16(v) => write_shaped(path, group, n, v, w)?,
        ColumnData::U32(v) => write_shaped(path, group, n, v, w)?,
        ColumnData::U64(v) => write_shaped(path, group, n, v, w)?,
        ColumnData::F32(v) => write_shaped(path, group, n, v, w)?,
        ColumnData::F64(v) => write_shaped(path, group, n, v, w)?,
        ColumnData::Str(v) => {
            let mut s = Vec::with_capacity(v.len());
            for (i, x) in v.iter().enumerate() {
                s.push(x.parse::<VarLenUnicode>().map_err(|e| {
                    SonataError::from(SonataErrorKind::InvalidData {
                        what: format!("column '{n}' in '{}'", path.display()),
                        problem: format!("row {i}: '{x}' is not a valid HDF5 string: {e}"),
                    })
                })?);
            }
            write_shaped(path, group, n, &s, w)?
        }
    };
    Ok(())
}

/// Reads the numbered subgroups of a population group (`0`, `1`, ...), each with its columns
/// and its optional `dynamics_params` subgroup. Non-numeric members are skipped.
pub(crate) fn read_groups(
    path: &Path,
    pop: &hdf5::Group,
    skip: &[&str],
) -> Result<Vec<PopulationGroup>> {
    let names = pop
        .member_names()
        .map_err(|e| SonataError::h5(path, pop.name(), e))?;
    let mut groups = Vec::new();
    for name in names {
        if skip.contains(&name.as_str()) {
            continue;
        }
        let Ok(id) = name.parse::<u32>() else {
            continue;
        };
        let obj = format!("{}/{name}", pop.name());
        let g = pop
            .group(&name)
            .map_err(|e| SonataError::h5(path, &obj, e))?;
        let mut group = PopulationGroup {
            id,
            ..Default::default()
        };
        for m in g
            .member_names()
            .map_err(|e| SonataError::h5(path, &obj, e))?
        {
            if m == "dynamics_params" {
                if let Ok(dp) = g.group(&m) {
                    for d in dp
                        .member_names()
                        .map_err(|e| SonataError::h5(path, dp.name(), e))?
                    {
                        let ds = dp
                            .dataset(&d)
                            .map_err(|e| SonataError::h5(path, format!("{}/{d}", dp.name()), e))?;
                        group.dynamics_params.push(read_column(path, &ds, &d)?);
                    }
                    continue;
                }
            }
            let Ok(ds) = g.dataset(&m) else {
                continue;
            };
            group.columns.push(read_column(path, &ds, &m)?);
        }
        groups.push(group);
    }
    groups.sort_by_key(|g| g.id);
    Ok(groups)
}

/// Writes groups (`<id>/<column>` and `<id>/dynamics_params/<column>`) under `pop`.
pub(crate) fn write_groups(
    path: &Path,
    pop: &hdf5::Group,
    groups: &[PopulationGroup],
) -> Result<()> {
    for g in groups {
        let name = g.id.to_string();
        let obj = format!("{}/{name}", pop.name());
        let h = pop
            .create_group(&name)
            .map_err(|e| SonataError::h5(path, &obj, e))?;
        for c in &g.columns {
            write_column(path, &h, c)?;
        }
        if !g.dynamics_params.is_empty() {
            let dp = h
                .create_group("dynamics_params")
                .map_err(|e| SonataError::h5(path, format!("{obj}/dynamics_params"), e))?;
            for c in &g.dynamics_params {
                write_column(path, &dp, c)?;
            }
        }
    }
    Ok(())
}

/// Checks that every group's columns have the same number of rows and that every
/// `(group_id, group_index)` pair points into an existing group row.
pub(crate) fn check_group_refs(
    path: &Path,
    pop_obj: &str,
    kind: &str,
    group_id: &[u32],
    group_index: &[u64],
    groups: &[PopulationGroup],
) -> Result<()> {
    for g in groups {
        let mut rows = None;
        for c in g.columns.iter().chain(g.dynamics_params.iter()) {
            if c.data.len() % c.width.max(1) != 0 {
                return Err(SonataErrorKind::BadValue {
                    path: path.to_path_buf(),
                    object: format!("{pop_obj}/{}/{}", g.id, c.name),
                    problem: format!(
                        "{} values do not fill rows of width {}",
                        c.data.len(),
                        c.width
                    ),
                }
                .into());
            }
            match rows {
                None => rows = Some(c.rows()),
                Some(r) if r != c.rows() => {
                    return Err(SonataErrorKind::BadValue {
                        path: path.to_path_buf(),
                        object: format!("{pop_obj}/{}/{}", g.id, c.name),
                        problem: format!(
                            "has {} rows but other columns of group {} have {r}",
                            c.rows(),
                            g.id
                        ),
                    }
                    .into())
                }
                _ => {}
            }
        }
    }
    for (i, (&gid, &gidx)) in group_id.iter().zip(group_index).enumerate() {
        let g = groups.iter().find(|g| g.id == gid);
        match g {
            None if !groups.is_empty() || gid != 0 => {
                return Err(SonataErrorKind::BadValue {
                    path: path.to_path_buf(),
                    object: format!("{pop_obj}/{kind}_group_id"),
                    problem: format!(
                        "row {i} names group {gid}, which does not exist under {pop_obj}"
                    ),
                }
                .into())
            }
            Some(g) => {
                if let Some(rows) = g.rows() {
                    if gidx as usize >= rows {
                        return Err(SonataErrorKind::BadValue {
                            path: path.to_path_buf(),
                            object: format!("{pop_obj}/{kind}_group_index"),
                            problem: format!(
                                "row {i} has index {gidx} into group {gid}, which has only {rows} rows"
                            ),
                        }.into());
                    }
                }
            }
            None => {}
        }
    }
    Ok(())
}
