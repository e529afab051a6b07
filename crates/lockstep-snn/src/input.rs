//! Inputs of virtual nodes: spike trains (SONATA spike files) and Poisson sources.
//!
//! A spike of a virtual node at time `t` (ms) is mapped like NEST's `spike_generator` with
//! `precise_times=True` driving grid-based neurons: it belongs to the step that ends at or
//! after `t` (`Time::ms_stamp`), i.e. it is emitted in update step `stamp - 1` and reaches
//! its targets `delay` steps later. Poisson nodes draw a spike count per step from a
//! counter-based generator keyed by `(seed, global sample index, node, step)`, so the draw
//! never depends on the rank, the batch split or the thread count (`docs/design.md` invariant 5).

use lockstep_core::rng::{splitmix64, unit_f64};

use crate::error::{Result, SnnError};
use crate::simulation::nest::TimeGrid;

/// Input description: any combination of spike trains and Poisson background.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct InputSpec {
    /// `[n_virtual]` spike times (ms) per virtual node, shared by every sample; `None`: no file input.
    pub spike_trains: Option<Vec<Vec<f64>>>,
    /// Poisson background, if any.
    pub poisson: Option<PoissonSpec>,
}

/// Poisson firing of virtual nodes.
#[derive(Debug, Clone, PartialEq)]
pub struct PoissonSpec {
    /// `[n_virtual]` rates in Hz (0 for silent nodes).
    pub rates_hz: Vec<f64>,
    /// Seed of the counter-based generator.
    pub seed: u64,
}

/// Inputs compiled onto a time grid for `n_steps` steps.
#[derive(Debug, Clone, Default)]
pub struct Inputs {
    n_steps: usize,
    /// `[n_steps + 1]` CSR over emission steps into `node`/`count`.
    step_ptr: Vec<u32>,
    node: Vec<u32>,
    count: Vec<u32>,
    /// `(node, mean count per step)` of Poisson nodes with rate > 0.
    poisson: Vec<(u32, f64)>,
    /// `exp(-mean)` per Poisson node (inversion start).
    poisson_p0: Vec<f64>,
    seed: u64,
}

impl InputSpec {
    /// Compile for `n_virtual` virtual nodes, grid `grid` and `n_steps` steps.
    /// `name` identifies the input in errors (file name or config key).
    pub fn compile(
        &self,
        name: &str,
        n_virtual: usize,
        grid: &TimeGrid,
        n_steps: usize,
    ) -> Result<Inputs> {
        if n_steps > u32::MAX as usize {
            return Err(SnnError::InvalidInput {
                input: name.into(),
                reason: format!("{n_steps} steps are more than one run can hold (2^32 - 1)"),
            });
        }
        // (emission step, node) of every file spike inside the run.
        let mut events: Vec<(u32, u32)> = Vec::new();
        if let Some(trains) = &self.spike_trains {
            if trains.len() != n_virtual {
                return Err(SnnError::InvalidInput {
                    input: name.into(),
                    reason: format!(
                        "{} spike trains given for {n_virtual} virtual nodes",
                        trains.len()
                    ),
                });
            }
            for (v, train) in trains.iter().enumerate() {
                for &t in train {
                    if !(t.is_finite() && t > 0.0) {
                        return Err(SnnError::InvalidInput {
                            input: name.into(),
                            reason: format!(
                                "virtual node #{v} has spike time {t} ms; NEST's spike_generator needs times > 0 ms"
                            ),
                        });
                    }
                    let emit = grid.ms_stamp_steps(t) - 1;
                    if emit >= 0 && (emit as usize) < n_steps {
                        events.push((emit as u32, v as u32));
                    }
                }
            }
        }
        events.sort_unstable();
        let mut inputs = Inputs {
            n_steps,
            ..Default::default()
        };
        inputs.step_ptr.reserve(n_steps + 1);
        inputs.step_ptr.push(0);
        let mut i = 0;
        for step in 0..n_steps as u32 {
            while i < events.len() && events[i].0 == step {
                let mut j = i;
                while j < events.len() && events[j] == events[i] {
                    j += 1;
                }
                inputs.node.push(events[i].1);
                inputs.count.push((j - i) as u32);
                i = j;
            }
            inputs.step_ptr.push(inputs.node.len() as u32);
        }
        if let Some(p) = &self.poisson {
            if p.rates_hz.len() != n_virtual {
                return Err(SnnError::InvalidInput {
                    input: name.into(),
                    reason: format!(
                        "{} Poisson rates given for {n_virtual} virtual nodes",
                        p.rates_hz.len()
                    ),
                });
            }
            for (v, &r) in p.rates_hz.iter().enumerate() {
                if !(r.is_finite() && r >= 0.0) {
                    return Err(SnnError::InvalidInput {
                        input: name.into(),
                        reason: format!(
                            "virtual node #{v}: Poisson rate {r} Hz must be finite and >= 0"
                        ),
                    });
                }
                let mean = r * grid.dt / 1000.0;
                if mean > 100.0 {
                    return Err(SnnError::InvalidInput {
                        input: name.into(),
                        reason: format!("virtual node #{v}: rate {r} Hz gives {mean} spikes per step; use a smaller dt or rate"),
                    });
                }
                if r > 0.0 {
                    inputs.poisson.push((v as u32, mean));
                    inputs.poisson_p0.push((-mean).exp());
                }
            }
            inputs.seed = p.seed;
        }
        Ok(inputs)
    }
}

/// Uniform number in `[0, 1)` keyed by `(seed, sample, node, step)` (counter-based, stateless).
#[inline]
pub(crate) fn keyed_uniform(seed: u64, sample: u64, node: u64, step: u64) -> f64 {
    let mut x = splitmix64(seed ^ 0x005E_ED0F_1A57_u64);
    x = splitmix64(x ^ sample);
    x = splitmix64(x ^ node.wrapping_mul(0x9E37_79B9));
    x = splitmix64(x ^ step);
    unit_f64(x)
}

impl Inputs {
    /// Number of steps the inputs were compiled for.
    pub fn n_steps(&self) -> usize {
        self.n_steps
    }

    /// Number of Poisson-driven virtual nodes (one draw each per step and sample).
    pub fn n_poisson(&self) -> usize {
        self.poisson.len()
    }

    /// The Poisson nodes: `(virtual node, mean spike count per step)`, nodes ascending.
    pub(crate) fn poisson_nodes(&self) -> &[(u32, f64)] {
        &self.poisson
    }

    /// The seed of the Poisson draws.
    pub(crate) fn poisson_seed(&self) -> u64 {
        self.seed
    }

    /// The file spikes emitted in update step `step` (the same in every sample), as
    /// `(virtual node, count)` with the nodes ascending.
    pub(crate) fn file_events(&self, step: usize) -> impl Iterator<Item = (u32, u32)> + '_ {
        let (a, b) = if step < self.n_steps {
            (
                self.step_ptr[step] as usize,
                self.step_ptr[step + 1] as usize,
            )
        } else {
            (0, 0)
        };
        (a..b).map(|i| (self.node[i], self.count[i]))
    }

    /// Call `f(node, count)` for every virtual node emitting `count >= 1` spikes in update
    /// step `step` of global sample `sample` (file spikes first, then Poisson draws).
    #[inline]
    pub fn for_each(&self, sample: u64, step: usize, mut f: impl FnMut(u32, u32)) {
        for (v, c) in self.file_events(step) {
            f(v, c);
        }
        self.poisson_events(sample, step, f);
    }

    /// Call `f(node, count)` for every Poisson-driven virtual node drawing `count >= 1`
    /// spikes in update step `step` of global sample `sample` (nodes ascending): the draws of
    /// [`Inputs::for_each`] without the file spikes.
    #[inline]
    pub fn poisson_events(&self, sample: u64, step: usize, mut f: impl FnMut(u32, u32)) {
        for (i, &(v, mean)) in self.poisson.iter().enumerate() {
            let u = keyed_uniform(self.seed, sample, v as u64, step as u64);
            let k = poisson_inversion(u, mean, self.poisson_p0[i]);
            if k > 0 {
                f(v, k);
            }
        }
    }
}

/// The Poisson count of mean `mean` (`p0 = e^-mean`) for the uniform number `u` in `[0, 1)`:
/// the smallest `k` with `u < cdf_k`, the cdf summed in float64 from `p_0 = p0`, `p_k =
/// p_{k-1} mean / k`; it stops at 10,000 or where `p_k` underflows to zero.
#[inline]
fn poisson_inversion(u: f64, mean: f64, p0: f64) -> u32 {
    let mut p = p0;
    let mut cdf = p;
    let mut k = 0u32;
    while u >= cdf && k < 10_000 {
        k += 1;
        p *= mean / k as f64;
        cdf += p;
        if p == 0.0 {
            break;
        }
    }
    k
}

/// `2^53`: the uniform numbers of [`keyed_uniform`] are `m 2^-53` for an integer `m < 2^53`.
pub(crate) const UNIT_STEPS: u64 = 1 << 53;

/// The Poisson draw of [`Inputs::poisson_events`] for a node of mean `mean` (spikes per step)
/// as integer thresholds on the 53-bit integer `m` behind its uniform number (`u = m 2^-53`,
/// [`keyed_uniform`]): pairs `(threshold, count)`, thresholds strictly ascending, the last
/// [`UNIT_STEPS`]; the draw is the count of the first pair with `m < threshold`. The pairs
/// come from the inversion's own float64 recurrence (`p_k = p_{k-1} mean / k`, `cdf_k =
/// cdf_{k-1} + p_k`, the same stops), and `u < cdf` holds exactly when `m < ceil(cdf 2^53)`,
/// so the counts are the inversion's bit for bit without float64 arithmetic (the GPU
/// kernels on adapters without `SHADER_F64`). A node of mean up to 100 takes a few hundred
/// pairs at most (about 10 at 0.1 spikes per step).
pub(crate) fn poisson_thresholds(mean: f64) -> Vec<(u64, u32)> {
    let threshold = |cdf: f64| -> u64 {
        if cdf >= 1.0 {
            UNIT_STEPS
        } else {
            // Exact: a power-of-two scaling of a float64 below 1, an integer below 2^53.
            (cdf * UNIT_STEPS as f64).ceil() as u64
        }
    };
    let mut p = (-mean).exp();
    let mut cdf = p;
    let mut k = 0u32;
    let mut out: Vec<(u64, u32)> = Vec::new();
    loop {
        if k >= 10_000 {
            out.push((UNIT_STEPS, k));
            return out;
        }
        let t = threshold(cdf);
        // A threshold no larger than the one before decides nothing the earlier pair did not.
        if out.last().is_none_or(|&(last, _)| t > last) {
            out.push((t, k));
        }
        if t >= UNIT_STEPS {
            return out;
        }
        k += 1;
        p *= mean / k as f64;
        cdf += p;
        if p == 0.0 {
            out.push((UNIT_STEPS, k));
            return out;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The integer thresholds give the float64 inversion's counts for the uniform numbers
    /// at and around every threshold and at random, for means from none to 100 spikes per
    /// step (where `e^-mean` is tiny and the tail runs to the recurrence's end).
    #[test]
    fn poisson_thresholds_give_the_inversions_counts() {
        let inversion = |mean: f64, u: f64| poisson_inversion(u, mean, (-mean).exp());
        let mut rng = lockstep_core::rng::SplitMix64::new(11);
        for mean in [0.0, 1e-9, 1e-3, 0.0173, 0.1, 0.5, 1.0, 3.7, 20.0, 99.5] {
            let th = poisson_thresholds(mean);
            assert_eq!(th.last().unwrap().0, UNIT_STEPS, "mean {mean}");
            assert!(th.windows(2).all(|w| w[0].0 < w[1].0 && w[0].1 < w[1].1));
            let draw = |m: u64| th.iter().find(|&&(t, _)| m < t).unwrap().1;
            let mut ms: Vec<u64> = vec![0, UNIT_STEPS - 1];
            for &(t, _) in &th {
                for m in [t.saturating_sub(1), t, t + 1] {
                    if m < UNIT_STEPS {
                        ms.push(m);
                    }
                }
            }
            ms.extend((0..2000).map(|_| rng.next_u64() >> 11));
            for m in ms {
                let u = m as f64 * (1.0 / UNIT_STEPS as f64);
                assert_eq!(draw(m), inversion(mean, u), "mean {mean}, m {m}");
            }
        }
    }

    #[test]
    fn file_spikes_go_to_the_step_ending_at_or_after_them() {
        let g = TimeGrid::new(0.1).unwrap();
        let spec = InputSpec {
            spike_trains: Some(vec![vec![0.05, 0.1, 0.1001, 0.15], vec![0.2]]),
            poisson: None,
        };
        let inp = spec.compile("t", 2, &g, 5).unwrap();
        let mut seen = Vec::new();
        for s in 0..5 {
            inp.for_each(0, s, |v, c| seen.push((s, v, c)));
        }
        // 0.05 and 0.1 -> stamp 1 (emitted in step 0); 0.1001, 0.15 -> stamp 2 (step 1); 0.2 -> step 1.
        assert_eq!(seen, vec![(0, 0, 2), (1, 0, 2), (1, 1, 1)]);
        let bad = InputSpec {
            spike_trains: Some(vec![vec![0.0]]),
            poisson: None,
        };
        assert!(bad
            .compile("f.h5", 1, &g, 5)
            .unwrap_err()
            .to_string()
            .contains("f.h5"));
    }

    #[test]
    fn poisson_rate_and_key_independence() {
        let g = TimeGrid::new(1.0).unwrap();
        let spec = InputSpec {
            spike_trains: None,
            poisson: Some(PoissonSpec {
                rates_hz: vec![50.0, 0.0],
                seed: 7,
            }),
        };
        let inp = spec.compile("p", 2, &g, 20000).unwrap();
        let mut n = 0u64;
        for s in 0..20000 {
            inp.for_each(3, s, |v, c| {
                assert_eq!(v, 0);
                n += c as u64;
            });
        }
        // 50 Hz * 20 s = 1000 expected, sd ~ 32
        assert!((880..1120).contains(&n), "{n}");
        // Different sample keys give different streams; the same key gives the same stream.
        let draw = |sample| {
            let mut v = Vec::new();
            for s in 0..500 {
                inp.for_each(sample, s, |_, c| v.push((s, c)));
            }
            v
        };
        assert_eq!(draw(3), draw(3));
        assert_ne!(draw(3), draw(4));
    }
}
