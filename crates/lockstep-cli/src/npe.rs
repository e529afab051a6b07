//! `lockstep npe train SETTINGS.yaml`, `lockstep npe sample CHECKPOINT`, `lockstep npe pp
//! CHECKPOINT`: neural posterior estimation with Dingo-shaped settings (crate lockstep-npe),
//! trained by the lockstep-train engine like `lockstep train` (serial, thread replicas from
//! `local.replicas`, or one MPI rank per replica under `mpirun`/`srun`).

use anyhow::{bail, Context, Result};
use lockstep_comm::World;
use lockstep_npe::calibration::{injection, pp_test, PpResult};
use lockstep_npe::settings::Launch;
use lockstep_npe::trained::{self, Trained};
use lockstep_npe::{CpuAutodiff, NpeModel, NpeSettings, TaskSource};
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
    /// Output folder (default RUN_DIR/pp): pp.png, pp.csv (percentiles), ks.csv.
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
    }
}

/// Reads the settings, checks them and builds the engine config (no output touched).
fn prepare(args: &TrainArgs, world: &World) -> Result<(NpeSettings, Value, EngineConfig)> {
    let (settings, raw) = NpeSettings::from_yaml_file(&args.settings)?;
    let launch = if world.launch.is_mpi_launch() && world.launch.size > 1 {
        Launch::Mpi(world.launch.size)
    } else {
        Launch::SingleProcess
    };
    let dir = std::path::absolute(&args.train_dir)?;
    let json = settings
        .engine_config(&raw, launch, &dir, args.overwrite)
        .map_err(|e| e.in_file(&args.settings))?;
    let cfg = EngineConfig::from_json(&json, Path::new("/")).map_err(|e| match e {
        TrainError::Config(c) => TrainError::Config(c.in_file(&args.settings)),
        other => other,
    })?;
    Ok((settings, json, cfg))
}

fn train(args: &TrainArgs, world: &World) -> Result<()> {
    let prepared = prepare(args, world).map_err(TrainError::Build);
    let (settings, json, cfg) = agree_on_validation(world.comm(), prepared)?;
    let task = settings.task()?;
    let network = trained::network(&settings, task.as_ref())?;
    let opts = EngineOptions {
        resolved_config: json,
        resume: args.resume.clone(),
        ..EngineOptions::default()
    };
    let (seed, n_train) = (settings.data.seed, settings.train_samples());
    let summary = run_job(world, &cfg, &opts, |_rank| {
        Ok((
            NpeModel::<CpuAutodiff>::new(network.clone(), seed, Default::default()),
            TaskSource::dataset(task.clone(), seed, n_train),
        ))
    })?;
    if world.comm().is_chief() {
        let t = trained::load(&summary.output_dir)?;
        if let Some(loss) = t.test_loss()? {
            let n = settings.data.num_samples - n_train;
            let line = format!(
                "test loss (mean negative log-probability over {n} held-out simulations): {loss:.6}"
            );
            println!("{line}");
            let log = summary.output_dir.join(&cfg.log_file);
            std::fs::OpenOptions::new()
                .append(true)
                .open(&log)
                .and_then(|mut f| writeln!(f, "{line}"))
                .with_context(|| format!("cannot append to {}", log.display()))?;
        }
    }
    Ok(())
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
    let out = args
        .output_dir
        .clone()
        .unwrap_or_else(|| t.run_dir.join("pp"));
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
