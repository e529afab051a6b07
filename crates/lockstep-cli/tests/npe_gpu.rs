//! `lockstep npe` with `local.device: gpu` (burn's wgpu backend on the adapter lockstep-gpu
//! selects), on the machine's Vulkan adapter: Mesa's software driver lavapipe in CI. No
//! adapter is a failure of these tests, never a skip.
//!
//! - gaussian_linear trains on the GPU with the CPU run's losses (1e-4 relative, 10 updates
//!   from the same initial parameters);
//! - 2 MPI ranks on the GPU with local batch B train like 1 rank with 2B (LayerNorm and
//!   SyncBatchNorm), the two ranks sharing the one adapter, which the run says;
//! - a checkpoint written on the GPU resumes on the CPU and the reverse;
//! - `npe sample` and `npe pp` take `--device`;
//! - no adapter, or `cuda` in a build without CUDA, stops before any output naming the fix;
//! - mixed precision (`automatic_mixed_precision`, float16 on the adapter) trains like
//!   float32 to f16's rounding, an overflowing loss scale skips updates and backs off, a
//!   resumed run restores the scaler, and the CPU and an adapter without float16
//!   (`LOCKSTEP_GPU_HIDE_FEATURES=SHADER_F16`) refuse it before any output;
//! - `lockstep bench npe --device gpu` reports the step, mixed precision, the kernel
//!   launches per step (at most the bound this code reaches) and one host synchronisation
//!   per step;
//! - the posterior trained on the GPU, in float32 and in mixed precision, has the analytic
//!   mean and covariance of gaussian_linear and passes the P-P test, like the CPU run.

use lockstep_comm::launch::{mpirun_command, run_with_limit, JobOutput};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

const LOCKSTEP: &str = env!("CARGO_BIN_EXE_lockstep");

/// gaussian_linear settings in `dim` dimensions (a small flow: 2 steps, width 16) on
/// `device`; 356 simulations x 0.9 = 320 training simulations.
fn settings(
    dim: usize,
    norm: &str,
    epochs: u64,
    batch: usize,
    device: &str,
    local: &str,
) -> String {
    let optimizer = if norm == "batch_norm" {
        // The bias before a BatchNorm layer has a gradient of 0 up to rounding, which Adam
        // scales up to steps of ±lr: SGD keeps the comparison about the backend.
        "{type: sgd, lr: 0.01, momentum: 0.9}"
    } else {
        "{type: adam, lr: 0.003}"
    };
    format!(
        "data:
  task: {{name: gaussian_linear, dim: {dim}}}
  num_samples: 356
  train_fraction: 0.9
  seed: 5
model:
  posterior_model_type: normalizing_flow
  posterior_kwargs:
    num_flow_steps: 2
    base_transform_kwargs:
      hidden_dim: 16
      num_transform_blocks: 1
      activation: elu
      dropout_probability: 0.0
      norm: {norm}
      num_bins: 8
      base_transform_type: rq-coupling
      tail_bound: 3.0
  embedding_kwargs:
    output_dim: 8
    hidden_dims: [16, 16]
    activation: elu
    dropout: 0.0
    norm: {norm}
training:
  stage_0:
    epochs: {epochs}
    batch_size: {batch}
    optimizer: {optimizer}
local:
  device: {device}
{local}"
    )
}

fn write(dir: &Path, name: &str, text: &str) -> PathBuf {
    let p = dir.join(name);
    std::fs::write(&p, text).unwrap();
    p
}

fn lockstep(args: &[&str]) -> JobOutput {
    let mut cmd = Command::new(LOCKSTEP);
    cmd.args(args);
    run_with_limit(cmd, Duration::from_secs(120)).unwrap()
}

fn ok(out: JobOutput) -> JobOutput {
    assert!(out.success(), "{}", out.all_output());
    out
}

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

fn rel_l2(a: &[f32], b: &[f32]) -> f64 {
    assert_eq!(a.len(), b.len());
    let num: f64 = a.iter().zip(b).map(|(x, y)| ((x - y) as f64).powi(2)).sum();
    let den: f64 = b.iter().map(|y| (*y as f64).powi(2)).sum();
    (num / den).sqrt()
}

/// Trainable and frozen values (running statistics included) of checkpoint `update`.
fn values(run: &Path, update: u64) -> Vec<f32> {
    let state = lockstep_train::checkpoint::read(
        &run.join(format!("checkpoints/update_{update:06}.safetensors")),
    )
    .unwrap();
    [state.trainable, state.frozen].concat()
}

/// The per-update losses of a run (`callbacks/losses.csv`).
fn losses(run: &Path) -> Vec<f64> {
    std::fs::read_to_string(run.join("callbacks/losses.csv"))
        .unwrap()
        .lines()
        .skip(1)
        .map(|l| l.rsplit(',').next().unwrap().parse().unwrap())
        .collect()
}

/// gaussian_linear (dim 2 and 3) trains on the GPU with the CPU's losses, update by update
/// (1e-4 relative), from the same initial parameters; the run names its adapter.
#[test]
fn gpu_training_gives_the_cpu_losses() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    for dim in [2, 3] {
        let (rc, rg) = (d.join(format!("cpu{dim}")), d.join(format!("gpu{dim}")));
        let cpu = write(
            d,
            "cpu.yaml",
            &settings(dim, "layer_norm", 1, 32, "cpu", ""),
        );
        let gpu = write(
            d,
            "gpu.yaml",
            &settings(dim, "layer_norm", 1, 32, "gpu", ""),
        );
        ok(lockstep(&["npe", "train", s(&cpu), "--train-dir", s(&rc)]));
        let out = ok(lockstep(&["npe", "train", s(&gpu), "--train-dir", s(&rg)]));
        assert!(
            out.stderr.contains("rank 0: computes on GPU adapter"),
            "{}",
            out.all_output()
        );
        let log = std::fs::read_to_string(rg.join("run.log")).unwrap();
        assert!(log.contains("computes on GPU adapter"), "{log}");
        assert!(log.contains("is a software adapter"), "{log}");
        let cpu_out = lockstep(&[
            "npe",
            "train",
            s(&cpu),
            "--train-dir",
            s(&rc),
            "--overwrite",
        ]);
        assert!(!ok(cpu_out).stderr.contains("software adapter"));
        let (lc, lg) = (losses(&rc), losses(&rg));
        assert_eq!((lc.len(), lg.len()), (10, 10));
        for (u, (a, b)) in lc.iter().zip(&lg).enumerate() {
            assert!(
                (a - b).abs() <= 1e-4 * a.abs().max(1e-3),
                "dim {dim}, update {}: cpu {a} gpu {b}",
                u + 1
            );
        }
        let dp = rel_l2(&values(&rg, 10), &values(&rc, 10));
        eprintln!("dim {dim}: parameters gpu vs cpu {dp:e}");
        assert!(dp <= 1e-4, "dim {dim}: parameters gpu vs cpu {dp:e}");
    }
}

/// 2 MPI ranks on the GPU (sharing the one adapter, which each run says) with local batch
/// 16 train like 1 rank with 32 on the GPU: parameters (and SyncBatchNorm's running
/// statistics) to 1e-5 after 10 updates, with LayerNorm and with BatchNorm.
#[test]
fn two_mpi_ranks_on_the_gpu_train_like_one() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    for norm in ["layer_norm", "batch_norm"] {
        let cfg = write(
            d,
            &format!("{norm}.yaml"),
            &settings(3, norm, 1, 32, "gpu", ""),
        );
        let (r1, rm) = (d.join(format!("one_{norm}")), d.join(format!("mpi_{norm}")));
        ok(lockstep(&["npe", "train", s(&cfg), "--train-dir", s(&r1)]));
        let mut cmd = mpirun_command(2);
        cmd.arg(LOCKSTEP)
            .args(["npe", "train", s(&cfg), "--train-dir", s(&rm)]);
        let m = ok(run_with_limit(cmd, Duration::from_secs(120)).unwrap());
        assert!(
            m.stderr.contains("rank 1: computes on GPU adapter")
                && m.stderr.contains("shared with another replica"),
            "{}",
            m.all_output()
        );
        // lavapipe is a software adapter: the chief alone says so, once, with the faster key.
        assert_eq!(
            m.stderr.matches("emulates a GPU on CPU cores").count(),
            1,
            "{}",
            m.all_output()
        );
        assert!(
            m.stderr.contains("local.device: cpu is faster"),
            "{}",
            m.stderr
        );
        let log = std::fs::read_to_string(rm.join("run.log")).unwrap();
        assert!(
            log.contains("2 replica(s)") && log.contains("local batch 16,"),
            "{log}"
        );
        let dm = rel_l2(&values(&rm, 10), &values(&r1, 10));
        eprintln!("{norm}: 2 ranks vs 1 on the GPU {dm:e}");
        assert!(dm <= 1e-5, "{norm}: 2 ranks vs 1 on the GPU {dm:e}");
    }
}

/// A checkpoint written on the GPU resumes on the CPU and one written on the CPU resumes on
/// the GPU: each resumed run ends where the uninterrupted run of the first device ends (to
/// the GPU/CPU rounding difference), and says it resumed.
#[test]
fn checkpoints_resume_across_devices() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    // 320 training simulations / 64 = 5 updates per epoch, 2 epochs, a checkpoint per epoch.
    let cfg = |device: &str| {
        write(
            d,
            &format!("{device}.yaml"),
            &settings(2, "batch_norm", 2, 64, device, "  checkpoint_epochs: 1\n"),
        )
    };
    let (cpu, gpu) = (cfg("cpu"), cfg("gpu"));
    let (rc, rg) = (d.join("cpu"), d.join("gpu"));
    ok(lockstep(&["npe", "train", s(&cpu), "--train-dir", s(&rc)]));
    ok(lockstep(&["npe", "train", s(&gpu), "--train-dir", s(&rg)]));
    for (from, settings, reference, into) in [
        (&rg, &cpu, &rg, d.join("gpu_then_cpu")),
        (&rc, &gpu, &rc, d.join("cpu_then_gpu")),
    ] {
        let mid = from.join("checkpoints/update_000005.safetensors");
        ok(lockstep(&[
            "npe",
            "train",
            s(settings),
            "--train-dir",
            s(&into),
            "--resume",
            s(&mid),
        ]));
        let log = std::fs::read_to_string(into.join("run.log")).unwrap();
        assert!(log.contains("updates 5..10"), "{log}");
        let dr = rel_l2(&values(&into, 10), &values(reference, 10));
        eprintln!("{}: {dr:e}", into.display());
        assert!(dr <= 1e-4, "{}: {dr:e}", into.display());
    }
}

/// `npe sample --device gpu` draws the CPU's samples (same seed, to float rounding) and
/// `npe pp --device gpu` writes its files.
#[test]
fn sample_and_pp_take_a_device() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let cfg = write(d, "s.yaml", &settings(2, "layer_norm", 1, 32, "cpu", ""));
    let run = d.join("run");
    ok(lockstep(&["npe", "train", s(&cfg), "--train-dir", s(&run)]));
    let draw = |device: &str| {
        let out = d.join(format!("{device}.csv"));
        ok(lockstep(&[
            "npe",
            "sample",
            s(&run),
            "--observation",
            "0.3,-0.2",
            "--num-samples",
            "200",
            "--output",
            s(&out),
            "--device",
            device,
        ]));
        std::fs::read_to_string(&out)
            .unwrap()
            .lines()
            .skip(1)
            .flat_map(|l| {
                l.split(',')
                    .map(|v| v.parse::<f32>().unwrap())
                    .collect::<Vec<_>>()
            })
            .collect::<Vec<f32>>()
    };
    let (c, g) = (draw("cpu"), draw("gpu"));
    assert_eq!(c.len(), 400);
    let dd = rel_l2(&g, &c);
    assert!(dd <= 1e-4, "samples gpu vs cpu {dd:e}");
    let pp = d.join("pp");
    let out = ok(lockstep(&[
        "npe",
        "pp",
        s(&run),
        "--injections",
        "4",
        "--num-samples",
        "50",
        "--output-dir",
        s(&pp),
        "--device",
        "gpu",
    ]));
    assert!(
        out.stderr.contains("computes on GPU adapter"),
        "{}",
        out.all_output()
    );
    for f in ["pp.png", "pp.csv", "ks.csv"] {
        assert!(pp.join(f).is_file(), "{f}");
    }
    let bad = lockstep(&[
        "npe",
        "sample",
        s(&run),
        "--observation",
        "0,0",
        "--device",
        "tpu",
    ]);
    assert!(
        !bad.success() && bad.stderr.contains("--device") && bad.stderr.contains("cpu, gpu"),
        "{}",
        bad.all_output()
    );
}

/// Without any Vulkan driver (the loader pointed at no file) `local.device: gpu` and
/// `--device gpu` stop before any output with the message naming the fix; `cuda` in a build
/// without the feature names the build command.
#[test]
fn no_adapter_and_no_cuda_stop_before_any_output() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let gpu = write(d, "gpu.yaml", &settings(2, "none", 1, 32, "gpu", ""));
    let run = d.join("run");
    let no_driver = |args: &[&str]| {
        let mut cmd = Command::new(LOCKSTEP);
        cmd.args(args)
            .env("VK_ICD_FILENAMES", "/nonexistent")
            .env("VK_DRIVER_FILES", "/nonexistent");
        run_with_limit(cmd, Duration::from_secs(60)).unwrap()
    };
    let out = no_driver(&["npe", "train", s(&gpu), "--train-dir", s(&run)]);
    assert!(
        !out.success() && out.elapsed < Duration::from_secs(10),
        "{}",
        out.all_output()
    );
    let e = out.stderr;
    assert!(
        e.contains("gpu.yaml")
            && e.contains("local.device: gpu: no GPU adapter found")
            && e.contains("mesa-vulkan-drivers")
            && e.contains("local.device to \"cpu\""),
        "{e}"
    );
    assert!(out.stdout.is_empty(), "{}", out.stdout);
    assert!(!run.exists());
    // sample with --device gpu: the checkpoint of a CPU run, no output file.
    let cpu = write(d, "cpu.yaml", &settings(2, "none", 1, 32, "cpu", ""));
    let cpu_run = d.join("cpu_run");
    ok(lockstep(&[
        "npe",
        "train",
        s(&cpu),
        "--train-dir",
        s(&cpu_run),
    ]));
    let samples = d.join("x.csv");
    let out = no_driver(&[
        "npe",
        "sample",
        s(&cpu_run),
        "--observation",
        "0,0",
        "--output",
        s(&samples),
        "--device",
        "gpu",
    ]);
    assert!(
        !out.success() && out.stderr.contains("no GPU adapter found") && !samples.exists(),
        "{}",
        out.all_output()
    );
    // cuda in this build (no cuda feature): the build command, before any output.
    if !cfg!(feature = "cuda") {
        let cuda = write(d, "cuda.yaml", &settings(2, "none", 1, 32, "cuda", ""));
        let out = lockstep(&["npe", "train", s(&cuda), "--train-dir", s(&run)]);
        assert!(
            !out.success()
                && out.stderr.contains("cuda.yaml")
                && out.stderr.contains("--features cuda"),
            "{}",
            out.all_output()
        );
        assert!(!run.exists());
    }
}

/// The final checkpoint's loss scaler state of a run.
fn scaler(run: &Path, update: u64) -> lockstep_train::grad_scaler::GradScalerState {
    lockstep_train::checkpoint::read(
        &run.join(format!("checkpoints/update_{update:06}.safetensors")),
    )
    .unwrap()
    .grad_scaler
    .expect("a mixed-precision checkpoint holds the loss scaler")
}

/// `automatic_mixed_precision: true` on the GPU (float16 linear layers and activations):
/// the losses follow the float32 run's to f16 rounding (1e-2 relative; about 1e-4 seen on
/// lavapipe); with a loss scale of 1e10 every scaled gradient overflows f16, so each update
/// is skipped (the parameters stay where they started) and the scale halves; a run resumed
/// from its mid-run checkpoint ends with the same scaler and parameters; the CPU refuses
/// mixed precision before writing anything, naming the key and the fix.
#[test]
fn mixed_precision_on_the_gpu_scales_the_loss_and_skips_overflows() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let amp = |device: &str, scaler: &str, local: &str| {
        settings(2, "layer_norm", 2, 64, device, local).replace(
            "    optimizer:",
            &format!("    automatic_mixed_precision: true\n{scaler}    optimizer:"),
        )
    };
    let f32_cfg = write(d, "f32.yaml", &settings(2, "layer_norm", 2, 64, "gpu", ""));
    let amp_cfg = write(d, "amp.yaml", &amp("gpu", "", "  checkpoint_epochs: 1\n"));
    let (rf, ra) = (d.join("f32"), d.join("amp"));
    ok(lockstep(&[
        "npe",
        "train",
        s(&f32_cfg),
        "--train-dir",
        s(&rf),
    ]));
    let out = ok(lockstep(&[
        "npe",
        "train",
        s(&amp_cfg),
        "--train-dir",
        s(&ra),
    ]));
    assert!(
        out.stdout.contains("mixed precision"),
        "{}",
        out.all_output()
    );
    // The amp run's summary counts applied and skipped updates.
    assert!(
        out.stdout
            .contains("Completed 10 optimizer updates; this run applied 10 and skipped 0"),
        "{}",
        out.stdout
    );
    let (lf, la) = (losses(&rf), losses(&ra));
    assert_eq!((lf.len(), la.len()), (10, 10));
    let worst = lf
        .iter()
        .zip(&la)
        .map(|(a, b)| (a - b).abs() / a.abs().max(1e-3))
        .fold(0.0, f64::max);
    eprintln!("mixed precision vs float32 losses: {worst:e} relative");
    assert!(worst <= 1e-2 && worst > 0.0, "{lf:?} vs {la:?}");
    let g = scaler(&ra, 10);
    assert_eq!(g.skipped, 0, "{g:?}");
    assert_eq!(g.scale, 65536.0);
    // A loss scale of 1e10: every update overflows, is skipped and halves the scale.
    let huge = write(
        d,
        "huge.yaml",
        &amp(
            "gpu",
            "    grad_scaler: {init_scale: 1.0e10}\n",
            "  checkpoint_epochs: 1\n",
        ),
    );
    let rh = d.join("huge");
    // Every update of the run skipped: it trained nothing, so it ends with an error naming
    // the settings' keys and the fix, and exports no posterior.
    let out = lockstep(&["npe", "train", s(&huge), "--train-dir", s(&rh)]);
    assert_eq!(out.code, Some(1), "{}", out.all_output());
    assert!(
        out.stderr
            .contains("huge.yaml: training.stage_0: nothing was trained")
            && out
                .stderr
                .contains("the loss scaler skipped 10 update(s) in a row up to update 10")
            && out
                .stderr
                .contains("lower training.stage_0.grad_scaler.init_scale (now 1e10)")
            && out
                .stderr
                .contains("set training.stage_0.automatic_mixed_precision to false")
            && !out.stdout.contains("Completed"),
        "{}",
        out.all_output()
    );
    assert!(!rh.join("posterior.safetensors").exists());
    let log = std::fs::read_to_string(rh.join("run.log")).unwrap();
    assert!(log.contains("stopped: "), "{log}");
    assert!(
        log.contains("update 1: the gradient overflowed at loss scale 10000000000; update skipped, loss scale lowered to 5000000000"),
        "{log}"
    );
    let g = scaler(&rh, 10);
    assert_eq!(g.skipped, 10, "{g:?}");
    assert_eq!(g.scale, (1.0e10f32 as f64 / 1024.0) as f32);
    assert_eq!(
        values(&rh, 5),
        values(&rh, 10),
        "skipped updates change nothing"
    );
    // Resumed from update 5, the run ends with the uninterrupted run's scaler and values.
    let resumed = d.join("resumed");
    ok(lockstep(&[
        "npe",
        "train",
        s(&amp_cfg),
        "--train-dir",
        s(&resumed),
        "--resume",
        s(&ra.join("checkpoints/update_000005.safetensors")),
    ]));
    assert_eq!(scaler(&resumed, 10), scaler(&ra, 10));
    // Mixed precision is a property of the device: the GPU run's checkpoint resumes on the
    // CPU in float32 (settings without automatic_mixed_precision), as a float32 run.
    let cpu_f32 = write(
        d,
        "cpu_f32.yaml",
        &settings(2, "layer_norm", 2, 64, "cpu", "  checkpoint_epochs: 1\n"),
    );
    let on_cpu = d.join("amp_then_cpu");
    let out = ok(lockstep(&[
        "npe",
        "train",
        s(&cpu_f32),
        "--train-dir",
        s(&on_cpu),
        "--resume",
        s(&ra.join("checkpoints/update_000005.safetensors")),
    ]));
    let log = std::fs::read_to_string(on_cpu.join("run.log")).unwrap();
    assert!(log.contains("updates 5..10"), "{log}");
    assert!(
        on_cpu.join("posterior.safetensors").exists(),
        "{}",
        out.stdout
    );
    // Another learning rate is refused naming the key, both values and what may change.
    let lr = write(
        d,
        "lr.yaml",
        &amp("gpu", "", "  checkpoint_epochs: 1\n").replace("lr: 0.003", "lr: 0.001"),
    );
    let out = lockstep(&[
        "npe",
        "train",
        s(&lr),
        "--train-dir",
        s(&d.join("lr_run")),
        "--resume",
        s(&ra.join("checkpoints/update_000005.safetensors")),
    ]);
    assert!(
        !out.success()
            && out
                .stderr
                .contains("training.stage_0.optimizer.lr (0.003 there, 0.001 here)")
            && out
                .stderr
                .contains("training.stage_N.automatic_mixed_precision")
            && !out.stderr.contains("run.device"),
        "{}",
        out.all_output()
    );
    assert!(!d.join("lr_run").exists());
    let dr = rel_l2(&values(&resumed, 10), &values(&ra, 10));
    assert!(dr <= 1e-5, "resumed vs uninterrupted {dr:e}");
    // The CPU refuses it before any output.
    let cpu = write(d, "cpu.yaml", &amp("cpu", "", ""));
    let run = d.join("cpu_run");
    let out = lockstep(&["npe", "train", s(&cpu), "--train-dir", s(&run)]);
    assert!(
        !out.success()
            && out.stderr.contains("cpu.yaml")
            && out
                .stderr
                .contains("training.stage_0.automatic_mixed_precision")
            && out.stderr.contains("set local.device to gpu or cuda"),
        "{}",
        out.all_output()
    );
    assert!(!run.exists());
    // An adapter without float16 (lavapipe with SHADER_F16 hidden) refuses it before any
    // output, naming the adapter, the feature and the fix.
    let no_f16 = |value: &str| {
        let mut cmd = Command::new(LOCKSTEP);
        cmd.args(["npe", "train", s(&amp_cfg), "--train-dir", s(&run)])
            .env(lockstep_gpu::HIDE_FEATURES_VAR, value);
        run_with_limit(cmd, Duration::from_secs(120)).unwrap()
    };
    let out = no_f16("SHADER_F16");
    assert!(
        !out.success()
            && out.stderr.contains("amp.yaml")
            && out
                .stderr
                .contains("training.stage_0.automatic_mixed_precision")
            && out.stderr.contains("GPU adapter [")
            && out
                .stderr
                .contains("has no float16 in shaders (wgpu's SHADER_F16)")
            && out
                .stderr
                .contains("set automatic_mixed_precision to false"),
        "{}",
        out.all_output()
    );
    assert!(!run.exists() && out.stdout.is_empty(), "{}", out.stdout);
    // A feature lockstep cannot hide is an error naming the variable, before any output.
    let out = no_f16("SHADER_F32");
    assert!(
        !out.success()
            && out.stderr.contains("LOCKSTEP_GPU_HIDE_FEATURES")
            && out.stderr.contains("\"SHADER_F32\" is not a feature"),
        "{}",
        out.all_output()
    );
    assert!(!run.exists());
}

/// gaussian_linear (dim 2) trained for the posterior checks: a 3-step flow of width 32,
/// 75 updates of batch 1024 on fresh simulations, Adam at 1.5e-2. (Was 300 updates of batch
/// 256 at 5e-3: the same 76,800 simulations in a quarter of the updates, which lavapipe
/// trains in less time; the worst errors of the checks below stay about half their limits,
/// mean 0.053 sd and covariance 0.100, on the CPU, the GPU in float32 and in mixed precision.)
fn posterior_settings(device: &str, amp: bool) -> String {
    let amp = if amp {
        "    automatic_mixed_precision: true\n"
    } else {
        ""
    };
    format!(
        "data:
  task: {{name: gaussian_linear, dim: 2}}
  num_samples: 76800
  train_fraction: 1.0
  seed: 5
model:
  posterior_model_type: normalizing_flow
  posterior_kwargs:
    num_flow_steps: 3
    base_transform_kwargs:
      hidden_dim: 32
      num_transform_blocks: 1
      activation: elu
      dropout_probability: 0.0
      norm: layer_norm
      num_bins: 8
      base_transform_type: rq-coupling
      tail_bound: 3.0
  embedding_kwargs:
    output_dim: 8
    hidden_dims: [32, 32]
    activation: elu
    dropout: 0.0
    norm: layer_norm
training:
  stage_0:
    epochs: 1
    batch_size: 1024
{amp}    optimizer: {{type: adam, lr: 0.015}}
    scheduler: {{type: cosine, T_max: 1}}
local:
  device: {device}
"
    )
}

/// The same checks as the CPU test of the trained posterior (lockstep-npe's
/// `gaussian_linear_posterior_matches_the_analytic_one`), on runs trained on the GPU in
/// float32 and in mixed precision (and, as the control, on the CPU), each sampled on the
/// device it trained on: for four observations x the mean of 4000 samples lies within 0.1
/// posterior standard deviations of the analytic x/2 and the covariance within 15%
/// (Frobenius) of 0.05·I (prior and noise variances 0.1); `npe pp` over 100 injections gives
/// every parameter a KS p-value above 0.01. One test per run, so that the test threads run
/// them side by side (the GPU runs are the slowest tests of `make test` on lavapipe).
#[test]
fn a_posterior_trained_on_the_cpu_matches_the_analytic_one() {
    check_trained_posterior("cpu", "cpu", false);
}

/// See [`a_posterior_trained_on_the_cpu_matches_the_analytic_one`].
#[test]
fn a_posterior_trained_on_the_gpu_in_float32_matches_the_analytic_one() {
    check_trained_posterior("gpu_f32", "gpu", false);
}

/// See [`a_posterior_trained_on_the_cpu_matches_the_analytic_one`].
#[test]
fn a_posterior_trained_on_the_gpu_in_mixed_precision_matches_the_analytic_one() {
    check_trained_posterior("gpu_amp", "gpu", true);
}

/// Trains the run `name` on `device` (`amp`: mixed precision) and checks its posterior (see
/// [`a_posterior_trained_on_the_cpu_matches_the_analytic_one`]).
fn check_trained_posterior(name: &str, device: &str, amp: bool) {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let (var, dim, n) = (0.05f64, 2usize, 4000usize);
    let sd = var.sqrt();
    let long = |args: &[&str]| {
        let mut cmd = Command::new(LOCKSTEP);
        cmd.args(args);
        ok(run_with_limit(cmd, Duration::from_secs(600)).unwrap())
    };
    let cfg = write(d, &format!("{name}.yaml"), &posterior_settings(device, amp));
    let run = d.join(name);
    let out = long(&["npe", "train", s(&cfg), "--train-dir", s(&run)]);
    assert_eq!(
        out.stdout.contains("mixed precision"),
        amp,
        "{}",
        out.all_output()
    );
    for (k, x) in [[0.0, 0.0], [0.5, -0.3], [-0.6, 0.4], [0.3, 0.9]]
        .iter()
        .enumerate()
    {
        let csv = d.join(format!("{name}_{k}.csv"));
        let obs = format!("--observation={},{}", x[0], x[1]);
        long(&[
            "npe",
            "sample",
            s(&run),
            &obs,
            "--num-samples",
            &n.to_string(),
            "--output",
            s(&csv),
            "--device",
            device,
            "--seed",
            "7",
        ]);
        let text = std::fs::read_to_string(&csv).unwrap();
        let rows: Vec<Vec<f64>> = text
            .lines()
            .skip(1)
            .map(|l| l.split(',').map(|v| v.parse().unwrap()).collect())
            .collect();
        assert_eq!(rows.len(), n);
        let m: Vec<f64> = (0..dim)
            .map(|j| rows.iter().map(|r| r[j]).sum::<f64>() / n as f64)
            .collect();
        let mut err2 = 0.0;
        for a in 0..dim {
            for b in 0..dim {
                let c = rows
                    .iter()
                    .map(|r| (r[a] - m[a]) * (r[b] - m[b]))
                    .sum::<f64>()
                    / (n - 1) as f64;
                let exact = if a == b { var } else { 0.0 };
                err2 += (c - exact).powi(2);
            }
        }
        let cov_err = err2.sqrt() / (var * (dim as f64).sqrt());
        let mean_err = (0..dim)
            .map(|j| (m[j] - x[j] / 2.0).abs() / sd)
            .fold(0.0, f64::max);
        eprintln!("{name}, x {x:?}: mean error {mean_err:.3} sd, covariance error {cov_err:.3}");
        assert!(
            mean_err < 0.1 && cov_err < 0.15,
            "{name}, x {x:?}: mean {m:?} (error {mean_err:.3} sd), covariance error {cov_err:.3}"
        );
    }
    let pp = d.join(format!("{name}_pp"));
    long(&[
        "npe",
        "pp",
        s(&run),
        "--injections",
        "100",
        "--num-samples",
        "500",
        "--device",
        device,
        "--output-dir",
        s(&pp),
    ]);
    let ks = std::fs::read_to_string(pp.join("ks.csv")).unwrap();
    for line in ks.lines().skip(1) {
        let p: f64 = line.rsplit(',').next().unwrap().parse().unwrap();
        eprintln!("{name}: {line}");
        assert!(p > 0.01, "{name}: P-P KS {line}");
    }
    assert_eq!(ks.lines().count(), 1 + dim, "{ks}");
}

/// `lockstep bench npe --device gpu` (small batch, one timed step): the device step, its
/// copies and memory, the mixed-precision step, and the kernel launches per step counted in
/// float32 and mixed precision (a positive count, broken down by kernel, with the casts of
/// mixed precision); without torch's GPU it says so instead of timing PyTorch.
#[test]
fn bench_npe_on_the_gpu_counts_kernel_launches() {
    let mut cmd = Command::new(LOCKSTEP);
    cmd.args([
        "bench",
        "npe",
        "--device",
        "gpu",
        "--batch",
        "16",
        "--steps",
        "1",
        "--warmup",
        "0",
        "--python",
        "/nonexistent/python3",
        // The other pools than training's default (the counts do not depend on them).
        "--memory-pools",
        "exclusive-pages",
    ]);
    let out = ok(run_with_limit(cmd, Duration::from_secs(300)).unwrap());
    let text = out.stdout.clone();
    assert!(text.contains("1 replica on gpu (burn, f32)"), "{text}");
    assert!(
        text.contains("CubeCL memory pools: exclusive-pages (--memory-pools)"),
        "{text}"
    );
    assert!(text.contains("copy grads device -> flat"), "{text}");
    assert!(
        text.contains("mixed precision (automatic_mixed_precision"),
        "{text}"
    );
    let count = |precision: &str| -> (f64, f64, f64, String) {
        let prefix = format!("kernel launches per step ({precision}, ");
        let line = text
            .lines()
            .find(|l| l.starts_with(&prefix))
            .unwrap_or_else(|| panic!("no launch count for {precision}: {text}"));
        let n: f64 = line
            .split("): ")
            .nth(1)
            .and_then(|r| r.split(';').next())
            .and_then(|v| v.parse().ok())
            .unwrap_or_else(|| panic!("{line}"));
        let syncs: f64 = line
            .split("host synchronisations per step: ")
            .nth(1)
            .and_then(|r| r.split(';').next())
            .and_then(|v| v.parse().ok())
            .unwrap_or_else(|| panic!("no synchronisation count: {line}"));
        let gradient_syncs: f64 = line
            .split("gradient read-backs per step: ")
            .nth(1)
            .and_then(|r| r.split(';').next())
            .and_then(|v| v.parse().ok())
            .unwrap_or_else(|| panic!("no gradient read-back count: {line}"));
        (n, syncs, gradient_syncs, line.to_string())
    };
    // Launches per step: 1,989 (float32) and 2,638 (mixed precision) when the parameters
    // were cut out of one upload with `narrow` (a copy kernel each where the offset is not
    // aligned) and the gradients packed by `cat`; 1,674 and 2,323 with the parameters
    // placed by one allocation and the gradients read as they are; 1,346 in float32 with
    // ELU and the sigmoid as a kernel each way (32 ELUs, 12 sigmoid gates); 551 and 1,552
    // with LayerNorm (and its ELU), the bias and ELU after the gated blocks' first product,
    // the gated tail, the LU map's weight and log-determinant and the coupling's end as a
    // kernel each way (the 8 LayerNorms, 12 gated blocks, 6 flow steps); 1,144 in mixed
    // precision with its float16 activations as a kernel each way, the casts inside (36). The
    // 6 spline couplings run as one forward and one backward kernel each. With the optimizer
    // on the device (lockstep_npe::resident) 710 and 1,304: each of the 158 parameters'
    // gradients packed by one kernel, one Adam kernel, and in mixed precision one finiteness
    // test, in place of the gradient's read-back and the host's Adam. 562 and 1,156 with the
    // gradients packed 16 to a launch (10 launches; lavapipe binds 32 storage buffers), 551
    // and 1,145 with the base density and log-determinant as one kernel each way (for 6
    // scalar operations, a row sum and their backward). Mixed precision 851 with each
    // linear layer's bias and casts in two kernels around its float16 products (59 layers:
    // HalfBiasForward after the product, HalfLinearBackward after the gradient's products,
    // in place of 5 casts, an addition and a reduction). 535 and 835 with each flow step's
    // permutation folded into its LU weight's rows (no gather of the features forward, no
    // scatter back). 444 and 744 with the flow carried as one state tensor [N, n + 2]
    // (features, log-determinant, ones): each step's LU map one kernel and one product (the
    // bias and log-determinant through the ones column), the conditioner's input one kernel
    // (SplitForward), the spline reading the state, the next state one kernel
    // (PlaceForward, the log-determinant's sum inside), in place of the weight, bias,
    // log-determinant, gathers, concatenations, slices and their gradients' zeros, scatters
    // and additions (6 flow steps). 393 and 737 with the gated tails' context products
    // summed inside their kernels (12 gates: a product forward and two backward each, and
    // the context gradient's addition between a step's two gates), the backward pass
    // started from log q with its gradient scaled (no loss reduction, negation and scaling
    // and their gradients), the embedding's residual ends one kernel each (ResidualForward,
    // for two additions) and the conditioners' final bias added by the spline kernel. 593
    // in mixed precision with the gated tails' kernel there too (the block's product in
    // float16, the gate and tail in float32: 12 gates, each 11 launches forward and about
    // 12 backward before); 581 with the block's float16 product read by the kernel as it is
    // (no cast to float32 between). 475 with the weights' float16 copies made by one cast of
    // the packed parameter buffer per pass (47 casts before, one per linear layer), the ELUs
    // before a linear layer returning float16 (no cast of the layer's input: 24), the flow
    // blocks' first linear layer, bias and ELU as one float16 kernel (HalfBiasEluForward)
    // whose backward writes the ELU's gradient in float16 (12 launches each way), and the
    // gated kernel writing the block product's gradient in float16 (12 casts). A
    // regression fails here.
    let (f32_launches, f32_syncs, f32_grads, line) = count("float32");
    let kernels = [
        "LayerNormBackward 8, LayerNormForward 8",
        "GatedBackward 12, GatedForward 12",
        "BiasBackward 12, BiasForward 12",
        "EluBackward 12, EluForward 12",
        "LuAffineBackward 6, LuAffineForward 6",
        "PlaceBackward 6, PlaceForward 6",
        "SplitBackward 6, SplitForward 6",
        "ResidualForward 4",
    ];
    assert!(
        f32_launches > 100.0
            && f32_launches <= 393.0
            && line.contains("MatmulEntry")
            && line.contains("PackMany 10")
            && line.contains("BaseBackward 1, BaseForward 1")
            && line.contains("Adam 1")
            && kernels.iter().all(|k| line.contains(k))
            && line.contains("the spline couplings' kernels: SplineBackward 6, SplineForward 6"),
        "{line}"
    );
    let (amp_launches, amp_syncs, amp_grads, line) = count("mixed precision (float16)");
    assert!(
        amp_launches > f32_launches
            && amp_launches <= 475.0
            && line.contains("GatedBackward 12, GatedForward 12")
            && line.contains("HalfBiasForward 23")
            && line.contains("HalfBiasEluForward 12, HalfForward 12")
            && line.contains("HalfLinearBackward 47")
            && line.contains("CastElement 47")
            && line.contains("NonFinite 1")
            && line.contains("HalfBackward 24")
            && line.contains("LayerNormBackward 8, LayerNormForward 8"),
        "{line}"
    );
    // One host synchronisation per step, and none of them the gradient's: the optimizer
    // runs on the device (lockstep_npe::resident), and only log q (with mixed precision
    // also the gradient's finiteness flag, in the same transfer) comes back. Before: the
    // gradient and log q read together after the backward pass (and before that, log q
    // before it and the gradient after it: 2).
    assert_eq!((f32_syncs, amp_syncs), (1.0, 1.0), "{text}");
    assert_eq!((f32_grads, amp_grads), (0.0, 0.0), "{text}");
    for precision in ["float32", "mixed precision"] {
        let prefix = format!(
            "host per step ({precision}, NpeModel::nll_and_grad): 1.0 host synchronisations"
        );
        assert!(
            text.lines().any(|l| l.starts_with(&prefix)
                && l.contains("0.0 of the gradient")
                && l.contains("ms recording")),
            "{text}"
        );
    }
    assert!(
        text.contains("note: no PyTorch comparison on the GPU"),
        "{text}"
    );
}

/// sbi's `clip_max_norm` under mixed precision on the GPU: the unscaled gradient is clipped
/// (PyTorch's order: unscale, then clip), so the AMP run's parameter steps follow the float32
/// run's (5% relative), where clipping the scaled gradient (65536x larger) would shrink them
/// to nothing; SGD moves at most `lr x clip_max_norm` per update, far less than unclipped.
#[test]
fn mixed_precision_clips_the_unscaled_gradient() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let (lr, max) = (0.05, 0.02);
    let cfg = |amp: bool, clip: bool| {
        let mut opt = String::new();
        if amp {
            opt += "    automatic_mixed_precision: true\n";
        }
        if clip {
            opt += &format!("    clip_max_norm: {max}\n");
        }
        settings(2, "layer_norm", 2, 64, "gpu", "  checkpoint_epochs: 1\n")
            .replace(
                "{type: adam, lr: 0.003}",
                &format!("{{type: sgd, lr: {lr}}}"),
            )
            .replace("    optimizer:", &format!("{opt}    optimizer:"))
    };
    let mut step = Vec::new();
    for (name, amp, clip) in [
        ("f32", false, true),
        ("amp", true, true),
        ("free", false, false),
    ] {
        let c = write(d, &format!("{name}.yaml"), &cfg(amp, clip));
        let run = d.join(name);
        ok(lockstep(&["npe", "train", s(&c), "--train-dir", s(&run)]));
        let (a, b) = (values(&run, 5), values(&run, 10));
        step.push(b.iter().zip(&a).map(|(x, y)| x - y).collect::<Vec<f32>>());
        let log = std::fs::read_to_string(run.join("run.log")).unwrap();
        assert_eq!(
            log.contains("clipped to clip_max_norm 0.02"),
            clip,
            "{name}: {log}"
        );
    }
    let norm = |v: &[f32]| v.iter().map(|x| f64::from(*x).powi(2)).sum::<f64>().sqrt();
    let r = rel_l2(&step[1], &step[0]);
    eprintln!(
        "clipped steps, mixed precision vs float32: {r:e}; norms {:e} {:e} unclipped {:e}",
        norm(&step[0]),
        norm(&step[1]),
        norm(&step[2])
    );
    assert!(
        r <= 0.05,
        "mixed precision clipped otherwise than float32: {r:e}"
    );
    // Five SGD updates of at most lr x max each.
    assert!(
        norm(&step[0]) <= 5.0 * lr * max * (1.0 + 1e-4),
        "{}",
        norm(&step[0])
    );
    assert!(
        norm(&step[2]) > 4.0 * norm(&step[0]),
        "the clip did not bind"
    );
}
