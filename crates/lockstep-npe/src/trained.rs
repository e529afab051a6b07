//! A trained posterior, loaded back from a run of `lockstep npe train`: the run directory's
//! `config.json` (which holds the settings under `npe` and the stage under `npe_stage`)
//! rebuilds the task and the network, and a checkpoint supplies the parameters.
//!
//! A one-stage run is one run directory. A run of several stages is a folder with one run
//! directory per stage, `stage_0`, `stage_1`, ... ([`stage_dir`]); pointing at the folder
//! means its latest stage that has a checkpoint ([`resolve_checkpoint`]).

use crate::error::NpeError;
use crate::flow::NpeNetwork;
use crate::model::NpeModel;
use crate::settings::NpeSettings;
use crate::task::Task;
use crate::tasks::TaskSource;
use crate::CpuAutodiff;
use lockstep_train::{checkpoint, Model};
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// The network of `settings` for `task` (standardization from the task's fixed stream, the
/// permutations from `data.seed`).
///
/// Errors: widths the network refuses (see [`NpeNetwork::new`]).
pub fn network(settings: &NpeSettings, task: &dyn Task) -> Result<NpeNetwork, NpeError> {
    NpeNetwork::new(
        settings.network_config(),
        task.theta_dim(),
        task.x_dim(),
        task.standardization(),
        settings.data.seed,
    )
}

/// The network of `settings` for `task`, after checking that the task's data fits the
/// network's float32 ([`crate::task::DataScale::check`]); also returns notes for the log (x
/// components left unscaled because they are constant).
///
/// Errors: [`NpeError::Config`] for `data.task` when the data does not fit (non-finite
/// values, magnitudes beyond float32's range, a constant θ component); widths the network
/// refuses.
pub fn checked_network(
    settings: &NpeSettings,
    task: &dyn Task,
) -> Result<(NpeNetwork, Vec<String>), NpeError> {
    let scale = task.data_scale();
    let notes = scale.check(&task.parameter_names()).map_err(|m| {
        NpeError::Config(lockstep_core::config::ConfigError::new(
            "data.task",
            format!("{}: {m}", task.name()),
        ))
    })?;
    let net = NpeNetwork::new(
        settings.network_config(),
        task.theta_dim(),
        task.x_dim(),
        scale.standardization,
        settings.data.seed,
    )?;
    Ok((net, notes))
}

/// The flow steps' permutations stored in the metadata of `file` (a `posterior.safetensors`
/// written by training): `None` when the file does not exist or predates the key (the
/// permutations are then drawn from `data.seed`, as they were when it was trained). Reads
/// only the file's header.
///
/// Errors: a file that cannot be read or whose header or `permutations` is malformed,
/// naming the file.
pub fn stored_permutations(file: &Path) -> Result<Option<Vec<Vec<usize>>>, NpeError> {
    use std::io::Read;
    if !file.is_file() {
        return Ok(None);
    }
    let bad = |m: String| NpeError::Data(format!("{}: {m}", file.display()));
    let mut f = std::fs::File::open(file).map_err(|e| bad(format!("cannot open: {e}")))?;
    let mut len = [0u8; 8];
    f.read_exact(&mut len)
        .map_err(|e| bad(format!("not a safetensors file: {e}")))?;
    let len = u64::from_le_bytes(len);
    if len > 100 << 20 {
        return Err(bad(format!(
            "a header of {len} bytes: not a safetensors file"
        )));
    }
    let mut header = vec![0u8; len as usize];
    f.read_exact(&mut header)
        .map_err(|e| bad(format!("truncated header: {e}")))?;
    let header: serde_json::Value =
        serde_json::from_slice(&header).map_err(|e| bad(format!("unreadable header: {e}")))?;
    let Some(text) = header
        .get("__metadata__")
        .and_then(|m| m.get("permutations"))
    else {
        return Ok(None);
    };
    let text = text
        .as_str()
        .ok_or_else(|| bad("metadata `permutations` is not a string".into()))?;
    serde_json::from_str(text).map(Some).map_err(|e| {
        bad(format!(
            "metadata `permutations` is not a list of index lists: {e}"
        ))
    })
}

/// Sets `net`'s permutations to those stored in `run_dir`'s `posterior.safetensors` (see
/// [`stored_permutations`]); returns whether there were any. Without them `net` keeps the
/// permutations drawn from the seed, which are the ones a checkpoint without them was
/// trained with.
///
/// Errors: an unreadable file, or stored permutations that do not fit `net`, naming the file.
pub fn restore_permutations(net: &mut NpeNetwork, run_dir: &Path) -> Result<bool, NpeError> {
    let file = run_dir.join(crate::model::EXPORT_FILE);
    match stored_permutations(&file)? {
        None => Ok(false),
        Some(p) => {
            net.set_permutations(&p)
                .map_err(|e| e.context(file.display().to_string()))?;
            Ok(true)
        }
    }
}

/// The run directory of stage `stage` inside the folder `train_dir` of a run of several
/// stages: `train_dir/stage_N`.
pub fn stage_dir(train_dir: &Path, stage: usize) -> PathBuf {
    train_dir.join(format!("stage_{stage}"))
}

/// The checkpoint file `path` names, as [`checkpoint::resolve`] (a run directory, a
/// `checkpoints/latest` pointer, a checkpoint file), or, for the folder of a run of several
/// stages, the latest checkpoint of its last stage that has one.
///
/// Errors: as [`checkpoint::resolve`] when no checkpoint is found.
pub fn resolve_checkpoint(path: &Path) -> Result<PathBuf, NpeError> {
    if path.is_dir() && !path.join("checkpoints").is_dir() {
        let stages = std::fs::read_dir(path)
            .into_iter()
            .flatten()
            .flatten()
            .filter_map(|e| {
                let name = e.file_name().into_string().ok()?;
                name.strip_prefix("stage_")?.parse::<usize>().ok()
            });
        let last = stages
            .filter(|&n| checkpoint::resolve(&stage_dir(path, n)).is_ok())
            .max();
        if let Some(n) = last {
            return Ok(checkpoint::resolve(&stage_dir(path, n))?);
        }
    }
    Ok(checkpoint::resolve(path)?)
}

/// The settings and stage of the run directory that holds the checkpoint `file`
/// (`RUN_DIR/checkpoints/FILE`): its `config.json`'s `npe` and `npe_stage` (0 when absent).
///
/// Errors: no `config.json` of an NPE run there, or settings it no longer accepts.
pub fn run_settings(file: &Path) -> Result<(PathBuf, NpeSettings, usize), NpeError> {
    let run_dir = file
        .parent()
        .and_then(Path::parent)
        .map(Path::to_path_buf)
        .unwrap_or_else(|| PathBuf::from("."));
    let config_path = run_dir.join("config.json");
    let config = lockstep_core::config::read_json(&config_path).map_err(|e| {
        NpeError::from(e).context(format!(
            "{} is not inside the run directory of `lockstep npe train` (expected {})",
            file.display(),
            config_path.display()
        ))
    })?;
    let Some(npe) = config.get("npe") else {
        return Err(NpeError::Data(format!(
            "{}: no `npe` section; this run was not made by `lockstep npe train`",
            config_path.display()
        )));
    };
    let npe = crate::settings::stored_npe_section(npe);
    let settings =
        NpeSettings::from_value(&npe).map_err(|e| e.under("npe").in_file(&config_path))?;
    let stage = config
        .get("npe_stage")
        .and_then(|v| v.as_u64())
        .unwrap_or(0) as usize;
    if stage >= settings.stages().len() {
        return Err(NpeError::Data(format!(
            "{}: npe_stage {stage} but the settings have {} stage(s)",
            config_path.display(),
            settings.stages().len()
        )));
    }
    Ok((run_dir, settings, stage))
}

/// A posterior restored from a checkpoint.
pub struct Trained {
    /// The settings it was trained with.
    pub settings: NpeSettings,
    /// The task.
    pub task: Arc<dyn Task>,
    /// The network with the checkpoint's parameters.
    pub model: NpeModel<CpuAutodiff>,
    /// The run directory (of the checkpoint's stage).
    pub run_dir: PathBuf,
    /// The training stage the checkpoint belongs to.
    pub stage: usize,
    /// The checkpoint file read.
    pub checkpoint: PathBuf,
    /// Optimizer updates behind the parameters.
    pub update: u64,
}

/// Loads the posterior of `path`: a run directory (its latest checkpoint), its
/// `checkpoints/latest` pointer, a checkpoint file `checkpoints/update_NNNNNN.safetensors`,
/// or the folder of a run of several stages (see [`resolve_checkpoint`]). The flow's
/// permutations are those the run directory's `posterior.safetensors` stores, or, for runs
/// without them, drawn from `data.seed` as in training ([`restore_permutations`]).
///
/// Errors: the checkpoint cannot be found or verified, the run directory has no
/// `config.json` of an NPE run, or the parameters do not fit the network it describes.
pub fn load(path: &Path) -> Result<Trained, NpeError> {
    let file = resolve_checkpoint(path)?;
    let (run_dir, settings, stage) = run_settings(&file)?;
    let config_path = run_dir.join("config.json");
    let task = settings.task()?;
    let mut net = network(&settings, task.as_ref())?;
    restore_permutations(&mut net, &run_dir)?;
    let state = checkpoint::read(&file)?;
    let mut model = NpeModel::<CpuAutodiff>::new(net, settings.data.seed, Default::default());
    model
        .freeze(&settings.frozen_blocks(stage))
        .map_err(|e| e.context(format!("{}: training.stage_{stage}", config_path.display())))?;
    if state.trainable.len() != model.trainable().len()
        || state.frozen.len() != model.frozen().len()
    {
        return Err(NpeError::Data(format!(
            "{}: {} trainable and {} frozen values, but the network of {} has {} and {}",
            file.display(),
            state.trainable.len(),
            state.frozen.len(),
            config_path.display(),
            model.trainable().len(),
            model.frozen().len()
        )));
    }
    model.trainable_mut().copy_from_slice(&state.trainable);
    model.frozen_mut().copy_from_slice(&state.frozen);
    Ok(Trained {
        settings,
        task,
        model,
        run_dir,
        stage,
        checkpoint: file,
        update: state.update,
    })
}

impl Trained {
    /// `n` posterior samples (`[n * theta_dim]`, float32) at the standardized observation
    /// `x` from `seed` on the CPU ([`NpeModel::sample`]): a non-generic entry, so that the
    /// sampling code compiles in this crate and not again in each program that calls it.
    pub fn sample(&self, x: &[f32], n: usize, seed: u64) -> Vec<f32> {
        self.model.sample(x, n, seed)
    }

    /// The mean negative log-probability over the test set (simulations
    /// `train_samples .. num_samples`), in chunks of 1024; `None` when the test set is empty.
    ///
    pub fn test_loss(&self) -> Option<f64> {
        let (start, end) = (
            self.settings.train_samples(),
            self.settings.data.num_samples,
        );
        if end <= start {
            return None;
        }
        let mut source = TaskSource::new(self.task.clone(), self.settings.data.seed);
        let mut sum = 0.0f64;
        let mut first = start;
        while first < end {
            let count = (end - first).min(1024) as usize;
            let b = source.batch(first, count);
            let lp = self.model.log_prob(&b.targets, &b.inputs, count);
            sum -= lp.iter().map(|&v| v as f64).sum::<f64>();
            first += count as u64;
        }
        Some(sum / (end - start) as f64)
    }
}
