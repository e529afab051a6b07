//! Inputs users hit (issue 13): ranks without particles, the output folder owned by the run,
//! drifts of systems whose initial scale is zero, runs that cannot fit in memory.

use std::path::{Path, PathBuf};

use lockstep_comm::{run_replicas, SelfComm};
use lockstep_nbody::config::run_nbody_config_on;
use lockstep_nbody::snapshot::read_gadget_hdf5;
use lockstep_nbody::{run_nbody_config, RunOptions};

fn write_config(dir: &Path, name: &str, ic: serde_json::Value, out: &str) -> PathBuf {
    let cfg = serde_json::json!({
        "units": {"gravitational_constant": 1.0},
        "initial_conditions": ic,
        "forces": {"method": "fmm", "softening": 0.05},
        "time": {"t_start": 0.0, "t_end": 0.01, "steps": 4},
        "output": {"dir": out, "every": 2}
    });
    let path = dir.join(format!("{name}.json"));
    std::fs::write(&path, cfg.to_string()).unwrap();
    path
}

fn cube(n: u64, dispersion: f64) -> serde_json::Value {
    serde_json::json!({"kind": "uniform_cube", "n": n, "box_size": 1.0,
                       "velocity_dispersion": dispersion, "seed": 3})
}

fn quiet() -> RunOptions {
    RunOptions {
        quiet: true,
        ..Default::default()
    }
}

/// Every id of the final snapshot, over all rank files.
fn final_ids(dir: &Path, index: usize) -> Vec<u64> {
    let p = read_gadget_hdf5(&dir.join(format!("snap_{index:03}.0.hdf5")), 0, 1, 1.0).unwrap();
    let mut ids = p.valid_id().to_vec();
    ids.sort_unstable();
    ids
}

#[test]
fn ranks_without_particles_run() {
    let dir = tempfile::tempdir().unwrap();
    for (n, ranks) in [(1u64, 2usize), (2, 3), (3, 4)] {
        let name = format!("n{n}_r{ranks}");
        let path = write_config(dir.path(), &name, cube(n, 0.1), &name);
        let sums = run_replicas(ranks, |comm| run_nbody_config_on(&comm, &path, &quiet()))
            .unwrap_or_else(|e| panic!("{n} particles on {ranks} ranks: {e}"));
        assert_eq!(sums[0].num_total, n);
        assert_eq!(sums[0].diagnostics.len(), 3);
        let out = dir.path().join(&name);
        for r in 0..ranks {
            assert!(out.join(format!("snap_002.{r}.hdf5")).exists(), "rank {r}");
        }
        assert_eq!(final_ids(&out, 2), (0..n).collect::<Vec<_>>());
    }
}

#[test]
fn drifts_of_a_system_at_rest_are_absolute_and_finite() {
    let dir = tempfile::tempdir().unwrap();
    // One particle at rest: K = W = E = 0 and P = sum m|v| = 0 at the start.
    let path = write_config(dir.path(), "rest", cube(1, 0.0), "rest");
    let s = run_nbody_config(&path, &quiet()).unwrap();
    assert_eq!(s.diagnostics[0].energy(), 0.0);
    assert_eq!(s.drift_is_absolute, (true, true));
    assert_eq!(
        (s.energy_drift, s.max_energy_drift, s.momentum_drift),
        (0.0, 0.0, 0.0)
    );
    // One moving particle: E0 = K > 0 (relative), and it keeps its energy.
    let path = write_config(dir.path(), "moving", cube(1, 1.0), "moving");
    let s = run_nbody_config(&path, &quiet()).unwrap();
    assert_eq!(s.drift_is_absolute, (false, false));
    assert!(
        s.energy_drift.abs() < 1e-12 && s.momentum_drift < 1e-12,
        "{s:?}"
    );
}

#[test]
fn the_output_folder_is_owned_by_the_run() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("out");
    let path = write_config(dir.path(), "c", cube(50, 0.1), "out");
    // A 2-rank run, then a 1-rank run into the same folder.
    run_replicas(2, |comm| run_nbody_config_on(&comm, &path, &quiet())).unwrap();
    assert!(out.join("snap_002.1.hdf5").exists());
    assert!(out.join(lockstep_core::output_dir::MARKER).exists());
    let before = std::fs::read(out.join("snap_002.1.hdf5")).unwrap();
    let e = run_nbody_config(&path, &quiet()).unwrap_err().to_string();
    assert!(
        e.contains("overwrite_output_dir") && e.contains("--overwrite") && e.contains("out"),
        "{e}"
    );
    assert_eq!(
        std::fs::read(out.join("snap_002.1.hdf5")).unwrap(),
        before,
        "a refused run leaves the earlier outputs untouched"
    );
    let overwrite = RunOptions {
        overwrite: true,
        ..quiet()
    };
    let s = run_nbody_config(&path, &overwrite).unwrap();
    assert_eq!(s.output_dir.as_deref(), Some(out.as_path()));
    let mut names: Vec<String> = std::fs::read_dir(&out)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    for k in 0..3 {
        assert!(names.contains(&format!("snap_{k:03}.0.hdf5")));
        assert!(!names.contains(&format!("snap_{k:03}.1.hdf5")), "{names:?}");
        assert!(!names.contains(&format!("snapshot_{k:04}_rank_0001.npz")));
    }
    // The HDF5 header now says one file per snapshot, and it holds every particle.
    assert_eq!(final_ids(&out, 2), (0..50).collect::<Vec<_>>());

    // A file lockstep did not write: refused even with overwrite, and kept.
    std::fs::write(out.join("notes.txt"), "mine").unwrap();
    let e = run_nbody_config(&path, &overwrite).unwrap_err().to_string();
    assert!(e.contains("notes.txt"), "{e}");
    assert_eq!(
        std::fs::read_to_string(out.join("notes.txt")).unwrap(),
        "mine"
    );
    assert!(out.join("snap_002.0.hdf5").exists());

    // An existing empty folder is used; a file in the folder's place is refused.
    let empty = dir.path().join("empty");
    std::fs::create_dir(&empty).unwrap();
    let p2 = write_config(dir.path(), "e", cube(10, 0.1), "empty");
    run_nbody_config_on(&SelfComm::new(), &p2, &quiet()).unwrap();
    assert!(empty.join("diagnostics.csv").exists());
    std::fs::write(dir.path().join("afile"), "x").unwrap();
    let p3 = write_config(dir.path(), "f", cube(10, 0.1), "afile");
    let e = run_nbody_config(&p3, &overwrite).unwrap_err().to_string();
    assert!(e.contains("not a folder"), "{e}");
}

#[test]
fn a_run_that_cannot_fit_in_memory_is_refused_before_outputs() {
    let dir = tempfile::tempdir().unwrap();
    let path = write_config(dir.path(), "huge", cube(100_000_000_000_000, 0.1), "huge");
    let e = run_nbody_config(&path, &quiet()).unwrap_err().to_string();
    assert!(
        e.contains("huge.json") && e.contains("initial_conditions.n") && e.contains("memory"),
        "{e}"
    );
    assert!(!dir.path().join("huge").exists(), "nothing was created");
}
