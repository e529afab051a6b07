//! `lockstep simulate` as a user runs it: the rate table, membrane reports (read by libsonata
//! in their default float32), warnings for report keys BMTK ignores, refused keys and trial
//! counts, and no progress bar when stderr is not a terminal.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use lockstep_testkit::{python, require_libsonata};
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
            "module": "multimeter_report", "sections": "soma", "interval": 1.0}}
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

/// libsonata (the SONATA reference reader) reads the spikes file of `simulate` (the `sorting`
/// enum) and a V_m report written with the default settings (float32 data, the spec's type),
/// with the same values h5py reads.
#[test]
fn libsonata_reads_the_spikes_and_a_default_membrane_report() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = config(dir.path(), |c| {
        c["run"]["tstop"] = json!(100.0);
    });
    let (out, text, err) = simulate(&cfg, &[]);
    assert!(out.status.success(), "{text}\n{err}");
    require_libsonata();
    let script = r#"
import sys, libsonata, h5py, numpy as np
d = sys.argv[1]
with h5py.File(d + "/spikes.h5", "r") as f:
    ids = f["spikes/v1/node_ids"][...]
    ts = f["spikes/v1/timestamps"][...]
p = libsonata.SpikeReader(d + "/spikes.h5")["v1"]
assert p.sorting == "by_time", p.sorting
got = p.get()
assert len(got) == len(ids) > 100, (len(got), len(ids))
assert [(int(i), float(t)) for i, t in got] == list(zip(ids.tolist(), ts.tolist()))
r = libsonata.SomaReportReader(d + "/membrane_potential.h5")
assert r.get_population_names() == ["v1"]
v = r["v1"]
assert v.times == (1.0, 101.0, 1.0), v.times
assert v.data_units == "mV" and v.time_units == "ms", (v.data_units, v.time_units)
frame = v.get()
with h5py.File(d + "/membrane_potential.h5", "r") as f:
    data = f["report/v1/data"]
    assert data.dtype == np.float32, data.dtype
    assert data.shape == (100, 450), data.shape
    assert np.array_equal(np.asarray(frame.data), data[...])
    assert list(frame.ids) == list(f["report/v1/mapping/node_ids"][...])
    assert list(frame.times) == [1.0 + k for k in range(100)]
print("ok")
"#;
    let out = python(script, &[dir.path().join("out").as_os_str()]);
    assert_eq!(out.trim(), "ok");
}

/// Report keys lockstep honours but BMTK's pointnet ignores (the SONATA names of the window)
/// are named in a warning with the key BMTK reads; BMTK's own names give none.
#[test]
fn report_keys_that_bmtk_ignores_are_warned_about() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = config(dir.path(), |c| {
        c["run"]["tstop"] = json!(10.0);
        c["reports"]["membrane_potential"] = json!({"cells": "v1", "variable_name": "V_m",
            "module": "multimeter_report", "dt": 1.0, "start_time": 2.0, "tstop": 8.0});
    });
    let (out, text, err) = simulate(&cfg, &[]);
    assert!(out.status.success(), "{text}\n{err}");
    assert!(
        text.contains("V_m of 450 cells, 6 frames (3 to 8 ms every 1 ms)"),
        "{text}"
    );
    for (key, bmtk) in [("dt", "interval"), ("start_time", "tstart")] {
        let line = err
            .lines()
            .find(|l| l.starts_with(&format!("warning: reports.membrane_potential.{key} ")))
            .unwrap_or_else(|| panic!("no warning for {key}: {err}"));
        assert!(
            line.contains("ignored by BMTK") && line.contains(&format!("\"{bmtk}\"")),
            "{line}"
        );
    }
    assert_eq!(err.lines().count(), 2, "{err}");
    // An off-grid window names the key as written.
    let cfg = config(dir.path(), |c| {
        c["run"]["tstop"] = json!(10.0);
        c["reports"]["membrane_potential"]["interval"] = json!(0.25);
    });
    let (out, _, err) = simulate(&cfg, &[]);
    assert!(!out.status.success());
    assert!(
        err.contains("reports.membrane_potential.interval") && err.contains("multiple of run.dt"),
        "{err}"
    );
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
