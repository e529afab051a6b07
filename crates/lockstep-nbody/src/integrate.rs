//! Time integration (docs/nbody.md, "Time integration"): drift-kick-drift leapfrog (default) or
//! kick-drift-kick through a time array, one force evaluation per step, energy and momentum
//! diagnostics at each output.

use serde::{Deserialize, Serialize};

use lockstep_gpu::DeviceRequest;

use crate::direct::{direct, Forces};
use crate::fmm::{Fmm, FmmParams, FmmStats, NearField, SourceSet};
use crate::fmm_gpu::{gpu_error, DeviceField, ResidentShard};
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
    /// Read-backs of the last [`simulate`] that kept its particles on the GPU: host
    /// synchronisations and bytes of its own (positions, velocities, fields at outputs;
    /// not the force evaluations' internal waits).
    pub last_reads: (u64, u64),
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
            last_reads: (0, 0),
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

impl Gravity {
    /// [`Gravity::forces`] on this gravity's GPU with the field left on the device for a
    /// resident shard ([`crate::fmm_gpu::ResidentShard`]); with `shard` (holding `p`'s
    /// particles) the FMM takes the positions from it ([`crate::fmm_gpu::GpuForces::fmm_field`]).
    ///
    /// Errors: [`NbodyError::Gpu`] (also when the forces do not run on a GPU);
    /// [`NbodyError::Interrupted`].
    pub fn field_on_device(
        &mut self,
        p: &Particles,
        shard: Option<&mut ResidentShard>,
    ) -> Result<DeviceField, NbodyError> {
        let gpu = crate::fmm_gpu::gpu_of(&self.fmm)
            .ok_or_else(|| NbodyError::Gpu("the forces do not run on a GPU".into()))?;
        let (pos, mass) = (p.valid_pos(), p.valid_mass());
        let (g, eps) = (self.g, self.settings.softening);
        let field = match self.settings.method {
            Method::Direct => gpu.direct_field(pos, Some(0), pos, mass, g, eps, shard)?,
            Method::Fmm => {
                let src = SourceSet::local(pos, mass);
                let (f, st) = gpu.fmm_field(&self.fmm, &src, g, eps, shard)?;
                self.last_stats = st;
                f
            }
        };
        NbodyError::check_interrupt()?;
        Ok(field)
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
    /// With forces on a GPU: keep the particles on the device between steps (drift and kick
    /// as kernels, [`crate::fmm_gpu::ResidentShard`]; what the runs of `lockstep nbody` do).
    /// False steps them on the host with the forces read back every step. No effect on the
    /// CPU.
    pub keep_on_device: bool,
}

impl NbodySimulateOptions {
    /// The options of a run: `integrator`, outputs at `outputs`, particles kept on the GPU
    /// when the forces run there.
    pub fn new(integrator: Integrator, outputs: Vec<usize>) -> Self {
        NbodySimulateOptions {
            integrator,
            outputs,
            keep_on_device: true,
        }
    }
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
/// With forces on a GPU and `opts.keep_on_device`, the particles stay on the device between
/// steps ([`crate::fmm_gpu::ResidentShard`]); `particles` is brought up to date at each
/// output and at the end.
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
    if opts.keep_on_device {
        if let Some(gpu) = crate::fmm_gpu::gpu_of(gravity.solver()) {
            let ctx = gpu.context().clone();
            // The FMM builds its tree from the shard on the device: the positions need not
            // come back each step (direct sums take their box from them).
            let read_positions =
                !(gravity.settings.method == Method::Fmm && gpu.builds_tree_on_device());
            let (diags, reads) = simulate_on_device(
                particles,
                ts,
                opts,
                &ctx,
                read_positions,
                |p, shard| gravity.field_on_device(p, Some(shard)),
                |_| Ok(()),
                on_output,
                on_step,
            )?;
            gravity.last_reads = reads;
            return Ok(diags);
        }
    }
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
/// over ranks by `reduce` before `on_output` sees them). Steps on the host.
pub fn simulate_with(
    particles: &mut Particles,
    ts: &[f64],
    opts: &NbodySimulateOptions,
    forces_of: impl FnMut(&Particles) -> Result<Forces, NbodyError>,
    reduce: impl FnMut(&mut Diagnostics) -> Result<(), NbodyError>,
    on_output: impl FnMut(usize, &Particles, &Diagnostics) -> Result<(), NbodyError>,
    on_step: impl FnMut(usize),
) -> Result<Vec<Diagnostics>, NbodyError> {
    let mut stepper = HostStepper { forces_of };
    run_steps(
        particles,
        ts,
        opts,
        &mut stepper,
        reduce,
        on_output,
        on_step,
    )
}

/// [`simulate_with`] with the particles kept on the GPU of `ctx` between steps
/// ([`crate::fmm_gpu::ResidentShard`]: drift and kick as kernels); `field_of(p, shard)`
/// evaluates the forces and leaves them on the device (the FMM takes the positions from
/// `shard`, [`crate::fmm_gpu::GpuForces::fmm_field`]). With `read_positions` the positions
/// are read back into `p` before each evaluation (for a host tree, the exchange, direct
/// sums); without, `p` keeps those of the last output (only their count is used) and a
/// failed evaluation reads them back to report positions that are not finite.
/// `particles` is brought up to date at each output and at the end. Returns the diagnostics
/// and the run's own read-backs ([`ResidentShard::reads`]: host synchronisations, bytes).
///
/// Errors: as [`simulate_with`]; [`NbodyError::Gpu`] from the device (a buffer over the
/// adapter's limits, naming it; a device that failed or timed out).
#[allow(clippy::too_many_arguments)]
pub fn simulate_on_device(
    particles: &mut Particles,
    ts: &[f64],
    opts: &NbodySimulateOptions,
    ctx: &std::sync::Arc<lockstep_gpu::GpuContext>,
    read_positions: bool,
    field_of: impl FnMut(&Particles, &mut ResidentShard) -> Result<DeviceField, NbodyError>,
    reduce: impl FnMut(&mut Diagnostics) -> Result<(), NbodyError>,
    on_output: impl FnMut(usize, &Particles, &Diagnostics) -> Result<(), NbodyError>,
    on_step: impl FnMut(usize),
) -> Result<(Vec<Diagnostics>, (u64, u64)), NbodyError> {
    validate_times(ts)?;
    particles.validate()?;
    let shard = ResidentShard::new(ctx, particles).map_err(gpu_error)?;
    let mut stepper = DeviceStepper {
        shard,
        field_of,
        t: ts[0],
        read_positions,
    };
    let diags = run_steps(
        particles,
        ts,
        opts,
        &mut stepper,
        reduce,
        on_output,
        on_step,
    )?;
    stepper.shard.fetch(particles, true).map_err(gpu_error)?;
    check_finite(particles, ts[ts.len() - 1])?;
    Ok((diags, stepper.shard.reads()))
}

/// How [`run_steps`] evaluates forces and moves particles: on the host, or on a GPU that
/// keeps the shard.
trait Stepper {
    /// A force evaluation's result.
    type Field;
    /// Forces at the current positions (brought into `p.pos` first where they live
    /// elsewhere), `t` the time for error messages.
    fn forces(&mut self, p: &mut Particles, t: f64) -> Result<Self::Field, NbodyError>;
    /// `v += a dt`.
    fn kick(&mut self, p: &mut Particles, f: &Self::Field, dt: f64);
    /// `x += v dt`.
    fn drift(&mut self, p: &mut Particles, dt: f64);
    /// Brings `p` up to date for an output and returns the potential `[num]` of `f`.
    fn output(&mut self, p: &mut Particles, f: &Self::Field) -> Result<Vec<f64>, NbodyError>;
    /// Checks the state after the step that ended at `t`.
    fn check(&mut self, p: &Particles, t: f64) -> Result<(), NbodyError>;
}

struct HostStepper<F> {
    forces_of: F,
}

impl<F: FnMut(&Particles) -> Result<Forces, NbodyError>> Stepper for HostStepper<F> {
    type Field = Forces;
    fn forces(&mut self, p: &mut Particles, _t: f64) -> Result<Forces, NbodyError> {
        (self.forces_of)(p)
    }
    fn kick(&mut self, p: &mut Particles, f: &Forces, dt: f64) {
        for (v, a) in p.vel.iter_mut().zip(&f.acc) {
            for c in 0..3 {
                v[c] += a[c] * dt;
            }
        }
    }
    fn drift(&mut self, p: &mut Particles, dt: f64) {
        for i in 0..p.num {
            for c in 0..3 {
                p.pos[i][c] += p.vel[i][c] * dt;
            }
        }
    }
    fn output(&mut self, _p: &mut Particles, f: &Forces) -> Result<Vec<f64>, NbodyError> {
        Ok(f.pot.clone())
    }
    fn check(&mut self, p: &Particles, t: f64) -> Result<(), NbodyError> {
        check_finite(p, t)
    }
}

struct DeviceStepper<F> {
    shard: ResidentShard,
    field_of: F,
    t: f64,
    /// Read the positions back before each evaluation (for the host's tree, the exchange or
    /// direct sums' box); when false, `field_of` gets the positions of the last read (only
    /// their count is used) and non-finite positions are found by the device's tree.
    read_positions: bool,
}

impl<F> Stepper for DeviceStepper<F>
where
    F: FnMut(&Particles, &mut ResidentShard) -> Result<DeviceField, NbodyError>,
{
    type Field = DeviceField;
    fn forces(&mut self, p: &mut Particles, t: f64) -> Result<DeviceField, NbodyError> {
        if !self.read_positions {
            return (self.field_of)(p, &mut self.shard).or_else(|e| {
                // The device's tree refused positions that are not finite: read them (and
                // the velocities) back for the host path's message naming the particle.
                if e.to_string().contains(crate::fmm_gpu::NOT_FINITE) {
                    self.shard.fetch(p, true).map_err(gpu_error)?;
                    check_finite(p, self.t.max(t))?;
                }
                Err(e)
            });
        }
        self.shard.fetch(p, false).map_err(gpu_error)?;
        if p.pos[..p.num].iter().flatten().any(|x| !x.is_finite()) {
            // The velocities too, for the message.
            self.shard.fetch(p, true).map_err(gpu_error)?;
            check_finite(p, self.t.max(t))?;
        }
        (self.field_of)(p, &mut self.shard)
    }
    fn kick(&mut self, _p: &mut Particles, f: &DeviceField, dt: f64) {
        self.shard.kick(f, dt);
    }
    fn drift(&mut self, _p: &mut Particles, dt: f64) {
        self.shard.drift(dt);
    }
    fn output(&mut self, p: &mut Particles, f: &DeviceField) -> Result<Vec<f64>, NbodyError> {
        self.shard.fetch(p, true).map_err(gpu_error)?;
        Ok(self.shard.read_field(f).map_err(gpu_error)?.pot)
    }
    fn check(&mut self, _p: &Particles, t: f64) -> Result<(), NbodyError> {
        // Positions are checked when they are read back for the next evaluation (or by the
        // device's tree when they are not read back), the whole state at outputs and at the
        // end.
        self.t = t;
        Ok(())
    }
}

/// The leapfrog of [`simulate`] over a [`Stepper`].
fn run_steps<S: Stepper>(
    particles: &mut Particles,
    ts: &[f64],
    opts: &NbodySimulateOptions,
    stepper: &mut S,
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
    let forces_of = |s: &mut S, p: &mut Particles, t: f64| {
        let f = s.forces(p, t)?;
        NbodyError::check_interrupt()?;
        Ok::<_, NbodyError>(f)
    };
    let mut diags = Vec::new();
    let mut forces: Option<S::Field> = None;
    if opts.integrator == Integrator::Kdk || want[0] {
        forces = Some(forces_of(stepper, particles, ts[0])?);
    }
    if want[0] {
        let pot = stepper.output(particles, forces.as_ref().expect("computed"))?;
        let mut d = Diagnostics::measure(particles, &pot, ts[0]);
        reduce(&mut d)?;
        on_output(0, particles, &d)?;
        diags.push(d);
    }
    for k in 1..ts.len() {
        NbodyError::check_interrupt()?;
        let dt = ts[k] - ts[k - 1];
        match opts.integrator {
            Integrator::Dkd => {
                stepper.drift(particles, 0.5 * dt);
                let f = forces_of(stepper, particles, ts[k - 1])?;
                stepper.kick(particles, &f, dt);
                stepper.drift(particles, 0.5 * dt);
                forces = None;
            }
            Integrator::Kdk => {
                let f0 = match forces.take() {
                    Some(f) => f,
                    None => forces_of(stepper, particles, ts[k - 1])?,
                };
                stepper.kick(particles, &f0, 0.5 * dt);
                stepper.drift(particles, dt);
                let f1 = forces_of(stepper, particles, ts[k])?;
                stepper.kick(particles, &f1, 0.5 * dt);
                forces = Some(f1);
            }
        }
        stepper.check(particles, ts[k])?;
        if want[k] {
            if forces.is_none() {
                forces = Some(forces_of(stepper, particles, ts[k])?);
            }
            let pot = stepper.output(particles, forces.as_ref().expect("computed"))?;
            let mut d = Diagnostics::measure(particles, &pot, ts[k]);
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
