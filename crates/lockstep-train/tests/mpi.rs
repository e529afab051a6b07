//! Multi-process tests: real `mpirun -n 2` jobs of `lockstep-train-check` (the reference
//! model) under an external time limit; a timeout fails.

use lockstep_comm::launch::mpirun_command;
use lockstep_comm::launch::{run_with_limit, JobOutput};
use serde_json::{json, Value};
use std::path::Path;
use std::process::Command;
use std::time::Duration;

const CHECK: &str = env!("CARGO_BIN_EXE_lockstep-train-check");
const LIMIT: Duration = Duration::from_secs(10);

fn write_config(
    dir: &Path,
    name: &str,
    batch: usize,
    dist: Value,
    overwrite: bool,
) -> std::path::PathBuf {
    let training = json!({"optimizer": {"name": "adam", "learning_rate": 0.05}, "optimizer_updates": 3, "checksum_every": 1});
    write_config_with(dir, name, batch, dist, overwrite, training, json!({}))
}

fn write_config_with(
    dir: &Path,
    name: &str,
    batch: usize,
    dist: Value,
    overwrite: bool,
    training: Value,
    model: Value,
) -> std::path::PathBuf {
    let mut run = json!({"batch_size": batch, "seed": 21});
    if !dist.is_null() {
        run["distribution"] = dist;
    }
    let c = json!({
        "run": run,
        "training": training,
        "output": {"output_dir": name, "overwrite_output_dir": overwrite},
        "model": model,
    });
    let path = dir.join(format!("{name}.json"));
    std::fs::write(&path, serde_json::to_string_pretty(&c).unwrap()).unwrap();
    path
}

fn mpirun(n: usize, config: &Path, args: &[&str]) -> JobOutput {
    let mut cmd = mpirun_command(n);
    cmd.arg(CHECK).arg(config).args(args);
    let out = run_with_limit(cmd, Duration::from_secs(60)).unwrap();
    assert!(!out.timed_out, "job timed out:\n{}", out.all_output());
    out
}

fn check(config: &Path) -> Command {
    let mut cmd = Command::new(CHECK);
    cmd.arg(config);
    cmd
}

fn summary(out: &JobOutput) -> Value {
    let line = out
        .stdout
        .lines()
        .rfind(|l| l.starts_with('{'))
        .unwrap_or_else(|| panic!("no summary:\n{}", out.all_output()));
    serde_json::from_str(line).unwrap()
}

fn weights(dir: &Path) -> Vec<f64> {
    let v: Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("weights.json")).unwrap()).unwrap();
    v["w"]
        .as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_f64().unwrap())
        .collect()
}

/// Numerical oracle over real MPI: 2 processes x B equals 1 process x 2B.
#[test]
fn mpi_two_replicas_match_serial_with_twice_the_batch() {
    let dir = tempfile::tempdir().unwrap();
    let serial = write_config(dir.path(), "serial", 16, Value::Null, true);
    let mpi = write_config(
        dir.path(),
        "mpi",
        8,
        json!({"strategy": "mpi", "global_batch_size": 16}),
        true,
    );
    let s = run_with_limit(check(&serial), Duration::from_secs(60)).unwrap();
    assert!(s.success(), "{}", s.all_output());
    let m = mpirun(2, &mpi, &[]);
    assert!(m.success(), "{}", m.all_output());
    let (ws, wm) = (
        weights(&dir.path().join("serial")),
        weights(&dir.path().join("mpi")),
    );
    let num: f64 = ws.iter().zip(&wm).map(|(a, b)| (a - b) * (a - b)).sum();
    let den: f64 = ws.iter().map(|a| a * a).sum();
    assert!((num / den).sqrt() <= 1e-6, "{ws:?} vs {wm:?}");
    let (hs, hm) = (summary(&s), summary(&m));
    for (a, b) in hs["loss_history"]
        .as_array()
        .unwrap()
        .iter()
        .zip(hm["loss_history"].as_array().unwrap())
    {
        for (x, y) in a.as_array().unwrap().iter().zip(b.as_array().unwrap()) {
            let (x, y) = (x.as_f64().unwrap(), y.as_f64().unwrap());
            assert_eq!(format!("{x:.5e}"), format!("{y:.5e}"));
        }
    }
    // Only the chief prints (invariant 8).
    assert_eq!(
        m.stdout.matches("Completed 3 optimizer updates.").count(),
        1,
        "{}",
        m.stdout
    );
}

/// Invariant 3: launcher and config must agree, checked before any file is created.
#[test]
fn launcher_mismatches_fail_before_any_output() {
    let dir = tempfile::tempdir().unwrap();
    let mpi = write_config(dir.path(), "mpi_cfg", 8, json!({"strategy": "mpi"}), false);
    let out = run_with_limit(check(&mpi), LIMIT).unwrap();
    assert!(!out.success() && !out.timed_out);
    assert!(
        out.stderr.contains("not started by mpirun"),
        "{}",
        out.all_output()
    );
    assert!(!dir.path().join("mpi_cfg").exists());

    let serial = write_config(dir.path(), "serial_cfg", 8, Value::Null, false);
    let out = mpirun(2, &serial, &[]);
    assert!(!out.success());
    assert!(
        out.all_output()
            .contains("launched by Open MPI (mpirun) with 2 ranks"),
        "{}",
        out.all_output()
    );
    assert!(!dir.path().join("serial_cfg").exists());
}

fn injected(spec: &str, rank_text: &str) {
    let dir = tempfile::tempdir().unwrap();
    let cfg = write_config(dir.path(), "out", 4, json!({"strategy": "mpi"}), true);
    let out = mpirun(2, &cfg, &["--inject-failure", spec]);
    assert!(
        out.code != Some(0),
        "{spec}: exited 0:\n{}",
        out.all_output()
    );
    assert!(out.elapsed < LIMIT, "{spec}: took {:?}", out.elapsed);
    assert!(
        out.all_output().contains("injected failure"),
        "{spec}:\n{}",
        out.all_output()
    );
    assert!(
        out.all_output().contains(rank_text),
        "{spec}: no {rank_text:?}:\n{}",
        out.all_output()
    );
}

#[test]
fn injected_failure_at_validation_ends_the_job() {
    injected("validation", "error on rank");
}

#[test]
fn injected_failure_in_chief_output_setup_ends_the_job() {
    injected("output_setup", "error on rank 0");
}

#[test]
fn injected_failure_on_a_worker_update_ends_the_job() {
    injected("update:1:1", "error on rank 1");
}

#[test]
fn injected_failure_on_the_chief_update_ends_the_job() {
    injected("update:1:0", "error on rank 0");
}

#[test]
fn injected_failure_in_a_chief_callback_ends_the_job() {
    injected("callback:2", "error on rank 0");
}

#[test]
fn existing_output_dir_stops_the_job_and_is_untouched() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = write_config(dir.path(), "out", 4, json!({"strategy": "mpi"}), false);
    std::fs::create_dir_all(dir.path().join("out")).unwrap();
    std::fs::write(dir.path().join("out/results.csv"), "precious").unwrap();
    let out = mpirun(2, &cfg, &[]);
    assert!(
        out.code != Some(0) && out.elapsed < LIMIT,
        "{}",
        out.all_output()
    );
    assert!(out.all_output().contains("overwrite_output_dir"));
    refused_once(&out);
    assert_eq!(
        std::fs::read_dir(dir.path().join("out")).unwrap().count(),
        1
    );
    assert_eq!(
        std::fs::read_to_string(dir.path().join("out/results.csv")).unwrap(),
        "precious"
    );
}

/// A refusal every rank learns before training (here the chief's output folder or resume
/// point): the reason printed once, by rank 0, and the ranks leave through `MPI_Finalize`
/// (no `MPI_ABORT` report from the launcher).
fn refused_once(out: &JobOutput) {
    let all = out.all_output();
    assert!(!all.contains("MPI_ABORT"), "aborted:\n{all}");
    assert_eq!(all.matches(": error on rank").count(), 1, "{all}");
    assert!(
        all.contains("lockstep-train-check: error on rank 0"),
        "{all}"
    );
}

/// Resuming a finished run (the checkpoint already has every update) is refused on every
/// rank without an abort, naming the key and the fix.
#[test]
fn resuming_a_finished_run_is_refused_cleanly() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = write_config(dir.path(), "done", 4, json!({"strategy": "mpi"}), true);
    let out = mpirun(2, &cfg, &[]);
    assert!(out.success(), "{}", out.all_output());
    let ckpt = dir.path().join("done/checkpoints/latest");
    let out = mpirun(2, &cfg, &["--resume", ckpt.to_str().unwrap()]);
    assert!(
        out.code != Some(0) && out.elapsed < LIMIT,
        "{}",
        out.all_output()
    );
    assert!(
        out.all_output().contains("already has 3 updates"),
        "{}",
        out.all_output()
    );
    refused_once(&out);
}

/// Issue 13 item 3 over real MPI: 2 ranks x 2 accumulated micro-batches of 2 log the loss
/// of a serial batch of 8 and stop early at the same update.
#[test]
fn mpi_accumulation_logs_the_loss_of_the_plain_batch() {
    let dir = tempfile::tempdir().unwrap();
    let training = |k: usize| {
        json!({"optimizer": {"name": "adam", "learning_rate": 0.05}, "optimizer_updates": 100,
               "gradient_updates_per_optimizer_step": k, "early_stop_loss": 0.02})
    };
    let serial = write_config_with(
        dir.path(),
        "serial",
        8,
        Value::Null,
        true,
        training(1),
        json!({}),
    );
    let mpi = write_config_with(
        dir.path(),
        "mpi",
        2,
        json!({"strategy": "mpi", "global_batch_size": 4}),
        true,
        training(2),
        json!({}),
    );
    let s = run_with_limit(check(&serial), Duration::from_secs(60)).unwrap();
    assert!(s.success(), "{}", s.all_output());
    let m = mpirun(2, &mpi, &[]);
    assert!(m.success(), "{}", m.all_output());
    let (hs, hm) = (summary(&s), summary(&m));
    let updates = hs["updates"].as_u64().unwrap();
    assert!(updates > 3 && updates < 100, "serial stopped at {updates}");
    assert_eq!(hm["updates"], hs["updates"], "early stop at another update");
    let rows = |v: &Value| -> Vec<f64> {
        v["loss_history"]
            .as_array()
            .unwrap()
            .iter()
            .flat_map(|r| r.as_array().unwrap().iter().map(|x| x.as_f64().unwrap()))
            .collect()
    };
    for (a, b) in rows(&hs).iter().zip(rows(&hm)) {
        assert!((a - b).abs() <= 1e-6 * a.abs(), "mpi logs {b}, serial {a}");
    }
}

/// The memory check counts the MPI ranks on this node: a run where one rank fits but two do
/// not is refused before any output, by one clean message (no MPI_Abort).
#[test]
fn mpi_memory_check_counts_the_ranks_on_this_node() {
    let dir = tempfile::tempdir().unwrap();
    let avail = lockstep_core::memory::available_bytes().expect("Linux reports MemAvailable");
    let training = json!({"optimizer_updates": 2});
    let model = json!({"memory_per_sample": avail / 10 * 6 / 4});
    let cfg = write_config_with(
        dir.path(),
        "out",
        4,
        json!({"strategy": "mpi"}),
        true,
        training,
        model,
    );
    let out = mpirun(2, &cfg, &[]);
    let text = out.all_output();
    assert!(out.code != Some(0) && out.elapsed < LIMIT, "{text}");
    assert!(
        text.contains("x 2 MPI ranks on this node") && text.contains("run.batch_size"),
        "{text}"
    );
    assert_eq!(text.matches("this training run needs").count(), 1, "{text}");
    assert!(!text.contains("MPI_ABORT"), "{text}");
    assert!(!dir.path().join("out").exists());
}
