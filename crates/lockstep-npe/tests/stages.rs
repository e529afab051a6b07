//! `lockstep npe train`'s stages ([`train_stages`]): every stage validated before the first
//! trains, errors naming the settings keys as written (also when training goes NaN, which
//! run.log records), and resumes of runs of several stages: relative paths, a checkpoint
//! that ends a stage continuing with the next one (equal to the uninterrupted run), a stage
//! appended to a finished run, and a finished last stage refused with an NPE message.

use lockstep_comm::World;
use lockstep_npe::stages::{train_stages, TrainRequest};
use lockstep_npe::NpeError;
use lockstep_train::checkpoint;
use std::path::{Path, PathBuf};

/// gaussian_linear in 2 dimensions, a tiny network; `stages` is the `training` section's
/// stages (indented by 2).
fn settings(stages: &str) -> String {
    format!(
        "data:
  task: {{name: gaussian_linear, dim: 2}}
  num_samples: 300
  train_fraction: 0.8
  seed: 3
model:
  posterior_kwargs:
    num_flow_steps: 1
    base_transform_kwargs: {{hidden_dim: 8, num_transform_blocks: 1, tail_bound: 3.0}}
  embedding_kwargs: {{output_dim: 4, hidden_dims: [8]}}
training:
{stages}local:
  checkpoint_epochs: 1
  log_every: 1000
"
    )
}

const STAGE_0: &str = "  stage_0:
    epochs: 2
    batch_size: 60
    optimizer: {type: adam, lr: 0.003}
";
const STAGE_1: &str = "  stage_1:
    epochs: 2
    batch_size: 120
    optimizer: {type: adamw, lr: 0.001}
    freeze: [embedding_net]
";

fn write(dir: &Path, name: &str, text: &str) -> PathBuf {
    let p = dir.join(name);
    std::fs::write(&p, text).unwrap();
    p
}

fn train(settings: &Path, train_dir: &Path, resume: Option<&Path>) -> Result<(), NpeError> {
    let world = World::init(lockstep_comm::launch::ComputeKind::Cpu, true).unwrap();
    train_stages(
        &TrainRequest {
            settings_file: settings.to_path_buf(),
            train_dir: train_dir.to_path_buf(),
            overwrite: false,
            resume: resume.map(Path::to_path_buf),
            force_cpu: false,
            overrides: Default::default(),
        },
        &world,
    )
    .map(drop)
}

/// An error with all its causes, as `lockstep` prints it.
fn full(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut cur = e.source();
    while let Some(c) = cur {
        s.push_str(": ");
        s.push_str(&c.to_string());
        cur = c.source();
    }
    s
}

/// The trainable values of a run directory's latest checkpoint.
fn trainable(run_dir: &Path) -> Vec<f32> {
    checkpoint::read(&checkpoint::resolve(run_dir).unwrap())
        .unwrap()
        .trainable
}

#[test]
fn every_stage_is_checked_before_the_first_trains_with_keys_as_written() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    // A later stage that freezes every block: refused before stage 0 trains.
    let all = STAGE_1.replace("[embedding_net]", "[embedding_net, flow]");
    let f = write(d, "all.yaml", &settings(&format!("{STAGE_0}{all}")));
    let e = full(&train(&f, &d.join("all"), None).unwrap_err());
    assert!(
        e.contains("all.yaml: training.stage_1.freeze") && e.contains("nothing to train"),
        "{e}"
    );
    assert!(!e.contains("edges"), "{e}");
    assert!(!d.join("all").exists(), "output written before refusing");
    // Data beyond float32's range is refused naming the data, before any output (it used
    // to go NaN and blame the learning rate).
    let f = write(
        d,
        "huge.yaml",
        &settings(STAGE_0).replace(
            "{name: gaussian_linear, dim: 2}",
            "{name: gaussian_linear, dim: 2, prior_scale: 1.0e+300}",
        ),
    );
    let e = full(&train(&f, &d.join("huge"), None).unwrap_err());
    assert!(
        e.contains("huge.yaml: data.task: gaussian_linear: the simulated θ component theta_0")
            && e.contains("beyond float32's range")
            && !e.contains("learning"),
        "{e}"
    );
    assert!(!d.join("huge").exists());
    // Optimizer values are refused by the keys the settings file has.
    for (from, to, key) in [
        ("lr: 0.001}", "lr: 0.0}", "training.stage_1.optimizer.lr"),
        (
            "lr: 0.001}",
            "lr: 1.0e-50}",
            "training.stage_1.optimizer.lr",
        ),
        (
            "lr: 0.001}",
            "lr: 0.001, betas: [1.5, 0.9]}",
            "training.stage_1.optimizer.betas",
        ),
        (
            "lr: 0.001}",
            "lr: 0.001, eps: 0.0}",
            "training.stage_1.optimizer.eps",
        ),
        (
            "lr: 0.001}",
            "lr: 0.001, weight_decay: 3.0}",
            "training.stage_1.optimizer.weight_decay",
        ),
        (
            "{type: adamw, lr: 0.001}",
            "{type: sgd, lr: 0.001, momentum: 1.5}",
            "training.stage_1.optimizer.momentum",
        ),
    ] {
        let f = write(
            d,
            "opt.yaml",
            &settings(&format!("{STAGE_0}{}", STAGE_1.replace(from, to))),
        );
        let e = full(&train(&f, &d.join("opt"), None).unwrap_err());
        assert!(e.contains(&format!("opt.yaml: {key}: ")), "{to}: {e}");
        for engine_key in [
            "learning_rate",
            "beta1",
            "beta2",
            "epsilon",
            "training.optimizer",
        ] {
            assert!(!e.contains(engine_key), "{to}: {e}");
        }
        assert!(!d.join("opt").exists());
    }
}

#[test]
fn a_stage_that_goes_nan_names_the_settings_key_and_run_log_records_why() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let f = write(
        d,
        "nan.yaml",
        &settings(&STAGE_0.replace("lr: 0.003", "lr: 1.0e+30")),
    );
    let e = train(&f, &d.join("nan"), None).unwrap_err();
    let m = full(&e);
    assert!(
        m.contains("nan.yaml: training.stage_0")
            && m.contains("lower training.stage_0.optimizer.lr (now "),
        "{m}"
    );
    assert!(!m.contains("training.optimizer.learning_rate"), "{m}");
    let log = std::fs::read_to_string(d.join("nan/run.log")).unwrap();
    assert!(
        log.contains("stopped: ") && log.contains("training.stage_0.optimizer.lr"),
        "{log}"
    );
}

/// Resumes of a run of two stages (and of a one-stage run given a second stage), with
/// relative paths as the README writes them; each ends equal to the uninterrupted run.
#[test]
fn staged_runs_resume_with_relative_paths_and_continue_after_a_finished_stage() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    // The only test of this binary that depends on the current directory.
    std::env::set_current_dir(d).unwrap();
    let two = write(d, "two.yaml", &settings(&format!("{STAGE_0}{STAGE_1}")));
    write(d, "one.yaml", &settings(STAGE_0));
    // The uninterrupted run: 240 training simulations, stage 0 has 2 epochs of 4 updates,
    // stage 1 2 epochs of 2 updates.
    train(Path::new("two.yaml"), Path::new("full"), None).unwrap();
    let end = trainable(&d.join("full/stage_1"));
    let copy = |from: &str, to: &str| {
        let status = std::process::Command::new("cp")
            .args(["-a", from, to])
            .current_dir(d)
            .status()
            .unwrap();
        assert!(status.success());
    };
    // (a) A mid-stage checkpoint named by a relative path, resumed in place.
    copy("full", "mid");
    let e = train(
        Path::new("two.yaml"),
        Path::new("mid"),
        Some(Path::new(
            "mid/stage_1/checkpoints/update_000002.safetensors",
        )),
    );
    e.unwrap();
    assert_eq!(trainable(&d.join("mid/stage_1")), end);
    // `--resume DIR` with a relative folder of stages.
    copy("full", "dirres");
    std::fs::remove_file(d.join("dirres/stage_1/checkpoints/update_000004.safetensors")).unwrap();
    std::fs::write(
        d.join("dirres/stage_1/checkpoints/latest"),
        "update_000002.safetensors",
    )
    .unwrap();
    train(
        Path::new("two.yaml"),
        Path::new("dirres"),
        Some(Path::new("dirres")),
    )
    .unwrap();
    assert_eq!(trainable(&d.join("dirres/stage_1")), end);
    // (b) Killed after stage 0 ended, before stage 1 wrote a checkpoint: `--resume DIR`
    // continues with stage 1 from stage 0's last checkpoint.
    copy("full", "between");
    std::fs::remove_dir_all(d.join("between/stage_1/checkpoints")).unwrap();
    train(
        Path::new("two.yaml"),
        Path::new("between"),
        Some(Path::new("between")),
    )
    .unwrap();
    assert_eq!(trainable(&d.join("between/stage_1")), end);
    let log = std::fs::read_to_string(d.join("between/stage_1/run.log")).unwrap();
    assert!(log.contains("training.stage_1 starts from"), "{log}");
    // A finished last stage: nothing to train, said in NPE terms.
    let e = full(
        &train(
            Path::new("two.yaml"),
            Path::new("full"),
            Some(Path::new("full")),
        )
        .unwrap_err(),
    );
    assert!(
        e.contains("the last stage of two.yaml") && e.contains("add a training.stage_2"),
        "{e}"
    );
    assert!(
        !e.contains("lockstep train") && !e.contains("--updates"),
        "{e}"
    );
    // (c) A stage appended to a finished one-stage run: trains in a new --train-dir and
    // ends as the run that had both stages from the start; in the one-stage run's own
    // folder it is refused with an NPE message.
    train(Path::new("one.yaml"), Path::new("single"), None).unwrap();
    assert_eq!(
        trainable(&d.join("single")),
        trainable(&d.join("full/stage_0"))
    );
    let e = full(
        &train(
            Path::new("one.yaml"),
            Path::new("single"),
            Some(Path::new("single")),
        )
        .unwrap_err(),
    );
    assert!(e.contains("add a training.stage_1"), "{e}");
    let e = full(
        &train(
            Path::new("two.yaml"),
            Path::new("single"),
            Some(Path::new("single")),
        )
        .unwrap_err(),
    );
    assert!(e.contains("pass another --train-dir"), "{e}");
    train(
        Path::new("two.yaml"),
        Path::new("appended"),
        Some(Path::new("single")),
    )
    .unwrap();
    assert!(!d.join("appended/stage_0").exists());
    assert_eq!(trainable(&d.join("appended/stage_1")), end);
    // Settings that changed the finished stage are refused.
    let other = write(
        d,
        "other.yaml",
        &std::fs::read_to_string(&two)
            .unwrap()
            .replace("lr: 0.003", "lr: 0.002"),
    );
    let e = full(&train(&other, Path::new("other"), Some(Path::new("single"))).unwrap_err());
    assert!(
        e.contains("in training.stage_0.optimizer.lr (0.003 there, 0.002 here)"),
        "{e}"
    );
}
