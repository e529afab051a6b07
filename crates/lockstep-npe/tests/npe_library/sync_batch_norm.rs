//! SyncBatchNorm: one training pass of 2 replicas x B samples equals one replica's pass over
//! the 2B samples with plain BatchNorm (per-sample outputs, the averaged gradient and the
//! running statistics, to 1e-5), with every block trainable and with the first blocks frozen
//! (their BatchNorm input then carries no gradient); and replicas that disagree fail with a
//! message instead of hanging.

use crate::common::small_network;
use lockstep_comm::{run_replicas, Communicator, SelfComm};
use lockstep_core::rng::SplitMix64;
use lockstep_npe::{DeviceModel, Norm, NpeNetwork, Placement};
use lockstep_train::{Model, ReplicaContext};

const THETA: usize = 3;
const X: usize = 5;

fn data(n: usize, seed: u64) -> (Vec<f32>, Vec<f32>) {
    let mut rng = SplitMix64::new(seed);
    let theta = (0..n * THETA).map(|_| rng.normal() as f32).collect();
    let x = (0..n * X)
        .map(|_| (1.0 + 2.0 * rng.normal()) as f32)
        .collect();
    (theta, x)
}

/// `(per-sample log q, gradient, running statistics)` after one training pass.
type PassResult = (Vec<f32>, Vec<f32>, Vec<f32>);

fn model(net: &NpeNetwork, frozen: &[String]) -> DeviceModel {
    let mut m = DeviceModel::new(net.clone(), 11, &Placement::Cpu).unwrap();
    m.freeze(frozen).unwrap();
    m
}

fn one_pass(
    m: &mut DeviceModel,
    theta: &[f32],
    x: &[f32],
    n: usize,
    comm: &dyn Communicator,
) -> anyhow::Result<PassResult> {
    let mut grad = vec![0.0f32; m.trainable().len()];
    let lp = m.train_pass(theta, x, n, &mut grad, &ReplicaContext::new(comm))?;
    Ok((lp, grad, m.state().to_vec()))
}

fn max_rel(a: &[f32], b: &[f32]) -> f64 {
    assert_eq!(a.len(), b.len());
    let scale = b
        .iter()
        .fold(0.0f64, |m, v| m.max(v.abs() as f64))
        .max(1e-30);
    a.iter()
        .zip(b)
        .map(|(x, y)| (*x as f64 - *y as f64).abs())
        .fold(0.0, f64::max)
        / scale
}

fn check_two_replicas_equal_one(frozen: &[String]) {
    let net = small_network(THETA, X, Norm::BatchNorm, 3.0);
    let (b, steps) = (8, 3);
    let mut whole = model(&net, frozen);
    let mut halves = [model(&net, frozen), model(&net, frozen)];
    for step in 0..steps {
        let (theta, x) = data(2 * b, 100 + step);
        let (lp, grad, stats) = one_pass(&mut whole, &theta, &x, 2 * b, &SelfComm).unwrap();
        let slots: Vec<_> = halves.iter_mut().map(std::sync::Mutex::new).collect();
        let results = run_replicas(2, |comm| {
            let r = comm.rank();
            let mut m = slots[r].lock().unwrap();
            one_pass(
                &mut m,
                &theta[r * b * THETA..(r + 1) * b * THETA],
                &x[r * b * X..(r + 1) * b * X],
                b,
                &comm,
            )
        })
        .unwrap();
        let lp2: Vec<f32> = results.iter().flat_map(|r| r.0.clone()).collect();
        let grad2: Vec<f32> = results[0]
            .1
            .iter()
            .zip(&results[1].1)
            .map(|(a, b)| 0.5 * (a + b))
            .collect();
        assert!(
            max_rel(&lp2, &lp) <= 1e-5,
            "outputs: {:e}",
            max_rel(&lp2, &lp)
        );
        assert!(
            max_rel(&grad2, &grad) <= 1e-5,
            "step {step}: gradients differ by {:e} (frozen {frozen:?})",
            max_rel(&grad2, &grad)
        );
        assert_eq!(results[0].2, results[1].2, "running statistics differ");
        assert!(
            max_rel(&results[0].2, &stats) <= 1e-5,
            "running statistics: {:e}",
            max_rel(&results[0].2, &stats)
        );
        // Not trivially equal: a replica's own batch alone gives other statistics.
        let mut alone = model(&net, frozen);
        let (_, g_alone, s_alone) =
            one_pass(&mut alone, &theta[..b * THETA], &x[..b * X], b, &SelfComm).unwrap();
        assert!(max_rel(&g_alone, &results[0].1) > 1e-3);
        assert!(max_rel(&s_alone, &results[0].2) > 1e-4);
        // Every model takes the same small step, so the next pass starts from new values.
        drop(slots);
        for m in std::iter::once(&mut whole).chain(halves.iter_mut()) {
            m.trainable_mut()
                .iter_mut()
                .zip(&grad)
                .for_each(|(p, g)| *p -= 0.05 * g);
        }
    }
}

#[test]
fn two_replicas_with_sync_batch_norm_equal_one_replica_with_twice_the_batch() {
    check_two_replicas_equal_one(&[]);
}

#[test]
fn sync_batch_norm_with_frozen_first_blocks() {
    check_two_replicas_equal_one(&[
        "embedding_net.initial_layer".into(),
        "embedding_net.blocks.0".into(),
    ]);
}

/// Replicas whose networks differ in depth (a bug the engine's checksums would catch only
/// later) fail at the first mismatched reduction with a message naming it, within seconds.
#[test]
fn replicas_that_disagree_fail_instead_of_mixing_statistics() {
    let deep = small_network(THETA, X, Norm::BatchNorm, 3.0);
    let mut config = deep.config.clone();
    config.embedding.hidden_dims = vec![16, 8, 8];
    let deeper = NpeNetwork::new(config, THETA, X, deep.standardization.clone(), 5).unwrap();
    let (theta, x) = data(8, 1);
    let t0 = std::time::Instant::now();
    let failure = run_replicas(2, |comm| {
        let net = if comm.rank() == 0 { &deep } else { &deeper };
        let mut m = model(net, &[]);
        one_pass(&mut m, &theta, &x, 8, &comm).map(|_| ())
    })
    .unwrap_err();
    assert!(t0.elapsed().as_secs() < 10);
    assert!(
        failure.message.contains("BatchNorm") || failure.message.contains("all_reduce"),
        "{}",
        failure.message
    );
}
