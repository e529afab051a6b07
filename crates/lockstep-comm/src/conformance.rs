//! The conformance suite every [`Communicator`] backend must pass.
//!
//! The same checks run on [`SelfComm`](crate::SelfComm), on [`ThreadComm`](crate::ThreadComm)
//! groups and, through the `lockstep-comm-check` binary under `mpirun`, on `MpiComm`. Every
//! check computes the exact expected result on each rank (all test values are small integers,
//! exact in every dtype) and compares element by element.

use crate::{CommExt, Communicator, ReduceOp, Reducible};
use std::fmt::Debug;

/// Sizes of the suite's heavy checks.
#[derive(Debug, Clone)]
pub struct SuiteOptions {
    /// Bytes of the large f32 all-reduce that is checked element by element (default 64 MiB).
    pub large_all_reduce_bytes: usize,
    /// Number of small collectives run back to back (default 10,000).
    pub small_collectives: usize,
}

impl Default for SuiteOptions {
    fn default() -> Self {
        SuiteOptions {
            large_all_reduce_bytes: 64 << 20,
            small_collectives: 10_000,
        }
    }
}

/// Element types exercised by the suite.
trait TestElem: Reducible + PartialEq + Debug {
    const NAME: &'static str;
    const SIGNED: bool;
    fn from_i(v: i64) -> Self;
}

macro_rules! test_elem {
    ($t:ty, $name:expr, $signed:expr) => {
        impl TestElem for $t {
            const NAME: &'static str = $name;
            const SIGNED: bool = $signed;
            fn from_i(v: i64) -> Self {
                v as $t
            }
        }
    };
}
test_elem!(f32, "f32", true);
test_elem!(f64, "f64", true);
test_elem!(u64, "u64", false);
test_elem!(i64, "i64", true);

/// The test value of rank `r` at index `i`: a small integer (negative ones for signed types).
fn value<T: TestElem>(r: usize, i: usize) -> i64 {
    let v = (i % 97) as i64 + 3 * r as i64;
    if T::SIGNED {
        v - 50
    } else {
        v
    }
}

fn check_eq<T: PartialEq + Debug>(what: &str, got: &[T], want: &[T]) -> Result<(), String> {
    if got.len() != want.len() {
        return Err(format!(
            "{what}: got {} elements, expected {}",
            got.len(),
            want.len()
        ));
    }
    if let Some(i) = (0..got.len()).find(|&i| got[i] != want[i]) {
        return Err(format!(
            "{what}: element {i} is {:?}, expected {:?}",
            got[i], want[i]
        ));
    }
    Ok(())
}

fn err<E: std::fmt::Display>(what: &str) -> impl Fn(E) -> String + '_ {
    move |e| format!("{what}: {e}")
}

fn identity(comm: &dyn Communicator) -> Result<(), String> {
    let size = comm.size();
    let ranks = comm
        .all_gather_vec(&[comm.rank() as u64])
        .map_err(err("all_gather of ranks"))?;
    let want: Vec<u64> = (0..size as u64).collect();
    check_eq("rank identity", &ranks, &want)?;
    for _ in 0..10 {
        comm.barrier().map_err(err("barrier"))?;
    }
    Ok(())
}

fn broadcast_typed<T: TestElem>(comm: &dyn Communicator) -> Result<(), String> {
    for root in 0..comm.size() {
        for len in [0usize, 1, 1000] {
            let mut buf: Vec<T> = (0..len)
                .map(|i| T::from_i(value::<T>(comm.rank(), i)))
                .collect();
            comm.broadcast(&mut buf, root).map_err(err("broadcast"))?;
            let want: Vec<T> = (0..len).map(|i| T::from_i(value::<T>(root, i))).collect();
            check_eq(
                &format!("broadcast<{}> from root {root}, {len} elements", T::NAME),
                &buf,
                &want,
            )?;
        }
    }
    Ok(())
}

fn all_reduce_typed<T: TestElem>(comm: &dyn Communicator) -> Result<(), String> {
    let size = comm.size();
    for op in [ReduceOp::Sum, ReduceOp::Max, ReduceOp::Min] {
        for len in [1usize, 7, 1000, 4099] {
            let mut buf: Vec<T> = (0..len)
                .map(|i| T::from_i(value::<T>(comm.rank(), i)))
                .collect();
            comm.all_reduce(&mut buf, op).map_err(err("all_reduce"))?;
            let want: Vec<T> = (0..len)
                .map(|i| {
                    let vals = (0..size).map(|r| value::<T>(r, i));
                    T::from_i(match op {
                        ReduceOp::Sum => vals.sum(),
                        ReduceOp::Max => vals.max().unwrap(),
                        ReduceOp::Min => vals.min().unwrap(),
                    })
                })
                .collect();
            check_eq(
                &format!("all_reduce<{}> {op:?}, {len} elements", T::NAME),
                &buf,
                &want,
            )?;
        }
    }
    Ok(())
}

fn scatter_gather_typed<T: TestElem>(comm: &dyn Communicator) -> Result<(), String> {
    let size = comm.size();
    let n = 33;
    for root in 0..size {
        // scatter: the root holds size*n values; rank r gets slice r.
        let send: Vec<T> = if comm.rank() == root {
            (0..size * n)
                .map(|i| T::from_i(value::<T>(root, i)))
                .collect()
        } else {
            Vec::new()
        };
        let mut recv = vec![T::from_i(0); n];
        comm.scatter(&send, &mut recv, root)
            .map_err(err("scatter"))?;
        let want: Vec<T> = (0..n)
            .map(|k| T::from_i(value::<T>(root, comm.rank() * n + k)))
            .collect();
        check_eq(
            &format!("scatter<{}> from root {root}", T::NAME),
            &recv,
            &want,
        )?;

        // gather: every rank sends n values; the root gets them in rank order.
        let send: Vec<T> = (0..n)
            .map(|k| T::from_i(value::<T>(comm.rank(), k)))
            .collect();
        let mut recv = if comm.rank() == root {
            vec![T::from_i(0); size * n]
        } else {
            Vec::new()
        };
        comm.gather(&send, &mut recv, root).map_err(err("gather"))?;
        if comm.rank() == root {
            let want: Vec<T> = (0..size * n)
                .map(|i| T::from_i(value::<T>(i / n, i % n)))
                .collect();
            check_eq(&format!("gather<{}> to root {root}", T::NAME), &recv, &want)?;
        }
    }
    // all_gather
    let send: Vec<T> = (0..n)
        .map(|k| T::from_i(value::<T>(comm.rank(), k)))
        .collect();
    let got = comm.all_gather_vec(&send).map_err(err("all_gather"))?;
    let want: Vec<T> = (0..size * n)
        .map(|i| T::from_i(value::<T>(i / n, i % n)))
        .collect();
    check_eq(&format!("all_gather<{}>", T::NAME), &got, &want)
}

/// Elements rank `src` sends to rank `dst` in the all-to-all check: uneven, zero for some pairs.
fn a2a_count(src: usize, dst: usize) -> usize {
    ((src + 2 * dst + 1) % 3) * (dst + 1) + if src == dst { 0 } else { src % 2 }
}

fn a2a_value(src: usize, dst: usize, k: usize) -> i64 {
    (src * 10_000 + dst * 100 + k) as i64
}

fn all_to_all_v_typed<T: TestElem>(comm: &dyn Communicator) -> Result<(), String> {
    let size = comm.size();
    let me = comm.rank();
    let counts: Vec<usize> = (0..size).map(|d| a2a_count(me, d)).collect();
    let send: Vec<T> = (0..size)
        .flat_map(|d| (0..a2a_count(me, d)).map(move |k| T::from_i(a2a_value(me, d, k))))
        .collect();
    let (recv, recv_counts) = comm
        .all_to_all_v(&send, &counts)
        .map_err(err("all_to_all_v"))?;
    let want_counts: Vec<usize> = (0..size).map(|s| a2a_count(s, me)).collect();
    check_eq(
        &format!("all_to_all_v<{}> receive counts", T::NAME),
        &recv_counts,
        &want_counts,
    )?;
    let want: Vec<T> = (0..size)
        .flat_map(|s| (0..a2a_count(s, me)).map(move |k| T::from_i(a2a_value(s, me, k))))
        .collect();
    check_eq(&format!("all_to_all_v<{}> data", T::NAME), &recv, &want)?;
    // Everything to one rank, nothing elsewhere.
    let counts: Vec<usize> = (0..size).map(|d| if d == 0 { 5 } else { 0 }).collect();
    let send: Vec<T> = (0..5).map(|k| T::from_i(a2a_value(me, 0, k))).collect();
    let (recv, recv_counts) = comm
        .all_to_all_v(&send, &counts)
        .map_err(err("all_to_all_v"))?;
    let want_total = if me == 0 { 5 * size } else { 0 };
    if recv.len() != want_total || recv_counts.iter().sum::<usize>() != want_total {
        return Err(format!(
            "all_to_all_v<{}> to rank 0 only: rank {me} received {} elements, expected {want_total}",
            T::NAME,
            recv.len()
        ));
    }
    Ok(())
}

fn large_all_reduce(comm: &dyn Communicator, bytes: usize) -> Result<(), String> {
    let n = bytes / 4;
    let size = comm.size();
    let r = comm.rank() as f32;
    let mut buf: Vec<f32> = (0..n).map(|i| (i % 1000) as f32 + r).collect();
    comm.all_reduce(&mut buf, ReduceOp::Sum)
        .map_err(err("large all_reduce"))?;
    let offset = (size * (size - 1) / 2) as f32;
    for (i, &v) in buf.iter().enumerate() {
        let want = size as f32 * (i % 1000) as f32 + offset;
        if v != want {
            return Err(format!(
                "large all_reduce of {bytes} bytes: element {i} is {v}, expected {want}"
            ));
        }
    }
    Ok(())
}

/// Float sums whose rounding depends on the order of the terms must still come out bitwise
/// the same on every rank: compares a hash of each rank's result with rank 0's, for a tiny,
/// a medium and a large (MPI's segmented algorithms) buffer of f32 and f64.
fn bitwise_equal_sums(comm: &dyn Communicator) -> Result<(), String> {
    fn check<T: Reducible + Copy>(
        comm: &dyn Communicator,
        n: usize,
        make: impl Fn(f64) -> T,
        bits: impl Fn(T) -> u64,
    ) -> Result<(), String> {
        let r = comm.rank() as f64;
        let mut buf: Vec<T> = (0..n)
            .map(|i| make(((i as f64) * 0.7 + r * 1.3).sin() * 10f64.powi((i % 9) as i32 - 4)))
            .collect();
        comm.all_reduce(&mut buf, ReduceOp::Sum)
            .map_err(err("all_reduce (bitwise check)"))?;
        // FNV-1a over the element bits.
        let hash = buf.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, &v| {
            (h ^ bits(v)).wrapping_mul(0x100_0000_01b3)
        });
        let all = comm
            .all_gather_vec(&[hash])
            .map_err(err("all_gather (bitwise check)"))?;
        if let Some(q) = all.iter().position(|&h| h != all[0]) {
            return Err(format!(
                "sum of {n} {} elements: rank {q}'s result differs bitwise from rank 0's",
                std::any::type_name::<T>()
            ));
        }
        Ok(())
    }
    for n in [3, 4099, 1 << 20] {
        check(comm, n, |x| x as f32, |v: f32| u64::from(v.to_bits()))?;
        check(comm, n, |x| x, |v: f64| v.to_bits())?;
    }
    Ok(())
}

fn many_small(comm: &dyn Communicator, count: usize) -> Result<(), String> {
    let size = comm.size() as u64;
    let me = comm.rank() as u64;
    for i in 0..count {
        match i % 3 {
            0 => {
                let got = comm
                    .all_reduce_scalar(me + i as u64, ReduceOp::Sum)
                    .map_err(err("small all_reduce"))?;
                let want = size * i as u64 + size * (size - 1) / 2;
                if got != want {
                    return Err(format!(
                        "small collective {i}: all_reduce gave {got}, expected {want}"
                    ));
                }
            }
            1 => {
                let root = i % comm.size();
                let mut v = [if comm.rank() == root { i as f64 } else { -1.0 }];
                comm.broadcast(&mut v, root)
                    .map_err(err("small broadcast"))?;
                if v[0] != i as f64 {
                    return Err(format!(
                        "small collective {i}: broadcast gave {}, expected {i}",
                        v[0]
                    ));
                }
            }
            _ => comm.barrier().map_err(err("small barrier"))?,
        }
    }
    Ok(())
}

/// The first check of [`run_suite`] that failed: its message names the rank, the backend,
/// the check (collective and dtype) and the first wrong element.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct CheckFailed(pub String);

/// Runs every check on `comm` (a collective: call it on every rank).
///
/// Returns the names of the checks that passed, in order. Errors: [`CheckFailed`] for the
/// first failing check, with the rank, the collective, the dtype and the first wrong element.
pub fn run_suite(comm: &dyn Communicator, opts: &SuiteOptions) -> Result<Vec<String>, CheckFailed> {
    let mut passed = Vec::new();
    let mut run = |name: &str, f: &dyn Fn() -> Result<(), String>| -> Result<(), CheckFailed> {
        f().map_err(|e| {
            CheckFailed(format!(
                "rank {} ({}): {name}: {e}",
                comm.rank(),
                comm.backend()
            ))
        })?;
        passed.push(name.to_string());
        Ok(())
    };
    run("identity and barrier", &|| identity(comm))?;
    run("broadcast f32", &|| broadcast_typed::<f32>(comm))?;
    run("broadcast f64", &|| broadcast_typed::<f64>(comm))?;
    run("broadcast u64", &|| broadcast_typed::<u64>(comm))?;
    run("broadcast i64", &|| broadcast_typed::<i64>(comm))?;
    run("all_reduce f32", &|| all_reduce_typed::<f32>(comm))?;
    run("all_reduce f64", &|| all_reduce_typed::<f64>(comm))?;
    run("all_reduce u64", &|| all_reduce_typed::<u64>(comm))?;
    run("all_reduce i64", &|| all_reduce_typed::<i64>(comm))?;
    run("scatter/gather/all_gather f32", &|| {
        scatter_gather_typed::<f32>(comm)
    })?;
    run("scatter/gather/all_gather f64", &|| {
        scatter_gather_typed::<f64>(comm)
    })?;
    run("scatter/gather/all_gather u64", &|| {
        scatter_gather_typed::<u64>(comm)
    })?;
    run("scatter/gather/all_gather i64", &|| {
        scatter_gather_typed::<i64>(comm)
    })?;
    run("all_to_all_v f32", &|| all_to_all_v_typed::<f32>(comm))?;
    run("all_to_all_v f64", &|| all_to_all_v_typed::<f64>(comm))?;
    run("all_to_all_v u64", &|| all_to_all_v_typed::<u64>(comm))?;
    run("all_to_all_v i64", &|| all_to_all_v_typed::<i64>(comm))?;
    run("all_reduce float sums bitwise equal on every rank", &|| {
        bitwise_equal_sums(comm)
    })?;
    let large = opts.large_all_reduce_bytes;
    run(&format!("all_reduce of {} MiB f32", large >> 20), &|| {
        large_all_reduce(comm, large)
    })?;
    let small = opts.small_collectives;
    run(&format!("{small} small collectives"), &|| {
        many_small(comm, small)
    })?;
    Ok(passed)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn all_to_all_counts_include_zeros_and_are_uneven() {
        let counts: Vec<usize> = (0..3)
            .flat_map(|s| (0..3).map(move |d| a2a_count(s, d)))
            .collect();
        assert!(counts.contains(&0));
        assert!(counts.iter().any(|&c| c > 2));
    }
}
