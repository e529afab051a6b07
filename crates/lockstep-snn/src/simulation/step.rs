//! The single-step update of one neuron, written once and generic over [`Scalar`].
//!
//! This is the recursion of `docs/neuron-models.md` ("Cell models"), reproducing NEST 3.x `glif_psc::update`
//! and `iaf_psc_alpha::update` operation by operation (same order of floating-point
//! operations for `f64`), so that the forward pass is NEST-exact. Running it on dual numbers
//! gives the surrogate-gradient directional derivative that the BPTT backward pass
//! (`crate::training`) must reproduce:
//!
//! * spike `z = H(U_n - th)` with derivative `pseudo_derivative(U_n / th) / th * dU_n`;
//! * after-spike currents `A'' = A' + z * (amp + A' * refr_decay - A')` (value: NEST's jump);
//! * hard reset forward `U' = V_reset`, soft-reset derivative `dU' = dU_n - (th - V_reset) dz`;
//! * refractory steps hold `U` and `A` (gradient passes unchanged), `z = 0` with no derivative.

use crate::scalar::{Scalar, Surrogate};
use crate::simulation::model::{CellConsts, ModelKind};

/// Mutable state of one neuron (one trial). Shapes: `asc` `[n_asc]`, `y1`/`y2` `[n_ports]`.
#[derive(Debug)]
pub(crate) struct NeuronStateMut<'a, S> {
    /// Membrane potential relative to `E_L` (mV).
    pub u: &'a mut S,
    /// After-spike currents (pA).
    pub asc: &'a mut [S],
    /// Alpha-PSC derivative states `y1` per port (pA/ms).
    pub y1: &'a mut [S],
    /// Alpha-PSC currents `y2` per port (pA).
    pub y2: &'a mut [S],
    /// Remaining refractory steps.
    pub refr: &'a mut u32,
}

/// Advance one neuron by one step `h`.
///
/// `arrivals[k]` is the summed weight (pA) of spikes arriving at port `k` in this step
/// (NEST's ring-buffer value). Returns the spike `z` (value 0 or 1).
#[inline]
pub(crate) fn step_neuron<S: Scalar>(
    c: &CellConsts,
    st: NeuronStateMut<'_, S>,
    arrivals: &[S],
    sg: &Surrogate,
) -> S {
    let NeuronStateMut {
        u,
        asc,
        y1,
        y2,
        refr,
    } = st;
    let mut z = S::zero();
    if *refr == 0 {
        let un = membrane_update(c, *u, asc, y1, y2);
        z = S::spike(un, c.th, c.kind == ModelKind::Glif, sg);
        let fired = z.re() != 0.0;
        if fired || S::HAS_DERIVATIVE {
            for (a, ac) in c.asc.iter().enumerate() {
                let jump = S::from_f64(ac.amp) + asc[a].mulc(ac.refr_decay) - asc[a];
                let e = asc[a] + z * jump;
                asc[a] = if fired {
                    e.with_re(ac.amp + asc[a].re() * ac.refr_decay)
                } else {
                    e
                };
            }
        }
        *u = if S::HAS_DERIVATIVE {
            let soft = un - z.mulc(c.th - c.v_reset);
            soft.with_re(if fired { c.v_reset } else { un.re() })
        } else if fired {
            S::from_f64(c.v_reset)
        } else {
            un
        };
        if fired {
            *refr = c.refractory_steps;
        }
    } else {
        *refr -= 1;
    }
    // Alpha-shaped PSCs, then this step's arrivals (NEST: "spikes arriving at T+1 have an
    // immediate effect on the state of the neuron").
    for (((pc, y1k), y2k), &xk) in c
        .ports
        .iter()
        .zip(y1.iter_mut())
        .zip(y2.iter_mut())
        .zip(arrivals)
    {
        *y2k = y1k.mulc(pc.p21) + y2k.mulc(pc.p22);
        *y1k = y1k.mulc(pc.p11);
        *y1k += xk.mulc(pc.psc_init);
    }
    z
}

/// The membrane part of a non-refractory step: decays the after-spike currents in place
/// and returns the pre-reset potential `U_n` (mV rel. `E_L`), with NEST's operation order
/// (`glif_psc`: `U*P33 + (I_e + sum_a stable_a*A_a)*P30 + sum_k (P31 y1 + P32 y2)`;
/// `iaf_psc_alpha`: `P30*I_e + sum_k (P31 y1 + P32 y2) + expm1*U + U`, clamped at `V_min`).
#[inline]
pub(crate) fn membrane_update<S: Scalar>(
    c: &CellConsts,
    u: S,
    asc: &mut [S],
    y1: &[S],
    y2: &[S],
) -> S {
    match c.kind {
        ModelKind::Glif => {
            // NEST glif_psc: mean ASC over the step, then decay to the end of the step.
            let mut asc_sum = S::zero();
            for (ac, ak) in c.asc.iter().zip(asc.iter_mut()) {
                asc_sum += ak.mulc(ac.stable);
                *ak = ak.mulc(ac.decay);
            }
            let mut un = u.mulc(c.p33) + (S::from_f64(c.i_e) + asc_sum).mulc(c.p30);
            for ((pc, &y1k), &y2k) in c.ports.iter().zip(y1).zip(y2) {
                un += y1k.mulc(pc.p31) + y2k.mulc(pc.p32);
            }
            un
        }
        ModelKind::Iaf => {
            // NEST iaf_psc_alpha: P30*(y0 + I_e) + sum_k (P31 dI + P32 I) + expm1*y3 + y3.
            let mut un = S::from_f64(0.0 + c.i_e).mulc(c.p30);
            for ((pc, &y1k), &y2k) in c.ports.iter().zip(y1).zip(y2) {
                un += y1k.mulc(pc.p31);
                un += y2k.mulc(pc.p32);
            }
            un = un + u.mulc(c.expm1_tau_m) + u;
            if un.re() < c.lower_bound {
                un = S::from_f64(c.lower_bound);
            }
            un
        }
    }
}
