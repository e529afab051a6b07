//! `lockstep npe train SETTINGS.yaml`, `lockstep npe sample CHECKPOINT`, `lockstep npe pp
//! CHECKPOINT`, `lockstep npe submit SETTINGS.yaml`: neural posterior estimation with
//! Dingo-shaped settings (crate lockstep-npe), trained by the lockstep-train engine like
//! `lockstep train` (serial, thread replicas from `local.replicas`, or one MPI rank per
//! replica under `mpirun`/`srun`).
//!
//! This module reads the arguments and writes the files a user asked for; the training
//! stages run in [`lockstep_npe::stages`], the figures are drawn by [`crate::plot::npe`].

use crate::plot::npe::{plot_corner, plot_pp};
use anyhow::{bail, Context, Result};
use lockstep_comm::World;
use lockstep_npe::calibration::injection;
use lockstep_npe::stages::{train_stages, TrainRequest};
use lockstep_npe::trained::{self, Trained};
use lockstep_npe::{DeviceKind, DeviceModel, NpeError, NpeSettings, Placement};
use std::path::{Path, PathBuf};

/// `lockstep npe` subcommands.
#[derive(Debug, clap::Subcommand)]
pub enum NpeCommand {
    /// Train a posterior from Dingo-style YAML settings (data, model, training.stage_0, local).
    Train(TrainArgs),
    /// Draw posterior samples for an observation (HDF5 or CSV).
    Sample(SampleArgs),
    /// P-P test over simulated injections: a P-P plot PNG and per-parameter KS p-values.
    Pp(PpArgs),
    /// Write an HTCondor submit description (--condor) or a Slurm batch script (--slurm) that
    /// runs `lockstep npe train` with the resources of the settings' `local` section.
    Submit(SubmitArgs),
}

/// Options of `lockstep npe submit`.
#[derive(Debug, clap::Args)]
#[command(group(clap::ArgGroup::new("system").required(true).args(["condor", "slurm"])))]
pub struct SubmitArgs {
    /// The settings file (YAML, Dingo's shape).
    pub settings: PathBuf,
    /// Write an HTCondor submit description (resources from local.condor, local.num_gpus).
    #[arg(long)]
    pub condor: bool,
    /// Write a Slurm batch script: one MPI rank per replica under srun (local.slurm).
    #[arg(long)]
    pub slurm: bool,
    /// The run directory the job trains into.
    #[arg(long, default_value = "npe_output")]
    pub train_dir: PathBuf,
    /// The file to write (default lockstep_npe.sub or lockstep_npe.sbatch); the job's
    /// .out/.err/.log files go next to it.
    #[arg(long)]
    pub output: Option<PathBuf>,
    /// Replace an existing output file.
    #[arg(long)]
    pub overwrite: bool,
}

/// Options of `lockstep npe train`.
#[derive(Debug, clap::Args)]
pub struct TrainArgs {
    /// The settings file (YAML, Dingo's shape).
    pub settings: PathBuf,
    /// The run directory (Dingo's --train_dir).
    #[arg(long, alias = "output-dir", default_value = "npe_output")]
    pub train_dir: PathBuf,
    /// Replace an existing run directory written by lockstep.
    #[arg(long)]
    pub overwrite: bool,
    /// Continue from this checkpoint, run directory or checkpoints/latest (any replica count).
    #[arg(long)]
    pub resume: Option<PathBuf>,
}

/// Options of `lockstep npe sample`.
#[derive(Debug, clap::Args)]
pub struct SampleArgs {
    /// A checkpoint file, checkpoints/latest, or a run directory (its latest checkpoint).
    pub checkpoint: PathBuf,
    /// The observation x: comma-separated values, or a file of whitespace/comma-separated
    /// values (.csv, .txt).
    #[arg(long, conflicts_with = "injection")]
    pub observation: Option<String>,
    /// Instead of --observation: simulate injection number N of the P-P stream (its true
    /// parameters are written next to the samples).
    #[arg(long)]
    pub injection: Option<u64>,
    /// Posterior samples to draw.
    #[arg(long, default_value_t = 10_000)]
    pub num_samples: usize,
    /// Output file: .h5/.hdf5 (datasets samples [n, d], parameter_names, observation,
    /// injection_parameters) or .csv (a header of parameter names).
    #[arg(long, default_value = "posterior_samples.h5")]
    pub output: PathBuf,
    /// Seed of the base draws.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Also draw a corner plot of the samples into this PNG: 1-D histograms on the diagonal,
    /// 2-D histograms below it, the true values (with --injection) marked in red.
    #[arg(long)]
    pub corner: Option<PathBuf>,
    /// Where the network computes: cpu, gpu (burn's wgpu backend on the first adapter
    /// `lockstep info` lists) or cuda (a build with the cuda feature).
    #[arg(long, default_value = "cpu")]
    pub device: String,
}

/// Options of `lockstep npe pp`.
#[derive(Debug, clap::Args)]
pub struct PpArgs {
    /// A checkpoint file, checkpoints/latest, or a run directory (its latest checkpoint).
    pub checkpoint: PathBuf,
    /// Injections simulated from the task's prior.
    #[arg(long, default_value_t = 200)]
    pub injections: usize,
    /// Posterior samples per injection.
    #[arg(long, default_value_t = 1000)]
    pub num_samples: usize,
    /// Seed of the injections and base draws (default: the settings' data.seed).
    #[arg(long)]
    pub seed: Option<u64>,
    /// Output folder (default RUN_DIR/pp, or TRAIN_DIR/pp for the folder of a run of several
    /// stages): pp.png, pp.csv (percentiles), ks.csv.
    #[arg(long)]
    pub output_dir: Option<PathBuf>,
    /// Where the network computes: cpu, gpu (burn's wgpu backend on the first adapter
    /// `lockstep info` lists) or cuda (a build with the cuda feature).
    #[arg(long, default_value = "cpu")]
    pub device: String,
}

/// Runs a `lockstep npe` subcommand.
///
/// Errors: settings errors (agreed across MPI ranks), training errors, unreadable
/// checkpoints or observations, unwritable outputs.
pub fn run(cmd: &NpeCommand, world: &World) -> Result<()> {
    match cmd {
        NpeCommand::Train(a) => train(a, world),
        NpeCommand::Sample(a) => sample(a),
        NpeCommand::Pp(a) => pp(a),
        NpeCommand::Submit(a) => submit(a),
    }
}

/// Writes the submission file of `lockstep npe submit` (atomically; an existing file only
/// with --overwrite) and prints how to submit it.
fn submit(args: &SubmitArgs) -> Result<()> {
    use lockstep_npe::submit::{condor, slurm, Job};
    let (settings, _) = NpeSettings::from_yaml_file(&args.settings)?;
    let default = if args.condor {
        "lockstep_npe.sub"
    } else {
        "lockstep_npe.sbatch"
    };
    let out = std::path::absolute(args.output.as_deref().unwrap_or(Path::new(default)))?;
    if out.exists() && !args.overwrite {
        bail!(
            "{} already exists; pass --overwrite to replace it or --output to write elsewhere",
            out.display()
        );
    }
    let exe = std::env::current_exe().context("cannot find the lockstep executable")?;
    let settings_file = std::path::absolute(&args.settings)?;
    let train_dir = std::path::absolute(&args.train_dir)?;
    let log_stem = out.with_extension("");
    let job = Job {
        executable: &exe,
        settings_file: &settings_file,
        train_dir: &train_dir,
        log_stem: &log_stem,
    };
    let (text, warnings) = if args.condor {
        condor(&settings, &job)
    } else {
        (slurm(&settings, &job), Vec::new())
    };
    for w in warnings {
        eprintln!("warning: {w}");
    }
    lockstep_train::checkpoint::write_atomic(&out, text.as_bytes())?;
    println!("wrote {}", out.display());
    if args.condor {
        match settings.local.condor.as_ref().and_then(|c| c.bid) {
            Some(bid) => println!("submit with: condor_submit_bid {bid} {}", out.display()),
            None => println!("submit with: condor_submit {}", out.display()),
        }
    } else {
        println!("submit with: sbatch {}", out.display());
    }
    Ok(())
}

fn train(args: &TrainArgs, world: &World) -> Result<()> {
    let request = TrainRequest {
        settings_file: args.settings.clone(),
        train_dir: args.train_dir.clone(),
        overwrite: args.overwrite,
        resume: args.resume.clone(),
    };
    train_stages(&request, world).map_err(|e| match e {
        // The engine's errors stay a TrainError, so that `main` ends the ranks that agreed on
        // a failure cleanly (`TrainError::is_agreed`).
        NpeError::Train(t) => anyhow::Error::new(t),
        other => anyhow::Error::new(other),
    })
}

/// Parses an observation: comma/whitespace-separated numbers, or a file holding them.
fn read_observation(spec: &str) -> Result<Vec<f64>> {
    let path = Path::new(spec);
    let text = if path.is_file() {
        std::fs::read_to_string(path).with_context(|| format!("cannot read {spec}"))?
    } else {
        spec.to_string()
    };
    text.split(|c: char| c == ',' || c.is_whitespace())
        .filter(|t| !t.is_empty())
        .map(|t| {
            t.parse::<f64>().with_context(|| {
                if path.is_file() {
                    format!("{spec}: {t:?} is not a number")
                } else {
                    format!("--observation: {t:?} is not a number (give comma-separated values or a file)")
                }
            })
        })
        .collect()
}

/// Writes `data` to `path` through a temporary file in the same folder (renamed when
/// complete), so a failure never leaves a partial file under the final name.
fn write_via_temp(path: &Path, write: impl FnOnce(&Path) -> Result<()>) -> Result<()> {
    let dir = match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
        _ => PathBuf::from("."),
    };
    std::fs::create_dir_all(&dir).with_context(|| format!("cannot create {}", dir.display()))?;
    let name = path
        .file_name()
        .with_context(|| format!("{} is not a file name", path.display()))?;
    // The extension stays last: the PNG writer picks the format from it.
    let tmp = dir.join(format!(
        ".tmp{}-{}",
        std::process::id(),
        name.to_string_lossy()
    ));
    let result = write(&tmp).and_then(|()| {
        std::fs::rename(&tmp, path)
            .with_context(|| format!("cannot rename {} to {}", tmp.display(), path.display()))
    });
    if result.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    result
}

fn sample(args: &SampleArgs) -> Result<()> {
    let ext = args
        .output
        .extension()
        .and_then(|e| e.to_str())
        .unwrap_or("")
        .to_ascii_lowercase();
    if !matches!(ext.as_str(), "h5" | "hdf5" | "csv") {
        bail!(
            "--output {}: use a .h5/.hdf5 or .csv file name",
            args.output.display()
        );
    }
    if args.num_samples == 0 {
        bail!("--num-samples must be at least 1");
    }
    let t = trained::load(&args.checkpoint)?;
    let model = model_on(&t, &args.device)?;
    let (x, truth) = match (&args.observation, args.injection) {
        (Some(spec), _) => (read_observation(spec)?, None),
        (None, Some(i)) => {
            let (theta, x) = injection(t.task.as_ref(), t.settings.data.seed, i);
            (x, Some(theta))
        }
        (None, None) => bail!("give --observation VALUES|FILE or --injection N"),
    };
    if x.len() != t.task.x_dim() {
        bail!(
            "the observation has {} values; the task {} expects {}",
            x.len(),
            t.task.name(),
            t.task.x_dim()
        );
    }
    let xf: Vec<f32> = x.iter().map(|&v| v as f32).collect();
    let samples = model.sample(&xf, args.num_samples, args.seed);
    let names = t.task.parameter_names();
    let d = names.len();
    if ext == "csv" {
        write_via_temp(&args.output, |tmp| {
            let mut text = names.join(",");
            text.push('\n');
            for row in samples.chunks_exact(d) {
                let r: Vec<String> = row.iter().map(|v| format!("{v}")).collect();
                text.push_str(&r.join(","));
                text.push('\n');
            }
            std::fs::write(tmp, text).with_context(|| format!("cannot write {}", tmp.display()))
        })?;
    } else {
        write_via_temp(&args.output, |tmp| {
            write_samples_h5(tmp, &samples, &names, &x, truth.as_deref())
                .with_context(|| format!("cannot write {}", tmp.display()))
        })?;
    }
    if let Some(png) = &args.corner {
        let title = match args.injection {
            Some(i) => format!("{}, injection {i}", t.task.name()),
            None => t.task.name().to_string(),
        };
        write_via_temp(png, |tmp| {
            plot_corner(&samples, &names, truth.as_deref(), &title, tmp)
        })?;
        println!("corner plot written to {}", png.display());
    }
    println!(
        "{} posterior samples of {} ({}) from {} (update {}) written to {}",
        args.num_samples,
        t.task.name(),
        names.join(", "),
        t.checkpoint.display(),
        t.update,
        args.output.display()
    );
    Ok(())
}

fn write_samples_h5(
    path: &Path,
    samples: &[f32],
    names: &[String],
    x: &[f64],
    truth: Option<&[f64]>,
) -> Result<()> {
    use hdf5::types::VarLenUnicode;
    let f = hdf5::File::create(path)?;
    let d = names.len();
    f.new_dataset::<f32>()
        .shape([samples.len() / d, d])
        .create("samples")?
        .write_raw(samples)?;
    let n: Vec<VarLenUnicode> = names
        .iter()
        .map(|s| s.parse::<VarLenUnicode>())
        .collect::<Result<_, _>>()?;
    f.new_dataset::<VarLenUnicode>()
        .shape([d])
        .create("parameter_names")?
        .write_raw(&n)?;
    f.new_dataset::<f64>()
        .shape([x.len()])
        .create("observation")?
        .write_raw(x)?;
    if let Some(t) = truth {
        f.new_dataset::<f64>()
            .shape([t.len()])
            .create("injection_parameters")?
            .write_raw(t)?;
    }
    Ok(())
}

/// Whether the settings at `path` set `local.device` to a GPU (`gpu`, `cuda`); read
/// leniently: any error leaves it to the real reading of the settings.
pub fn asks_for_gpu(path: &Path) -> bool {
    NpeSettings::from_yaml_file(path).is_ok_and(|(s, _)| s.device() != DeviceKind::Cpu)
}

/// The trained network on `--device` (the first adapter for `gpu`, CUDA device 0 for
/// `cuda`), opened before any output.
fn model_on(t: &Trained, device: &str) -> Result<DeviceModel> {
    let kind: DeviceKind = device
        .parse()
        .map_err(|e: NpeError| anyhow::anyhow!("--device: {e}"))?;
    let placement =
        Placement::for_slot(kind, 0).map_err(|e| anyhow::anyhow!("--device {device}: {e}"))?;
    if kind != DeviceKind::Cpu {
        eprintln!("computes on {}", placement.describe());
    }
    Ok(DeviceModel::from_model(&t.model, &placement)?)
}

fn pp(args: &PpArgs) -> Result<()> {
    if args.injections < 2 || args.num_samples == 0 {
        bail!("--injections must be at least 2 and --num-samples at least 1");
    }
    let t: Trained = trained::load(&args.checkpoint)?;
    let model = model_on(&t, &args.device)?;
    // The folder of a run of several stages gets its pp/ next to its stages.
    let stages_folder = args.checkpoint.is_dir() && !args.checkpoint.join("checkpoints").is_dir();
    let base = if stages_folder {
        &args.checkpoint
    } else {
        &t.run_dir
    };
    let out = args.output_dir.clone().unwrap_or_else(|| base.join("pp"));
    let seed = args.seed.unwrap_or(t.settings.data.seed);
    let start = std::time::Instant::now();
    let r = model.pp_test(t.task.as_ref(), seed, args.injections, args.num_samples);
    std::fs::create_dir_all(&out).with_context(|| format!("cannot create {}", out.display()))?;
    let mut csv = r.names.join(",");
    csv.push('\n');
    for row in &r.percentiles {
        let v: Vec<String> = row.iter().map(|p| format!("{p}")).collect();
        csv.push_str(&v.join(","));
        csv.push('\n');
    }
    write_via_temp(&out.join("pp.csv"), |tmp| Ok(std::fs::write(tmp, &csv)?))?;
    let mut ks = String::from("parameter,ks_p_value\n");
    for (n, p) in r.names.iter().zip(&r.p_values) {
        ks.push_str(&format!("{n},{p}\n"));
    }
    write_via_temp(&out.join("ks.csv"), |tmp| Ok(std::fs::write(tmp, &ks)?))?;
    let png = out.join("pp.png");
    write_via_temp(&png, |tmp| plot_pp(&r, tmp, t.task.name()))?;
    println!(
        "P-P test of {} (update {}): {} injections x {} samples in {:.1} s",
        t.checkpoint.display(),
        t.update,
        args.injections,
        args.num_samples,
        start.elapsed().as_secs_f64()
    );
    for (n, p) in r.names.iter().zip(&r.p_values) {
        println!("  {n:>20}: KS p-value {p:.4}");
    }
    println!("wrote {}, pp.csv and ks.csv", png.display());
    Ok(())
}
