//! Dynamic loss scaling for mixed-precision training, as PyTorch's `torch.amp.GradScaler`
//! (`training.grad_scaler`).
//!
//! A model that computes in half precision (f16: largest finite value 65504, smallest normal
//! 6.1e-5) loses small gradients to underflow. The model multiplies its loss by the scale `S`
//! before the backward pass ([`crate::Model::set_loss_scale`]), so the half-precision
//! gradients are `S` times larger; the engine divides the reduced gradient by `S` before the
//! optimizer sees it. When the scaled gradients overflow (an infinity or NaN anywhere in the
//! reduced gradient), the update is skipped (the optimizer, its step counter and the
//! parameters stay as they were) and the scale is multiplied by `backoff_factor`; after
//! `growth_interval` consecutive updates without overflow it is multiplied by
//! `growth_factor`. The decision is taken from the all-reduced gradient, which is the same on
//! every replica, so every replica skips the same updates and holds the same scale
//! (invariants 6 and 9); the scale and its counter are part of every checkpoint.
//!
//! Unlike PyTorch's scaler, the engine does not skip forever: a run stops with
//! [`crate::TrainError::UpdatesSkipped`] after [`MAX_CONSECUTIVE_SKIPS`] skipped updates in a
//! row, or when an overflow happens at the scale's floor, and a run whose every update was
//! skipped ends with that error before it exports anything; the summary says how many
//! updates were applied and skipped.
//!
//! Defaults are PyTorch's: `init_scale` 65536 (2^16), `growth_factor` 2, `backoff_factor`
//! 0.5, `growth_interval` 2000.

use lockstep_core::config::ConfigError;
use serde::{Deserialize, Serialize};

/// Consecutive skipped updates after which a run stops ([`crate::TrainError::UpdatesSkipped`]):
/// from the default scale 65536 a backoff of 0.5 reaches 1 in 16 skips and the float32 floor
/// in 142, so a stretch this long means the gradient overflows whatever the scale.
pub const MAX_CONSECUTIVE_SKIPS: u64 = 100;

/// `training.grad_scaler`: the settings of dynamic loss scaling (PyTorch `GradScaler`'s
/// keyword arguments).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GradScalerConfig {
    /// The first scale (default 65536).
    #[serde(default = "default_init_scale")]
    pub init_scale: f64,
    /// The scale's factor after `growth_interval` clean updates (default 2, > 1).
    #[serde(default = "default_growth_factor")]
    pub growth_factor: f64,
    /// The scale's factor after an overflow (default 0.5, in (0, 1)).
    #[serde(default = "default_backoff_factor")]
    pub backoff_factor: f64,
    /// Consecutive updates without overflow before the scale grows (default 2000, >= 1).
    #[serde(default = "default_growth_interval")]
    pub growth_interval: u64,
}

fn default_init_scale() -> f64 {
    65536.0
}
fn default_growth_factor() -> f64 {
    2.0
}
fn default_backoff_factor() -> f64 {
    0.5
}
fn default_growth_interval() -> u64 {
    2000
}

impl Default for GradScalerConfig {
    fn default() -> Self {
        GradScalerConfig {
            init_scale: default_init_scale(),
            growth_factor: default_growth_factor(),
            backoff_factor: default_backoff_factor(),
            growth_interval: default_growth_interval(),
        }
    }
}

impl GradScalerConfig {
    /// Checks the ranges; errors name `PREFIX.KEY` (`prefix` is where the settings sit, e.g.
    /// `training.grad_scaler`).
    ///
    /// Errors: `init_scale` not a positive finite f32; `growth_factor <= 1`;
    /// `backoff_factor` outside (0, 1); `growth_interval` 0.
    pub fn validate(&self, prefix: &str) -> Result<(), ConfigError> {
        let key = |k: &str| format!("{prefix}.{k}");
        if !(self.init_scale > 0.0 && (self.init_scale as f32).is_finite()) {
            return Err(ConfigError::new(
                key("init_scale"),
                format!(
                    "is {}; it must be positive and at most {:e} (float32)",
                    self.init_scale,
                    f32::MAX
                ),
            ));
        }
        if !(self.growth_factor > 1.0 && self.growth_factor.is_finite()) {
            return Err(ConfigError::new(
                key("growth_factor"),
                format!("is {}; it must be above 1", self.growth_factor),
            ));
        }
        if !(self.backoff_factor > 0.0 && self.backoff_factor < 1.0) {
            return Err(ConfigError::new(
                key("backoff_factor"),
                format!("is {}; it must lie in (0, 1)", self.backoff_factor),
            ));
        }
        if self.growth_interval == 0 {
            return Err(ConfigError::new(
                key("growth_interval"),
                "is 0; it must be at least 1",
            ));
        }
        Ok(())
    }
}

/// The scaler's state, saved in checkpoints (`grad_scaler` metadata).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct GradScalerState {
    /// The current loss scale.
    pub scale: f32,
    /// Consecutive updates without overflow since the scale last changed.
    pub growth_tracker: u64,
    /// Updates skipped so far because the gradient overflowed.
    pub skipped: u64,
}

/// What one update's check decided ([`GradScaler::unscale_and_step`]).
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum ScalerVerdict {
    /// The gradient was finite; it is unscaled and the update goes ahead. `grown` holds the
    /// new scale when it grew after this update.
    Apply {
        /// The new scale, when it grew.
        grown: Option<f32>,
    },
    /// The gradient overflowed at scale `scale`: skip the update; the scale is now `lowered`.
    Skip {
        /// The scale the overflowing pass used.
        scale: f32,
        /// The scale after the backoff.
        lowered: f32,
    },
}

/// Dynamic loss scaling ([module docs](self)).
#[derive(Debug, Clone, PartialEq)]
pub struct GradScaler {
    /// The settings.
    pub config: GradScalerConfig,
    /// The state (scale, counters).
    pub state: GradScalerState,
}

impl GradScaler {
    /// A scaler at `config.init_scale`.
    pub fn new(config: GradScalerConfig) -> Self {
        GradScaler {
            config,
            state: GradScalerState {
                scale: config.init_scale as f32,
                growth_tracker: 0,
                skipped: 0,
            },
        }
    }

    /// The scale the next pass multiplies its loss by.
    pub fn scale(&self) -> f32 {
        self.state.scale
    }

    /// Checks the reduced, averaged gradient `grad` (of the loss times [`GradScaler::scale`])
    /// and updates the state: finite, it is divided by the scale in place (then the caller
    /// applies the update); any infinity or NaN, it is left as it is and the update must be
    /// skipped. The scale never falls below the smallest positive normal f32.
    pub fn unscale_and_step(&mut self, grad: &mut [f32]) -> ScalerVerdict {
        let finite = grad.iter().all(|g| g.is_finite());
        if finite {
            let inv = self.unscale_factor();
            grad.iter_mut().for_each(|g| *g *= inv);
        }
        self.step(finite)
    }

    /// The factor that unscales a gradient of the current scale: `1 / scale` in float32,
    /// as [`GradScaler::unscale_and_step`] multiplies by.
    pub fn unscale_factor(&self) -> f32 {
        1.0 / self.state.scale
    }

    /// [`GradScaler::unscale_and_step`] for a gradient the caller tested and unscales
    /// itself (a device's: [`crate::device_state::DeviceState::gradient_is_finite`], with
    /// [`GradScaler::unscale_factor`] taken before this call): updates the state from
    /// whether every value was `finite` and returns the verdict.
    pub fn step(&mut self, finite: bool) -> ScalerVerdict {
        let s = &mut self.state;
        if finite {
            s.growth_tracker += 1;
            let mut grown = None;
            if s.growth_tracker >= self.config.growth_interval {
                let next = s.scale as f64 * self.config.growth_factor;
                // PyTorch keeps the old scale where growing would overflow float32.
                if (next as f32).is_finite() {
                    s.scale = next as f32;
                    grown = Some(s.scale);
                }
                s.growth_tracker = 0;
            }
            ScalerVerdict::Apply { grown }
        } else {
            let scale = s.scale;
            s.scale = ((scale as f64 * self.config.backoff_factor) as f32).max(f32::MIN_POSITIVE);
            s.growth_tracker = 0;
            s.skipped += 1;
            ScalerVerdict::Skip {
                scale,
                lowered: s.scale,
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_overflow_skips_and_backs_off_and_clean_updates_grow_the_scale() {
        let mut s = GradScaler::new(GradScalerConfig {
            init_scale: 1024.0,
            growth_interval: 2,
            ..Default::default()
        });
        let mut g = vec![2048.0, -512.0];
        assert_eq!(
            s.unscale_and_step(&mut g),
            ScalerVerdict::Apply { grown: None }
        );
        assert_eq!(g, vec![2.0, -0.5]);
        let mut bad = vec![1.0, f32::INFINITY];
        assert_eq!(
            s.unscale_and_step(&mut bad),
            ScalerVerdict::Skip {
                scale: 1024.0,
                lowered: 512.0
            }
        );
        assert_eq!(bad[0], 1.0, "a skipped gradient is not unscaled");
        let mut nan = vec![f32::NAN];
        assert!(matches!(
            s.unscale_and_step(&mut nan),
            ScalerVerdict::Skip { lowered: 256.0, .. }
        ));
        // Two clean updates after the last overflow: the scale doubles.
        for expect in [None, Some(512.0)] {
            let mut g = vec![256.0];
            assert_eq!(
                s.unscale_and_step(&mut g),
                ScalerVerdict::Apply { grown: expect }
            );
            assert_eq!(g, vec![1.0]);
        }
        assert_eq!(
            s.state,
            GradScalerState {
                scale: 512.0,
                growth_tracker: 0,
                skipped: 2
            }
        );
    }

    #[test]
    fn out_of_range_settings_name_their_key() {
        for (c, key) in [
            (
                GradScalerConfig {
                    init_scale: 0.0,
                    ..Default::default()
                },
                "init_scale",
            ),
            (
                GradScalerConfig {
                    init_scale: 1e39,
                    ..Default::default()
                },
                "init_scale",
            ),
            (
                GradScalerConfig {
                    growth_factor: 1.0,
                    ..Default::default()
                },
                "growth_factor",
            ),
            (
                GradScalerConfig {
                    backoff_factor: 1.0,
                    ..Default::default()
                },
                "backoff_factor",
            ),
            (
                GradScalerConfig {
                    growth_interval: 0,
                    ..Default::default()
                },
                "growth_interval",
            ),
        ] {
            let e = c.validate("training.grad_scaler").unwrap_err().to_string();
            assert!(e.contains(&format!("training.grad_scaler.{key}")), "{e}");
        }
        GradScalerConfig::default()
            .validate("training.grad_scaler")
            .unwrap();
    }
}
