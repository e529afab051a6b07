//! `lockstep build-network RECIPE --output DIR`: builds a SONATA network (BMTK layout) from a
//! JSON recipe with [`lockstep_sonata::builder`] and writes it with its `config.circuit.json`.

use anyhow::{Context, Result};
use lockstep_sonata::builder::{build, Recipe};
use std::path::PathBuf;

/// Options of `lockstep build-network`.
#[derive(Debug, clap::Args)]
pub struct BuildNetworkArgs {
    /// The network recipe (JSON; format in the lockstep-sonata builder docs).
    pub recipe: PathBuf,
    /// Output folder: gets config.circuit.json, target_rates.csv (if any) and network/.
    #[arg(long, short)]
    pub output: PathBuf,
    /// Replace existing output files.
    #[arg(long)]
    pub overwrite: bool,
}

/// Builds the network, writes it and prints a per-population summary.
pub fn run(args: &BuildNetworkArgs) -> Result<()> {
    let recipe = Recipe::from_file(&args.recipe)?;
    let net = build(&recipe)?;
    let files = net
        .save(&args.output, args.overwrite)
        .with_context(|| format!("writing the network into '{}'", args.output.display()))?;
    for n in &net.nodes {
        println!(
            "nodes {}: {} nodes, {} node type(s){}",
            n.parts.name,
            n.parts.node_id.len(),
            n.types.len(),
            if n.is_virtual { " (virtual)" } else { "" }
        );
    }
    for e in &net.edges {
        println!(
            "edges {}: {} edges, {} edge type(s)",
            e.parts.name,
            e.parts.source_node_id.len(),
            e.types.len()
        );
    }
    println!(
        "wrote {} files; circuit config: {}",
        files.len(),
        files
            .last()
            .map(|f| f.display().to_string())
            .unwrap_or_default()
    );
    Ok(())
}
