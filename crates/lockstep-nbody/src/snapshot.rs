//! Snapshots (docs/nbody.md, "Snapshots"): per rank and output, a NumPy `.npz` file and a
//! GADGET-style HDF5 file holding exactly the rank's valid particles; and the reader of
//! GADGET-style HDF5 initial conditions.

use std::path::{Path, PathBuf};

use npyz::WriterBuilder;

use crate::particles::{padded_capacity, rank_range};
use crate::units::{Units, KMS_IN_CM_PER_S, KPC_IN_CM, MSUN_IN_G, TIME_UNIT_IN_GYR};
use crate::{NbodyError, Particles};

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
/// are per particle), `Time`, `Time_GYR` (the time in Gyr from the `Units` group: pynbody
/// reads it as the snapshot's time, where it would take `Time` of a non-cosmological file for
/// a scale factor), `Redshift` (0), `BoxSize`, `NumFilesPerSnapshot`,
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
        ("Time_GYR", header.time * TIME_UNIT_IN_GYR),
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

/// Particles of one type in one file: positions, velocities (`[particle]` of `[x, y, z]`),
/// ids and masses.
type TypeParticles = (Vec<[f64; 3]>, Vec<[f64; 3]>, Vec<u64>, Vec<f64>);

/// Number of particles of every type (`PartType0`..`PartType5`) of a GADGET snapshot (all
/// files of a multi-file set), from the header alone: `NumPart_Total[t] + 2^32
/// NumPart_Total_HighWord[t]`, or the sum of `NumPart_ThisFile[t]` over the files when the
/// total is absent, or the `Coordinates` rows.
fn gadget_counts(files: &[PathBuf]) -> Result<[u64; 6], NbodyError> {
    let f = hdf5::File::open(&files[0]).map_err(|e| h5err(&files[0], "/", e))?;
    let mut out = [0u64; 6];
    if let Some(tot) = header_u64s(&f, "NumPart_Total") {
        let high = header_u64s(&f, "NumPart_Total_HighWord").unwrap_or_default();
        for (t, o) in out.iter_mut().enumerate() {
            *o = tot.get(t).copied().unwrap_or(0) + (high.get(t).copied().unwrap_or(0) << 32);
        }
        return Ok(out);
    }
    for file in files {
        let f = hdf5::File::open(file).map_err(|e| h5err(file, "/", e))?;
        let this = header_u64s(&f, "NumPart_ThisFile");
        for (t, o) in out.iter_mut().enumerate() {
            *o += match &this {
                Some(this) => this.get(t).copied().unwrap_or(0),
                None => f
                    .dataset(&format!("PartType{t}/Coordinates"))
                    .map(|d| d.shape().first().copied().unwrap_or(0) as u64)
                    .unwrap_or(0),
            };
        }
    }
    Ok(out)
}

/// Number of particles of a GADGET snapshot, all types 0-5 (see [`read_gadget_hdf5`]), from
/// the header alone (`NumPart_Total` + `2^32 NumPart_Total_HighWord`, else the sum of
/// `NumPart_ThisFile` over the files, else the `Coordinates` rows). Used to check the memory
/// a run needs before reading the particles.
///
/// Errors: [`NbodyError::Hdf5`] naming the file that cannot be opened.
pub fn gadget_total(path: &Path) -> Result<u64, NbodyError> {
    Ok(gadget_counts(&snapshot_files(path)?)?.iter().sum())
}

/// Reads the `PartType{t}` particles of one file; `None` when the file holds none of that
/// type (`NumPart_ThisFile[t] = 0` or the group absent, as GADGET-4 writes). `first_id` numbers
/// the particles when `ParticleIDs` is absent. Masses from `Masses`, else `MassTable[t]`.
fn read_type(
    f: &hdf5::File,
    file: &Path,
    t: usize,
    first_id: u64,
) -> Result<Option<TypeParticles>, NbodyError> {
    let group = format!("PartType{t}");
    let this = header_u64s(f, "NumPart_ThisFile").and_then(|v| v.get(t).copied());
    if this == Some(0) || (this.is_none() && f.group(&group).is_err()) {
        return Ok(None);
    }
    let read3 = |name: &str| -> Result<Vec<[f64; 3]>, NbodyError> {
        let obj = format!("{group}/{name}");
        let d = f.dataset(&obj).map_err(|e| h5err(file, &obj, e))?;
        let sh = d.shape();
        if sh.len() != 2 || sh[1] != 3 {
            return Err(h5err(file, &obj, format!("shape {sh:?}, expected (N, 3)")));
        }
        let v = d.read_raw::<f64>().map_err(|e| h5err(file, &obj, e))?;
        Ok(v.chunks_exact(3).map(|c| [c[0], c[1], c[2]]).collect())
    };
    let x = read3("Coordinates")?;
    let v = read3("Velocities")?;
    let n = x.len();
    let check = |name: &str, len: usize| {
        if len == n {
            Ok(())
        } else {
            Err(h5err(
                file,
                &format!("{group}/{name}"),
                format!("{len} rows, Coordinates has {n}"),
            ))
        }
    };
    check("Velocities", v.len())?;
    let id: Vec<u64> = match f.dataset(&format!("{group}/ParticleIDs")) {
        Ok(d) => d
            .read_raw::<u64>()
            .map_err(|e| h5err(file, &format!("{group}/ParticleIDs"), e))?,
        Err(_) => (first_id..first_id + n as u64).collect(),
    };
    check("ParticleIDs", id.len())?;
    let m: Vec<f64> = match f.dataset(&format!("{group}/Masses")) {
        Ok(d) => d
            .read_raw::<f64>()
            .map_err(|e| h5err(file, &format!("{group}/Masses"), e))?,
        Err(_) => {
            let mt = f
                .group("Header")
                .and_then(|h| h.attr("MassTable"))
                .and_then(|a| a.read_raw::<f64>())
                .map_err(|e| {
                    h5err(
                        file,
                        "Header/MassTable",
                        format!("{e}; without {group}/Masses the header needs MassTable[6]"),
                    )
                })?;
            let mt = mt.get(t).copied().unwrap_or(0.0);
            if mt <= 0.0 {
                return Err(h5err(
                    file,
                    "Header/MassTable",
                    format!(
                        "MassTable[{t}] = {mt} and no {group}/Masses dataset; give particle masses"
                    ),
                ));
            }
            vec![mt; n]
        }
    };
    check("Masses", m.len())?;
    Ok(Some((x, v, id, m)))
}

/// Reads rank `rank`'s share (the contiguous range of the particles in file order, types in
/// order 0-5 within a file) of a GADGET-style HDF5 snapshot, padded by `capacity_factor`.
///
/// Every particle type (`PartType0`..`PartType5`: gas, halo, disk, bulge, stars, boundary) is
/// read as a gravitating point mass, as GADGET's gravity treats them; gas (type 0) is then
/// collisionless (no hydrodynamics), and rank 0 prints a one-line warning saying so. Masses come
/// from `PartTypeT/Masses` or, when absent, `Header/MassTable[T]`. Single- or
/// double-precision datasets and 32- or 64-bit ids are read (HDF5 converts); files of a
/// multi-file set without particles of a type (`NumPart_ThisFile[T] = 0`, group absent) are
/// skipped for it; the particles read must add up to the header's `NumPart_Total` (+ `2^32
/// NumPart_Total_HighWord`) of each type.
///
/// Errors: [`NbodyError::Hdf5`] naming the file and object: unreadable or misshapen datasets,
/// missing masses, counts that disagree with the header, a snapshot without particles.
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
    let mut read = [0u64; 6];
    for file in &files {
        let f = hdf5::File::open(file).map_err(|e| h5err(file, "/", e))?;
        for (t, count) in read.iter_mut().enumerate() {
            if let Some((x, v, id, m)) = read_type(&f, file, t, ids.len() as u64)? {
                *count += x.len() as u64;
                pos.extend(x);
                vel.extend(v);
                mass.extend(m);
                ids.extend(id);
            }
        }
    }
    let counts = gadget_counts(&files)?;
    for t in 0..6 {
        if counts[t] != read[t] {
            return Err(h5err(
                path,
                "Header/NumPart_Total",
                format!("the header gives {} PartType{t} particles but the files hold {}; is a file of the set missing or truncated?", counts[t], read[t]),
            ));
        }
    }
    let n = pos.len() as u64;
    if n == 0 {
        return Err(h5err(
            path,
            "PartType0-5",
            "the snapshot holds no particles",
        ));
    }
    if read[0] > 0 && rank == 0 {
        eprintln!(
            "lockstep nbody: warning: the {} gas particles (PartType0) of '{}' are simulated as collisionless point masses (gravity only, no hydrodynamics)",
            read[0],
            path.display()
        );
    }
    let (start, end) = rank_range(n, rank, size);
    let local = (end - start) as usize;
    let mut p = Particles::with_capacity(padded_capacity(local, capacity_factor)?, n);
    for i in start as usize..end as usize {
        p.push(pos[i], vel[i], mass[i], ids[i], rank)?;
    }
    p.validate().map_err(|e| h5err(path, "PartType0-5", e))?;
    Ok(p)
}
