//! The `lockstep` binary as a user runs it.

use lockstep_comm::launch::mpirun_command;
use lockstep_comm::testing::run_with_limit;
use std::path::PathBuf;
use std::process::Command;
use std::time::Duration;

const LOCKSTEP: &str = env!("CARGO_BIN_EXE_lockstep");

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..")
}

#[test]
fn info_reports_every_rank_under_mpirun() {
    let mut cmd = mpirun_command(2);
    cmd.arg(LOCKSTEP)
        .arg("info")
        .env("CUDA_VISIBLE_DEVICES", "2,3");
    let out = run_with_limit(cmd, Duration::from_secs(30)).unwrap();
    assert!(out.success(), "{}", out.all_output());
    assert!(
        out.stdout.contains("communicator: mpi with 2 rank(s)"),
        "{}",
        out.stdout
    );
    assert!(out.stdout.contains("rank 1/2: launch Open MPI (mpirun), rank 1 of 2, node-local rank 1, device cuda (CUDA_VISIBLE_DEVICES token 3)"), "{}", out.stdout);
}

#[test]
fn info_serial_and_bad_binding() {
    let out = Command::new(LOCKSTEP).arg("info").output().unwrap();
    assert!(out.status.success());
    assert!(String::from_utf8_lossy(&out.stdout).contains("rank 0/1: launch serial"));
    let out = Command::new(LOCKSTEP)
        .arg("info")
        .env("CUDA_VISIBLE_DEVICES", "1,1")
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("\"1,1\" lists device \"1\" twice"));
}

/// The README's simulate example, with the config path relative to the working directory.
#[test]
fn simulate_the_bundled_real_network() {
    let out = Command::new(LOCKSTEP)
        .current_dir(repo())
        .args(["simulate", "examples/point_450glifs/config.simulation.json"])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{text}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    // NEST 3.10 produced 19,263 spikes for this network, input, dt and duration.
    assert!(text.contains("19263 spikes"), "{text}");
    assert!(repo()
        .join("examples/point_450glifs/output/spikes.h5")
        .exists());
}

#[test]
fn plot_writes_pngs_from_a_run_directory() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::create_dir_all(dir.path().join("callbacks")).unwrap();
    std::fs::write(
        dir.path().join("callbacks/losses.csv"),
        "step,epoch,rate,voltage,total\n1,0,4.0e2,1.0e-3,4.00001e2\n2,0,2.0e2,2.0e-3,2.00002e2\n3,0,1.0e2,2.0e-3,1.00002e2\n",
    )
    .unwrap();
    let spikes = repo().join("../shared/data/reference/nest_point450_dt0.1_t1000.spikes.h5");
    let out = Command::new(LOCKSTEP)
        .arg("plot")
        .arg(dir.path())
        .arg("--spikes")
        .arg(&spikes)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    for f in ["plots/losses.png", "plots/raster.png"] {
        let bytes = std::fs::read(dir.path().join(f)).unwrap();
        assert_eq!(&bytes[1..4], b"PNG", "{f} is not a PNG");
        assert!(bytes.len() > 10_000, "{f} is suspiciously small");
    }
    // A broken CSV is a clear error naming the file and line.
    std::fs::write(
        dir.path().join("callbacks/losses.csv"),
        "step,epoch,rate,total\n1,0,abc,1\n",
    )
    .unwrap();
    let out = Command::new(LOCKSTEP)
        .arg("plot")
        .arg(dir.path())
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("losses.csv line 2"));
}
