//! `lockstep simulate CONFIG`: the NEST-exact forward simulation of a SONATA point-neuron
//! network (lockstep-snn), its outputs and a table of the firing rates.

use std::io::IsTerminal;
use std::path::PathBuf;
use std::sync::Arc;

use anyhow::{bail, Result};
use lockstep_comm::World;
use lockstep_snn::{
    simulate_config, RateGroup, RateRow, RunProgress, SimulateOptions, SimulationSummary,
};

/// Options of `lockstep simulate`.
#[derive(Debug, clap::Args)]
pub struct SimulateArgs {
    /// A BMTK-style simulation config (run.tstop, run.dt, inputs, networks, output, reports).
    pub config: PathBuf,
    /// Independent trials to run together (the spikes and reports of trial 0 are written).
    #[arg(allow_negative_numbers = true, long, default_value_t = 1)]
    pub trials: usize,
}

/// An indicatif bar on stderr, in trial steps.
struct Bar(indicatif::ProgressBar);

impl RunProgress for Bar {
    fn start(&self, total_steps: u64) {
        self.0.set_length(total_steps);
        self.0.set_position(0);
    }
    fn advance(&self, steps: u64) {
        self.0.inc(steps);
    }
    fn finish(&self) {
        self.0.finish_and_clear();
    }
}

/// Runs the simulation and prints a summary and the rate table.
pub fn run(args: &SimulateArgs, world: &World) -> Result<()> {
    if world.comm().size() > 1 {
        bail!("`lockstep simulate` runs on one process; start it without mpirun");
    }
    if args.trials == 0 {
        bail!("--trials 0: a simulation runs at least 1 trial (trial 0 is the one written)");
    }
    // indicatif draws on stderr: a bar only where stderr is a terminal.
    let progress: Option<Arc<dyn RunProgress>> = std::io::stderr().is_terminal().then(|| {
        let bar = indicatif::ProgressBar::new(0);
        bar.set_style(
            indicatif::ProgressStyle::with_template("{bar:30} step {pos}/{len} ETA {eta}")
                .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
        );
        Arc::new(Bar(bar)) as Arc<dyn RunProgress>
    });
    let opts = SimulateOptions {
        batch: args.trials,
        progress,
        ..SimulateOptions::default()
    };
    let s = simulate_config(&args.config, &opts)?;
    for w in &s.warnings {
        eprintln!("warning: {w}");
    }
    print!("{}", summary_text(&s));
    Ok(())
}

/// The summary `lockstep simulate` prints: counts, timings, the files written and the rate
/// table of trial 0.
pub fn summary_text(s: &SimulationSummary) -> String {
    let mut t = format!(
        "simulated {} neurons for {} ms (dt {} ms, {} steps): {} spikes ({:.2} Hz mean), {} synaptic events\n",
        s.n_neurons,
        s.tstop,
        s.dt,
        s.n_steps,
        s.n_spikes,
        s.n_spikes as f64 / s.n_neurons.max(1) as f64 / (s.tstop / 1000.0),
        s.syn_events
    );
    t.push_str(&format!(
        "build {:.3} s, simulate {:.3} s\n",
        s.build_s, s.simulate_s
    ));
    t.push_str(&format!("spikes: {}\n", s.spikes_file.display()));
    if let Some(csv) = &s.spikes_file_csv {
        t.push_str(&format!("spikes (CSV): {}\n", csv.display()));
    }
    for r in &s.reports {
        t.push_str(&format!(
            "report '{}': V_m of {} cells, {} frames ({} to {} ms every {} ms): {}\n",
            r.name,
            r.cells,
            r.frames,
            r.time[0],
            r.time[1] - r.time[2],
            r.time[2],
            r.file.display()
        ));
    }
    t.push_str(&rate_table(&s.rates));
    t
}

/// The rate table: one line per row, `group name cells spikes rate`.
pub fn rate_table(rows: &[RateRow]) -> String {
    let width = rows.iter().map(|r| r.name.len()).max().unwrap_or(4).max(4);
    let mut t = format!(
        "firing rates (trial 0)\n{:<11} {:<width$} {:>7} {:>9} {:>10}\n",
        "group", "name", "cells", "spikes", "rate (Hz)"
    );
    for r in rows {
        let group = match r.group {
            RateGroup::All => "all",
            RateGroup::Population => "population",
            RateGroup::NodeType => "node type",
        };
        t.push_str(&format!(
            "{group:<11} {:<width$} {:>7} {:>9} {:>10.3}\n",
            r.name, r.cells, r.spikes, r.rate_hz
        ));
    }
    t
}
