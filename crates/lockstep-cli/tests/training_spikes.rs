//! `output.training_spikes`: a training run writes the spikes of one training trial (the
//! first sample of the global batch) at the chosen updates as SONATA spike files, serially,
//! with thread replicas and with MPI replicas; they are the spikes the model computes for
//! that sample with that update's weights; `lockstep plot RUN_DIR` draws the latest of them;
//! bad keys are refused before anything is written.

use lockstep_comm::launch::{mpirun_command, run_with_limit, JobOutput};
use serde_json::{json, Value};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

const LOCKSTEP: &str = env!("CARGO_BIN_EXE_lockstep");

fn example() -> PathBuf {
    std::path::absolute(
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../examples/glif_all2all"),
    )
    .unwrap()
}

/// A 3-update config on the example network (global batch 4 of 40-step trials) recording
/// the training trials of `spikes`, with a checkpoint after every update.
fn config(dir: &Path, name: &str, batch: usize, dist: Value, spikes: Value) -> PathBuf {
    let ex = example();
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
            "optimizer_updates": 3,
            "checkpoint_every": 1,
            "losses": [{"name": "TargetFiringRate", "firing_rate": ex.join("target_rates.csv")}],
        },
        "output": {"output_dir": dir.join(name), "overwrite_output_dir": true,
                   "training_spikes": spikes},
    });
    let path = dir.join(format!("{name}.json"));
    std::fs::write(&path, serde_json::to_string_pretty(&c).unwrap()).unwrap();
    path
}

fn run(cmd: Command) -> JobOutput {
    run_with_limit(cmd, Duration::from_secs(300)).unwrap()
}

fn lockstep(args: &[&std::ffi::OsStr]) -> JobOutput {
    let mut cmd = Command::new(LOCKSTEP);
    cmd.args(args);
    run(cmd)
}

fn ok(out: JobOutput) -> JobOutput {
    assert!(out.success(), "{}", out.all_output());
    out
}

/// The spikes of a file as sorted `(node_id, time in ms)` pairs of population `v1`.
fn spikes_of(path: &Path) -> Vec<(u64, f64)> {
    let trains = lockstep_sonata::read_spikes(path).unwrap();
    assert_eq!(trains.populations.len(), 1, "{}", path.display());
    let p = &trains.populations[0];
    assert_eq!(p.population, "v1");
    let mut s: Vec<(u64, f64)> = p
        .node_ids
        .iter()
        .copied()
        .zip(p.timestamps.clone())
        .collect();
    s.sort_by(|a, b| a.0.cmp(&b.0).then(a.1.total_cmp(&b.1)));
    s
}

/// What the model computes for global sample `sample` with the weights of the run's
/// checkpoint after `update` updates (a batch of that one sample), as `spikes_of` pairs.
fn model_spikes(config: &Path, run_dir: &Path, update: u64, sample: u64) -> Vec<(u64, f64)> {
    let (_, mut model) = lockstep_snn::model_from_config(config).unwrap();
    let params = if update == 0 {
        model.initial_params()
    } else {
        let ckpt = run_dir.join(format!("checkpoints/update_{update:06}.safetensors"));
        lockstep_train::checkpoint::read(&ckpt).unwrap().trainable
    };
    model.opts.record_first_sample = true;
    model.opts.parallel = false;
    let r = model.loss_and_grad(&params, sample, 1).unwrap();
    let dt = model.net.grid.dt;
    let mut s: Vec<(u64, f64)> = r
        .first_spikes
        .unwrap()
        .iter()
        .map(|&(step, e)| {
            (
                model.net.neurons[e as usize].node_id,
                (step + 1) as f64 * dt,
            )
        })
        .collect();
    s.sort_by(|a, b| a.0.cmp(&b.0).then(a.1.total_cmp(&b.1)));
    s
}

fn recorded(run_dir: &Path) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(run_dir.join("spikes"))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    names
}

#[test]
fn training_writes_the_first_samples_spikes_at_chosen_updates_and_plot_draws_them() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let chosen = json!({"updates": [0, 2]});
    let serial = config(d, "serial", 4, Value::Null, chosen.clone());
    let threads = config(
        d,
        "threads",
        2,
        json!({"strategy": "threads", "global_batch_size": 4}),
        chosen.clone(),
    );
    let mpi = config(
        d,
        "mpi",
        2,
        json!({"strategy": "mpi", "global_batch_size": 4}),
        chosen,
    );
    ok(lockstep(&["train".as_ref(), serial.as_os_str()]));
    ok(lockstep(&["train".as_ref(), threads.as_os_str()]));
    let mut cmd = mpirun_command(2);
    cmd.arg(LOCKSTEP).arg("train").arg(&mpi);
    ok(run(cmd));

    let want = ["update_000000.h5", "update_000002.h5"];
    for name in ["serial", "threads", "mpi"] {
        assert_eq!(recorded(&d.join(name)), want, "{name}");
    }
    // Update 0: every run simulates sample 0 with the initial weights, so every file is the
    // model's trial of sample 0, and it is not empty.
    let first = model_spikes(&serial, &d.join("serial"), 0, 0);
    assert!(
        first.len() > 20,
        "too few spikes to compare: {}",
        first.len()
    );
    for name in ["serial", "threads", "mpi"] {
        let got = spikes_of(&d.join(name).join("spikes/update_000000.h5"));
        assert_eq!(got, first, "{name}: update 0");
    }
    // Update 2: the first sample of the third update (global index 2 x 4 = 8) with the
    // weights after 2 updates, as each run's own checkpoint holds them.
    for (name, cfg) in [("serial", &serial), ("threads", &threads), ("mpi", &mpi)] {
        let run_dir = d.join(name);
        let got = spikes_of(&run_dir.join("spikes/update_000002.h5"));
        assert_eq!(got, model_spikes(cfg, &run_dir, 2, 8), "{name}: update 2");
        assert_ne!(got, first, "{name}: update 2 repeats update 0");
    }
    let log = std::fs::read_to_string(d.join("serial/run.log")).unwrap();
    assert!(log.contains("update 2: wrote"), "{log}");

    // `plot RUN_DIR` draws the losses and a raster of the latest recorded training trial.
    let out = ok(lockstep(&["plot".as_ref(), d.join("serial").as_os_str()]));
    let png = d.join("serial/plots/training_raster.png");
    assert!(
        out.stdout.contains(&format!("wrote {}", png.display())),
        "{}",
        out.stdout
    );
    let bytes = std::fs::read(&png).unwrap();
    assert!(bytes.starts_with(b"\x89PNG") && bytes.len() > 5_000);
    assert!(d.join("serial/plots/losses.png").is_file());

    // `every`: updates 0 and 2 of 3 with every 2.
    let every = config(d, "every", 4, Value::Null, json!({"every": 2}));
    ok(lockstep(&["train".as_ref(), every.as_os_str()]));
    assert_eq!(recorded(&d.join("every")), want);
}

#[test]
fn bad_training_spikes_keys_are_refused_before_any_output() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    for (i, (spikes, key, text)) in [
        (
            json!({"update": [0]}),
            "output.training_spikes.update",
            "did you mean `updates`",
        ),
        (
            json!({"updates": [1, 3]}),
            "output.training_spikes.updates",
            "update 3 is not below the run's 3 updates",
        ),
        (
            json!({"updates": [0], "every": 2}),
            "output.training_spikes",
            "both `updates` and `every`",
        ),
        (
            json!({"every": 0}),
            "output.training_spikes.every",
            "at least 1",
        ),
        (
            json!({"updates": "all"}),
            "output.training_spikes.updates",
            "invalid type",
        ),
    ]
    .into_iter()
    .enumerate()
    {
        let name = format!("bad{i}");
        let c = config(d, &name, 2, Value::Null, spikes);
        let out = lockstep(&["train".as_ref(), c.as_os_str()]);
        assert!(!out.success(), "{key} accepted");
        let want = format!("{}: {key}: ", c.display());
        assert!(
            out.stderr.contains(&want) && out.stderr.contains(text),
            "{key}: {}",
            out.stderr
        );
        assert!(!d.join(&name).exists(), "{key}: output written");
    }
}
