//! Cell models against hand-computed steps.
//!
//! * Subthreshold response to one input spike per receptor port: the exact integration must
//!   equal the closed-form solution of an alpha current through a leaky membrane at every
//!   grid point, starting at the step NEST delivers the spike (stamp - 1 + delay).
//! * ASC reset, refractory hold: a constant current drives a GLIF3 cell; the trajectory is
//!   recomputed by hand with the update of docs/neuron-models.md.
//! * Delays of 1 and several steps between two cells.

use lockstep_snn::CellModel;
use lockstep_snn::{
    CellType, EdgeSpec, InitialState, InputSpec, Network, NetworkSpec, NeuronSpec, Surrogate,
    TrialState, VirtualNodeSpec,
};
use serde_json::json;

const H: f64 = 0.1;

fn glif_params() -> serde_json::Value {
    json!({
        "V_m": -70.0, "V_th": -50.0, "g": 5.0, "E_L": -70.0, "C_m": 60.0, "t_ref": 2.0,
        "V_reset": -70.0, "asc_init": [0.0, 0.0], "asc_decay": [0.1, 0.3], "asc_amps": [-20.0, -60.0],
        "tau_syn": [5.5, 8.5, 2.8, 5.8], "spike_dependent_threshold": false,
        "after_spike_currents": true, "adapting_threshold": false
    })
}

fn iaf_params() -> serde_json::Value {
    json!({"I_e": 0.0, "tau_m": 20.0, "C_m": 100.0, "t_ref": 3.0, "E_L": -75.0, "V_th": -40.0, "V_reset": -60.0,
           "tau_syn_ex": 2.0, "tau_syn_in": 4.0})
}

/// One virtual node -> one neuron with the given receptor/weight/delay.
fn single(model: CellModel, receptor: i64, weight: f64, delay_ms: f64) -> NetworkSpec {
    NetworkSpec {
        cell_types: vec![CellType {
            name: "t".into(),
            model,
        }],
        neurons: vec![NeuronSpec {
            population: "v1".into(),
            node_id: 0,
            cell_type: 0,
        }],
        virtual_nodes: vec![VirtualNodeSpec {
            population: "lgn".into(),
            node_id: 0,
        }],
        recurrent_edges: vec![],
        input_edges: vec![EdgeSpec {
            source: 0,
            target: 0,
            weight,
            receptor,
            delay_ms,
        }],
    }
}

/// Closed form: membrane response (mV) at time `t` after an alpha current of peak `w` (pA)
/// starting at t = 0, time constants tau_s (synapse) and tau (membrane, ms), capacitance c.
fn alpha_response(w: f64, tau_s: f64, tau: f64, c: f64, t: f64) -> f64 {
    if t <= 0.0 {
        return 0.0;
    }
    let a = 1.0 / tau_s - 1.0 / tau;
    w * std::f64::consts::E / (tau_s * c)
        * (-t / tau).exp()
        * (1.0 - (-a * t).exp() * (1.0 + a * t))
        / (a * a)
}

/// Run `n` steps of one trial and return U (mV rel. E_L) after each step.
fn trajectory(
    net: &Network,
    inputs: &lockstep_snn::Inputs,
    n: usize,
    init: InitialState,
) -> (Vec<f64>, Vec<f64>) {
    let mut st = TrialState::<f64>::new(net, init);
    let mut z = vec![0.0; net.n_neurons()];
    let mut u = Vec::new();
    let mut spikes = Vec::new();
    for t in 0..n {
        st.step(
            net,
            &net.weights_rec,
            &net.weights_in,
            inputs,
            0,
            t,
            &Surrogate::default(),
            &mut z,
        );
        u.push(st.u[0]);
        spikes.push(z[0]);
    }
    (u, spikes)
}

#[test]
fn glif_subthreshold_response_per_port_matches_closed_form() {
    let model = CellModel::from_template("nest:glif_psc", &glif_params(), "glif").unwrap();
    let tau_syn = [5.5, 8.5, 2.8, 5.8];
    let (c_m, g) = (60.0, 5.0);
    for (port, &ts) in tau_syn.iter().enumerate() {
        for (delay_ms, delay_steps) in [(0.1, 1usize), (0.5, 5usize)] {
            let w = if port % 2 == 0 { 3.0 } else { -4.0 };
            let net = single(model.clone(), port as i64 + 1, w, delay_ms)
                .compile(H)
                .unwrap();
            // Input at 0.25 ms -> stamp 3 (step ending at 0.3 ms), emitted in step 2,
            // delivered in step 2 + delay: y1 jumps at the end of that step.
            let spec = InputSpec {
                spike_trains: Some(vec![vec![0.25]]),
                poisson: None,
            };
            let inputs = spec.compile("test", 1, &net.grid, 300).unwrap();
            let (u, spikes) = trajectory(&net, &inputs, 300, InitialState::Nest);
            assert!(spikes.iter().all(|&s| s == 0.0));
            let arrival_end = (2 + delay_steps + 1) as f64 * H; // time of the y1 jump
            for (n, &un) in u.iter().enumerate() {
                let t_end = (n + 1) as f64 * H;
                let expect = alpha_response(w, ts, c_m / g, c_m, t_end - arrival_end);
                assert!(
                    (un - expect).abs() <= 1e-10 * expect.abs().max(1e-3),
                    "port {port} delay {delay_steps}: step {n}: U = {un}, closed form {expect}"
                );
                if t_end <= arrival_end + 1e-9 {
                    assert_eq!(un, 0.0, "no response before the delivery step (step {n})");
                }
            }
            assert!(u[299].abs() > 0.0);
        }
    }
}

#[test]
fn iaf_subthreshold_response_per_port_matches_closed_form() {
    let model = CellModel::from_template("nest:iaf_psc_alpha", &iaf_params(), "iaf").unwrap();
    for (w, tau_s) in [(50.0, 2.0), (-50.0, 4.0)] {
        let net = single(model.clone(), 0, w, 2.0).compile(H).unwrap();
        let spec = InputSpec {
            spike_trains: Some(vec![vec![1.0]]),
            poisson: None,
        };
        let inputs = spec.compile("test", 1, &net.grid, 400).unwrap();
        // Start at rest so that only the PSC moves U.
        let (u, _) = trajectory(&net, &inputs, 400, InitialState::Rest);
        let arrival_end = (9 + 20 + 1) as f64 * H; // stamp 10 -> step 9, +20 steps delay
        for (n, &un) in u.iter().enumerate() {
            let expect = alpha_response(w, tau_s, 20.0, 100.0, (n + 1) as f64 * H - arrival_end);
            assert!(
                (un - expect).abs() <= 1e-10 * expect.abs().max(1e-3),
                "w {w}: step {n}: {un} vs {expect}"
            );
        }
        assert!(if w > 0.0 { u[399] > 0.0 } else { u[399] < 0.0 });
    }
}

#[test]
fn iaf_starts_where_nest_starts() {
    // NEST keeps V_m = -70 mV (absolute) when the parameters set E_L = -75 but no V_m:
    // U relaxes from +5 mV towards 0 with exp(-t/tau_m).
    let model = CellModel::from_template("nest:iaf_psc_alpha", &iaf_params(), "iaf").unwrap();
    let net = single(model, 0, 1.0, 1.0).compile(H).unwrap();
    let inputs = InputSpec::default()
        .compile("none", 1, &net.grid, 10)
        .unwrap();
    let (u, _) = trajectory(&net, &inputs, 10, InitialState::Nest);
    for (n, &un) in u.iter().enumerate() {
        let expect = 5.0 * (-((n + 1) as f64) * H / 20.0).exp();
        assert!((un - expect).abs() < 1e-12, "{un} vs {expect}");
    }
}

/// Hand-written GLIF3 update (docs/neuron-models.md) with constant current, used as the expectation.
struct HandGlif {
    u: f64,
    asc: [f64; 2],
    refr: u32,
}

#[test]
fn glif_asc_reset_and_refractory_hold_by_hand() {
    let mut p = glif_params();
    p["I_e"] = json!(150.0);
    let model = CellModel::from_template("nest:glif_psc", &p, "glif").unwrap();
    let net = single(model, 1, 0.0, 1.0).compile(H).unwrap();
    let inputs = InputSpec::default()
        .compile("none", 1, &net.grid, 2000)
        .unwrap();
    let (u, spikes) = trajectory(&net, &inputs, 2000, InitialState::Nest);

    // By hand.
    let (c_m, g, i_e, th, v_reset) = (60.0, 5.0, 150.0, 20.0, 0.0);
    let tau: f64 = c_m / g;
    let p33 = (-H / tau).exp();
    let p30 = (1.0 - p33) * tau / c_m;
    let k = [0.1, 0.3];
    let amps = [-20.0, -60.0];
    let decay = [(-k[0] * H).exp(), (-k[1] * H).exp()];
    let stable = [(1.0 - decay[0]) / (k[0] * H), (1.0 - decay[1]) / (k[1] * H)];
    let refr_decay = [(-k[0] * 2.0f64).exp(), (-k[1] * 2.0f64).exp()];
    let ref_steps = 20u32; // t_ref 2 ms at 0.1 ms
    let mut s = HandGlif {
        u: 0.0,
        asc: [0.0, 0.0],
        refr: 0,
    };
    let mut n_spikes = 0;
    let mut first_spike = None;
    for n in 0..2000 {
        let mut fired = false;
        if s.refr == 0 {
            let asc_sum = stable[0] * s.asc[0] + stable[1] * s.asc[1];
            s.asc = [s.asc[0] * decay[0], s.asc[1] * decay[1]];
            s.u = s.u * p33 + (i_e + asc_sum) * p30;
            if s.u > th {
                fired = true;
                s.refr = ref_steps;
                s.asc = [
                    amps[0] + s.asc[0] * refr_decay[0],
                    amps[1] + s.asc[1] * refr_decay[1],
                ];
                s.u = v_reset;
            }
        } else {
            s.refr -= 1;
        }
        assert_eq!(spikes[n] == 1.0, fired, "spike mismatch at step {n}");
        assert!(
            (u[n] - s.u).abs() < 1e-9,
            "step {n}: U {} vs hand {}",
            u[n],
            s.u
        );
        if fired {
            n_spikes += 1;
            first_spike.get_or_insert(n);
        }
    }
    assert!(
        n_spikes >= 3,
        "the test current must make the cell fire repeatedly ({n_spikes})"
    );
    // Refractory hold: U stays exactly at V_reset for 20 steps after the spike step, then moves.
    let f = first_spike.unwrap();
    for (n, &un) in u.iter().enumerate().take(f + 21).skip(f) {
        assert_eq!(un, v_reset, "held at reset during refractory step {n}");
    }
    assert!(u[f + 21] > v_reset);
    // ASC reset makes the second inter-spike interval longer than the first integration time.
    let spike_steps: Vec<usize> = (0..2000).filter(|&n| spikes[n] == 1.0).collect();
    assert!(spike_steps[1] - spike_steps[0] > spike_steps[0] + 1);
}

#[test]
fn iaf_reset_and_refractory_hold() {
    let mut p = iaf_params();
    p["I_e"] = json!(400.0);
    let model = CellModel::from_template("nest:iaf_psc_alpha", &p, "iaf").unwrap();
    let net = single(model, 0, 1.0, 1.0).compile(H).unwrap();
    let inputs = InputSpec::default()
        .compile("none", 1, &net.grid, 1000)
        .unwrap();
    let (u, spikes) = trajectory(&net, &inputs, 1000, InitialState::Rest);
    let p30 = -20.0 / 100.0 * (-H / 20.0f64).exp_m1();
    let e1 = (-H / 20.0f64).exp_m1();
    let (mut uh, mut r) = (0.0f64, 0u32);
    for n in 0..1000 {
        let mut fired = false;
        if r == 0 {
            uh = p30 * 400.0 + e1 * uh + uh;
            if uh >= 35.0 {
                fired = true;
                uh = 15.0;
                r = 30;
            }
        } else {
            r -= 1;
        }
        assert_eq!(spikes[n] == 1.0, fired, "spike mismatch at step {n}");
        assert!((u[n] - uh).abs() < 1e-9, "step {n}: {} vs {uh}", u[n]);
    }
    assert!(spikes.iter().filter(|&&s| s == 1.0).count() >= 3);
}

#[test]
fn recurrent_delays_of_one_and_several_steps() {
    // Cell 0 is driven to fire by a constant current; cells 1 and 2 receive its spikes with
    // delays of 1 and 4 steps on port 1. y1 of the receiver jumps exactly in step t + d.
    let mut drive = glif_params();
    drive["I_e"] = json!(150.0);
    let driver = CellModel::from_template("nest:glif_psc", &drive, "driver").unwrap();
    let quiet = CellModel::from_template("nest:glif_psc", &glif_params(), "quiet").unwrap();
    let spec = NetworkSpec {
        cell_types: vec![
            CellType {
                name: "driver".into(),
                model: driver,
            },
            CellType {
                name: "quiet".into(),
                model: quiet,
            },
        ],
        neurons: (0..3)
            .map(|i| NeuronSpec {
                population: "v1".into(),
                node_id: i,
                cell_type: (i > 0) as usize,
            })
            .collect(),
        virtual_nodes: vec![],
        recurrent_edges: vec![
            EdgeSpec {
                source: 0,
                target: 1,
                weight: 2.0,
                receptor: 1,
                delay_ms: 0.1,
            },
            EdgeSpec {
                source: 0,
                target: 2,
                weight: 2.0,
                receptor: 1,
                delay_ms: 0.4,
            },
        ],
        input_edges: vec![],
    };
    let net = spec.compile(H).unwrap();
    assert_eq!(net.max_delay, 4);
    let inputs = InputSpec::default()
        .compile("none", 0, &net.grid, 400)
        .unwrap();
    let mut st = TrialState::<f64>::new(&net, InitialState::Rest);
    let mut z = vec![0.0; 3];
    let (r0, r1, r2) = (
        net.rank[0] as usize,
        net.rank[1] as usize,
        net.rank[2] as usize,
    );
    let np = net.n_ports;
    let jump = 2.0 * std::f64::consts::E / 5.5;
    let mut first = None;
    for t in 0..400 {
        st.step(
            &net,
            &net.weights_rec,
            &net.weights_in,
            &inputs,
            0,
            t,
            &Surrogate::default(),
            &mut z,
        );
        if z[r0] == 1.0 && first.is_none() {
            first = Some(t);
        }
        if let Some(f) = first {
            let y1_1 = st.y1[r1 * np];
            let y1_2 = st.y1[r2 * np];
            if t < f + 1 {
                assert_eq!(y1_1, 0.0, "delay 1: nothing before step {}", f + 1);
            }
            if t == f + 1 {
                assert!(
                    (y1_1 - jump).abs() < 1e-12,
                    "delay 1: jump in step t+1: {y1_1}"
                );
            }
            if t < f + 4 {
                assert_eq!(y1_2, 0.0, "delay 4: nothing before step {}", f + 4);
            }
            if t == f + 4 {
                assert!(
                    (y1_2 - jump).abs() < 1e-12,
                    "delay 4: jump in step t+4: {y1_2}"
                );
                return;
            }
        }
    }
    panic!("the driver never fired");
}

#[test]
fn delay_shorter_than_dt_and_bad_receptor_are_rejected() {
    let model = CellModel::from_template("nest:glif_psc", &glif_params(), "101 (Rorb)").unwrap();
    let e = single(model.clone(), 1, 1.0, 0.05)
        .compile(H)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("0.05") && e.contains("shorter than one time step"),
        "{e}"
    );
    let e = single(model.clone(), 5, 1.0, 1.0)
        .compile(H)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("receptor_type 5") && e.contains("glif_psc"),
        "{e}"
    );
    let e = single(model, 0, 1.0, 1.0)
        .compile(H)
        .unwrap_err()
        .to_string();
    assert!(e.contains("receptor_type 0"), "{e}");
}
