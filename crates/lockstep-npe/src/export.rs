//! The trained posterior as a PyTorch state dict that nflows (Durkan et al. 2019) and Dingo
//! (Dax et al. 2021) modules load with `load_state_dict` (`lockstep npe export RUN --format
//! nflows`, alias `dingo`).
//!
//! The state dict is laid out as Dingo's `FlowWrapper(flow, embedding_net)`:
//!
//! - `flow` is the nflows `Flow` that Dingo's `create_nsf_model` builds: `_transform` is a
//!   `CompositeTransform` of `num_flow_steps` steps, step `i` a `CompositeTransform` of
//!   (`CompositeTransform(RandomPermutation, LULinear)`,
//!   `PiecewiseRationalQuadraticCouplingTransform` with linear tails and nflows'
//!   `ResidualNet` conditioner), then one more
//!   `CompositeTransform(RandomPermutation, LULinear)`: Dingo's final linear transform, which
//!   lockstep's flow does not have and which is exported as the identity (permutation
//!   `0..d`, `L = U = I`, bias 0). Names: `flow._transform._transforms.{i}._transforms.0.
//!   _transforms.0._permutation` (int64), `..._transforms.0._transforms.1.{lower_entries,
//!   upper_entries,unconstrained_upper_diag,bias}`, `flow._transform._transforms.{i}.
//!   _transforms.1.{identity_features,transform_features}` (int64) and `....transform_net.
//!   {initial_layer,blocks.{b}.{linear_layers.{j},context_layer},final_layer}.{weight,bias}`.
//! - `embedding_net` is an `nn.Sequential`: with a reduced-basis layer, Dingo's
//!   `LinearProjectionRB` (`embedding_net.0.layers_rb.{k}`) then its `DenseResidualNet`
//!   (`embedding_net.1.{initial_layer,blocks.{n}.linear_layers.{j},resize_layers.{n}}`);
//!   without one, the `DenseResidualNet` alone (`embedding_net.0.*`).
//!
//! The settings file next to it ([`NFLOWS_SETTINGS_FILE`]) gives every argument needed to
//! build those modules (Dingo's `posterior_kwargs` / `embedding_kwargs` names), the
//! standardization of θ and x (which Dingo applies outside the network), the permutations,
//! and a few `(θ, x, log q)` pairs computed by lockstep, so a user (and
//! `scripts/peers/nflows_export_check.py`) can check the rebuilt model:
//! `log q(θ|x) = flow.log_prob((θ - θ_mean)/θ_std, context=embedding_net((x - x_mean)/x_std))
//! - Σ log θ_std`.
//!
//! With BatchNorm (Dingo's default, `batch_norm: true`) the blocks' `batch_norm_layers.{j}`
//! carry `weight`, `bias`, `running_mean`, `running_var` (float32) and
//! `num_batches_tracked` (int64, the training forward passes behind the statistics), as
//! `BatchNorm1d(features, eps=1e-3)` in nflows' `ResidualBlock` has them; load the model in
//! evaluation mode (`model.eval()`), where BatchNorm uses the running statistics as
//! lockstep's evaluation does. Networks without a counterpart are refused naming the key
//! ([`check_settings`]): LayerNorm (nflows' and Dingo's residual blocks have none), and
//! BatchNorm with another eps than 1e-3 (runs stored before `model.batch_norm_eps` existed
//! used 1e-5).

use crate::error::NpeError;
use crate::flow::NpeNetwork;
use crate::layers::{Norm, DINGO_BATCH_NORM_EPS};
use crate::settings::NpeSettings;
use crate::tasks::TaskSource;
use crate::trained::Trained;
use lockstep_core::config::ConfigError;
use safetensors::tensor::{Dtype, TensorView};
use serde_json::{json, Value};
use std::collections::HashMap;
use std::path::{Path, PathBuf};

/// The state dict's file name.
pub const NFLOWS_STATE_FILE: &str = "posterior.nflows.safetensors";
/// The settings file's name (JSON).
pub const NFLOWS_SETTINGS_FILE: &str = "posterior.nflows.json";
/// Format tag written into the settings file.
pub const NFLOWS_FORMAT: &str = "lockstep-nflows-export-1";

/// nflows' `LULinear` eps: the diagonal of `U` is `softplus(u) + eps`.
const LU_EPS: f64 = 1e-3;

/// The formats `lockstep npe export` writes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ExportFormat {
    /// nflows modules in Dingo's layout (`nflows`, also `dingo`).
    Nflows,
}

impl ExportFormat {
    /// The format named `name` (`nflows` or its alias `dingo`).
    ///
    /// Errors: any other name, with the known ones.
    pub fn parse(name: &str) -> Result<Self, NpeError> {
        match name.to_ascii_lowercase().as_str() {
            "nflows" | "dingo" => Ok(ExportFormat::Nflows),
            _ => Err(NpeError::Invalid(format!(
                "--format {name}: unknown export format; the formats are nflows (alias dingo)"
            ))),
        }
    }
}

/// The values of one exported tensor.
#[derive(Debug, Clone, PartialEq)]
pub enum Values {
    /// float32 (parameters).
    F32(Vec<f32>),
    /// int64 (index buffers: permutations, coupling features).
    I64(Vec<i64>),
}

/// One entry of the state dict.
#[derive(Debug, Clone, PartialEq)]
pub struct ExportTensor {
    /// Module path, e.g. `flow._transform._transforms.0._transforms.1.transform_net.final_layer.weight`.
    pub name: String,
    /// Shape (`[out, in]` for linear weights).
    pub shape: Vec<usize>,
    /// Values, row-major.
    pub values: Values,
}

/// `(θ, x)` pairs with lockstep's `log q(θ | x)`, written into the settings so a rebuilt
/// model can be checked.
#[derive(Debug, Clone, PartialEq)]
pub struct CheckPairs {
    /// θ, `[n * theta_dim]` row-major, raw units.
    pub theta: Vec<f32>,
    /// x, `[n * x_dim]` row-major, raw units.
    pub x: Vec<f32>,
    /// lockstep's `log q(θ | x)`, `[n]`.
    pub log_prob: Vec<f32>,
}

/// A network in the nflows/Dingo layout: the state dict and the settings that build the
/// modules it loads into.
#[derive(Debug, Clone)]
pub struct NflowsExport {
    /// The state dict entries, in lockstep's layout order, then the added buffers.
    pub tensors: Vec<ExportTensor>,
    /// The settings file's content.
    pub settings: Value,
}

/// Refuses settings whose network has no nflows counterpart, naming the key as the
/// settings file writes it: a LayerNorm in the embedding network
/// (`model.embedding_kwargs`) or in the coupling conditioners
/// (`model.posterior_kwargs.base_transform_kwargs`), or BatchNorm with an eps other than
/// nflows' 1e-3 (`model.batch_norm_eps`).
///
/// Errors: [`ConfigError`] for `...norm` or `...batch_norm`, whichever the settings give, or
/// `model.batch_norm_eps`.
pub fn check_settings(settings: &NpeSettings) -> Result<(), ConfigError> {
    let m = &settings.model;
    let e = &m.embedding_kwargs;
    let b = &m.posterior_kwargs.base_transform_kwargs;
    let net = settings.network_config();
    for (key, norm, given_norm, network) in [
        (
            "model.embedding_kwargs",
            net.embedding.norm,
            e.norm.is_some(),
            "Dingo's DenseResidualNet (nflows' ResidualBlock)",
        ),
        (
            "model.posterior_kwargs.base_transform_kwargs",
            net.flow.norm,
            b.norm.is_some(),
            "nflows' ResidualNet",
        ),
    ] {
        let (written, value) = if given_norm {
            (format!("{key}.norm"), norm_name(norm))
        } else {
            (format!("{key}.batch_norm"), "true")
        };
        if let Some(why) = norm_refusal(norm, value, network) {
            return Err(ConfigError::new(written, why));
        }
    }
    if let Some(why) = eps_refusal(&net) {
        return Err(ConfigError::new("model.batch_norm_eps", why));
    }
    Ok(())
}

/// Why a BatchNorm network's eps has no nflows counterpart (`None` when it has).
fn eps_refusal(net: &crate::flow::NetworkConfig) -> Option<String> {
    let eps = net.batch_norm_eps;
    (net.uses_batch_norm() && eps != DINGO_BATCH_NORM_EPS).then(|| {
        let stored = if eps == crate::layers::LEGACY_BATCH_NORM_EPS {
            " (runs stored before model.batch_norm_eps existed used 1e-5)"
        } else {
            ""
        };
        format!("is {eps}{stored}, but the BatchNorm1d layers of nflows' ResidualBlock (Dingo's networks) use eps 1e-3, which changes the log-probabilities; only BatchNorm networks trained with batch_norm_eps 1e-3 (the default) can be exported")
    })
}

/// Why a network with `norm` (given as `written`, e.g. `true` for `batch_norm: true`) has
/// no nflows counterpart (`None` for no normalization).
fn norm_refusal(norm: Norm, written: &str, network: &str) -> Option<String> {
    match norm {
        Norm::None | Norm::BatchNorm => None,
        Norm::LayerNorm => Some(format!(
            "is {written}, but {network} has no LayerNorm (its residual blocks normalize with BatchNorm or not at all), so no nflows/Dingo model computes this network; only networks trained with norm: batch_norm (Dingo's default, batch_norm: true) or none can be exported"
        )),
    }
}

/// The settings' name of `norm`.
fn norm_name(norm: Norm) -> &'static str {
    match norm {
        Norm::None => "none",
        Norm::LayerNorm => "layer_norm",
        Norm::BatchNorm => "batch_norm",
    }
}

/// `prefix.rest` -> `rest`.
fn strip<'a>(name: &'a str, prefix: &str) -> Option<&'a str> {
    name.strip_prefix(prefix)?.strip_prefix('.')
}

/// The nflows/Dingo name of lockstep's parameter or state buffer `name` (a residual block's
/// `norm_layers.{j}` are nflows' `batch_norm_layers.{j}`).
fn nflows_name(name: &str, projection: bool) -> Result<String, NpeError> {
    let bn = name.replace(".norm_layers.", ".batch_norm_layers.");
    let name = bn.as_str();
    let flow_step = |rest: &str| -> Option<String> {
        let (step, rest) = rest.split_once('.')?;
        step.parse::<usize>().ok()?;
        let t = format!("flow._transform._transforms.{step}._transforms");
        if let Some(p) = strip(rest, "lu_linear") {
            Some(format!("{t}.0._transforms.1.{p}"))
        } else {
            strip(rest, "coupling").map(|p| format!("{t}.1.{p}"))
        }
    };
    let mapped = if let Some(rest) = strip(name, "embedding_net") {
        if rest.starts_with("layers_rb.") {
            Some(format!("embedding_net.0.{rest}"))
        } else {
            Some(format!("embedding_net.{}.{rest}", usize::from(projection)))
        }
    } else {
        strip(name, "flow.steps").and_then(flow_step)
    };
    mapped.ok_or_else(|| {
        NpeError::Invalid(format!(
            "parameter {name} has no place in the nflows/Dingo layout"
        ))
    })
}

fn indices(v: &[usize]) -> Values {
    Values::I64(v.iter().map(|&i| i as i64).collect())
}

/// The network `net` with parameter values `params` (layout order, all of them) and
/// BatchNorm running statistics `state` (state layout order; empty without BatchNorm) in the
/// nflows/Dingo layout, with `checks` and θ's `parameter_names` in the settings.
/// `batches_tracked` is each BatchNorm layer's `num_batches_tracked`: the training forward
/// passes behind the running statistics (PyTorch counts them; with momentum 0.1 they change
/// nothing computed).
///
/// Errors: a network without nflows counterpart (LayerNorm, or BatchNorm with an eps other
/// than 1e-3; see [`check_settings`] for the error that names the settings key), values of
/// the wrong lengths.
pub fn nflows_export(
    net: &NpeNetwork,
    params: &[f32],
    state: &[f32],
    batches_tracked: u64,
    checks: &CheckPairs,
    parameter_names: &[String],
) -> Result<NflowsExport, NpeError> {
    let cfg = &net.config;
    for (key, norm, network) in [
        (
            "embedding.norm",
            cfg.embedding.norm,
            "Dingo's DenseResidualNet (nflows' ResidualBlock)",
        ),
        ("flow.norm", cfg.flow.norm, "nflows' ResidualNet"),
    ] {
        if let Some(why) = norm_refusal(norm, norm_name(norm), network) {
            return Err(NpeError::Invalid(format!("the network's {key} {why}")));
        }
    }
    if let Some(why) = eps_refusal(cfg) {
        return Err(NpeError::Invalid(format!(
            "the network's batch_norm_eps {why}"
        )));
    }
    let layout = net.layout();
    let state_layout = net.state_layout();
    if params.len() != layout.len() || state.len() != state_layout.len() {
        return Err(NpeError::Invalid(format!(
            "{} parameter and {} state values for a network of {} and {}",
            params.len(),
            state.len(),
            layout.len(),
            state_layout.len()
        )));
    }
    let (d, xd) = (net.theta_dim, net.x_dim);
    let n = checks.log_prob.len();
    if checks.theta.len() != n * d || checks.x.len() != n * xd {
        return Err(NpeError::Invalid(format!(
            "{} θ and {} x values for {n} check pairs of θ {d} and x {xd}",
            checks.theta.len(),
            checks.x.len()
        )));
    }
    let tensors = state_dict(net, params, state, batches_tracked)?;
    let settings = settings_json(net, checks, parameter_names);
    Ok(NflowsExport { tensors, settings })
}

/// The state dict of [`nflows_export`]: the parameters and BatchNorm buffers under their
/// nflows/Dingo names, the permutations and coupling features, Dingo's final linear
/// transform as the identity. The lengths are checked by the caller.
///
/// Errors: a parameter without a place in the layout.
fn state_dict(
    net: &NpeNetwork,
    params: &[f32],
    state: &[f32],
    batches_tracked: u64,
) -> Result<Vec<ExportTensor>, NpeError> {
    let cfg = &net.config;
    let (layout, state_layout) = (net.layout(), net.state_layout());
    let d = net.theta_dim;
    let projection = cfg.embedding.projection.is_some();
    let mut tensors = Vec::new();
    for (i, spec) in layout.specs().iter().enumerate() {
        tensors.push(ExportTensor {
            name: nflows_name(&spec.name, projection)?,
            shape: spec.shape.clone(),
            values: Values::F32(layout.slice(params, i).to_vec()),
        });
    }
    for (i, spec) in state_layout.specs().iter().enumerate() {
        let name = nflows_name(&spec.name, projection)?;
        if let Some(layer) = name.strip_suffix(".running_mean") {
            tensors.push(ExportTensor {
                name: format!("{layer}.num_batches_tracked"),
                shape: vec![],
                values: Values::I64(vec![batches_tracked as i64]),
            });
        }
        tensors.push(ExportTensor {
            name,
            shape: spec.shape.clone(),
            values: Values::F32(state_layout.slice(state, i).to_vec()),
        });
    }
    let perms = net.permutations();
    let step_name = |i: usize| format!("flow._transform._transforms.{i}._transforms");
    for (i, (perm, (identity, transform))) in perms.iter().zip(net.coupling_features()).enumerate()
    {
        let t = step_name(i);
        for (name, v) in [
            (format!("{t}.0._transforms.0._permutation"), perm.clone()),
            (format!("{t}.1.identity_features"), identity),
            (format!("{t}.1.transform_features"), transform),
        ] {
            tensors.push(ExportTensor {
                name,
                shape: vec![v.len()],
                values: indices(&v),
            });
        }
    }
    // Dingo's final linear transform: the identity.
    let t = step_name(cfg.flow.num_flow_steps);
    let tri = d * (d - 1) / 2;
    let diag = ((1.0 - LU_EPS).exp() - 1.0).ln() as f32;
    let identity: Vec<usize> = (0..d).collect();
    tensors.push(ExportTensor {
        name: format!("{t}.0._permutation"),
        shape: vec![d],
        values: indices(&identity),
    });
    for (p, len, v) in [
        ("lower_entries", tri, 0.0),
        ("upper_entries", tri, 0.0),
        ("unconstrained_upper_diag", d, diag),
        ("bias", d, 0.0),
    ] {
        tensors.push(ExportTensor {
            name: format!("{t}.1.{p}"),
            shape: vec![len],
            values: Values::F32(vec![v; len]),
        });
    }
    Ok(tensors)
}

/// The settings file of [`nflows_export`]: the module arguments, standardization,
/// permutations and the check pairs.
fn settings_json(net: &NpeNetwork, checks: &CheckPairs, parameter_names: &[String]) -> Value {
    let cfg = &net.config;
    let (d, xd) = (net.theta_dim, net.x_dim);
    let perms = net.permutations();
    let s = &net.standardization;
    let f = &cfg.flow;
    let e = &cfg.embedding;
    let rows =
        |v: &[f32], w: usize| -> Vec<Vec<f32>> { v.chunks(w).map(<[f32]>::to_vec).collect() };
    let projection = e.projection.as_ref().map(|pc| {
        let l = &pc.layout;
        let dingo_input_dims = match *l {
            crate::task::BasisLayout::Complex { blocks, bins } => json!([blocks, 2, bins]),
            crate::task::BasisLayout::Real { .. } => Value::Null,
        };
        json!({
            "blocks": l.blocks(),
            "block_inputs": l.block_inputs(),
            "block_outputs": l.block_outputs(pc.size),
            "n_rb": pc.size,
            "dingo_input_dims": dingo_input_dims,
            "note": "layers_rb.{k} maps x[:, k*block_inputs:(k+1)*block_inputs] (x flattened as lockstep lays it out; for complex data that is Dingo's [num_blocks, 2, num_bins] flattened) to block_outputs values; the blocks' outputs are concatenated",
        })
    });
    json!({
        "format": NFLOWS_FORMAT,
        "producer": format!("lockstep {}", env!("CARGO_PKG_VERSION")),
        "state_dict": NFLOWS_STATE_FILE,
        "module": "Dingo's FlowWrapper: `flow` = nflows Flow(create_transform(...), StandardNormal((theta_dim,))) as Dingo's create_nsf_model builds it (no embedding inside), `embedding_net` = nn.Sequential([LinearProjectionRB,] DenseResidualNet)",
        "theta_dim": d,
        "x_dim": xd,
        "parameter_names": parameter_names,
        "posterior_kwargs": {
            "input_dim": d,
            "context_dim": e.output_dim,
            "num_flow_steps": f.num_flow_steps,
            "base_transform_kwargs": {
                "hidden_dim": f.hidden_dim,
                "num_transform_blocks": f.num_transform_blocks,
                "activation": "elu",
                "dropout_probability": 0.0,
                "batch_norm": f.norm == Norm::BatchNorm,
                "num_bins": f.num_bins,
                "tail_bound": f.tail_bound,
                "apply_unconditional_transform": false,
                "base_transform_type": "rq-coupling",
            },
            "tails": "linear",
            "min_bin_width": 1e-3,
            "min_bin_height": 1e-3,
            "min_derivative": 1e-3,
            "lu_eps": LU_EPS,
            "mask": "create_alternating_binary_mask(input_dim, even=(i % 2 == 0)) for step i",
            "final_linear_transform": "identity (Dingo appends a permutation + LULinear after the last step; lockstep's flow has none, so it is exported as the identity)",
        },
        "embedding_kwargs": {
            "input_dim": xd,
            "output_dim": e.output_dim,
            "hidden_dims": e.hidden_dims,
            "activation": "elu",
            "dropout": 0.0,
            "batch_norm": e.norm == Norm::BatchNorm,
            "projection": projection,
        },
        "standardization": {
            "theta_mean": s.theta_mean,
            "theta_std": s.theta_std,
            "x_mean": s.x_mean,
            "x_std": s.x_std,
        },
        "batch_norm": if cfg.uses_batch_norm() {
            json!({"eps": cfg.batch_norm_eps, "momentum": 0.1, "mode": "evaluation: load the model and call model.eval() (BatchNorm then uses running_mean/running_var, as lockstep's sampling and log_prob do)"})
        } else {
            Value::Null
        },
        "log_prob": "log q(theta|x) = flow.log_prob((theta - theta_mean) / theta_std, context=embedding_net((x - x_mean) / x_std)) - sum(log(theta_std))",
        "permutations": perms,
        "check": {
            "theta": rows(&checks.theta, d),
            "x": rows(&checks.x, xd),
            "log_prob": checks.log_prob,
        },
    })
}

/// The posterior `t` in the nflows/Dingo layout, with `pairs` check pairs `(θ, x)` of its
/// task (the test set's first simulations, or the first training simulations when there is
/// no test set) and lockstep's `log q(θ | x)` of each.
///
/// Errors: settings without an nflows counterpart ([`check_settings`], naming the key and
/// the run's `config.json`).
pub fn export_trained(t: &Trained, pairs: usize) -> Result<NflowsExport, NpeError> {
    check_settings(&t.settings).map_err(|e| {
        NpeError::Config(e.in_file(t.run_dir.join("config.json"))).context(
            "the run's settings (its config.json, section npe) cannot be exported to nflows",
        )
    })?;
    let (start, end) = (t.settings.train_samples(), t.settings.data.num_samples);
    let first = if end > start { start } else { 0 };
    let mut source = TaskSource::new(t.task.clone(), t.settings.data.seed);
    let b = source.batch(first, pairs);
    let log_prob = t.model.log_prob(&b.targets, &b.inputs, pairs);
    let checks = CheckPairs {
        theta: b.targets,
        x: b.inputs,
        log_prob,
    };
    nflows_export(
        &t.model.network,
        &t.model.parameters(),
        t.model.state(),
        training_forward_passes(t),
        &checks,
        &t.task.parameter_names(),
    )
}

/// The training forward passes of one replica behind `t`'s running statistics (PyTorch's
/// `num_batches_tracked`): every update of the earlier stages (epochs × updates per epoch)
/// and `t.update` of its own stage, each `gradient_updates_per_optimizer_step` micro-batches.
fn training_forward_passes(t: &Trained) -> u64 {
    let stages = t.settings.stages();
    let micro = |k: usize| stages[k].gradient_updates_per_optimizer_step.unwrap_or(1) as u64;
    let earlier: u64 = (0..t.stage)
        .map(|k| stages[k].epochs * t.settings.steps_per_epoch(k) * micro(k))
        .sum();
    earlier + t.update * micro(t.stage)
}

impl NflowsExport {
    /// The state dict as safetensors bytes (metadata `format: pt`, as PyTorch's
    /// `safetensors.torch.save_file` writes).
    ///
    /// Errors: a tensor whose values do not fill its shape.
    pub fn state_dict_bytes(&self) -> Result<Vec<u8>, NpeError> {
        let bytes: Vec<(Dtype, Vec<u8>)> = self
            .tensors
            .iter()
            .map(|t| match &t.values {
                Values::F32(v) => (Dtype::F32, v.iter().flat_map(|x| x.to_le_bytes()).collect()),
                Values::I64(v) => (Dtype::I64, v.iter().flat_map(|x| x.to_le_bytes()).collect()),
            })
            .collect();
        let views = self
            .tensors
            .iter()
            .zip(&bytes)
            .map(|(t, (dtype, b))| {
                TensorView::new(*dtype, t.shape.clone(), b)
                    .map(|v| (t.name.clone(), v))
                    .map_err(|e| NpeError::Invalid(format!("{}: {e}", t.name)))
            })
            .collect::<Result<Vec<_>, _>>()?;
        let meta: HashMap<String, String> = [("format".to_string(), "pt".to_string())].into();
        safetensors::serialize(views, Some(meta))
            .map_err(|e| NpeError::Invalid(format!("cannot serialize the state dict: {e}")))
    }

    /// Writes [`NFLOWS_STATE_FILE`] and [`NFLOWS_SETTINGS_FILE`] into `dir` (each
    /// atomically: temp file, fsync, rename) and returns their paths.
    ///
    /// Errors: `dir` is not a folder, or a file cannot be written (naming it).
    pub fn write(&self, dir: &Path) -> Result<Vec<PathBuf>, NpeError> {
        if !dir.is_dir() {
            return Err(NpeError::Data(format!(
                "{}: no such folder to write the export into",
                dir.display()
            )));
        }
        let state = self.state_dict_bytes()?;
        let settings = serde_json::to_string_pretty(&self.settings)
            .map_err(|e| NpeError::Invalid(format!("cannot write the settings: {e}")))?;
        let (sp, jp) = (dir.join(NFLOWS_STATE_FILE), dir.join(NFLOWS_SETTINGS_FILE));
        // Both files are written under temporary names first and renamed only when both
        // are complete, so a failure leaves the earlier pair as it was.
        let tmp = |p: &Path| {
            let name = p.file_name().unwrap_or_default().to_string_lossy();
            dir.join(format!(".{name}.tmp{}", std::process::id()))
        };
        let pairs = [(tmp(&sp), &sp), (tmp(&jp), &jp)];
        let written = [state, settings.into_bytes()]
            .iter()
            .zip(&pairs)
            .try_for_each(|(data, (t, _))| {
                std::fs::File::create(t)
                    .and_then(|mut f| {
                        std::io::Write::write_all(&mut f, data)?;
                        f.sync_all()
                    })
                    .map_err(|e| NpeError::io(format!("cannot write {}", t.display()), e))
            })
            .and_then(|()| {
                pairs.iter().try_for_each(|(t, p)| {
                    std::fs::rename(t, p)
                        .map_err(|e| NpeError::io(format!("cannot write {}", p.display()), e))
                })
            });
        if written.is_err() {
            pairs.iter().for_each(|(t, _)| {
                let _ = std::fs::remove_file(t);
            });
        }
        written?;
        Ok(vec![sp, jp])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_map_to_dingo_layout() {
        let n = |s: &str, p: bool| nflows_name(s, p).unwrap();
        assert_eq!(
            n("embedding_net.layers_rb.1.weight", true),
            "embedding_net.0.layers_rb.1.weight"
        );
        assert_eq!(
            n("embedding_net.blocks.0.linear_layers.1.bias", true),
            "embedding_net.1.blocks.0.linear_layers.1.bias"
        );
        assert_eq!(
            n("embedding_net.initial_layer.weight", false),
            "embedding_net.0.initial_layer.weight"
        );
        assert_eq!(
            n("flow.steps.3.lu_linear.lower_entries", false),
            "flow._transform._transforms.3._transforms.0._transforms.1.lower_entries"
        );
        assert_eq!(
            n(
                "flow.steps.12.coupling.transform_net.final_layer.weight",
                false
            ),
            "flow._transform._transforms.12._transforms.1.transform_net.final_layer.weight"
        );
        assert!(nflows_name("flow.other.weight", false).is_err());
        assert!(ExportFormat::parse("dingo").is_ok());
        assert!(ExportFormat::parse("onnx").is_err());
    }
}
