//! `lockstep bench simulate`: the NEST-exact forward simulation (lockstep-snn) against NEST
//! itself, on the same network, input, dt and duration, in the same invocation.
//!
//! Cases: BMTK's 450-cell `point_450glifs` with its real LGN input (dt 0.1 ms, 1000 ms; the
//! network of the stored NEST 3.10 reference), and, when it has been built, the tenth-scale
//! V1 network of `examples/v1_scale` (6,667 cells, 2.4M recurrent edges) driven by seeded
//! 15 Hz Poisson LGN spikes written to a spike file both simulators read (dt 0.1 ms, 500 ms),
//! where event delivery dominates. NEST runs through `scripts/peers/nest_sonata.py` (embedded
//! in the binary) with the Python given by `--python` when that Python can import `nest`
//! (PyPI `nest-simulator`) and `h5py`; otherwise the 450-cell case falls back to NEST's time
//! and spikes stored with the reference, labelled as such. Both run one trial on one thread,
//! in rounds that alternate the two simulators (`--repeats`); each reports its best round.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use lockstep_core::rng::{SplitMix64, GOLDEN_GAMMA};
use lockstep_snn::{
    network_spec_from_circuit, simulate, spike_trains_for_virtual_nodes, InputSpec, SimOptions,
};
use lockstep_sonata::{Circuit, PopulationSpikes, SpikeSorting, SpikeTrains};
use serde_json::{json, Value};

/// The NEST side of the benchmark (BMTK `pointnet` mapping, read with h5py).
const NEST_SCRIPT: &str = include_str!("../../../../scripts/peers/nest_sonata.py");

/// Options of `lockstep bench simulate`.
#[derive(Debug, clap::Args)]
pub struct BenchSimulateArgs {
    /// The repository's `examples` folder (point_450glifs with its NEST reference; the
    /// v1_scale tenth-scale network when built).
    #[arg(long, default_value = "examples")]
    pub examples: PathBuf,
    /// Python that can import `nest` (pip install nest-simulator==3.10.0 h5py) to run NEST
    /// in the same invocation.
    #[arg(long, default_value = "python3")]
    pub python: String,
    /// Rounds per case; each round runs lockstep (build and simulate) once and then NEST
    /// (build and simulate) once, and each simulator's best build and best simulation are
    /// reported.
    #[arg(allow_negative_numbers = true, long, default_value_t = 5)]
    pub repeats: usize,
}

/// One case's figures.
#[derive(Debug, Clone, PartialEq)]
struct CaseReport {
    name: String,
    cells: usize,
    edges: usize,
    steps: usize,
    build_s: f64,
    simulate_s: f64,
    syn_events: u64,
    /// lockstep's spikes as (SONATA node id, time in ms).
    spikes: Vec<(u64, f64)>,
    nest: Option<NestFigures>,
}

/// NEST's figures for a case.
#[derive(Debug, Clone, PartialEq)]
struct NestFigures {
    /// Where the figures come from ("NEST 3.10.0, this run" or "stored ...").
    source: String,
    build_s: f64,
    simulate_s: f64,
    /// NEST's spikes (node id, ms), when it ran in this invocation.
    spikes: Option<Vec<(u64, f64)>>,
}

/// A network, its input spike file and the run settings.
struct Case {
    name: String,
    circuit_config: PathBuf,
    input_file: PathBuf,
    input_population: String,
    dt: f64,
    tstop: f64,
}

/// Runs the benchmark and prints its report.
///
/// Errors: the examples folder lacks `point_450glifs`, a network cannot be read, or NEST
/// fails after it could be imported (its output is shown).
pub fn run(args: &BenchSimulateArgs) -> Result<()> {
    let p450 = args.examples.join("point_450glifs");
    if !p450.join("config.circuit.json").is_file() {
        bail!(
            "'{}' has no point_450glifs/config.circuit.json: run from the repository root or pass --examples DIR",
            args.examples.display()
        );
    }
    let tmp = tempfile::tempdir().context("creating a temporary folder for the benchmark")?;
    let mut cases = vec![Case {
        name: "point_450glifs".into(),
        circuit_config: p450.join("config.circuit.json"),
        input_file: p450.join("inputs/lgn_spikes.h5"),
        input_population: "lgn".into(),
        dt: 0.1,
        tstop: 1000.0,
    }];
    let tenth = args.examples.join("v1_scale/tenth/config.circuit.json");
    if tenth.is_file() {
        let input_file = tmp.path().join("v1_tenth_lgn_spikes.h5");
        write_poisson_input(&tenth, "lgn", 15.0, 500.0, 7, &input_file)?;
        cases.push(Case {
            name: "v1_scale tenth".into(),
            circuit_config: tenth,
            input_file,
            input_population: "lgn".into(),
            dt: 0.1,
            tstop: 500.0,
        });
    }
    let nest_ok = nest_importable(&args.python);
    let rounds = args.repeats.max(1);
    let mut reports = Vec::new();
    for case in &cases {
        // Rounds alternate the two simulators, so that both meet the same machine (its
        // speed drifts by tens of percent within minutes); each reports its best round.
        let mut r: Option<CaseReport> = None;
        let mut nest: Option<NestFigures> = None;
        for _ in 0..rounds {
            // lockstep builds and simulates once per round, as NEST does.
            let prepared = prepare_lockstep(case)?;
            let this = simulate_lockstep(case, &prepared);
            r = Some(match r {
                Some(mut best) => {
                    let build_s = best.build_s.min(this.build_s);
                    if this.simulate_s < best.simulate_s {
                        best = this;
                    }
                    best.build_s = build_s;
                    best
                }
                None => this,
            });
            if nest_ok {
                let n = run_nest(case, &args.python, tmp.path())?;
                nest = Some(match nest {
                    Some(mut best) => {
                        best.build_s = best.build_s.min(n.build_s);
                        best.simulate_s = best.simulate_s.min(n.simulate_s);
                        best
                    }
                    None => n,
                });
            }
        }
        let mut r = r.context("no round ran")?;
        r.nest = if nest_ok {
            nest.map(|mut n| {
                n.source = format!("{} (best of {rounds} rounds)", n.source);
                n
            })
        } else if case.name == "point_450glifs" {
            Some(stored_nest(&p450)?)
        } else {
            None
        };
        reports.push(r);
    }
    print_report(
        &reports,
        nest_ok,
        &args.python,
        tenth_missing(&args.examples),
    );
    Ok(())
}

fn tenth_missing(examples: &Path) -> bool {
    !examples
        .join("v1_scale/tenth/config.circuit.json")
        .is_file()
}

/// lockstep's network and inputs for `case`, and the time it took to read and compile them.
struct PreparedCase {
    spec: lockstep_snn::NetworkSpec,
    net: lockstep_snn::Network,
    inputs: lockstep_snn::Inputs,
    steps: usize,
    build_s: f64,
}

/// Reads and compiles `case` for lockstep (timed: the build figure).
fn prepare_lockstep(case: &Case) -> Result<PreparedCase> {
    let t0 = Instant::now();
    let circuit = Circuit::from_config(&case.circuit_config)?;
    let spec = network_spec_from_circuit(&circuit)?;
    let spikes = lockstep_sonata::read_spikes(&case.input_file)?;
    let trains = spike_trains_for_virtual_nodes(
        &spec,
        &spikes,
        &case.input_file.display().to_string(),
        Some(&case.input_population),
    )?;
    let net = spec.compile(case.dt)?;
    let steps = net.grid.run_steps(case.tstop)?;
    let inputs = InputSpec {
        spike_trains: Some(trains),
        poisson: None,
    }
    .compile(&case.input_population, net.n_virtual(), &net.grid, steps)?;
    Ok(PreparedCase {
        spec,
        net,
        inputs,
        steps,
        build_s: t0.elapsed().as_secs_f64(),
    })
}

/// Simulates one trial of the prepared case with lockstep (timed).
fn simulate_lockstep(case: &Case, p: &PreparedCase) -> CaseReport {
    let t = Instant::now();
    let out = simulate(&p.net, &p.inputs, p.steps, 1, 0, &SimOptions::default());
    let simulate_s = t.elapsed().as_secs_f64();
    let trial = out.trials.first();
    let spikes = trial.map_or_else(Vec::new, |t| {
        t.spikes
            .iter()
            .map(|&(step, n)| {
                (
                    p.spec.neurons[n as usize].node_id,
                    (step as f64 + 1.0) * case.dt,
                )
            })
            .collect()
    });
    CaseReport {
        name: case.name.clone(),
        cells: p.net.n_neurons(),
        edges: p.spec.recurrent_edges.len() + p.spec.input_edges.len(),
        steps: p.steps,
        build_s: p.build_s,
        simulate_s,
        syn_events: trial.map_or(0, |t| t.syn_events),
        spikes,
        nest: None,
    }
}

/// Whether `python` can import NEST and h5py.
fn nest_importable(python: &str) -> bool {
    Command::new(python)
        .args(["-c", "import nest, h5py"])
        .env("PYNEST_QUIET", "1")
        .output()
        .is_ok_and(|o| o.status.success())
}

/// Runs NEST once on `case` through the embedded peer script (build and simulate).
fn run_nest(case: &Case, python: &str, tmp: &Path) -> Result<NestFigures> {
    let circuit = Circuit::from_config(&case.circuit_config)?;
    let comps = &circuit.config.components;
    let dir_of = |p: &Option<PathBuf>, what: &str| {
        p.clone()
            .with_context(|| format!("{}: no components.{what}", case.circuit_config.display()))
    };
    let virtual_pop: Vec<&str> = circuit
        .nodes
        .iter()
        .filter(|p| !p.is_virtual)
        .map(|p| p.name.as_str())
        .collect();
    let [record] = virtual_pop[..] else {
        bail!(
            "the NEST comparison expects one non-virtual population in {}",
            case.circuit_config.display()
        );
    };
    let mut nodes = Vec::new();
    for p in &circuit.nodes {
        let e = circuit.config.nodes.iter().find(|e| e.nodes_file == p.file);
        let e = e.with_context(|| format!("no nodes entry for '{}'", p.file.display()))?;
        nodes.push(json!({"file": p.file, "types": e.node_types_file, "population": p.name}));
    }
    let mut edges = Vec::new();
    for p in &circuit.edges {
        let e = circuit.config.edges.iter().find(|e| e.edges_file == p.file);
        let e = e.with_context(|| format!("no edges entry for '{}'", p.file.display()))?;
        edges.push(json!({"file": p.file, "types": e.edge_types_file, "population": p.name}));
    }
    let spec = json!({
        "dt": case.dt, "tstop": case.tstop, "threads": 1, "nodes": nodes, "edges": edges,
        "cell_models_dir": dir_of(&comps.point_neuron_models_dir, "point_neuron_models_dir")?,
        "synaptic_models_dir": dir_of(&comps.synaptic_models_dir, "synaptic_models_dir")?,
        "inputs": [{"file": case.input_file, "population": case.input_population}],
        "record": record,
    });
    let script = tmp.join("nest_sonata.py");
    std::fs::write(&script, NEST_SCRIPT)?;
    let spec_path = tmp.join("nest_spec.json");
    std::fs::write(&spec_path, serde_json::to_vec(&spec)?)?;
    let out_path = tmp.join("nest_out.json");
    let out = Command::new(python)
        .arg(&script)
        .arg(&spec_path)
        .arg(&out_path)
        .env("PYNEST_QUIET", "1")
        .output()
        .with_context(|| format!("starting `{python}` for NEST"))?;
    if !out.status.success() {
        bail!(
            "NEST failed on {} ({}):\n{}",
            case.name,
            out.status,
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let v: Value = lockstep_core::config::read_json(&out_path)?;
    let ids = v["node_ids"].as_array().context("NEST output: node_ids")?;
    let times = v["times"].as_array().context("NEST output: times")?;
    let spikes = ids
        .iter()
        .zip(times)
        .map(|(n, t)| {
            (
                n.as_u64().unwrap_or(u64::MAX),
                t.as_f64().unwrap_or(f64::NAN),
            )
        })
        .collect();
    Ok(NestFigures {
        source: format!(
            "NEST {}, this run",
            v["nest_version"].as_str().unwrap_or("?")
        ),
        build_s: v["build_s"].as_f64().context("NEST output: build_s")?,
        simulate_s: v["simulate_s"]
            .as_f64()
            .context("NEST output: simulate_s")?,
        spikes: Some(spikes),
    })
}

/// NEST's times stored with the 450-cell reference (another day, another load) and its
/// stored spikes (the same network, input, dt and duration), for the agreement column.
fn stored_nest(p450: &Path) -> Result<NestFigures> {
    let spikes_path = p450.join("reference/nest_point450_dt0.1_t1000.spikes.h5");
    let trains = lockstep_sonata::read_spikes(&spikes_path)?;
    let spikes: Vec<(u64, f64)> = trains
        .populations
        .iter()
        .flat_map(|p| p.node_ids.iter().copied().zip(p.timestamps.iter().copied()))
        .collect();
    let path = p450.join("reference/nest_point450_dt0.1_t1000.json");
    let v: Value = lockstep_core::config::read_json(&path)?;
    let num = |k: &str| {
        v[k].as_f64()
            .with_context(|| format!("{}: key '{k}' missing", path.display()))
    };
    Ok(NestFigures {
        source: format!(
            "stored NEST {} time ({})",
            v["nest_version"].as_str().unwrap_or("?"),
            path.display()
        ),
        build_s: num("wall_s_build")?,
        simulate_s: num("wall_s_simulate")?,
        spikes: Some(spikes),
    })
}

/// Writes seeded Poisson spike times (Hz, ms) for every node of the virtual population
/// `population` of the circuit: off the 0.1 ms grid (at ...5 us), as recorded input files are.
fn write_poisson_input(
    circuit_config: &Path,
    population: &str,
    rate_hz: f64,
    tstop: f64,
    seed: u64,
    path: &Path,
) -> Result<()> {
    let circuit = Circuit::from_config(circuit_config)?;
    let pop = circuit
        .node_population(population)
        .with_context(|| format!("{}: no population '{population}'", circuit_config.display()))?;
    let mut node_ids = Vec::new();
    let mut timestamps = Vec::new();
    let mut ids: Vec<u64> = pop.node_id.clone();
    ids.sort_unstable();
    for id in ids {
        let mut rng = SplitMix64::new(seed ^ id.wrapping_mul(GOLDEN_GAMMA));
        let mut t = 0.0;
        loop {
            t += -(1.0 - rng.uniform()).ln() * 1000.0 / rate_hz;
            if t >= tstop {
                break;
            }
            node_ids.push(id);
            timestamps.push(((t * 1000.0).floor() + 0.5) / 1000.0);
        }
    }
    let mut spikes = PopulationSpikes {
        population: population.into(),
        node_ids,
        timestamps,
        sorting: SpikeSorting::None,
    };
    spikes.sort_by_time();
    lockstep_sonata::write_spikes(
        path,
        &SpikeTrains {
            populations: vec![spikes],
        },
    )?;
    Ok(())
}

/// Fraction of spikes (node id, time to 1 us) that both simulators produced.
fn agreement(a: &[(u64, f64)], b: &[(u64, f64)]) -> (usize, f64) {
    let key = |&(n, t): &(u64, f64)| (n, (t * 1000.0).round() as i64);
    let mut x: Vec<_> = a.iter().map(key).collect();
    let mut y: Vec<_> = b.iter().map(key).collect();
    x.sort_unstable();
    y.sort_unstable();
    let (mut i, mut j, mut same) = (0, 0, 0);
    while i < x.len() && j < y.len() {
        match x[i].cmp(&y[j]) {
            std::cmp::Ordering::Equal => {
                same += 1;
                i += 1;
                j += 1;
            }
            std::cmp::Ordering::Less => i += 1,
            std::cmp::Ordering::Greater => j += 1,
        }
    }
    let denom = x.len().max(y.len()).max(1);
    (same, same as f64 / denom as f64)
}

fn print_report(reports: &[CaseReport], nest_ran: bool, python: &str, tenth_missing: bool) {
    println!("forward simulation, one trial, 1 thread each; times in s (each simulator's best build and best simulation of the rounds; one build and simulation of each per round)");
    println!(
        "{:>16} {:>6} {:>9} {:>6} | {:>8} {:>8} {:>9} {:>9} | {:>8} {:>8} | {:>9} {:>9} | {:>8} {:>8} {:>9}",
        "case", "cells", "edges", "steps", "build", "simulate", "n-steps/s", "events/s",
        "NEST bld", "NEST sim", "sim ratio", "b+s ratio", "spikes", "NEST", "identical"
    );
    for r in reports {
        let nsteps = (r.cells * r.steps) as f64 / r.simulate_s;
        let events = r.syn_events as f64 / r.simulate_s;
        let (nb, ns, sr, bsr) = match &r.nest {
            Some(n) => (
                format!("{:.4}", n.build_s),
                format!("{:.4}", n.simulate_s),
                format!("{:.2}", n.simulate_s / r.simulate_s),
                format!(
                    "{:.2}",
                    (n.build_s + n.simulate_s) / (r.build_s + r.simulate_s)
                ),
            ),
            None => ("-".into(), "-".into(), "-".into(), "-".into()),
        };
        let (nspk, ident) = match r.nest.as_ref().and_then(|n| n.spikes.as_ref()) {
            Some(s) => {
                let (same, frac) = agreement(&r.spikes, s);
                (
                    s.len().to_string(),
                    format!("{same} ({:.2}%)", 100.0 * frac),
                )
            }
            None => ("-".into(), "-".into()),
        };
        println!(
            "{:>16} {:>6} {:>9} {:>6} | {:>8.4} {:>8.4} {:>9.3e} {:>9.3e} | {:>8} {:>8} | {:>9} {:>9} | {:>8} {:>8} {:>9}",
            r.name, r.cells, r.edges, r.steps, r.build_s, r.simulate_s, nsteps, events, nb, ns,
            sr, bsr, r.spikes.len(), nspk, ident
        );
    }
    println!("ratio = NEST time / lockstep time (> 1: lockstep is faster); b+s = build + simulate");
    for r in reports {
        if let Some(n) = &r.nest {
            if !nest_ran {
                println!(
                    "{}: NEST figures are the {} and its stored spikes",
                    r.name, n.source
                );
            }
        }
    }
    if nest_ran {
        if let Some(n) = reports.first().and_then(|r| r.nest.as_ref()) {
            println!("NEST: {} (`{python}`)", n.source);
        }
    } else {
        println!("NEST did not run: `{python}` cannot import nest and h5py (pip install nest-simulator==3.10.0 h5py, or pass --python)");
    }
    if tenth_missing {
        println!("v1_scale tenth: not built; build it with `lockstep build-network examples/v1_scale/network_recipe.tenth.json --output examples/v1_scale/tenth`");
    }
}

#[cfg(test)]
mod tests {
    use super::agreement;

    #[test]
    fn agreement_counts_identical_spikes_to_the_microsecond() {
        let a = [(1, 10.1), (2, 10.1), (3, 20.0)];
        let b = [(2, 10.1000000001), (1, 10.1), (3, 20.1)];
        assert_eq!(agreement(&a, &b), (2, 2.0 / 3.0));
        assert_eq!(agreement(&[], &[]), (0, 0.0));
    }
}
