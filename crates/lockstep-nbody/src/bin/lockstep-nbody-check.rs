//! `lockstep-nbody-check`: `lockstep nbody CONFIG` as a standalone program for the mpirun
//! tests of this crate: one rank, or one rank per process under `mpirun -n K` (the
//! communicator comes from the launch environment).
//!
//! `lockstep-nbody-check CONFIG [--quiet] [--overwrite] [--crash-rank R --crash-after-ms T]`
//!
//! `--crash-rank` is fault injection for the tests: rank R exits with status 3 after T ms,
//! as a crashed process would, and the job must end instead of hanging.

use std::path::PathBuf;

use lockstep_comm::World;
use lockstep_nbody::config::run_nbody_config_on;
use lockstep_nbody::RunOptions;

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let Some(path) = args.get(1).map(PathBuf::from) else {
        eprintln!("usage: lockstep-nbody-check CONFIG [--quiet] [--overwrite] [--crash-rank R --crash-after-ms T]");
        std::process::exit(2);
    };
    let world = match World::init(lockstep_comm::launch::ComputeKind::Cpu, true) {
        Ok(w) => w,
        Err(e) => {
            eprintln!("lockstep-nbody-check: {e}");
            std::process::exit(1);
        }
    };
    let flag = |name: &str| {
        args.iter()
            .position(|a| a == name)
            .and_then(|i| args.get(i + 1))
            .and_then(|v| v.parse::<u64>().ok())
    };
    if let (Some(r), Some(ms)) = (flag("--crash-rank"), flag("--crash-after-ms")) {
        if world.comm().rank() as u64 == r {
            std::thread::spawn(move || {
                std::thread::sleep(std::time::Duration::from_millis(ms));
                eprintln!("lockstep-nbody-check: rank {r} crashes on purpose (--crash-rank)");
                std::process::exit(3);
            });
        }
    }
    let opts = RunOptions {
        quiet: args.iter().any(|a| a == "--quiet"),
        progress: true,
        output_dir: None,
        overwrite: args.iter().any(|a| a == "--overwrite"),
        ..Default::default()
    };
    if let Err(e) = run_nbody_config_on(world.comm(), &path, &opts) {
        world.fail(&format!("rank {}: {e}", world.comm().rank()));
    }
}
