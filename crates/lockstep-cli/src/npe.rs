//! `lockstep npe train SETTINGS.yaml`, `lockstep npe sample CHECKPOINT`, `lockstep npe pp
//! CHECKPOINT`, `lockstep npe export CHECKPOINT`, `lockstep npe submit SETTINGS.yaml`: neural posterior estimation with
//! Dingo-shaped settings (crate lockstep-npe), trained by the lockstep-train engine like
//! `lockstep train` (serial, thread replicas from `local.replicas`, or one MPI rank per
//! replica under `mpirun`/`srun`).
//!
//! This module reads the arguments and writes the files a user asked for; the training
//! stages run in [`lockstep_npe::stages`], the figures are drawn by [`crate::plot::npe`].

use crate::plot::figure::PlotFormat;
use crate::plot::npe::{plot_corner, plot_pp};
use anyhow::{bail, Context, Result};
use lockstep_comm::World;
use lockstep_npe::calibration::injection;
use lockstep_npe::export::{export_trained, ExportFormat};
use lockstep_npe::sampling::{self, PriorFilter, SampleRequest, SAMPLE_CHUNK};
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
    /// Write the posterior as a PyTorch state dict (safetensors) and settings (JSON) that
    /// nflows/Dingo modules load with load_state_dict.
    Export(ExportArgs),
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
    /// For a quick try: simulations in the data set (`data.num_samples` of the settings;
    /// stored with the run as if the file said so).
    #[arg(allow_negative_numbers = true, long)]
    pub num_samples: Option<u64>,
    /// For a quick try: epochs of every training stage (`training.stage_N.epochs`).
    #[arg(allow_negative_numbers = true, long)]
    pub epochs: Option<u64>,
}

/// Options of `lockstep npe sample`.
#[derive(Debug, clap::Args)]
pub struct SampleArgs {
    /// A checkpoint file, checkpoints/latest, or a run directory (its latest checkpoint).
    pub checkpoint: PathBuf,
    /// The observation x: comma-separated values, or a file of whitespace/comma-separated
    /// values (.csv, .txt); the first value may be negative (`--observation -0.5,0.3`).
    #[arg(long, conflicts_with = "injection", allow_hyphen_values = true)]
    pub observation: Option<String>,
    /// Instead of --observation: simulate injection number N of the P-P stream (its true
    /// parameters are written next to the samples: `injection_parameters` in a .h5 file,
    /// `NAME.injection.csv` beside a `NAME.csv`).
    #[arg(allow_negative_numbers = true, long)]
    pub injection: Option<u64>,
    /// Posterior samples to draw (any count: drawn and written in chunks; refused before
    /// writing when the file would not fit where it goes).
    #[arg(allow_negative_numbers = true, long, default_value_t = 10_000)]
    pub num_samples: u64,
    /// Output file: .h5/.hdf5 (datasets samples [n, d], parameter_names, observation,
    /// injection_parameters) or .csv (a header of parameter names).
    #[arg(long, default_value = "posterior_samples.h5")]
    pub output: PathBuf,
    /// Seed of the base draws (a negative seed stands for 2^64 plus it, as in
    /// torch.manual_seed).
    #[arg(allow_negative_numbers = true, long, default_value_t = 0, value_parser = crate::flags::parse_seed)]
    pub seed: u64,
    /// Also draw a corner plot of the samples into this file, PNG or SVG as its extension
    /// says (.png, .svg): 1-D histograms on the diagonal, 2-D histograms below it, the true
    /// values (with --injection) marked in red.
    #[arg(long)]
    pub corner: Option<PathBuf>,
    /// Keep only samples inside the prior's support (drawing more until --num-samples are
    /// kept, at most 100 draws per sample kept; refused with the acceptance rate when the
    /// posterior lies mostly outside). Without it, the fraction outside is reported.
    #[arg(long)]
    pub inside_prior: bool,
    /// Where the network computes: cpu, gpu (burn's wgpu backend on the first adapter
    /// `lockstep info` lists) or cuda (a build with the cuda feature).
    #[arg(long, default_value = "cpu")]
    pub device: String,
}

/// Options of `lockstep npe export`.
#[derive(Debug, clap::Args)]
pub struct ExportArgs {
    /// A checkpoint file, checkpoints/latest, or a run directory (its latest checkpoint).
    pub checkpoint: PathBuf,
    /// The layout: nflows (alias dingo): Dingo's FlowWrapper of an nflows Flow and its
    /// embedding network.
    #[arg(long, default_value = "nflows")]
    pub format: String,
    /// Folder to write posterior.nflows.safetensors and posterior.nflows.json into (created
    /// if missing; default: the run directory of the checkpoint).
    #[arg(long)]
    pub output_dir: Option<PathBuf>,
    /// (θ, x) pairs of the task written with lockstep's log-probabilities, to check the
    /// rebuilt model against.
    #[arg(allow_negative_numbers = true, long, default_value_t = 8)]
    pub check_pairs: usize,
}

/// Options of `lockstep npe pp`.
#[derive(Debug, clap::Args)]
pub struct PpArgs {
    /// A checkpoint file, checkpoints/latest, or a run directory (its latest checkpoint).
    pub checkpoint: PathBuf,
    /// Injections simulated from the task's prior.
    #[arg(allow_negative_numbers = true, long, default_value_t = 200)]
    pub injections: usize,
    /// Posterior samples per injection.
    #[arg(allow_negative_numbers = true, long, default_value_t = 1000)]
    pub num_samples: usize,
    /// Seed of the injections and base draws (default: the settings' data.seed; a negative
    /// seed stands for 2^64 plus it, as in torch.manual_seed).
    #[arg(allow_negative_numbers = true, long, value_parser = crate::flags::parse_seed)]
    pub seed: Option<u64>,
    /// Output folder (default RUN_DIR/pp, or TRAIN_DIR/pp for the folder of a run of several
    /// stages): pp.png (or pp.svg), pp.csv (percentiles), ks.csv.
    #[arg(long)]
    pub output_dir: Option<PathBuf>,
    /// The P-P plot's file format: png, or svg (vector graphics, for papers).
    #[arg(long, value_enum, default_value = "png")]
    pub plot_format: PlotFormat,
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
        NpeCommand::Export(a) => export(a),
    }
}

/// Writes the nflows/Dingo export of a trained posterior (both files atomically, after
/// every check) and prints the files.
fn export(args: &ExportArgs) -> Result<()> {
    ExportFormat::parse(&args.format)?;
    if args.check_pairs == 0 {
        bail!("--check-pairs must be at least 1");
    }
    let t = trained::load(&args.checkpoint)?;
    let out = export_trained(&t, args.check_pairs)?;
    let dir = args.output_dir.clone().unwrap_or_else(|| t.run_dir.clone());
    std::fs::create_dir_all(&dir)
        .with_context(|| format!("cannot create the folder {}", dir.display()))?;
    for f in out.write(&dir)? {
        println!("wrote {}", f.display());
    }
    println!(
        "from {} (update {}); build the modules as scripts/peers/nflows_export_check.py does",
        t.checkpoint.display(),
        t.update
    );
    Ok(())
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
        force_cpu: crate::flags::cpu_only(),
        overrides: lockstep_npe::settings::Overrides {
            num_samples: crate::flags::positive("--num-samples", args.num_samples)?,
            epochs: crate::flags::positive("--epochs", args.epochs)?,
        },
    };
    train_stages(&request, world)
        .map(drop)
        .map_err(|e| match e {
            // The engine's errors stay a TrainError, so that `main` ends the ranks that agreed on
            // a failure cleanly (`TrainError::is_agreed`).
            NpeError::Train(t) => anyhow::Error::new(t),
            other => anyhow::Error::new(other),
        })
}

/// Parses an observation: comma/whitespace-separated numbers, or a file holding them.
/// Returns the values and where they came from (`--observation` or the file), for messages.
fn read_observation(spec: &str) -> Result<(Vec<f64>, String)> {
    let path = Path::new(spec);
    let (text, source) = if path.is_file() {
        (
            std::fs::read_to_string(path).with_context(|| format!("cannot read {spec}"))?,
            format!("--observation {spec}"),
        )
    } else {
        (spec.to_string(), "--observation".to_string())
    };
    let values = text
        .split(|c: char| c == ',' || c.is_whitespace())
        .filter(|t| !t.is_empty())
        .enumerate()
        .map(|(i, t)| {
            t.parse::<f64>().with_context(|| {
                if path.is_file() {
                    format!("{spec}: value {} ({t:?}) is not a number", i + 1)
                } else {
                    format!("--observation: value {} ({t:?}) is not a number (give comma-separated values or a file)", i + 1)
                }
            })
        })
        .collect::<Result<Vec<f64>>>()?;
    Ok((values, source))
}

/// The files of one command, written under hidden temporary names next to their final
/// names and moved into place together by [`Staged::commit`] once every step has succeeded;
/// dropped without a commit (an error on the way), the temporary files are removed, so a
/// failed command leaves the files of an earlier run as they were.
#[derive(Default)]
struct Staged {
    /// (temporary, final) paths, in the order they were asked for.
    moves: Vec<(PathBuf, PathBuf)>,
}

impl Staged {
    /// The temporary path to write `path`'s contents into (its folder created); the
    /// extension stays last, since the figure and HDF5 writers go by it.
    fn path_for(&mut self, path: &Path) -> Result<PathBuf> {
        let dir = match path.parent() {
            Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
            _ => PathBuf::from("."),
        };
        std::fs::create_dir_all(&dir)
            .with_context(|| format!("cannot create {}", dir.display()))?;
        let name = path
            .file_name()
            .with_context(|| format!("{} is not a file name", path.display()))?;
        let tmp = dir.join(format!(
            ".tmp{}-{}-{}",
            std::process::id(),
            self.moves.len(),
            name.to_string_lossy()
        ));
        self.moves.push((tmp.clone(), path.to_path_buf()));
        Ok(tmp)
    }

    /// Moves every file into place (a rename each, in the order asked for).
    ///
    /// Errors: a rename fails (the files not yet moved are removed).
    fn commit(mut self) -> Result<()> {
        for (tmp, path) in std::mem::take(&mut self.moves) {
            std::fs::rename(&tmp, &path).with_context(|| {
                format!("cannot rename {} to {}", tmp.display(), path.display())
            })?;
        }
        Ok(())
    }
}

impl Drop for Staged {
    fn drop(&mut self) {
        for (tmp, _) in &self.moves {
            let _ = std::fs::remove_file(tmp);
        }
    }
}

/// The corner plot of `npe sample --corner` shows at most this many samples (the first).
const CORNER_MAX: u64 = 1_000_000;

/// Free bytes for an unprivileged user on the file system holding `dir`, when known.
fn free_bytes(dir: &Path) -> Option<u64> {
    use std::os::unix::ffi::OsStrExt;
    let c = std::ffi::CString::new(dir.as_os_str().as_bytes()).ok()?;
    // SAFETY: statvfs is a plain C struct of integers, for which all zeroes is valid.
    let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
    // SAFETY: `c` is a NUL-terminated path and `st` a writable statvfs.
    if unsafe { libc::statvfs(c.as_ptr(), &mut st) } != 0 {
        return None;
    }
    Some((st.f_bavail as u64).saturating_mul(st.f_frsize as u64))
}

/// Refuses a sample count whose output cannot be written: a size beyond 64 bits, or more
/// than the free space where it goes (estimated before anything is written).
fn check_sample_size(args: &SampleArgs, d: usize, csv: bool) -> Result<()> {
    let n = args.num_samples;
    // float32 in HDF5; in CSV up to about 15 characters per value and separator.
    let per_value: u64 = if csv { 15 } else { 4 };
    let Some(bytes) = n.checked_mul(d as u64 * per_value) else {
        bail!(
            "--num-samples {n}: {n} samples of {d} parameters do not fit in a file (the size overflows 64 bits); draw fewer"
        );
    };
    let dir = match args.output.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
        _ => PathBuf::from("."),
    };
    let probe = dir
        .ancestors()
        .find(|p| p.exists())
        .unwrap_or(Path::new("."));
    if let Some(free) = free_bytes(probe) {
        if bytes > free {
            bail!(
                "--num-samples {n}: the samples take about {} but {} has {} free; draw fewer or write elsewhere (--output)",
                lockstep_core::memory::human_bytes(bytes),
                probe.display(),
                lockstep_core::memory::human_bytes(free)
            );
        }
    }
    Ok(())
}

/// Draws `--num-samples` samples (all, or with `--inside-prior` the first ones inside the
/// prior) in chunks of [`SAMPLE_CHUNK`], each chunk's rows handed to `sink`
/// ([`lockstep_npe::sampling::draw`]), and returns the filter's counts.
///
/// Errors: `sink`'s errors; with `--inside-prior`, an acceptance rate too low to keep the
/// samples within 100 draws each.
fn draw(
    t: &Trained,
    model: &DeviceModel,
    xf: &[f32],
    args: &SampleArgs,
    sink: &mut dyn FnMut(&[f32]) -> Result<()>,
) -> Result<PriorFilter> {
    let request = SampleRequest {
        num_samples: args.num_samples,
        seed: args.seed,
        inside_prior: args.inside_prior,
        chunk: SAMPLE_CHUNK,
        inside_prior_name: "--inside-prior",
    };
    sampling::draw(t, model, xf, &request, sink)
}

/// Checks `npe sample`'s options that need no run; returns the output's extension
/// (lowercase).
///
/// Errors: an output that is neither .h5/.hdf5 nor .csv, a corner plot of an unknown format
/// or of one sample, no samples, `--cpu` with a GPU `--device`.
fn check_sample_args(args: &SampleArgs) -> Result<String> {
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
    if let Some(corner) = &args.corner {
        PlotFormat::of_path(corner, "--corner")?;
    }
    if args.num_samples == 0 {
        bail!("--num-samples must be at least 1");
    }
    if let (Some(corner), 1) = (&args.corner, args.num_samples) {
        bail!(
            "--corner {}: a corner plot needs at least 2 samples, and --num-samples is 1",
            corner.display()
        );
    }
    crate::flags::check_cpu_flag(&args.device)?;
    Ok(ext)
}

fn sample(args: &SampleArgs) -> Result<()> {
    let ext = check_sample_args(args)?;
    let t = trained::load(&args.checkpoint)?;
    let model = model_on(&t, &args.device)?;
    let (x, truth, source) = match (&args.observation, args.injection) {
        (Some(spec), _) => {
            let (x, source) = read_observation(spec)?;
            (x, None, source)
        }
        (None, Some(i)) => {
            let (theta, x) = injection(t.task.as_ref(), t.settings.data.seed, i);
            (x, Some(theta), format!("--injection {i}: the simulated x"))
        }
        (None, None) => bail!("give --observation VALUES|FILE or --injection N"),
    };
    let xf = t.checked_observation(&x, &source)?;
    let names = t.task.parameter_names();
    let d = names.len();
    let csv = ext == "csv";
    check_sample_size(args, d, csv)?;
    let n = args.num_samples;
    // Drawn and written chunk by chunk: memory stays bounded whatever the count; the file
    // appears under its name only when complete.
    let mut corner: Vec<f32> = Vec::new();
    let keep = args.corner.as_ref().map_or(0, |_| CORNER_MAX.min(n)) as usize * d;
    let mut keep_for_corner = |rows: &[f32]| {
        let room = keep - corner.len();
        corner.extend_from_slice(&rows[..room.min(rows.len())]);
    };
    // Every file goes to a temporary name and into place only when all are written.
    let mut staged = Staged::default();
    let samples_tmp = staged.path_for(&args.output)?;
    let filter = if csv {
        write_samples_csv(
            &samples_tmp,
            &t,
            &model,
            &xf,
            args,
            &names,
            &mut keep_for_corner,
        )?
    } else {
        write_samples_h5(
            &samples_tmp,
            &t,
            &model,
            &xf,
            args,
            &names,
            &x,
            truth.as_deref(),
            &mut keep_for_corner,
        )?
    };
    let truth_csv = match (&truth, csv) {
        (Some(theta), true) => {
            let path = args.output.with_extension("injection.csv");
            write_truth_csv(&staged.path_for(&path)?, &names, theta)?;
            Some(path)
        }
        _ => None,
    };
    if let Some(plot) = &args.corner {
        let title = match args.injection {
            Some(i) => format!("{}, injection {i}", t.task.name()),
            None => t.task.name().to_string(),
        };
        plot_corner(
            &corner,
            &names,
            truth.as_deref(),
            &title,
            &staged.path_for(plot)?,
        )?;
    }
    staged.commit()?;
    report_samples(
        args,
        &t,
        &names,
        truth_csv.as_deref(),
        &filter.report(n, "--inside-prior"),
    );
    Ok(())
}

/// What `npe sample` wrote: the true parameters' file, the corner plot, the prior filter's
/// report and the samples.
fn report_samples(
    args: &SampleArgs,
    t: &Trained,
    names: &[String],
    truth_csv: Option<&Path>,
    filter_report: &str,
) {
    let n = args.num_samples;
    if let Some(path) = truth_csv {
        println!(
            "true parameters of the injection written to {}",
            path.display()
        );
    }
    if let Some(plot) = &args.corner {
        if n > CORNER_MAX {
            println!(
                "corner plot of the first {CORNER_MAX} samples written to {}",
                plot.display()
            );
        } else {
            println!("corner plot written to {}", plot.display());
        }
    }
    println!("{filter_report}");
    println!(
        "{} posterior samples of {} ({}) from {} (update {}) written to {}{}",
        n,
        t.task.name(),
        names.join(", "),
        t.checkpoint.display(),
        t.update,
        args.output.display(),
        lockstep_core::memory::peak_rss_bytes().map_or(String::new(), |b| format!(
            " (peak memory {})",
            lockstep_core::memory::human_bytes(b)
        ))
    );
}

/// Writes the CSV samples file: a header of parameter names, then the samples drawn chunk
/// by chunk ([`draw`]; each chunk also handed to `keep`).
fn write_samples_csv(
    path: &Path,
    t: &Trained,
    model: &DeviceModel,
    xf: &[f32],
    args: &SampleArgs,
    names: &[String],
    keep: &mut dyn FnMut(&[f32]),
) -> Result<PriorFilter> {
    use std::io::Write;
    let f =
        std::fs::File::create(path).with_context(|| format!("cannot create {}", path.display()))?;
    let mut w = std::io::BufWriter::new(f);
    writeln!(w, "{}", names.join(","))?;
    let d = names.len();
    let filter = draw(t, model, xf, args, &mut |rows| {
        keep(rows);
        for row in rows.chunks_exact(d) {
            let r: Vec<String> = row.iter().map(|v| format!("{v}")).collect();
            writeln!(w, "{}", r.join(","))?;
        }
        Ok(())
    })?;
    w.flush()?;
    Ok(filter)
}

/// Writes an injection's true parameters as CSV: a header of parameter names and one row.
fn write_truth_csv(path: &Path, names: &[String], theta: &[f64]) -> Result<()> {
    let row: Vec<String> = theta.iter().map(|v| format!("{v}")).collect();
    std::fs::write(path, format!("{}\n{}\n", names.join(","), row.join(",")))
        .with_context(|| format!("cannot write {}", path.display()))
}

/// Writes the HDF5 samples file: `samples [n, d]` drawn chunk by chunk straight into the
/// dataset ([`draw`]; each chunk also handed to `keep`), `parameter_names`, `observation`,
/// `fraction_outside_prior` (of the samples drawn) and, for an injection,
/// `injection_parameters`.
#[allow(clippy::too_many_arguments)]
fn write_samples_h5(
    path: &Path,
    t: &Trained,
    model: &DeviceModel,
    xf: &[f32],
    args: &SampleArgs,
    names: &[String],
    x: &[f64],
    truth: Option<&[f64]>,
    keep: &mut dyn FnMut(&[f32]),
) -> Result<PriorFilter> {
    use hdf5::types::VarLenUnicode;
    let mut write = || -> Result<PriorFilter> {
        let f = hdf5::File::create(path)
            .with_context(|| format!("cannot create {}", path.display()))?;
        let d = names.len();
        let rows = usize::try_from(args.num_samples)
            .context("the sample count does not fit this machine's usize")?;
        let ds = f.new_dataset::<f32>().shape([rows, d]).create("samples")?;
        let mut done = 0usize;
        let filter = draw(t, model, xf, args, &mut |chunk| {
            keep(chunk);
            let r = chunk.len() / d;
            let view = ndarray::ArrayView2::from_shape((r, d), chunk)?;
            ds.write_slice(view, (done..done + r, ..))?;
            done += r;
            Ok(())
        })?;
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
        f.new_dataset::<f64>()
            .shape([1])
            .create("fraction_outside_prior")?
            .write_raw(&[filter.outside_fraction()])?;
        if let Some(t) = truth {
            f.new_dataset::<f64>()
                .shape([t.len()])
                .create("injection_parameters")?
                .write_raw(t)?;
        }
        Ok(filter)
    };
    write()
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
    crate::flags::check_cpu_flag(&args.device)?;
    let t: Trained = trained::load(&args.checkpoint)?;
    // What the test holds, estimated before anything is written: per injection its true
    // values and percentiles (f64), and one injection's samples with the flow's activations.
    let d = t.task.theta_dim() as u64;
    let per_sample = 4 * (d + t.model.network.activation_floats_per_sample());
    let mut m = lockstep_core::memory::MemoryEstimate::new();
    m.add(
        "true values and percentiles of every injection",
        (args.injections as u64).saturating_mul(16 * d),
    )
    .add(
        "posterior samples of one injection",
        (args.num_samples as u64).saturating_mul(per_sample),
    )
    .driven_by("--injections")
    .driven_by("--num-samples");
    m.check_here("this P-P test")?;
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
    // A long test reports its progress on stderr: every 10 s, with an estimate of the rest.
    let total = args.injections;
    let mut last = std::time::Instant::now();
    let mut progress = |done: usize| {
        if last.elapsed().as_secs_f64() >= 10.0 && done < total {
            last = std::time::Instant::now();
            let spent = start.elapsed().as_secs_f64();
            let left = spent / done as f64 * (total - done) as f64;
            eprintln!(
                "pp: {done} of {total} injections ({:.1}%) in {spent:.0} s, about {left:.0} s left",
                100.0 * done as f64 / total as f64
            );
        }
    };
    let r = model.pp_test_with_progress(
        t.task.as_ref(),
        seed,
        args.injections,
        args.num_samples,
        &mut progress,
    )?;
    std::fs::create_dir_all(&out).with_context(|| format!("cannot create {}", out.display()))?;
    let mut csv = r.names.join(",");
    csv.push('\n');
    for row in &r.percentiles {
        let v: Vec<String> = row.iter().map(|p| format!("{p}")).collect();
        csv.push_str(&v.join(","));
        csv.push('\n');
    }
    // The three files go into place together, when all are written.
    let mut staged = Staged::default();
    let tmp = staged.path_for(&out.join("pp.csv"))?;
    std::fs::write(&tmp, &csv).with_context(|| format!("cannot write {}", tmp.display()))?;
    let mut ks = String::from("parameter,ks_p_value\n");
    for (n, p) in r.names.iter().zip(&r.p_values) {
        ks.push_str(&format!("{n},{p}\n"));
    }
    let tmp = staged.path_for(&out.join("ks.csv"))?;
    std::fs::write(&tmp, &ks).with_context(|| format!("cannot write {}", tmp.display()))?;
    let plot = out.join(format!("pp.{}", args.plot_format.extension()));
    plot_pp(&r, &staged.path_for(&plot)?, t.task.name())?;
    staged.commit()?;
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
    println!("wrote {}, pp.csv and ks.csv", plot.display());
    Ok(())
}
