//! Optimizers on flat f32 buffers: Adam (Kingma & Ba 2015, with bias correction as in
//! PyTorch's `torch.optim.Adam`) and SGD with momentum (PyTorch's formulation:
//! `v = momentum*v + g; p -= lr*v`); learning-rate schedules constant and warmup-cosine.
//!
//! The optimizer state is plain data (`slots`, `step`) so checkpoints can save and restore it
//! exactly, and every replica applying the same update to the same state stays bitwise equal.

use crate::config::{check_keys, get_f64, get_str, get_u64};
use crate::TrainError;
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
    },
    /// Stochastic gradient descent with (heavy-ball) momentum (default 0: plain SGD).
    Sgd {
        /// Momentum factor.
        momentum: f32,
    },
}

/// Learning-rate schedule over optimizer updates.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Schedule {
    /// The base learning rate at every update.
    Constant,
    /// Linear warm-up from 0 over `warmup_updates`, then cosine decay to `min_learning_rate`
    /// at `total_updates` (0 = the run's update count).
    WarmupCosine {
        /// Updates of linear warm-up.
        warmup_updates: u64,
        /// Update at which the cosine reaches its minimum.
        total_updates: u64,
        /// The final learning rate.
        min_learning_rate: f64,
    },
}

/// `training.optimizer`.
#[derive(Debug, Clone, PartialEq)]
pub struct OptimizerConfig {
    /// The update rule.
    pub kind: OptimizerKind,
    /// Base learning rate (`learning_rate`, default 1e-3).
    pub learning_rate: f64,
    /// The schedule (`schedule`, default constant).
    pub schedule: Schedule,
}

impl OptimizerConfig {
    /// Parses `training.optimizer`, e.g.
    /// `{"name": "adam", "learning_rate": 1e-3, "beta1": 0.9, "beta2": 0.999, "epsilon": 1e-8,
    ///   "schedule": {"name": "warmup_cosine", "warmup_updates": 10, "min_learning_rate": 0}}`
    /// or `{"name": "sgd", "learning_rate": 0.1, "momentum": 0.9}`. Absent: Adam, lr 1e-3.
    ///
    /// Errors: [`TrainError::Config`] naming the key.
    pub fn from_json(v: Option<&Value>) -> Result<OptimizerConfig, TrainError> {
        let path = "training.optimizer";
        let empty = serde_json::Map::new();
        let obj = match v {
            None | Some(Value::Null) => &empty,
            Some(Value::Object(m)) => m,
            Some(other) => {
                return Err(TrainError::config(
                    path,
                    format!("must be an object, found {other}"),
                ))
            }
        };
        let name = get_str(obj, path, "name")?.unwrap_or("adam");
        let kind = match name {
            "adam" => {
                check_keys(
                    obj,
                    &[
                        "name",
                        "learning_rate",
                        "beta1",
                        "beta2",
                        "epsilon",
                        "schedule",
                    ],
                    path,
                )?;
                OptimizerKind::Adam {
                    beta1: get_f64(obj, path, "beta1")?.unwrap_or(0.9) as f32,
                    beta2: get_f64(obj, path, "beta2")?.unwrap_or(0.999) as f32,
                    epsilon: get_f64(obj, path, "epsilon")?.unwrap_or(1e-8) as f32,
                }
            }
            "sgd" => {
                check_keys(
                    obj,
                    &["name", "learning_rate", "momentum", "schedule"],
                    path,
                )?;
                OptimizerKind::Sgd {
                    momentum: get_f64(obj, path, "momentum")?.unwrap_or(0.0) as f32,
                }
            }
            other => {
                return Err(TrainError::config(
                    "training.optimizer.name",
                    format!("{other:?} is not an optimizer; use \"adam\" or \"sgd\""),
                ))
            }
        };
        let in_range =
            |key: &str, v: f32, lo: f32, hi: f32, what: &str| -> Result<(), TrainError> {
                if v >= lo && v < hi {
                    Ok(())
                } else {
                    Err(TrainError::config(
                        format!("training.optimizer.{key}"),
                        format!("{v} is out of range: {what}"),
                    ))
                }
            };
        match kind {
            OptimizerKind::Adam {
                beta1,
                beta2,
                epsilon,
            } => {
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
        let learning_rate = get_f64(obj, path, "learning_rate")?.unwrap_or(1e-3);
        if !(learning_rate > 0.0 && learning_rate.is_finite()) {
            return Err(TrainError::config(
                "training.optimizer.learning_rate",
                format!("must be a positive number, found {learning_rate}"),
            ));
        }
        let schedule = match obj.get("schedule") {
            None | Some(Value::Null) => Schedule::Constant,
            Some(Value::String(s)) if s == "constant" => Schedule::Constant,
            Some(Value::Object(s)) => {
                let sp = "training.optimizer.schedule";
                check_keys(
                    s,
                    &[
                        "name",
                        "warmup_updates",
                        "total_updates",
                        "min_learning_rate",
                    ],
                    sp,
                )?;
                match get_str(s, sp, "name")?.unwrap_or("constant") {
                    "constant" => Schedule::Constant,
                    "warmup_cosine" => {
                        let min_learning_rate = get_f64(s, sp, "min_learning_rate")?.unwrap_or(0.0);
                        if !(0.0..=learning_rate).contains(&min_learning_rate) {
                            return Err(TrainError::config(
                                "training.optimizer.schedule.min_learning_rate",
                                format!("{min_learning_rate} must lie between 0 and the learning_rate {learning_rate}"),
                            ));
                        }
                        Schedule::WarmupCosine {
                            warmup_updates: get_u64(s, sp, "warmup_updates")?.unwrap_or(0),
                            total_updates: get_u64(s, sp, "total_updates")?.unwrap_or(0),
                            min_learning_rate,
                        }
                    }
                    other => {
                        return Err(TrainError::config(
                            "training.optimizer.schedule.name",
                            format!(
                            "{other:?} is not a schedule; use \"constant\" or \"warmup_cosine\""
                        ),
                        ))
                    }
                }
            }
            Some(other) => {
                return Err(TrainError::config(
                    "training.optimizer.schedule",
                    format!("must be \"constant\" or an object, found {other}"),
                ))
            }
        };
        Ok(OptimizerConfig {
            kind,
            learning_rate,
            schedule,
        })
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
}

impl Optimizer {
    /// A fresh optimizer (zero state) for `n` parameters.
    pub fn new(config: OptimizerConfig, n: usize) -> Optimizer {
        let slots = match config.kind {
            OptimizerKind::Adam { .. } => vec![vec![0.0; n], vec![0.0; n]],
            OptimizerKind::Sgd { .. } => vec![vec![0.0; n]],
        };
        Optimizer {
            config,
            step: 0,
            slots,
        }
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
            } => {
                let t = self.step as i32;
                let c1 = 1.0 - beta1.powi(t);
                let c2 = 1.0 - beta2.powi(t);
                let (m, rest) = self.slots.split_at_mut(1);
                let (m, v) = (&mut m[0], &mut rest[0]);
                for i in 0..params.len() {
                    let g = grad[i];
                    m[i] = beta1 * m[i] + (1.0 - beta1) * g;
                    v[i] = beta2 * v[i] + (1.0 - beta2) * g * g;
                    let m_hat = m[i] / c1;
                    let v_hat = v[i] / c2;
                    params[i] -= lr * m_hat / (v_hat.sqrt() + epsilon);
                }
            }
            OptimizerKind::Sgd { momentum } => {
                let vel = &mut self.slots[0];
                for i in 0..params.len() {
                    vel[i] = momentum * vel[i] + grad[i];
                    params[i] -= lr * vel[i];
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

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

    #[test]
    fn bad_optimizer_names_the_key() {
        let e = OptimizerConfig::from_json(Some(&json!({"name": "adamw"}))).unwrap_err();
        assert!(e.to_string().contains("training.optimizer.name"));
        let e =
            OptimizerConfig::from_json(Some(&json!({"name": "adam", "beta_1": 0.9}))).unwrap_err();
        assert!(e.to_string().contains("did you mean `beta1`"), "{e}");
    }
}
