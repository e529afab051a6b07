//! `lockstep simulate CONFIG` and `lockstep bench simulate`: the NEST-exact forward
//! simulation of a SONATA point-neuron network (lockstep-snn).

use anyhow::{bail, Result};
use lockstep_comm::World;
use lockstep_snn::simulate::{bench_simulate, simulate_config, BenchOptions, SimulateOptions};
use std::path::PathBuf;

/// Options of `lockstep simulate`.
#[derive(Debug, clap::Args)]
pub struct SimulateArgs {
    /// A BMTK-style simulation config (run.tstop, run.dt, inputs, networks, output).
    pub config: PathBuf,
    /// Independent trials to run together (the spikes of trial 0 are written).
    #[arg(long, default_value_t = 1)]
    pub trials: usize,
}

/// Runs the simulation and prints a summary.
pub fn run(args: &SimulateArgs, world: &World) -> Result<()> {
    if world.comm().size() > 1 {
        bail!("`lockstep simulate` runs on one process; start it without mpirun");
    }
    let opts = SimulateOptions {
        batch: args.trials.max(1),
        ..SimulateOptions::default()
    };
    let s = simulate_config(&args.config, &opts)?;
    println!(
        "simulated {} neurons for {} ms (dt {} ms, {} steps): {} spikes ({:.2} Hz mean), {} synaptic events",
        s.n_neurons,
        s.tstop,
        s.dt,
        s.n_steps,
        s.n_spikes,
        s.n_spikes as f64 / s.n_neurons.max(1) as f64 / (s.tstop / 1000.0),
        s.syn_events
    );
    println!("build {:.3} s, simulate {:.3} s", s.build_s, s.simulate_s);
    println!("spikes: {}", s.spikes_file.display());
    if let Some(csv) = &s.spikes_file_csv {
        println!("spikes (CSV): {}", csv.display());
    }
    Ok(())
}

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
pub fn bench(args: &BenchSimulateArgs) -> Result<()> {
    let r = bench_simulate(&BenchOptions {
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
