//! Sharded runs (issue 9): the same config on 1, 2 and 4 ranks (ThreadComm, and real
//! `mpirun` processes) writes snapshots whose union is the one-rank snapshot; a failing
//! rank ends the run within seconds.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use lockstep_comm::{run_replicas, Communicator};
use lockstep_nbody::config::run_nbody_config_on;
use lockstep_nbody::shard::simulate_sharded;
use lockstep_nbody::snapshot::read_gadget_hdf5;
use lockstep_nbody::{
    ForceSettings, InitialConditions, Integrator, Method, NbodyError, NbodySimulateOptions,
    Particles, RunOptions,
};

fn config(dir: &Path, name: &str, method: &str, steps: usize) -> PathBuf {
    let cfg = serde_json::json!({
        "units": {"gravitational_constant": 1.0},
        "initial_conditions": {"kind": "clumps", "n": 1000, "clumps": 4, "total_mass": 1.0,
                               "box_size": 4.0, "clump_radius": 0.3, "velocity_dispersion": 0.2, "seed": 5},
        "capacity_factor": 1.5,
        "forces": {"method": method, "softening": 0.05},
        "time": {"t_start": 0.0, "t_end": 0.002 * steps as f64, "steps": steps},
        "output": {"dir": name, "every": steps}
    });
    let path = dir.join(format!("{name}.json"));
    std::fs::write(&path, cfg.to_string()).unwrap();
    path
}

fn quiet() -> RunOptions {
    RunOptions {
        quiet: true,
        ..Default::default()
    }
}

/// The union of the final snapshot files, sorted by id.
fn final_snapshot(dir: &Path, index: usize) -> Particles {
    let p = read_gadget_hdf5(&dir.join(format!("snap_{index:03}.0.hdf5")), 0, 1, 1.0).unwrap();
    let mut order: Vec<usize> = (0..p.num).collect();
    order.sort_by_key(|&i| p.id[i]);
    Particles::from_arrays(
        order.iter().map(|&i| p.pos[i]).collect(),
        order.iter().map(|&i| p.vel[i]).collect(),
        order.iter().map(|&i| p.mass[i]).collect(),
        order.iter().map(|&i| p.id[i]).collect(),
    )
    .unwrap()
}

fn max_pos_diff(a: &Particles, b: &Particles) -> f64 {
    assert_eq!(a.id, b.id, "same particle ids");
    (0..a.num)
        .flat_map(|i| (0..3).map(move |k| (a.pos[i][k] - b.pos[i][k]).abs()))
        .fold(0.0, f64::max)
}

#[test]
fn thread_ranks_reproduce_the_one_rank_snapshot_after_100_steps() {
    let dir = tempfile::tempdir().unwrap();
    for method in ["direct", "fmm"] {
        let one = config(dir.path(), &format!("{method}_1"), method, 100);
        let s1 = run_nbody_config_on(&lockstep_comm::SelfComm::new(), &one, &quiet()).unwrap();
        let reference = final_snapshot(&dir.path().join(format!("{method}_1")), 1);
        assert_eq!(reference.num, 1000);
        for ranks in [2usize, 4] {
            let name = format!("{method}_{ranks}");
            let path = config(dir.path(), &name, method, 100);
            let sums =
                run_replicas(ranks, |comm| run_nbody_config_on(&comm, &path, &quiet())).unwrap();
            let out = dir.path().join(&name);
            for r in 0..ranks {
                assert!(out.join(format!("snapshot_0001_rank_{r:04}.npz")).exists());
            }
            let union = final_snapshot(&out, 1);
            let diff = max_pos_diff(&union, &reference);
            println!("{method} on {ranks} ranks: max |dx| = {diff:e}");
            // Direct sums differ only in summation order; the FMM by its truncation error.
            let tol = if method == "direct" { 1e-10 } else { 5e-5 };
            assert!(diff < tol, "{method} on {ranks} ranks: max |dx| = {diff:e}");
            let e1 = s1.diagnostics[1].energy();
            for s in &sums {
                assert!(
                    (s.diagnostics[1].energy() / e1 - 1.0).abs() < 1e-6,
                    "energy reduced over ranks"
                );
            }
        }
    }
}

#[test]
fn a_failing_rank_ends_the_run_within_seconds() {
    let ic = InitialConditions::Plummer {
        n: 2000,
        total_mass: 1.0,
        scale_radius: 1.0,
        max_radius: 30.0,
        seed: 1,
    };
    let ts: Vec<f64> = (0..=200).map(|k| k as f64 * 1e-3).collect();
    let opts = NbodySimulateOptions {
        integrator: Integrator::Dkd,
        outputs: (0..=200).step_by(10).collect(),
        keep_on_device: true,
    };
    let settings = ForceSettings {
        method: Method::Fmm,
        softening: 0.05,
        ..Default::default()
    };
    let start = Instant::now();
    let res = run_replicas(3, |comm| -> Result<(), NbodyError> {
        let mut p = ic.generate(1.0, comm.rank(), 3, 1.5)?;
        let rank = comm.rank();
        simulate_sharded(
            &comm,
            &mut p,
            &ts,
            &settings,
            1.0,
            &opts,
            |k, _, _| {
                if rank == 1 && k == 50 {
                    Err(NbodyError::param(
                        "test",
                        k,
                        "rank 1 fails on purpose at step 50",
                    ))
                } else {
                    Ok(())
                }
            },
            |_| {},
        )?;
        Ok(())
    });
    let elapsed = start.elapsed();
    let e = res.unwrap_err().to_string();
    assert!(e.contains("rank 1") && e.contains("on purpose"), "{e}");
    assert!(elapsed < Duration::from_secs(10), "took {elapsed:?}");
}

/// The `lockstep-nbody-check` binary (built by `cargo test`); fails when mpirun is missing
/// (CI installs Open MPI).
fn check_binary() -> PathBuf {
    let bin = PathBuf::from(env!("CARGO_BIN_EXE_lockstep-nbody-check"));
    assert!(
        lockstep_testkit::have_mpirun() && bin.exists(),
        "the mpirun tests need mpirun (found: {}) and {} (exists: {})",
        lockstep_testkit::have_mpirun(),
        bin.display(),
        bin.exists()
    );
    bin
}

#[test]
fn mpirun_ranks_reproduce_the_one_rank_snapshot() {
    let bin = check_binary();
    let dir = tempfile::tempdir().unwrap();
    for (method, ranks, tol) in [
        ("direct", 2usize, 1e-10),
        ("fmm", 3, 5e-5),
        ("fmm", 4, 5e-5),
    ] {
        let one = config(dir.path(), &format!("mpi_{method}_1"), method, 100);
        // The same reference folder serves two rank counts: the second run replaces it.
        let replace = RunOptions {
            overwrite: true,
            ..quiet()
        };
        run_nbody_config_on(&lockstep_comm::SelfComm::new(), &one, &replace).unwrap();
        let reference = final_snapshot(&dir.path().join(format!("mpi_{method}_1")), 1);
        let name = format!("mpi_{method}_{ranks}");
        let path = config(dir.path(), &name, method, 100);
        let cmd = lockstep_comm::launch::mpirun_command(ranks);
        let out = std::process::Command::new("timeout")
            .arg("120")
            .arg(cmd.get_program())
            .args(cmd.get_args())
            .envs(
                cmd.get_envs()
                    .filter_map(|(k, v)| v.map(|v| (k.to_owned(), v.to_owned()))),
            )
            .arg(&bin)
            .arg(&path)
            .arg("--quiet")
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "mpirun failed ({}):\n{}\n{}",
            out.status,
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        // One file per process (a serial fallback would write only rank 0's).
        let last = ranks - 1;
        assert!(
            dir.path()
                .join(format!("{name}/snap_001.{last}.hdf5"))
                .exists(),
            "rank {last} wrote its file"
        );
        assert!(dir
            .path()
            .join(format!("{name}/snapshot_0001_rank_{last:04}.npz"))
            .exists());
        let union = final_snapshot(&dir.path().join(&name), 1);
        let diff = max_pos_diff(&union, &reference);
        println!("{method} on {ranks} MPI ranks: max |dx| = {diff:e}");
        assert!(
            diff < tol,
            "{method} on {ranks} MPI ranks: max |dx| = {diff:e}"
        );
    }
}

#[test]
fn a_crashing_mpi_rank_ends_the_job_within_10_s() {
    let bin = check_binary();
    let dir = tempfile::tempdir().unwrap();
    // A run long enough that the crash happens mid-run.
    let path = config(dir.path(), "crash", "fmm", 100_000);
    let cmd = lockstep_comm::launch::mpirun_command(2);
    let start = Instant::now();
    let out = std::process::Command::new("timeout")
        .arg("10")
        .arg(cmd.get_program())
        .args(cmd.get_args())
        .envs(
            cmd.get_envs()
                .filter_map(|(k, v)| v.map(|v| (k.to_owned(), v.to_owned()))),
        )
        .arg(&bin)
        .arg(&path)
        .args(["--quiet", "--crash-rank", "1", "--crash-after-ms", "1500"])
        .output()
        .unwrap();
    let elapsed = start.elapsed();
    let code = out.status.code();
    println!(
        "exit {code:?} after {elapsed:?}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_ne!(code, Some(124), "the job hung until the 10 s limit");
    assert!(!out.status.success(), "a crashed rank must fail the job");
    assert!(elapsed < Duration::from_secs(10));
}

#[test]
fn mpirun_with_a_rank_that_holds_no_particle_runs() {
    let bin = check_binary();
    let dir = tempfile::tempdir().unwrap();
    let cfg = serde_json::json!({
        "units": {"gravitational_constant": 1.0},
        "initial_conditions": {"kind": "plummer", "n": 1, "seed": 5},
        "forces": {"method": "fmm", "softening": 0.05},
        "time": {"t_start": 0.0, "t_end": 0.01, "steps": 4},
        "output": {"dir": "one", "every": 4}
    });
    let path = dir.path().join("one.json");
    std::fs::write(&path, cfg.to_string()).unwrap();
    let cmd = lockstep_comm::launch::mpirun_command(2);
    let out = std::process::Command::new("timeout")
        .arg("60")
        .arg(cmd.get_program())
        .args(cmd.get_args())
        .envs(
            cmd.get_envs()
                .filter_map(|(k, v)| v.map(|v| (k.to_owned(), v.to_owned()))),
        )
        .arg(&bin)
        .arg(&path)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "mpirun -n 2 on one particle failed ({}):\n{stdout}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        !stdout.contains("NaN") && !stdout.contains("inf"),
        "{stdout}"
    );
    let p = final_snapshot(&dir.path().join("one"), 1);
    assert_eq!(p.num, 1);
    assert!(dir.path().join("one/snap_001.1.hdf5").exists());
}
