//! Writing nodes and edges files with the layout BMTK's network builder writes (SONATA
//! spec, "Nodes" / "Edges"; BMTK `NetworkBuilder.save`):
//!
//! - root attributes `magic = 0x0A7A` (uint32) and `version = [0, 1]` (uint32[2]);
//! - nodes: `/nodes/<pop>/node_id` (uint64), `node_type_id` (uint64), `node_group_id`
//!   (uint32), `node_group_index` (uint64), `<group>/<column>` in the column's dtype;
//! - edges: `/edges/<pop>/source_node_id`, `target_node_id` (uint64, attribute
//!   `node_population`), `edge_type_id` (uint32), `edge_group_id` (uint16),
//!   `edge_group_index` (uint32), `<group>/<column>`, and the lookup indices
//!   `indices/source_to_target` and `indices/target_to_source`, each with
//!   `node_id_to_ranges` (uint64 `[max node id + 1, 2]`: for node n, the half-open range of
//!   rows of `range_to_edge_id` that belong to it; `[0, 0]` when it has no edges), the same
//!   dataset hard-linked as `node_id_to_range`, and `range_to_edge_id` (uint64 `[runs, 2]`:
//!   half-open edge-row ranges of consecutive edges with the same node id, ordered by node
//!   id, then by position). `node_id_to_ranges` is the SONATA spec's name, which libsonata's
//!   index queries read; `node_id_to_range` is the name BMTK's builder writes and BMTK reads.
//!   [`read_edge_index`](crate::read_edge_index) reads either.
//!
//! All datasets are contiguous with fixed size, like h5py's defaults.

use std::path::Path;

use hdf5::types::VarLenUnicode;

use crate::column::{
    check_group_refs, read_f64, write_groups, write_str_attr, write_vec, PopulationGroup,
};
use crate::edges::{EdgeParts, EdgePopulation, NODE_ID_TO_RANGES, NODE_ID_TO_RANGE_BMTK};
use crate::error::{Result, SonataError, SonataErrorKind};
use crate::nodes::{NodeParts, NodePopulation};

/// SONATA's magic number (root attribute `magic`).
pub const SONATA_MAGIC: u32 = 0x0A7A;
/// SONATA format version written to the root attribute `version`.
pub const SONATA_VERSION: [u32; 2] = [0, 1];

/// A borrowed view of one node population to write.
#[derive(Debug, Clone, Copy)]
pub struct NodesView<'a> {
    /// Population name.
    pub name: &'a str,
    /// `node_id`, `[node]`.
    pub node_id: &'a [u64],
    /// `node_type_id`, `[node]`.
    pub node_type_id: &'a [u64],
    /// `node_group_id`, `[node]`.
    pub node_group_id: &'a [u32],
    /// `node_group_index`, `[node]`.
    pub node_group_index: &'a [u64],
    /// Groups with their columns.
    pub groups: &'a [PopulationGroup],
}

impl<'a> From<&'a NodeParts> for NodesView<'a> {
    fn from(p: &'a NodeParts) -> Self {
        NodesView {
            name: &p.name,
            node_id: &p.node_id,
            node_type_id: &p.node_type_id,
            node_group_id: &p.node_group_id,
            node_group_index: &p.node_group_index,
            groups: &p.groups,
        }
    }
}

impl<'a> From<&'a NodePopulation> for NodesView<'a> {
    fn from(p: &'a NodePopulation) -> Self {
        NodesView {
            name: &p.name,
            node_id: &p.node_id,
            node_type_id: &p.node_type_id,
            node_group_id: &p.node_group_id,
            node_group_index: &p.node_group_index,
            groups: &p.groups,
        }
    }
}

/// A borrowed view of one edge population to write.
#[derive(Debug, Clone, Copy)]
pub struct EdgesView<'a> {
    /// Population name.
    pub name: &'a str,
    /// Node population of the sources (attribute `node_population`).
    pub source_population: &'a str,
    /// Node population of the targets (attribute `node_population`).
    pub target_population: &'a str,
    /// `source_node_id`, `[edge]`.
    pub source_node_id: &'a [u64],
    /// `target_node_id`, `[edge]`.
    pub target_node_id: &'a [u64],
    /// `edge_type_id`, `[edge]`.
    pub edge_type_id: &'a [u64],
    /// `edge_group_id`, `[edge]`.
    pub edge_group_id: &'a [u32],
    /// `edge_group_index`, `[edge]`.
    pub edge_group_index: &'a [u64],
    /// Groups with their columns (`nsyns`, `syn_weight`, ...).
    pub groups: &'a [PopulationGroup],
}

impl<'a> From<&'a EdgeParts> for EdgesView<'a> {
    fn from(p: &'a EdgeParts) -> Self {
        EdgesView {
            name: &p.name,
            source_population: &p.source_population,
            target_population: &p.target_population,
            source_node_id: &p.source_node_id,
            target_node_id: &p.target_node_id,
            edge_type_id: &p.edge_type_id,
            edge_group_id: &p.edge_group_id,
            edge_group_index: &p.edge_group_index,
            groups: &p.groups,
        }
    }
}

impl<'a> From<&'a EdgePopulation> for EdgesView<'a> {
    fn from(p: &'a EdgePopulation) -> Self {
        EdgesView {
            name: &p.name,
            source_population: &p.source_population,
            target_population: &p.target_population,
            source_node_id: &p.source_node_id,
            target_node_id: &p.target_node_id,
            edge_type_id: &p.edge_type_id,
            edge_group_id: &p.edge_group_id,
            edge_group_index: &p.edge_group_index,
            groups: &p.groups,
        }
    }
}

pub(crate) fn write_root_attrs(path: &Path, file: &hdf5::File) -> Result<()> {
    file.new_attr::<u32>()
        .create("magic")
        .and_then(|a| a.write_scalar(&SONATA_MAGIC))
        .map_err(|e| SonataError::h5(path, "/@magic", e))?;
    file.new_attr_builder()
        .with_data(&SONATA_VERSION[..])
        .create("version")
        .map_err(|e| SonataError::h5(path, "/@version", e))?;
    Ok(())
}

fn check_pop_name(what: &str, name: &str, seen: &[&str]) -> Result<()> {
    if name.is_empty() || name.contains('/') || name == "." {
        return Err(SonataErrorKind::InvalidData {
            what: what.to_string(),
            problem: format!("population name '{name}' must be non-empty and contain no '/'"),
        }
        .into());
    }
    if seen.contains(&name) {
        return Err(SonataErrorKind::InvalidData {
            what: what.to_string(),
            problem: format!("population '{name}' is listed twice"),
        }
        .into());
    }
    Ok(())
}

fn narrow<T: TryFrom<u64>>(what: &str, ds: &str, v: &[u64], ty: &str) -> Result<Vec<T>> {
    v.iter()
        .enumerate()
        .map(|(i, &x)| {
            T::try_from(x).map_err(|_| {
                SonataError::from(SonataErrorKind::InvalidData {
                    what: what.to_string(),
                    problem: format!("{ds}[{i}] = {x} does not fit the {ty} dtype BMTK uses"),
                })
            })
        })
        .collect()
}

fn check_lengths(what: &str, n: usize, lens: &[(&str, usize)]) -> Result<()> {
    for (ds, len) in lens {
        if *len != n {
            return Err(SonataErrorKind::InvalidData {
                what: what.to_string(),
                problem: format!("{ds} has {len} rows, expected {n}"),
            }
            .into());
        }
    }
    Ok(())
}

/// Writes a nodes file with the given populations (replacing an existing file).
pub fn write_nodes(path: impl AsRef<Path>, populations: &[NodesView<'_>]) -> Result<()> {
    let path = path.as_ref();
    let mut seen = Vec::new();
    for p in populations {
        let what = format!("nodes file '{}' population '{}'", path.display(), p.name);
        check_pop_name(&what, p.name, &seen)?;
        seen.push(p.name);
        check_lengths(
            &what,
            p.node_id.len(),
            &[
                ("node_type_id", p.node_type_id.len()),
                ("node_group_id", p.node_group_id.len()),
                ("node_group_index", p.node_group_index.len()),
            ],
        )?;
        check_group_refs(
            path,
            &format!("/nodes/{}", p.name),
            "node",
            p.node_group_id,
            p.node_group_index,
            p.groups,
        )
        .map_err(|e| {
            SonataError::from(SonataErrorKind::InvalidData {
                what: what.clone(),
                problem: e.to_string(),
            })
        })?;
    }
    let file = hdf5::File::create(path).map_err(|e| SonataError::h5(path, "/", e))?;
    write_root_attrs(path, &file)?;
    let root = file
        .create_group("nodes")
        .map_err(|e| SonataError::h5(path, "/nodes", e))?;
    for p in populations {
        let obj = format!("/nodes/{}", p.name);
        let g = root
            .create_group(p.name)
            .map_err(|e| SonataError::h5(path, &obj, e))?;
        write_vec(path, &g, "node_id", p.node_id)?;
        write_vec(path, &g, "node_type_id", p.node_type_id)?;
        write_vec(path, &g, "node_group_id", p.node_group_id)?;
        write_vec(path, &g, "node_group_index", p.node_group_index)?;
        write_groups(path, &g, p.groups)?;
    }
    Ok(())
}

/// The BMTK lookup index over `ids` (see the module docs): `(node_id_to_range,
/// range_to_edge_id)`, each flattened `[rows * 2]`.
pub fn build_edge_index(ids: &[u64]) -> (Vec<u64>, Vec<u64>) {
    let Some(&max) = ids.iter().max() else {
        return (Vec::new(), Vec::new());
    };
    // runs of equal consecutive ids
    let mut runs: Vec<(u64, u64, u64)> = Vec::new(); // (node, start, end)
    let mut start = 0usize;
    for i in 1..=ids.len() {
        if i == ids.len() || ids[i] != ids[start] {
            runs.push((ids[start], start as u64, i as u64));
            start = i;
        }
    }
    // stable sort by node keeps each node's runs in edge order
    runs.sort_by_key(|r| r.0);
    let n_nodes = max as usize + 1;
    let mut node_id_to_range = vec![0u64; n_nodes * 2];
    let mut range_to_edge_id = Vec::with_capacity(runs.len() * 2);
    let mut r = 0usize;
    while r < runs.len() {
        let node = runs[r].0 as usize;
        let first = r;
        while r < runs.len() && runs[r].0 as usize == node {
            range_to_edge_id.push(runs[r].1);
            range_to_edge_id.push(runs[r].2);
            r += 1;
        }
        node_id_to_range[2 * node] = first as u64;
        node_id_to_range[2 * node + 1] = r as u64;
    }
    (node_id_to_range, range_to_edge_id)
}

fn write_2col(path: &Path, g: &hdf5::Group, name: &str, flat: &[u64]) -> Result<()> {
    let obj = format!("{}/{name}", g.name());
    let ds = g
        .new_dataset::<u64>()
        .shape([flat.len() / 2, 2])
        .create(name)
        .map_err(|e| SonataError::h5(path, &obj, e))?;
    if !flat.is_empty() {
        ds.write_raw(flat)
            .map_err(|e| SonataError::h5(path, obj, e))?;
    }
    Ok(())
}

/// Writes an edges file with the given populations (replacing an existing file), including
/// the `indices` groups BMTK writes.
pub fn write_edges(path: impl AsRef<Path>, populations: &[EdgesView<'_>]) -> Result<()> {
    let path = path.as_ref();
    let mut seen = Vec::new();
    let mut narrowed = Vec::new();
    for p in populations {
        let what = format!("edges file '{}' population '{}'", path.display(), p.name);
        check_pop_name(&what, p.name, &seen)?;
        seen.push(p.name);
        check_lengths(
            &what,
            p.source_node_id.len(),
            &[
                ("target_node_id", p.target_node_id.len()),
                ("edge_type_id", p.edge_type_id.len()),
                ("edge_group_id", p.edge_group_id.len()),
                ("edge_group_index", p.edge_group_index.len()),
            ],
        )?;
        check_group_refs(
            path,
            &format!("/edges/{}", p.name),
            "edge",
            p.edge_group_id,
            p.edge_group_index,
            p.groups,
        )
        .map_err(|e| {
            SonataError::from(SonataErrorKind::InvalidData {
                what: what.clone(),
                problem: e.to_string(),
            })
        })?;
        let type_id: Vec<u32> = narrow(&what, "edge_type_id", p.edge_type_id, "uint32")?;
        let gid64: Vec<u64> = p.edge_group_id.iter().map(|&g| g as u64).collect();
        let group_id: Vec<u16> = narrow(&what, "edge_group_id", &gid64, "uint16")?;
        let group_index: Vec<u32> =
            narrow(&what, "edge_group_index", p.edge_group_index, "uint32")?;
        for s in [p.source_population, p.target_population] {
            if s.parse::<VarLenUnicode>().is_err() || s.is_empty() {
                return Err(SonataErrorKind::InvalidData {
                    what,
                    problem: format!("node population name '{s}' is empty or not a valid string"),
                }
                .into());
            }
        }
        narrowed.push((type_id, group_id, group_index));
    }
    let file = hdf5::File::create(path).map_err(|e| SonataError::h5(path, "/", e))?;
    write_root_attrs(path, &file)?;
    let root = file
        .create_group("edges")
        .map_err(|e| SonataError::h5(path, "/edges", e))?;
    for (p, (type_id, group_id, group_index)) in populations.iter().zip(narrowed) {
        let obj = format!("/edges/{}", p.name);
        let g = root
            .create_group(p.name)
            .map_err(|e| SonataError::h5(path, &obj, e))?;
        let s = write_vec(path, &g, "source_node_id", p.source_node_id)?;
        write_str_attr(path, &s, "node_population", p.source_population)?;
        let t = write_vec(path, &g, "target_node_id", p.target_node_id)?;
        write_str_attr(path, &t, "node_population", p.target_population)?;
        write_vec(path, &g, "edge_type_id", &type_id)?;
        write_vec(path, &g, "edge_group_id", &group_id)?;
        write_vec(path, &g, "edge_group_index", &group_index)?;
        write_groups(path, &g, p.groups)?;
        let idx = g
            .create_group("indices")
            .map_err(|e| SonataError::h5(path, format!("{obj}/indices"), e))?;
        for (name, ids) in [
            ("source_to_target", p.source_node_id),
            ("target_to_source", p.target_node_id),
        ] {
            let ig = idx
                .create_group(name)
                .map_err(|e| SonataError::h5(path, format!("{obj}/indices/{name}"), e))?;
            write_index_group(path, &ig, ids)?;
        }
    }
    Ok(())
}

/// Writes one index group (`node_id_to_ranges`, its BMTK name as a hard link, and
/// `range_to_edge_id`) over the node ids `ids` into `ig`.
fn write_index_group(path: &Path, ig: &hdf5::Group, ids: &[u64]) -> Result<()> {
    let (n2r, r2e) = build_edge_index(ids);
    write_2col(path, ig, NODE_ID_TO_RANGES, &n2r)?;
    ig.link_hard(NODE_ID_TO_RANGES, NODE_ID_TO_RANGE_BMTK)
        .map_err(|e| SonataError::h5(path, format!("{}/{NODE_ID_TO_RANGE_BMTK}", ig.name()), e))?;
    write_2col(path, ig, "range_to_edge_id", &r2e)
}

/// Makes the `indices` of edge population `p` (HDF5 group `pop`, in file `path`) readable by
/// both libsonata and BMTK: where an index group has the node-to-ranges dataset under one
/// name only, the other name is added as a hard link to it; where the `indices` group or one
/// of its two index groups is missing (or has neither name), it is built from the node ids.
fn complete_edge_indices(path: &Path, pop: &hdf5::Group, p: &EdgeParts) -> Result<()> {
    let obj = format!("{}/indices", pop.name());
    let idx = if pop.link_exists("indices") {
        pop.group("indices")
            .map_err(|e| SonataError::h5(path, &obj, e))?
    } else {
        pop.create_group("indices")
            .map_err(|e| SonataError::h5(path, &obj, e))?
    };
    for (name, ids) in [
        ("source_to_target", &p.source_node_id),
        ("target_to_source", &p.target_node_id),
    ] {
        let gobj = format!("{obj}/{name}");
        if !idx.link_exists(name) {
            let ig = idx
                .create_group(name)
                .map_err(|e| SonataError::h5(path, &gobj, e))?;
            write_index_group(path, &ig, ids)?;
            continue;
        }
        let ig = idx
            .group(name)
            .map_err(|e| SonataError::h5(path, &gobj, e))?;
        let spec = ig.link_exists(NODE_ID_TO_RANGES);
        let bmtk = ig.link_exists(NODE_ID_TO_RANGE_BMTK);
        let (from, to) = match (spec, bmtk) {
            (true, true) => continue,
            (true, false) => (NODE_ID_TO_RANGES, NODE_ID_TO_RANGE_BMTK),
            (false, true) => (NODE_ID_TO_RANGE_BMTK, NODE_ID_TO_RANGES),
            (false, false) => {
                if ig.link_exists("range_to_edge_id") {
                    ig.unlink("range_to_edge_id").map_err(|e| {
                        SonataError::h5(path, format!("{gobj}/range_to_edge_id"), e)
                    })?;
                }
                write_index_group(path, &ig, ids)?;
                continue;
            }
        };
        ig.link_hard(from, to)
            .map_err(|e| SonataError::h5(path, format!("{gobj}/{to}"), e))?;
    }
    Ok(())
}

/// Copies the edges file `src` to `dst` and stores new per-edge `syn_weight` values for
/// population `population` (`syn_weight[edge]`, in the file's edge order), leaving every
/// other dataset and attribute unchanged. The values go into each group's `syn_weight`
/// dataset (overwritten in place when it exists as a float dataset of the right length,
/// created as float64 otherwise), where they take precedence over the edge-types CSV.
///
/// BMTK/NEST use `syn_weight * nsyns` as the weight, so to export trained NEST weights `w`
/// pass `w / nsyns`. `dst` may equal `src` (rewrite in place).
///
/// The population's `indices` are completed so that libsonata and BMTK both read them (see
/// the module docs): a file from BMTK's builder, which names the node-to-ranges dataset
/// `node_id_to_range` only, gets `node_id_to_ranges` as well; missing indices are built.
pub fn rewrite_syn_weights(
    src: impl AsRef<Path>,
    dst: impl AsRef<Path>,
    population: &str,
    syn_weight: &[f64],
) -> Result<()> {
    let (src, dst) = (src.as_ref(), dst.as_ref());
    let parts = crate::edges::read_edge_parts(src)?;
    let p = checked_population(&parts, src, dst, population, syn_weight)?;
    let same = match (std::fs::canonicalize(src), std::fs::canonicalize(dst)) {
        (Ok(a), Ok(b)) => a == b,
        _ => false,
    };
    if !same {
        std::fs::copy(src, dst).map_err(|source| {
            SonataError::from(SonataErrorKind::Io {
                what: "edges file copy".into(),
                path: dst.to_path_buf(),
                origin: format!("copy of '{}'", src.display()),
                cause: source,
            })
        })?;
    }
    let file = hdf5::File::open_rw(dst).map_err(|e| SonataError::h5(dst, "/", e))?;
    let obj = format!("/edges/{population}");
    let pop = file
        .group(&obj)
        .map_err(|e| SonataError::h5(dst, &obj, e))?;
    let mut group_ids: Vec<u32> = p.edge_group_id.clone();
    group_ids.sort_unstable();
    group_ids.dedup();
    for gid in group_ids {
        write_group_weights(dst, &pop, &obj, p, gid, syn_weight)?;
    }
    complete_edge_indices(dst, &pop, p)
}

/// The edge population `population` of `parts` (read from `src`), once `syn_weight` is
/// checked against it: one finite weight per edge.
///
/// Errors: no such population (the file's populations listed), a wrong count, a weight
/// that is not finite (naming `dst`).
fn checked_population<'a>(
    parts: &'a [EdgeParts],
    src: &Path,
    dst: &Path,
    population: &str,
    syn_weight: &[f64],
) -> Result<&'a EdgeParts> {
    let Some(p) = parts.iter().find(|p| p.name == population) else {
        return Err(SonataErrorKind::MissingDataset {
            path: src.to_path_buf(),
            object: format!("/edges/{population}"),
            hint: format!(
                "no such edge population; the file has: {}",
                parts
                    .iter()
                    .map(|p| p.name.as_str())
                    .collect::<Vec<_>>()
                    .join(", ")
            ),
        }
        .into());
    };
    let what = || {
        format!(
            "syn_weight of '{}' population '{population}'",
            dst.display()
        )
    };
    if syn_weight.len() != p.source_node_id.len() {
        return Err(SonataErrorKind::InvalidData {
            what: what(),
            problem: format!(
                "{} weights given for {} edges",
                syn_weight.len(),
                p.source_node_id.len()
            ),
        }
        .into());
    }
    if let Some((i, w)) = syn_weight.iter().enumerate().find(|(_, w)| !w.is_finite()) {
        return Err(SonataErrorKind::InvalidData {
            what: what(),
            problem: format!("weight {i} is {w}; weights must be finite"),
        }
        .into());
    }
    Ok(p)
}

/// Stores the weights of group `gid` of population `p` (HDF5 group `pop`, object path
/// `obj`, in file `dst`): into its `syn_weight` dataset when that is a float dataset of the
/// group's length (other rows kept), else into a new float64 dataset (other rows 0).
fn write_group_weights(
    dst: &Path,
    pop: &hdf5::Group,
    obj: &str,
    p: &EdgeParts,
    gid: u32,
    syn_weight: &[f64],
) -> Result<()> {
    let gname = gid.to_string();
    let gobj = format!("{obj}/{gname}");
    let rows_from_cols = p.groups.iter().find(|g| g.id == gid).and_then(|g| g.rows());
    let max_idx = p
        .edge_group_id
        .iter()
        .zip(&p.edge_group_index)
        .filter(|(g, _)| **g == gid)
        .map(|(_, &i)| i as usize + 1)
        .max()
        .unwrap_or(0);
    let rows = rows_from_cols.unwrap_or(max_idx);
    let g = if pop.link_exists(&gname) {
        pop.group(&gname)
            .map_err(|e| SonataError::h5(dst, &gobj, e))?
    } else {
        pop.create_group(&gname)
            .map_err(|e| SonataError::h5(dst, &gobj, e))?
    };
    let existing = if g.link_exists("syn_weight") {
        let ds = g
            .dataset("syn_weight")
            .map_err(|e| SonataError::h5(dst, format!("{gobj}/syn_weight"), e))?;
        let is_float = matches!(
            crate::column::dtype_of(dst, &ds)?,
            hdf5::types::TypeDescriptor::Float(_)
        );
        if is_float && ds.shape() == vec![rows] {
            Some(ds)
        } else {
            g.unlink("syn_weight")
                .map_err(|e| SonataError::h5(dst, format!("{gobj}/syn_weight"), e))?;
            None
        }
    } else {
        None
    };
    let mut values = match &existing {
        Some(ds) => read_f64(dst, ds)?,
        None => vec![0.0; rows],
    };
    for (i, (&eg, &ei)) in p.edge_group_id.iter().zip(&p.edge_group_index).enumerate() {
        if eg == gid {
            values[ei as usize] = syn_weight[i];
        }
    }
    match existing {
        Some(ds) => ds
            .write_raw(&values)
            .map_err(|e| SonataError::h5(dst, format!("{gobj}/syn_weight"), e))?,
        None => {
            write_vec(dst, &g, "syn_weight", &values)?;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::build_edge_index;

    #[test]
    fn index_runs_gaps_and_order() {
        // node 2 has two runs, node 1 none, node 0 one run of length 2
        let (n2r, r2e) = build_edge_index(&[2, 0, 0, 3, 2]);
        assert_eq!(n2r, [0, 1, 0, 0, 1, 3, 3, 4]); // no edges: [0, 0] as BMTK writes
        assert_eq!(r2e, [1, 3, 0, 1, 4, 5, 3, 4]);
        let (n2r, r2e) = build_edge_index(&[]);
        assert!(n2r.is_empty() && r2e.is_empty());
    }
}
