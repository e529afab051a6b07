//! The conformance suite on every backend: SelfComm and ThreadComm in-process, MpiComm
//! through real `mpirun -n 2` and `-n 3` child processes under a time limit.

use lockstep_comm::conformance::{run_suite, SuiteOptions};
use lockstep_comm::launch::mpirun_command;
use lockstep_comm::launch::run_with_limit;
use lockstep_comm::{run_replicas, SelfComm};
use std::time::Duration;

const CHECK: &str = env!("CARGO_BIN_EXE_lockstep-comm-check");
const CHECKS: usize = 20;

#[test]
fn self_comm_passes_the_suite() {
    let passed = run_suite(&SelfComm, &SuiteOptions::default()).unwrap();
    assert_eq!(passed.len(), CHECKS);
}

fn threads(n: usize) {
    let results = run_replicas(n, |comm| run_suite(&comm, &SuiteOptions::default()))
        .unwrap_or_else(|f| panic!("{f}"));
    assert!(results.iter().all(|p| p.len() == CHECKS));
}

#[test]
fn thread_comm_2_replicas_passes_the_suite() {
    threads(2);
}

#[test]
fn thread_comm_3_replicas_passes_the_suite() {
    threads(3);
}

fn mpi(n: usize) {
    let mut cmd = mpirun_command(n);
    cmd.arg(CHECK).arg("suite");
    let out = run_with_limit(cmd, Duration::from_secs(120)).unwrap();
    assert!(
        !out.timed_out,
        "mpirun -n {n} timed out:\n{}",
        out.all_output()
    );
    assert!(out.success(), "mpirun -n {n} failed:\n{}", out.all_output());
    let want = format!("conformance: {CHECKS} checks passed on backend mpi with {n} ranks");
    assert!(out.stdout.contains(&want), "{}", out.all_output());
}

#[test]
fn mpi_comm_2_ranks_passes_the_suite() {
    mpi(2);
}

#[test]
fn mpi_comm_3_ranks_passes_the_suite() {
    mpi(3);
}
