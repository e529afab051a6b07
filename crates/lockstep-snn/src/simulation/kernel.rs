//! The double-precision forward simulation kernel behind [`crate::simulate`]: NEST-exact,
//! in structure-of-arrays layout, vectorised over neurons.
//!
//! [`crate::simulation::step::step_neuron`] is the single definition of the dynamics, generic over
//! [`crate::Scalar`], and [`crate::TrialState`] runs it neuron by neuron in `[neuron, port]`
//! layout (the layout BPTT's reference and the dual-number oracle use). This kernel runs the
//! same recursion on a trial stored as `u [neuron]`, `asc [asc, neuron]`,
//! `y1`/`y2 [port, neuron]` and a ring buffer `[slot, port, neuron]`, so that one group
//! of neurons (one parameter set) advances as a loop over contiguous rows: with the model
//! kind, the number of after-spike currents and of ports fixed at compile time, the
//! threshold, reset and refractory branches become selects and the loop runs on four
//! neurons at a time ([`wide::f64x4`]). Each neuron still performs the very same IEEE operations
//! in the same order as `step_neuron::<f64>` (no fused multiply-adds), so states, spikes and
//! `V_m` are bitwise equal to [`crate::TrialState::step`]'s
//! (`tests::kernel_matches_trial_state`) and the simulation stays NEST-exact. Group shapes
//! beyond the compiled ones (more than 2 after-spike currents or 4 ports) run
//! `step_neuron` itself, one neuron at a time.
//!
//! Spike delivery is NEST's: the neurons that fired in step `t` (in index order), then the
//! input spikes emitted in step `t`, each add their weight to the ring slot of step
//! `t + delay`, in the same order as `TrialState::step`.

use crate::input::Inputs;
use crate::network::{Csr, Network};
use crate::scalar::Surrogate;
use crate::simulation::model::InitialState;
use crate::simulation::model::{CellConsts, ModelKind};
use crate::simulation::step::{step_neuron, NeuronStateMut};
use wide::{f64x4, CmpEq, CmpGe, CmpGt, CmpLt};

/// What a simulation computes once from its network and shares among its trials: each
/// edge's target neuron (internal index), in CSR order, for the `[slot, port, neuron]` ring
/// (`[n_recurrent_edges]` and `[n_input_edges]`, 4 bytes per edge), and each group's live
/// receptor ports.
///
/// A group's update runs over its live ports only ([`Network::live_ports`]): a port that no
/// edge reaches keeps `y1 = y2 = 0`, so its share of the membrane update,
/// `0 * P31 + 0 * P32`, adds `+0.0`. Skipping it leaves the same nonzero terms in the same
/// order, so the same bits as NEST's update over every port (adding `+0.0` changes no value
/// but a `-0.0` potential, which the update never produces from NEST's start).
#[derive(Debug, Clone)]
pub(crate) struct SimPlan {
    recurrent: Vec<u32>,
    input: Vec<u32>,
    /// `[group]` the group's constants over its live ports only, and those ports (ascending
    /// 0-based indices into the network's ports).
    groups: Vec<(CellConsts, Vec<usize>)>,
}

impl SimPlan {
    /// The targets of `net`'s recurrent and input edges and its groups' live ports.
    pub(crate) fn new(net: &Network) -> Self {
        let np = net.n_ports as u32;
        let of = |csr: &Csr| csr.target_off.iter().map(|&o| o / np).collect();
        let groups = net
            .groups
            .iter()
            .zip(net.live_ports())
            .map(|(g, ports)| {
                let mut consts = g.consts.clone();
                consts.ports = ports.iter().map(|&k| g.consts.ports[k]).collect();
                (consts, ports)
            })
            .collect();
        SimPlan {
            recurrent: of(&net.recurrent),
            input: of(&net.input),
            groups,
        }
    }

    /// Bytes the edge arrays take for `net`.
    pub(crate) fn bytes(net: &Network) -> u64 {
        4 * (net.recurrent.len() as u64 + net.input.len() as u64)
    }
}

/// One trial's state in structure-of-arrays layout (module docs). `n` neurons.
#[derive(Debug, Clone)]
pub(crate) struct SimTrial {
    n: usize,
    /// `[neuron]` membrane potential relative to `E_L` (mV), internal order.
    u: Vec<f64>,
    /// `[neuron]` remaining refractory steps.
    refr: Vec<u32>,
    /// `[neuron]` spikes of the last step (0 or 1).
    z: Vec<u8>,
    /// `[n_asc, neuron]` after-spike currents (pA).
    asc: Vec<f64>,
    /// `[n_ports, neuron]` PSC derivative states (pA/ms).
    y1: Vec<f64>,
    /// `[n_ports, neuron]` PSC currents (pA).
    y2: Vec<f64>,
    /// `[ring_len, n_ports, neuron]` summed weights (pA) arriving per step.
    ring: Vec<f64>,
}

impl SimTrial {
    /// A trial of `net` at its initial state (as [`crate::TrialState::new`]).
    pub(crate) fn new(net: &Network, init: InitialState) -> Self {
        let n = net.n_neurons();
        let mut u = vec![0.0; n];
        let mut asc = vec![0.0; n * net.n_asc];
        if init == InitialState::Nest {
            for g in &net.groups {
                u[g.start..g.end].fill(g.consts.u0);
                for (a, ac) in g.consts.asc.iter().enumerate() {
                    asc[a * n + g.start..a * n + g.end].fill(ac.init);
                }
            }
        }
        SimTrial {
            n,
            u,
            refr: vec![0; n],
            z: vec![0; n],
            asc,
            y1: vec![0.0; n * net.n_ports],
            y2: vec![0.0; n * net.n_ports],
            ring: vec![0.0; net.ring_len() * n * net.n_ports],
        }
    }

    /// `[neuron]` membrane potentials relative to `E_L` (mV), internal order.
    pub(crate) fn u(&self) -> &[f64] {
        &self.u
    }

    /// Advance by update step `t` (0-based) of global sample `sample` with the network's
    /// own weights: every neuron steps, then the spikes of this step are delivered.
    /// `fired` receives the internal indices of the neurons that spiked, ascending.
    /// Returns the number of synaptic events delivered (recurrent + input edges).
    ///
    /// # Panics
    /// If `self` or `plan` were not made for `net`.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn step(
        &mut self,
        net: &Network,
        plan: &SimPlan,
        inputs: &Inputs,
        sample: u64,
        t: usize,
        sg: &Surrogate,
        fired: &mut Vec<u32>,
    ) -> u64 {
        let n = self.n;
        let np = net.n_ports;
        let rl = net.ring_len();
        let stride = n * np;
        let slot = t % rl;
        for (g, (consts, ports)) in net.groups.iter().zip(&plan.groups) {
            advance_group(
                consts,
                Group {
                    ports,
                    n,
                    a: g.start,
                    b: g.end,
                    u: &mut self.u,
                    refr: &mut self.refr,
                    z: &mut self.z,
                    asc: &mut self.asc,
                    y1: &mut self.y1,
                    y2: &mut self.y2,
                    arrivals: &mut self.ring[slot * stride..(slot + 1) * stride],
                },
                sg,
            );
        }
        fired.clear();
        for (c, z8) in self.z.chunks(8).enumerate() {
            if z8.iter().any(|&z| z != 0) {
                fired.extend(
                    z8.iter()
                        .enumerate()
                        .filter(|(_, &z)| z != 0)
                        .map(|(i, _)| (c * 8 + i) as u32),
                );
            }
        }
        let mut events = 0u64;
        let ring = &mut self.ring;
        let w_rec = &net.weights_rec;
        for &i in fired.iter() {
            for seg in net.recurrent.segments_of(i as usize) {
                let base = ((t + seg.delay as usize) % rl) * stride + seg.port as usize * n;
                let (a, b) = (seg.start as usize, seg.end as usize);
                let row = &mut ring[base..base + n];
                for (&tg, &w) in plan.recurrent[a..b].iter().zip(&w_rec[a..b]) {
                    // TrialState::step adds `w * z`, which is `w` for a spike (z = 1).
                    row[tg as usize] += w;
                }
                events += (b - a) as u64;
            }
        }
        let w_in = &net.weights_in;
        inputs.for_each(sample, t, |v, count| {
            let cnt = count as f64;
            for seg in net.input.segments_of(v as usize) {
                let base = ((t + seg.delay as usize) % rl) * stride + seg.port as usize * n;
                let (a, b) = (seg.start as usize, seg.end as usize);
                let row = &mut ring[base..base + n];
                for (&tg, &w) in plan.input[a..b].iter().zip(&w_in[a..b]) {
                    row[tg as usize] += w * cnt;
                }
                events += (b - a) as u64;
            }
        });
        events
    }
}

/// The neurons `a..b` (one group) of a trial, over the trial's whole arrays (`n` neurons):
/// `u`, `refr`, `z` `[neuron]`; `asc` `[n_asc, neuron]`; `y1`, `y2` and this step's ring slot
/// `arrivals` `[n_ports, neuron]`. The group's update reads `arrivals` and leaves its rows
/// of the group's ports zero (the slot is reused `ring_len` steps later).
struct Group<'a> {
    /// The group's live ports (ascending): the rows of `y1`, `y2` and `arrivals` it updates,
    /// in the order of its constants' ports.
    ports: &'a [usize],
    n: usize,
    a: usize,
    b: usize,
    u: &'a mut [f64],
    refr: &'a mut [u32],
    z: &'a mut [u8],
    asc: &'a mut [f64],
    y1: &'a mut [f64],
    y2: &'a mut [f64],
    arrivals: &'a mut [f64],
}

/// The columns `a..b` of the rows `which` (ascending, `K` of them) of a `[row, n]` array.
///
/// # Panics
/// If `which` has fewer than `K` entries or is not ascending, if `v` has no row
/// `which[K - 1]`, or if `b > n`.
#[inline(always)]
fn rows<'a, const K: usize>(
    v: &'a mut [f64],
    n: usize,
    a: usize,
    b: usize,
    which: &[usize],
) -> [&'a mut [f64]; K] {
    let mut rest = v;
    let mut next = 0;
    std::array::from_fn(|k| {
        let skip = (which[k] - next) * n;
        let (row, tail) = std::mem::take(&mut rest)[skip..].split_at_mut(n);
        rest = tail;
        next = which[k] + 1;
        &mut row[a..b]
    })
}

/// Advance the neurons of one group with constants `c` by one step (f64, NEST's operation
/// order); `g.z` receives their spikes (0 or 1). Bitwise the same as [`step_neuron`] on
/// each neuron: the loop compiled for the group's shape, or [`advance_any`]. On CPUs with
/// AVX the same loop runs on 256-bit vectors ([`advance_group_avx`]): the same IEEE
/// operations in the same order (no fused multiply-add), so the same bits.
fn advance_group(c: &CellConsts, g: Group<'_>, sg: &Surrogate) {
    #[cfg(target_arch = "x86_64")]
    if std::is_x86_feature_detected!("avx") {
        // SAFETY: the CPU has AVX (checked at run time).
        return unsafe { advance_group_avx(c, g, sg) };
    }
    advance_by_shape(c, g, sg)
}

/// [`advance_by_shape`] compiled for AVX.
///
/// # Safety
/// The CPU must support AVX.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx")]
unsafe fn advance_group_avx(c: &CellConsts, g: Group<'_>, sg: &Surrogate) {
    advance_by_shape(c, g, sg)
}

/// [`advance_group`]'s dispatch on the group's shape.
#[inline(always)]
fn advance_by_shape(c: &CellConsts, g: Group<'_>, sg: &Surrogate) {
    macro_rules! by_shape {
        ($($ga:literal, $gp:literal);*) => {
            match (c.kind, c.asc.len(), c.ports.len()) {
                (ModelKind::Iaf, 0, 2) => advance::<false, 0, 2>(c, g),
                (ModelKind::Iaf, 0, 1) => advance::<false, 0, 1>(c, g),
                $((ModelKind::Glif, $ga, $gp) => advance::<true, $ga, $gp>(c, g),)*
                _ => advance_any(c, g, sg),
            }
        };
    }
    by_shape!(0, 1; 0, 2; 0, 3; 0, 4; 1, 1; 1, 2; 1, 3; 1, 4; 2, 1; 2, 2; 2, 3; 2, 4);
}

/// Any group shape: [`step_neuron`] itself, one neuron at a time (its state gathered from
/// and scattered back to the rows of its live ports).
fn advance_any(c: &CellConsts, g: Group<'_>, sg: &Surrogate) {
    let (ga, gp, n) = (c.asc.len(), c.ports.len(), g.n);
    let mut asc = vec![0.0; ga];
    let (mut y1, mut y2, mut x) = (vec![0.0; gp], vec![0.0; gp], vec![0.0; gp]);
    for i in g.a..g.b {
        for (a, v) in asc.iter_mut().enumerate() {
            *v = g.asc[a * n + i];
        }
        for (k, &p) in g.ports.iter().enumerate() {
            y1[k] = g.y1[p * n + i];
            y2[k] = g.y2[p * n + i];
            x[k] = std::mem::take(&mut g.arrivals[p * n + i]);
        }
        let z = step_neuron(
            c,
            NeuronStateMut {
                u: &mut g.u[i],
                asc: &mut asc,
                y1: &mut y1,
                y2: &mut y2,
                refr: &mut g.refr[i],
            },
            &x,
            sg,
        );
        g.z[i] = u8::from(z != 0.0);
        for (a, &v) in asc.iter().enumerate() {
            g.asc[a * n + i] = v;
        }
        for (k, &p) in g.ports.iter().enumerate() {
            g.y1[p * n + i] = y1[k];
            g.y2[p * n + i] = y2[k];
        }
    }
}

/// Neurons per vector in the compiled loops ([`f64x4`]: two SSE2 or one AVX register).
const LANES: usize = 4;

/// A group's constants with its shape fixed at compile time: `GA` after-spike currents,
/// `GP` ports, `GLIF` selecting `glif_psc` (strict threshold) over `iaf_psc_alpha`.
struct Fixed<const GLIF: bool, const GA: usize, const GP: usize> {
    decay: [f64; GA],
    stable: [f64; GA],
    refr_decay: [f64; GA],
    amp: [f64; GA],
    p11: [f64; GP],
    p21: [f64; GP],
    p22: [f64; GP],
    p31: [f64; GP],
    p32: [f64; GP],
    psc_init: [f64; GP],
    p33: f64,
    p30: f64,
    expm1_tau_m: f64,
    th: f64,
    v_reset: f64,
    i_e: f64,
    lower_bound: f64,
    refractory_steps: u32,
}

/// The values `j..j + len` of a row in the first `len <= LANES` lanes (the others 0).
#[inline(always)]
fn load(row: &[f64], j: usize, len: usize) -> f64x4 {
    let mut v = [0.0; LANES];
    v[..len].copy_from_slice(&row[j..j + len]);
    f64x4::new(v)
}

/// Writes the first `len <= LANES` lanes of `v` to the values `j..j + len` of a row.
#[inline(always)]
fn store(row: &mut [f64], j: usize, len: usize, v: f64x4) {
    row[j..j + len].copy_from_slice(&v.to_array()[..len]);
}

impl<const GLIF: bool, const GA: usize, const GP: usize> Fixed<GLIF, GA, GP> {
    fn new(c: &CellConsts) -> Self {
        Fixed {
            decay: std::array::from_fn(|a| c.asc[a].decay),
            stable: std::array::from_fn(|a| c.asc[a].stable),
            refr_decay: std::array::from_fn(|a| c.asc[a].refr_decay),
            amp: std::array::from_fn(|a| c.asc[a].amp),
            p11: std::array::from_fn(|k| c.ports[k].p11),
            p21: std::array::from_fn(|k| c.ports[k].p21),
            p22: std::array::from_fn(|k| c.ports[k].p22),
            p31: std::array::from_fn(|k| c.ports[k].p31),
            p32: std::array::from_fn(|k| c.ports[k].p32),
            psc_init: std::array::from_fn(|k| c.ports[k].psc_init),
            p33: c.p33,
            p30: c.p30,
            expm1_tau_m: c.expm1_tau_m,
            th: c.th,
            v_reset: c.v_reset,
            i_e: c.i_e,
            lower_bound: c.lower_bound,
            refractory_steps: c.refractory_steps,
        }
    }

    /// One step of the `len <= LANES` neurons `j..j + len` of the group's rows, one
    /// vector operation per operation of `step_neuron` (unused lanes compute on zeros and
    /// are not stored). Without branches: a refractory neuron's potential is computed and
    /// discarded, and selects keep what `step_neuron` would have kept.
    #[allow(clippy::too_many_arguments)]
    #[inline(always)]
    fn block(
        &self,
        j: usize,
        len: usize,
        u: &mut [f64],
        refr: &mut [u32],
        z: &mut [u8],
        asc: &mut [&mut [f64]; GA],
        y1: &mut [&mut [f64]; GP],
        y2: &mut [&mut [f64]; GP],
        x: &mut [&mut [f64]; GP],
    ) {
        let zero = f64x4::splat(0.0);
        let uj = load(u, j, len);
        let mut r = [1u32; LANES];
        r[..len].copy_from_slice(&refr[j..j + len]);
        let active = f64x4::new(r.map(f64::from)).cmp_eq(zero);
        let mut y1j = [zero; GP];
        let mut y2j = [zero; GP];
        for k in 0..GP {
            y1j[k] = load(y1[k], j, len);
            y2j[k] = load(y2[k], j, len);
        }
        let mut a_old = [zero; GA];
        for (old, row) in a_old.iter_mut().zip(asc.iter()) {
            *old = load(row, j, len);
        }
        let (un, over) = if GLIF {
            let mut asc_sum = zero;
            for (&old, &stable) in a_old.iter().zip(&self.stable) {
                asc_sum += old * stable;
            }
            let mut un = uj * self.p33 + (f64x4::splat(self.i_e) + asc_sum) * self.p30;
            for k in 0..GP {
                un += y1j[k] * self.p31[k] + y2j[k] * self.p32[k];
            }
            (un, un.cmp_gt(f64x4::splat(self.th)))
        } else {
            let mut un = f64x4::splat((0.0 + self.i_e) * self.p30);
            for k in 0..GP {
                un += y1j[k] * self.p31[k];
                un += y2j[k] * self.p32[k];
            }
            un = un + uj * self.expm1_tau_m + uj;
            let lb = f64x4::splat(self.lower_bound);
            un = un.cmp_lt(lb).blend(lb, un);
            (un, un.cmp_ge(f64x4::splat(self.th)))
        };
        let fired = active & over;
        for q in 0..GA {
            let decayed = a_old[q] * self.decay[q];
            let jumped = f64x4::splat(self.amp[q]) + decayed * self.refr_decay[q];
            let kept = active.blend(decayed, a_old[q]);
            store(asc[q], j, len, fired.blend(jumped, kept));
        }
        let kept = active.blend(un, uj);
        store(u, j, len, fired.blend(f64x4::splat(self.v_reset), kept));
        let bits = fired.move_mask();
        for l in 0..len {
            let spiked = (bits >> l) & 1 == 1;
            refr[j + l] = if spiked {
                self.refractory_steps
            } else {
                r[l].saturating_sub(1)
            };
            z[j + l] = u8::from(spiked);
        }
        for k in 0..GP {
            let xk = load(x[k], j, len);
            store(y2[k], j, len, y1j[k] * self.p21[k] + y2j[k] * self.p22[k]);
            store(y1[k], j, len, y1j[k] * self.p11[k] + xk * self.psc_init[k]);
            x[k][j..j + len].fill(0.0);
        }
    }
}

/// The recursion of `step_neuron::<f64>` for a group of shape `<GLIF, GA, GP>`:
/// [`LANES`] neurons at a time ([`Fixed::block`]).
#[inline(always)]
fn advance<const GLIF: bool, const GA: usize, const GP: usize>(c: &CellConsts, g: Group<'_>) {
    let f = Fixed::<GLIF, GA, GP>::new(c);
    let (n, a, b) = (g.n, g.a, g.b);
    let m = b - a;
    let u = &mut g.u[a..b];
    let refr = &mut g.refr[a..b];
    let z = &mut g.z[a..b];
    let all: [usize; GA] = std::array::from_fn(|q| q);
    let mut asc = rows::<GA>(g.asc, n, a, b, &all);
    let mut y1 = rows::<GP>(g.y1, n, a, b, g.ports);
    let mut y2 = rows::<GP>(g.y2, n, a, b, g.ports);
    let mut x = rows::<GP>(g.arrivals, n, a, b, g.ports);
    let mut j = 0;
    while j + LANES <= m {
        f.block(j, LANES, u, refr, z, &mut asc, &mut y1, &mut y2, &mut x);
        j += LANES;
    }
    if j < m {
        f.block(j, m - j, u, refr, z, &mut asc, &mut y1, &mut y2, &mut x);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::input::{InputSpec, PoissonSpec};
    use crate::network::{CellType, EdgeSpec, NetworkSpec, NeuronSpec, VirtualNodeSpec};
    use crate::simulation::forward::TrialState;
    use crate::simulation::model::CellModel;
    use lockstep_core::rng::SplitMix64;
    use serde_json::json;

    /// A GLIF cell with `n_asc` after-spike currents (0: GLIF1) and `ports` receptor ports.
    fn glif(n_asc: usize, ports: usize) -> CellModel {
        let tau_syn: Vec<f64> = (0..ports).map(|k| 2.0 + 1.7 * k as f64).collect();
        let p = json!({
            "V_m": -68.0, "V_th": -52.0, "g": 5.0, "E_L": -70.0, "C_m": 60.0, "t_ref": 2.0,
            "V_reset": -69.0, "I_e": 30.0,
            "asc_init": vec![0.5; n_asc], "asc_decay": (0..n_asc).map(|a| 0.1 + 0.2 * a as f64).collect::<Vec<_>>(),
            "asc_amps": (0..n_asc).map(|a| -10.0 - 25.0 * a as f64).collect::<Vec<_>>(),
            "asc_r": vec![1.0; n_asc],
            "tau_syn": tau_syn, "spike_dependent_threshold": false,
            "after_spike_currents": n_asc > 0, "adapting_threshold": false
        });
        CellModel::from_template("nest:glif_psc", &p, "test").unwrap()
    }

    /// Cell types of every compiled shape and of the fallback, neurons interleaved by type,
    /// random recurrent and input edges on every port with delays of 1 to 20 steps.
    fn network() -> Network {
        let iaf = CellModel::from_template(
            "nest:iaf_psc_alpha",
            &json!({"I_e": 150.0, "tau_m": 20.0, "C_m": 100.0, "t_ref": 3.0, "E_L": -75.0,
                    "V_th": -55.0, "V_reset": -70.0, "V_min": -80.0, "tau_syn_ex": 2.0, "tau_syn_in": 4.0}),
            "iaf",
        )
        .unwrap();
        let models = vec![
            glif(2, 4),
            glif(0, 1),
            glif(1, 3),
            glif(2, 2),
            glif(3, 5),
            iaf,
        ];
        let ports: Vec<usize> = models.iter().map(|m| m.n_ports()).collect();
        let cell_types: Vec<CellType> = models
            .into_iter()
            .enumerate()
            .map(|(i, model)| CellType {
                name: format!("type {i}"),
                model,
            })
            .collect();
        let (n, nv) = (61usize, 20usize);
        let neurons: Vec<NeuronSpec> = (0..n)
            .map(|i| NeuronSpec {
                population: "v1".into(),
                node_id: i as u64,
                cell_type: i % cell_types.len(),
            })
            .collect();
        let mut rng = SplitMix64::new(11);
        let mut edge = |source: usize, target: usize, scale: f64| {
            let ty = target % cell_types.len();
            let np = ports[ty];
            // Type 0 never receives on its second port and type 3 never on its first: the
            // kernel skips those dead ports (SimPlan), the reference updates them.
            let port = match (ty, (rng.next_u64() % np as u64) as i64) {
                (0, 1) => 2,
                (3, 0) => 1,
                (_, p) => p,
            };
            let weight = scale * (rng.uniform() - 0.4);
            // iaf_psc_alpha: receptor 0, the weight's sign picks the port.
            let receptor = if ty == cell_types.len() - 1 {
                0
            } else {
                port + 1
            };
            let delay_ms = 0.1 * (1 + rng.next_u64() % 20) as f64;
            EdgeSpec {
                source,
                target,
                weight,
                receptor,
                delay_ms,
            }
        };
        let mut recurrent_edges = Vec::new();
        let mut input_edges = Vec::new();
        for t in 0..n {
            for s in 0..n {
                if (s * 7 + t * 3) % 5 == 0 {
                    recurrent_edges.push(edge(s, t, 60.0));
                }
            }
            for v in 0..nv {
                if (v + t) % 3 == 0 {
                    input_edges.push(edge(v, t, 120.0));
                }
            }
        }
        NetworkSpec {
            cell_types,
            neurons,
            virtual_nodes: (0..nv)
                .map(|v| VirtualNodeSpec {
                    population: "lgn".into(),
                    node_id: v as u64,
                })
                .collect(),
            recurrent_edges,
            input_edges,
        }
        .compile(0.1)
        .unwrap()
    }

    #[test]
    fn kernel_matches_trial_state() {
        let net = network();
        let (n, np, na) = (net.n_neurons(), net.n_ports, net.n_asc);
        assert!(net.groups.len() == 6 && np == 5 && na == 3);
        let steps = 3000;
        let inputs = InputSpec {
            spike_trains: Some((0..20).map(|v| vec![0.05 + 0.7 * v as f64]).collect()),
            poisson: Some(PoissonSpec {
                rates_hz: (0..20).map(|v| 200.0 + 40.0 * v as f64).collect(),
                seed: 5,
            }),
        }
        .compile("test", net.n_virtual(), &net.grid, steps)
        .unwrap();
        let sg = Surrogate::default();
        let plan = SimPlan::new(&net);
        let live: Vec<usize> = plan.groups.iter().map(|(_, p)| p.len()).collect();
        assert_eq!(live, [3, 1, 3, 1, 5, 2], "live ports per group");
        let mut spikes_per_type = vec![0usize; net.groups.len()];
        let mut refractory_seen = 0usize;
        for init in [InitialState::Nest, InitialState::Rest] {
            let mut reference = TrialState::<f64>::new(&net, init);
            let mut kernel = SimTrial::new(&net, init);
            let mut z = vec![0.0; n];
            let mut fired = Vec::new();
            for t in 0..steps {
                let e_ref = reference.step(
                    &net,
                    &net.weights_rec,
                    &net.weights_in,
                    &inputs,
                    3,
                    t,
                    &sg,
                    &mut z,
                );
                let e = kernel.step(&net, &plan, &inputs, 3, t, &sg, &mut fired);
                assert_eq!(e, e_ref, "events of step {t}");
                let want: Vec<u32> = (0..n as u32).filter(|&i| z[i as usize] != 0.0).collect();
                assert_eq!(fired, want, "spikes of step {t}");
                for (gi, g) in net.groups.iter().enumerate() {
                    spikes_per_type[gi] += fired
                        .iter()
                        .filter(|&&i| (g.start..g.end).contains(&(i as usize)))
                        .count();
                }
                refractory_seen += reference.refr.iter().filter(|&&r| r > 0).count();
                for i in 0..n {
                    assert_eq!(
                        kernel.u[i].to_bits(),
                        reference.u[i].to_bits(),
                        "U[{i}] step {t}"
                    );
                    assert_eq!(kernel.refr[i], reference.refr[i], "refr[{i}] step {t}");
                    for a in 0..na {
                        assert_eq!(
                            kernel.asc[a * n + i].to_bits(),
                            reference.asc[i * na + a].to_bits(),
                            "asc[{a}][{i}] step {t}"
                        );
                    }
                    for k in 0..np {
                        assert_eq!(
                            kernel.y1[k * n + i].to_bits(),
                            reference.y1[i * np + k].to_bits()
                        );
                        assert_eq!(
                            kernel.y2[k * n + i].to_bits(),
                            reference.y2[i * np + k].to_bits()
                        );
                    }
                }
                // Pending arrivals of later steps agree too.
                for s in 0..net.ring_len() {
                    for i in 0..n {
                        for k in 0..np {
                            assert_eq!(
                                kernel.ring[(s * np + k) * n + i].to_bits(),
                                reference.ring[(s * n + i) * np + k].to_bits(),
                                "ring slot {s} neuron {i} port {k} after step {t}"
                            );
                        }
                    }
                }
            }
        }
        // Every cell type (every compiled shape and the fallback) spiked and went refractory.
        assert!(
            spikes_per_type.iter().all(|&s| s > 20),
            "{spikes_per_type:?}"
        );
        assert!(refractory_seen > 1000, "{refractory_seen}");
    }
}
