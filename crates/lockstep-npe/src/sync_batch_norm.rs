//! SyncBatchNorm: BatchNorm whose batch statistics cover the global batch of all replicas.
//!
//! With `norm: BatchNorm` and more than one replica, every BatchNorm layer sums, per channel,
//! its local batch's count, sum and centred sum of squares over all replicas in the forward
//! pass (one all-reduce per layer), normalizes with the global mean and biased variance, and
//! updates its running statistics from them (so they stay identical on every replica). The
//! backward pass needs the matching global sums of the incoming gradient `g = dL/dx̂` and of
//! `g x̂` (one all-reduce per layer):
//!
//! `dL/dx_i = (g_i - mean_j g_j - x̂_i mean_j(g_j x̂_j)) / sqrt(var + eps)`, means over the
//! global batch (Ioffe & Szegedy 2015, eq. after alg. 1; PyTorch `SyncBatchNorm`). So 2
//! replicas x B samples train exactly like 1 replica x 2B with BatchNorm.
//!
//! burn runs a backward pass as one call, so the all-reduce inside it is a custom autodiff
//! operation ([`NormBackend`], implemented for every `Autodiff<B>`) whose state holds a
//! [`StatsReducer`]: a channel to the thread that owns the replicas' communicator.
//! [`with_stats_reducer`] runs the pass on a scoped worker thread while the calling thread
//! serves the reductions in the order they arrive; each request carries a tag (layer and
//! direction), summed with the values, so replicas that reach different layers fail with a
//! clear error instead of mixing statistics.

use crate::error::NpeError;
use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::backend::Autodiff;
use burn::tensor::backend::Backend;
use burn::tensor::{Tensor, TensorData, TensorPrimitive};
use lockstep_train::ReplicaContext;
use std::sync::mpsc;

/// One reduction asked for by the pass: the values, the tag every replica must agree on,
/// and where to send the sums.
struct Request {
    values: Vec<f64>,
    tag: u64,
    reply: mpsc::Sender<Result<Vec<f64>, String>>,
}

/// What the worker thread sends to the thread that owns the communicator.
enum Message {
    Reduce(Request),
    /// The pass is over (sent also when it panics), so the serving loop ends.
    Done,
}

/// A handle through which a pass sums per-channel statistics over all replicas (see the
/// module docs). Cloned into the autodiff graph; once its pass is over, a reduction through
/// a leftover clone is an error, never a wait.
#[derive(Clone)]
pub struct StatsReducer {
    to_owner: mpsc::Sender<Message>,
}

impl std::fmt::Debug for StatsReducer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("StatsReducer")
    }
}

impl StatsReducer {
    /// Sums `values` over all replicas, in place. `tag` names the call site (layer and
    /// direction); every replica must pass the same tags in the same order.
    ///
    /// Panics (inside the pass, caught by [`with_stats_reducer`] and returned as its error):
    /// the communicator failed (a peer failed), or the replicas' tags differ.
    pub fn all_reduce_sum(&self, values: &mut [f64], tag: u64) {
        let (reply, answer) = mpsc::channel();
        let request = Request {
            values: values.to_vec(),
            tag,
            reply,
        };
        let sums = self
            .to_owner
            .send(Message::Reduce(request))
            .map_err(|_| "the pass that owned this SyncBatchNorm reducer is over".to_string())
            .and_then(|()| {
                answer
                    .recv()
                    .map_err(|_| "the SyncBatchNorm reduction was dropped".to_string())
            })
            .and_then(|r| r);
        match sums {
            Ok(sums) => values.copy_from_slice(&sums),
            Err(e) => panic!("SyncBatchNorm: {e}"),
        }
    }
}

/// Sends `Done` when the pass ends, also by a panic.
struct DoneOnDrop(mpsc::Sender<Message>);

impl Drop for DoneOnDrop {
    fn drop(&mut self) {
        let _ = self.0.send(Message::Done);
    }
}

/// Runs `pass` on a scoped worker thread with a [`StatsReducer`] whose reductions this thread
/// performs on `replicas` (so an MPI communicator is only ever used by its own thread).
/// Returns what `pass` returns.
///
/// Errors: a panic of the pass (its message; this includes a failed reduction: a failed peer
/// or replicas that disagree on the order of the SyncBatchNorm layers).
pub fn with_stats_reducer<T: Send>(
    replicas: &ReplicaContext<'_>,
    pass: impl FnOnce(&StatsReducer) -> T + Send,
) -> Result<T, NpeError> {
    let (to_owner, from_pass) = mpsc::channel();
    std::thread::scope(|scope| {
        let done = DoneOnDrop(to_owner.clone());
        let reducer = StatsReducer { to_owner };
        // The pass gets the stack of a replica thread (`lockstep_comm::run_replicas`).
        let worker = std::thread::Builder::new()
            .name(format!("rank-{}-pass", replicas.rank()))
            .stack_size(16 << 20)
            .spawn_scoped(scope, move || {
                let _done = done;
                pass(&reducer)
            })
            .map_err(|e| NpeError::io("cannot start the thread of a training pass", e))?;
        while let Ok(Message::Reduce(request)) = from_pass.recv() {
            let mut values = request.values;
            values.push(request.tag as f64);
            let result = replicas
                .all_reduce_sum(&mut values)
                .map_err(|e| format!("the all-reduce of batch statistics failed: {e}"))
                .and_then(|()| {
                    let tags = values.pop().unwrap_or_default();
                    let expected = request.tag as f64 * replicas.replicas() as f64;
                    if tags == expected {
                        Ok(values)
                    } else {
                        Err(format!(
                            "the replicas reached different BatchNorm layers (rank {} at call {}); every replica must run the same network",
                            replicas.rank(),
                            request.tag
                        ))
                    }
                });
            let failed = result.is_err();
            let _ = request.reply.send(result);
            if failed {
                break;
            }
        }
        worker.join().map_err(|payload| {
            let message = payload
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| payload.downcast_ref::<&str>().map(|s| s.to_string()))
                .unwrap_or_else(|| "a panic without a message".into());
            NpeError::Replicas(format!(
                "the training pass failed on rank {}: {message}",
                replicas.rank()
            ))
        })
    })
}

/// The global batch statistics of one SyncBatchNorm layer, per channel.
#[derive(Debug, Clone)]
pub struct GlobalStatistics {
    /// Samples in the global batch.
    pub count: f64,
    /// Mean `[features]`.
    pub mean: Vec<f64>,
    /// Biased variance `[features]` (divided by `count`).
    pub variance: Vec<f64>,
}

/// Sums this replica's statistics of `x: [n, features]` with the others' (one all-reduce of
/// `2 features + 1` values: `n mean`, `n (var + mean^2)` with the local two-pass mean and
/// variance, and `n`; Chan et al. 1979) and returns the global ones.
fn global_statistics<B: Backend>(
    x: &Tensor<B, 2>,
    reducer: &StatsReducer,
    tag: u64,
) -> GlobalStatistics {
    let [n, f] = x.dims();
    let (var, mean) = x.clone().var_mean_bias(0);
    let mean = f64s(mean);
    let var = f64s(var);
    let nf = n as f64;
    let mut sums: Vec<f64> = mean.iter().map(|m| nf * m).collect();
    sums.extend(mean.iter().zip(&var).map(|(m, v)| nf * (v + m * m)));
    sums.push(nf);
    reducer.all_reduce_sum(&mut sums, tag);
    let count = sums[2 * f];
    let mean: Vec<f64> = sums[..f].iter().map(|s| s / count).collect();
    let variance = sums[f..2 * f]
        .iter()
        .zip(&mean)
        .map(|(s, m)| (s / count - m * m).max(0.0))
        .collect();
    GlobalStatistics {
        count,
        mean,
        variance,
    }
}

/// The values of a tensor as f64.
fn f64s<B: Backend, const D: usize>(t: Tensor<B, D>) -> Vec<f64> {
    crate::device::count_host_read();
    t.into_data()
        .convert::<f64>()
        .to_vec::<f64>()
        .unwrap_or_default()
}

/// A `[1, features]` row on `device`.
fn row<B: Backend>(values: &[f64], device: &B::Device) -> Tensor<B, 2> {
    Tensor::<B, 1>::from_data(TensorData::new(values.to_vec(), [values.len()]), device)
        .unsqueeze::<2>()
}

/// `(x̂, 1/sqrt(var + eps))` for `x` with the global statistics.
fn normalize<B: Backend>(
    x: Tensor<B, 2>,
    stats: &GlobalStatistics,
    eps: f64,
) -> (Tensor<B, 2>, Tensor<B, 2>) {
    let device = x.device();
    let inv_std: Vec<f64> = stats
        .variance
        .iter()
        .map(|v| 1.0 / (v + eps).sqrt())
        .collect();
    let inv_std = row::<B>(&inv_std, &device);
    let mean = row::<B>(&stats.mean, &device);
    ((x - mean) * inv_std.clone(), inv_std)
}

/// Backends that can run a SyncBatchNorm layer ([`NormBackend::sync_batch_norm`]). Every
/// `Autodiff<B>` does, with the backward pass of the module docs; the plain backends used for
/// evaluation (ndarray, CUDA) compute the forward pass only.
pub trait NormBackend: Backend {
    /// Normalizes `x: [n, features]` with the batch statistics of all replicas (see the
    /// module docs), returning `x̂ = (x - mean) / sqrt(var + eps)` `[n, features]` and the
    /// global statistics (for the running statistics). `tag` identifies the layer; it must be
    /// unique per layer and below 2^50.
    ///
    /// Panics: a failed reduction (see [`StatsReducer::all_reduce_sum`]).
    fn sync_batch_norm(
        x: Tensor<Self, 2>,
        reducer: &StatsReducer,
        tag: u64,
        eps: f64,
    ) -> (Tensor<Self, 2>, GlobalStatistics) {
        let stats = global_statistics(&x, reducer, 2 * tag);
        let (xhat, _) = normalize(x, &stats, eps);
        (xhat, stats)
    }
}

impl NormBackend for burn::backend::NdArray<f32> {}

impl NormBackend for burn::backend::NdArray<f64> {}

impl NormBackend for burn::backend::Wgpu {}

#[cfg(feature = "cuda")]
impl NormBackend for burn::backend::Cuda {}

/// The backward step of [`NormBackend::sync_batch_norm`] on `Autodiff<B>`.
#[derive(Debug)]
struct SyncBatchNormBackward;

/// What the backward step keeps: `x̂`, `1/sqrt(var + eps)` `[1, features]`, the global
/// count, the reducer and the layer's tag.
#[derive(Debug, Clone)]
struct SyncBatchNormState<B: Backend> {
    xhat: Tensor<B, 2>,
    inv_std: Tensor<B, 2>,
    count: f64,
    reducer: StatsReducer,
    tag: u64,
}

impl<B: Backend> Backward<B, 1> for SyncBatchNormBackward {
    type State = SyncBatchNormState<B>;

    fn backward(
        self,
        ops: Ops<Self::State, 1>,
        grads: &mut Gradients,
        _checkpointer: &mut Checkpointer,
    ) {
        let [parent] = ops.parents;
        let g = grads.consume::<B>(&ops.node);
        let Some(parent) = parent else {
            return;
        };
        let s = ops.state;
        let g = Tensor::<B, 2>::from_primitive(TensorPrimitive::Float(g));
        let f = g.dims()[1];
        let mut sums = f64s(g.clone().sum_dim(0));
        sums.extend(f64s((g.clone() * s.xhat.clone()).sum_dim(0)));
        s.reducer.all_reduce_sum(&mut sums, 2 * s.tag + 1);
        let device = g.device();
        let mean_g: Vec<f64> = sums[..f].iter().map(|v| v / s.count).collect();
        let mean_gx: Vec<f64> = sums[f..].iter().map(|v| v / s.count).collect();
        let dx =
            (g - row::<B>(&mean_g, &device) - s.xhat * row::<B>(&mean_gx, &device)) * s.inv_std;
        grads.register::<B>(parent.id, dx.into_primitive().tensor());
    }
}

impl<B: Backend, C: CheckpointStrategy> NormBackend for Autodiff<B, C> {
    fn sync_batch_norm(
        x: Tensor<Self, 2>,
        reducer: &StatsReducer,
        tag: u64,
        eps: f64,
    ) -> (Tensor<Self, 2>, GlobalStatistics) {
        let x = x.into_primitive().tensor();
        let inner = Tensor::<B, 2>::from_primitive(TensorPrimitive::Float(x.primitive.clone()));
        let stats = global_statistics(&inner, reducer, 2 * tag);
        let (xhat, inv_std) = normalize(inner, &stats, eps);
        let output = xhat.clone().into_primitive().tensor();
        let tracked = match SyncBatchNormBackward
            .prepare::<C>([x.node.clone()])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => prep.finish(
                SyncBatchNormState {
                    xhat,
                    inv_std,
                    count: stats.count,
                    reducer: reducer.clone(),
                    tag,
                },
                output,
            ),
            OpsKind::UnTracked(prep) => prep.finish(output),
        };
        (
            Tensor::from_primitive(TensorPrimitive::Float(tracked)),
            stats,
        )
    }
}
