//! Drawing posterior samples as `lockstep npe sample` and the Python package's
//! `Posterior.sample` draw them: chunk by chunk from the trained flow
//! ([`DeviceModel::sample_chunks`]), periodic components wrapped onto their circle, samples
//! outside the prior's support counted and, when asked, dropped ([`draw`]). Both callers go
//! through this one function, so the same seed gives the same samples, bit for bit.

use crate::task::PriorBound;
use crate::trained::Trained;
use crate::{DeviceModel, NpeError};

/// Rows drawn at a time by `lockstep npe sample` (bounded memory for any count); the
/// default `batch_size` of the Python package, so both draw the same samples.
pub const SAMPLE_CHUNK: usize = 65_536;

/// Draws at most this many samples per sample kept with `inside_prior`.
pub const MAX_DRAWS_PER_KEPT: u64 = 100;

/// What to draw: `num_samples` rows (all of them, or with `inside_prior` the first
/// `num_samples` inside the prior's support), from base draws seeded with `seed`, `chunk`
/// rows per pass of the network.
#[derive(Debug, Clone, PartialEq)]
pub struct SampleRequest {
    /// Samples to return (at least 1).
    pub num_samples: u64,
    /// Seed of the base draws.
    pub seed: u64,
    /// Keep only samples inside the prior's support.
    pub inside_prior: bool,
    /// Rows per pass of the network ([`SAMPLE_CHUNK`] in `lockstep npe sample`).
    pub chunk: usize,
    /// How the caller names the inside-prior option in messages (`--inside-prior` for the
    /// command line, `inside_prior=True` for Python).
    pub inside_prior_name: &'static str,
}

/// Posterior samples on their way to the caller: periodic components wrapped onto their
/// circle, samples outside the prior's support counted and, with `inside_only`, dropped.
#[derive(Debug, Clone, PartialEq)]
pub struct PriorFilter {
    /// The prior's support, one bound per parameter.
    pub bounds: Vec<PriorBound>,
    /// Drop the samples outside the support.
    pub inside_only: bool,
    /// Samples drawn.
    pub drawn: u64,
    /// Samples drawn that lie outside the support.
    pub outside: u64,
}

impl PriorFilter {
    /// The rows of `chunk` to keep (row-major, one row per sample), wrapped.
    pub fn apply(&mut self, chunk: &[f32]) -> Vec<f32> {
        let d = self.bounds.len();
        let mut out = Vec::with_capacity(chunk.len());
        for row in chunk.chunks_exact(d) {
            self.drawn += 1;
            let start = out.len();
            let mut inside = true;
            for (&v, b) in row.iter().zip(&self.bounds) {
                let w = b.wrap(v as f64);
                inside &= b.contains(w);
                out.push(w as f32);
            }
            if !inside {
                self.outside += 1;
                if self.inside_only {
                    out.truncate(start);
                }
            }
        }
        out
    }

    /// The fraction of the samples drawn that lie outside the support (0 before any).
    pub fn outside_fraction(&self) -> f64 {
        self.outside as f64 / self.drawn.max(1) as f64
    }

    /// What the sampling found, in words (`kept` samples returned); `inside_prior_name`
    /// names the option that keeps only the samples inside.
    pub fn report(&self, kept: u64, inside_prior_name: &str) -> String {
        let pct = 100.0 * self.outside_fraction();
        if self.inside_only {
            format!(
                "kept the {kept} samples inside the prior's support: {} drawn, {} ({pct:.2}%) outside, acceptance rate {:.2}%",
                self.drawn,
                self.outside,
                100.0 - pct
            )
        } else {
            format!(
                "{} of {} samples ({pct:.2}%) lie outside the prior's support{}",
                self.outside,
                self.drawn,
                if self.outside > 0 {
                    format!(" ({inside_prior_name} keeps only those inside)")
                } else {
                    String::new()
                }
            )
        }
    }
}

/// Draws `request.num_samples` samples of `trained`'s posterior at the (standardized)
/// observation `xf` with `model` (all, or with `inside_prior` the first ones inside the
/// prior) in chunks, each chunk's kept rows (row-major, parameters in
/// `trained.task.parameter_names()` order, float32) handed to `sink` in order; returns the
/// filter's counts.
///
/// Errors: `sink`'s errors (a caller stops the draw by returning one); with
/// `inside_prior`, an acceptance rate too low to keep the samples within
/// [`MAX_DRAWS_PER_KEPT`] draws each ([`NpeError::Invalid`], said as soon as the rate shows
/// it).
pub fn draw<E: From<NpeError>>(
    trained: &Trained,
    model: &DeviceModel,
    xf: &[f32],
    request: &SampleRequest,
    sink: &mut dyn FnMut(&[f32]) -> Result<(), E>,
) -> Result<PriorFilter, E> {
    let n = request.num_samples;
    let mut filter = PriorFilter {
        bounds: trained.task.prior_bounds(),
        inside_only: request.inside_prior,
        drawn: 0,
        outside: 0,
    };
    let d = filter.bounds.len() as u64;
    let cap = if request.inside_prior {
        n.saturating_mul(MAX_DRAWS_PER_KEPT)
    } else {
        n
    };
    let mut kept = 0u64;
    let name = request.inside_prior_name;
    let too_few = |f: &PriorFilter, kept: u64| {
        E::from(NpeError::Invalid(format!(
            "{name}: only {:.3}% of the samples lie inside the prior's support ({} of {} drawn), so keeping {n} would take more than {MAX_DRAWS_PER_KEPT} draws per sample; the observation may lie outside the training data: sample without {name} to see where the posterior lies",
            100.0 * (1.0 - f.outside_fraction()),
            kept,
            f.drawn
        )))
    };
    // The sampling code takes a `dyn` callback (it compiles once, in this crate): the first
    // error of `sink` or of the acceptance rate is kept here and stops the draw.
    let mut failure: Option<E> = None;
    model.sample_chunks(xf, cap, request.seed, request.chunk, &mut |chunk| {
        let rows = filter.apply(chunk);
        let take = ((n - kept) * d).min(rows.len() as u64) as usize;
        if let Err(e) = sink(&rows[..take]) {
            failure = Some(e);
            return false;
        }
        kept += take as u64 / d;
        if kept < n && request.inside_prior {
            // Stop as soon as the acceptance rate shows the cap cannot be reached.
            let rate = (filter.drawn - filter.outside) as f64 / filter.drawn as f64;
            if rate * (cap - filter.drawn) as f64 + (kept as f64) < 0.5 * n as f64 {
                failure = Some(too_few(&filter, kept));
                return false;
            }
        }
        kept < n
    });
    if let Some(e) = failure {
        return Err(e);
    }
    if kept < n {
        return Err(too_few(&filter, kept));
    }
    Ok(filter)
}

impl Trained {
    /// The observation `x` as the network's float32 values: the task's length, every value
    /// finite and within float32's range, standardized too (see
    /// [`crate::Standardization::observation`]); messages start with `source` (where the
    /// values came from, as the user gave them) and name the position from 1.
    ///
    /// Errors: [`NpeError::Invalid`], naming the length or the value.
    pub fn checked_observation(&self, x: &[f64], source: &str) -> Result<Vec<f32>, NpeError> {
        if x.len() != self.task.x_dim() {
            return Err(NpeError::Invalid(format!(
                "{source}: the observation has {} values; the task {} expects {}",
                x.len(),
                self.task.name(),
                self.task.x_dim()
            )));
        }
        self.model
            .network
            .standardization
            .observation(x)
            .map_err(|m| {
                NpeError::Invalid(format!(
                    "{source}: {m}; give finite values within float32's range"
                ))
            })
    }
}
