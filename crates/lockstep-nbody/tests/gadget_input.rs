//! GADGET-format HDF5 initial conditions in the shapes GADGET-4 and the usual readers
//! (h5py scripts, pynbody, yt) produce, written here with the hdf5 crate: multi-file sets
//! where a file holds no `PartType1` (group absent, `NumPart_ThisFile` 0), masses only in
//! `MassTable`, single precision, 32-bit ids, totals from `NumPart_Total` +
//! `NumPart_Total_HighWord`, every particle type 0-5 read as gravitating point masses.

use std::path::Path;

use lockstep_nbody::snapshot::{gadget_total, read_gadget_hdf5};

/// Writes one file of a set: `counts[k]` particles of type 1 starting at id `first`,
/// positions `(id, 2 id, 3 id)` and velocities `-(id, ...)` in f32, ids u32, masses only in
/// the MassTable (0.5). GADGET-4-style int64 counts when `wide`, else GADGET-2 uint32.
fn write_file(path: &Path, this: u64, total: u64, nfiles: i32, first: u64, wide: bool) {
    let f = hdf5::File::create(path).unwrap();
    let h = f.create_group("Header").unwrap();
    let mut this6 = [0u64; 6];
    this6[1] = this;
    let mut tot6 = [0u64; 6];
    tot6[1] = total & 0xffff_ffff;
    let mut high6 = [0u64; 6];
    high6[1] = total >> 32;
    if wide {
        for (name, v) in [("NumPart_ThisFile", this6), ("NumPart_Total", tot6)] {
            let v: Vec<i64> = v.iter().map(|&x| x as i64).collect();
            h.new_attr::<i64>()
                .shape([6])
                .create(name)
                .unwrap()
                .write_raw(&v)
                .unwrap();
        }
    } else {
        for (name, v) in [
            ("NumPart_ThisFile", this6),
            ("NumPart_Total", tot6),
            ("NumPart_Total_HighWord", high6),
        ] {
            let v: Vec<u32> = v.iter().map(|&x| x as u32).collect();
            h.new_attr::<u32>()
                .shape([6])
                .create(name)
                .unwrap()
                .write_raw(&v)
                .unwrap();
        }
    }
    h.new_attr::<f64>()
        .shape([6])
        .create("MassTable")
        .unwrap()
        .write_raw(&[0.0, 0.5, 0.0, 0.0, 0.0, 0.0])
        .unwrap();
    h.new_attr::<i32>()
        .create("NumFilesPerSnapshot")
        .unwrap()
        .write_scalar(&nfiles)
        .unwrap();
    if this == 0 {
        return; // GADGET-4 writes no PartType1 group for a file without such particles
    }
    let g = f.create_group("PartType1").unwrap();
    let ids: Vec<u64> = (first..first + this).collect();
    let x: Vec<f32> = ids
        .iter()
        .flat_map(|&i| [i as f32, 2.0 * i as f32, 3.0 * i as f32])
        .collect();
    let v: Vec<f32> = x.iter().map(|a| -a).collect();
    let n = this as usize;
    g.new_dataset::<f32>()
        .shape([n, 3])
        .create("Coordinates")
        .unwrap()
        .write_raw(&x)
        .unwrap();
    g.new_dataset::<f32>()
        .shape([n, 3])
        .create("Velocities")
        .unwrap()
        .write_raw(&v)
        .unwrap();
    let ids32: Vec<u32> = ids.iter().map(|&i| i as u32).collect();
    g.new_dataset::<u32>()
        .shape([n])
        .create("ParticleIDs")
        .unwrap()
        .write_raw(&ids32)
        .unwrap();
}

fn check_all(path: &Path, n: u64, ranks: usize) {
    assert_eq!(gadget_total(path).unwrap(), n);
    let mut ids = Vec::new();
    for r in 0..ranks {
        let p = read_gadget_hdf5(path, r, ranks, 1.25).unwrap();
        assert_eq!(p.num_total, n);
        for i in 0..p.num {
            let k = p.id[i] as f64;
            assert_eq!(p.pos[i], [k, 2.0 * k, 3.0 * k]);
            assert_eq!(p.vel[i], [-k, -2.0 * k, -3.0 * k]);
            assert_eq!(p.mass[i], 0.5);
        }
        ids.extend_from_slice(p.valid_id());
    }
    ids.sort_unstable();
    assert_eq!(ids, (0..n).collect::<Vec<_>>());
}

#[test]
fn multi_file_sets_with_empty_files_single_precision_and_mass_table() {
    for wide in [false, true] {
        let dir = tempfile::tempdir().unwrap();
        // Three files: 7 particles, none (no group), 5 particles.
        let counts = [7u64, 0, 5];
        let mut first = 0;
        for (k, &c) in counts.iter().enumerate() {
            let p = dir.path().join(format!("snap_000.{k}.hdf5"));
            write_file(&p, c, 12, 3, first, wide);
            first += c;
        }
        // Any file of the set names the set.
        check_all(&dir.path().join("snap_000.0.hdf5"), 12, 1);
        check_all(&dir.path().join("snap_000.2.hdf5"), 12, 3);
        check_all(&dir.path().join("snap_000.0.hdf5"), 12, 5);
    }
}

#[test]
fn totals_use_the_high_word_and_must_match_the_files() {
    let dir = tempfile::tempdir().unwrap();
    // A header claiming 2^32 + 3 particles: the total is read from both words, and the
    // files that hold only 3 are refused with a message naming the header key.
    let p = dir.path().join("big.hdf5");
    write_file(&p, 3, (1u64 << 32) + 3, 1, 0, false);
    assert_eq!(gadget_total(&p).unwrap(), (1u64 << 32) + 3);
    let e = read_gadget_hdf5(&p, 0, 1, 1.0).unwrap_err().to_string();
    assert!(e.contains("NumPart_Total") && e.contains("big.hdf5"), "{e}");
    // A missing file of a set is named.
    let q = dir.path().join("snap_001.0.hdf5");
    write_file(&q, 3, 6, 2, 0, false);
    let e = read_gadget_hdf5(&q, 0, 1, 1.0).unwrap_err().to_string();
    assert!(e.contains("snap_001.1.hdf5"), "{e}");
}

/// Writes a two-file GADGET set with h5py: gas (type 0, `Masses` f32) and halo (type 1,
/// `MassTable` only, f32) in file 0; disk (type 2, `MassTable`) and one star (type 4, `Masses`
/// f64) in file 1, which has no `PartType1` (`NumPart_ThisFile[1] = 0`). Totals in
/// `NumPart_Total` (uint32) and `NumPart_Total_HighWord`.
const MIXED_TYPES: &str = r#"
import sys, h5py, numpy as np
d = sys.argv[1]
total = [2, 3, 2, 0, 1, 0]
def header(f, this):
    h = f.create_group("Header")
    h.attrs["NumPart_ThisFile"] = np.array(this, "u4")
    h.attrs["NumPart_Total"] = np.array(total, "u4")
    h.attrs["NumPart_Total_HighWord"] = np.zeros(6, "u4")
    h.attrs["MassTable"] = np.array([0.0, 0.5, 2.0, 0.0, 0.0, 0.0])
    h.attrs["NumFilesPerSnapshot"] = np.int32(2)
def part(f, t, ids, masses=None, dtype="f4"):
    g = f.create_group("PartType%d" % t)
    ids = np.array(ids, "u8")
    x = np.stack([ids, 2 * ids, 3 * ids], axis=1).astype(dtype)
    g["Coordinates"] = x
    g["Velocities"] = -x
    g["ParticleIDs"] = ids.astype("u4")
    if masses is not None:
        g["Masses"] = np.array(masses, dtype)
with h5py.File(d + "/ics.0.hdf5", "w") as f:
    header(f, [2, 3, 0, 0, 0, 0])
    part(f, 0, [1, 2], [0.25, 0.25])
    part(f, 1, [3, 4, 5])
with h5py.File(d + "/ics.1.hdf5", "w") as f:
    header(f, [0, 0, 2, 0, 1, 0])
    part(f, 2, [6, 7])
    part(f, 4, [8], [7.0], dtype="f8")
"#;

#[test]
fn every_particle_type_is_read_as_a_gravitating_mass() {
    let dir = tempfile::tempdir().unwrap();
    lockstep_testkit::python(MIXED_TYPES, &[dir.path().as_os_str()]);
    let p = dir.path().join("ics.0.hdf5");
    assert_eq!(gadget_total(&p).unwrap(), 8);
    let all = read_gadget_hdf5(&p, 0, 1, 1.0).unwrap();
    // File order, types 0-5 within a file: gas, halo | disk, star.
    assert_eq!(all.valid_id(), [1, 2, 3, 4, 5, 6, 7, 8]);
    assert_eq!(all.valid_mass(), [0.25, 0.25, 0.5, 0.5, 0.5, 2.0, 2.0, 7.0]);
    for (x, &id) in all.valid_pos().iter().zip(all.valid_id()) {
        let i = id as f64;
        assert_eq!(*x, [i, 2.0 * i, 3.0 * i]);
    }
    // Two ranks split the 8 particles 4 + 4 whatever their types.
    let r1 = read_gadget_hdf5(&p, 1, 2, 1.0).unwrap();
    assert_eq!(r1.valid_id(), [5, 6, 7, 8]);
    // A count that disagrees with the header names the type.
    std::fs::remove_file(dir.path().join("ics.1.hdf5")).unwrap();
    let e = read_gadget_hdf5(&p, 0, 1, 1.0).unwrap_err().to_string();
    assert!(e.contains("ics.1.hdf5"), "{e}");
}
