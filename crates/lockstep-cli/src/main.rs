//! `lockstep`: runs scientific models on several devices at once and keeps every replica in
//! lockstep. See the README for the quickstart.
//!
//! What this program guarantees (the library crates guarantee the rest):
//!
//! - **It ends.** An error on any rank ends the whole job with a non-zero status and one
//!   message naming the rank: ranks that agree on the failure (a config error every rank
//!   read) leave through `MPI_Finalize`, any other failure aborts the job
//!   ([`lockstep_comm::World::fail`]); commands that must run in one process refuse mpirun.
//! - **Bad input fails before output.** `train`, `simulate` and `npe` read and check their
//!   configs (typed sections, unknown keys refused with the nearest key,
//!   `FILE: KEY: PROBLEM`) before any output folder is created or overwritten
//!   (`tests/train.rs`, `tests/simulate.rs`, `tests/npe.rs`).
//! - **Benchmarks report ratios measured in the same run** (`lockstep bench ...`); the
//!   benchmark code lives here ([`mod@bench`], one file per benchmark), not in the libraries.

mod bench;
mod build_network;
mod flags;
mod info;
mod nbody;
mod npe;
mod plot;
mod simulate;
mod train;

use clap::{Parser, Subcommand};
use lockstep_comm::launch::ComputeKind;
use lockstep_comm::World;
use std::process::ExitCode;

#[derive(Debug, Parser)]
#[command(name = "lockstep", version, about = "Sample-parallel training and sharded simulation of scientific models", long_about = None)]
struct Cli {
    /// Compute on CPU cores only: bind no GPU even for a model that runs on GPUs, and do not
    /// warn about GPUs in CUDA_VISIBLE_DEVICES that a CPU model leaves unused.
    #[arg(long, global = true)]
    cpu: bool,
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Print the detected launch environment (serial, MPI, Slurm), each rank's device and the version.
    Info,
    /// Train a SONATA point-neuron network with BPTT (serial, threads or MPI replicas: run.distribution).
    Train(train::TrainArgs),
    /// Simulate a SONATA point-neuron network (BMTK-style config), NEST-exact; writes SONATA spikes.
    Simulate(simulate::SimulateArgs),
    /// Build a SONATA network from a JSON recipe.
    BuildNetwork(build_network::BuildNetworkArgs),
    /// Gravitational N-body simulation with FMM forces; under mpirun the particles are sharded over the ranks.
    Nbody(nbody::NbodyArgs),
    /// Neural posterior estimation (Dingo-style settings): train, sample, pp.
    #[command(subcommand)]
    Npe(npe::NpeCommand),
    /// PNG figures of a training run: loss curves and a spike raster.
    Plot(plot::PlotArgs),
    /// Benchmarks (speed is reported as ratios measured in the same run).
    #[command(subcommand)]
    Bench(bench::BenchCommand),
}

/// The options whose value may start with a minus (`allow_hyphen_values`): clap's tip for
/// a value taken for a flag is `-- VALUE`, so `--observation -- -0.5,0.3` is read as
/// `--observation -0.5,0.3` (clap alone would take `--` as the value).
const HYPHEN_VALUE_OPTIONS: &[&str] = &[
    "--observation",
    "--sizes",
    "--direct-sizes",
    "--fmm3d-eps",
    "--simulations",
    "--observations",
];

/// `args` without a `--` that directly follows one of [`HYPHEN_VALUE_OPTIONS`] and precedes
/// its value.
fn without_escape_after_values(
    args: impl IntoIterator<Item = std::ffi::OsString>,
) -> Vec<std::ffi::OsString> {
    let args: Vec<std::ffi::OsString> = args.into_iter().collect();
    let mut out = Vec::with_capacity(args.len());
    for (i, a) in args.iter().enumerate() {
        let escape_of_value = a == "--"
            && i > 0
            && i + 1 < args.len()
            && HYPHEN_VALUE_OPTIONS.iter().any(|o| args[i - 1] == *o);
        if !escape_of_value {
            out.push(a.clone());
        }
    }
    out
}

/// BPTT allocates and frees large per-sample buffers. glibc would return them to the kernel
/// (munmap, heap trimming) and take page faults to get them back; with several replica
/// threads in one process those calls also serialise on the address-space lock. Keeping freed
/// memory in the allocator avoids both. glibc only; elsewhere the allocator's defaults stay.
fn keep_freed_memory() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: mallopt only adjusts allocator parameters; called before any thread starts.
    unsafe {
        libc::mallopt(libc::M_MMAP_THRESHOLD, 1 << 30);
        libc::mallopt(libc::M_TRIM_THRESHOLD, 1 << 30);
    }
}

/// What the command's model computes on (decides whether ranks bind GPUs), and whether it
/// computes at all (`None`: no model, nothing to warn about). Every model of this build runs
/// on CPU cores: the spiking networks (train, simulate, bench bptt/scaling/simulate), the
/// N-body code (nbody, bench nbody), the NPE flows (npe, burn's CPU backend) and the
/// communicator benchmarks; `info` reports the devices these models bind.
///
/// The spiking network's GPU engine (`run.device: "gpu"`) and the NPE on a GPU
/// (`local.device: gpu | cuda`) bind their device through `lockstep-gpu` or CUDA's ordinals
/// (node-local rank, or the thread replica's index), not through this binding; such a run
/// does not warn about `CUDA_VISIBLE_DEVICES`.
fn compute_kind(command: &Command) -> Option<ComputeKind> {
    match command {
        Command::Info | Command::Train(_) | Command::Simulate(_) | Command::Nbody(_) => {
            Some(ComputeKind::Cpu)
        }
        Command::Bench(_) | Command::Npe(_) => Some(ComputeKind::Cpu),
        Command::BuildNetwork(_) | Command::Plot(_) => None,
    }
}

fn main() -> ExitCode {
    // Like other command-line tools, end quietly when the reader of stdout goes away
    // (`lockstep ... | head`) instead of panicking on a broken pipe.
    // SAFETY: restoring the default disposition of SIGPIPE before any thread starts.
    unsafe {
        libc::signal(libc::SIGPIPE, libc::SIG_DFL);
    }
    keep_freed_memory();
    // The Vulkan loader prints an error on every start when XDG_RUNTIME_DIR is unset
    // (containers, batch jobs); point it at the temporary folder before any thread starts.
    if std::env::var_os("XDG_RUNTIME_DIR").is_none() {
        std::env::set_var("XDG_RUNTIME_DIR", std::env::temp_dir());
    }
    let cli = Cli::parse_from(without_escape_after_values(std::env::args_os()));
    flags::set_cpu_only(cli.cpu);
    let kind = compute_kind(&cli.command);
    let world = match World::init(kind.unwrap_or(ComputeKind::Cpu), cli.cpu) {
        Ok(w) => w,
        Err(e) => {
            eprintln!("lockstep: {e:#}");
            return ExitCode::from(2);
        }
    };
    let mpi_worker = match &cli.command {
        Command::Bench(bench) => bench.is_mpi_worker(),
        _ => false,
    };
    let on_gpu = match &cli.command {
        Command::Train(t) => train::asks_for_gpu(&t.config),
        Command::Npe(npe::NpeCommand::Train(t)) => npe::asks_for_gpu(&t.settings),
        _ => false,
    };
    if kind.is_some() && !mpi_worker && !on_gpu {
        world.warn_unused_gpus();
    }
    let single_process = match &cli.command {
        Command::Simulate(_) | Command::BuildNetwork(_) | Command::Plot(_) => true,
        Command::Bench(bench) => !bench.is_mpi_worker(),
        Command::Npe(
            npe::NpeCommand::Sample(_) | npe::NpeCommand::Pp(_) | npe::NpeCommand::Export(_),
        ) => true,
        Command::Info | Command::Train(_) | Command::Nbody(_) | Command::Npe(_) => false,
    };
    if single_process && world.comm().size() > 1 {
        world.fail(&"this command runs in one process (it writes shared files or starts its own MPI jobs); start it without mpirun/srun");
    }
    let result = match &cli.command {
        Command::Info => info::run(&world),
        Command::Train(args) => train::run(args, &world),
        Command::Simulate(args) => simulate::run(args, &world),
        Command::BuildNetwork(args) => build_network::run(args),
        Command::Plot(args) => plot::run(args),
        Command::Nbody(args) => nbody::run(args, &world),
        Command::Npe(cmd) => npe::run(cmd, &world),
        Command::Bench(bench) => bench.run(&world),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => match agreed(&e) {
            // Every rank stopped at the same point and knows it (e.g. a config error all
            // ranks read, the chief's output folder): one rank reports, every rank leaves
            // through MPI_Finalize with a non-zero status, and the launcher prints no abort
            // report over the message.
            Some(reports) => {
                if reports {
                    lockstep_comm::eprint_flush(&format!(
                        "lockstep: {}: {e:#}",
                        world.error_origin()
                    ));
                }
                drop(world);
                ExitCode::FAILURE
            }
            None => world.fail(&e),
        },
    }
}

/// Whether `e` is a failure every rank agreed on before the work began (training and NPE:
/// [`lockstep_train::TrainError::is_agreed`]; N-body: [`lockstep_nbody::NbodyError::is_agreed`]),
/// and if so whether this rank reports it (`false` for the ranks that only learned of
/// another rank's refusal). `None`: not agreed, the job must abort.
fn agreed(e: &anyhow::Error) -> Option<bool> {
    if let Some(t) = e.downcast_ref::<lockstep_train::TrainError>() {
        let by_peer = matches!(t, lockstep_train::TrainError::RefusedByPeer { .. });
        return t.is_agreed().then_some(!by_peer);
    }
    if let Some(n) = e.downcast_ref::<lockstep_nbody::NbodyError>() {
        let by_peer = matches!(n, lockstep_nbody::NbodyError::RefusedByPeer { .. });
        return n.is_agreed().then_some(!by_peer);
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::builder::ValueParser;
    use clap::CommandFactory;

    /// Every option of every command whose value is a number takes a leading minus as its
    /// value (`--seed -1`, `--theta -0.5`): the value's own check answers, never clap's
    /// "unexpected argument '-1'".
    #[test]
    fn every_numeric_option_takes_a_leading_minus_as_its_value() {
        let numeric = [
            ValueParser::from(clap::value_parser!(u64)).type_id(),
            ValueParser::from(clap::value_parser!(usize)).type_id(),
            ValueParser::from(clap::value_parser!(f64)).type_id(),
            ValueParser::from(clap::value_parser!(i64)).type_id(),
            ValueParser::from(clap::value_parser!(u32)).type_id(),
        ];
        fn options(cmd: &clap::Command, path: &str, out: &mut Vec<(String, clap::Arg)>) {
            for a in cmd.get_arguments() {
                if let Some(long) = a.get_long() {
                    out.push((format!("{path} --{long}"), a.clone()));
                }
            }
            for s in cmd.get_subcommands() {
                options(s, &format!("{path} {}", s.get_name()), out);
            }
        }
        let mut all = Vec::new();
        options(&Cli::command(), "lockstep", &mut all);
        let bad: Vec<&String> = all
            .iter()
            .filter(|(_, a)| {
                a.get_num_args().is_none_or(|n| n.takes_values())
                    && numeric.contains(&a.get_value_parser().type_id())
                    && !a.is_allow_negative_numbers_set()
                    && !a.is_allow_hyphen_values_set()
            })
            .map(|(p, _)| p)
            .collect();
        assert!(
            bad.is_empty(),
            "options that take a number but not a leading minus: {bad:?}"
        );
    }

    /// The options whose numbers may be negative take them space-separated; numbers that
    /// may not be negative are refused by their own check, naming the option.
    #[test]
    fn negative_values_are_values_of_the_options_that_take_numbers() {
        let parse = |args: &str| Cli::try_parse_from(args.split(' '));
        let cli = parse("lockstep npe sample run --observation -0.5,0.3").unwrap();
        let Command::Npe(npe::NpeCommand::Sample(a)) = cli.command else {
            panic!("not npe sample")
        };
        assert_eq!(a.observation.as_deref(), Some("-0.5,0.3"));
        let cli = parse("lockstep npe sample run --observation -1e-3 --seed -2").unwrap();
        let Command::Npe(npe::NpeCommand::Sample(a)) = cli.command else {
            panic!("not npe sample")
        };
        assert_eq!(
            (a.observation.as_deref(), a.seed),
            (Some("-1e-3"), u64::MAX - 1)
        );
        let cli = parse("lockstep npe pp run --seed -1").unwrap();
        let Command::Npe(npe::NpeCommand::Pp(a)) = cli.command else {
            panic!("not npe pp")
        };
        assert_eq!(a.seed, Some(u64::MAX));
        // Negative floats reach the command's own range checks.
        for line in [
            "lockstep bench c2st --seed -1",
            "lockstep bench nbody --theta -0.5",
            "lockstep bench nbody --fmm3d-eps -1e-3,1e-4",
            "lockstep bench bptt --dt -1",
            "lockstep bench allreduce --seconds -1",
        ] {
            assert!(parse(line).is_ok(), "{line}");
        }
        for (line, option) in [
            ("lockstep npe sample run --num-samples -5", "--num-samples"),
            ("lockstep npe sample run --injection -1", "--injection"),
            ("lockstep npe pp run --injections -2", "--injections"),
            ("lockstep npe export run --check-pairs -1", "--check-pairs"),
            ("lockstep train c.json --updates -1", "--updates"),
            ("lockstep simulate c.json --trials -1", "--trials"),
            ("lockstep bench nbody --sizes -1,2", "--sizes"),
            ("lockstep bench c2st --simulations -10", "--simulations"),
        ] {
            let e = parse(line).map(drop).unwrap_err().to_string();
            assert!(
                e.contains("invalid value") && e.contains(option),
                "{line}: {e}"
            );
        }
    }

    #[test]
    fn clap_tip_form_gives_the_value_to_the_option() {
        let args = [
            "lockstep",
            "npe",
            "sample",
            "run",
            "--observation",
            "--",
            "-0.5,0.3",
        ];
        let cli = Cli::try_parse_from(without_escape_after_values(args.map(Into::into))).unwrap();
        let Command::Npe(npe::NpeCommand::Sample(a)) = cli.command else {
            panic!("not npe sample")
        };
        assert_eq!(a.observation.as_deref(), Some("-0.5,0.3"));
    }

    #[test]
    fn negative_seeds_count_from_two_to_the_64() {
        assert_eq!(flags::parse_seed("7"), Ok(7));
        assert_eq!(flags::parse_seed("-1"), Ok(u64::MAX));
        assert_eq!(flags::parse_seed("18446744073709551615"), Ok(u64::MAX));
        assert!(flags::parse_seed("-x")
            .unwrap_err()
            .contains("is not a seed"));
    }
}
