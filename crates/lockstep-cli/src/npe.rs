//! `lockstep npe train SETTINGS.yaml`, `lockstep npe sample CHECKPOINT`, `lockstep npe pp
//! CHECKPOINT`: neural posterior estimation with Dingo-shaped settings (crate lockstep-npe),
//! trained by the lockstep-train engine like `lockstep train` (serial, thread replicas from
//! `local.replicas`, or one MPI rank per replica under `mpirun`/`srun`).

use anyhow::{bail, Context, Result};
use lockstep_comm::World;
use lockstep_npe::calibration::{injection, pp_test, PpResult};
use lockstep_npe::settings::Launch;
use lockstep_npe::svd::ReducedBasis;
use lockstep_npe::trained::{self, Trained};
use lockstep_npe::{CpuAutodiff, NpeModel, NpeNetwork, NpeSettings, TaskSource};
use lockstep_train::config::EngineConfig;
use lockstep_train::job::{agree_on_validation, run_job};
use lockstep_train::{EngineOptions, TrainError};
use plotters::prelude::*;
use serde_json::Value;
use std::io::Write;
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

/// A checked `lockstep npe train` run: the settings, the network, one engine config per
/// stage, where each stage's run directory is, and where training starts.
struct Prepared {
    settings: NpeSettings,
    network: NpeNetwork,
    /// Per stage: the resolved config (the engine's sections plus `npe`, `npe_stage`).
    configs: Vec<(Value, EngineConfig)>,
    /// The folder holding `stage_N` run directories (runs of several stages only).
    stages_dir: Option<PathBuf>,
    /// The stage to start with and the checkpoint to resume it from.
    first_stage: usize,
    resume: Option<PathBuf>,
    /// Replicas of this launch ([`NpeSettings::replicas`]).
    replicas: usize,
}

/// Reads the settings, checks them (every stage's engine config and frozen blocks), and
/// finds the stage a `--resume` checkpoint belongs to; no output is touched.
fn prepare(args: &TrainArgs, world: &World) -> Result<Prepared> {
    let (settings, raw) = NpeSettings::from_yaml_file(&args.settings)?;
    let launch = if world.launch.is_mpi_launch() && world.launch.size > 1 {
        Launch::Mpi(world.launch.size)
    } else {
        Launch::SingleProcess
    };
    let dir = std::path::absolute(&args.train_dir)?;
    let n = settings.stages().len();
    let stages_dir = (n > 1).then(|| dir.clone());
    let (first_stage, resume) = match &args.resume {
        None => (0, None),
        Some(p) => {
            let file = trained::resolve_checkpoint(p)?;
            let (_, _, stage) = trained::run_settings(&file)?;
            (stage, Some(file))
        }
    };
    if first_stage >= n {
        bail!(
            "--resume {}: the checkpoint is of training.stage_{first_stage}, but {} has {n} stage(s)",
            args.resume.as_deref().unwrap_or(Path::new("")).display(),
            args.settings.display()
        );
    }
    let mut configs = Vec::with_capacity(n);
    for stage in 0..n {
        let (out, overwrite) = match &stages_dir {
            // Later stages of a resumed run replace what an interrupted attempt left.
            Some(d) => (
                trained::stage_dir(d, stage),
                stage > first_stage && resume.is_some(),
            ),
            None => (dir.clone(), args.overwrite),
        };
        let json = settings
            .engine_config(stage, &raw, launch, &out, overwrite)
            .map_err(|e| e.in_file(&args.settings))?;
        let cfg = EngineConfig::from_json(&json, Path::new("/")).map_err(|e| match e {
            TrainError::Config(c) => TrainError::Config(c.in_file(&args.settings)),
            other => other,
        })?;
        configs.push((json, cfg));
    }
    let task = settings.task()?;
    let network = trained::network(&settings, task.as_ref())?;
    for stage in 0..n {
        network
            .freezing(&settings.frozen_blocks(stage))
            .with_context(|| {
                format!("{}: training.stage_{stage}.freeze", args.settings.display())
            })?;
    }
    let replicas = settings
        .replicas(launch)
        .map_err(|e| e.in_file(&args.settings))?;
    Ok(Prepared {
        settings,
        network,
        configs,
        stages_dir,
        first_stage,
        resume,
        replicas,
    })
}

/// The chief creates the folder of a run of several stages (replacing an old one only with
/// `--overwrite`, and only when lockstep wrote it or it is empty); a resumed run keeps it.
///
/// Errors: the folder exists (without `--overwrite`) or may not be replaced, or I/O.
fn create_stages_dir(dir: &Path, overwrite: bool, resumed_inside: bool) -> Result<()> {
    use lockstep_core::output_dir::{check_replaceable, write_marker};
    if resumed_inside {
        return Ok(());
    }
    if dir.exists() {
        if !overwrite {
            bail!(
                "{} already exists; choose another --train-dir, pass --overwrite to replace it, or --resume {} to continue it",
                dir.display(),
                dir.display()
            );
        }
        check_replaceable(dir, &[])?;
        std::fs::remove_dir_all(dir)
            .with_context(|| format!("cannot remove the old {}", dir.display()))?;
    }
    std::fs::create_dir_all(dir).with_context(|| format!("cannot create {}", dir.display()))?;
    write_marker(
        dir,
        "written by lockstep npe train (one run directory per stage); --overwrite may replace this directory\n",
    )
    .with_context(|| format!("cannot write into {}", dir.display()))?;
    Ok(())
}

/// The (parameters, running statistics) a finished stage ended with, in layout order, read
/// from its run directory's latest checkpoint.
///
/// Errors: the checkpoint cannot be read or does not fit the network.
fn stage_result(run_dir: &Path) -> Result<(Vec<f32>, Vec<f32>)> {
    let t = trained::load(run_dir)?;
    Ok((t.model.parameters(), t.model.state().to_vec()))
}

fn train(args: &TrainArgs, world: &World) -> Result<()> {
    let prepared = prepare(args, world).map_err(TrainError::Build);
    let p = agree_on_validation(world.comm(), prepared)?;
    let (settings, network) = (&p.settings, &p.network);
    let task = settings.task()?;
    let (seed, n_train) = (settings.data.seed, settings.train_samples());
    let chief = world.comm().is_chief();
    if let Some(dir) = &p.stages_dir {
        let inside = p.resume.as_ref().is_some_and(|f| f.starts_with(dir));
        let made = if chief {
            create_stages_dir(dir, args.overwrite, inside).map_err(TrainError::Build)
        } else {
            Ok(())
        };
        agree_on_validation(world.comm(), made)?;
    }
    // Stage 0 starts from the initial parameters, with the reduced basis computed from keyed
    // inputs in every process (deterministic; the startup broadcast makes the replicas equal
    // in any case). A resumed stage takes its parameters from the checkpoint instead.
    let fresh = NpeModel::<CpuAutodiff>::new(network.clone(), seed, Default::default());
    let mut values = (fresh.parameters(), fresh.state().to_vec());
    let mut svd_report = Vec::new();
    if let (Some(svd), None) = (&settings.model.embedding_kwargs.svd, &p.resume) {
        let basis = ReducedBasis::compute(task.as_ref(), seed, svd, &network.standardization)?;
        basis.initialize(network, &mut values.0)?;
        svd_report = basis.report();
        if chief {
            svd_report.iter().for_each(|l| println!("{l}"));
        }
    }
    let n = p.configs.len();
    let mut last_dir = PathBuf::new();
    for stage in p.first_stage..n {
        let (json, cfg) = &p.configs[stage];
        let frozen = settings.frozen_blocks(stage);
        let mut notes = std::mem::take(&mut svd_report);
        if n > 1 {
            let st = settings.stages()[stage];
            notes.push(format!(
                "stage {stage} of {n}: {} epoch(s), total batch {}, frozen blocks: {}",
                st.epochs,
                st.batch_size,
                if frozen.is_empty() {
                    "none".to_string()
                } else {
                    frozen.join(", ")
                }
            ));
            if chief {
                println!("{}", notes.last().map(String::as_str).unwrap_or(""));
            }
        }
        let opts = EngineOptions {
            resolved_config: json.clone(),
            resume: if stage == p.first_stage {
                p.resume.clone()
            } else {
                None
            },
            ..EngineOptions::default()
        };
        let summary = run_job(world, cfg, &opts, |_rank| {
            let mut model = NpeModel::<CpuAutodiff>::new(network.clone(), seed, Default::default());
            model.freeze(&frozen)?;
            model.set_parameters(&values.0)?;
            model.set_state(&values.1)?;
            // local.num_workers counts the loader threads of all replicas (as Dingo's); each
            // replica simulates its own slice, with at least one.
            let workers = (settings.local.num_workers.unwrap_or(1) / p.replicas).max(1);
            // The test simulations are the validation set that reduce_on_plateau steps on.
            let held_out = settings.data.num_samples.saturating_sub(n_train);
            let source = TaskSource::dataset(task.clone(), seed, n_train)
                .with_workers(workers)
                .with_validation(n_train, held_out);
            Ok((model, source))
        })?;
        last_dir = summary.output_dir.clone();
        if chief {
            append_log(&last_dir.join(&cfg.log_file), &notes)?;
        }
        if stage + 1 < n {
            // The next stage starts where this one ended: the chief reads the final
            // checkpoint, the startup broadcast hands the values to every replica.
            let next = if chief {
                stage_result(&last_dir).map_err(TrainError::Build)
            } else {
                Ok(values.clone())
            };
            values = agree_on_validation(world.comm(), next)?;
        }
    }
    if chief {
        let log = last_dir.join(&p.configs[n - 1].1.log_file);
        if let Some(dir) = &p.stages_dir {
            let export = last_dir.join(lockstep_npe::model::EXPORT_FILE);
            let bytes = std::fs::read(&export)
                .with_context(|| format!("cannot read {}", export.display()))?;
            lockstep_train::checkpoint::write_atomic(
                &dir.join(lockstep_npe::model::EXPORT_FILE),
                &bytes,
            )?;
        }
        let t = trained::load(&last_dir)?;
        if let Some(loss) = t.test_loss() {
            let held_out = settings.data.num_samples - n_train;
            let line = format!(
                "test loss (mean negative log-probability over {held_out} held-out simulations): {loss:.6}"
            );
            println!("{line}");
            append_log(&log, &[line])?;
        }
    }
    Ok(())
}

/// Appends `lines` to the run's log file.
fn append_log(log: &Path, lines: &[String]) -> Result<()> {
    if lines.is_empty() {
        return Ok(());
    }
    std::fs::OpenOptions::new()
        .append(true)
        .open(log)
        .and_then(|mut f| lines.iter().try_for_each(|l| writeln!(f, "{l}")))
        .with_context(|| format!("cannot append to {}", log.display()))
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
    let samples = t.model.sample(&xf, args.num_samples, args.seed);
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

fn pp(args: &PpArgs) -> Result<()> {
    if args.injections < 2 || args.num_samples == 0 {
        bail!("--injections must be at least 2 and --num-samples at least 1");
    }
    let t: Trained = trained::load(&args.checkpoint)?;
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
    let r = pp_test(
        &t.model,
        t.task.as_ref(),
        seed,
        args.injections,
        args.num_samples,
    );
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

/// The P-P plot: per parameter, the fraction of injections whose true value lies at or
/// below each credible level of its marginal posterior, against the level; the diagonal and
/// the 68/95/99.7% binomial bands of a calibrated posterior with this many injections (as
/// bilby's `make_pp_plot`, normal approximation).
pub fn plot_pp(r: &PpResult, out: &Path, title: &str) -> Result<()> {
    plotters::style::register_font(
        "sans-serif",
        plotters::style::FontStyle::Normal,
        crate::plot::FONT,
    )
    .map_err(|_| anyhow::anyhow!("the bundled font cannot be loaded"))?;
    let n = r.percentiles.len() as f64;
    let root = BitMapBackend::new(out, (700, 700)).into_drawing_area();
    root.fill(&WHITE)?;
    let mut chart = ChartBuilder::on(&root)
        .margin(15)
        .caption(
            format!("P-P plot, {title}, {} injections", r.percentiles.len()),
            ("sans-serif", 22),
        )
        .x_label_area_size(45)
        .y_label_area_size(55)
        .build_cartesian_2d(0.0f64..1.0, 0.0f64..1.0)?;
    chart
        .configure_mesh()
        .x_desc("credible level")
        .y_desc("fraction of injections in the credible interval")
        .light_line_style(WHITE)
        .label_style(("sans-serif", 14))
        .draw()?;
    let grid: Vec<f64> = (0..=200).map(|i| i as f64 / 200.0).collect();
    for (z, shade) in [(3.0, 235u8), (1.96, 220), (1.0, 200)] {
        let upper: Vec<(f64, f64)> = grid
            .iter()
            .map(|&p| (p, (p + z * (p * (1.0 - p) / n).sqrt()).min(1.0)))
            .collect();
        let lower: Vec<(f64, f64)> = grid
            .iter()
            .rev()
            .map(|&p| (p, (p - z * (p * (1.0 - p) / n).sqrt()).max(0.0)))
            .collect();
        chart.draw_series(std::iter::once(Polygon::new(
            upper.into_iter().chain(lower).collect::<Vec<_>>(),
            RGBColor(shade, shade, shade).filled(),
        )))?;
    }
    chart.draw_series(LineSeries::new(
        [(0.0, 0.0), (1.0, 1.0)],
        BLACK.stroke_width(1),
    ))?;
    for (j, name) in r.names.iter().enumerate() {
        let mut col = r.column(j);
        col.sort_by(f64::total_cmp);
        let colour = crate::plot::COLOURS[j % crate::plot::COLOURS.len()];
        let pts: Vec<(f64, f64)> = grid
            .iter()
            .map(|&p| (p, col.partition_point(|&v| v <= p) as f64 / n))
            .collect();
        chart
            .draw_series(LineSeries::new(pts, colour.stroke_width(2)))?
            .label(format!("{name} (p = {:.3})", r.p_values[j]))
            .legend(move |(x, y)| PathElement::new([(x, y), (x + 20, y)], colour.stroke_width(2)));
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperLeft)
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .label_font(("sans-serif", 14))
        .draw()?;
    root.present()
        .with_context(|| format!("cannot write {}", out.display()))?;
    Ok(())
}

/// The axis range of one parameter in a corner plot: its 0.5% to 99.5% sample quantiles,
/// widened to hold the true value, with a 5% margin.
fn corner_range(values: &mut [f64], truth: Option<f64>) -> (f64, f64) {
    values.sort_by(f64::total_cmp);
    let q = |p: f64| values[((values.len() - 1) as f64 * p).round() as usize];
    let (mut lo, mut hi) = (q(0.005), q(0.995));
    if let Some(t) = truth.filter(|t| t.is_finite()) {
        lo = lo.min(t);
        hi = hi.max(t);
    }
    let pad = 0.05 * (hi - lo).max(1e-12 * lo.abs().max(1.0));
    (lo - pad, hi + pad)
}

/// A corner plot of posterior samples (`[n * d]` row-major): per parameter a histogram on
/// the diagonal; below it, per pair, a 2-D histogram (40 x 40 bins, darker = more samples);
/// the true values, when given, as red lines and points.
pub fn plot_corner(
    samples: &[f32],
    names: &[String],
    truth: Option<&[f64]>,
    title: &str,
    out: &Path,
) -> Result<()> {
    plotters::style::register_font(
        "sans-serif",
        plotters::style::FontStyle::Normal,
        crate::plot::FONT,
    )
    .map_err(|_| anyhow::anyhow!("the bundled font cannot be loaded"))?;
    let d = names.len();
    let n = samples.len() / d.max(1);
    if d == 0 || n < 2 {
        bail!("a corner plot needs at least 2 samples of at least 1 parameter");
    }
    let column = |j: usize| -> Vec<f64> {
        samples
            .iter()
            .skip(j)
            .step_by(d)
            .map(|&v| v as f64)
            .collect()
    };
    let ranges: Vec<(f64, f64)> = (0..d)
        .map(|j| corner_range(&mut column(j), truth.map(|t| t[j])))
        .collect();
    let panel = 190u32;
    let root =
        BitMapBackend::new(out, (panel * d as u32 + 40, panel * d as u32 + 70)).into_drawing_area();
    root.fill(&WHITE)?;
    let root = root.titled(
        &format!("{title}: {n} posterior samples"),
        ("sans-serif", 20),
    )?;
    let areas = root.split_evenly((d, d));
    for i in 0..d {
        for j in 0..=i {
            let panel = CornerPanel {
                area: &areas[i * d + j],
                x_range: ranges[j],
                y_range: ranges[i],
                x_label: if i + 1 == d { names[j].as_str() } else { "" },
                y_label: if j == 0 && i != j {
                    names[i].as_str()
                } else {
                    ""
                },
                bottom: i + 1 == d,
                left: j == 0,
            };
            if i == j {
                corner_histogram(&panel, &column(j), truth.map(|t| t[j]))?;
            } else {
                corner_pair(&panel, &column(j), &column(i), truth.map(|t| (t[j], t[i])))?;
            }
        }
    }
    root.present()
        .with_context(|| format!("cannot write {}", out.display()))?;
    Ok(())
}

/// Histogram bins per axis of a corner plot's panels.
const CORNER_BINS: usize = 40;

/// The bin of `v` in `[lo, hi)` split into [`CORNER_BINS`] bins (`None` outside).
fn corner_bin(v: f64, (lo, hi): (f64, f64)) -> Option<usize> {
    let b = ((v - lo) / (hi - lo) * CORNER_BINS as f64).floor();
    (b >= 0.0 && b < CORNER_BINS as f64).then_some(b as usize)
}

/// One panel of a corner plot: its drawing area, axis ranges and labels, and whether it sits
/// on the bottom row (x tick labels) or the left column (y tick labels).
struct CornerPanel<'a, 'b> {
    area: &'a DrawingArea<BitMapBackend<'b>, plotters::coord::Shift>,
    x_range: (f64, f64),
    y_range: (f64, f64),
    x_label: &'a str,
    y_label: &'a str,
    bottom: bool,
    left: bool,
}

const CORNER_RED: RGBColor = RGBColor(214, 39, 40);

/// A diagonal panel: the histogram of one parameter's samples, the true value as a red line.
fn corner_histogram(p: &CornerPanel, values: &[f64], truth: Option<f64>) -> Result<()> {
    let xr = p.x_range;
    let mut counts = [0u32; CORNER_BINS];
    for &v in values {
        if let Some(b) = corner_bin(v, xr) {
            counts[b] += 1;
        }
    }
    let top = *counts.iter().max().unwrap_or(&1) as f64 * 1.1;
    let mut chart = ChartBuilder::on(p.area)
        .margin(4)
        .x_label_area_size(if p.bottom { 38 } else { 14 })
        .y_label_area_size(if p.left { 46 } else { 8 })
        .build_cartesian_2d(xr.0..xr.1, 0.0..top.max(1.0))?;
    chart
        .configure_mesh()
        .disable_mesh()
        .y_labels(0)
        .x_labels(3)
        .x_desc(p.x_label)
        .label_style(("sans-serif", 11))
        .draw()?;
    let w = (xr.1 - xr.0) / CORNER_BINS as f64;
    let blue = crate::plot::COLOURS[0];
    chart.draw_series(counts.iter().enumerate().map(|(b, &c)| {
        let x0 = xr.0 + b as f64 * w;
        Rectangle::new([(x0, 0.0), (x0 + w, c as f64)], blue.mix(0.6).filled())
    }))?;
    if let Some(t) = truth {
        chart.draw_series(std::iter::once(PathElement::new(
            [(t, 0.0), (t, top)],
            CORNER_RED.stroke_width(2),
        )))?;
    }
    Ok(())
}

/// A panel below the diagonal: the 2-D histogram of a pair of parameters (darker = more
/// samples), the true values as red lines and a point.
fn corner_pair(p: &CornerPanel, xs: &[f64], ys: &[f64], truth: Option<(f64, f64)>) -> Result<()> {
    let (xr, yr) = (p.x_range, p.y_range);
    let mut grid = vec![0u32; CORNER_BINS * CORNER_BINS];
    for (&x, &y) in xs.iter().zip(ys) {
        if let (Some(bx), Some(by)) = (corner_bin(x, xr), corner_bin(y, yr)) {
            grid[by * CORNER_BINS + bx] += 1;
        }
    }
    let most = *grid.iter().max().unwrap_or(&1) as f64;
    let mut chart = ChartBuilder::on(p.area)
        .margin(4)
        .x_label_area_size(if p.bottom { 38 } else { 14 })
        .y_label_area_size(if p.left { 46 } else { 8 })
        .build_cartesian_2d(xr.0..xr.1, yr.0..yr.1)?;
    chart
        .configure_mesh()
        .disable_mesh()
        .x_labels(3)
        .y_labels(if p.left { 3 } else { 0 })
        .x_desc(p.x_label)
        .y_desc(p.y_label)
        .label_style(("sans-serif", 11))
        .draw()?;
    let (wx, wy) = (
        (xr.1 - xr.0) / CORNER_BINS as f64,
        (yr.1 - yr.0) / CORNER_BINS as f64,
    );
    chart.draw_series(
        grid.iter()
            .enumerate()
            .filter(|(_, &c)| c > 0)
            .map(|(k, &c)| {
                let (bx, by) = ((k % CORNER_BINS) as f64, (k / CORNER_BINS) as f64);
                let shade = (c as f64 / most).sqrt();
                let level = (255.0 * (1.0 - 0.85 * shade)) as u8;
                let (x0, y0) = (xr.0 + bx * wx, yr.0 + by * wy);
                Rectangle::new(
                    [(x0, y0), (x0 + wx, y0 + wy)],
                    RGBColor(level, level, 255).filled(),
                )
            }),
    )?;
    if let Some((tx, ty)) = truth {
        chart.draw_series([
            PathElement::new([(tx, yr.0), (tx, yr.1)], CORNER_RED.stroke_width(1)),
            PathElement::new([(xr.0, ty), (xr.1, ty)], CORNER_RED.stroke_width(1)),
        ])?;
        chart.draw_series(std::iter::once(Circle::new(
            (tx, ty),
            3,
            CORNER_RED.filled(),
        )))?;
    }
    Ok(())
}
