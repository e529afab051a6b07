//! A failure on any rank ends the whole job, non-zero, within 10 s, naming the rank.
//! Every job runs under an external time limit; a timeout fails the test.

use lockstep_comm::launch::mpirun_command;
use lockstep_comm::launch::{run_with_limit, JobOutput};
use std::process::Command;
use std::time::Duration;

const CHECK: &str = env!("CARGO_BIN_EXE_lockstep-comm-check");
const LIMIT: Duration = Duration::from_secs(10);

fn assert_failed_fast(out: &JobOutput, rank_text: &str) {
    assert!(
        !out.timed_out,
        "job hung past {LIMIT:?}:\n{}",
        out.all_output()
    );
    assert!(out.code != Some(0), "job exited 0:\n{}", out.all_output());
    assert!(out.elapsed < LIMIT);
    assert!(
        out.all_output().contains(rank_text),
        "output does not name {rank_text:?}:\n{}",
        out.all_output()
    );
}

#[test]
fn thread_comm_panicking_replica_ends_the_process() {
    let mut cmd = Command::new(CHECK);
    cmd.args(["--threads", "3", "fail", "panic", "--rank", "1"]);
    let out = run_with_limit(cmd, LIMIT).unwrap();
    assert_failed_fast(&out, "replica rank 1 failed");
}

fn mpi_fail(how: &str, rank: usize) -> JobOutput {
    let mut cmd = mpirun_command(2);
    cmd.arg(CHECK)
        .args(["fail", how, "--rank", &rank.to_string()]);
    run_with_limit(cmd, LIMIT).unwrap()
}

#[test]
fn mpi_rank_1_panicking_aborts_the_job() {
    let out = mpi_fail("panic", 1);
    assert_failed_fast(&out, "rank 1 panicked");
}

#[test]
fn mpi_rank_0_error_aborts_the_job() {
    let out = mpi_fail("error", 0);
    assert_failed_fast(&out, "error on rank 0");
}

#[test]
fn mpi_rank_1_sigkill_mid_collective_ends_the_job() {
    let out = mpi_fail("sigkill", 1);
    // mpirun reports the killed rank: "process rank 1 ... exited on signal 9".
    assert_failed_fast(&out, "rank 1");
}
