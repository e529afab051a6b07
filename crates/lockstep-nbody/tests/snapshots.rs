//! Snapshot files (issue 8 acceptance): `.npz` and GADGET-style HDF5 files open with numpy
//! and h5py and hold exactly the valid particles (never the padding); GADGET input
//! round-trips; the config runner writes them.

use lockstep_nbody::snapshot::{read_gadget_hdf5, write_hdf5, write_npz, SnapshotHeader};
use lockstep_nbody::{run_nbody_config, InitialConditions, Particles, RunOptions, Units};
use lockstep_testkit::{python, require_h5py};

/// Padded shard: 7 valid particles, capacity 12, padding filled with poison values.
fn padded() -> Particles {
    let ic = InitialConditions::UniformCube {
        n: 7,
        total_mass: 7.0,
        box_size: 2.0,
        velocity_dispersion: 3.0,
        seed: 9,
    };
    let mut p = ic.generate(1.0, 0, 1, 12.0 / 7.0).unwrap();
    assert_eq!((p.num, p.capacity()), (7, 12));
    for i in p.num..p.capacity() {
        p.pos[i] = [999.0; 3];
        p.vel[i] = [-999.0; 3];
        p.mass[i] = 999.0;
        p.id[i] = 999;
    }
    p.id[3] = 1 << 40; // exercises 64-bit ids
    p.num_total = 10; // as if 3 more particles lived on another rank
    p
}

#[test]
fn snapshot_files_hold_exactly_the_valid_particles() {
    let dir = tempfile::tempdir().unwrap();
    let p = padded();
    let header = SnapshotHeader {
        time: 1.5,
        num_files: 2,
        box_size: 0.0,
        units: Units::with_mass_unit(1e10),
    };
    let npz = write_npz(dir.path(), 3, 1, &p).unwrap();
    let h5 = write_hdf5(dir.path(), 3, 1, &p, &header).unwrap();
    assert_eq!(npz.file_name().unwrap(), "snapshot_0003_rank_0001.npz");
    assert_eq!(h5.file_name().unwrap(), "snap_003.1.hdf5");

    // Rust-side read back of the HDF5 file: same particles, padding absent.
    let back = read_gadget_hdf5(&h5, 0, 1, 1.0);
    // num_files = 2 but the sibling file is missing: a clear error naming the header key.
    let e = back.unwrap_err().to_string();
    assert!(
        e.contains("snap_003.0.hdf5") || e.contains("NumFilesPerSnapshot"),
        "{e}"
    );

    require_h5py();
    let expect = serde_json::json!({
        "pos": p.valid_pos(), "vel": p.valid_vel(), "id": p.valid_id(), "mass": p.valid_mass(),
    });
    std::fs::write(dir.path().join("expect.json"), expect.to_string()).unwrap();
    let script = r#"
import sys, json
import numpy as np, h5py
d = sys.argv[1]
e = json.load(open(d + "/expect.json"))
z = np.load(d + "/snapshot_0003_rank_0001.npz")
assert sorted(z.files) == ["id", "mass", "pos", "vel"], z.files
assert z["pos"].shape == (7, 3) and z["pos"].dtype == np.float64
assert z["vel"].shape == (7, 3)
assert np.array_equal(z["pos"], np.array(e["pos"]))
assert np.array_equal(z["vel"], np.array(e["vel"]))
assert np.array_equal(z["id"], np.array(e["id"], dtype=np.uint64))
with h5py.File(d + "/snap_003.1.hdf5", "r") as f:
    h = f["Header"].attrs
    assert list(h["NumPart_ThisFile"]) == [0, 7, 0, 0, 0, 0]
    assert list(h["NumPart_Total"]) == [0, 10, 0, 0, 0, 0]
    assert list(h["NumPart_Total_HighWord"]) == [0] * 6
    assert list(h["MassTable"]) == [0.0] * 6
    assert h["Time"] == 1.5 and h["Redshift"] == 0.0 and h["BoxSize"] == 0.0
    assert h["NumFilesPerSnapshot"] == 2 and h["Flag_DoublePrecision"] == 1
    g = f["PartType1"]
    assert g["Coordinates"].shape == (7, 3) and g["Velocities"].shape == (7, 3)
    assert g["ParticleIDs"].shape == (7,) and g["Masses"].shape == (7,)
    assert np.array_equal(g["Coordinates"][...], np.array(e["pos"]))
    assert np.array_equal(g["Velocities"][...], np.array(e["vel"]))
    assert np.array_equal(g["ParticleIDs"][...], np.array(e["id"], dtype=np.uint64))
    assert np.array_equal(g["Masses"][...], np.array(e["mass"]))
    assert 999.0 not in g["Coordinates"][...]
    u = f["Units"].attrs
    assert abs(u["UnitLength_in_cm"] / 3.0857e21 - 1) < 1e-4
    assert abs(u["UnitMass_in_g"] / 1.989e43 - 1) < 1e-3
    assert abs(u["GravitationalConstant"] / 4.30071057317063e4 - 1) < 1e-12
    # pynbody's time of a non-cosmological file: Time_GYR, the time in Gyr from the Units
    # group (1.5 kpc/(km/s) = 1.4667 Gyr with the Julian year).
    gyr = 1.5 * u["UnitLength_in_cm"] / u["UnitVelocity_in_cm_per_s"] / 3.15576e16
    assert abs(h["Time_GYR"] - gyr) <= 1e-12 * gyr, (h["Time_GYR"], gyr)
    assert abs(h["Time_GYR"] - 1.4667) < 1e-4, h["Time_GYR"]
print("ok")
"#;
    assert_eq!(python(script, &[dir.path().as_os_str()]).trim(), "ok");
}

#[test]
fn gadget_initial_conditions_written_by_h5py_are_read_and_split_over_ranks() {
    require_h5py();
    let dir = tempfile::tempdir().unwrap();
    let script = r#"
import sys
import numpy as np, h5py
d = sys.argv[1]
rng = np.random.default_rng(1)
n = 101
with h5py.File(d + "/ics.hdf5", "w") as f:
    h = f.create_group("Header")
    h.attrs["NumPart_ThisFile"] = np.array([0, n, 0, 0, 0, 0], dtype=np.uint32)
    h.attrs["NumPart_Total"] = np.array([0, n, 0, 0, 0, 0], dtype=np.uint32)
    h.attrs["MassTable"] = np.array([0, 0.25, 0, 0, 0, 0])
    h.attrs["NumFilesPerSnapshot"] = np.int32(1)
    g = f.create_group("PartType1")
    g["Coordinates"] = np.arange(3 * n, dtype=np.float64).reshape(n, 3)
    g["Velocities"] = -np.arange(3 * n, dtype=np.float64).reshape(n, 3)
    g["ParticleIDs"] = np.arange(n, dtype=np.uint64) + 1000
print("ok")
"#;
    assert_eq!(python(script, &[dir.path().as_os_str()]).trim(), "ok");
    let path = dir.path().join("ics.hdf5");
    let mut ids = Vec::new();
    for r in 0..3 {
        let p = read_gadget_hdf5(&path, r, 3, 1.5).unwrap();
        assert_eq!(p.num_total, 101);
        assert!(p.capacity() >= (p.num as f64 * 1.5) as usize);
        for i in 0..p.num {
            let k = (p.id[i] - 1000) as f64;
            assert_eq!(p.pos[i], [3.0 * k, 3.0 * k + 1.0, 3.0 * k + 2.0]);
            assert_eq!(p.vel[i][0], -3.0 * k);
            assert_eq!(p.mass[i], 0.25);
        }
        ids.extend_from_slice(p.valid_id());
    }
    assert_eq!(ids, (1000..1101).collect::<Vec<u64>>());
    let e = read_gadget_hdf5(&dir.path().join("missing.hdf5"), 0, 1, 1.0)
        .unwrap_err()
        .to_string();
    assert!(e.contains("missing.hdf5"), "{e}");
}

#[test]
fn config_runner_writes_snapshots_and_diagnostics() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = serde_json::json!({
        "units": {"mass_in_msol": 1e10},
        "initial_conditions": {"kind": "plummer", "n": 500, "total_mass": 1.0, "scale_radius": 1.0, "seed": 7},
        "capacity_factor": 1.5,
        "forces": {"method": "fmm", "softening": 0.05, "order": 4, "theta": 0.5, "leaf_size": 16},
        "integrator": "kdk",
        "time": {"t_start": 0.0, "t_end": 0.002, "steps": 20},
        "output": {"dir": "out", "every": 10}
    });
    let path = dir.path().join("nbody.json");
    std::fs::write(&path, cfg.to_string()).unwrap();
    let s = run_nbody_config(
        &path,
        &RunOptions {
            quiet: true,
            ..Default::default()
        },
    )
    .unwrap();
    assert_eq!(s.steps, 20);
    assert_eq!(s.diagnostics.len(), 3);
    assert!(s.max_energy_drift < 1e-4, "{s:?}");
    assert!(s.momentum_drift < 1e-6 * s.steps as f64, "{s:?}");
    let out = dir.path().join("out");
    for k in 0..3 {
        assert!(out.join(format!("snapshot_{k:04}_rank_0000.npz")).exists());
        assert!(out.join(format!("snap_{k:03}.0.hdf5")).exists());
    }
    assert_eq!(s.files.len(), 6);
    let csv = std::fs::read_to_string(out.join("diagnostics.csv")).unwrap();
    assert_eq!(csv.lines().count(), 4);
    // The final HDF5 snapshot restarts a run as GADGET initial conditions.
    let p = read_gadget_hdf5(&out.join("snap_002.0.hdf5"), 0, 1, 1.0).unwrap();
    assert_eq!(p.num, 500);
    // The run keeps the z-ordered layout: every id once, in Morton order.
    let mut ids = p.valid_id().to_vec();
    ids.sort_unstable();
    assert_eq!(ids, (0..500).collect::<Vec<u64>>());

    // Unknown keys are errors naming the file and the nearest key.
    std::fs::write(
        &path,
        cfg.to_string().replace("\"integrator\"", "\"integrater\""),
    )
    .unwrap();
    let e = run_nbody_config(
        &path,
        &RunOptions {
            quiet: true,
            ..Default::default()
        },
    )
    .unwrap_err()
    .to_string();
    assert!(
        e.contains("nbody.json") && e.contains("did you mean `integrator`"),
        "{e}"
    );
    // Out-of-range values are errors before anything runs.
    std::fs::write(&path, cfg.to_string().replace("\"order\":4", "\"order\":9")).unwrap();
    let e = run_nbody_config(
        &path,
        &RunOptions {
            quiet: true,
            ..Default::default()
        },
    )
    .unwrap_err()
    .to_string();
    assert!(e.contains("forces.order") && e.contains('9'), "{e}");
}
