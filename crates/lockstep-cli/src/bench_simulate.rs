//! `lockstep bench simulate`: throughput of the NEST-exact forward simulation (lockstep-snn)
//! on the 450-cell BMTK network `point_450glifs` with NEST's reference input, dt and
//! duration, and its ratio to NEST's recorded wall time.

use std::path::PathBuf;
use std::time::Instant;

use anyhow::{Context, Result};
use lockstep_snn::{
    network_spec_from_circuit, simulate, spike_trains_for_virtual_nodes, InputSpec, SimOptions,
};
use lockstep_sonata::Circuit;
use serde_json::Value;

/// Options of `lockstep bench simulate`.
#[derive(Debug, clap::Args)]
pub struct BenchSimulateArgs {
    /// The `shared/` folder with data/bmtk/point_450glifs and data/reference.
    #[arg(long, default_value = "../shared")]
    pub shared: PathBuf,
    /// Timed repetitions (the best is reported).
    #[arg(long, default_value_t = 5)]
    pub repeats: usize,
    /// Trials per run.
    #[arg(long, default_value_t = 1)]
    pub batch: usize,
    /// Run the trials in parallel (rayon).
    #[arg(long)]
    pub parallel: bool,
}

/// Runs the forward-simulation benchmark and prints its report.
pub fn run(args: &BenchSimulateArgs) -> Result<()> {
    let r = bench_simulate(&SimulateBenchOptions {
        shared_dir: args.shared.clone(),
        repeats: args.repeats.max(1),
        batch: args.batch.max(1),
        parallel: args.parallel,
    })?;
    println!("point_450glifs, NEST reference input, dt 0.1 ms, 1000 ms ({} neurons, {} steps, {} trial(s) per run, best of {})", r.n_neurons, r.n_steps, r.batch, args.repeats);
    println!("  build                 {:>12.4} s", r.build_s);
    println!("  simulate              {:>12.4} s", r.simulate_s);
    println!("  neuron-steps / s      {:>12.3e}", r.neuron_steps_per_s);
    println!("  synaptic events / s   {:>12.3e}", r.syn_events_per_s);
    println!("  spikes (trial 0)      {:>12}", r.n_spikes);
    println!(
        "  NEST wall (build+sim) {:>12.4} s  -> lockstep is {:.2}x NEST per trial",
        r.nest_wall_s, r.speedup_vs_nest_wall
    );
    println!(
        "  NEST simulate         {:>12.4} s  -> lockstep is {:.2}x NEST per trial",
        r.nest_simulate_s, r.speedup_vs_nest_simulate
    );
    Ok(())
}

/// Options of [`bench_simulate`].
#[derive(Debug, Clone, PartialEq)]
pub struct SimulateBenchOptions {
    /// The `shared/` folder (holds `data/bmtk/point_450glifs` and `data/reference`).
    pub shared_dir: PathBuf,
    /// Timed repetitions (the best is reported).
    pub repeats: usize,
    /// Trials per run (batched, parallel over trials when `parallel`).
    pub batch: usize,
    /// Use rayon over trials.
    pub parallel: bool,
}

/// Throughput of the forward simulation on `point_450glifs` with the reference input, dt and
/// duration, and its ratio to NEST's recorded wall time.
#[derive(Debug, Clone, PartialEq)]
pub struct SimulateBenchReport {
    /// Neurons simulated.
    pub n_neurons: usize,
    /// Steps per trial.
    pub n_steps: usize,
    /// Trials per run.
    pub batch: usize,
    /// Seconds to read and compile network and inputs.
    pub build_s: f64,
    /// Best seconds of one batched simulation.
    pub simulate_s: f64,
    /// `batch * neurons * steps / simulate_s`.
    pub neuron_steps_per_s: f64,
    /// Synaptic events (all trials) per second.
    pub syn_events_per_s: f64,
    /// Spikes in trial 0 (19,263 for NEST).
    pub n_spikes: usize,
    /// NEST's `wall_s` (build + simulate) from the reference JSON.
    pub nest_wall_s: f64,
    /// NEST's `wall_s_simulate`.
    pub nest_simulate_s: f64,
    /// `nest_wall_s / (build_s + simulate_s / batch)`: > 1 means faster than NEST per trial.
    pub speedup_vs_nest_wall: f64,
    /// `nest_simulate_s / (simulate_s / batch)`.
    pub speedup_vs_nest_simulate: f64,
}

/// `lockstep bench simulate`: runs the reference network `repeats` times.
pub fn bench_simulate(opts: &SimulateBenchOptions) -> Result<SimulateBenchReport> {
    let data = opts.shared_dir.join("data");
    let ref_json = data.join("reference/nest_point450_dt0.1_t1000.json");
    let meta: Value = lockstep_core::config::read_json(&ref_json)
        .context("reading the NEST reference of the benchmark")?;
    let num = |k: &str| {
        meta[k].as_f64().with_context(|| {
            format!(
                "{}: key '{k}' is missing or not a number",
                ref_json.display()
            )
        })
    };
    let (dt, tstop, nest_wall_s, nest_simulate_s) = (
        num("dt")?,
        num("tstop")?,
        num("wall_s")?,
        num("wall_s_simulate")?,
    );

    let t0 = Instant::now();
    let circuit = Circuit::from_config(data.join("bmtk/point_450glifs/config.circuit.json"))?;
    let spec = network_spec_from_circuit(&circuit)?;
    let lgn_path = data.join("bmtk/point_450glifs/inputs/lgn_spikes.h5");
    let lgn = lockstep_sonata::read_spikes(&lgn_path)?;
    let trains =
        spike_trains_for_virtual_nodes(&spec, &lgn, &lgn_path.display().to_string(), Some("lgn"))?;
    let net = spec.compile(dt)?;
    let n_steps = net.grid.run_steps(tstop)?;
    let inputs = InputSpec {
        spike_trains: Some(trains),
        poisson: None,
    }
    .compile("lgn", net.n_virtual(), &net.grid, n_steps)?;
    let build_s = t0.elapsed().as_secs_f64();

    let batch = opts.batch.max(1);
    let sim_opts = SimOptions {
        parallel: opts.parallel,
        ..Default::default()
    };
    let mut best = f64::INFINITY;
    let mut last = None;
    for _ in 0..opts.repeats.max(1) {
        let t = Instant::now();
        let out = simulate(&net, &inputs, n_steps, batch, 0, &sim_opts);
        best = best.min(t.elapsed().as_secs_f64());
        last = Some(out);
    }
    let out = last.unwrap_or_default();
    let events: u64 = out.trials.iter().map(|t| t.syn_events).sum();
    let per_trial = best / batch as f64;
    Ok(SimulateBenchReport {
        n_neurons: net.n_neurons(),
        n_steps,
        batch,
        build_s,
        simulate_s: best,
        neuron_steps_per_s: (batch * net.n_neurons() * n_steps) as f64 / best,
        syn_events_per_s: events as f64 / best,
        n_spikes: out.trials.first().map_or(0, |t| t.spikes.len()),
        nest_wall_s,
        nest_simulate_s,
        speedup_vs_nest_wall: nest_wall_s / (build_s + per_trial),
        speedup_vs_nest_simulate: nest_simulate_s / per_trial,
    })
}
