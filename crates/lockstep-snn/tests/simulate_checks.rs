//! What `lockstep simulate` refuses before it touches any output: unknown keys (in `run`,
//! `output` and at the top level, with the nearest known key) and runs that cannot fit in
//! memory (the previous output stays as it was).

use std::path::{Path, PathBuf};

use lockstep_core::config::ConfigError;
use lockstep_snn::{simulate_config, SimulateOptions, SnnError};
use serde_json::{json, Value};

fn examples() -> PathBuf {
    std::fs::canonicalize(concat!(env!("CARGO_MANIFEST_DIR"), "/../../examples")).unwrap()
}

/// The bundled 450-cell simulation writing to `dir/out`, with `edit` applied to the config.
fn config(dir: &Path, edit: impl FnOnce(&mut Value)) -> PathBuf {
    let base = examples().join("point_450glifs");
    let mut cfg = json!({
        "manifest": {"$OUT": dir.join("out").to_str().unwrap()},
        "target_simulator": "NEST",
        "run": {"tstop": 50.0, "dt": 1.0},
        "network": base.join("config.circuit.json").to_str().unwrap(),
        "inputs": {"LGN_spikes": {"input_type": "spikes", "module": "sonata",
            "input_file": base.join("inputs/lgn_spikes.h5").to_str().unwrap(), "node_set": "lgn"}},
        "output": {"output_dir": "$OUT", "spikes_file": "spikes.h5", "log_file": "log.txt",
            "overwrite_output_dir": true},
    });
    edit(&mut cfg);
    let path = dir.join("config.simulation.json");
    std::fs::write(&path, serde_json::to_string_pretty(&cfg).unwrap()).unwrap();
    path
}

fn config_error(e: &SnnError) -> (&str, &str) {
    match e {
        SnnError::Config(ConfigError { key, problem, .. }) => (key.as_str(), problem.as_str()),
        other => panic!("expected a config error, got {other}"),
    }
}

#[test]
fn unknown_keys_in_run_output_and_top_level_are_refused_with_the_nearest_key() {
    let tmp = tempfile::tempdir().unwrap();
    // (section, key, value, the key in the error, what the error says)
    let cases = [
        (
            "run",
            "tsop",
            json!(100.0),
            "run.tsop",
            "did you mean `tstop`?",
        ),
        (
            "output",
            "spike_file",
            json!("s.h5"),
            "output.spike_file",
            "did you mean `spikes_file`?",
        ),
        (
            "",
            "reprots",
            json!({}),
            "reprots",
            "did you mean `reports`?",
        ),
        ("", "training", json!({}), "training", "lockstep train"),
    ];
    for (section, k, v, key, text) in cases {
        let cfg = config(tmp.path(), |c| match section {
            "" => c[k] = v,
            s => c[s][k] = v,
        });
        let e = simulate_config(&cfg, &SimulateOptions::default()).unwrap_err();
        let (k, problem) = config_error(&e);
        assert_eq!(k, key, "{e}");
        assert!(problem.contains(text), "{e}");
        assert!(!tmp.path().join("out").exists(), "{key}: output written");
    }
    // The same config without the typo runs.
    let cfg = config(tmp.path(), |_| {});
    simulate_config(&cfg, &SimulateOptions::default()).unwrap();
    assert!(tmp.path().join("out/spikes.h5").is_file());
}

/// Every file under `dir` with its bytes.
fn snapshot(dir: &Path) -> Vec<(PathBuf, Vec<u8>)> {
    let mut out: Vec<(PathBuf, Vec<u8>)> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| {
            let p = e.unwrap().path();
            let bytes = std::fs::read(&p).unwrap();
            (p, bytes)
        })
        .collect();
    out.sort();
    out
}

#[test]
fn a_run_that_cannot_fit_in_memory_is_refused_and_the_previous_output_kept() {
    let tmp = tempfile::tempdir().unwrap();
    let report = json!({"membrane_potential": {"cells": "v1", "variable_name": "V_m",
        "module": "multimeter_report", "dt": 1.0}});
    let r = report.clone();
    let cfg = config(tmp.path(), |c| c["reports"] = r);
    simulate_config(&cfg, &SimulateOptions::default()).unwrap();
    let before = snapshot(&tmp.path().join("out"));
    assert!(before
        .iter()
        .any(|(p, _)| p.ends_with("membrane_potential.h5")));

    // 4e9 steps of 1 ms with V_m of 450 cells every step: about 14 TB of report alone.
    let cfg = config(tmp.path(), |c| {
        c["run"]["tstop"] = json!(4.0e9);
        c["reports"] = report;
    });
    let e = simulate_config(&cfg, &SimulateOptions::default()).unwrap_err();
    assert!(matches!(e, SnnError::Memory(_)), "{e}");
    let msg = e.to_string();
    for part in [
        "this simulation needs about",
        "report 'membrane_potential' (4000000000 frames x 450 cells)",
        "memory is available",
        "run.tstop",
        "run.dt",
        "reports.membrane_potential.cells",
        "reports.membrane_potential.dt",
    ] {
        assert!(msg.contains(part), "missing {part:?} in: {msg}");
    }
    assert_eq!(snapshot(&tmp.path().join("out")), before);
    for e in std::fs::read_dir(tmp.path()).unwrap() {
        let name = e.unwrap().file_name().to_string_lossy().to_string();
        assert!(
            !name.starts_with(".lockstep-simulate-"),
            "{name} left behind"
        );
    }

    // Many trials multiply the state; the key is named.
    let cfg = config(tmp.path(), |c| c["run"]["tstop"] = json!(4.0e9));
    let e = simulate_config(
        &cfg,
        &SimulateOptions {
            batch: 64,
            ..SimulateOptions::default()
        },
    )
    .unwrap_err();
    assert!(e.to_string().contains("--trials"), "{e}");
    assert_eq!(snapshot(&tmp.path().join("out")), before);
}
