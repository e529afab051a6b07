//! Optimizers on flat f32 buffers: Adam (Kingma & Ba 2015, with bias correction as in
//! PyTorch's `torch.optim.Adam`), AdamW (Loshchilov & Hutter 2019, decoupled weight decay as
//! in `torch.optim.AdamW`: `p -= lr * weight_decay * p` before the Adam step) and SGD with
//! momentum (PyTorch's formulation: `v = momentum*v + g; p -= lr*v`); learning-rate schedules
//! constant, warmup-cosine, step (PyTorch `StepLR`) and reduce-on-plateau (PyTorch
//! `ReduceLROnPlateau`, stepped by the engine with the validation loss at each epoch end).
//!
//! The optimizer state is plain data (`slots`, `step`, `plateau`) so checkpoints can save and
//! restore it exactly, and every replica applying the same update to the same state stays
//! bitwise equal.

use crate::device_state::{DeviceRule, DeviceUpdate};
use lockstep_core::config::{from_value, ConfigError};
use serde::{Deserialize, Deserializer};
use serde_json::Value;

/// Which update rule.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum OptimizerKind {
    /// Adam with decay rates `beta1`, `beta2` and `epsilon` added to `sqrt(v_hat)`.
    Adam {
        /// First-moment decay (default 0.9).
        beta1: f32,
        /// Second-moment decay (default 0.999).
        beta2: f32,
        /// Denominator offset (default 1e-8).
        epsilon: f32,
        /// Decoupled weight decay (AdamW; 0 = plain Adam). Default 0 for `adam`, 0.01 for
        /// `adamw` (PyTorch's defaults).
        weight_decay: f32,
    },
    /// Stochastic gradient descent with (heavy-ball) momentum (default 0: plain SGD).
    Sgd {
        /// Momentum factor.
        momentum: f32,
    },
}

/// Learning-rate schedule over optimizer updates: `"constant"`, or an object tagged by
/// `name` (`{"name": "warmup_cosine", "warmup_updates": 10, "min_learning_rate": 0}`; an
/// object without `name` is constant).
#[derive(Debug, Clone, Copy, PartialEq, Default, Deserialize)]
#[serde(tag = "name", rename_all = "snake_case", deny_unknown_fields)]
pub enum Schedule {
    /// The base learning rate at every update.
    #[default]
    Constant,
    /// Linear warm-up from 0 over `warmup_updates`, then cosine decay to `min_learning_rate`
    /// at `total_updates` (0 = the run's update count).
    WarmupCosine {
        /// Updates of linear warm-up.
        #[serde(default)]
        warmup_updates: u64,
        /// Update at which the cosine reaches its minimum.
        #[serde(default)]
        total_updates: u64,
        /// The final learning rate.
        #[serde(default)]
        min_learning_rate: f64,
    },
    /// PyTorch `StepLR`: the base rate times `gamma` to the power `floor(update /
    /// step_updates)`.
    Step {
        /// Updates between two decays (at least 1).
        step_updates: u64,
        /// Decay factor per step, in (0, 1] (default 0.1, as PyTorch).
        #[serde(default = "default_gamma")]
        gamma: f64,
    },
    /// PyTorch `ReduceLROnPlateau` (mode `min`, relative threshold), stepped once per epoch
    /// with the validation loss ([`Optimizer::end_epoch`]): a loss below `best (1 -
    /// threshold)` is an improvement; after more than `patience` epochs without one the rate
    /// becomes `max(rate factor, min_learning_rate)`, then `cooldown` epochs pass before
    /// counting again. Needs a run with a validation set.
    ReduceOnPlateau {
        /// Rate multiplier of a reduction, in (0, 1) (default 0.1).
        #[serde(default = "default_gamma")]
        factor: f64,
        /// Epochs without improvement tolerated (default 10).
        #[serde(default = "default_patience")]
        patience: u64,
        /// Relative improvement that counts (default 1e-4).
        #[serde(default = "default_threshold")]
        threshold: f64,
        /// Epochs after a reduction before bad epochs count again (default 0).
        #[serde(default)]
        cooldown: u64,
        /// Lower bound of the rate (default 0).
        #[serde(default)]
        min_learning_rate: f64,
    },
}

fn default_patience() -> u64 {
    10
}

fn default_threshold() -> f64 {
    1e-4
}

/// The state of a [`Schedule::ReduceOnPlateau`] (PyTorch `ReduceLROnPlateau`'s `best`,
/// `num_bad_epochs`, `cooldown_counter` and the current rate).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PlateauState {
    /// The current learning rate.
    pub learning_rate: f64,
    /// The best validation loss so far (`+inf` before the first epoch).
    pub best: f64,
    /// Epochs since the last improvement.
    pub bad_epochs: u64,
    /// Epochs of cooldown left after a reduction.
    pub cooldown_left: u64,
}

impl PlateauState {
    /// The state before the first epoch, at `learning_rate`.
    pub fn new(learning_rate: f64) -> Self {
        PlateauState {
            learning_rate,
            best: f64::INFINITY,
            bad_epochs: 0,
            cooldown_left: 0,
        }
    }
}

fn default_gamma() -> f64 {
    0.1
}
fn default_adamw_weight_decay() -> f32 {
    0.01
}

fn default_learning_rate() -> f64 {
    1e-3
}
fn default_beta1() -> f32 {
    0.9
}
fn default_beta2() -> f32 {
    0.999
}
fn default_epsilon() -> f32 {
    1e-8
}

/// `training.optimizer` as written: tagged by `name` (default `"adam"`), unknown keys refused.
#[derive(Debug, Deserialize)]
#[serde(tag = "name", rename_all = "snake_case", deny_unknown_fields)]
enum OptimizerSection {
    Adam {
        #[serde(default = "default_learning_rate")]
        learning_rate: f64,
        #[serde(default = "default_beta1")]
        beta1: f32,
        #[serde(default = "default_beta2")]
        beta2: f32,
        #[serde(default = "default_epsilon")]
        epsilon: f32,
        #[serde(default, deserialize_with = "schedule")]
        schedule: Schedule,
    },
    #[serde(rename = "adamw")]
    AdamW {
        #[serde(default = "default_learning_rate")]
        learning_rate: f64,
        #[serde(default = "default_beta1")]
        beta1: f32,
        #[serde(default = "default_beta2")]
        beta2: f32,
        #[serde(default = "default_epsilon")]
        epsilon: f32,
        #[serde(default = "default_adamw_weight_decay")]
        weight_decay: f32,
        #[serde(default, deserialize_with = "schedule")]
        schedule: Schedule,
    },
    Sgd {
        #[serde(default = "default_learning_rate")]
        learning_rate: f64,
        #[serde(default)]
        momentum: f32,
        #[serde(default, deserialize_with = "schedule")]
        schedule: Schedule,
    },
}

/// Inserts the default tag `name` into an object that has none.
fn with_default_name(mut v: Value, name: &str) -> Value {
    if let Value::Object(m) = &mut v {
        m.entry("name").or_insert_with(|| Value::from(name));
    }
    v
}

/// A schedule written as a name (`"constant"`) or as a tagged object (default `constant`).
fn schedule<'de, D: Deserializer<'de>>(d: D) -> Result<Schedule, D::Error> {
    let v = match Value::deserialize(d)? {
        Value::String(name) => serde_json::json!({ "name": name }),
        other => with_default_name(other, "constant"),
    };
    Schedule::deserialize(v).map_err(serde::de::Error::custom)
}

/// `training.optimizer`: the update rule, its learning rate and schedule, e.g.
/// `{"name": "adam", "learning_rate": 1e-3, "beta1": 0.9, "beta2": 0.999, "epsilon": 1e-8,
///   "schedule": {"name": "warmup_cosine", "warmup_updates": 10, "min_learning_rate": 0}}`,
/// `{"name": "adamw", "learning_rate": 1e-3, "weight_decay": 0.01,
///   "schedule": {"name": "step", "step_updates": 100, "gamma": 0.5}}`
/// or `{"name": "sgd", "learning_rate": 0.1, "momentum": 0.9}`. Default: Adam, lr 1e-3.
/// Deserializing checks the structure; [`OptimizerConfig::validate`] checks the ranges.
#[derive(Debug, Clone, PartialEq)]
pub struct OptimizerConfig {
    /// The update rule.
    pub kind: OptimizerKind,
    /// Base learning rate (`learning_rate`, default 1e-3).
    pub learning_rate: f64,
    /// The schedule (`schedule`, default constant).
    pub schedule: Schedule,
}

impl Default for OptimizerConfig {
    fn default() -> Self {
        OptimizerConfig {
            kind: OptimizerKind::Adam {
                beta1: default_beta1(),
                beta2: default_beta2(),
                epsilon: default_epsilon(),
                weight_decay: 0.0,
            },
            learning_rate: default_learning_rate(),
            schedule: Schedule::Constant,
        }
    }
}

impl<'de> Deserialize<'de> for OptimizerConfig {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let v = with_default_name(Value::deserialize(d)?, "adam");
        Ok(
            match OptimizerSection::deserialize(v).map_err(serde::de::Error::custom)? {
                OptimizerSection::Adam {
                    learning_rate,
                    beta1,
                    beta2,
                    epsilon,
                    schedule,
                } => OptimizerConfig {
                    kind: OptimizerKind::Adam {
                        beta1,
                        beta2,
                        epsilon,
                        weight_decay: 0.0,
                    },
                    learning_rate,
                    schedule,
                },
                OptimizerSection::AdamW {
                    learning_rate,
                    beta1,
                    beta2,
                    epsilon,
                    weight_decay,
                    schedule,
                } => OptimizerConfig {
                    kind: OptimizerKind::Adam {
                        beta1,
                        beta2,
                        epsilon,
                        weight_decay,
                    },
                    learning_rate,
                    schedule,
                },
                OptimizerSection::Sgd {
                    learning_rate,
                    momentum,
                    schedule,
                } => OptimizerConfig {
                    kind: OptimizerKind::Sgd { momentum },
                    learning_rate,
                    schedule,
                },
            },
        )
    }
}

impl OptimizerConfig {
    /// Reads and validates a `training.optimizer` value (`None`: the default).
    ///
    /// Errors: a [`ConfigError`] under `training.optimizer` naming the key.
    pub fn from_json(v: Option<&Value>) -> Result<OptimizerConfig, ConfigError> {
        let section = "training.optimizer";
        let cfg: OptimizerConfig = match v {
            None | Some(Value::Null) => OptimizerConfig::default(),
            Some(v) => from_value(v, section)?,
        };
        cfg.validate().map_err(|e| e.under(section))?;
        Ok(cfg)
    }

    /// Checks the ranges: `0 <= beta1, beta2, momentum < 1`, `0 < epsilon < 1`,
    /// `0 <= weight_decay < 1`, a positive finite learning rate,
    /// `0 <= min_learning_rate <= learning_rate`, `step_updates >= 1`, `0 < gamma <= 1`.
    ///
    /// Errors: a [`ConfigError`] whose key is relative to the optimizer (`beta1`,
    /// `schedule.min_learning_rate`, ...).
    pub fn validate(&self) -> Result<(), ConfigError> {
        let in_range = |key: &str, v: f32, lo: f32, hi: f32, what: &str| {
            if v >= lo && v < hi {
                Ok(())
            } else {
                Err(ConfigError::new(
                    key,
                    format!("{v} is out of range: {what}"),
                ))
            }
        };
        match self.kind {
            OptimizerKind::Adam {
                beta1,
                beta2,
                epsilon,
                weight_decay,
            } => {
                in_range(
                    "weight_decay",
                    weight_decay,
                    0.0,
                    1.0,
                    "use 0 <= weight_decay < 1 (AdamW's default is 0.01)",
                )?;
                in_range(
                    "beta1",
                    beta1,
                    0.0,
                    1.0,
                    "use 0 <= beta1 < 1 (typically 0.9)",
                )?;
                in_range(
                    "beta2",
                    beta2,
                    0.0,
                    1.0,
                    "use 0 <= beta2 < 1 (typically 0.999)",
                )?;
                in_range(
                    "epsilon",
                    epsilon,
                    f32::MIN_POSITIVE,
                    1.0,
                    "use a small positive number such as 1e-8",
                )?;
            }
            OptimizerKind::Sgd { momentum } => {
                in_range(
                    "momentum",
                    momentum,
                    0.0,
                    1.0,
                    "use 0 <= momentum < 1 (e.g. 0.9)",
                )?;
            }
        }
        let lr = self.learning_rate;
        if !(lr > 0.0 && lr.is_finite()) {
            return Err(ConfigError::new(
                "learning_rate",
                format!("must be a positive number, found {lr}"),
            ));
        }
        match self.schedule {
            Schedule::WarmupCosine {
                min_learning_rate, ..
            } if !(0.0..=lr).contains(&min_learning_rate) => Err(ConfigError::new(
                "schedule.min_learning_rate",
                format!("{min_learning_rate} must lie between 0 and the learning_rate {lr}"),
            )),
            Schedule::Step {
                step_updates: 0, ..
            } => Err(ConfigError::new(
                "schedule.step_updates",
                "must be at least 1",
            )),
            Schedule::Step { gamma, .. } if !(gamma > 0.0 && gamma <= 1.0) => Err(
                ConfigError::new("schedule.gamma", format!("{gamma} is not in (0, 1]")),
            ),
            Schedule::ReduceOnPlateau { factor, .. } if !(factor > 0.0 && factor < 1.0) => Err(
                ConfigError::new("schedule.factor", format!("{factor} is not in (0, 1)")),
            ),
            Schedule::ReduceOnPlateau { threshold, .. } if !(0.0..1.0).contains(&threshold) => {
                Err(ConfigError::new(
                    "schedule.threshold",
                    format!("{threshold} is not in [0, 1)"),
                ))
            }
            Schedule::ReduceOnPlateau {
                min_learning_rate, ..
            } if !(0.0..=lr).contains(&min_learning_rate) => Err(ConfigError::new(
                "schedule.min_learning_rate",
                format!("{min_learning_rate} must lie between 0 and the learning_rate {lr}"),
            )),
            _ => Ok(()),
        }
    }
}

/// An optimizer and its state for one flat parameter buffer.
#[derive(Debug, Clone, PartialEq)]
pub struct Optimizer {
    /// Settings.
    pub config: OptimizerConfig,
    /// Updates applied so far (Adam's `t`).
    pub step: u64,
    /// State buffers, each as long as the parameters: Adam `[m, v]`, SGD `[velocity]`.
    pub slots: Vec<Vec<f32>>,
    /// The reduce-on-plateau state (used only by [`Schedule::ReduceOnPlateau`]).
    pub plateau: PlateauState,
}

impl Optimizer {
    /// A fresh optimizer (zero state) for `n` parameters.
    pub fn new(config: OptimizerConfig, n: usize) -> Optimizer {
        let slots = match config.kind {
            OptimizerKind::Adam { .. } => vec![vec![0.0; n], vec![0.0; n]],
            OptimizerKind::Sgd { .. } => vec![vec![0.0; n]],
        };
        Optimizer {
            plateau: PlateauState::new(config.learning_rate),
            config,
            step: 0,
            slots,
        }
    }

    /// True when the schedule needs the validation loss at each epoch end
    /// ([`Optimizer::end_epoch`]).
    pub fn steps_on_validation(&self) -> bool {
        matches!(self.config.schedule, Schedule::ReduceOnPlateau { .. })
    }

    /// Ends an epoch whose validation loss is `loss` (reduce-on-plateau; other schedules
    /// ignore it). Returns the new learning rate when it was reduced.
    pub fn end_epoch(&mut self, loss: f64) -> Option<f64> {
        let Schedule::ReduceOnPlateau {
            factor,
            patience,
            threshold,
            cooldown,
            min_learning_rate,
        } = self.config.schedule
        else {
            return None;
        };
        let p = &mut self.plateau;
        if loss < p.best * (1.0 - threshold) {
            p.best = loss;
            p.bad_epochs = 0;
        } else {
            p.bad_epochs += 1;
        }
        if p.cooldown_left > 0 {
            p.cooldown_left -= 1;
            p.bad_epochs = 0;
        }
        if p.bad_epochs > patience {
            p.bad_epochs = 0;
            p.cooldown_left = cooldown;
            let reduced = (p.learning_rate * factor).max(min_learning_rate);
            // PyTorch's eps: a change below 1e-8 is not made.
            if p.learning_rate - reduced > 1e-8 {
                p.learning_rate = reduced;
                return Some(reduced);
            }
        }
        None
    }

    /// The learning rate of update number `step` (0-based).
    pub fn learning_rate(&self, step: u64) -> f64 {
        let base = self.config.learning_rate;
        match self.config.schedule {
            Schedule::Constant => base,
            Schedule::WarmupCosine {
                warmup_updates,
                total_updates,
                min_learning_rate,
            } => {
                if step < warmup_updates {
                    base * (step + 1) as f64 / warmup_updates as f64
                } else {
                    let span = total_updates.saturating_sub(warmup_updates).max(1) as f64;
                    let x = ((step - warmup_updates) as f64 / span).min(1.0);
                    min_learning_rate
                        + 0.5
                            * (base - min_learning_rate)
                            * (1.0 + (std::f64::consts::PI * x).cos())
                }
            }
            Schedule::Step {
                step_updates,
                gamma,
            } => base * gamma.powi((step / step_updates.max(1)).min(i32::MAX as u64) as i32),
            Schedule::ReduceOnPlateau { .. } => self.plateau.learning_rate,
        }
    }

    /// The update a device applies in place of [`Optimizer::update`]
    /// ([`crate::device_state`]): advances the step counter as `update` does and returns the
    /// rule with the scalars `update` would compute (the learning rate of this step, Adam's
    /// bias corrections, AdamW's decay factor), so the device's arithmetic is the host's.
    /// `grad_factor` and `unscale` multiply the device's gradient first
    /// ([`DeviceUpdate`]).
    pub fn device_update(&mut self, grad_factor: f32, unscale: f32) -> DeviceUpdate {
        let learning_rate = self.learning_rate(self.step) as f32;
        self.step += 1;
        let rule = match self.config.kind {
            OptimizerKind::Adam {
                beta1,
                beta2,
                epsilon,
                weight_decay,
            } => {
                let t = self.step as i32;
                DeviceRule::Adam {
                    beta1,
                    one_minus_beta1: 1.0 - beta1,
                    beta2,
                    one_minus_beta2: 1.0 - beta2,
                    epsilon,
                    keep: if weight_decay != 0.0 {
                        1.0 - learning_rate * weight_decay
                    } else {
                        1.0
                    },
                    c1: 1.0 - beta1.powi(t),
                    c2: 1.0 - beta2.powi(t),
                }
            }
            OptimizerKind::Sgd { momentum } => DeviceRule::Sgd { momentum },
        };
        DeviceUpdate {
            learning_rate,
            grad_factor,
            unscale,
            step: self.step,
            rule,
        }
    }

    /// Applies one update to `params` with gradient `grad` (same length).
    pub fn update(&mut self, params: &mut [f32], grad: &[f32]) {
        assert_eq!(
            params.len(),
            grad.len(),
            "parameter and gradient lengths differ"
        );
        let lr = self.learning_rate(self.step) as f32;
        self.step += 1;
        match self.config.kind {
            OptimizerKind::Adam {
                beta1,
                beta2,
                epsilon,
                weight_decay,
            } => {
                if weight_decay != 0.0 {
                    let keep = 1.0 - lr * weight_decay;
                    params.iter_mut().for_each(|p| *p *= keep);
                }
                let t = self.step as i32;
                let c1 = 1.0 - beta1.powi(t);
                let c2 = 1.0 - beta2.powi(t);
                let (m, rest) = self.slots.split_at_mut(1);
                let (m, v) = (&mut m[0], &mut rest[0]);
                assert!(m.len() == params.len() && v.len() == params.len());
                // Zipped slices (no bounds checks), so the loop vectorizes; the operations
                // and their order are those of the scalar formula, so the same bits.
                for (((p, &g), m), v) in params
                    .iter_mut()
                    .zip(grad)
                    .zip(m.iter_mut())
                    .zip(v.iter_mut())
                {
                    *m = beta1 * *m + (1.0 - beta1) * g;
                    *v = beta2 * *v + (1.0 - beta2) * g * g;
                    let m_hat = *m / c1;
                    let v_hat = *v / c2;
                    *p -= lr * m_hat / (v_hat.sqrt() + epsilon);
                }
            }
            OptimizerKind::Sgd { momentum } => {
                let vel = &mut self.slots[0];
                assert_eq!(vel.len(), params.len());
                for ((p, &g), vel) in params.iter_mut().zip(grad).zip(vel.iter_mut()) {
                    *vel = momentum * *vel + g;
                    *p -= lr * *vel;
                }
            }
        }
    }
}

/// Scales `grad` down to global L2 norm `max_norm` when its norm is larger, as PyTorch's
/// `torch.nn.utils.clip_grad_norm_` does: `coef = max_norm / (norm + 1e-6)`, applied when
/// `coef < 1`. The norm is summed in float64 in index order, so every replica, given the same
/// reduced gradient, clips to the same bits. Returns the norm before clipping when it clipped,
/// `None` when the gradient was left alone (norm at most `max_norm`, or not finite: a
/// non-finite gradient is the loss scaler's or the non-finite-parameter check's to report).
pub fn clip_grad_norm(grad: &mut [f32], max_norm: f64) -> Option<f64> {
    let norm = grad
        .iter()
        .map(|&g| f64::from(g) * f64::from(g))
        .sum::<f64>()
        .sqrt();
    let coef = max_norm / (norm + 1e-6);
    if !norm.is_finite() || coef >= 1.0 {
        return None;
    }
    let coef = coef as f32;
    grad.iter_mut().for_each(|g| *g *= coef);
    Some(norm)
}

#[cfg(test)]
mod tests {
    /// Clipping by hand: [3, 4] has norm 5; clipped to 1 it becomes [0.6, 0.8] (times
    /// 1 / (5 + 1e-6)); a gradient within the norm and a non-finite one are left alone.
    #[test]
    fn clip_grad_norm_scales_to_the_norm_as_pytorch_does() {
        let mut g = [3.0f32, 4.0];
        assert_eq!(super::clip_grad_norm(&mut g, 1.0), Some(5.0));
        let coef = (1.0 / (5.0 + 1e-6)) as f32;
        assert_eq!(g, [3.0 * coef, 4.0 * coef]);
        assert!((g[0] - 0.6).abs() < 1e-6 && (g[1] - 0.8).abs() < 1e-6);
        // PyTorch's 1e-6 makes a norm equal to the bound clip by a hair; one above it does not.
        let mut g = [3.0f32, 4.0];
        assert_eq!(super::clip_grad_norm(&mut g, 5.0), Some(5.0));
        let mut g = [3.0f32, 4.0];
        assert_eq!(super::clip_grad_norm(&mut g, 5.1), None);
        assert_eq!(g, [3.0, 4.0]);
        let mut g = [f32::INFINITY, 1.0];
        assert_eq!(super::clip_grad_norm(&mut g, 1.0), None);
    }

    use super::*;
    use serde_json::json;

    /// The vectorized update computes Adam's formula (Kingma & Ba 2015, algorithm 1, with
    /// PyTorch's placement of epsilon) bit for bit, over several steps.
    #[test]
    fn adam_matches_the_scalar_formula_bit_for_bit() {
        let cfg = OptimizerConfig::from_json(Some(&json!({"name": "adam", "learning_rate": 0.01})))
            .unwrap();
        let n = 1003;
        let mut opt = Optimizer::new(cfg, n);
        let mut p: Vec<f32> = (0..n).map(|i| (i as f32 * 0.37).sin()).collect();
        let mut q = p.clone();
        let (mut m, mut v) = (vec![0.0f32; n], vec![0.0f32; n]);
        let (b1, b2, eps) = (0.9f32, 0.999f32, 1e-8f32);
        for t in 1..=5 {
            let g: Vec<f32> = (0..n)
                .map(|i| ((i * t) as f32 * 0.11).cos() * 0.1)
                .collect();
            opt.update(&mut p, &g);
            let (c1, c2) = (1.0 - b1.powi(t as i32), 1.0 - b2.powi(t as i32));
            for i in 0..n {
                m[i] = b1 * m[i] + (1.0 - b1) * g[i];
                v[i] = b2 * v[i] + (1.0 - b2) * g[i] * g[i];
                q[i] -= 0.01 * (m[i] / c1) / ((v[i] / c2).sqrt() + eps);
            }
            assert!(
                p.iter().zip(&q).all(|(a, b)| a.to_bits() == b.to_bits()),
                "step {t}"
            );
        }
    }

    #[test]
    fn adam_first_step_moves_by_lr_times_sign() {
        let cfg = OptimizerConfig::from_json(Some(&json!({"name": "adam", "learning_rate": 0.1})))
            .unwrap();
        let mut opt = Optimizer::new(cfg, 2);
        let mut p = [1.0f32, 1.0];
        opt.update(&mut p, &[3.0, -0.5]);
        // m_hat = g, v_hat = g^2 after bias correction: step = lr * g/|g|.
        assert!(
            (p[0] - 0.9).abs() < 1e-6 && (p[1] - 1.1).abs() < 1e-6,
            "{p:?}"
        );
    }

    #[test]
    fn sgd_momentum_accumulates() {
        let cfg = OptimizerConfig::from_json(Some(
            &json!({"name": "sgd", "learning_rate": 0.5, "momentum": 0.9}),
        ))
        .unwrap();
        let mut opt = Optimizer::new(cfg, 1);
        let mut p = [0.0f32];
        opt.update(&mut p, &[1.0]);
        opt.update(&mut p, &[1.0]);
        assert!((p[0] - -(0.5 + 0.5 * 1.9)).abs() < 1e-6);
    }

    #[test]
    fn warmup_cosine_shape() {
        let cfg = OptimizerConfig::from_json(Some(&json!({"learning_rate": 1.0,
            "schedule": {"name": "warmup_cosine", "warmup_updates": 4, "total_updates": 14, "min_learning_rate": 0.1}})))
            .unwrap();
        let opt = Optimizer::new(cfg, 0);
        assert!((opt.learning_rate(0) - 0.25).abs() < 1e-12);
        assert!((opt.learning_rate(3) - 1.0).abs() < 1e-12);
        assert!((opt.learning_rate(9) - 0.55).abs() < 1e-12);
        assert!((opt.learning_rate(14) - 0.1).abs() < 1e-12);
        assert!((opt.learning_rate(100) - 0.1).abs() < 1e-12);
    }

    /// AdamW as `torch.optim.AdamW`: the decay shrinks the parameter by `1 - lr*wd` before
    /// the Adam step (which moves it by `lr * sign(g)` on the first update).
    #[test]
    fn adamw_decays_before_the_adam_step() {
        let cfg = OptimizerConfig::from_json(Some(
            &json!({"name": "adamw", "learning_rate": 0.1, "weight_decay": 0.5}),
        ))
        .unwrap();
        let mut opt = Optimizer::new(cfg, 2);
        let mut p = [2.0f32, -1.0];
        opt.update(&mut p, &[1.0, 1.0]);
        assert!((p[0] - (2.0 * 0.95 - 0.1)).abs() < 1e-6, "{p:?}");
        assert!((p[1] - (-0.95 - 0.1)).abs() < 1e-6, "{p:?}");
        let cfg = OptimizerConfig::from_json(Some(&json!({"name": "adamw"}))).unwrap();
        assert!(
            matches!(cfg.kind, OptimizerKind::Adam { weight_decay, .. } if weight_decay == 0.01)
        );
        let e = OptimizerConfig::from_json(Some(&json!({"name": "adamw", "weight_decay": 2.0})))
            .unwrap_err();
        assert!(
            e.to_string().contains("training.optimizer.weight_decay"),
            "{e}"
        );
    }

    #[test]
    fn reduce_on_plateau_follows_pytorch() {
        // torch.optim.lr_scheduler.ReduceLROnPlateau(opt, factor=0.5, patience=1,
        // threshold=0.1, cooldown=1, min_lr=0.02) stepped with these losses gives these rates.
        let mut o = Optimizer::new(
            OptimizerConfig::from_json(Some(&json!({"name": "sgd", "learning_rate": 0.1,
                "schedule": {"name": "reduce_on_plateau", "factor": 0.5, "patience": 1,
                    "threshold": 0.1, "cooldown": 1, "min_learning_rate": 0.02}})))
            .unwrap(),
            1,
        );
        assert!(o.steps_on_validation());
        let losses = [1.0, 0.95, 0.95, 0.5, 0.5, 0.5, 0.5, 0.5, 0.5, 0.5, 0.5];
        let rates: Vec<f64> = losses
            .iter()
            .map(|&l| {
                o.end_epoch(l);
                o.learning_rate(0)
            })
            .collect();
        let want = [
            0.1, 0.1, 0.05, 0.05, 0.05, 0.025, 0.025, 0.025, 0.02, 0.02, 0.02,
        ];
        for (r, w) in rates.iter().zip(want) {
            assert!((r - w).abs() < 1e-12, "{rates:?}");
        }
        let e = OptimizerConfig::from_json(Some(
            &json!({"schedule": {"name": "reduce_on_plateau", "factor": 1.5}}),
        ))
        .unwrap_err();
        assert!(e.to_string().contains("schedule.factor"), "{e}");
    }

    #[test]
    fn step_schedule_decays_every_step_updates() {
        let cfg = OptimizerConfig::from_json(Some(&json!({"learning_rate": 1.0,
            "schedule": {"name": "step", "step_updates": 3, "gamma": 0.5}})))
        .unwrap();
        let opt = Optimizer::new(cfg, 0);
        let lr: Vec<f64> = (0..7).map(|s| opt.learning_rate(s)).collect();
        assert_eq!(lr, [1.0, 1.0, 1.0, 0.5, 0.5, 0.5, 0.25]);
        let e = OptimizerConfig::from_json(Some(
            &json!({"schedule": {"name": "step", "step_updates": 0}}),
        ))
        .unwrap_err();
        assert!(e.to_string().contains("schedule.step_updates"), "{e}");
    }

    #[test]
    fn bad_optimizer_names_the_key() {
        let e = OptimizerConfig::from_json(Some(&json!({"name": "adan"}))).unwrap_err();
        assert!(e.to_string().contains("training.optimizer"), "{e}");
        assert!(e.to_string().contains("did you mean `adam`"), "{e}");
        let e =
            OptimizerConfig::from_json(Some(&json!({"name": "sgd", "momentum": 1.5}))).unwrap_err();
        assert!(e.to_string().contains("training.optimizer.momentum"), "{e}");
        let e = OptimizerConfig::from_json(Some(
            &json!({"schedule": {"name": "warmup_cosine", "min_learning_rate": 1.0}}),
        ))
        .unwrap_err();
        assert!(
            e.to_string()
                .contains("training.optimizer.schedule.min_learning_rate"),
            "{e}"
        );
        let e = OptimizerConfig::from_json(Some(&json!({"schedule": "warmup_cosin"}))).unwrap_err();
        assert!(
            e.to_string().contains("did you mean `warmup_cosine`"),
            "{e}"
        );

        let e =
            OptimizerConfig::from_json(Some(&json!({"name": "adam", "beta_1": 0.9}))).unwrap_err();
        assert!(e.to_string().contains("did you mean `beta1`"), "{e}");
    }
}
