//! `lockstep simulate CONFIG`: the NEST-exact forward simulation of a SONATA point-neuron
//! network (lockstep-snn).

use anyhow::{bail, Result};
use lockstep_comm::World;
use lockstep_snn::{simulate_config, SimulateOptions};
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
