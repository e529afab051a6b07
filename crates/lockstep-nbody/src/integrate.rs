//! Time integration (docs/nbody.md, "Time integration"): drift-kick-drift leapfrog (default) or
//! kick-drift-kick through a time array, one force evaluation per step, energy and momentum
//! diagnostics at each output.

use serde::{Deserialize, Serialize};

use lockstep_gpu::DeviceRequest;

use crate::direct::{direct, Forces};
use crate::fmm::{Fmm, FmmParams, FmmStats, NearField, SourceSet};
use crate::{NbodyError, Particles};

/// Leapfrog variant.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Integrator {
    /// Drift-kick-drift: `x += v dt/2; v += a(x) dt; x += v dt/2`.
    #[default]
    Dkd,
    /// Kick-drift-kick: `v += a dt/2; x += v dt; v += a(x) dt/2`.
    Kdk,
}

/// Force method.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Method {
    /// Fast multipole method ([`mod@crate::fmm`]).
    #[default]
    Fmm,
    /// Direct summation ([`mod@crate::direct`]), O(N^2).
    Direct,
}

/// Gravity settings: method, Plummer softening (kpc), FMM parameters.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ForceSettings {
    /// `"fmm"` (default) or `"direct"`.
    #[serde(default)]
    pub method: Method,
    /// Plummer softening length `eps`, kpc.
    #[serde(default)]
    pub softening: f64,
    /// FMM expansion order p (1..=6).
    #[serde(default = "d_order")]
    pub order: usize,
    /// FMM opening angle theta.
    #[serde(default = "d_theta")]
    pub theta: f64,
    /// FMM leaf size.
    #[serde(default = "d_leaf")]
    pub leaf_size: usize,
    /// FMM near-field arithmetic: `"f32"` (default) or `"f64"` ([`NearField`]).
    #[serde(default)]
    pub near_field: NearField,
    /// Where the forces are evaluated: `"cpu"` (default), `"gpu"` (the adapter of the
    /// node-local rank, as `run.device`) or `"gpu:N"` (adapter N of `lockstep info`); both
    /// methods run on the GPU ([`crate::fmm_gpu`]).
    #[serde(default, deserialize_with = "de_device")]
    pub device: DeviceRequest,
}

/// `forces.device`: `"cpu"`, `"gpu"` or `"gpu:N"`, with a message that names the accepted
/// values.
fn de_device<'de, D: serde::Deserializer<'de>>(d: D) -> Result<DeviceRequest, D::Error> {
    let s = String::deserialize(d)?;
    s.parse().map_err(|_| {
        serde::de::Error::custom(format!(
            "{s:?} is not a device; use \"cpu\", \"gpu\" or \"gpu:N\" (N from `lockstep info`)"
        ))
    })
}

fn d_order() -> usize {
    FmmParams::default().order
}
fn d_theta() -> f64 {
    FmmParams::default().theta
}
fn d_leaf() -> usize {
    FmmParams::default().leaf_size
}

impl ForceSettings {
    /// The FMM solver of these settings, on the GPU of `slot` when `device` asks for one
    /// ([`crate::fmm_gpu::open_device`]).
    ///
    /// Errors: bad FMM parameters, or [`NbodyError::Gpu`].
    pub fn solver(&self, slot: usize) -> Result<Fmm, NbodyError> {
        let fmm = Fmm::new(self.fmm_params())?;
        Ok(match crate::fmm_gpu::open_device(self.device, slot)? {
            Some(d) => fmm.on_device(d),
            None => fmm,
        })
    }

    /// The FMM parameters of these settings.
    pub fn fmm_params(&self) -> FmmParams {
        FmmParams {
            order: self.order,
            theta: self.theta,
            leaf_size: self.leaf_size,
            near_field: self.near_field,
        }
    }
}

impl Default for ForceSettings {
    fn default() -> Self {
        ForceSettings {
            method: Method::Fmm,
            softening: 0.0,
            order: d_order(),
            theta: d_theta(),
            leaf_size: d_leaf(),
            near_field: NearField::F32,
            device: DeviceRequest::Cpu,
        }
    }
}

/// Evaluates gravity on the valid particles of a shard.
#[derive(Debug, Clone)]
pub struct Gravity {
    settings: ForceSettings,
    g: f64,
    fmm: Fmm,
    /// Work counts of the last FMM evaluation.
    pub last_stats: FmmStats,
}

impl Gravity {
    /// Validated gravity with G = `g`; `forces.device: "gpu"` binds the node-local rank's
    /// adapter (slot 0 outside a launcher; [`Gravity::new_in_slot`] for thread ranks).
    ///
    /// Errors: a bad setting, or [`NbodyError::Gpu`] when the GPU cannot be opened.
    pub fn new(settings: ForceSettings, g: f64) -> Result<Self, NbodyError> {
        Self::new_in_slot(settings, g, crate::fmm_gpu::device_slot(0))
    }

    /// [`Gravity::new`] binding the GPU of `slot` (node-local rank or thread replica).
    pub fn new_in_slot(settings: ForceSettings, g: f64, slot: usize) -> Result<Self, NbodyError> {
        if !(settings.softening.is_finite() && settings.softening >= 0.0) {
            return Err(NbodyError::param(
                "forces.softening",
                settings.softening,
                "the Plummer softening length must be finite and >= 0 (kpc)",
            ));
        }
        if !(g.is_finite() && g > 0.0) {
            return Err(NbodyError::param("G", g, "G must be finite and positive"));
        }
        Ok(Gravity {
            settings,
            g,
            fmm: settings.solver(slot)?,
            last_stats: FmmStats::default(),
        })
    }

    /// Settings.
    pub fn settings(&self) -> &ForceSettings {
        &self.settings
    }

    /// G in code units.
    pub fn g(&self) -> f64 {
        self.g
    }

    /// The FMM solver (with its device, if any).
    pub fn solver(&self) -> &Fmm {
        &self.fmm
    }

    /// Acceleration `[num][3]` and potential `[num]` of the valid particles.
    ///
    /// Errors: the solver's; [`NbodyError::Interrupted`] once a stop was asked for
    /// ([`lockstep_core::interrupt`]), checked between the FMM's phases, between blocks of
    /// targets of the direct sums and after a GPU evaluation.
    pub fn forces(&mut self, p: &Particles) -> Result<Forces, NbodyError> {
        match self.settings.method {
            Method::Direct if self.fmm.device().is_some() => {
                let d = self.fmm.device().expect("checked");
                let pos = p.valid_pos();
                let f = d.direct_forces(
                    pos,
                    Some(0),
                    pos,
                    p.valid_mass(),
                    self.g,
                    self.settings.softening,
                )?;
                NbodyError::check_interrupt()?;
                Ok(f)
            }
            Method::Direct => {
                let f = direct(
                    p.valid_pos(),
                    p.valid_mass(),
                    self.g,
                    self.settings.softening,
                );
                NbodyError::check_interrupt()?;
                Ok(f)
            }
            Method::Fmm => {
                let (f, st) = self.fmm.forces(
                    &SourceSet::local(p.valid_pos(), p.valid_mass()),
                    self.g,
                    self.settings.softening,
                )?;
                self.last_stats = st;
                Ok(f)
            }
        }
    }
}

/// Conserved quantities of a shard at one time. Sums over particles, so shards combine by
/// adding (an all-reduce over ranks in sharded runs).
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct Diagnostics {
    /// Time, kpc/(km/s).
    pub time: f64,
    /// Kinetic energy `K = sum m v^2 / 2`, mass (km/s)^2.
    pub kinetic: f64,
    /// Potential energy `W = sum m phi / 2`, mass (km/s)^2.
    pub potential: f64,
    /// Total momentum `sum m v`, mass km/s.
    pub momentum: [f64; 3],
    /// Momentum scale `sum m |v|`, mass km/s (for relative momentum errors).
    pub momentum_scale: f64,
    /// Angular momentum `sum m x cross v`, mass kpc km/s.
    pub angular_momentum: [f64; 3],
}

impl Diagnostics {
    /// Energies and momenta of the valid particles with potentials `pot` (`[num]`).
    pub fn measure(p: &Particles, pot: &[f64], time: f64) -> Self {
        let mut d = Diagnostics {
            time,
            ..Default::default()
        };
        for i in 0..p.num {
            let (x, v, m) = (p.pos[i], p.vel[i], p.mass[i]);
            let v2 = v[0] * v[0] + v[1] * v[1] + v[2] * v[2];
            d.kinetic += 0.5 * m * v2;
            d.potential += 0.5 * m * pot[i];
            d.momentum_scale += m * v2.sqrt();
            for c in 0..3 {
                d.momentum[c] += m * v[c];
            }
            d.angular_momentum[0] += m * (x[1] * v[2] - x[2] * v[1]);
            d.angular_momentum[1] += m * (x[2] * v[0] - x[0] * v[2]);
            d.angular_momentum[2] += m * (x[0] * v[1] - x[1] * v[0]);
        }
        d
    }

    /// Total energy `E = K + W`.
    pub fn energy(&self) -> f64 {
        self.kinetic + self.potential
    }

    /// Adds another shard's diagnostics (same time).
    pub fn add(&mut self, o: &Diagnostics) {
        self.kinetic += o.kinetic;
        self.potential += o.potential;
        self.momentum_scale += o.momentum_scale;
        for c in 0..3 {
            self.momentum[c] += o.momentum[c];
            self.angular_momentum[c] += o.angular_momentum[c];
        }
    }
}

/// Options of [`simulate`].
#[derive(Debug, Clone, PartialEq)]
pub struct NbodySimulateOptions {
    /// Leapfrog variant.
    pub integrator: Integrator,
    /// Indices into `ts` at which outputs (diagnostics and the output callback) happen.
    /// Index 0 is the initial state. Out-of-range indices are errors.
    pub outputs: Vec<usize>,
}

/// Checks a time array: at least two finite, strictly increasing entries.
pub fn validate_times(ts: &[f64]) -> Result<(), NbodyError> {
    if ts.len() < 2 {
        return Err(NbodyError::param(
            "time",
            format!("{} entries", ts.len()),
            "give at least two times (t_start and t_end)",
        ));
    }
    for (i, w) in ts.windows(2).enumerate() {
        if !(w[0].is_finite() && w[1].is_finite() && w[1] > w[0]) {
            return Err(NbodyError::param(
                "time",
                format!("ts[{i}] = {}, ts[{}] = {}", w[0], i + 1, w[1]),
                "times must be finite and strictly increasing",
            ));
        }
    }
    Ok(())
}

/// Advances the valid particles through the times `ts` (`ts[0]` is the current time) with
/// the leapfrog of `opts.integrator`, one force evaluation per step (DKD evaluates forces at
/// the half-step positions; KDK at the step end and reuses them). At each output index `k`
/// (in `opts.outputs`) the particles are at `ts[k]`; the energy needs the potential there,
/// so DKD pays one extra evaluation per output. `on_output(k, particles, diagnostics)` runs
/// at each output (write snapshots there); `on_step(k)` after each step (progress).
///
/// Returns the diagnostics at every output, in order.
pub fn simulate(
    particles: &mut Particles,
    ts: &[f64],
    gravity: &mut Gravity,
    opts: &NbodySimulateOptions,
    on_output: impl FnMut(usize, &Particles, &Diagnostics) -> Result<(), NbodyError>,
    on_step: impl FnMut(usize),
) -> Result<Vec<Diagnostics>, NbodyError> {
    simulate_with(
        particles,
        ts,
        opts,
        |p| gravity.forces(p),
        |_| Ok(()),
        on_output,
        on_step,
    )
}

/// [`simulate`] with the force evaluation and the diagnostics reduction supplied by the
/// caller (sharded runs: forces through the locally essential tree, diagnostics summed
/// over ranks by `reduce` before `on_output` sees them).
pub fn simulate_with(
    particles: &mut Particles,
    ts: &[f64],
    opts: &NbodySimulateOptions,
    mut forces_of: impl FnMut(&Particles) -> Result<Forces, NbodyError>,
    mut reduce: impl FnMut(&mut Diagnostics) -> Result<(), NbodyError>,
    mut on_output: impl FnMut(usize, &Particles, &Diagnostics) -> Result<(), NbodyError>,
    mut on_step: impl FnMut(usize),
) -> Result<Vec<Diagnostics>, NbodyError> {
    validate_times(ts)?;
    particles.validate()?;
    if let Some(&k) = opts.outputs.iter().find(|&&k| k >= ts.len()) {
        return Err(NbodyError::param(
            "outputs",
            k,
            &format!(
                "output indices must be < the number of times ({})",
                ts.len()
            ),
        ));
    }
    let mut want = vec![false; ts.len()];
    for &k in &opts.outputs {
        want[k] = true;
    }
    // A stop asked for ends the run before any force it may have cut short is used.
    let mut forces_of = |p: &Particles| {
        let f = forces_of(p)?;
        NbodyError::check_interrupt()?;
        Ok::<_, NbodyError>(f)
    };
    let mut diags = Vec::new();
    let n = particles.num;
    let mut forces: Option<Forces> = None;
    if opts.integrator == Integrator::Kdk || want[0] {
        forces = Some(forces_of(particles)?);
    }
    if want[0] {
        let mut d = Diagnostics::measure(particles, &forces.as_ref().expect("computed").pot, ts[0]);
        reduce(&mut d)?;
        on_output(0, particles, &d)?;
        diags.push(d);
    }
    for k in 1..ts.len() {
        NbodyError::check_interrupt()?;
        let dt = ts[k] - ts[k - 1];
        match opts.integrator {
            Integrator::Dkd => {
                drift(particles, n, 0.5 * dt);
                let f = forces_of(particles)?;
                kick(particles, &f, dt);
                drift(particles, n, 0.5 * dt);
                forces = None;
            }
            Integrator::Kdk => {
                let f0 = match forces.take() {
                    Some(f) => f,
                    None => forces_of(particles)?,
                };
                kick(particles, &f0, 0.5 * dt);
                drift(particles, n, dt);
                let f1 = forces_of(particles)?;
                kick(particles, &f1, 0.5 * dt);
                forces = Some(f1);
            }
        }
        check_finite(particles, ts[k])?;
        if want[k] {
            if forces.is_none() {
                forces = Some(forces_of(particles)?);
            }
            let mut d =
                Diagnostics::measure(particles, &forces.as_ref().expect("computed").pot, ts[k]);
            reduce(&mut d)?;
            on_output(k, particles, &d)?;
            diags.push(d);
        }
        if opts.integrator == Integrator::Dkd {
            forces = None;
        }
        on_step(k);
    }
    Ok(diags)
}

fn drift(p: &mut Particles, n: usize, dt: f64) {
    for i in 0..n {
        for c in 0..3 {
            p.pos[i][c] += p.vel[i][c] * dt;
        }
    }
}

fn kick(p: &mut Particles, f: &Forces, dt: f64) {
    for (v, a) in p.vel.iter_mut().zip(&f.acc) {
        for c in 0..3 {
            v[c] += a[c] * dt;
        }
    }
}

fn check_finite(p: &Particles, t: f64) -> Result<(), NbodyError> {
    if let Some(i) = (0..p.num).find(|&i| !p.pos[i].iter().chain(&p.vel[i]).all(|v| v.is_finite()))
    {
        return Err(NbodyError::param(
            "particle state",
            format!(
                "id {} at t = {t}: pos {:?} vel {:?}",
                p.id[i], p.pos[i], p.vel[i]
            ),
            "the integration diverged: reduce the time step or raise forces.softening",
        ));
    }
    Ok(())
}
