//! Snapshots (NBODY.md, "Snapshots"): per rank and output, a NumPy `.npz` file and a
//! GADGET-style HDF5 file holding exactly the rank's valid particles; and the reader of
//! GADGET-style HDF5 initial conditions.

use std::path::{Path, PathBuf};

use npyz::WriterBuilder;

use crate::units::{Units, KMS_IN_CM_PER_S, KPC_IN_CM, MSUN_IN_G};
use crate::{ic, NbodyError, Particles};

/// Path of the `.npz` snapshot `snapshot_{index:04}_rank_{rank:04}.npz` in `dir`.
pub fn npz_path(dir: &Path, index: usize, rank: usize) -> PathBuf {
    dir.join(format!("snapshot_{index:04}_rank_{rank:04}.npz"))
}

/// Path of the HDF5 snapshot `snap_{index:03}.{rank}.hdf5` in `dir`.
pub fn hdf5_path(dir: &Path, index: usize, rank: usize) -> PathBuf {
    dir.join(format!("snap_{index:03}.{rank}.hdf5"))
}

/// Writes the valid particles to `snapshot_{index:04}_rank_{rank:04}.npz`: arrays `pos`
/// `(num, 3)` kpc and `vel` `(num, 3)` km/s (float64), plus `id` `(num,)` uint64 and `mass`
/// `(num,)` float64. Returns the path.
pub fn write_npz(
    dir: &Path,
    index: usize,
    rank: usize,
    p: &Particles,
) -> Result<PathBuf, NbodyError> {
    let path = npz_path(dir, index, rank);
    let io = |e: std::io::Error| NbodyError::io(&path, e);
    let mut npz = npyz::npz::NpzWriter::create(&path).map_err(io)?;
    let opts = || {
        npyz::zip::write::FileOptions::default()
            .compression_method(npyz::zip::CompressionMethod::Stored)
            .large_file(true)
    };
    let n = p.num as u64;
    {
        let mut w = npz
            .array::<f64>("pos", opts())
            .map_err(io)?
            .default_dtype()
            .shape(&[n, 3])
            .begin_nd()
            .map_err(io)?;
        w.extend(p.valid_pos().iter().flatten().copied())
            .map_err(io)?;
        w.finish().map_err(io)?;
    }
    {
        let mut w = npz
            .array::<f64>("vel", opts())
            .map_err(io)?
            .default_dtype()
            .shape(&[n, 3])
            .begin_nd()
            .map_err(io)?;
        w.extend(p.valid_vel().iter().flatten().copied())
            .map_err(io)?;
        w.finish().map_err(io)?;
    }
    {
        let mut w = npz
            .array::<u64>("id", opts())
            .map_err(io)?
            .default_dtype()
            .shape(&[n])
            .begin_nd()
            .map_err(io)?;
        w.extend(p.valid_id().iter().copied()).map_err(io)?;
        w.finish().map_err(io)?;
    }
    {
        let mut w = npz
            .array::<f64>("mass", opts())
            .map_err(io)?
            .default_dtype()
            .shape(&[n])
            .begin_nd()
            .map_err(io)?;
        w.extend(p.valid_mass().iter().copied()).map_err(io)?;
        w.finish().map_err(io)?;
    }
    npz.zip_writer()
        .finish()
        .map_err(|e| NbodyError::io(&path, std::io::Error::other(e)))?;
    Ok(path)
}

/// Header values of one HDF5 snapshot file.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SnapshotHeader {
    /// Simulation time, kpc/(km/s).
    pub time: f64,
    /// Files of this snapshot (the number of ranks).
    pub num_files: usize,
    /// Box size recorded in the header (0 for open boundaries), kpc.
    pub box_size: f64,
    /// Units of the run.
    pub units: Units,
}

fn h5err(path: &Path, object: &str, e: impl std::fmt::Display) -> NbodyError {
    NbodyError::Hdf5 {
        path: path.to_path_buf(),
        object: object.to_string(),
        message: e.to_string(),
    }
}

/// Writes the valid particles to the GADGET-style file `snap_{index:03}.{rank}.hdf5`:
/// `Header` attributes `NumPart_ThisFile[6]`, `NumPart_Total[6]`,
/// `NumPart_Total_HighWord[6]` (uint32, particle type 1 only), `MassTable[6]` (zeros: masses
/// are per particle), `Time`, `Redshift` (0), `BoxSize`, `NumFilesPerSnapshot`,
/// `Flag_DoublePrecision` (1); `PartType1` datasets `Coordinates (N,3)` kpc,
/// `Velocities (N,3)` km/s, `ParticleIDs (N,)` uint64, `Masses (N,)`; a `Units` group with
/// `UnitLength_in_cm`, `UnitVelocity_in_cm_per_s`, `UnitMass_in_g`, `GravitationalConstant`.
pub fn write_hdf5(
    dir: &Path,
    index: usize,
    rank: usize,
    p: &Particles,
    header: &SnapshotHeader,
) -> Result<PathBuf, NbodyError> {
    let path = hdf5_path(dir, index, rank);
    let e = |obj: &str| {
        let path = path.clone();
        let obj = obj.to_string();
        move |err: hdf5::Error| h5err(&path, &obj, err)
    };
    let f = hdf5::File::create(&path).map_err(e("/"))?;
    let h = f.create_group("Header").map_err(e("Header"))?;
    let n = p.num as u32;
    let total = p.num_total;
    let mut this = [0u32; 6];
    this[1] = n;
    let mut tot = [0u32; 6];
    tot[1] = (total & 0xffff_ffff) as u32;
    let mut high = [0u32; 6];
    high[1] = (total >> 32) as u32;
    for (name, v) in [
        ("NumPart_ThisFile", this),
        ("NumPart_Total", tot),
        ("NumPart_Total_HighWord", high),
    ] {
        h.new_attr::<u32>()
            .shape([6])
            .create(name)
            .and_then(|a| a.write_raw(&v[..]))
            .map_err(e(&format!("Header/{name}")))?;
    }
    h.new_attr::<f64>()
        .shape([6])
        .create("MassTable")
        .and_then(|a| a.write_raw(&[0.0f64; 6][..]))
        .map_err(e("Header/MassTable"))?;
    for (name, v) in [
        ("Time", header.time),
        ("Redshift", 0.0),
        ("BoxSize", header.box_size),
    ] {
        h.new_attr::<f64>()
            .create(name)
            .and_then(|a| a.write_scalar(&v))
            .map_err(e(&format!("Header/{name}")))?;
    }
    for (name, v) in [
        ("NumFilesPerSnapshot", header.num_files as i32),
        ("Flag_DoublePrecision", 1i32),
    ] {
        h.new_attr::<i32>()
            .create(name)
            .and_then(|a| a.write_scalar(&v))
            .map_err(e(&format!("Header/{name}")))?;
    }
    let u = f.create_group("Units").map_err(e("Units"))?;
    for (name, v) in [
        ("UnitLength_in_cm", KPC_IN_CM),
        ("UnitVelocity_in_cm_per_s", KMS_IN_CM_PER_S),
        ("UnitMass_in_g", MSUN_IN_G * header.units.mass_in_msol),
        ("GravitationalConstant", header.units.g()),
    ] {
        u.new_attr::<f64>()
            .create(name)
            .and_then(|a| a.write_scalar(&v))
            .map_err(e(&format!("Units/{name}")))?;
    }
    let g = f.create_group("PartType1").map_err(e("PartType1"))?;
    let nn = p.num;
    let flat = |x: &[[f64; 3]]| -> Vec<f64> { x.iter().flatten().copied().collect() };
    g.new_dataset::<f64>()
        .shape([nn, 3])
        .create("Coordinates")
        .and_then(|d| d.write_raw(&flat(p.valid_pos())[..]))
        .map_err(e("PartType1/Coordinates"))?;
    g.new_dataset::<f64>()
        .shape([nn, 3])
        .create("Velocities")
        .and_then(|d| d.write_raw(&flat(p.valid_vel())[..]))
        .map_err(e("PartType1/Velocities"))?;
    g.new_dataset::<u64>()
        .shape([nn])
        .create("ParticleIDs")
        .and_then(|d| d.write_raw(p.valid_id()))
        .map_err(e("PartType1/ParticleIDs"))?;
    g.new_dataset::<f64>()
        .shape([nn])
        .create("Masses")
        .and_then(|d| d.write_raw(p.valid_mass()))
        .map_err(e("PartType1/Masses"))?;
    Ok(path)
}

/// Files of a GADGET snapshot: `name.0.hdf5, name.1.hdf5, ...` when `path` is one file of a
/// multi-file snapshot (`Header/NumFilesPerSnapshot > 1`), else just `path`.
fn snapshot_files(path: &Path) -> Result<Vec<PathBuf>, NbodyError> {
    let f = hdf5::File::open(path).map_err(|e| h5err(path, "/", e))?;
    let nfiles = f
        .attr("Header/NumFilesPerSnapshot")
        .or_else(|_| {
            f.group("Header")
                .and_then(|h| h.attr("NumFilesPerSnapshot"))
        })
        .and_then(|a| a.read_scalar::<i32>())
        .unwrap_or(1);
    if nfiles <= 1 {
        return Ok(vec![path.to_path_buf()]);
    }
    let name = path.file_name().and_then(|s| s.to_str()).unwrap_or("");
    let parts: Vec<&str> = name.rsplitn(3, '.').collect();
    // parts = [ext, file index, stem]
    if parts.len() == 3 && parts[1].parse::<usize>().is_ok() {
        Ok((0..nfiles as usize)
            .map(|k| path.with_file_name(format!("{}.{k}.{}", parts[2], parts[0])))
            .collect())
    } else {
        Err(h5err(
            path,
            "Header/NumFilesPerSnapshot",
            format!("{nfiles} files per snapshot, but the name is not of the form NAME.K.hdf5; pass one file of the set named NAME.0.hdf5"),
        ))
    }
}

/// A header attribute array (`Header/NAME`) read as u64 (HDF5 converts from the stored
/// integer type: GADGET-2 writes uint32, GADGET-4 int64/uint64). None when absent.
fn header_u64s(f: &hdf5::File, name: &str) -> Option<Vec<u64>> {
    f.group("Header")
        .and_then(|h| h.attr(name))
        .and_then(|a| a.read_raw::<u64>())
        .ok()
}

/// Refuses snapshots with particles of a type other than 1 (gas, disk, bulge, stars,
/// boundary), which the reader would otherwise drop silently: lockstep nbody simulates one
/// collisionless species (`PartType1`).
///
/// Errors: [`NbodyError::Hdf5`] naming the file, the type and its particle count.
fn refuse_other_types(files: &[std::path::PathBuf]) -> Result<(), NbodyError> {
    for file in files {
        let f = hdf5::File::open(file).map_err(|e| h5err(file, "/", e))?;
        let counts = header_u64s(&f, "NumPart_Total")
            .or_else(|| header_u64s(&f, "NumPart_ThisFile"))
            .unwrap_or_default();
        for t in (0..6).filter(|&t| t != 1) {
            let group = format!("PartType{t}");
            let rows = f
                .dataset(&format!("{group}/Coordinates"))
                .map(|d| d.shape().first().copied().unwrap_or(0) as u64)
                .unwrap_or(0);
            let n = counts.get(t).copied().unwrap_or(0).max(rows);
            if n > 0 {
                return Err(h5err(
                    file,
                    &group,
                    format!(
                        "the snapshot holds {n} particles of type {t}; lockstep nbody simulates \
                         collisionless particles of type 1 (PartType1) only and does not drop \
                         the others silently: convert them to PartType1 or remove them"
                    ),
                ));
            }
        }
    }
    Ok(())
}

/// Number of `PartType1` particles of a GADGET snapshot (all files of a multi-file set), from
/// the header alone: `NumPart_Total[1] + 2^32 NumPart_Total_HighWord[1]`, or the sum of
/// `NumPart_ThisFile[1]` over the files when the total is absent, or the `Coordinates` rows.
/// Used to check the memory a run needs before reading the particles.
///
/// Errors: [`NbodyError::Hdf5`] naming the file that cannot be opened.
pub fn gadget_total(path: &Path) -> Result<u64, NbodyError> {
    let files = snapshot_files(path)?;
    refuse_other_types(&files)?;
    let f = hdf5::File::open(&files[0]).map_err(|e| h5err(&files[0], "/", e))?;
    if let Some(tot) = header_u64s(&f, "NumPart_Total") {
        let high = header_u64s(&f, "NumPart_Total_HighWord").unwrap_or_default();
        let t = tot.get(1).copied().unwrap_or(0) + (high.get(1).copied().unwrap_or(0) << 32);
        return Ok(t);
    }
    let mut sum = 0u64;
    for file in &files {
        let f = hdf5::File::open(file).map_err(|e| h5err(file, "/", e))?;
        sum += match header_u64s(&f, "NumPart_ThisFile") {
            Some(this) => this.get(1).copied().unwrap_or(0),
            None => f
                .dataset("PartType1/Coordinates")
                .map(|d| d.shape().first().copied().unwrap_or(0) as u64)
                .unwrap_or(0),
        };
    }
    Ok(sum)
}

/// Reads rank `rank`'s share (the contiguous range of the particles in file order) of a
/// GADGET-style HDF5 snapshot (`PartType1`), padded by `capacity_factor`. Masses come from
/// `PartType1/Masses` or, when absent, `Header/MassTable[1]`. Single- or double-precision
/// datasets and 32- or 64-bit ids are read (HDF5 converts); files of a multi-file set that
/// hold no `PartType1` particles (`NumPart_ThisFile[1] = 0`, group absent) are skipped; the
/// particles read must add up to the header's `NumPart_Total[1]` (+ `2^32 HighWord[1]`).
pub fn read_gadget_hdf5(
    path: &Path,
    rank: usize,
    size: usize,
    capacity_factor: f64,
) -> Result<Particles, NbodyError> {
    let mut pos = Vec::new();
    let mut vel = Vec::new();
    let mut mass = Vec::new();
    let mut ids = Vec::new();
    let files = snapshot_files(path)?;
    refuse_other_types(&files)?;
    for file in files {
        let f = hdf5::File::open(&file).map_err(|e| h5err(&file, "/", e))?;
        // A file of a multi-file set may hold no particles of the type: GADGET-4 then
        // writes `NumPart_ThisFile[1] = 0` and no `PartType1` group.
        let this = header_u64s(&f, "NumPart_ThisFile").and_then(|v| v.get(1).copied());
        if this == Some(0) || (this.is_none() && f.group("PartType1").is_err()) {
            continue;
        }
        let read3 = |name: &str| -> Result<Vec<[f64; 3]>, NbodyError> {
            let obj = format!("PartType1/{name}");
            let d = f.dataset(&obj).map_err(|e| h5err(&file, &obj, e))?;
            let sh = d.shape();
            if sh.len() != 2 || sh[1] != 3 {
                return Err(h5err(&file, &obj, format!("shape {sh:?}, expected (N, 3)")));
            }
            let v = d.read_raw::<f64>().map_err(|e| h5err(&file, &obj, e))?;
            Ok(v.chunks_exact(3).map(|c| [c[0], c[1], c[2]]).collect())
        };
        let x = read3("Coordinates")?;
        let v = read3("Velocities")?;
        if v.len() != x.len() {
            return Err(h5err(
                &file,
                "PartType1/Velocities",
                format!("{} rows, Coordinates has {}", v.len(), x.len()),
            ));
        }
        let id: Vec<u64> = match f.dataset("PartType1/ParticleIDs") {
            Ok(d) => d
                .read_raw::<u64>()
                .map_err(|e| h5err(&file, "PartType1/ParticleIDs", e))?,
            Err(_) => (ids.len() as u64..(ids.len() + x.len()) as u64).collect(),
        };
        if id.len() != x.len() {
            return Err(h5err(
                &file,
                "PartType1/ParticleIDs",
                format!("{} entries, Coordinates has {}", id.len(), x.len()),
            ));
        }
        let m: Vec<f64> = match f.dataset("PartType1/Masses") {
            Ok(d) => d
                .read_raw::<f64>()
                .map_err(|e| h5err(&file, "PartType1/Masses", e))?,
            Err(_) => {
                let mt = f
                    .group("Header")
                    .and_then(|h| h.attr("MassTable"))
                    .and_then(|a| a.read_raw::<f64>())
                    .map_err(|e| {
                        h5err(
                            &file,
                            "Header/MassTable",
                            format!("{e}; without PartType1/Masses the header needs MassTable[6]"),
                        )
                    })?;
                let m1 = mt.get(1).copied().unwrap_or(0.0);
                if m1 <= 0.0 {
                    return Err(h5err(&file, "Header/MassTable", format!("MassTable[1] = {m1} and no PartType1/Masses dataset; give particle masses")));
                }
                vec![m1; x.len()]
            }
        };
        if m.len() != x.len() {
            return Err(h5err(
                &file,
                "PartType1/Masses",
                format!("{} entries, Coordinates has {}", m.len(), x.len()),
            ));
        }
        pos.extend(x);
        vel.extend(v);
        mass.extend(m);
        ids.extend(id);
    }
    let n = pos.len() as u64;
    let total = gadget_total(path)?;
    if total != n {
        return Err(h5err(
            path,
            "Header/NumPart_Total",
            format!("the header gives {total} PartType1 particles but the files hold {n}; is a file of the set missing or truncated?"),
        ));
    }
    if n == 0 {
        return Err(h5err(
            path,
            "PartType1",
            "the snapshot holds no PartType1 particles",
        ));
    }
    let (start, end) = ic::rank_range(n, rank, size);
    let local = (end - start) as usize;
    let mut p = Particles::with_capacity(ic::padded_capacity(local, capacity_factor)?, n);
    for i in start as usize..end as usize {
        p.push(pos[i], vel[i], mass[i], ids[i], rank)?;
    }
    p.validate().map_err(|e| h5err(path, "PartType1", e))?;
    Ok(p)
}
