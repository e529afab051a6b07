//! `lockstep train` end to end on the bundled glif_all2all network with a reduced schedule:
//! serial, thread replicas and MPI replicas give the same update (invariants 4-5), trained
//! weights are exported as SONATA edges, and the run can be resumed.

use lockstep_comm::launch::mpirun_command;
use lockstep_comm::launch::{run_with_limit, JobOutput};
use serde_json::{json, Value};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

const LOCKSTEP: &str = env!("CARGO_BIN_EXE_lockstep");

fn example() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../examples/glif_all2all")
}

/// A short training config on the example network: `batch` samples per replica of 40 steps.
fn config(dir: &Path, name: &str, batch: usize, dist: Value) -> PathBuf {
    let ex = std::path::absolute(example()).unwrap();
    let mut run = json!({"dt": 1.0, "seq_len": 40, "batch_size": batch, "seed": 77});
    if !dist.is_null() {
        run["distribution"] = dist;
    }
    let c = json!({
        "network": ex.join("config.circuit.json"),
        "inputs": {"lgn": {"input_type": "poisson", "rate": 20.0, "node_set": "lgn"}},
        "run": run,
        "training": {
            "optimizer": {"name": "adam", "learning_rate": 0.01},
            "optimizer_updates": 2,
            "losses": [{"name": "TargetFiringRate", "firing_rate": ex.join("target_rates.csv")}],
            "checksum_every": 1,
        },
        "output": {"output_dir": dir.join(name), "overwrite_output_dir": true},
    });
    let path = dir.join(format!("{name}.json"));
    std::fs::write(&path, serde_json::to_string_pretty(&c).unwrap()).unwrap();
    path
}

fn ok(out: JobOutput) -> JobOutput {
    assert!(out.success(), "{}", out.all_output());
    out
}

fn lockstep(args: &[&str]) -> JobOutput {
    let mut cmd = Command::new(LOCKSTEP);
    cmd.args(args);
    run_with_limit(cmd, Duration::from_secs(300)).unwrap()
}

fn trained(dir: &Path, name: &str) -> Vec<f32> {
    let ckpt = dir.join(name).join("checkpoints/update_000002.safetensors");
    lockstep_train::checkpoint::read(&ckpt).unwrap().trainable
}

fn rel_l2(a: &[f32], b: &[f32]) -> f64 {
    let num: f64 = a.iter().zip(b).map(|(x, y)| ((x - y) as f64).powi(2)).sum();
    let den: f64 = b.iter().map(|y| (*y as f64).powi(2)).sum();
    (num / den).sqrt()
}

#[test]
fn serial_threads_and_mpi_replicas_train_identically() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let serial = config(d, "serial", 4, Value::Null);
    let threads = config(
        d,
        "threads",
        2,
        json!({"strategy": "threads", "global_batch_size": 4}),
    );
    let mpi = config(
        d,
        "mpi",
        2,
        json!({"strategy": "mpi", "global_batch_size": 4}),
    );
    let s = ok(lockstep(&["train", serial.to_str().unwrap()]));
    assert!(
        s.stdout.contains("Completed 2 optimizer updates."),
        "{}",
        s.stdout
    );
    ok(lockstep(&["train", threads.to_str().unwrap()]));
    let mut cmd = mpirun_command(2);
    cmd.arg(LOCKSTEP).arg("train").arg(&mpi);
    let m = ok(run_with_limit(cmd, Duration::from_secs(300)).unwrap());
    assert_eq!(
        m.stdout.matches("Completed 2 optimizer updates.").count(),
        1
    );

    let (ws, wt, wm) = (
        trained(d, "serial"),
        trained(d, "threads"),
        trained(d, "mpi"),
    );
    let w0 =
        lockstep_train::checkpoint::read(&d.join("serial/checkpoints/update_000002.safetensors"))
            .unwrap();
    assert_eq!(ws.len(), 89_700);
    assert!(
        rel_l2(&wt, &ws) <= 1e-6,
        "threads vs serial: {}",
        rel_l2(&wt, &ws)
    );
    assert!(
        rel_l2(&wm, &ws) <= 1e-6,
        "mpi vs serial: {}",
        rel_l2(&wm, &ws)
    );
    assert_eq!(w0.update, 2);

    // The loss logs agree to 6 significant digits.
    let losses = |n: &str| std::fs::read_to_string(d.join(n).join("callbacks/losses.csv")).unwrap();
    let parse = |t: String| -> Vec<f64> {
        t.lines()
            .skip(1)
            .map(|l| l.split(',').next_back().unwrap().parse().unwrap())
            .collect()
    };
    for (a, b) in parse(losses("serial")).iter().zip(parse(losses("mpi"))) {
        assert_eq!(format!("{a:.5e}"), format!("{b:.5e}"));
    }

    // Trained weights are SONATA edges files that lockstep simulate can use.
    for f in ["network/v1_v1_edges.h5", "network/lgn_v1_edges.h5"] {
        assert!(d.join("serial").join(f).exists(), "{f} not exported");
    }
}

#[test]
fn resume_continues_from_a_checkpoint() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let c = config(d, "first", 2, Value::Null);
    ok(lockstep(&["train", c.to_str().unwrap()]));
    let ckpt = d.join("first/checkpoints/update_000002.safetensors");
    let out = ok(lockstep(&[
        "train",
        c.to_str().unwrap(),
        "--updates",
        "3",
        "--resume",
        ckpt.to_str().unwrap(),
        "--output-dir",
        d.join("resumed").to_str().unwrap(),
    ]));
    assert!(out.stdout.contains("updates 2..3"), "{}", out.stdout);
    assert!(out.stdout.contains("Completed 3 optimizer updates."));
}

#[test]
fn bad_training_configs_fail_before_any_output() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let c = config(d, "typo", 2, Value::Null);
    let mut v: Value = serde_json::from_str(&std::fs::read_to_string(&c).unwrap()).unwrap();
    v["training"]["optimiser"] = json!({"name": "adam"});
    std::fs::write(&c, v.to_string()).unwrap();
    let out = lockstep(&["train", c.to_str().unwrap()]);
    assert!(!out.success());
    assert!(
        out.stderr.contains("training.optimiser")
            && out.stderr.contains("did you mean `optimizer`"),
        "{}",
        out.stderr
    );
    // A serial run has no ranks to name.
    assert!(
        out.stderr.contains("lockstep: error: ") && !out.stderr.contains("rank"),
        "{}",
        out.stderr
    );
    assert!(!d.join("typo").exists());

    let c = config(d, "input_typo", 2, Value::Null);
    let mut v: Value = serde_json::from_str(&std::fs::read_to_string(&c).unwrap()).unwrap();
    v["inputs"]["lgn"]["rat"] = v["inputs"]["lgn"]["rate"].take();
    v["inputs"]["lgn"].as_object_mut().unwrap().remove("rate");
    std::fs::write(&c, v.to_string()).unwrap();
    let out = lockstep(&["train", c.to_str().unwrap()]);
    assert!(
        out.stderr.contains("inputs.lgn.rat") && out.stderr.contains("did you mean `rate`"),
        "{}",
        out.stderr
    );
    assert!(!d.join("input_typo").exists());

    // A misspelled input population: the message lists the network's virtual populations.
    let c = config(d, "population_typo", 2, Value::Null);
    let mut v: Value = serde_json::from_str(&std::fs::read_to_string(&c).unwrap()).unwrap();
    v["inputs"]["lgn"]["node_set"] = json!("LGN");
    std::fs::write(&c, v.to_string()).unwrap();
    let out = lockstep(&["train", c.to_str().unwrap()]);
    assert!(
        !out.success()
            && out.stderr.contains("inputs.lgn.node_set")
            && out.stderr.contains("'LGN' has no virtual nodes")
            && out.stderr.contains("the network's: 'lgn'"),
        "{}",
        out.stderr
    );
    assert!(!d.join("population_typo").exists());

    // A network that a recipe beside the config builds, not built yet: the message gives the
    // `lockstep build-network` command.
    let c = config(d, "not_built", 2, Value::Null);
    let mut v: Value = serde_json::from_str(&std::fs::read_to_string(&c).unwrap()).unwrap();
    v["network"] = json!(d.join("full/config.circuit.json"));
    std::fs::write(&c, v.to_string()).unwrap();
    std::fs::write(d.join("network_recipe.json"), "{}").unwrap();
    let out = lockstep(&["train", c.to_str().unwrap()]);
    assert!(
        !out.success()
            && out.stderr.contains("does not exist: build it first")
            && out
                .stderr
                .contains("lockstep build-network RECIPE --output")
            && out.stderr.contains("network_recipe.json"),
        "{}",
        out.stderr
    );
    assert!(!d.join("not_built").exists());
    std::fs::remove_file(d.join("network_recipe.json")).unwrap();

    let c = config(d, "mpi_alone", 2, json!({"strategy": "mpi"}));
    let out = lockstep(&["train", c.to_str().unwrap()]);
    assert!(
        !out.success() && out.stderr.contains("not started by mpirun"),
        "{}",
        out.stderr
    );
    assert!(!d.join("mpi_alone").exists());

    // A serial config under mpirun: refused once, by the chief, and the ranks leave through
    // the launcher without an MPI abort (no Open MPI abort or unpack noise).
    let c = config(d, "serial_under_mpirun", 2, Value::Null);
    let mut cmd = mpirun_command(2);
    cmd.arg(LOCKSTEP).arg("train").arg(&c);
    let out = run_with_limit(cmd, Duration::from_secs(60)).unwrap();
    let text = out.all_output();
    assert!(!out.success() && !out.timed_out, "{text}");
    assert_eq!(
        text.matches("launched by Open MPI (mpirun) with 2 ranks")
            .count(),
        1,
        "{text}"
    );
    assert!(
        !text.contains("MPI_ABORT") && !text.contains("unpack"),
        "{text}"
    );
    assert!(!d.join("serial_under_mpirun").exists());
}

/// With `output.overwrite_output_dir`, a second run into the same folder replaces the first
/// and says so on stdout and in its log; the first run says nothing of the kind.
#[test]
fn replacing_an_earlier_run_is_said() {
    let dir = tempfile::tempdir().unwrap();
    let c = config(dir.path(), "again", 2, Value::Null);
    let said = "Replaced the earlier lockstep run in";
    let first = ok(lockstep(&["train", c.to_str().unwrap(), "--updates", "1"]));
    assert!(!first.stdout.contains(said), "{}", first.stdout);
    let second = ok(lockstep(&["train", c.to_str().unwrap(), "--updates", "1"]));
    assert!(second.stdout.contains(said), "{}", second.stdout);
    let log = std::fs::read_to_string(dir.path().join("again/run.log")).unwrap();
    assert!(
        log.contains(said) && log.contains("overwrite_output_dir"),
        "{log}"
    );
}

/// `--resume` takes a run directory or its `checkpoints/latest` pointer; a run that already
/// has the updates asked for is refused without touching it; the run's resolved
/// `config.json` trains again as it is.
#[test]
fn resume_from_a_run_directory_and_rerun_its_config() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let c = config(d, "first", 2, Value::Null);
    ok(lockstep(&["train", c.to_str().unwrap()]));
    let run_dir = d.join("first");
    for (name, resume) in [
        ("from_dir", run_dir.clone()),
        ("from_latest", run_dir.join("checkpoints/latest")),
    ] {
        let out = ok(lockstep(&[
            "train",
            c.to_str().unwrap(),
            "--updates",
            "3",
            "--resume",
            resume.to_str().unwrap(),
            "--output-dir",
            d.join(name).to_str().unwrap(),
        ]));
        assert!(
            out.stdout.contains("updates 2..3"),
            "{name}: {}",
            out.stdout
        );
        assert!(
            out.stdout.contains("Completed 3 optimizer updates."),
            "{name}"
        );
    }
    let before = std::fs::read(run_dir.join("config.json")).unwrap();
    let out = lockstep(&[
        "train",
        c.to_str().unwrap(),
        "--updates",
        "1",
        "--resume",
        run_dir.to_str().unwrap(),
    ]);
    assert!(!out.success());
    assert!(
        out.stderr.contains("already has 2 updates") && out.stderr.contains("optimizer_updates"),
        "{}",
        out.all_output()
    );
    assert!(!out.stdout.contains("updates 2..1"), "{}", out.stdout);
    assert_eq!(std::fs::read(run_dir.join("config.json")).unwrap(), before);

    // The resolved config of the run, passed back from another working directory.
    let resolved = run_dir.join("config.json");
    let mut cmd = Command::new(LOCKSTEP);
    cmd.current_dir(d.join("from_dir")).args([
        "train",
        resolved.to_str().unwrap(),
        "--output-dir",
        d.join("again").to_str().unwrap(),
    ]);
    let out = ok(run_with_limit(cmd, Duration::from_secs(300)).unwrap());
    assert!(
        out.stdout.contains("Completed 2 optimizer updates."),
        "{}",
        out.stdout
    );
    assert_eq!(
        trained(d, "again"),
        trained(d, "first"),
        "the resolved config trains differently"
    );
}
