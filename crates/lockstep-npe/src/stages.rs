//! `lockstep npe train`: the training stages of a settings file (Dingo's `training.stage_N`),
//! run one after the other by lockstep-train's engine, serially, as thread replicas
//! (`local.replicas`) or as one MPI rank per replica (`mpirun`/`srun`).
//!
//! [`train_stages`] first reads and checks everything: the settings, every stage's engine
//! config and frozen blocks, and the stage a `--resume` checkpoint belongs to; a failure ends
//! every rank with one message before any output exists. Then:
//!
//! - a run of one stage trains into `train_dir` itself; a run of several stages into one run
//!   directory per stage, `train_dir/stage_N` ([`crate::trained::stage_dir`]), and the chief
//!   creates `train_dir` (replacing an old one only with `overwrite`, and only when lockstep
//!   wrote it or it is empty);
//! - stage 0 starts from the network's initial parameters, its reduced-basis layer (when the
//!   settings ask for one) initialized from an SVD of keyed inputs ([`crate::svd`]), computed
//!   identically in every process; a resumed stage starts from its checkpoint;
//! - each later stage starts where the previous one ended: the chief reads the final
//!   checkpoint and the engine's startup broadcast hands the values to every replica; the
//!   blocks a stage freezes stay fixed ([`crate::model::NpeModel::freeze`]);
//! - at the end the chief copies the last stage's `posterior.safetensors` into `train_dir`
//!   (runs of several stages) and evaluates the test loss over the held-out simulations
//!   (`data.num_samples` beyond the training share), printed and appended to the log.
//!
//! The chief prints the reduced-basis report, one line per stage and the test loss to its
//! standard output and appends them to the run's log file; the engine prints its own log
//! lines. Messages name the settings file as given and the options of `lockstep npe train`
//! (`--train-dir`, `--overwrite`, `--resume`).

use crate::device::Placement;
use crate::device_model::DeviceModel;
use crate::error::NpeError;
use crate::flow::NpeNetwork;
use crate::model::{NpeModel, EXPORT_FILE};
use crate::settings::{Launch, NpeSettings};
use crate::svd::ReducedBasis;
use crate::tasks::TaskSource;
use crate::trained;
use crate::CpuAutodiff;
use lockstep_comm::World;
use lockstep_train::config::EngineConfig;
use lockstep_train::job::{agree_on_validation, run_job};
use lockstep_train::{EngineOptions, TrainError};
use serde_json::Value;
use std::io::Write;
use std::path::{Path, PathBuf};

/// What `lockstep npe train` is asked to do.
#[derive(Debug, Clone)]
pub struct TrainRequest {
    /// The settings file (YAML, Dingo's shape), as the user named it: messages name it so.
    pub settings_file: PathBuf,
    /// The run directory (Dingo's `--train_dir`); for a run of several stages the folder
    /// holding one run directory per stage.
    pub train_dir: PathBuf,
    /// Replace an existing run directory (or folder of stages) written by lockstep.
    pub overwrite: bool,
    /// Continue from this checkpoint, run directory, `checkpoints/latest` or folder of
    /// stages ([`trained::resolve_checkpoint`]), with any replica count.
    pub resume: Option<PathBuf>,
}

/// A checked run: the settings, the network, one engine config per stage, where each
/// stage's run directory is, and where training starts.
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
    /// The device of each replica this process runs (`local.device`): one per thread
    /// replica, or this rank's under MPI (its node-local rank is its GPU slot).
    placements: Vec<Placement>,
}

/// `path` made absolute against the current directory.
fn absolute(path: &Path) -> Result<PathBuf, NpeError> {
    std::path::absolute(path)
        .map_err(|e| NpeError::io(format!("cannot resolve {}", path.display()), e))
}

/// Reads the settings, checks them (every stage's engine config and frozen blocks), and
/// finds the stage a `--resume` checkpoint belongs to; no output is touched.
fn prepare(request: &TrainRequest, world: &World) -> Result<Prepared, NpeError> {
    let file = &request.settings_file;
    let (settings, raw) = NpeSettings::from_yaml_file(file)?;
    let launch = if world.launch.is_mpi_launch() && world.launch.size > 1 {
        Launch::Mpi(world.launch.size)
    } else {
        Launch::SingleProcess
    };
    let dir = absolute(&request.train_dir)?;
    let n = settings.stages().len();
    let stages_dir = (n > 1).then(|| dir.clone());
    let (first_stage, resume) = match &request.resume {
        None => (0, None),
        Some(p) => {
            let checkpoint = trained::resolve_checkpoint(p)?;
            let (_, _, stage) = trained::run_settings(&checkpoint)?;
            (stage, Some(checkpoint))
        }
    };
    if first_stage >= n {
        return Err(NpeError::Invalid(format!(
            "--resume {}: the checkpoint is of training.stage_{first_stage}, but {} has {n} stage(s)",
            request.resume.as_deref().unwrap_or(Path::new("")).display(),
            file.display()
        )));
    }
    let mut configs = Vec::with_capacity(n);
    for stage in 0..n {
        let (out, overwrite) = match &stages_dir {
            // Later stages of a resumed run replace what an interrupted attempt left.
            Some(d) => (
                trained::stage_dir(d, stage),
                stage > first_stage && resume.is_some(),
            ),
            None => (dir.clone(), request.overwrite),
        };
        let json = settings
            .engine_config(stage, &raw, launch, &out, overwrite)
            .map_err(|e| e.in_file(file))?;
        let cfg = EngineConfig::from_json(&json, Path::new("/")).map_err(|e| match e {
            TrainError::Config(c) => TrainError::Config(c.in_file(file)),
            other => other,
        })?;
        configs.push((json, cfg));
    }
    let task = settings.task()?;
    let network = trained::network(&settings, task.as_ref())?;
    for stage in 0..n {
        network
            .freezing(&settings.frozen_blocks(stage))
            .map_err(|e| e.context(format!("{}: training.stage_{stage}.freeze", file.display())))?;
    }
    let replicas = settings.replicas(launch).map_err(|e| e.in_file(file))?;
    // The devices, opened before any output: no adapter, no CUDA library or device stops the
    // run here with the fix.
    let slots: Vec<usize> = match launch {
        Launch::Mpi(_) => vec![world.launch.local_rank],
        Launch::SingleProcess => (0..replicas).collect(),
    };
    let placements = slots
        .iter()
        .map(|&slot| Placement::for_slot(settings.device(), slot))
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| e.context(file.display().to_string()))?;
    Ok(Prepared {
        settings,
        network,
        configs,
        stages_dir,
        first_stage,
        resume,
        replicas,
        placements,
    })
}

/// The chief creates the folder of a run of several stages (replacing an old one only with
/// `--overwrite`, and only when lockstep wrote it or it is empty); a resumed run keeps it.
///
/// Errors: the folder exists (without `--overwrite`) or may not be replaced, or I/O.
fn create_stages_dir(dir: &Path, overwrite: bool, resumed_inside: bool) -> Result<(), NpeError> {
    use lockstep_core::output_dir::{check_replaceable, write_marker};
    if resumed_inside {
        return Ok(());
    }
    if dir.exists() {
        if !overwrite {
            return Err(NpeError::Output(format!(
                "{} already exists; choose another --train-dir, pass --overwrite to replace it, or --resume {} to continue it",
                dir.display(),
                dir.display()
            )));
        }
        check_replaceable(dir, &[])?;
        std::fs::remove_dir_all(dir)
            .map_err(|e| NpeError::io(format!("cannot remove the old {}", dir.display()), e))?;
    }
    std::fs::create_dir_all(dir)
        .map_err(|e| NpeError::io(format!("cannot create {}", dir.display()), e))?;
    write_marker(
        dir,
        "written by lockstep npe train (one run directory per stage); --overwrite may replace this directory\n",
    )
    .map_err(|e| NpeError::io(format!("cannot write into {}", dir.display()), e))?;
    Ok(())
}

/// The (parameters, running statistics) a finished stage ended with, in layout order, read
/// from its run directory's latest checkpoint.
///
/// Errors: the checkpoint cannot be read or does not fit the network.
fn stage_result(run_dir: &Path) -> Result<(Vec<f32>, Vec<f32>), NpeError> {
    let t = trained::load(run_dir)?;
    Ok((t.model.parameters(), t.model.state().to_vec()))
}

/// A validation result as the engine's agreement wants it (the error kept whole as its
/// cause).
fn for_agreement<T>(result: Result<T, NpeError>) -> Result<T, TrainError> {
    result.map_err(|e| TrainError::Build(e.into()))
}

/// Trains the posterior of `request.settings_file` through all its stages, on this process's
/// share of the job `world` (every rank of an MPI job calls it): see the module docs for
/// what happens in which order.
///
/// Errors: [`NpeError::Train`] for what the engine reports, including settings errors that
/// every rank agreed on before any output ([`TrainError::is_agreed`], so the caller can end
/// all ranks cleanly with one message); otherwise a settings error (`FILE: KEY: PROBLEM`),
/// an existing `train_dir` without `overwrite`, a checkpoint that cannot be resumed, a failed
/// reduced-basis SVD, or I/O on the run's files.
pub fn train_stages(request: &TrainRequest, world: &World) -> Result<(), NpeError> {
    let p = agree_on_validation(world.comm(), for_agreement(prepare(request, world)))?;
    let (settings, network) = (&p.settings, &p.network);
    let task = settings.task()?;
    let (seed, n_train) = (settings.data.seed, settings.train_samples());
    let chief = world.comm().is_chief();
    if let Some(dir) = &p.stages_dir {
        let inside = p.resume.as_ref().is_some_and(|f| f.starts_with(dir));
        let made = if chief {
            for_agreement(create_stages_dir(dir, request.overwrite, inside))
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
    // The device each replica computes on, said by the chief and by any replica that shares
    // its GPU with another one of its node.
    let threads = matches!(p.placements.len(), n if n > 1);
    let slot_of = |rank: usize| {
        if threads {
            rank
        } else {
            world.launch.local_rank
        }
    };
    let mut device_notes = Vec::new();
    for (i, placement) in p.placements.iter().enumerate() {
        let rank = if threads { i } else { world.launch.rank };
        let slot = slot_of(rank);
        if placement.kind() != crate::device::DeviceKind::Cpu
            && (rank == 0 || placement.shared(slot))
        {
            let shared = if placement.shared(slot) {
                " (shared with another replica of this node)"
            } else {
                ""
            };
            let line = format!("rank {rank}: computes on {}{shared}", placement.describe());
            eprintln!("{line}");
            if chief {
                device_notes.push(line);
            }
        }
    }
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
        notes.append(&mut device_notes);
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
        let summary = run_job(world, cfg, &opts, |rank| {
            let placement = &p.placements[if threads { rank } else { 0 }];
            let mut model = DeviceModel::new(network.clone(), seed, placement)?;
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
                for_agreement(stage_result(&last_dir))
            } else {
                Ok(values.clone())
            };
            values = agree_on_validation(world.comm(), next)?;
        }
    }
    if chief {
        let log = last_dir.join(&p.configs[n - 1].1.log_file);
        if let Some(dir) = &p.stages_dir {
            let export = last_dir.join(EXPORT_FILE);
            let bytes = std::fs::read(&export)
                .map_err(|e| NpeError::io(format!("cannot read {}", export.display()), e))?;
            lockstep_train::checkpoint::write_atomic(&dir.join(EXPORT_FILE), &bytes)?;
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
fn append_log(log: &Path, lines: &[String]) -> Result<(), NpeError> {
    if lines.is_empty() {
        return Ok(());
    }
    std::fs::OpenOptions::new()
        .append(true)
        .open(log)
        .and_then(|mut f| lines.iter().try_for_each(|l| writeln!(f, "{l}")))
        .map_err(|e| NpeError::io(format!("cannot append to {}", log.display()), e))
}
