//! `lockstep npe train`: the training stages of a settings file (Dingo's `training.stage_N`),
//! run one after the other by lockstep-train's engine, serially, as thread replicas
//! (`local.replicas`) or as one MPI rank per replica (`mpirun`/`srun`).
//!
//! [`train_stages`] first reads and checks everything: the settings, the data's scale
//! ([`crate::trained::checked_network`]), every stage's engine config and frozen blocks (a
//! stage may not freeze every block), and where a `--resume` checkpoint continues; a failure
//! ends every rank with one message before any output exists. A `--resume` path may be
//! relative. A checkpoint in the middle of stage N resumes stage N through the engine
//! (optimizer state and schedule); one with all of stage N's updates continues with stage
//! N+1 from its parameters (as Dingo does), provided the settings keep the data, model and
//! stages up to N of the run that wrote it; a checkpoint that ends the last stage is refused
//! (add a stage to train further). Then:
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
//! A loss or parameter that becomes non-finite stops the stage with a message naming
//! `training.stage_N.optimizer.lr` and the data, appended to the stage's run.log; every
//! replica sees the same value, so every rank ends cleanly (an agreed error, no MPI abort).
//! So does a stage whose loss scaler keeps skipping updates (mixed precision): its message
//! names `training.stage_N.grad_scaler` and `automatic_mixed_precision`, and a stage that
//! applied no update exports nothing.
//!
//! A mid-stage `--resume` may change only what [`MAY_CHANGE_ON_RESUME`] lists (where the run
//! computes, and mixed precision, a property of the device); any other differing key is
//! refused by name, as the settings file spells it, with both values, before any output.
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
use crate::settings::{settings_key, Launch, NpeSettings, OptimizerSettings};
use crate::svd::ReducedBasis;
use crate::tasks::TaskSource;
use crate::trained;
use crate::CpuAutodiff;
use lockstep_comm::World;
use lockstep_core::config::ConfigError;
use lockstep_train::config::EngineConfig;
use lockstep_train::job::{agree_on_validation, run_job};
use lockstep_train::{EngineOptions, TrainError, TrainSummary};
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
    /// `--cpu`: compute on the CPU whatever `local.device` says (the run says so).
    pub force_cpu: bool,
    /// Quick-try overrides of the settings file (`--num-samples`, `--epochs`), applied
    /// before it is checked and stored with the run as if the file said so.
    pub overrides: crate::settings::Overrides,
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
    /// The stage to start with and the checkpoint to resume it from (mid-stage, through
    /// the engine).
    first_stage: usize,
    resume: Option<PathBuf>,
    /// The checkpoint at the end of the stage before `first_stage` that `first_stage`
    /// starts from (a resumed run whose checkpoint ends a stage).
    start_from: Option<PathBuf>,
    /// Replicas of this launch ([`NpeSettings::replicas`]).
    replicas: usize,
    /// The config hash a mid-stage checkpoint may carry in place of this run's own
    /// ([`check_resume_settings`]).
    accept_config_hash: Option<String>,
    /// Notes about the data for the log (constant x components left unscaled).
    data_notes: Vec<String>,
    /// The device of each replica this process runs (`local.device`): one per thread
    /// replica, or this rank's under MPI (its node-local rank is its GPU slot).
    placements: Vec<Placement>,
}

/// `path` made absolute against the current directory.
fn absolute(path: &Path) -> Result<PathBuf, NpeError> {
    std::path::absolute(path)
        .map_err(|e| NpeError::io(format!("cannot resolve {}", path.display()), e))
}

/// An engine config error of stage `stage`, its key renamed to the settings file's key
/// ([`settings_key`]) and the file named.
fn in_settings(e: TrainError, file: &Path, stage: usize) -> TrainError {
    match e {
        TrainError::Config(mut c) => {
            c.key = settings_key(stage, &c.key);
            TrainError::Config(c.in_file(file))
        }
        TrainError::Refused(inner) => {
            TrainError::Refused(Box::new(in_settings(*inner, file, stage)))
        }
        other => other,
    }
}

/// The keys of `npe train` settings that may differ between a checkpoint's run and the
/// run that resumes it mid-stage: the `local` section (where and how the run computes:
/// device, replicas, workers, logging) and mixed precision, a property of the device
/// (`training.stage_N.automatic_mixed_precision`, `training.stage_N.grad_scaler`).
pub const MAY_CHANGE_ON_RESUME: &str = "the local section (device, replicas, num_workers, checkpoint_epochs, log_every), training.stage_N.automatic_mixed_precision and training.stage_N.grad_scaler";

/// Whether `key` (dotted, as a settings file spells it) may change on resume
/// ([`MAY_CHANGE_ON_RESUME`]).
fn may_change_on_resume(key: &str) -> bool {
    let mut parts = key.split('.');
    match (parts.next(), parts.next(), parts.next()) {
        (Some("local"), _, _) => true,
        (Some("training"), Some(stage), Some(k)) => {
            stage.starts_with("stage_") && matches!(k, "automatic_mixed_precision" | "grad_scaler")
        }
        _ => false,
    }
}

/// Appends to `out` the dotted keys under `prefix` whose values differ between `old` (the
/// checkpoint's run) and `new` (these settings), each as `KEY (OLD there, NEW here)`, where
/// a missing key reads `not set`; keys that [`may_change_on_resume`] are left out.
fn differing_keys(old: Option<&Value>, new: Option<&Value>, prefix: &str, out: &mut Vec<String>) {
    if may_change_on_resume(prefix) {
        return;
    }
    match (old, new) {
        (Some(Value::Object(a)), Some(Value::Object(b))) => {
            let mut keys: Vec<&String> = a.keys().chain(b.keys()).collect();
            keys.sort();
            keys.dedup();
            for k in keys {
                let key = if prefix.is_empty() {
                    k.clone()
                } else {
                    format!("{prefix}.{k}")
                };
                differing_keys(a.get(k), b.get(k), &key, out);
            }
        }
        (a, b) if a != b => {
            let show = |v: Option<&Value>| v.map_or("not set".to_string(), Value::to_string);
            out.push(format!("{prefix} ({} there, {} here)", show(a), show(b)));
        }
        _ => {}
    }
}

/// Checks that settings `raw` may resume the checkpoint `checkpoint` mid-stage: the settings
/// of the run that wrote it (its `config.json`) differ at most in keys that
/// [`may_change_on_resume`]. Returns the config hash the checkpoint may then carry in place
/// of this run's own (the mixed-precision keys differ), when that run's `config.json` is the
/// one the checkpoint was written with.
///
/// Errors: the differing keys, named as the settings file spells them, with both values.
fn check_resume_settings(
    request: &TrainRequest,
    raw: &Value,
    checkpoint: &Path,
) -> Result<Option<String>, NpeError> {
    let config_path = checkpoint
        .parent()
        .and_then(Path::parent)
        .unwrap_or(Path::new("."))
        .join("config.json");
    let Ok(old) = lockstep_core::config::read_json(&config_path) else {
        return Ok(None);
    };
    let mut new = raw.clone();
    if let Some(o) = new.as_object_mut() {
        o.remove("local");
    }
    let mut keys = Vec::new();
    let old_npe = old.get("npe").map(crate::settings::stored_npe_section);
    differing_keys(old_npe.as_ref(), Some(&new), "", &mut keys);
    if !keys.is_empty() {
        return Err(NpeError::Invalid(format!(
            "--resume {}: {} differs from the settings of the run that wrote the checkpoint ({}) in {}; on resume only {} may change: resume with that run's settings, or train with these into another --train-dir",
            request.resume.as_deref().unwrap_or(checkpoint).display(),
            request.settings_file.display(),
            config_path.display(),
            keys.join(", "),
            MAY_CHANGE_ON_RESUME
        )));
    }
    let state = lockstep_train::checkpoint::read(checkpoint)?;
    let hash = lockstep_train::engine::config_hash(&old);
    Ok((state.config_hash == hash).then_some(hash))
}

/// Where a resumed run starts: `(first stage, checkpoint the engine resumes mid-stage,
/// checkpoint at the end of the previous stage that the first stage starts from)`.
///
/// A checkpoint with every update of its stage N ends that stage: the run continues with
/// stage N+1 from its parameters (as Dingo does), provided the settings describe the same
/// data, model and stages up to N as the run that wrote it. A checkpoint of the last stage
/// that ends it leaves nothing to train and is refused.
fn resume_point(
    request: &TrainRequest,
    settings: &NpeSettings,
    raw: &Value,
    dir: &Path,
    updates_of: impl Fn(usize) -> Result<u64, NpeError>,
) -> Result<(usize, Option<PathBuf>, Option<PathBuf>), NpeError> {
    let Some(given) = &request.resume else {
        return Ok((0, None, None));
    };
    let file = &request.settings_file;
    let n = settings.stages().len();
    let checkpoint = trained::resolve_checkpoint(&absolute(given)?)?;
    let (run_dir, old, stage) = trained::run_settings(&checkpoint)?;
    let shown = given.display();
    if stage >= n {
        return Err(NpeError::Invalid(format!(
            "--resume {shown}: the checkpoint is of training.stage_{stage}, but {} has {n} stage(s)",
            file.display()
        )));
    }
    let update = lockstep_train::checkpoint::read(&checkpoint)?.update;
    let updates = updates_of(stage)?;
    if update < updates {
        return Ok((stage, Some(checkpoint), None));
    }
    // The checkpoint ends its stage.
    let differs = if old.data != settings.data {
        Some("data".to_string())
    } else if old.model != settings.model {
        Some("model".to_string())
    } else {
        (0..=stage)
            .find(|&k| old.stages().get(k) != settings.stages().get(k))
            .map(|k| format!("training.stage_{k}"))
    };
    if let Some(section) = differs {
        // The keys as the settings files spell them (the typed settings decide).
        let old_raw = lockstep_core::config::read_json(&run_dir.join("config.json"))
            .ok()
            .and_then(|c| c.get("npe").map(crate::settings::stored_npe_section));
        let mut keys = Vec::new();
        let parts = ["data".to_string(), "model".to_string()]
            .into_iter()
            .chain((0..=stage).map(|k| format!("training.stage_{k}")));
        for part in parts {
            let at = |v: Option<&Value>| -> Option<Value> {
                part.split('.')
                    .try_fold(v?.clone(), |v, k| v.get(k).cloned())
            };
            differing_keys(
                at(old_raw.as_ref()).as_ref(),
                at(Some(raw)).as_ref(),
                &part,
                &mut keys,
            );
        }
        let key = if keys.is_empty() {
            section.to_string()
        } else {
            keys.join(", ")
        };
        return Err(NpeError::Invalid(format!(
            "--resume {shown}: {} differs from the settings of the run that wrote the checkpoint ({}) in {key}; the stage after a finished one continues only with the same data, model and earlier stages",
            file.display(),
            run_dir.join("config.json").display()
        )));
    }
    if stage + 1 >= n {
        return Err(NpeError::Invalid(format!(
            "--resume {shown}: the checkpoint ends training.stage_{stage} (all its {updates} updates), the last stage of {}, so nothing is left to train; to train further, add a training.stage_{} to the settings (it starts from this checkpoint with its own optimizer and schedule)",
            file.display(),
            stage + 1
        )));
    }
    if old.stages().len() == 1 && run_dir == dir {
        return Err(NpeError::Invalid(format!(
            "--resume {shown}: the checkpoint ends the one-stage run in {}, which trained into the folder itself; a run of several stages keeps each stage in TRAIN_DIR/stage_N, so pass another --train-dir (training.stage_{} starts there from this checkpoint)",
            dir.display(),
            stage + 1
        )));
    }
    Ok((stage + 1, None, Some(checkpoint)))
}

/// Reads the settings, checks them (the data's scale, every stage's engine config and frozen
/// blocks), and finds where a `--resume` checkpoint continues; no output is touched.
fn prepare(request: &TrainRequest, world: &World) -> Result<Prepared, NpeError> {
    let file = &request.settings_file;
    let (settings, raw) = NpeSettings::from_yaml_file_with(file, &request.overrides)?;
    let launch = if world.launch.is_mpi_launch() && world.launch.size > 1 {
        Launch::Mpi(world.launch.size)
    } else {
        Launch::SingleProcess
    };
    let dir = absolute(&request.train_dir)?;
    let n = settings.stages().len();
    let stages_dir = (n > 1).then(|| dir.clone());
    let config = |stage: usize, overwrite: bool| -> Result<(Value, EngineConfig), NpeError> {
        let out = match &stages_dir {
            Some(d) => trained::stage_dir(d, stage),
            None => dir.clone(),
        };
        let json = settings
            .engine_config(stage, &raw, launch, &out, overwrite)
            .map_err(|e| e.in_file(file))?;
        let cfg = EngineConfig::from_json(&json, Path::new("/"))
            .map_err(|e| in_settings(e, file, stage))?;
        Ok((json, cfg))
    };
    let (first_stage, resume, start_from) =
        resume_point(request, &settings, &raw, &dir, |stage| {
            Ok(config(stage, false)?.1.updates)
        })?;
    let accept_config_hash = match &resume {
        Some(checkpoint) => check_resume_settings(request, &raw, checkpoint)?,
        None => None,
    };
    if n == 1 && resume.is_none() {
        check_train_dir(&dir, request.overwrite)?;
    }
    let mut configs = Vec::with_capacity(n);
    for stage in 0..n {
        let overwrite = match &stages_dir {
            // Stages a resumed run starts afresh replace what an interrupted attempt left.
            Some(_) => {
                request.resume.is_some()
                    && (stage > first_stage || (stage == first_stage && start_from.is_some()))
            }
            None => request.overwrite,
        };
        configs.push(config(stage, overwrite)?);
    }
    let task = settings.task()?;
    let (mut network, data_notes) =
        trained::checked_network(&settings, task.as_ref()).map_err(|e| match e {
            NpeError::Config(c) => NpeError::Config(c.in_file(file)),
            other => other,
        })?;
    // A continued run keeps the permutations its checkpoint's run stored (runs written
    // before they were stored draw them from data.seed again, as they were drawn then).
    if let Some(run_dir) = resume
        .as_ref()
        .or(start_from.as_ref())
        .and_then(|f| f.parent()?.parent())
    {
        trained::restore_permutations(&mut network, run_dir)?;
    }
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
    let device = if request.force_cpu {
        crate::device::DeviceKind::Cpu
    } else {
        settings.device()
    };
    let placements = slots
        .iter()
        .map(|&slot| Placement::for_slot(device, slot))
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| e.context(file.display().to_string()))?;
    // Mixed precision needs float16 on every replica's device (checked before any output).
    for (stage, st) in settings.stages().iter().enumerate() {
        if st.automatic_mixed_precision == Some(true) {
            for placement in &placements {
                placement.half_precision().map_err(|m| {
                    let m = if request.force_cpu && settings.device() != device {
                        "is true, but --cpu computes on the CPU in float32; leave out --cpu, or set automatic_mixed_precision to false".to_string()
                    } else {
                        m
                    };
                    NpeError::Config(
                        ConfigError::new(
                            format!("training.stage_{stage}.automatic_mixed_precision"),
                            m,
                        )
                        .in_file(file),
                    )
                })?;
            }
        }
    }
    Ok(Prepared {
        accept_config_hash,
        settings,
        network,
        configs,
        stages_dir,
        first_stage,
        resume,
        start_from,
        replicas,
        data_notes,
        placements,
    })
}

/// `--train-dir` `dir` of a new one-stage run, checked before any output: it may exist only
/// with `--overwrite`, and then only as a folder lockstep wrote (or an empty one).
///
/// Errors: messages naming `--train-dir`, `--overwrite` and `--resume`.
fn check_train_dir(dir: &Path, overwrite: bool) -> Result<(), NpeError> {
    use lockstep_core::output_dir::check_replaceable;
    if !dir.exists() && !dir.is_symlink() {
        return Ok(());
    }
    if !overwrite {
        return Err(output_dir_error(
            lockstep_core::output_dir::OutputDirError::Exists(dir.to_path_buf()),
        ));
    }
    check_replaceable(dir, &[]).map_err(output_dir_error)
}

/// An output folder error in `lockstep npe train`'s terms (`--train-dir`, `--overwrite`,
/// `--resume`), in place of the engine's config keys.
fn output_dir_error(e: lockstep_core::output_dir::OutputDirError) -> NpeError {
    use lockstep_core::output_dir::OutputDirError as E;
    NpeError::Output(match e {
        E::Exists(d) => format!(
            "{} already exists; choose another --train-dir, pass --overwrite to replace it, or --resume {} to continue it",
            d.display(),
            d.display()
        ),
        E::IsAFile(d) => format!("{} is a file; choose another --train-dir", d.display()),
        E::Foreign { dir, entry } => format!(
            "{} exists and was not written by lockstep (it holds {entry:?}), so --overwrite will not delete it; choose another --train-dir or remove it yourself",
            dir.display()
        ),
        other => other.to_string(),
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
        check_replaceable(dir, &[]).map_err(output_dir_error)?;
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
/// from its run directory's latest checkpoint (or the checkpoint file `run_dir` names).
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
///
/// Returns the engine's summary of each stage this call ran, in order (the run directory and
/// loss history of each; from the resumed stage on for a resumed run).
pub fn train_stages(request: &TrainRequest, world: &World) -> Result<Vec<TrainSummary>, NpeError> {
    let p = agree_on_validation(world.comm(), for_agreement(prepare(request, world)))?;
    same_on_every_rank(request, &p, world)?;
    let (settings, network) = (&p.settings, &p.network);
    let task = settings.task()?;
    let (seed, n_train) = (settings.data.seed, settings.train_samples());
    let chief = world.comm().is_chief();
    make_stages_dir(request, &p, world)?;
    // Stage 0 starts from the initial parameters, with the reduced basis computed from keyed
    // inputs in every process (deterministic; the startup broadcast makes the replicas equal
    // in any case). A resumed stage takes its parameters from the checkpoint instead.
    let fresh = NpeModel::<CpuAutodiff>::new(network.clone(), seed, Default::default());
    let mut values = (fresh.parameters(), fresh.state().to_vec());
    let mut svd_report = p.data_notes.clone();
    if chief {
        svd_report.iter().for_each(|l| println!("{l}"));
    }
    let mut device_notes = device_notes(request, &p, world);
    let threads = p.placements.len() > 1;
    starting_values(&p, world, &mut values, &mut svd_report)?;
    let n = p.configs.len();
    let mut last_dir = PathBuf::new();
    let mut summaries = Vec::new();
    for stage in p.first_stage..n {
        let (json, cfg) = &p.configs[stage];
        let frozen = settings.frozen_blocks(stage);
        let amp = settings.stages()[stage].automatic_mixed_precision == Some(true);
        let mut notes = std::mem::take(&mut svd_report);
        notes.append(&mut device_notes);
        if amp {
            let scaler = cfg.grad_scaler.unwrap_or_default();
            notes.push(format!(
                "training.stage_{stage}: mixed precision: linear layers and activations in float16 on float32 weights, loss scale from {} (x{} after {} clean updates, x{} on overflow)",
                scaler.init_scale, scaler.growth_factor, scaler.growth_interval, scaler.backoff_factor
            ));
            if chief {
                println!("{}", notes.last().map(String::as_str).unwrap_or(""));
            }
        }
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
            accept_config_hash: p.accept_config_hash.clone(),
            names: lockstep_train::CommandNames {
                command: "lockstep npe train".into(),
                overwrite: "--overwrite".into(),
            },
            ..EngineOptions::default()
        };
        let summary = run_job(world, cfg, &opts, |rank| {
            let placement = &p.placements[if threads { rank } else { 0 }];
            let mut model = DeviceModel::new(network.clone(), seed, placement)?;
            model.set_mixed_precision(amp);
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
        })
        .map_err(|e| stage_failure(e, request, &p, stage, chief))?;
        last_dir = summary.output_dir.clone();
        summaries.push(summary);
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
        finish_run(&p, &last_dir)?;
    }
    Ok(summaries)
}

/// What the run says about its devices: `--cpu` overriding `local.device` (chief), the
/// device of rank 0 and of every replica that shares its GPU (printed on stderr by that
/// rank), a software adapter's warning. Returns the chief's lines for `run.log`.
fn device_notes(request: &TrainRequest, p: &Prepared, world: &World) -> Vec<String> {
    let settings = &p.settings;
    let chief = world.comm().is_chief();
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
    if request.force_cpu && settings.device() != crate::device::DeviceKind::Cpu {
        let line = format!(
            "--cpu: computes on the CPU, in place of local.device: {} in {}",
            settings.local.device.as_deref().unwrap_or("gpu"),
            request.settings_file.display()
        );
        if chief {
            println!("{line}");
            device_notes.push(line);
        }
    }
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
        if rank == 0 {
            if let Some(warning) = placement.software_warning() {
                eprintln!("{warning}");
                device_notes.push(warning.to_string());
            }
        }
    }
    device_notes
}

/// The chief creates the folder of a run of several stages (see [`create_stages_dir`]),
/// every rank learning the outcome.
///
/// Errors: the folder's (agreed on every rank).
fn make_stages_dir(request: &TrainRequest, p: &Prepared, world: &World) -> Result<(), NpeError> {
    let Some(dir) = &p.stages_dir else {
        return Ok(());
    };
    let inside = p
        .resume
        .iter()
        .chain(&p.start_from)
        .any(|f| f.starts_with(dir));
    let made = if world.comm().is_chief() {
        for_agreement(create_stages_dir(dir, request.overwrite, inside))
    } else {
        Ok(())
    };
    agree_on_validation(world.comm(), made)?;
    Ok(())
}

/// The chief's end of a run: a run of several stages gets the last stage's
/// `posterior.safetensors` in its folder, and the test loss over the held-out simulations is
/// printed and logged.
///
/// Errors: reading or writing the posterior, loading the last checkpoint.
fn finish_run(p: &Prepared, last_dir: &Path) -> Result<(), NpeError> {
    let settings = &p.settings;
    let n = p.configs.len();
    let n_train = settings.train_samples();
    let log = last_dir.join(&p.configs[n - 1].1.log_file);
    if let Some(dir) = &p.stages_dir {
        let export = last_dir.join(EXPORT_FILE);
        let bytes = std::fs::read(&export)
            .map_err(|e| NpeError::io(format!("cannot read {}", export.display()), e))?;
        lockstep_train::checkpoint::write_atomic(&dir.join(EXPORT_FILE), &bytes)?;
    }
    let t = trained::load(last_dir)?;
    if let Some(loss) = t.test_loss() {
        let held_out = settings.data.num_samples - n_train;
        let line = format!(
            "test loss (mean negative log-probability over {held_out} held-out simulations): {loss:.6}"
        );
        println!("{line}");
        append_log(&log, &[line])?;
    }
    Ok(())
}

/// Where the first stage trained here starts (`values`: parameters and state): a
/// checkpoint that ends the previous stage (the chief reads it, the startup broadcast hands
/// it to every replica), or for a fresh run with a reduced-basis layer the basis computed
/// from keyed inputs. The lines said about it are printed (chief) and added to `notes`.
///
/// Errors: reading the checkpoint (agreed on every rank), computing the basis.
fn starting_values(
    p: &Prepared,
    world: &World,
    values: &mut (Vec<f32>, Vec<f32>),
    notes: &mut Vec<String>,
) -> Result<(), NpeError> {
    let (settings, network) = (&p.settings, &p.network);
    let chief = world.comm().is_chief();
    let seed = settings.data.seed;
    if let Some(file) = &p.start_from {
        // A checkpoint that ends the previous stage: the chief reads its values, the
        // startup broadcast hands them to every replica.
        let next = if chief {
            for_agreement(stage_result(file))
        } else {
            Ok(values.clone())
        };
        *values = agree_on_validation(world.comm(), next)?;
        if chief {
            let line = format!(
                "training.stage_{} starts from {}, the end of training.stage_{}",
                p.first_stage,
                file.display(),
                p.first_stage - 1
            );
            println!("{line}");
            notes.push(line);
        }
    } else if let (Some(svd), None) = (&settings.model.embedding_kwargs.svd, &p.resume) {
        let task = settings.task()?;
        let basis = ReducedBasis::compute(task.as_ref(), seed, svd, &network.standardization)?;
        basis.initialize(network, &mut values.0)?;
        let report = basis.report();
        if chief {
            report.iter().for_each(|l| println!("{l}"));
        }
        notes.extend(report);
    }
    Ok(())
}

/// What a stage's failure means in the settings' terms: a loss or parameter that became
/// non-finite names `training.stage_N.optimizer.lr` and the data (never the engine's
/// `training.optimizer.learning_rate`), is appended to the stage's run.log (batch jobs keep
/// only the log), and, as every replica detects the same value, ends every rank as an
/// agreed error (no MPI abort); engine config errors name the settings keys.
fn stage_failure(
    e: TrainError,
    request: &TrainRequest,
    p: &Prepared,
    stage: usize,
    chief: bool,
) -> NpeError {
    let file = request.settings_file.display();
    let st = p.settings.stages()[stage];
    let lr = match &st.optimizer {
        OptimizerSettings::Adam { lr, .. }
        | OptimizerSettings::AdamW { lr, .. }
        | OptimizerSettings::Sgd { lr, .. } => *lr,
    };
    let advice = format!(
        "lower training.stage_{stage}.optimizer.lr (now {lr}) or model.posterior_kwargs.base_transform_kwargs.tail_bound, or check the data (data.task)"
    );
    let e = match e {
        TrainError::OutputDir(o) => return output_dir_error(o),
        // The chief's output folder, refused before training: every rank knows it.
        TrainError::Refused(inner) if matches!(*inner, TrainError::OutputDir(_)) => {
            let TrainError::OutputDir(o) = *inner else {
                unreachable!("matched above")
            };
            return NpeError::Train(TrainError::Refused(Box::new(TrainError::Build(
                anyhow::Error::new(output_dir_error(o)),
            ))));
        }
        e => e,
    };
    let message = match &e {
        TrainError::NonFinite { update, value } => format!(
            "{file}: training.stage_{stage}: the loss became {value} at update {update} of the stage; {advice}"
        ),
        TrainError::NonFiniteParameter {
            update,
            index,
            value,
        } => format!(
            "{file}: training.stage_{stage}: trainable value {index} became {value} after update {update} of the stage; {advice}"
        ),
        TrainError::UpdatesSkipped {
            update,
            skipped,
            scale,
            at_floor,
            whole_run,
        } => {
            let g = st.grad_scaler.unwrap_or_default();
            format!(
                "{file}: training.stage_{stage}: {}the loss scaler skipped {skipped} update(s) in a row up to update {update} of the stage (the float16 gradient overflowed each time; loss scale now {scale:e}{}), so {}; lower training.stage_{stage}.grad_scaler.init_scale (now {:e}) or backoff_factor (now {}), or set training.stage_{stage}.automatic_mixed_precision to false",
                if *whole_run { "nothing was trained: " } else { "" },
                if *at_floor { ", its floor" } else { "" },
                if *whole_run {
                    "no update was applied and no posterior is exported"
                } else {
                    "training stopped"
                },
                g.init_scale,
                g.backoff_factor
            )
        }
        _ => return NpeError::Train(in_settings(e, &request.settings_file, stage)),
    };
    let (json, cfg) = &p.configs[stage];
    if chief {
        if let Some(out) = json["output"]["output_dir"].as_str() {
            let log = Path::new(out).join(&cfg.log_file);
            if log.is_file() {
                let _ = append_log(&log, &[format!("stopped: {message}")]);
            }
        }
        NpeError::Train(TrainError::Refused(Box::new(TrainError::Build(
            anyhow::Error::new(NpeError::Numerical(message)),
        ))))
    } else {
        NpeError::Train(TrainError::RefusedByPeer { rank: 0 })
    }
}

/// Checks that every rank read the same run: the same settings (file contents as parsed,
/// `local` included), the same data scale, and the same starting stage and checkpoint kind.
/// Ranks that read different copies of the settings (another host's file) would compute
/// different things; this is found before the first update, on every launcher.
///
/// Errors: an agreed error (every rank stops cleanly; rank 0 reports) naming the settings
/// file, when the ranks differ; a failed collective.
fn same_on_every_rank(request: &TrainRequest, p: &Prepared, world: &World) -> Result<(), NpeError> {
    use lockstep_comm::{CommExt, ReduceOp};
    use std::hash::{Hash, Hasher};
    let comm = world.comm();
    if comm.size() == 1 {
        return Ok(());
    }
    let mut h = std::collections::hash_map::DefaultHasher::new();
    let settings: Vec<Value> = p.configs.iter().map(|(j, _)| j["npe"].clone()).collect();
    serde_json::to_string(&settings)
        .unwrap_or_default()
        .hash(&mut h);
    serde_json::to_string(&p.settings.local)
        .unwrap_or_default()
        .hash(&mut h);
    serde_json::to_string(&p.network.standardization)
        .unwrap_or_default()
        .hash(&mut h);
    (p.first_stage, p.resume.is_some(), p.start_from.is_some()).hash(&mut h);
    let mine = h.finish();
    let lo = comm
        .all_reduce_scalar(mine, ReduceOp::Min)
        .map_err(TrainError::from)?;
    let hi = comm
        .all_reduce_scalar(mine, ReduceOp::Max)
        .map_err(TrainError::from)?;
    if lo == hi {
        return Ok(());
    }
    Err(NpeError::Train(if comm.is_chief() {
        TrainError::Refused(Box::new(TrainError::Build(anyhow::Error::new(
            NpeError::Invalid(format!(
                "{}: the ranks of this job read different settings (or resume from different points): every rank must read the same file (a copy on a shared filesystem, or identical copies on every host)",
                request.settings_file.display()
            )),
        ))))
    } else {
        TrainError::RefusedByPeer { rank: 0 }
    }))
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
