//! `lockstep nbody CONFIG` as a standalone program: one rank, or one rank per process under
//! `mpirun -n K` (the communicator comes from the launch environment).
//!
//! `cargo run --release -p lockstep-nbody --example nbody_run -- CONFIG [--quiet]`

use std::path::PathBuf;

use lockstep_comm::World;
use lockstep_nbody::config::run_nbody_config_on;
use lockstep_nbody::RunOptions;

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let Some(path) = args.get(1).map(PathBuf::from) else {
        eprintln!("usage: nbody_run CONFIG [--quiet]");
        std::process::exit(2);
    };
    let world = match World::init(true) {
        Ok(w) => w,
        Err(e) => {
            eprintln!("nbody_run: {e}");
            std::process::exit(1);
        }
    };
    let opts = RunOptions {
        quiet: args.iter().any(|a| a == "--quiet"),
        progress: true,
        output_dir: None,
    };
    if let Err(e) = run_nbody_config_on(world.comm(), &path, &opts) {
        world.fail(&format!("rank {}: {e}", world.comm().rank()));
    }
}
