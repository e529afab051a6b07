//! NEST's time grid and exact-integration propagators, reimplemented from NEST 3.x
//! documentation and sources (`nest::Time`, `IAFPropagatorAlpha` in `libnestutil`).
//!
//! NEST represents time in integer "tics" (1000 per ms by default); the resolution `dt`
//! is a whole number of tics per step. Conversions used by the models:
//! * refractory periods: `Time(Time::ms(t)).get_steps()`: round to tics, then round *up*
//!   to whole steps;
//! * delays: `delay_ms_to_steps`: round to the *nearest* step;
//! * precise spike times (`spike_generator`, `precise_times=True`): `Time::ms_stamp`,
//!   the step that ends at or after the time.

use crate::error::{Result, SnnError};

/// NEST's default tics per ms (`CONFIG_TICS_PER_MS`).
pub const TICS_PER_MS: f64 = 1000.0;

/// NEST's time grid for one resolution `dt` (ms).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct TimeGrid {
    /// Resolution in ms.
    pub dt: f64,
    /// Tics per step (integer, >= 1).
    pub tics_per_step: i64,
}

impl TimeGrid {
    /// Grid for resolution `dt` ms; `dt` must be a positive whole number of tics (0.001 ms).
    pub fn new(dt: f64) -> Result<Self> {
        if !(dt.is_finite() && dt > 0.0) {
            return Err(SnnError::InvalidDt {
                dt,
                reason: "must be a positive, finite number of ms".into(),
            });
        }
        let tics = dt * TICS_PER_MS;
        let rounded = tics.round();
        if rounded < 1.0 || (tics - rounded).abs() > 1e-9 * rounded.max(1.0) {
            return Err(SnnError::InvalidDt {
                dt,
                reason: format!(
                    "NEST's grid needs a whole number of tics of {} ms per step; use e.g. 0.1, 0.025 or 1.0",
                    1.0 / TICS_PER_MS
                ),
            });
        }
        Ok(TimeGrid {
            dt,
            tics_per_step: rounded as i64,
        })
    }

    /// Milliseconds per step as NEST stores it (`TICS_PER_STEP / TICS_PER_MS`).
    pub fn ms_per_step(&self) -> f64 {
        self.tics_per_step as f64 / TICS_PER_MS
    }

    /// `Time(Time::ms(t)).get_steps()`: tics rounded half up, then steps rounded up.
    /// Used for refractory periods.
    pub fn ms_to_steps_ceil(&self, t_ms: f64) -> i64 {
        let tics = (t_ms * TICS_PER_MS + 0.5) as i64;
        (tics + self.tics_per_step - 1).div_euclid(self.tics_per_step)
    }

    /// `Time::delay_ms_to_steps`: nearest step (`floor(x + 0.5)`). Used for delays.
    pub fn delay_ms_to_steps(&self, delay_ms: f64) -> i64 {
        let steps_per_ms = 1.0 / self.ms_per_step();
        (delay_ms * steps_per_ms + 0.5).floor() as i64
    }

    /// `Time::ms_stamp(t)` in steps: the grid point at or after `t` (ms), computed exactly as
    /// NEST does (truncate to tics, floor to a step, move up one step if that is before `t`).
    /// A spike with stamp `s` is emitted by its generator in update step `s - 1` (the step
    /// that ends at or after `t`).
    pub fn ms_stamp_steps(&self, t_ms: f64) -> i64 {
        let tps = self.tics_per_step;
        let mut n = (t_ms * TICS_PER_MS) as i64;
        n -= n.rem_euclid(tps);
        let ms = n as f64 * (1.0 / tps as f64) * self.ms_per_step();
        if ms < t_ms {
            n += tps;
        }
        n / tps
    }

    /// Number of steps of a run of `tstop` ms; `tstop` must be a whole number of steps.
    pub fn run_steps(&self, tstop: f64) -> Result<usize> {
        if !(tstop.is_finite() && tstop > 0.0) {
            return Err(SnnError::InvalidDt {
                dt: self.dt,
                reason: format!("run.tstop = {tstop} ms must be positive"),
            });
        }
        let tics = (tstop * TICS_PER_MS + 0.5) as i64;
        if tics % self.tics_per_step != 0 {
            return Err(SnnError::InvalidDt {
                dt: self.dt,
                reason: format!("run.tstop = {tstop} ms is not a whole number of steps of dt"),
            });
        }
        let steps = tics / self.tics_per_step;
        if steps > u32::MAX as i64 {
            return Err(SnnError::InvalidDt {
                dt: self.dt,
                reason: format!("run.tstop = {tstop} ms is {steps} steps, more than one run can hold (2^32 - 1); split the run or use a larger dt"),
            });
        }
        Ok(steps as usize)
    }
}

/// Exact propagators of an alpha-shaped synaptic current into the membrane potential of a
/// leaky integrator (NEST `IAFPropagatorAlpha::evaluate`, including its treatment of the
/// singular case `tau_syn == tau_m`).
///
/// Arguments in ms, ms, pF, ms. Returns `(P31, P32)`: the contributions of `dI/dt`-state `y1`
/// and current `y2` to `V` after one step `h`.
pub(crate) fn alpha_propagator(tau_syn: f64, tau_m: f64, c_m: f64, h: f64) -> (f64, f64) {
    const NUMERICAL_STABILITY_FACTOR: f64 = 1e-7;
    let h_min_regular = NUMERICAL_STABILITY_FACTOR * tau_m * tau_m / (tau_m - tau_syn).abs();
    let beta = tau_syn * tau_m / (tau_m - tau_syn);
    let gamma = beta / c_m;
    let inv_tau_syn = 1.0 / tau_syn;
    let inv_tau_m = 1.0 / tau_m;
    let inv_c_m = 1.0 / c_m;
    let inv_beta = (tau_m - tau_syn) / (tau_syn * tau_m);

    let exp_h_tau_syn = (-h * inv_tau_syn).exp();
    let expm1_h_tau = (h * inv_beta).exp_m1();
    let mut p32 = gamma * exp_h_tau_syn * expm1_h_tau;
    let mut exp_h_tau = f64::NAN;
    if !(p32.is_normal() && p32 > 0.0) {
        exp_h_tau = (-h * inv_tau_m).exp();
        p32 = h * inv_c_m * exp_h_tau;
    }
    if h > h_min_regular {
        let p31 = gamma * exp_h_tau_syn * (beta * expm1_h_tau - h);
        return (p31, p32);
    }
    if exp_h_tau.is_nan() {
        exp_h_tau = (-h * inv_tau_m).exp();
    }
    (0.5 * h * h * inv_c_m * exp_h_tau, p32)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn grid_conversions_match_nest_rules() {
        let g = TimeGrid::new(0.1).unwrap();
        assert_eq!(g.tics_per_step, 100);
        // refractory: round up to steps
        assert_eq!(g.ms_to_steps_ceil(2.6000000000000005), 26);
        assert_eq!(g.ms_to_steps_ceil(2.65), 27);
        assert_eq!(g.ms_to_steps_ceil(3.0), 30);
        // delays: nearest step
        assert_eq!(g.delay_ms_to_steps(2.0), 20);
        assert_eq!(g.delay_ms_to_steps(0.14), 1);
        assert_eq!(g.delay_ms_to_steps(0.04), 0);
        // precise times: step ending at or after t
        assert_eq!(g.ms_stamp_steps(445.539), 4456);
        assert_eq!(g.ms_stamp_steps(12.3), 123);
        assert_eq!(g.ms_stamp_steps(12.301), 124);
        assert_eq!(g.ms_stamp_steps(0.001), 1);
        assert_eq!(g.run_steps(1000.0).unwrap(), 10000);
        assert!(g.run_steps(1000.05).is_err());
        assert!(g.run_steps(1e12).is_err());
        let g1 = TimeGrid::new(1.0).unwrap();
        assert_eq!(g1.ms_to_steps_ceil(2.6), 3);
        assert_eq!(g1.ms_stamp_steps(3.0), 3);
        assert_eq!(g1.ms_stamp_steps(3.0001), 4);
        assert!(TimeGrid::new(0.0).is_err());
        assert!(TimeGrid::new(0.0001).is_err());
    }

    #[test]
    fn alpha_propagator_regular_and_singular() {
        // Regular case against the closed form of the alpha kernel integrated through a
        // leaky membrane: V(h) for y1(0)=1 (dI/dt), y2(0)=0, computed by fine Euler steps.
        let (tau_s, tau_m, c, h) = (2.0, 10.0, 250.0, 0.1);
        let (p31, p32) = alpha_propagator(tau_s, tau_m, c, h);
        let euler = |y1_0: f64, y2_0: f64| {
            let n = 200_000;
            let dt = h / n as f64;
            let (mut y1, mut y2, mut v) = (y1_0, y2_0, 0.0f64);
            for _ in 0..n {
                let dv = -v / tau_m + y2 / c;
                let dy2 = y1 - y2 / tau_s;
                let dy1 = -y1 / tau_s;
                v += dt * dv;
                y2 += dt * dy2;
                y1 += dt * dy1;
            }
            v
        };
        assert!(
            (p31 - euler(1.0, 0.0)).abs() < 1e-4 * p31.abs(),
            "{p31} vs {}",
            euler(1.0, 0.0)
        );
        assert!(
            (p32 - euler(0.0, 1.0)).abs() < 1e-4 * p32.abs(),
            "{p32} vs {}",
            euler(0.0, 1.0)
        );
        // Singular case tau_syn == tau_m: finite, and continuous with a nearby regular case.
        let (s31, s32) = alpha_propagator(10.0, 10.0, c, h);
        let (n31, n32) = alpha_propagator(10.0 + 1e-4, 10.0, c, h);
        assert!(s31.is_finite() && s32.is_finite());
        assert!((s31 - n31).abs() < 1e-6 * s31.abs());
        assert!((s32 - n32).abs() < 1e-5 * s32.abs());
    }
}
