//! Cell models: parameters read from SONATA `dynamics_params` JSON and the per-step
//! constants (propagators) of `docs/neuron-models.md`.
//!
//! * `nest:glif_psc` without threshold adaptation (GLIF1 "lif" / GLIF3 "lif_asc"),
//!   NEST 3.x `glif_psc` (Teeter et al. 2018, Nat. Commun. 9:709; NEST implementation by
//!   Kim & Teeter), with alpha-shaped PSCs on `tau_syn.len()` receptor ports.
//! * `nest:iaf_psc_alpha` (NEST `iaf_psc_alpha`, exact integration after Rotter & Diesmann
//!   1999), two ports: 0 excitatory (weight > 0), 1 inhibitory (weight <= 0).
//!
//! Voltages are stored relative to `E_L` (`U = V - E_L`, mV); currents in pA; times in ms.

use serde_json::{Map, Value};

use crate::error::{Result, SnnError};
use crate::simulation::nest::{alpha_propagator, TimeGrid};

/// NEST's default `V_m` of `glif_psc` (mV) when the parameters do not set it.
pub(crate) const GLIF_DEFAULT_V_M: f64 = -78.85;
/// NEST's default `E_L` of `glif_psc` (mV).
pub(crate) const GLIF_DEFAULT_E_L: f64 = -78.85;
/// NEST's default `E_L` (and resting `V_m`) of `iaf_psc_alpha` (mV).
pub(crate) const IAF_DEFAULT_E_L: f64 = -70.0;

/// Parameters of `nest:glif_psc` (GLIF1/GLIF3). Units: mV, nS, pF, ms, pA, 1/ms.
#[derive(Debug, Clone, PartialEq)]
pub struct GlifParams {
    /// Initial membrane potential (mV); NEST keeps the absolute default `-78.85` when absent.
    pub v_m: f64,
    /// Threshold `V_th` (mV).
    pub v_th: f64,
    /// Membrane conductance `g` (nS).
    pub g: f64,
    /// Resting potential `E_L` (mV).
    pub e_l: f64,
    /// Capacitance `C_m` (pF).
    pub c_m: f64,
    /// Refractory period `t_ref` (ms).
    pub t_ref: f64,
    /// Reset potential `V_reset` (mV).
    pub v_reset: f64,
    /// Whether after-spike currents are on (`after_spike_currents`, NEST default false).
    pub after_spike_currents: bool,
    /// Initial after-spike currents (pA).
    pub asc_init: Vec<f64>,
    /// After-spike current decay rates `k` (1/ms).
    pub asc_decay: Vec<f64>,
    /// After-spike current jumps (pA).
    pub asc_amps: Vec<f64>,
    /// Fraction of the ASC kept at a spike (`asc_r`, default 1).
    pub asc_r: Vec<f64>,
    /// Synaptic time constants, one per receptor port (ms).
    pub tau_syn: Vec<f64>,
    /// Constant external current (pA); NEST's `glif_psc` has none, so 0 unless set.
    pub i_e: f64,
}

/// Parameters of `nest:iaf_psc_alpha`. Units: mV, pF, ms, pA.
#[derive(Debug, Clone, PartialEq)]
pub struct IafPscAlphaParams {
    /// Initial membrane potential (mV); NEST keeps the absolute default `-70` when absent.
    pub v_m: f64,
    /// Resting potential (mV).
    pub e_l: f64,
    /// Capacitance (pF).
    pub c_m: f64,
    /// Membrane time constant (ms).
    pub tau_m: f64,
    /// Refractory period (ms).
    pub t_ref: f64,
    /// Threshold (mV).
    pub v_th: f64,
    /// Reset potential (mV).
    pub v_reset: f64,
    /// Excitatory synaptic time constant (ms, default 2).
    pub tau_syn_ex: f64,
    /// Inhibitory synaptic time constant (ms, default 2).
    pub tau_syn_in: f64,
    /// Constant external current (pA).
    pub i_e: f64,
    /// Lower bound of the membrane potential `V_min` (mV, default -inf).
    pub v_min: f64,
}

/// A NEST `receptor_type` the target's cell model does not have ([`CellModel::port_of`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum ReceptorError {
    /// glif_psc receptor types are 1-based indices into `tau_syn`.
    #[error("glif_psc receptor types are 1..={ports} (one per tau_syn entry)")]
    GlifPsc {
        /// Number of receptor ports (`tau_syn` entries).
        ports: usize,
    },
    /// iaf_psc_alpha has one receptor type, 0.
    #[error(
        "iaf_psc_alpha accepts only receptor_type 0 (the sign of the weight selects the port)"
    )]
    IafPscAlpha,
}

/// A supported cell model with its parameters.
#[derive(Debug, Clone, PartialEq)]
pub enum CellModel {
    /// `nest:glif_psc` without threshold adaptation.
    GlifPsc(GlifParams),
    /// `nest:iaf_psc_alpha`.
    IafPscAlpha(IafPscAlphaParams),
}

/// Which update rule a [`CellConsts`] uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ModelKind {
    /// NEST `glif_psc` (threshold `U > th`).
    Glif,
    /// NEST `iaf_psc_alpha` (threshold `U >= th`).
    Iaf,
}

struct Reader<'a> {
    map: &'a Map<String, Value>,
    node_type: &'a str,
    model: &'a str,
}

impl Reader<'_> {
    fn err(&self, key: &str, value: String, reason: impl Into<String>) -> SnnError {
        SnnError::InvalidParameter {
            node_type: self.node_type.to_string(),
            model: self.model.to_string(),
            key: key.to_string(),
            value,
            reason: reason.into(),
        }
    }
    fn num(&self, key: &str) -> Result<Option<f64>> {
        match self.map.get(key) {
            None | Some(Value::Null) => Ok(None),
            Some(v) => v
                .as_f64()
                .map(Some)
                .ok_or_else(|| self.err(key, v.to_string(), "must be a number")),
        }
    }
    fn num_or(&self, key: &str, default: f64) -> Result<f64> {
        Ok(self.num(key)?.unwrap_or(default))
    }
    fn num_req(&self, key: &str, default: Option<f64>) -> Result<f64> {
        match (self.num(key)?, default) {
            (Some(v), _) => Ok(v),
            (None, Some(d)) => Ok(d),
            (None, None) => Err(self.err(
                key,
                "missing".into(),
                "required; add it to the dynamics_params JSON",
            )),
        }
    }
    fn boolean(&self, key: &str, default: bool) -> Result<bool> {
        match self.map.get(key) {
            None | Some(Value::Null) => Ok(default),
            Some(Value::Bool(b)) => Ok(*b),
            Some(Value::Number(n)) if n.as_f64() == Some(0.0) || n.as_f64() == Some(1.0) => {
                Ok(n.as_f64() == Some(1.0))
            }
            Some(v) => Err(self.err(key, v.to_string(), "must be true or false")),
        }
    }
    fn vec(&self, key: &str) -> Result<Option<Vec<f64>>> {
        match self.map.get(key) {
            None | Some(Value::Null) => Ok(None),
            Some(Value::Array(a)) => a
                .iter()
                .map(|x| {
                    x.as_f64()
                        .ok_or_else(|| self.err(key, x.to_string(), "every entry must be a number"))
                })
                .collect::<Result<Vec<_>>>()
                .map(Some),
            Some(v) => Err(self.err(key, v.to_string(), "must be an array of numbers")),
        }
    }
    /// Refuses parameters `model` does not have, naming the nearest known one.
    fn check_keys(&self, allowed: &[&str]) -> Result<()> {
        lockstep_core::config::check_keys(self.map, allowed, "").map_err(|e| {
            self.err(
                &e.key,
                self.map[&e.key].to_string(),
                format!(
                    "unknown parameter of {} (NEST would reject it): {}",
                    self.model, e.problem
                ),
            )
        })
    }
    fn positive(&self, key: &str, v: f64) -> Result<()> {
        if v.is_finite() && v > 0.0 {
            Ok(())
        } else {
            Err(self.err(key, v.to_string(), "must be strictly positive"))
        }
    }
}

const GLIF_KEYS: &[&str] = &[
    "V_m",
    "V_th",
    "g",
    "E_L",
    "C_m",
    "t_ref",
    "V_reset",
    "asc_init",
    "asc_decay",
    "asc_amps",
    "asc_r",
    "tau_syn",
    "spike_dependent_threshold",
    "after_spike_currents",
    "adapting_threshold",
    "th_spike_add",
    "th_spike_decay",
    "voltage_reset_fraction",
    "voltage_reset_add",
    "th_voltage_index",
    "th_voltage_decay",
    "I_e",
];

const IAF_KEYS: &[&str] = &[
    "V_m",
    "E_L",
    "C_m",
    "tau_m",
    "t_ref",
    "V_th",
    "V_reset",
    "tau_syn_ex",
    "tau_syn_in",
    "I_e",
    "V_min",
];

impl CellModel {
    /// Build a cell model from a SONATA `model_template` and its `dynamics_params` JSON object.
    ///
    /// `node_type` names the node type in error messages (e.g. `"101 (Rorb)"`). Unknown
    /// templates, GLIF variants with spike- or voltage-dependent threshold, unknown or invalid
    /// parameters are errors naming the node type and the model.
    pub fn from_template(template: &str, params: &Value, node_type: &str) -> Result<Self> {
        let empty = Map::new();
        let map = match params {
            Value::Object(m) => m,
            Value::Null => &empty,
            other => {
                return Err(SnnError::InvalidParameter {
                    node_type: node_type.into(),
                    model: template.into(),
                    key: "dynamics_params".into(),
                    value: other.to_string(),
                    reason: "must be a JSON object".into(),
                })
            }
        };
        let r = Reader {
            map,
            node_type,
            model: template,
        };
        match template {
            "nest:glif_psc" | "glif_psc" => Self::glif(&r),
            "nest:iaf_psc_alpha" | "iaf_psc_alpha" => Self::iaf(&r),
            _ => Err(SnnError::UnsupportedModel {
                node_type: node_type.into(),
                model: template.into(),
                reason: "supported model_templates are nest:glif_psc (GLIF1/GLIF3, no threshold adaptation) and nest:iaf_psc_alpha".into(),
            }),
        }
    }

    fn glif(r: &Reader) -> Result<Self> {
        r.check_keys(GLIF_KEYS)?;
        for key in ["spike_dependent_threshold", "adapting_threshold"] {
            if r.boolean(key, false)? {
                return Err(SnnError::UnsupportedModel {
                    node_type: r.node_type.into(),
                    model: r.model.into(),
                    reason: format!(
                        "{key} = true (GLIF2/4/5 threshold adaptation) is not supported; only GLIF1 (lif) and GLIF3 (lif_asc) are"
                    ),
                });
            }
        }
        let e_l = r.num_or("E_L", GLIF_DEFAULT_E_L)?;
        let v_m = match r.num("V_m")? {
            Some(v) => v,
            None => GLIF_DEFAULT_V_M,
        };
        let after_spike_currents = r.boolean("after_spike_currents", false)?;
        let asc_decay = r.vec("asc_decay")?.unwrap_or_else(|| vec![0.003, 0.1]);
        let n_asc = asc_decay.len();
        let asc_init = r.vec("asc_init")?.unwrap_or_else(|| vec![0.0; n_asc]);
        let asc_amps = r.vec("asc_amps")?.unwrap_or_else(|| vec![-9.18, -198.94]);
        let asc_r = r.vec("asc_r")?.unwrap_or_else(|| vec![1.0; n_asc]);
        let tau_syn = r.vec("tau_syn")?.unwrap_or_else(|| vec![2.0]);
        let p = GlifParams {
            v_m,
            v_th: r.num_req("V_th", Some(-51.68))?,
            g: r.num_req("g", Some(9.43))?,
            e_l,
            c_m: r.num_req("C_m", Some(58.72))?,
            t_ref: r.num_req("t_ref", Some(3.75))?,
            v_reset: r.num_req("V_reset", Some(GLIF_DEFAULT_E_L))?,
            after_spike_currents,
            asc_init,
            asc_decay,
            asc_amps,
            asc_r,
            tau_syn,
            i_e: r.num_or("I_e", 0.0)?,
        };
        r.positive("g", p.g)?;
        r.positive("C_m", p.c_m)?;
        r.positive("t_ref", p.t_ref)?;
        if p.v_reset - p.e_l >= p.v_th - p.e_l {
            return Err(r.err(
                "V_reset",
                p.v_reset.to_string(),
                format!("must be below V_th = {}", p.v_th),
            ));
        }
        if p.tau_syn.is_empty() {
            return Err(r.err("tau_syn", "[]".into(), "needs at least one receptor port"));
        }
        for &t in &p.tau_syn {
            r.positive("tau_syn", t)?;
        }
        if p.after_spike_currents {
            let n = p.asc_decay.len();
            if p.asc_init.len() != n || p.asc_amps.len() != n || p.asc_r.len() != n {
                return Err(r.err(
                    "asc_amps",
                    format!(
                        "sizes asc_init {}, asc_decay {}, asc_amps {}, asc_r {}",
                        p.asc_init.len(),
                        n,
                        p.asc_amps.len(),
                        p.asc_r.len()
                    ),
                    "all after-spike current parameters must have the same length",
                ));
            }
            for &k in &p.asc_decay {
                r.positive("asc_decay", k)?;
            }
            for &x in &p.asc_r {
                if !(0.0..=1.0).contains(&x) {
                    return Err(r.err("asc_r", x.to_string(), "must lie in [0, 1]"));
                }
            }
        }
        Ok(CellModel::GlifPsc(p))
    }

    fn iaf(r: &Reader) -> Result<Self> {
        r.check_keys(IAF_KEYS)?;
        let p = IafPscAlphaParams {
            v_m: r.num_or("V_m", IAF_DEFAULT_E_L)?,
            e_l: r.num_or("E_L", IAF_DEFAULT_E_L)?,
            c_m: r.num_or("C_m", 250.0)?,
            tau_m: r.num_or("tau_m", 10.0)?,
            t_ref: r.num_or("t_ref", 2.0)?,
            v_th: r.num_or("V_th", -55.0)?,
            v_reset: r.num_or("V_reset", -70.0)?,
            tau_syn_ex: r.num_or("tau_syn_ex", 2.0)?,
            tau_syn_in: r.num_or("tau_syn_in", 2.0)?,
            i_e: r.num_or("I_e", 0.0)?,
            v_min: r.num_or("V_min", f64::NEG_INFINITY)?,
        };
        r.positive("C_m", p.c_m)?;
        r.positive("tau_m", p.tau_m)?;
        r.positive("tau_syn_ex", p.tau_syn_ex)?;
        r.positive("tau_syn_in", p.tau_syn_in)?;
        if p.t_ref.is_nan() || p.t_ref < 0.0 {
            return Err(r.err("t_ref", p.t_ref.to_string(), "must be >= 0"));
        }
        if p.v_reset >= p.v_th {
            return Err(r.err(
                "V_reset",
                p.v_reset.to_string(),
                format!("must be below V_th = {}", p.v_th),
            ));
        }
        Ok(CellModel::IafPscAlpha(p))
    }

    /// Number of receptor ports (glif: `tau_syn.len()`, iaf: 2).
    pub fn n_ports(&self) -> usize {
        match self {
            CellModel::GlifPsc(p) => p.tau_syn.len(),
            CellModel::IafPscAlpha(_) => 2,
        }
    }

    /// Number of after-spike currents (0 when they are off).
    pub fn n_asc(&self) -> usize {
        match self {
            CellModel::GlifPsc(p) if p.after_spike_currents => p.asc_decay.len(),
            _ => 0,
        }
    }

    /// The model template name (`nest:glif_psc` / `nest:iaf_psc_alpha`).
    pub fn template(&self) -> &'static str {
        match self {
            CellModel::GlifPsc(_) => "nest:glif_psc",
            CellModel::IafPscAlpha(_) => "nest:iaf_psc_alpha",
        }
    }

    /// Receptor port (0-based) of an edge with NEST `receptor_type` and weight `weight` (pA).
    ///
    /// glif_psc: receptor types are 1-based indices into `tau_syn`; iaf_psc_alpha: receptor 0,
    /// port 0 for positive and port 1 for other weights (NEST's `s > 0 ? SYN_EX : SYN_IN`).
    ///
    /// Errors: [`ReceptorError`] for a receptor type the model does not have.
    pub fn port_of(
        &self,
        receptor_type: i64,
        weight: f64,
    ) -> std::result::Result<usize, ReceptorError> {
        match self {
            CellModel::GlifPsc(p) => {
                if receptor_type >= 1 && (receptor_type as usize) <= p.tau_syn.len() {
                    Ok(receptor_type as usize - 1)
                } else {
                    Err(ReceptorError::GlifPsc {
                        ports: p.tau_syn.len(),
                    })
                }
            }
            CellModel::IafPscAlpha(_) => {
                if receptor_type == 0 {
                    Ok(if weight > 0.0 { 0 } else { 1 })
                } else {
                    Err(ReceptorError::IafPscAlpha)
                }
            }
        }
    }

    /// Per-step constants for resolution `grid.dt`.
    pub fn constants(&self, grid: &TimeGrid) -> CellConsts {
        let h = grid.dt;
        match self {
            CellModel::GlifPsc(p) => {
                let tau = p.c_m / p.g;
                let p33 = (-h / tau).exp();
                let p30 = 1.0 / p.c_m * (1.0 - p33) * tau;
                let ports = p
                    .tau_syn
                    .iter()
                    .map(|&ts| {
                        let p11 = (-h / ts).exp();
                        let (p31, p32) = alpha_propagator(ts, tau, p.c_m, h);
                        PortConsts {
                            p11,
                            p22: p11,
                            p21: h * p11,
                            p31,
                            p32,
                            psc_init: 1.0 * std::f64::consts::E / ts,
                        }
                    })
                    .collect();
                let asc = if p.after_spike_currents {
                    (0..p.asc_decay.len())
                        .map(|a| {
                            let k = p.asc_decay[a];
                            let decay = (-k * h).exp();
                            AscConsts {
                                decay,
                                stable: ((1.0 / k) / h) * (1.0 - decay),
                                refr_decay: p.asc_r[a] * (-k * p.t_ref).exp(),
                                amp: p.asc_amps[a],
                                init: p.asc_init[a],
                            }
                        })
                        .collect()
                } else {
                    Vec::new()
                };
                CellConsts {
                    kind: ModelKind::Glif,
                    p33,
                    p30,
                    expm1_tau_m: 0.0,
                    ports,
                    asc,
                    th: p.v_th - p.e_l,
                    v_reset: p.v_reset - p.e_l,
                    i_e: p.i_e,
                    lower_bound: f64::NEG_INFINITY,
                    refractory_steps: grid.ms_to_steps_ceil(p.t_ref).max(0) as u32,
                    u0: if p.v_m == GLIF_DEFAULT_V_M && p.e_l != GLIF_DEFAULT_E_L {
                        -(p.e_l - GLIF_DEFAULT_E_L)
                    } else {
                        p.v_m - p.e_l
                    },
                    e_l: p.e_l,
                }
            }
            CellModel::IafPscAlpha(p) => {
                let tau = p.tau_m;
                let port = |ts: f64| {
                    let p11 = (-h / ts).exp();
                    let (p31, p32) = alpha_propagator(ts, tau, p.c_m, h);
                    PortConsts {
                        p11,
                        p22: p11,
                        p21: h * p11,
                        p31,
                        p32,
                        psc_init: 1.0 * std::f64::consts::E / ts,
                    }
                };
                CellConsts {
                    kind: ModelKind::Iaf,
                    p33: (-h / tau).exp(),
                    p30: -tau / p.c_m * (-h / tau).exp_m1(),
                    expm1_tau_m: (-h / tau).exp_m1(),
                    ports: vec![port(p.tau_syn_ex), port(p.tau_syn_in)],
                    asc: Vec::new(),
                    th: p.v_th - p.e_l,
                    v_reset: p.v_reset - p.e_l,
                    i_e: p.i_e,
                    lower_bound: p.v_min - p.e_l,
                    refractory_steps: grid.ms_to_steps_ceil(p.t_ref).max(0) as u32,
                    // NEST keeps the absolute V_m (default -70 mV) when only E_L is set.
                    u0: if p.v_m == IAF_DEFAULT_E_L {
                        -(p.e_l - IAF_DEFAULT_E_L)
                    } else {
                        p.v_m - p.e_l
                    },
                    e_l: p.e_l,
                }
            }
        }
    }
}

/// Propagators of one receptor port (alpha PSC), NEST notation.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PortConsts {
    /// `exp(-h/tau_syn)`: decay of `y1` (dI/dt state).
    pub p11: f64,
    /// `h * P11`: `y1 -> y2`.
    pub p21: f64,
    /// `exp(-h/tau_syn)`: decay of `y2` (current, pA).
    pub p22: f64,
    /// `y1 -> U` (exact alpha propagator).
    pub p31: f64,
    /// `y2 -> U` (exact alpha propagator).
    pub p32: f64,
    /// Jump of `y1` per unit weight: `e / tau_syn` (peak current = weight, pA).
    pub psc_init: f64,
}

/// Constants of one after-spike current.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AscConsts {
    /// `exp(-k h)`.
    pub decay: f64,
    /// `(1 - exp(-k h)) / (k h)`: exact mean over a step.
    pub stable: f64,
    /// `asc_r * exp(-k t_ref)`.
    pub refr_decay: f64,
    /// Jump at a spike (pA).
    pub amp: f64,
    /// Initial value (pA).
    pub init: f64,
}

/// All per-step constants of one parameter set at one resolution (`docs/neuron-models.md`, "Cell models").
#[derive(Debug, Clone, PartialEq)]
pub struct CellConsts {
    /// Update rule.
    pub kind: ModelKind,
    /// `exp(-h/Tau)`.
    pub p33: f64,
    /// Current -> voltage propagator (mV/pA).
    pub p30: f64,
    /// `expm1(-h/tau_m)` (iaf_psc_alpha form of the voltage decay).
    pub expm1_tau_m: f64,
    /// One entry per receptor port.
    pub ports: Vec<PortConsts>,
    /// One entry per after-spike current (empty for GLIF1 and iaf_psc_alpha).
    pub asc: Vec<AscConsts>,
    /// Threshold relative to `E_L` (mV).
    pub th: f64,
    /// Reset potential relative to `E_L` (mV).
    pub v_reset: f64,
    /// Constant current (pA).
    pub i_e: f64,
    /// Lower bound of `U` (iaf_psc_alpha `V_min - E_L`; -inf otherwise).
    pub lower_bound: f64,
    /// Refractory period in steps (NEST rounding).
    pub refractory_steps: u32,
    /// Initial `U` (mV rel. to `E_L`) as NEST starts it.
    pub u0: f64,
    /// Resting potential `E_L` (mV): the membrane potential is `V_m = U + E_L` (NEST's
    /// `get_V_m_()` of `glif_psc` and `iaf_psc_alpha`).
    pub e_l: f64,
}

/// Initial state of a trial.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum InitialState {
    /// As NEST starts the nodes: `V_m` from the parameters (or the model's absolute default),
    /// ASCs at `asc_init`, PSCs zero. Used by `simulate` for NEST-exact reproduction.
    #[default]
    Nest,
    /// Every neuron at rest: zero state (`docs/neuron-models.md`, "Batched simulation"; used for training).
    Rest,
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn rejects_threshold_adaptation_and_unknown_templates() {
        let e = CellModel::from_template(
            "nest:glif_psc",
            &json!({"spike_dependent_threshold": true}),
            "7 (X)",
        )
        .unwrap_err()
        .to_string();
        assert!(
            e.contains("7 (X)")
                && e.contains("nest:glif_psc")
                && e.contains("spike_dependent_threshold"),
            "{e}"
        );
        let e = CellModel::from_template(
            "nest:glif_psc",
            &json!({"adapting_threshold": true}),
            "8 (Y)",
        )
        .unwrap_err()
        .to_string();
        assert!(
            e.contains("8 (Y)") && e.contains("adapting_threshold"),
            "{e}"
        );
        let e = CellModel::from_template("nest:iaf_cond_exp", &json!({}), "9 (Z)")
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("9 (Z)") && e.contains("nest:iaf_cond_exp"),
            "{e}"
        );
        let e = CellModel::from_template("nest:iaf_psc_alpha", &json!({"tau_x": 1.0}), "1")
            .unwrap_err()
            .to_string();
        assert!(e.contains("tau_x"), "{e}");
    }

    #[test]
    fn iaf_initial_potential_follows_nest() {
        let m = CellModel::from_template(
            "nest:iaf_psc_alpha",
            &json!({"E_L": -75.0, "V_th": -37.0, "V_reset": -53.0}),
            "x",
        )
        .unwrap();
        let c = m.constants(&TimeGrid::new(0.1).unwrap());
        assert_eq!(c.u0, 5.0);
        assert_eq!(c.th, 38.0);
        assert_eq!(c.v_reset, 22.0);
        assert_eq!(m.port_of(0, 3.0), Ok(0));
        assert_eq!(m.port_of(0, -3.0), Ok(1));
        assert!(m.port_of(1, 3.0).is_err());
    }
}
