//! The `lockstep` binary as a user runs it.

use lockstep_comm::launch::mpirun_command;
use lockstep_comm::launch::run_with_limit;
use std::path::PathBuf;
use std::process::Command;
use std::time::Duration;

const LOCKSTEP: &str = env!("CARGO_BIN_EXE_lockstep");

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..")
}

#[test]
fn info_reports_every_rank_under_mpirun() {
    let mut cmd = mpirun_command(2);
    cmd.arg(LOCKSTEP)
        .arg("info")
        .env("CUDA_VISIBLE_DEVICES", "2,3");
    let out = run_with_limit(cmd, Duration::from_secs(30)).unwrap();
    assert!(out.success(), "{}", out.all_output());
    assert!(
        out.stdout.contains("communicator: mpi with 2 rank(s)"),
        "{}",
        out.stdout
    );
    // The models compute on CPU cores: the listed GPUs are not bound (and the chief warns).
    assert!(
        out.stdout.contains(
            "rank 1/2: launch Open MPI (mpirun), rank 1 of 2, node-local rank 1 of 2, device cpu"
        ),
        "{}",
        out.stdout
    );
    assert!(
        out.stderr
            .contains("CUDA_VISIBLE_DEVICES=\"2,3\" makes GPUs visible"),
        "{}",
        out.stderr
    );
}

#[test]
fn info_serial_and_a_gpu_list_that_cpu_models_do_not_read() {
    let out = Command::new(LOCKSTEP).arg("info").output().unwrap();
    assert!(out.status.success());
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("rank 0/1: launch serial"));
    // This machine's adapter is Mesa's lavapipe (CI has no GPU): listed and marked as software.
    let lavapipe = text
        .lines()
        .find(|l| l.contains("llvmpipe"))
        .unwrap_or_else(|| panic!("no lavapipe adapter listed:\n{text}"));
    assert!(
        lavapipe.ends_with("software: emulates a GPU on CPU cores"),
        "{lavapipe}"
    );
    let out = Command::new(LOCKSTEP)
        .arg("info")
        .env("CUDA_VISIBLE_DEVICES", "1,1")
        .output()
        .unwrap();
    // Only a GPU model reads the list (its errors: lockstep_comm::launch unit tests).
    assert!(out.status.success());
    assert!(String::from_utf8_lossy(&out.stdout).contains("device cpu"));
}

/// The README's simulate example, with the config path relative to the working directory.
#[test]
fn simulate_the_bundled_real_network() {
    let out = Command::new(LOCKSTEP)
        .current_dir(repo())
        .args(["simulate", "examples/point_450glifs/config.simulation.json"])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{text}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    // NEST 3.10 produced 19,263 spikes for this network, input, dt and duration.
    assert!(text.contains("19263 spikes"), "{text}");
    assert!(repo()
        .join("examples/point_450glifs/output/spikes.h5")
        .exists());
}

#[test]
fn plot_writes_pngs_from_a_run_directory() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::create_dir_all(dir.path().join("callbacks")).unwrap();
    std::fs::write(
        dir.path().join("callbacks/losses.csv"),
        "step,epoch,rate,voltage,total\n1,0,4.0e2,1.0e-3,4.00001e2\n2,0,2.0e2,2.0e-3,2.00002e2\n3,0,1.0e2,2.0e-3,1.00002e2\n",
    )
    .unwrap();
    let spikes =
        repo().join("examples/point_450glifs/reference/nest_point450_dt0.1_t1000.spikes.h5");
    let out = Command::new(LOCKSTEP)
        .arg("plot")
        .arg(dir.path())
        .arg("--spikes")
        .arg(&spikes)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    for f in ["plots/losses.png", "plots/raster.png"] {
        let bytes = std::fs::read(dir.path().join(f)).unwrap();
        assert_eq!(&bytes[1..4], b"PNG", "{f} is not a PNG");
        assert!(bytes.len() > 10_000, "{f} is suspiciously small");
    }
    // Values a log axis cannot show (inf, subnormal) are left out instead of hanging.
    std::fs::write(
        dir.path().join("callbacks/losses.csv"),
        "step,epoch,rate,total\n1,0,5,5\n2,0,inf,inf\n3,0,5e-324,1e-300\n",
    )
    .unwrap();
    let mut cmd = Command::new(LOCKSTEP);
    cmd.arg("plot").arg(dir.path());
    let out = run_with_limit(cmd, Duration::from_secs(20)).unwrap();
    assert!(out.success(), "{}", out.all_output());
    // A broken CSV is a clear error naming the file and line.
    std::fs::write(
        dir.path().join("callbacks/losses.csv"),
        "step,epoch,rate,total\n1,0,abc,1\n",
    )
    .unwrap();
    let out = Command::new(LOCKSTEP)
        .arg("plot")
        .arg(dir.path())
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("losses.csv line 2"));
}

/// `lockstep build-network` on the bundled recipe (into a fresh folder), the refusal to
/// overwrite, and a 1000 ms simulation of the result with 20 Hz Poisson input: active, not
/// saturated.
#[test]
fn build_network_then_simulate_it() {
    let dir = tempfile::tempdir().unwrap();
    let recipe = repo().join("examples/glif_all2all/network_recipe.json");
    let build = |extra: &[&str]| {
        Command::new(LOCKSTEP)
            .arg("build-network")
            .arg(&recipe)
            .arg("--output")
            .arg(dir.path())
            .args(extra)
            .output()
            .unwrap()
    };
    let out = build(&[]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{text}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(text.contains("edges v1_to_v1: 89700 edges"), "{text}");
    assert!(text.contains("edges lgn_to_v1: 30000 edges"), "{text}");
    assert!(dir.path().join("network/v1_v1_edges.h5").is_file());
    // existing output without --overwrite: refused, naming the file and the flag
    let out = build(&[]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(
        err.contains("already exists") && err.contains("--overwrite"),
        "{err}"
    );
    assert!(build(&["--overwrite"]).status.success());

    let sim = serde_json::json!({
        "manifest": {"$BASE_DIR": "."},
        "run": {"tstop": 1000.0, "dt": 0.1},
        "inputs": {"lgn": {"input_type": "poisson", "rate": 20.0, "node_set": "lgn", "seed": 1}},
        "output": {"output_dir": "$BASE_DIR/output", "spikes_file": "spikes.h5"},
        "network": "config.circuit.json"
    });
    let cfg = dir.path().join("config.simulate.json");
    std::fs::write(&cfg, sim.to_string()).unwrap();
    let out = Command::new(LOCKSTEP)
        .arg("simulate")
        .arg(&cfg)
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{text}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(text.contains("simulated 300 neurons"), "{text}");
    let n: f64 = text
        .split(": ")
        .nth(1)
        .and_then(|s| s.split(' ').next())
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("no spike count in: {text}"));
    let rate = n / 300.0;
    assert!((2.0..40.0).contains(&rate), "mean rate {rate} Hz: {text}");
}

/// `lockstep plot` draws a raster from a simulation output folder and from either spike file
/// lockstep writes (HDF5 or BMTK's CSV), without a losses.csv.
#[test]
fn plot_draws_a_raster_from_a_simulation_folder_or_a_spikes_csv() {
    let dir = tempfile::tempdir().unwrap();
    let reference =
        repo().join("examples/point_450glifs/reference/nest_point450_dt0.1_t1000.spikes.h5");
    let sim = dir.path().join("sim");
    std::fs::create_dir_all(&sim).unwrap();
    std::fs::copy(&reference, sim.join("spikes.h5")).unwrap();
    let csv_dir = dir.path().join("csv");
    std::fs::create_dir_all(&csv_dir).unwrap();
    let mut csv = String::from("timestamps population node_ids\n");
    for i in 0..400u64 {
        csv.push_str(&format!("{} v1 {}\n", i as f64 * 2.5, i % 50));
    }
    std::fs::write(csv_dir.join("spikes.csv"), csv).unwrap();
    for (arg, png) in [
        (sim.clone(), sim.join("plots/raster.png")),
        (csv_dir.clone(), csv_dir.join("plots/raster.png")),
        (csv_dir.join("spikes.csv"), csv_dir.join("plots/raster.png")),
    ] {
        let _ = std::fs::remove_file(&png);
        let out = Command::new(LOCKSTEP)
            .arg("plot")
            .arg(&arg)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{}: {}",
            arg.display(),
            String::from_utf8_lossy(&out.stderr)
        );
        let bytes = std::fs::read(&png).unwrap();
        assert_eq!(&bytes[1..4], b"PNG", "{}", png.display());
        assert!(
            bytes.len() > 10_000,
            "{} is suspiciously small",
            png.display()
        );
    }
    // `--plot-format svg` writes the raster as SVG (vector graphics), with its labels; an
    // unknown format is refused naming the option and the value, before anything is written.
    let out = Command::new(LOCKSTEP)
        .arg("plot")
        .arg(&csv_dir)
        .args(["--plot-format", "pdf"])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && err.contains("--plot-format") && err.contains("'pdf'"),
        "{err}"
    );
    let svg = csv_dir.join("plots/raster.svg");
    assert!(!svg.exists());
    let out = Command::new(LOCKSTEP)
        .arg("plot")
        .arg(&csv_dir)
        .args(["--plot-format", "svg"])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let script = r#"
import sys, json, xml.etree.ElementTree as ET
root = ET.parse(sys.argv[1]).getroot()
assert root.tag == "{http://www.w3.org/2000/svg}svg", root.tag
print(json.dumps([(t.text or "").strip() for t in root.iter("{http://www.w3.org/2000/svg}text")]))
"#;
    let texts: Vec<String> =
        serde_json::from_str(lockstep_testkit::python(script, &[svg.as_os_str()]).trim()).unwrap();
    for want in ["spikes: v1 (400 spikes)", "time (ms)", "node id", "200.0"] {
        assert!(texts.iter().any(|t| t == want), "{want} not in {texts:?}");
    }
    // A folder with nothing to plot says what it looked for.
    let empty = dir.path().join("empty");
    std::fs::create_dir_all(&empty).unwrap();
    let out = Command::new(LOCKSTEP)
        .arg("plot")
        .arg(&empty)
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && err.contains("spikes.csv"), "{err}");
}

/// A fresh clone has no sibling folders: `lockstep bench simulate` runs from a copy of the
/// repository's 450-cell example alone (no `../shared`, no v1_scale build, no NEST),
/// compares with the NEST reference stored in the repository and agrees spike for spike.
#[test]
fn bench_simulate_runs_from_a_lone_copy_of_the_examples() {
    /// Copies a folder of the repository, without the outputs of earlier runs.
    fn copy(src: &std::path::Path, dst: &std::path::Path) {
        std::fs::create_dir_all(dst).unwrap();
        for e in std::fs::read_dir(src).unwrap() {
            let p = e.unwrap().path();
            let name = p.file_name().unwrap();
            if p.is_dir() && !["output", "runs"].contains(&name.to_str().unwrap()) {
                copy(&p, &dst.join(name));
            } else if p.is_file() {
                std::fs::copy(&p, dst.join(name)).unwrap();
            }
        }
    }
    let dir = tempfile::tempdir().unwrap();
    let clone = dir.path().join("lockstep");
    for ex in ["point_450glifs", "point_components"] {
        copy(
            &repo().join("examples").join(ex),
            &clone.join("examples").join(ex),
        );
    }
    let mut cmd = Command::new(LOCKSTEP);
    cmd.current_dir(&clone)
        .args(["bench", "simulate", "--repeats", "1", "--python"])
        .arg(dir.path().join("no-python-here"));
    let out = run_with_limit(cmd, Duration::from_secs(120)).unwrap();
    assert!(out.success(), "{}", out.all_output());
    let row = out
        .stdout
        .lines()
        .find(|l| l.trim_start().starts_with("point_450glifs"))
        .unwrap_or_else(|| panic!("no point_450glifs row: {}", out.stdout));
    assert!(
        row.contains("19263    19263 19263 (100.00%)"),
        "{row}\n{}",
        out.stdout
    );
    assert!(
        out.stdout
            .contains("NEST figures are the stored NEST 3.10.0 time"),
        "{}",
        out.stdout
    );
    assert!(out.stdout.contains("v1_scale tenth: not built"));
}

/// Writes an N-body config of `n` particles in a uniform cube (G = 1, FMM, softening 0.05)
/// over `(t_end, steps)` with the `output` section.
fn write_cube(
    path: &std::path::Path,
    n: u64,
    (t_end, steps): (f64, u64),
    output: serde_json::Value,
) {
    let cfg = serde_json::json!({
        "units": {"gravitational_constant": 1.0},
        "initial_conditions": {"kind": "uniform_cube", "n": n, "box_size": 1.0,
                               "velocity_dispersion": 0.1, "seed": 3},
        "forces": {"method": "fmm", "softening": 0.05},
        "time": {"t_start": 0.0, "t_end": t_end, "steps": steps},
        "output": output
    });
    std::fs::write(path, cfg.to_string()).unwrap();
}

/// `lockstep nbody` without `output.dir` writes into `./nbody_output` of the working
/// directory (not beside the config, which may sit in the source tree) and ends by printing
/// where it wrote.
#[test]
fn nbody_writes_into_the_working_directory_and_says_where() {
    let dir = tempfile::tempdir().unwrap();
    let configs = dir.path().join("configs");
    let work = dir.path().join("work");
    std::fs::create_dir_all(&configs).unwrap();
    std::fs::create_dir_all(&work).unwrap();
    let cfg = configs.join("cube.json");
    write_cube(&cfg, 200, (0.01, 4), serde_json::json!({"every": 2}));
    let mut cmd = Command::new(LOCKSTEP);
    cmd.current_dir(&work).arg("nbody").arg(&cfg);
    let out = run_with_limit(cmd, Duration::from_secs(60)).unwrap();
    assert!(out.success(), "{}", out.all_output());
    let written = std::path::absolute(work.join("nbody_output")).unwrap();
    assert!(
        out.stdout
            .contains(&format!("Outputs in {}", written.display())),
        "{}",
        out.stdout
    );
    assert!(written.join("diagnostics.csv").is_file());
    assert!(!configs.join("nbody_output").exists());
}

/// A refusal every rank learns before the work begins ends an MPI job cleanly: the reason
/// printed once, by rank 0, first, and no `MPI_ABORT` report from the launcher.
fn refused_cleanly(out: &lockstep_comm::launch::JobOutput, reason: &str) {
    let all = out.all_output();
    assert!(!out.success() && !out.timed_out, "{all}");
    assert!(!all.contains("MPI_ABORT"), "aborted:\n{all}");
    assert_eq!(all.matches("lockstep: error on rank").count(), 1, "{all}");
    let first = out
        .stderr
        .lines()
        .find(|l| l.contains("lockstep:"))
        .unwrap_or("");
    assert!(
        first.contains("lockstep: error on rank 0") && first.contains(reason),
        "{all}"
    );
}

/// Issue 60: `mpirun -n 2 lockstep nbody` into an existing output folder and
/// `mpirun -n 2 lockstep train --resume` of a finished run are refused without an abort.
#[test]
fn refusals_under_mpirun_end_without_an_abort() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = dir.path().join("cube.json");
    let out_dir = dir.path().join("snapshots");
    write_cube(
        &cfg,
        200,
        (0.01, 2),
        serde_json::json!({"every": 2, "dir": out_dir.to_str().unwrap()}),
    );
    let nbody = || {
        let mut cmd = mpirun_command(2);
        cmd.arg(LOCKSTEP).arg("nbody").arg(&cfg);
        run_with_limit(cmd, Duration::from_secs(60)).unwrap()
    };
    let first = nbody();
    assert!(first.success(), "{}", first.all_output());
    refused_cleanly(&nbody(), "exists and is not empty");

    let run = dir.path().join("glif");
    let config = repo().join("examples/glif_all2all/config.mpi.json");
    let train = |extra: &[&str]| {
        let mut cmd = mpirun_command(2);
        cmd.arg(LOCKSTEP)
            .arg("train")
            .arg(&config)
            .args(["--updates", "1", "--output-dir", run.to_str().unwrap()])
            .args(extra);
        run_with_limit(cmd, Duration::from_secs(120)).unwrap()
    };
    let done = train(&[]);
    assert!(done.success(), "{}", done.all_output());
    refused_cleanly(
        &train(&["--resume", run.to_str().unwrap()]),
        "already has 1 update",
    );
}

/// Quick-try overrides of `lockstep nbody` (`--n`, `--steps`: the first steps of the time
/// array), and progress lines on stderr when it is not a terminal (issue 60).
#[test]
fn nbody_quick_try_overrides_and_progress_lines() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = dir.path().join("cube.json");
    write_cube(&cfg, 5000, (1.0, 1000), serde_json::json!({"every": 100}));
    let mut cmd = Command::new(LOCKSTEP);
    cmd.current_dir(dir.path())
        .arg("nbody")
        .arg(&cfg)
        .args(["--n", "300", "--steps", "20"]);
    let out = run_with_limit(cmd, Duration::from_secs(60)).unwrap();
    assert!(out.success(), "{}", out.all_output());
    assert!(
        out.stdout
            .contains("lockstep nbody: 300 particles on 1 rank(s), 20 steps"),
        "{}",
        out.stdout
    );
    for k in [2, 10, 18] {
        assert!(
            out.stderr
                .contains(&format!("lockstep nbody: step {k}/20 (")),
            "{}",
            out.stderr
        );
    }
    // The last step (20 < every 100) is an output: the time reached is 20 steps of 1e-3.
    let csv = std::fs::read_to_string(dir.path().join("nbody_output/diagnostics.csv")).unwrap();
    assert_eq!(csv.lines().count(), 3, "{csv}");
    let bad = Command::new(LOCKSTEP)
        .current_dir(dir.path())
        .arg("nbody")
        .arg(&cfg)
        .args(["--steps", "0"])
        .output()
        .unwrap();
    assert!(!bad.status.success());
    assert!(String::from_utf8_lossy(&bad.stderr).contains("--steps 0"));
}

/// `lockstep bench nbody --device gpu` on the machine's adapter (lavapipe in CI): the GPU FMM,
/// the CPU FMM and direct sums on the GPU in one table, with the split and the H200 model;
/// with `--no-cpu-fmm` the GPU rows only; `--ranks 1,2` the sharded FMM with two thread ranks sharing the adapter.
#[test]
fn bench_nbody_on_the_gpu_prints_its_rows_and_the_sharded_ranks() {
    let run = |args: &[&str]| {
        let mut cmd = Command::new(LOCKSTEP);
        cmd.args([
            "bench",
            "nbody",
            "--device",
            "gpu",
            "--order",
            "3",
            "--repeats",
            "1",
        ])
        .args(args);
        let out = run_with_limit(cmd, Duration::from_secs(180)).unwrap();
        assert!(out.success(), "{}", out.all_output());
        out.stdout
    };
    let text = run(&["--sizes", "3000", "--direct-sizes", "800", "--no-fmm3d"]);
    let has_row = |method: &str, n: &str| {
        text.lines()
            .any(|l| l.starts_with(method) && l.split_whitespace().nth(2) == Some(n))
    };
    assert!(
        has_row("fmm gpu", "3000") && has_row("fmm cpu", "3000"),
        "{text}"
    );
    assert!(has_row("direct gpu", "800"), "{text}");
    for want in [
        "split (s): device tree ",
        ", device walk ",
        "H200 model (not measured",
    ] {
        assert!(text.contains(want), "no {want:?} in\n{text}");
    }
    // --no-cpu-fmm (what the GPU script runs at N = 1e8): the GPU row and its model only.
    let gpu_only = run(&[
        "--sizes",
        "2000",
        "--direct-sizes",
        "0",
        "--no-fmm3d",
        "--no-cpu-fmm",
    ]);
    let starts = |method: &str| gpu_only.lines().any(|l| l.starts_with(method));
    assert!(starts("fmm gpu") && !starts("fmm cpu"), "{gpu_only}");
    assert!(gpu_only.contains("H200 model (not measured"), "{gpu_only}");
    let text = run(&["--ranks", "1,2", "--n", "3000"]);
    let rows: Vec<&str> = text.lines().filter(|l| l.contains(" 3000 ")).collect();
    assert_eq!(rows.len(), 2, "{text}");
    assert!(
        rows[0].trim_start().starts_with("1 ") && rows[0].ends_with("[0]"),
        "{text}"
    );
    assert!(
        rows[1].trim_start().starts_with("2 ") && rows[1].contains("shared"),
        "{text}"
    );
}
