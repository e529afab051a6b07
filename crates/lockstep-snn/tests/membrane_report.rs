//! `lockstep simulate` with BMTK `reports`: the SONATA membrane report of `V_m` equals NEST
//! 3.10's multimeter on the bundled `point_450glifs` network (dt 0.1 ms, 1000 ms, every 1 ms),
//! windows and node sets select the right frames and cells, and the rate table equals the
//! rates of NEST's spike counts.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use lockstep_core::config::ConfigError;
use lockstep_snn::{simulate_config, RateGroup, SimulateOptions, SnnError};
use serde_json::{json, Value};

/// The repository's `examples/` folder (network, inputs, NEST reference output).
fn examples() -> PathBuf {
    std::fs::canonicalize(concat!(env!("CARGO_MANIFEST_DIR"), "/../../examples")).unwrap()
}

fn reference(file: &str) -> PathBuf {
    examples().join("point_450glifs/reference").join(file)
}

/// NEST's multimeter recording: `(node_ids [450], times [999], V_m [time, node])`.
fn nest_vm() -> (Vec<i64>, Vec<f64>, Vec<f64>) {
    let f = hdf5::File::open(reference("nest_point450_dt0.1_t1000.vm.h5")).unwrap();
    let ids = f.dataset("node_ids").unwrap().read_raw::<i64>().unwrap();
    let times = f.dataset("times").unwrap().read_raw::<f64>().unwrap();
    let vm = f.dataset("V_m").unwrap();
    assert_eq!(vm.shape(), [times.len(), ids.len()]);
    (ids, times, vm.read_raw::<f64>().unwrap())
}

/// The bundled simulation (the circuit config of `point_450glifs`, its LGN spikes) with
/// `run` and `reports` as given, writing to `dir/out`.
fn config(dir: &Path, tstop: f64, reports: Value) -> PathBuf {
    let base = examples().join("point_450glifs");
    let cfg = json!({
        "manifest": {"$OUT": dir.join("out").to_str().unwrap()},
        "target_simulator": "NEST",
        "run": {"tstop": tstop, "dt": 0.1},
        "network": base.join("config.circuit.json").to_str().unwrap(),
        "inputs": {"LGN_spikes": {"input_type": "spikes", "module": "sonata",
            "input_file": base.join("inputs/lgn_spikes.h5").to_str().unwrap(), "node_set": "lgn"}},
        "output": {"output_dir": "$OUT", "spikes_file": "spikes.h5", "overwrite_output_dir": true},
        "reports": reports,
    });
    let path = dir.join("config.simulation.json");
    std::fs::write(&path, serde_json::to_string_pretty(&cfg).unwrap()).unwrap();
    path
}

#[test]
fn membrane_report_equals_nest_multimeter_and_rates_equal_nest_counts() {
    let tmp = tempfile::tempdir().unwrap();
    // As BMTK's examples write it (module, sections, no file_name: <name>.h5 in output_dir).
    let cfg = config(
        tmp.path(),
        1000.0,
        // float64: the exact values (the default float32 is the SONATA spec's type).
        json!({"membrane_potential": {"cells": "v1", "variable_name": "V_m",
            "module": "multimeter_report", "sections": "soma", "interval": 1.0,
            "dtype": "float64"}}),
    );
    let s = simulate_config(&cfg, &SimulateOptions::default()).unwrap();
    let file = tmp.path().join("out/membrane_potential.h5");
    assert_eq!(s.reports.len(), 1);
    assert_eq!(s.reports[0].file, file);
    let report = lockstep_sonata::read_report(&file).unwrap();
    assert_eq!(report.variable, "V_m");
    let p = report.population("v1").unwrap();
    assert_eq!(p.units, "mV");
    // Every 1 ms in (0, 1000]: NEST's 999 frames (it loses the last min_delay slice) + 1000 ms.
    assert_eq!(p.time, [1.0, 1001.0, 1.0]);
    assert_eq!(p.n_frames(), 1000);
    let (ids, times, vm) = nest_vm();
    let ours_ids: Vec<i64> = p.node_ids.iter().map(|&i| i as i64).collect();
    assert_eq!(ours_ids, ids);
    let our_times = p.times();
    let n = ids.len();
    let mut worst = (0.0f64, 0usize, 0usize);
    for (k, &t) in times.iter().enumerate() {
        assert_eq!(our_times[k], t, "frame {k}");
        for c in 0..n {
            let d = (p.data[k * n + c] - vm[k * n + c]).abs();
            if d > worst.0 {
                worst = (d, k, c);
            }
        }
    }
    eprintln!(
        "largest |V_m - NEST| = {:.3e} mV (node {}, {} ms)",
        worst.0, ids[worst.2], times[worst.1]
    );
    assert!(
        worst.0 <= 1e-6,
        "V_m of node {} at {} ms differs from NEST's multimeter by {} mV",
        ids[worst.2],
        times[worst.1],
        worst.0
    );

    // The rate table of the same run equals the rates of NEST's per-node spike counts.
    let counts =
        std::fs::read_to_string(reference("nest_point450_dt0.1_t1000_counts.csv")).unwrap();
    let mut per_type: BTreeMap<String, (usize, usize)> = BTreeMap::new();
    let mut total = 0usize;
    for line in counts.lines().skip(1) {
        let f: Vec<&str> = line.split(',').collect();
        let spikes: usize = f[4].parse().unwrap();
        let e = per_type.entry(format!("{} ({})", f[1], f[2])).or_default();
        e.0 += 1;
        e.1 += spikes;
        total += spikes;
    }
    let row = |g: RateGroup, name: &str| {
        s.rates
            .iter()
            .find(|r| r.group == g && r.name == name)
            .unwrap_or_else(|| panic!("no rate row {g:?} {name}: {:?}", s.rates))
    };
    for (g, name) in [(RateGroup::All, "all"), (RateGroup::Population, "v1")] {
        let r = row(g, name);
        assert_eq!((r.cells, r.spikes), (450, total));
        assert!((r.rate_hz - total as f64 / 450.0).abs() < 1e-12, "{r:?}");
    }
    assert_eq!(s.rates.len(), 2 + per_type.len());
    for (name, &(cells, spikes)) in &per_type {
        let r = row(RateGroup::NodeType, name);
        assert_eq!((r.cells, r.spikes), (cells, spikes), "{name}");
        assert!(
            (r.rate_hz - spikes as f64 / cells as f64).abs() < 1e-12,
            "{name}: {r:?}"
        );
    }
    // NEST's README: Scnn1a 100.9 Hz, LIF_inh 3.8 Hz.
    assert!((row(RateGroup::NodeType, "100 (Scnn1a)").rate_hz - 100.9).abs() < 0.05);
    assert!((row(RateGroup::NodeType, "106 (LIF_inh)").rate_hz - 3.8).abs() < 0.05);
}

#[test]
fn window_interval_node_ids_and_float32_select_nests_values() {
    let tmp = tempfile::tempdir().unwrap();
    let cfg = config(
        tmp.path(),
        300.0,
        json!({
            "window": {"cells": {"population": "v1", "node_id": [400, 3, 5, 3]},
                "variable_name": ["V_m"], "module": "membrane_report",
                "start_time": 100.0, "end_time": 300.0, "dt": 5.0, "file_name": "win.h5",
                "dtype": "float64"},
            "bmtk_names": {"cells": {"population": "v1", "node_ids": [7]}, "variable_name": "V_m",
                "module": "multimeter", "tstart": 0.5, "tstop": 2.0, "interval": 0.5,
                "dtype": "float64"},
            "single": {"cells": "v1", "variable_name": "V_m", "module": "multimeter_report",
                "end_time": 20.0, "dtype": "float32"},
            "off": {"cells": "v1", "variable_name": "V_m", "module": "multimeter_report",
                "enabled": false}
        }),
    );
    let s = simulate_config(&cfg, &SimulateOptions::default()).unwrap();
    let names: Vec<&str> = s.reports.iter().map(|r| r.name.as_str()).collect();
    assert_eq!(names, ["bmtk_names", "single", "window"]);
    assert!(!tmp.path().join("out/off.h5").exists());
    let (ids, times, vm) = nest_vm();
    let nest = |node: u64, t: f64| {
        let k = times.iter().position(|&x| x == t).unwrap();
        let c = ids.iter().position(|&i| i == node as i64).unwrap();
        vm[k * ids.len() + c]
    };

    let w = lockstep_sonata::read_report(tmp.path().join("out/win.h5")).unwrap();
    let p = w.population("v1").unwrap();
    assert_eq!(p.node_ids, [3, 5, 400]);
    // Multiples of 5 ms in (100, 300]: 105, 110, ..., 300.
    assert_eq!(p.time, [105.0, 305.0, 5.0]);
    assert_eq!(p.n_frames(), 40);
    for (k, t) in p.times().into_iter().enumerate() {
        if t < 1000.0 {
            for (c, &node) in p.node_ids.iter().enumerate() {
                let d = (p.data[k * 3 + c] - nest(node, t)).abs();
                assert!(d <= 1e-6, "node {node} at {t} ms: {d} mV from NEST");
            }
        }
    }

    // BMTK pointnet's names for the window; 0.5 ms is off NEST's 1 ms recording, so only the
    // frames at 1.0 and 2.0 ms have a NEST value.
    let b = lockstep_sonata::read_report(tmp.path().join("out/bmtk_names.h5")).unwrap();
    let p = b.population("v1").unwrap();
    assert_eq!(p.time, [1.0, 2.5, 0.5]);
    assert_eq!(p.trace(7).unwrap().len(), 3);
    assert!((p.trace(7).unwrap()[0] - nest(7, 1.0)).abs() <= 1e-6);
    assert!((p.trace(7).unwrap()[2] - nest(7, 2.0)).abs() <= 1e-6);

    // float32 for libsonata: NEST's values to single precision; default dt = run.dt.
    let f = lockstep_sonata::read_report(tmp.path().join("out/single.h5")).unwrap();
    let p = f.population("v1").unwrap();
    assert_eq!(p.n_frames(), 200);
    assert_eq!(p.node_ids.len(), 450);
    let k = p
        .times()
        .iter()
        .position(|&t| (t - 13.0).abs() < 1e-9)
        .unwrap();
    assert_eq!(p.data[k * 450 + 42], nest(42, 13.0) as f32 as f64);
}

#[test]
fn reports_that_cannot_be_made_are_refused_before_any_output() {
    let tmp = tempfile::tempdir().unwrap();
    let base = json!({"cells": "v1", "variable_name": "V_m", "module": "multimeter_report"});
    let cases: Vec<(Value, &str, &str)> = vec![
        (json!({"dt": 0.25}), "reports.m.dt", "multiple of run.dt"),
        (
            json!({"end_time": 400.0}),
            "reports.m.end_time",
            "after run.tstop",
        ),
        (
            json!({"start_time": 50.0, "end_time": 50.0}),
            "reports.m.start_time",
            "before end_time",
        ),
        (
            json!({"cells": "lgn"}),
            "reports.m.cells",
            "virtual (input) population",
        ),
        (
            json!({"cells": "v2"}),
            "reports.m.cells",
            "not a node population",
        ),
        (
            json!({"cells": {"population": "v1", "node_id": [450]}}),
            "reports.m.cells",
            "no node with id 450",
        ),
        (
            json!({"variable_name": "I_syn"}),
            "reports.m.variable_name",
            "'I_syn' is not recorded",
        ),
        (
            json!({"module": "netcon_report"}),
            "reports.m.module",
            "'netcon_report' is not supported",
        ),
        (
            json!({"file_name": "spikes.h5"}),
            "reports.m.file_name",
            "also the file of output.spikes_file",
        ),
    ];
    for (change, key, text) in cases {
        let mut r = base.clone();
        for (k, v) in change.as_object().unwrap() {
            r[k] = v.clone();
        }
        let cfg = config(tmp.path(), 300.0, json!({ "m": r }));
        let e = simulate_config(&cfg, &SimulateOptions::default()).unwrap_err();
        match &e {
            SnnError::Config(ConfigError {
                key: k, problem, ..
            }) => {
                assert_eq!(k, key, "{e}");
                assert!(problem.contains(text), "{e}");
            }
            other => panic!("expected a config error for {key}, got {other}"),
        }
        assert!(!tmp.path().join("out").exists(), "{key}: output written");
    }
}
