//! `lockstep simulate` as a user runs it: the rate table, membrane reports, refused keys and
//! trial counts, and no progress bar when stderr is not a terminal.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use serde_json::{json, Value};

const LOCKSTEP: &str = env!("CARGO_BIN_EXE_lockstep");

fn examples() -> PathBuf {
    std::fs::canonicalize(concat!(env!("CARGO_MANIFEST_DIR"), "/../../examples")).unwrap()
}

/// The bundled 450-cell simulation (NEST's reference settings) with `reports`, into `dir/out`.
fn config(dir: &Path, edit: impl FnOnce(&mut Value)) -> PathBuf {
    let base = examples().join("point_450glifs");
    let mut cfg = json!({
        "manifest": {"$OUT": dir.join("out").to_str().unwrap()},
        "target_simulator": "NEST",
        "run": {"tstop": 1000.0, "dt": 0.1},
        "network": base.join("config.circuit.json").to_str().unwrap(),
        "inputs": {"LGN_spikes": {"input_type": "spikes", "module": "sonata",
            "input_file": base.join("inputs/lgn_spikes.h5").to_str().unwrap(), "node_set": "lgn"}},
        "output": {"output_dir": "$OUT", "spikes_file": "spikes.h5", "overwrite_output_dir": true},
        "reports": {"membrane_potential": {"cells": "v1", "variable_name": "V_m",
            "module": "multimeter_report", "sections": "soma", "dt": 1.0}}
    });
    edit(&mut cfg);
    let path = dir.join("config.simulation.json");
    std::fs::write(&path, serde_json::to_string_pretty(&cfg).unwrap()).unwrap();
    path
}

fn simulate(cfg: &Path, extra: &[&str]) -> (Output, String, String) {
    let out = Command::new(LOCKSTEP)
        .arg("simulate")
        .arg(cfg)
        .args(extra)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    (out, stdout, stderr)
}

/// The row of `name` in the printed rate table: `(cells, spikes, rate)`.
fn rate_row(text: &str, group: &str, name: &str) -> (usize, usize, f64) {
    let line = text
        .lines()
        .find(|l| l.starts_with(group) && l[11..].trim_start().starts_with(name))
        .unwrap_or_else(|| panic!("no row {group} {name} in:\n{text}"));
    let f: Vec<&str> = line.split_whitespace().collect();
    let n = f.len();
    (
        f[n - 3].parse().unwrap(),
        f[n - 2].parse().unwrap(),
        f[n - 1].parse().unwrap(),
    )
}

#[test]
fn simulate_prints_nests_rates_and_writes_the_membrane_report() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = config(dir.path(), |_| {});
    let (out, text, err) = simulate(&cfg, &[]);
    assert!(out.status.success(), "{text}\n{err}");
    // stderr is a pipe here: no progress bar, nothing else either.
    assert!(err.is_empty(), "unexpected stderr: {err}");
    assert!(text.contains("19263 spikes"), "{text}");
    let report = dir.path().join("out/membrane_potential.h5");
    assert!(
        text.contains(&format!(
            "report 'membrane_potential': V_m of 450 cells, 1000 frames (1 to 1000 ms every 1 ms): {}",
            report.display()
        )),
        "{text}"
    );
    assert!(report.is_file());
    // NEST 3.10's mean rates (reference README): all 19,263 spikes of 450 cells in 1 s.
    assert_eq!(rate_row(&text, "all", "all"), (450, 19263, 42.807));
    assert_eq!(rate_row(&text, "population", "v1"), (450, 19263, 42.807));
    for (name, cells, rate) in [
        ("100 (Scnn1a)", 80, 100.9),
        ("101 (Rorb)", 80, 37.9),
        ("102 (Nr5a1)", 80, 35.4),
        ("103 (PV1)", 30, 48.9),
        ("104 (PV2)", 30, 90.3),
        ("105 (LIF_exc)", 75, 11.5),
        ("106 (LIF_inh)", 75, 3.8),
    ] {
        let (c, s, r) = rate_row(&text, "node type", name);
        assert_eq!(c, cells, "{name}");
        assert!((r - s as f64 / c as f64).abs() < 1e-3, "{name}: {r}");
        assert!((r - rate).abs() < 0.05, "{name}: {r} Hz, NEST {rate} Hz");
    }
}

#[test]
fn zero_trials_and_unknown_keys_are_refused_before_any_output() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = config(dir.path(), |_| {});
    let (out, _, err) = simulate(&cfg, &["--trials", "0"]);
    assert!(!out.status.success());
    assert!(
        err.contains("--trials 0: a simulation runs at least 1 trial"),
        "{err}"
    );
    assert!(!dir.path().join("out").exists());

    for (edit, text) in [
        (
            json!({"run": {"tstop": 10.0, "dt": 0.1, "tsop": 10.0}}),
            "run.tsop: unknown key `tsop`; did you mean `tstop`?",
        ),
        (
            json!({"output": {"output_dir": "x", "spike_file": "s.h5"}}),
            "output.spike_file: unknown key `spike_file`; did you mean `spikes_file`?",
        ),
        (
            json!({"report": {}}),
            "report: unknown key `report`; did you mean `reports`?",
        ),
    ] {
        let cfg = config(dir.path(), |c| {
            for (k, v) in edit.as_object().unwrap() {
                c[k] = v.clone();
            }
        });
        let (out, _, err) = simulate(&cfg, &[]);
        assert!(!out.status.success());
        assert!(err.contains(cfg.to_str().unwrap()), "{err}");
        assert!(err.contains(text), "{err}");
        assert!(!dir.path().join("out").exists());
    }
}

/// On a terminal `simulate` shows a progress bar of the trial steps (issue 18, item 8). The
/// terminal is a pseudo-terminal from util-linux's `script` (package bsdutils, essential on
/// Debian and Ubuntu).
#[test]
fn simulate_shows_a_progress_bar_on_a_terminal() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = config(dir.path(), |_| {});
    let command = format!("'{LOCKSTEP}' simulate '{}' --trials 3", cfg.display());
    let out = Command::new("script")
        .args(["-q", "-e", "-c", &command, "/dev/null"])
        .output()
        .expect("`script` (util-linux, package bsdutils) runs the command on a pseudo-terminal");
    let text = String::from_utf8_lossy(&out.stdout).replace('\r', "\n");
    assert!(out.status.success(), "{text}");
    // 3 trials x 10,000 steps, advanced in chunks while the trials run.
    let positions: Vec<u64> = text
        .lines()
        .filter_map(|l| l.split("step ").nth(1)?.split('/').next()?.parse().ok())
        .collect();
    assert!(text.contains("/30000"), "no progress bar: {text}");
    assert!(
        positions.iter().any(|&p| p > 0 && p < 30000),
        "the bar never advanced: {positions:?}"
    );
    assert!(text.contains("19263 spikes"), "{text}");
}
