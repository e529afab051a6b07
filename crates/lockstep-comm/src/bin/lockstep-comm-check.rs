//! `lockstep-comm-check`: runs the Communicator conformance suite, or a failure scenario, on
//! the backend of the current launch. Used by the tests and to check an MPI installation
//! (`cargo build --release -p lockstep-comm` builds it beside the library):
//!
//! ```text
//! lockstep-comm-check suite                         # serial: SelfComm
//! lockstep-comm-check --threads 3 suite             # ThreadComm, 3 replica threads
//! mpirun -n 2 lockstep-comm-check suite             # MpiComm
//! mpirun -n 2 lockstep-comm-check fail panic --rank 1 --step 3
//! ```
//!
//! Failure scenarios (`fail panic|error|sigkill --rank R --step K`): every rank runs
//! all-reduces in a loop; at step K rank R panics, returns an error, or kills itself with
//! SIGKILL. The job must end non-zero within seconds, naming rank R.

use lockstep_comm::conformance::{run_suite, SuiteOptions};
use lockstep_comm::launch::detect_launch;
use lockstep_comm::{run_replicas, CommExt, Communicator, ReduceOp, SelfComm};
use std::process::ExitCode;

#[derive(Debug, Clone, Copy)]
enum Failure {
    Panic,
    Error,
    SigKill,
}

#[derive(Debug, Clone)]
enum Task {
    Suite(SuiteOptions),
    Fail {
        how: Failure,
        rank: usize,
        step: usize,
    },
}

const USAGE: &str = "usage: lockstep-comm-check [--threads N] (suite [--large-mib M] [--small N] | fail panic|error|sigkill --rank R [--step K])";

fn parse_args() -> Result<(Option<usize>, Task), String> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let mut threads = None;
    let mut i = 0;
    let num = |args: &[String], i: usize, flag: &str| -> Result<usize, String> {
        args.get(i)
            .and_then(|v| v.parse().ok())
            .ok_or_else(|| format!("{flag} needs a non-negative integer; {USAGE}"))
    };
    if args.first().map(String::as_str) == Some("--threads") {
        threads = Some(num(&args, 1, "--threads")?);
        i = 2;
    }
    let task = match args.get(i).map(String::as_str) {
        Some("suite") => {
            let mut opts = SuiteOptions::default();
            let mut j = i + 1;
            while j < args.len() {
                match args[j].as_str() {
                    "--large-mib" => {
                        opts.large_all_reduce_bytes = num(&args, j + 1, "--large-mib")? << 20
                    }
                    "--small" => opts.small_collectives = num(&args, j + 1, "--small")?,
                    other => return Err(format!("unknown option {other:?}; {USAGE}")),
                }
                j += 2;
            }
            Task::Suite(opts)
        }
        Some("fail") => {
            let how = match args.get(i + 1).map(String::as_str) {
                Some("panic") => Failure::Panic,
                Some("error") => Failure::Error,
                Some("sigkill") => Failure::SigKill,
                _ => return Err(format!("fail needs panic, error or sigkill; {USAGE}")),
            };
            let (mut rank, mut step) = (0, 3);
            let mut j = i + 2;
            while j < args.len() {
                match args[j].as_str() {
                    "--rank" => rank = num(&args, j + 1, "--rank")?,
                    "--step" => step = num(&args, j + 1, "--step")?,
                    other => return Err(format!("unknown option {other:?}; {USAGE}")),
                }
                j += 2;
            }
            Task::Fail { how, rank, step }
        }
        _ => return Err(USAGE.to_string()),
    };
    Ok((threads, task))
}

fn run(comm: &dyn Communicator, task: &Task) -> Result<(), String> {
    match task {
        Task::Suite(opts) => {
            let passed = run_suite(comm, opts).map_err(|e| e.to_string())?;
            if comm.is_chief() {
                for p in &passed {
                    println!("ok: {p}");
                }
                println!(
                    "conformance: {} checks passed on backend {} with {} ranks",
                    passed.len(),
                    comm.backend(),
                    comm.size()
                );
            }
            Ok(())
        }
        Task::Fail { how, rank, step } => {
            for k in 0..100_000 {
                if k == *step && comm.rank() == *rank {
                    match how {
                        Failure::Panic => panic!("injected panic on rank {rank} at step {k}"),
                        Failure::Error => {
                            return Err(format!("injected error on rank {rank} at step {k}"))
                        }
                        Failure::SigKill => {
                            // SAFETY: raising a signal on our own process.
                            unsafe { libc::raise(libc::SIGKILL) };
                        }
                    }
                }
                let mut v = vec![1.0f32; 1 << 12];
                comm.all_reduce(&mut v, ReduceOp::Sum)
                    .map_err(|e| e.to_string())?;
                std::thread::sleep(std::time::Duration::from_millis(1));
            }
            Err("the injected failure did not happen: is --rank below the rank count?".into())
        }
    }
}

fn main() -> ExitCode {
    let (threads, task) = match parse_args() {
        Ok(v) => v,
        Err(e) => {
            eprintln!("lockstep-comm-check: {e}");
            return ExitCode::from(2);
        }
    };
    let launch = match detect_launch() {
        Ok(l) => l,
        Err(e) => {
            eprintln!("lockstep-comm-check: {e}");
            return ExitCode::from(2);
        }
    };
    if let Some(n) = threads {
        return match run_replicas(n, |comm| run(&comm, &task)) {
            Ok(_) => ExitCode::SUCCESS,
            Err(f) => {
                eprintln!("lockstep-comm-check: {f}");
                ExitCode::FAILURE
            }
        };
    }
    if launch.is_mpi_launch() {
        #[cfg(feature = "mpi")]
        {
            let comm = match lockstep_comm::MpiComm::init() {
                Ok(c) => c,
                Err(e) => {
                    eprintln!("lockstep-comm-check: {e}");
                    return ExitCode::FAILURE;
                }
            };
            if let Err(e) = run(&comm, &task) {
                lockstep_comm::eprint_flush(&format!(
                    "lockstep-comm-check: error on rank {}: {e}",
                    comm.rank()
                ));
                comm.abort(1);
            }
            return ExitCode::SUCCESS;
        }
        #[cfg(not(feature = "mpi"))]
        {
            eprintln!(
                "lockstep-comm-check: launched by {} but built without the `mpi` feature",
                launch.launcher
            );
            return ExitCode::FAILURE;
        }
    }
    match run(&SelfComm, &task) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("lockstep-comm-check: error on rank 0: {e}");
            ExitCode::FAILURE
        }
    }
}
