//! The gravitational-wave chirp task: a frequency-domain post-Newtonian inspiral (TaylorF2)
//! projected onto the LIGO Hanford and Livingston detectors, whitened by an analytic design
//! sensitivity, with Gaussian noise; the data is the real and imaginary whitened strain per
//! detector over the frequency grid, as Dingo feeds its network.
//!
//! Sources and conventions (all SI, LAL's constants):
//! - TaylorF2 with LALSimulation's conventions (`XLALSimInspiralTaylorF2Core`,
//!   `XLALSimInspiralPNPhasing_F2`; Buonanno et al. 2009, PRD 80, 084043, Eq. 3.18): 3.5PN
//!   non-spinning phase, leading-order (0PN) amplitude, reference at coalescence
//!   (`f_ref = 0`), zero above the Schwarzschild ISCO `f = 1/(6^{3/2} π M)`;
//!   `h̃(f) = A v^{-7/2} e^{-i(Ψ(f) - 2φ_c - π/4)}` with `v = (π M f)^{1/3}` and
//!   `A = -4 (m₁ m₂ / r) (G M_☉/c²)(G M_☉/c³) √(π/12) √(5/(32η))` (masses in M_☉), and
//!   `h̃₊ = (1 + cos²ι)/2 · h̃`, `h̃ₓ = -i cos ι · h̃` (`XLALSimInspiralChooseFDWaveform`).
//! - Detector responses as LAL's `XLALComputeDetAMResponse` (detector tensor
//!   `D = (x⊗x - y⊗y)/2` from the arm directions of `LALDetectors.h`) and arrival times as
//!   `XLALTimeDelayFromEarthCenter`; the strain of detector d is
//!   `(F₊ h̃₊ + Fₓ h̃ₓ) e^{-2πi f (t_c + Δt_d)}`.
//! - The noise PSD is the analytic fit to Advanced LIGO's zero-detuned high-power design
//!   sensitivity of Ajith 2011 (PRD 84, 084037, Eq. 4.7):
//!   `S(f) = 1e-49 [x^{-4.14} - 5x^{-2} + 111 (1 - x² + x⁴/2)/(1 + x²/2)] Hz⁻¹`,
//!   `x = f / 215 Hz`.
//! - Whitening: `x_w(f) = d̃(f) √(4Δf) / √S(f)`, so the noise has independent standard normal
//!   real and imaginary parts and a signal's optimal SNR² is `Σ |h_w|²`.
//!
//! The test data `tests/data/taylorf2_lal.json` holds waveforms and detector responses
//! computed with LALSuite (lal 7.7.1, lalsimulation 6.2.1; the `lalsuite` 7.26.16 wheel) by
//! `scripts/taylorf2_lal_reference.py`; `tests/npe_library/gw_waveform.rs` compares against them.

use crate::task::{BasisLayout, PriorBound, Task};
use lockstep_core::config::ConfigError;
use lockstep_core::rng::SplitMix64;
use serde::{Deserialize, Serialize};
use std::f64::consts::PI;

/// Seconds per solar mass, `G M_☉ / c³` (LAL_MTSUN_SI).
pub const MTSUN_SI: f64 = 4.925_490_947_641_267e-6;
/// Metres per solar mass, `G M_☉ / c²` (LAL_MRSUN_SI).
pub const MRSUN_SI: f64 = 1_476.625_038_050_124_7;
/// Metres per parsec (LAL_PC_SI).
pub const PC_SI: f64 = 3.085_677_581_491_367e16;
/// Speed of light, m/s (LAL_C_SI).
pub const C_SI: f64 = 299_792_458.0;
/// Euler's constant (LAL_GAMMA).
const GAMMA_E: f64 = 0.577_215_664_901_532_9;

/// A detector: vertex in Earth-fixed coordinates (m) and unit arm directions.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Detector {
    /// Short name (`H1`, `L1`).
    pub name: &'static str,
    /// Vertex position, Earth-fixed (m).
    pub vertex: [f64; 3],
    /// Unit vector along the x arm.
    pub x_arm: [f64; 3],
    /// Unit vector along the y arm.
    pub y_arm: [f64; 3],
}

/// LIGO Hanford 4 km (LALDetectors.h `LAL_LHO_4K_*`).
pub const H1: Detector = Detector {
    name: "H1",
    vertex: [-2.161_414_926_36e6, -3.834_695_178_89e6, 4.600_350_226_64e6],
    x_arm: [-0.223_892_661_54, 0.799_830_627_46, 0.556_904_878_31],
    y_arm: [-0.913_978_185_74, 0.026_094_039_89, -0.404_923_421_25],
};

/// LIGO Livingston 4 km (LALDetectors.h `LAL_LLO_4K_*`).
pub const L1: Detector = Detector {
    name: "L1",
    vertex: [-7.427_604_472_38e4, -5.496_283_719_71e6, 3.224_257_017_44e6],
    x_arm: [-0.954_574_121_53, -0.141_580_773_40, -0.262_189_113_24],
    y_arm: [0.297_741_568_94, -0.487_910_336_47, -0.820_544_612_86],
};

impl Detector {
    /// `D = (x⊗x - y⊗y) / 2`.
    pub fn tensor(&self) -> [[f64; 3]; 3] {
        let mut d = [[0.0; 3]; 3];
        for (i, row) in d.iter_mut().enumerate() {
            for (j, v) in row.iter_mut().enumerate() {
                *v = 0.5 * (self.x_arm[i] * self.x_arm[j] - self.y_arm[i] * self.y_arm[j]);
            }
        }
        d
    }

    /// Antenna patterns `(F₊, Fₓ)` for a source at right ascension `ra`, declination `dec`
    /// (rad), polarization angle `psi`, at Greenwich mean sidereal time `gmst` (rad)
    /// (LAL `XLALComputeDetAMResponse`).
    pub fn antenna_pattern(&self, ra: f64, dec: f64, psi: f64, gmst: f64) -> (f64, f64) {
        let gha = gmst - ra;
        let (sg, cg) = gha.sin_cos();
        let (sd, cd) = dec.sin_cos();
        let (sp, cp) = psi.sin_cos();
        let x = [-cp * sg - sp * cg * sd, -cp * cg + sp * sg * sd, sp * cd];
        let y = [sp * sg - cp * cg * sd, sp * cg + cp * sg * sd, cp * cd];
        let d = self.tensor();
        let (mut fp, mut fc) = (0.0, 0.0);
        for i in 0..3 {
            for j in 0..3 {
                fp += d[i][j] * (x[i] * x[j] - y[i] * y[j]);
                fc += d[i][j] * (x[i] * y[j] + y[i] * x[j]);
            }
        }
        (fp, fc)
    }

    /// Arrival time at the detector minus at the Earth's centre (s) for a source at
    /// `(ra, dec)` at `gmst` (LAL `XLALTimeDelayFromEarthCenter`).
    pub fn time_delay_from_earth_center(&self, ra: f64, dec: f64, gmst: f64) -> f64 {
        let gha = gmst - ra;
        let e = [dec.cos() * gha.cos(), -dec.cos() * gha.sin(), dec.sin()];
        -(e[0] * self.vertex[0] + e[1] * self.vertex[1] + e[2] * self.vertex[2]) / C_SI
    }
}

/// One-sided noise PSD of Advanced LIGO's design (Ajith 2011 fit, Hz⁻¹) at `f` Hz.
pub fn design_psd(f: f64) -> f64 {
    let x = f / 215.0;
    let x2 = x * x;
    1e-49 * (x.powf(-4.14) - 5.0 / x2 + 111.0 * (1.0 - x2 + 0.5 * x2 * x2) / (1.0 + 0.5 * x2))
}

/// TaylorF2 `(h̃₊, h̃ₓ)` at frequencies `freqs` (Hz) as `(re, im)` pairs (strain/Hz), for
/// component masses `m1`, `m2` (M_☉), luminosity distance `distance_mpc` (Mpc),
/// inclination `iota` (rad) and orbital phase at coalescence `phi_c` (rad); zero above the
/// ISCO frequency and at `f ≤ 0`. Coalescence at t = 0 (multiply by `e^{-2πift}` to move it).
pub fn taylor_f2(
    freqs: &[f64],
    m1: f64,
    m2: f64,
    distance_mpc: f64,
    iota: f64,
    phi_c: f64,
) -> Vec<[[f64; 2]; 2]> {
    let m = m1 + m2;
    let eta = m1 * m2 / (m * m);
    let m_sec = m * MTSUN_SI;
    let pim = PI * m_sec;
    let f_isco = 1.0 / (6f64.sqrt().powi(3) * pim);
    let r = distance_mpc * 1e6 * PC_SI;
    // LAL: amp0 = -4 m1 m2 / r · MRSUN · MTSUN · sqrt(π/12); SPA amplitude at 0PN:
    // sqrt(-dE/flux) · v = sqrt(5 / (32 η)) v^{-7/2}.
    let amp0 = -4.0 * m1 * m2 / r * MRSUN_SI * MTSUN_SI * (PI / 12.0).sqrt();
    let amp_n = amp0 * (5.0 / (32.0 * eta)).sqrt();
    let pfa_n = 3.0 / (128.0 * eta);
    let pfa2 = 5.0 * (743.0 / 84.0 + 11.0 * eta) / 9.0;
    let pfa3 = -16.0 * PI;
    let pfa4 = 5.0 * (3058.673 / 7.056 + 5429.0 / 7.0 * eta + 617.0 * eta * eta) / 72.0;
    let pfa5 = 5.0 / 9.0 * (7729.0 / 84.0 - 13.0 * eta) * PI;
    let pfl5 = 5.0 / 3.0 * (7729.0 / 84.0 - 13.0 * eta) * PI;
    let pfa6 = (11583.231236531 / 4.694215680 - 640.0 / 3.0 * PI * PI - 6848.0 / 21.0 * GAMMA_E)
        + eta * (-15737.765635 / 3.048192 + 2255.0 / 12.0 * PI * PI)
        + eta * eta * 76055.0 / 1728.0
        - eta * eta * eta * 127825.0 / 1296.0
        + (-6848.0 / 21.0) * 4f64.ln();
    let pfl6 = -6848.0 / 21.0;
    let pfa7 = PI * (77096675.0 / 254016.0 + 378515.0 / 1512.0 * eta - 74045.0 / 756.0 * eta * eta);
    let (pfac, cfac) = (0.5 * (1.0 + iota.cos().powi(2)), iota.cos());
    freqs
        .iter()
        .map(|&f| {
            if f <= 0.0 || f > f_isco {
                return [[0.0; 2]; 2];
            }
            let v = (pim * f).cbrt();
            let logv = v.ln();
            let v2 = v * v;
            let v5 = v2 * v2 * v;
            let series = 1.0
                + pfa2 * v2
                + pfa3 * v2 * v
                + pfa4 * v2 * v2
                + (pfa5 + pfl5 * logv) * v5
                + (pfa6 + pfl6 * logv) * v5 * v
                + pfa7 * v5 * v2;
            let phasing = pfa_n * series / v5 - 2.0 * phi_c;
            let amp = amp_n * v.powf(-3.5);
            let (s, c) = (phasing - PI / 4.0).sin_cos();
            let h = [amp * c, -amp * s];
            // h+ = pfac h, hx = -i cfac h.
            [[pfac * h[0], pfac * h[1]], [cfac * h[1], -cfac * h[0]]]
        })
        .collect()
}

/// `(m₁, m₂)` (M_☉, m₁ ≥ m₂) from chirp mass `mc` and mass ratio `q = m₂/m₁ ≤ 1`.
pub fn component_masses(mc: f64, q: f64) -> (f64, f64) {
    // Mc = (m1 m2)^{3/5} / (m1 + m2)^{1/5} with m2 = q m1: m1 = Mc (1+q)^{1/5} / q^{3/5}.
    let m1 = mc * (1.0 + q).powf(0.2) / q.powf(0.6);
    (m1, q * m1)
}

fn default_mc() -> [f64; 2] {
    [15.0, 30.0]
}
fn default_q() -> [f64; 2] {
    [0.25, 1.0]
}
fn default_distance() -> [f64; 2] {
    [200.0, 1000.0]
}
fn default_tc() -> [f64; 2] {
    [-0.05, 0.05]
}
fn default_f_min() -> f64 {
    20.0
}
fn default_f_max() -> f64 {
    128.0
}
fn default_delta_f() -> f64 {
    0.25
}

/// `data.task` for the chirp task (`name: gw_chirp`): priors, the fixed extrinsic
/// parameters and the frequency grid.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GwChirp {
    /// Chirp mass prior bounds (M_☉, uniform). Default `[15, 30]`.
    #[serde(default = "default_mc")]
    pub chirp_mass: [f64; 2],
    /// Mass ratio `m₂/m₁` prior bounds (uniform). Default `[0.25, 1]`.
    #[serde(default = "default_q")]
    pub mass_ratio: [f64; 2],
    /// Luminosity distance prior bounds (Mpc, uniform in volume, `p ∝ d²`). Default
    /// `[200, 1000]`.
    #[serde(default = "default_distance")]
    pub luminosity_distance: [f64; 2],
    /// Geocentric coalescence time prior bounds (s, uniform). Default `[-0.05, 0.05]`.
    #[serde(default = "default_tc")]
    pub coalescence_time: [f64; 2],
    /// Right ascension (rad, fixed). Default 1.375.
    #[serde(default = "default_ra")]
    pub ra: f64,
    /// Declination (rad, fixed). Default -1.2108.
    #[serde(default = "default_dec")]
    pub dec: f64,
    /// Polarization angle (rad, fixed). Default 2.659.
    #[serde(default = "default_psi")]
    pub psi: f64,
    /// Inclination (rad, fixed). Default 0.4.
    #[serde(default = "default_iota")]
    pub inclination: f64,
    /// Greenwich mean sidereal time of the reference time (rad, fixed). Default 0.5.
    #[serde(default = "default_gmst")]
    pub gmst: f64,
    /// Lowest frequency of the grid (Hz). Default 20.
    #[serde(default = "default_f_min")]
    pub f_min: f64,
    /// Highest frequency of the grid (Hz). Default 128.
    #[serde(default = "default_f_max")]
    pub f_max: f64,
    /// Grid spacing (Hz; 1 / segment duration). Default 0.25.
    #[serde(default = "default_delta_f")]
    pub delta_f: f64,
}

fn default_ra() -> f64 {
    1.375
}
fn default_dec() -> f64 {
    -1.2108
}
fn default_psi() -> f64 {
    2.659
}
fn default_iota() -> f64 {
    0.4
}
fn default_gmst() -> f64 {
    0.5
}

impl Default for GwChirp {
    fn default() -> Self {
        GwChirp {
            chirp_mass: default_mc(),
            mass_ratio: default_q(),
            luminosity_distance: default_distance(),
            coalescence_time: default_tc(),
            ra: default_ra(),
            dec: default_dec(),
            psi: default_psi(),
            inclination: default_iota(),
            gmst: default_gmst(),
            f_min: default_f_min(),
            f_max: default_f_max(),
            delta_f: default_delta_f(),
        }
    }
}

/// Luminosity distance (Mpc) of the reduced-basis waveforms (Dingo fixes 100 Mpc).
pub const BASIS_DISTANCE: f64 = 100.0;

/// The detectors of the task, in data order.
pub const DETECTORS: [Detector; 2] = [H1, L1];

impl GwChirp {
    /// Checks the ranges.
    ///
    /// Errors: a [`ConfigError`] naming the key (relative to the task).
    pub fn validate(&self) -> Result<(), ConfigError> {
        let range = |k: &str, [a, b]: [f64; 2], lo: f64, hi: f64| {
            if a.is_finite() && b.is_finite() && lo <= a && a < b && b <= hi {
                Ok(())
            } else {
                Err(ConfigError::new(
                    k,
                    format!("[{a}, {b}] must be increasing bounds within [{lo}, {hi}]"),
                ))
            }
        };
        range("chirp_mass", self.chirp_mass, 1e-3, 1e4)?;
        range("mass_ratio", self.mass_ratio, 1e-3, 1.0)?;
        range("luminosity_distance", self.luminosity_distance, 1e-3, 1e6)?;
        range("coalescence_time", self.coalescence_time, -10.0, 10.0)?;
        if !(self.delta_f > 0.0 && self.f_min >= 10.0 && self.f_max > self.f_min) {
            return Err(ConfigError::new(
                "f_min",
                "the grid needs delta_f > 0 and 10 Hz <= f_min < f_max (the design PSD fit holds above 10 Hz)",
            ));
        }
        if self.frequencies().len() > 100_000 {
            return Err(ConfigError::new(
                "delta_f",
                "the grid has more than 100000 frequencies; raise delta_f",
            ));
        }
        Ok(())
    }

    /// The frequency grid `f_min, f_min + Δf, ...` up to `f_max` (inclusive within 1e-9 Δf).
    pub fn frequencies(&self) -> Vec<f64> {
        let n = ((self.f_max - self.f_min) / self.delta_f + 1e-9).floor() as usize + 1;
        (0..n)
            .map(|i| self.f_min + i as f64 * self.delta_f)
            .collect()
    }

    /// Draws θ = (chirp mass, mass ratio, distance, t_c, φ_c) from the prior.
    pub fn draw_prior(&self, rng: &mut SplitMix64, theta: &mut [f64]) {
        let u = |rng: &mut SplitMix64, [a, b]: [f64; 2]| a + (b - a) * rng.uniform();
        theta[0] = u(rng, self.chirp_mass);
        theta[1] = u(rng, self.mass_ratio);
        let [d0, d1] = self.luminosity_distance;
        let c = d0.powi(3) + (d1.powi(3) - d0.powi(3)) * rng.uniform();
        theta[2] = c.cbrt();
        theta[3] = u(rng, self.coalescence_time);
        theta[4] = 2.0 * PI * rng.uniform();
    }

    /// The whitened signal `[detector][re/im][frequency]` (flattened) for θ =
    /// `(chirp mass, mass ratio, distance, t_c, φ_c)`, without noise.
    pub fn whitened_signal(&self, theta: &[f64]) -> Vec<f64> {
        let freqs = self.frequencies();
        let (m1, m2) = component_masses(theta[0], theta[1]);
        let h = taylor_f2(&freqs, m1, m2, theta[2], self.inclination, theta[4]);
        let nf = freqs.len();
        let mut out = vec![0.0; 4 * nf];
        for (d, det) in DETECTORS.iter().enumerate() {
            let (fp, fc) = det.antenna_pattern(self.ra, self.dec, self.psi, self.gmst);
            let dt = det.time_delay_from_earth_center(self.ra, self.dec, self.gmst);
            let t = theta[3] + dt;
            for (k, &f) in freqs.iter().enumerate() {
                let w = (4.0 * self.delta_f / design_psd(f)).sqrt();
                let re = fp * h[k][0][0] + fc * h[k][1][0];
                let im = fp * h[k][0][1] + fc * h[k][1][1];
                let (s, c) = (-2.0 * PI * f * t).sin_cos();
                out[(2 * d) * nf + k] = w * (re * c - im * s);
                out[(2 * d + 1) * nf + k] = w * (re * s + im * c);
            }
        }
        out
    }
}

impl Task for GwChirp {
    fn name(&self) -> &str {
        "gw_chirp"
    }
    fn theta_dim(&self) -> usize {
        5
    }
    fn x_dim(&self) -> usize {
        4 * self.frequencies().len()
    }
    fn parameter_names(&self) -> Vec<String> {
        [
            "chirp_mass",
            "mass_ratio",
            "luminosity_distance",
            "geocent_time",
            "phase",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect()
    }
    /// The priors' bounds; the coalescence phase is periodic on `[0, 2π)`.
    fn prior_bounds(&self) -> Vec<PriorBound> {
        let i = |[a, b]: [f64; 2]| PriorBound::interval(a, b);
        vec![
            i(self.chirp_mass),
            i(self.mass_ratio),
            i(self.luminosity_distance),
            i(self.coalescence_time),
            PriorBound::periodic(0.0, 2.0 * PI),
        ]
    }
    fn simulate(&self, rng: &mut SplitMix64, theta: &mut [f64], x: &mut [f64]) {
        self.draw_prior(rng, theta);
        let signal = self.whitened_signal(theta);
        for (xi, s) in x.iter_mut().zip(signal) {
            *xi = s + rng.normal();
        }
    }
    /// `[detector][re, im][frequency]`: one complex block per detector.
    fn basis_layout(&self) -> BasisLayout {
        BasisLayout::Complex {
            blocks: DETECTORS.len(),
            bins: self.frequencies().len(),
        }
    }
    /// The noise-free whitened signal of a prior draw with the distance fixed at
    /// [`BASIS_DISTANCE`] (as Dingo builds its SVD basis).
    fn basis_sample(&self, rng: &mut SplitMix64, x: &mut [f64]) {
        let mut theta = [0.0; 5];
        self.draw_prior(rng, &mut theta);
        theta[2] = BASIS_DISTANCE;
        x.copy_from_slice(&self.whitened_signal(&theta));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn component_masses_invert_the_chirp_mass() {
        let (m1, m2) = component_masses(20.0, 0.5);
        let mc = (m1 * m2).powf(0.6) / (m1 + m2).powf(0.2);
        assert!((mc - 20.0).abs() < 1e-12 && (m2 / m1 - 0.5).abs() < 1e-12);
    }

    #[test]
    fn design_psd_matches_the_fit_at_its_knee() {
        // x = 1: 1 - 5 + 111 (1/2) / (3/2) = 33.
        assert!((design_psd(215.0) / 3.3e-48 - 1.0).abs() < 1e-12);
    }

    #[test]
    fn noise_is_unit_normal_and_snr_is_reasonable() {
        let task = GwChirp::default();
        let theta = [20.0, 0.8, 400.0, 0.01, 1.0];
        let s = task.whitened_signal(&theta);
        let snr = s.iter().map(|v| v * v).sum::<f64>().sqrt();
        // A 20 M_☉ chirp at 400 Mpc in two design detectors: SNR of order 10-100.
        assert!(snr > 5.0 && snr < 200.0, "SNR {snr}");
        let mut rng = SplitMix64::new(1);
        let (mut t, mut x) = (vec![0.0; 5], vec![0.0; task.x_dim()]);
        task.simulate(&mut rng, &mut t, &mut x);
        let sig = task.whitened_signal(&t);
        let n: Vec<f64> = x.iter().zip(&sig).map(|(a, b)| a - b).collect();
        let var = n.iter().map(|v| v * v).sum::<f64>() / n.len() as f64;
        assert!((var - 1.0).abs() < 0.1, "noise variance {var}");
    }
}
