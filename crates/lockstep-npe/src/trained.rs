//! A trained posterior, loaded back from a run of `lockstep npe train`: the run directory's
//! `config.json` (which holds the settings under `npe`) rebuilds the task and the network, and
//! a checkpoint supplies the parameters.

use crate::flow::NpeNetwork;
use crate::model::NpeModel;
use crate::settings::NpeSettings;
use crate::tasks::{Task, TaskSource};
use crate::CpuAutodiff;
use anyhow::{bail, Context, Result};
use lockstep_train::{checkpoint, BatchSource, Model};
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// The network of `settings` for `task` (standardization from the task's fixed stream, the
/// permutations from `data.seed`).
///
/// Errors: widths the network refuses (see [`NpeNetwork::new`]).
pub fn network(settings: &NpeSettings, task: &dyn Task) -> Result<NpeNetwork> {
    NpeNetwork::new(
        settings.network_config(),
        task.theta_dim(),
        task.x_dim(),
        task.standardization(),
        settings.data.seed,
    )
}

/// A posterior restored from a checkpoint.
pub struct Trained {
    /// The settings it was trained with.
    pub settings: NpeSettings,
    /// The task.
    pub task: Arc<dyn Task>,
    /// The network with the checkpoint's parameters.
    pub model: NpeModel<CpuAutodiff>,
    /// The run directory.
    pub run_dir: PathBuf,
    /// The checkpoint file read.
    pub checkpoint: PathBuf,
    /// Optimizer updates behind the parameters.
    pub update: u64,
}

/// Loads the posterior of `path`: a run directory (its latest checkpoint), its
/// `checkpoints/latest` pointer, or a checkpoint file `checkpoints/update_NNNNNN.safetensors`.
///
/// Errors: the checkpoint cannot be found or verified, the run directory has no
/// `config.json` of an NPE run, or the parameters do not fit the network it describes.
pub fn load(path: &Path) -> Result<Trained> {
    let file = checkpoint::resolve(path)?;
    let run_dir = file
        .parent()
        .and_then(Path::parent)
        .map(Path::to_path_buf)
        .unwrap_or_else(|| PathBuf::from("."));
    let config_path = run_dir.join("config.json");
    let config = lockstep_core::config::read_json(&config_path).with_context(|| {
        format!(
            "{} is not inside the run directory of `lockstep npe train` (expected {})",
            file.display(),
            config_path.display()
        )
    })?;
    let Some(npe) = config.get("npe") else {
        bail!(
            "{}: no `npe` section; this run was not made by `lockstep npe train`",
            config_path.display()
        );
    };
    let settings =
        NpeSettings::from_value(npe).map_err(|e| e.under("npe").in_file(&config_path))?;
    let task = settings.task()?;
    let net = network(&settings, task.as_ref())?;
    let state = checkpoint::read(&file)?;
    let mut model = NpeModel::<CpuAutodiff>::new(net, settings.data.seed, Default::default());
    if state.trainable.len() != model.trainable().len()
        || state.frozen.len() != model.frozen().len()
    {
        bail!(
            "{}: {} trainable and {} frozen values, but the network of {} has {} and {}",
            file.display(),
            state.trainable.len(),
            state.frozen.len(),
            config_path.display(),
            model.trainable().len(),
            model.frozen().len()
        );
    }
    model.trainable_mut().copy_from_slice(&state.trainable);
    model.frozen_mut().copy_from_slice(&state.frozen);
    Ok(Trained {
        settings,
        task,
        model,
        run_dir,
        checkpoint: file,
        update: state.update,
    })
}

impl Trained {
    /// The mean negative log-probability over the test set (simulations
    /// `train_samples .. num_samples`), in chunks of 1024; `None` when the test set is empty.
    ///
    /// Errors: simulation failures.
    pub fn test_loss(&self) -> Result<Option<f64>> {
        let (start, end) = (
            self.settings.train_samples(),
            self.settings.data.num_samples,
        );
        if end <= start {
            return Ok(None);
        }
        let mut source = TaskSource::new(self.task.clone(), self.settings.data.seed);
        let mut sum = 0.0f64;
        let mut first = start;
        while first < end {
            let count = (end - first).min(1024) as usize;
            let b = source.global_batch(first, count)?;
            let lp = self.model.log_prob(&b.targets, &b.inputs, count);
            sum -= lp.iter().map(|&v| v as f64).sum::<f64>();
            first += count as u64;
        }
        Ok(Some(sum / (end - start) as f64))
    }
}
