//! `lockstep bench npe`: training speed of the Dingo-shaped NPE network at a CPU-sized width
//! (the `gw_chirp` task's 708 whitened strain values into a LayerNorm residual embedding
//! network, then 6 rational-quadratic spline coupling steps; ~1.42M parameters), batch 512:
//!
//! 1. one replica on one core: seconds per optimizer step (loss, gradient, Adam) and samples
//!    per second on one fixed simulated batch, with the split into unpacking the flat
//!    parameter buffer into tensors, the forward pass (embedding, flow), the backward pass,
//!    packing the gradients into the flat buffer, and the Adam update;
//! 2. the same network in PyTorch eager on the same batch and the same initial parameters
//!    (`scripts/peers/npe_torch.py`, run by `--python` when it imports torch), at 1 and 2
//!    threads, with the time ratios and the loss of both at the initial parameters;
//! 3. the engine (`lockstep npe`'s training path, simulation included) at the same global
//!    batch with 1 replica, N thread replicas and N MPI ranks (each also with a loader
//!    thread, `local.num_workers: 1`): updates/s and the speed-up,
//!    next to PyTorch DistributedDataParallel (gloo, N processes of 1 thread, each with
//!    batch / N samples of the same batch) when torch is importable, and the machine's
//!    bound for N replicas (`independent`: N 1-replica processes of batch / N samples at
//!    once that never communicate, each update the slowest of them);
//! 4. normalization (embedding and flow): LayerNorm, BatchNorm and, under N replicas,
//!    SyncBatchNorm (threads and MPI) and BatchNorm with each replica's local statistics
//!    (what DDP without `convert_sync_batchnorm` trains; the bench wraps the model so that
//!    the engine runs it, which `lockstep npe` refuses), seconds per update in one run, so
//!    the cost of the batch statistics' collectives is seen.
//!
//! With `--device gpu` (burn's wgpu backend on the first adapter lockstep-gpu lists) or
//! `--device cuda`, part 1 runs on that device instead: seconds per step, the phases (each
//! ended by a device sync, so a phase's time is its kernels' time), the cost of copying the
//! parameters to the device and the gradient back into the flat buffer the all-reduce sends,
//! and the device memory burn's allocator holds; then the same step in mixed precision
//! (float16 linear layers and activations, where the device has float16), the kernel
//! launches per step by kernel (float32 and mixed precision, counted in a child process
//! through CubeCL's launch log), and PyTorch eager on torch's `cuda` device in float32 and
//! with autocast and GradScaler (a note when torch has no CUDA). The other parts are CPU
//! measurements and are skipped.
//!
//! Measured on lavapipe (2 cores): with the spline couplings composed from burn's
//! operations, 3,699 launches per float32 step and 4,510 in mixed precision (809 of them
//! casts); with the spline kernels (`lockstep_npe::spline_kernel`, one launch forward and one
//! backward per coupling) 1,989 and 2,800, and 2,638 once mixed precision kept its float16
//! casts for the backward pass (647 casts). There the float32 step went from 1.16-1.24 to
//! 1.09-1.12 s and the mixed one from 1.44-1.56 to 1.26-1.30 s (batch 512, two runs of
//! each in turn): lavapipe's time is mostly arithmetic, where a GPU's would be launches. burn's
//! `fusion` feature cut a gaussian_linear step from about 1,960 to 1,060 launches but made
//! it about twice as slow there (its per-operation host work), so it is not enabled; on an
//! NVIDIA GPU neither is measured yet. With the parameters placed in one allocation (no
//! slice kernels), the gradients and log q read back together after the backward pass (no
//! `cat`; one host synchronisation per step instead of two) and ELU and the sigmoid as a
//! kernel each way: 1,346 launches per float32 step and 2,323 in mixed precision (whose
//! float16 activations stay composed). With LayerNorm (and the ELU after it), the bias and
//! ELU after a gated block's first product, the gated tail, the LU map's weight and
//! log-determinant and the coupling's end as a kernel each way
//! (`lockstep_npe::{layer_kernel, lu_kernel, coupling_kernel}`): 551 launches per float32
//! step (193 of them matrix products) and 1,552 in mixed precision (615 casts); with mixed
//! precision's float16 activations as a kernel each way, the casts inside: 1,144 (471 casts,
//! those of the float16 linear layers' operands, results and gradients). The bench prints
//! the host synchronisations per step
//! (`lockstep_npe::device::host_reads`; of them the gradient's, `gradient_reads`: 0 since the
//! optimizer runs on the device, `lockstep_npe::resident`, where the step launches 710
//! kernels in float32 and 1,304 in mixed precision, 158 of them packing the gradients and 1
//! Adam's update) and the host's time recording the step and
//! waiting for its read-back; on lavapipe the device is the CPU itself, so the recording
//! time there includes most of the arithmetic and says little about a GPU.
//!
//! Since then (the flow on one state tensor, the gated tails' context products inside
//! their kernel, the loss as a scaled gradient; in mixed precision one cast of all the
//! weights per pass, float16 ELU outputs and gradients where a float16 product reads them):
//! 393 launches per float32 step and 475 mixed. CubeCL submits every `CUBECL_WGPU_MAX_TASKS` launches (default 32): with 32,
//! lavapipe's recording time per float32 step was 2.33 s (each submission runs its work
//! before the next is recorded), with 1,024 (one submission per step) 8.6 ms, that is about
//! 22 us of host work per launch (autodiff graph and queuing), and the whole step 2.77 s
//! against 2.15 s (batch 512, 5 steps). On a GPU fewer submissions cost less host time but
//! leave the GPU idle until the first one; lockstep keeps the default (13 submissions per
//! step, execution overlapping the recording) until an NVIDIA measurement says otherwise;
//! the variable overrides it.
//!
//! CubeCL's memory pools (`--memory-pools`, `lockstep_npe::device::set_memory_pools`),
//! measured at 475 mixed-precision launches (batch 512, 4 steps after 1, two runs of each in
//! turn, lavapipe): with CUBECL_WGPU_MAX_TASKS=1024, so that the recording time is the
//! host's work alone, sub-slices (CubeCL's default) recorded a float32 step in 9.0 and 11.9
//! ms and a mixed one in 9.7 and 10.7 ms, exclusive pages in 9.8 and 13.0 ms (mixed): no
//! difference beyond the noise, and with the default submission the steps took 2.41-2.53 s
//! either way. Exclusive pages reserved 40-56 MiB against 64 MiB. lockstep keeps CubeCL's
//! default; the flag is there to measure it on a GPU.
//!
//! burn's `fusion` on the fused step (a build with `--features lockstep-cli/fusion`, then
//! `LOCKSTEP_NPE_FUSION=1`; lockstep's kernels are barriers to it, see
//! `lockstep_npe::fusion_backend`), lavapipe, batch 512: 392 launches per float32 step and
//! 472 mixed (393 and 475 without; 14 and 15 of them burn's fused kernels), and with
//! `CUBECL_WGPU_MAX_TASKS=100000` 55-60 ms of host recording per float32 step against 8-10
//! ms (42-61 against 9-10 mixed; two runs of each in turn). It is not used: it can save no
//! more than the 1 to 3 launches it saved.

use super::npy::write_npy;
use anyhow::{anyhow, bail, Context, Result};
use lockstep_comm::World;
use lockstep_npe::settings::Launch;
use lockstep_npe::step_phases::{phase_names, PhaseRun};
use lockstep_npe::Task;
use lockstep_npe::{
    trained, DeviceKind, DeviceModel, NpeNetwork, NpeSettings, Placement, TaskSource,
};
use lockstep_train::config::EngineConfig;
use lockstep_train::job::run_job;
use lockstep_train::{BatchSource, EngineOptions, Model, Optimizer, OptimizerConfig, TrainSummary};
use std::path::Path;
use std::process::Command;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Options of `lockstep bench npe`.
#[derive(Debug, clap::Args)]
pub struct BenchNpeArgs {
    /// Samples per optimizer step (the global batch of the replica runs).
    #[arg(allow_negative_numbers = true, long, default_value_t = 512)]
    pub batch: usize,
    /// Timed steps per measurement (the median is reported).
    #[arg(allow_negative_numbers = true, long, default_value_t = 10)]
    pub steps: usize,
    /// Warm-up steps per measurement (not timed).
    #[arg(allow_negative_numbers = true, long, default_value_t = 2)]
    pub warmup: usize,
    /// Replicas N of the parallel runs.
    #[arg(allow_negative_numbers = true, long, default_value_t = 2)]
    pub replicas: usize,
    /// Python interpreter that imports torch and numpy (the PyTorch comparison is skipped,
    /// with a note, when it cannot).
    #[arg(long, default_value = "python3")]
    pub python: String,
    /// Skip the PyTorch comparison.
    #[arg(long)]
    pub no_torch: bool,
    /// Skip the replica runs.
    #[arg(long)]
    pub no_replicas: bool,
    /// Skip the MPI run.
    #[arg(long)]
    pub no_mpi: bool,
    /// Internal: one rank of the MPI measurement.
    #[arg(long, hide = true)]
    pub mpi_worker: bool,
    /// Internal: `local.num_workers` of the MPI measurement (its loader thread).
    #[arg(allow_negative_numbers = true, long, hide = true, default_value_t = 0)]
    pub workers: usize,
    /// Internal: one of the independent 1-replica processes (the machine's bound).
    #[arg(long, hide = true)]
    pub independent_worker: bool,
    /// Skip the machine-bound run (N independent 1-replica processes at once).
    #[arg(long)]
    pub no_independent: bool,
    /// Skip the normalization table.
    #[arg(long)]
    pub no_norms: bool,
    /// Internal: the norm of every layer of the MPI measurement (`layer_norm`,
    /// `batch_norm`); the main network's norms when absent.
    #[arg(long, hide = true)]
    pub norm: Option<String>,
    /// Where the one-replica step runs: cpu (all parts), gpu (burn's wgpu backend on the
    /// first adapter) or cuda (a build with the cuda feature); on a GPU only part 1 runs.
    #[arg(long, default_value = "cpu")]
    pub device: String,
    /// CubeCL's memory pools for `--device gpu`: sub-slices (CubeCL's default, what training
    /// uses) or exclusive-pages (one page per tensor, pages reused by size), to measure the
    /// step with each.
    #[arg(long, default_value = "sub-slices")]
    pub memory_pools: String,
    /// Internal: count the kernel launches of the device step (float32 and mixed
    /// precision), logging them to this file, and print the counts as JSON.
    #[arg(long, hide = true)]
    pub count_launches: Option<std::path::PathBuf>,
}

/// The benchmark's network and task, as Dingo-shaped settings (`BATCH`, `SAMPLES`,
/// `REPLICAS`, `WORKERS` and the norms are filled in).
const SETTINGS: &str = "
data:
  task: {name: gw_chirp, f_max: 64}
  num_samples: SAMPLES
  train_fraction: 1.0
  seed: 1
model:
  posterior_model_type: normalizing_flow
  posterior_kwargs:
    num_flow_steps: 6
    base_transform_kwargs: {hidden_dim: 160, num_transform_blocks: 2, num_bins: 8,
                            base_transform_type: rq-coupling, norm: FLOW_NORM, tail_bound: 1.0}
  embedding_kwargs: {output_dim: 64, hidden_dims: [256, 256, 128, 128], norm: EMBEDDING_NORM}
training:
  stage_0:
    epochs: 1
    batch_size: BATCH
    optimizer: {type: adam, lr: 0.001}
local:
  replicas: REPLICAS
  num_workers: WORKERS
";

fn settings(
    batch: usize,
    updates: usize,
    replicas: usize,
    workers: usize,
    norm: Option<&str>,
) -> Result<(NpeSettings, serde_json::Value)> {
    let text = SETTINGS
        .replace("EMBEDDING_NORM", norm.unwrap_or("layer_norm"))
        .replace("FLOW_NORM", norm.unwrap_or("none"))
        .replace("SAMPLES", &(batch * updates).to_string())
        .replace("BATCH", &batch.to_string())
        .replace("REPLICAS", &replicas.to_string())
        .replace("WORKERS", &workers.to_string());
    Ok(NpeSettings::from_yaml(&text)?)
}

fn median(v: &[f64]) -> f64 {
    let mut v = v.to_vec();
    v.sort_by(f64::total_cmp);
    match v.len() {
        0 => f64::NAN,
        n if n % 2 == 1 => v[n / 2],
        n => 0.5 * (v[n / 2 - 1] + v[n / 2]),
    }
}

/// Runs the benchmark and prints its tables.
pub fn run(args: &BenchNpeArgs, world: &World) -> Result<()> {
    if args.steps == 0 || args.batch == 0 {
        bail!("--steps and --batch must be at least 1");
    }
    let pools: lockstep_npe::device::MemoryPools = args
        .memory_pools
        .parse()
        .map_err(|e| anyhow!("--memory-pools: {e}"))?;
    if args.device != "gpu" && pools != Default::default() {
        bail!("--memory-pools: only --device gpu takes another than sub-slices");
    }
    let updates = args.warmup + args.steps;
    if args.mpi_worker {
        let ranks = world.comm().size();
        let run = EngineRun {
            replicas: ranks,
            workers: args.workers,
            launch: Launch::Mpi(ranks),
            norm: args.norm.as_deref(),
            local_statistics: false,
        };
        let times = engine(world, args.batch, updates, &run)?;
        if world.comm().is_chief() {
            println!("{}", serde_json::to_string(&times)?);
        }
        return Ok(());
    }
    if args.independent_worker {
        let times = engine(world, args.batch, updates, &EngineRun::serial(0))?;
        println!("{}", serde_json::to_string(&times)?);
        return Ok(());
    }
    if world.comm().size() > 1 {
        bail!("run `lockstep bench npe` without mpirun: it starts its own MPI job");
    }
    let (s, _) = settings(args.batch, updates, 1, 0, None)?;
    let task = s.task()?;
    let network = trained::network(&s, task.as_ref())?;
    let batch = TaskSource::new(task.clone(), 7).global_batch(0, args.batch)?;
    let n = args.batch;
    let params = network.layout().len();
    println!(
        "NPE network: gw_chirp x {} -> embedding [256, 256, 128, 128] -> 64 (LayerNorm), 6 RQ-spline coupling steps (hidden 160, 2 blocks, 8 bins) over theta {}; {} parameters; batch {n}",
        network.x_dim, network.theta_dim, params
    );

    let kind: DeviceKind = args.device.parse().map_err(|e| anyhow!("--device: {e}"))?;
    crate::flags::check_cpu_flag(&args.device)?;
    if kind != DeviceKind::Cpu {
        if let Some(log) = &args.count_launches {
            lockstep_npe::device::log_kernel_launches(log)?;
        }
        lockstep_npe::device::set_memory_pools(pools)?;
        let placement =
            Placement::for_slot(kind, 0).map_err(|e| anyhow!("--device {}: {e}", args.device))?;
        return on_device(args, &network, s.data.seed, &batch, &placement);
    }
    let (step, initial, initial_loss) =
        single_core(args, &network, s.data.seed, &batch.targets, &batch.inputs)?;
    let ddp = if args.no_torch {
        None
    } else {
        compare_with_torch(args, &network, &initial, &batch, step, initial_loss)
    };
    if !args.no_replicas {
        replica_table(args, world, updates, ddp)?;
    }
    if !args.no_norms {
        norm_table(args, world, updates)?;
    }
    Ok(())
}

/// Part 1 of the bench, one replica on one core: the model's own step (median seconds), then
/// the same step split in phases; returns the step time, the initial parameters and the loss
/// at them.
fn single_core(
    args: &BenchNpeArgs,
    network: &NpeNetwork,
    seed: u64,
    theta: &[f32],
    x: &[f32],
) -> Result<(f64, Vec<f32>, f64)> {
    let n = args.batch;
    let updates = args.warmup + args.steps;
    let params = network.layout().len();
    let mut model = DeviceModel::new(network.clone(), seed, &Placement::Cpu)?;
    let initial = model.trainable().to_vec();
    let lp = model.log_prob(theta, x, n);
    let initial_loss = -lp.iter().map(|&v| v as f64).sum::<f64>() / n as f64;
    let mut opt = Optimizer::new(OptimizerConfig::default(), params);
    let mut grad = vec![0.0f32; params];
    let mut step_s = Vec::new();
    for i in 0..updates {
        let t = Instant::now();
        model.nll_and_grad(theta, x, n, &mut grad);
        opt.update(model.trainable_mut(), &grad);
        if i >= args.warmup {
            step_s.push(t.elapsed().as_secs_f64());
        }
    }
    let phases = model.step_phases(&initial, &phase_run(args, theta, x), &mut || {})?;
    let step = median(&step_s);
    println!(
        "\n1 replica, 1 core (burn ndarray backend, f32): median of {} steps after {} warm-up",
        args.steps, args.warmup
    );
    println!("{:>28} {:>10} {:>8}", "phase", "ms", "% step");
    let names = phase_names(true);
    let sum: f64 = phases.iter().sum();
    for (name, t) in names.iter().zip(&phases) {
        println!("{:>28} {:>10.2} {:>8.1}", name, 1e3 * t, 100.0 * t / sum);
    }
    println!("{:>28} {:>10.2} {:>8.1}", "sum of phases", 1e3 * sum, 100.0);
    println!(
        "step (NpeModel::nll_and_grad + Adam): {:.4} s/step, {:.0} samples/s; pack + unpack {:.2} ms = {:.2}% of the step",
        step,
        n as f64 / step,
        1e3 * (phases[0] + phases[4]),
        100.0 * (phases[0] + phases[4]) / step
    );
    Ok((step, initial, initial_loss))
}

/// Part 1 on a GPU (`--device gpu|cuda`): seconds per step and its phases, the copies
/// between the flat host buffers and the device, and the device memory in use.
fn on_device(
    args: &BenchNpeArgs,
    network: &NpeNetwork,
    seed: u64,
    batch: &lockstep_train::Batch,
    placement: &Placement,
) -> Result<()> {
    let fusion = std::env::var("LOCKSTEP_NPE_FUSION").is_ok_and(|v| v == "1");
    println!(
        "device: {}{}",
        placement.describe(),
        if fusion && placement.kind() == DeviceKind::Gpu {
            " (burn's fusion: LOCKSTEP_NPE_FUSION=1)"
        } else {
            ""
        }
    );
    if placement.kind() == DeviceKind::Gpu {
        println!(
            "CubeCL memory pools: {} (--memory-pools)",
            args.memory_pools
        );
    }
    let model = DeviceModel::new(network.clone(), seed, placement)?;
    if matches!(model, DeviceModel::Cpu(_)) {
        bail!("on_device runs on a GPU");
    }
    device_step(args, model, batch, placement)
}

/// [`on_device`] for the model's backend.
fn device_step(
    args: &BenchNpeArgs,
    mut model: DeviceModel,
    batch: &lockstep_train::Batch,
    placement: &Placement,
) -> Result<()> {
    let (theta, x, n) = (&batch.targets, &batch.inputs, args.batch);
    let params = model.trainable().len();
    let initial = model.trainable().to_vec();
    if let Some(log) = &args.count_launches {
        return count_launches(args, model, batch, placement, log);
    }
    let mut opt = Optimizer::new(OptimizerConfig::default(), params);
    let mut grad = vec![0.0f32; params];
    let mut step_s = Vec::new();
    let mut host = HostCost::default();
    let first = Instant::now();
    to_device(&mut model, &opt)?;
    for i in 0..args.warmup + args.steps {
        let t = Instant::now();
        let reads = lockstep_npe::device::host_reads();
        let gradient_reads = lockstep_npe::device::gradient_reads();
        let loss = train_step(&mut model, &mut opt, &mut grad, (theta, x, n), None)?;
        if !loss.is_finite() {
            bail!("the loss is {loss}");
        }
        if i == 0 {
            println!(
                "first step (kernels compiled): {:.2} s",
                first.elapsed().as_secs_f64()
            );
        }
        if i >= args.warmup {
            step_s.push(t.elapsed().as_secs_f64());
            host.add(
                &model,
                lockstep_npe::device::host_reads() - reads,
                lockstep_npe::device::gradient_reads() - gradient_reads,
            );
        }
    }
    from_device(&mut model);
    println!("{}", host.line("float32"));
    let mut memory: Option<(u64, u64)> = None;
    let phases = model.step_phases(&initial, &phase_run(args, theta, x), &mut || {
        if let Some((u, r)) = placement.memory() {
            let (pu, pr) = memory.unwrap_or((0, 0));
            memory = Some((pu.max(u), pr.max(r)));
        }
    })?;
    let step = median(&step_s);
    println!(
        "\n1 replica on {} (burn, f32): median of {} steps after {} warm-up",
        placement.kind(),
        args.steps,
        args.warmup
    );
    println!("{:>28} {:>10} {:>8}", "phase", "ms", "% step");
    let names = phase_names(false);
    let sum: f64 = phases.iter().sum();
    for (name, t) in names.iter().zip(&phases) {
        println!("{:>28} {:>10.2} {:>8.1}", name, 1e3 * t, 100.0 * t / sum);
    }
    println!("{:>28} {:>10.2} {:>8.1}", "sum of phases", 1e3 * sum, 100.0);
    println!(
        "step (NpeModel::nll_and_grad + Adam): {:.4} s/step, {:.0} samples/s; parameter and gradient copies {:.2} ms = {:.1}% of the step ({} values, {:.1} MiB each way)",
        step,
        n as f64 / step,
        1e3 * (phases[0] + phases[4]),
        100.0 * (phases[0] + phases[4]) / step,
        params,
        4.0 * params as f64 / (1u64 << 20) as f64
    );
    match memory {
        Some((used, reserved)) => println!(
            "device memory at the end of the backward pass (activations and gradients alive): {:.1} MiB in use, {:.1} MiB reserved by burn's allocator",
            used as f64 / (1u64 << 20) as f64,
            reserved as f64 / (1u64 << 20) as f64
        ),
        None => println!("device memory: not reported by this backend"),
    }
    // Mixed precision: the same step with float16 linear layers and activations.
    match placement.half_precision() {
        Ok(()) => {
            let (amp, host) = amp_steps(args, &mut model, &initial, batch)?;
            println!("{}", host.line("mixed precision"));
            println!(
                "mixed precision (automatic_mixed_precision: float16 linear layers and activations, float32 weights, loss scale {AMP_SCALE}): {:.4} s/step, {:.0} samples/s; float32/mixed time ratio {:.2}",
                amp,
                n as f64 / amp,
                step / amp
            );
        }
        Err(e) => println!("mixed precision: not measured: automatic_mixed_precision {e}"),
    }
    match launches_child(args) {
        Ok(text) => print!("{text}"),
        Err(e) => println!("kernel launches: not counted: {e:#}"),
    }
    if !args.no_torch {
        torch_on_device(args, model.network(), &initial, batch, step);
    }
    Ok(())
}

/// PyTorch eager on the GPU beside lockstep's device step: the same network, batch and
/// initial parameters on torch's `cuda` device, in float32 and with `torch.autocast`
/// (float16 on CUDA) and `GradScaler`; prints the table, or a note when torch has no CUDA
/// device.
fn torch_on_device(
    args: &BenchNpeArgs,
    network: &NpeNetwork,
    initial: &[f32],
    batch: &lockstep_train::Batch,
    step: f64,
) {
    let n = args.batch as f64;
    let extra = serde_json::json!({"threads": [], "ddp_processes": 0, "device": "cuda"});
    let v = match torch_script(args, network, initial, &batch.targets, &batch.inputs, extra) {
        Ok(v) => v,
        Err(e) => {
            println!("\nnote: no PyTorch comparison on the GPU: {e:#}");
            return;
        }
    };
    if let Some(e) = v["device_error"].as_str() {
        println!("\nnote: no PyTorch comparison on the GPU: {e}");
        return;
    }
    println!(
        "\nPyTorch eager ({}) on {}, same network, batch and initial parameters:",
        v["torch_version"].as_str().unwrap_or("?"),
        v["device_name"].as_str().unwrap_or("its GPU")
    );
    println!(
        "{:>30} {:>10} {:>12} {:>22}",
        "run", "s/step", "samples/s", "lockstep f32/torch time"
    );
    for (key, name) in [
        ("float32", "torch float32"),
        ("amp", "torch autocast + GradScaler"),
    ] {
        let times: Vec<f64> = v["device_runs"][key]
            .as_array()
            .map(|a| a.iter().filter_map(|x| x.as_f64()).collect())
            .unwrap_or_default();
        if times.is_empty() {
            continue;
        }
        let t = median(&times);
        println!(
            "{:>30} {:>10.4} {:>12.0} {:>22.2}",
            name,
            t,
            n / t,
            step / t
        );
    }
}

/// One training step of `model` as the engine runs it: the pass on `(theta, x, n)`, then
/// the update, on the device where the model keeps its training state there
/// ([`Model::device_state`]: nothing of the gradient is read back), else by `opt` on the
/// host from the gradient read into `grad`. With `unscale` (mixed precision) the gradient
/// is unscaled first and an overflowing step is skipped. Returns the pass's loss.
fn train_step(
    model: &mut DeviceModel,
    opt: &mut Optimizer,
    grad: &mut [f32],
    (theta, x, n): (&[f32], &[f32], usize),
    unscale: Option<f32>,
) -> Result<f64> {
    let loss = model.nll_and_grad(theta, x, n, grad);
    if let Some(d) = model.device_state() {
        let finite = unscale.is_none() || d.gradient_is_finite()?;
        let step = finite.then(|| opt.device_update(1.0, unscale.unwrap_or(1.0)));
        d.finish_update(step.as_ref(), None)?;
        return Ok(loss);
    }
    let mut finite = true;
    if let Some(inv) = unscale {
        for g in grad.iter_mut() {
            *g *= inv;
            finite &= g.is_finite();
        }
    }
    if finite {
        opt.update(model.trainable_mut(), grad);
    }
    Ok(loss)
}

/// Moves `model`'s training state to its device where it keeps it there (the engine's
/// start of a run), with `opt`'s slots.
fn to_device(model: &mut DeviceModel, opt: &Optimizer) -> Result<()> {
    if let Some(d) = model.device_state() {
        d.upload(&opt.slots)?;
    }
    Ok(())
}

/// Ends [`to_device`]: the host's buffers are the model's again.
fn from_device(model: &mut DeviceModel) {
    if let Some(d) = model.device_state() {
        d.release();
    }
}

/// The loss scale of the bench's mixed-precision steps (PyTorch GradScaler's initial scale).
const AMP_SCALE: f32 = 65536.0;

/// The host's side of the timed device steps: read-backs (host synchronisations) and the
/// host's time recording the step and waiting for its results
/// ([`DeviceModel::last_step_times`]).
#[derive(Debug, Default)]
struct HostCost {
    /// Read-backs per timed step ([`lockstep_npe::device::host_reads`]).
    syncs: Vec<f64>,
    /// Of them, gradient read-backs ([`lockstep_npe::device::gradient_reads`]).
    gradient_syncs: Vec<f64>,
    /// Seconds recording per timed step.
    recording: Vec<f64>,
    /// Seconds waiting for the read-back per timed step.
    reading: Vec<f64>,
}

impl HostCost {
    /// Adds one timed step of `model` that made `syncs` read-backs, `gradient_syncs` of
    /// them of the gradient.
    fn add(&mut self, model: &DeviceModel, syncs: u64, gradient_syncs: u64) {
        let t = model.last_step_times();
        self.syncs.push(syncs as f64);
        self.gradient_syncs.push(gradient_syncs as f64);
        self.recording.push(t.recording.as_secs_f64());
        self.reading.push(t.reading.as_secs_f64());
    }

    /// The bench's line for the steps in `precision`.
    fn line(&self, precision: &str) -> String {
        let mean = |v: &[f64]| v.iter().sum::<f64>() / v.len().max(1) as f64;
        let (all, grads) = (mean(&self.syncs), mean(&self.gradient_syncs));
        format!(
            "host per step ({precision}, NpeModel::nll_and_grad): {all:.1} host synchronisations (read-backs by lockstep-npe: log q, with the gradient where the optimizer runs on the host), {grads:.1} of the gradient, {:.2} ms recording (autodiff graph, queuing every kernel), {:.2} ms waiting for the read-back (medians)",
            1e3 * median(&self.recording),
            1e3 * median(&self.reading)
        )
    }
}

/// Median seconds per step of `model` in mixed precision from `initial` (the gradient is
/// unscaled before Adam, as the engine does; an overflowing step is skipped), and the host's
/// side of those steps.
fn amp_steps(
    args: &BenchNpeArgs,
    model: &mut DeviceModel,
    initial: &[f32],
    batch: &lockstep_train::Batch,
) -> Result<(f64, HostCost)> {
    let (theta, x, n) = (&batch.targets, &batch.inputs, args.batch);
    model.trainable_mut().copy_from_slice(initial);
    model.set_mixed_precision(true);
    if !Model::set_loss_scale(model, AMP_SCALE) {
        bail!("the model refused the loss scale");
    }
    let mut opt = Optimizer::new(OptimizerConfig::default(), initial.len());
    let mut grad = vec![0.0f32; initial.len()];
    let mut times = Vec::new();
    let mut host = HostCost::default();
    to_device(model, &opt)?;
    for i in 0..args.warmup + args.steps {
        let t = Instant::now();
        let reads = lockstep_npe::device::host_reads();
        let gradient_reads = lockstep_npe::device::gradient_reads();
        let inv = 1.0 / AMP_SCALE;
        let loss = train_step(model, &mut opt, &mut grad, (theta, x, n), Some(inv))?;
        let reads = lockstep_npe::device::host_reads() - reads;
        let gradient_reads = lockstep_npe::device::gradient_reads() - gradient_reads;
        if !loss.is_finite() {
            bail!("the mixed-precision loss is {loss}");
        }
        if i >= args.warmup {
            times.push(t.elapsed().as_secs_f64());
            host.add(model, reads, gradient_reads);
        }
    }
    from_device(model);
    model.set_mixed_precision(false);
    Ok((median(&times), host))
}

/// Kernel launches per step of the model's training step, float32 and mixed precision, by
/// kernel kind.
#[derive(Debug, serde::Serialize, serde::Deserialize)]
struct LaunchCount {
    /// The precision counted (`float32`, `mixed precision (float16)`).
    precision: String,
    /// Launches per step (mean over the counted steps).
    per_step: f64,
    /// Host synchronisations per step ([`lockstep_npe::device::host_reads`], mean over the
    /// counted steps).
    syncs: f64,
    /// Of them, gradient read-backs ([`lockstep_npe::device::gradient_reads`]).
    gradient_syncs: f64,
    /// (kernel kind, launches per step), most launched first.
    kinds: Vec<(String, f64)>,
}

/// The launch-logging child (`--count-launches`): launches are counted in a process of their
/// own because CubeCL's logging is configured once per process, before its first device;
/// returns the table to print.
fn launches_child(args: &BenchNpeArgs) -> Result<String> {
    let dir = tempfile::tempdir().context("creating a temporary directory")?;
    let log = dir.path().join("launches.log");
    let exe = std::env::current_exe().context("finding the lockstep binary")?;
    let steps = args.steps.min(3).to_string();
    let out = Command::new(exe)
        .args(["bench", "npe", "--device", &args.device, "--warmup", "1"])
        .args(["--steps", &steps, "--batch", &args.batch.to_string()])
        .args(["--memory-pools", &args.memory_pools])
        .arg("--count-launches")
        .arg(&log)
        .output()
        .context("starting the launch-counting process")?;
    let stdout = String::from_utf8_lossy(&out.stdout);
    if !out.status.success() {
        bail!(
            "the launch-counting process failed ({}): {}",
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    let line = stdout
        .lines()
        .rev()
        .find(|l| l.starts_with('['))
        .ok_or_else(|| anyhow!("the launch-counting process printed no counts: {stdout}"))?;
    let counts: Vec<LaunchCount> = serde_json::from_str(line)?;
    let mut text = String::new();
    for c in &counts {
        let list = |kinds: &mut dyn Iterator<Item = &(String, f64)>| {
            kinds
                .map(|(k, v)| format!("{k} {v:.0}"))
                .collect::<Vec<_>>()
                .join(", ")
        };
        let spline = list(&mut c.kinds.iter().filter(|(k, _)| k.starts_with("Spline")));
        text += &format!(
            "kernel launches per step ({}, forward, backward, gradient packing and the optimizer's update on the device): {:.0}; host synchronisations per step: {:.1}; gradient read-backs per step: {:.1}; by kernel: {}; the spline couplings' kernels: {}\n",
            c.precision,
            c.per_step,
            c.syncs,
            c.gradient_syncs,
            list(&mut c.kinds.iter()),
            if spline.is_empty() { "none (composed)".to_string() } else { spline },
        );
    }
    Ok(text)
}

/// The lines CubeCL has written to the launch log `log` once the device has run every
/// queued kernel and the logging task has caught up (the count is unchanged for 0.3 s).
fn settled_launches(model: &DeviceModel, log: &Path) -> Result<Vec<String>> {
    model.sync()?;
    let read = || -> Vec<String> {
        std::fs::read_to_string(log)
            .unwrap_or_default()
            .lines()
            .filter(|l| l.starts_with("Executing "))
            .map(str::to_string)
            .collect()
    };
    let mut last = read();
    let start = Instant::now();
    loop {
        std::thread::sleep(Duration::from_millis(300));
        let now = read();
        if now.len() == last.len() || start.elapsed() > Duration::from_secs(20) {
            return Ok(now);
        }
        last = now;
    }
}

/// `--count-launches`: one warm-up step, then the launches of `--steps` steps, in float32
/// and (where the device computes in float16) in mixed precision; prints them as one JSON
/// line.
fn count_launches(
    args: &BenchNpeArgs,
    mut model: DeviceModel,
    batch: &lockstep_train::Batch,
    placement: &Placement,
    log: &Path,
) -> Result<()> {
    let (theta, x, n) = (&batch.targets, &batch.inputs, args.batch);
    let mut grad = vec![0.0f32; model.trainable().len()];
    let mut counts = Vec::new();
    let amp = placement.half_precision().is_ok();
    for (precision, half) in [("float32", false), ("mixed precision (float16)", true)] {
        if half && !amp {
            continue;
        }
        model.set_mixed_precision(half);
        let unscale = half.then_some(1.0 / AMP_SCALE);
        if half {
            Model::set_loss_scale(&mut model, AMP_SCALE);
        }
        let mut opt = Optimizer::new(OptimizerConfig::default(), grad.len());
        to_device(&mut model, &opt)?;
        let pass = (&theta[..], &x[..], n);
        train_step(&mut model, &mut opt, &mut grad, pass, unscale)?;
        let before = settled_launches(&model, log)?.len();
        let reads = lockstep_npe::device::host_reads();
        let gradient_reads = lockstep_npe::device::gradient_reads();
        for _ in 0..args.steps {
            train_step(&mut model, &mut opt, &mut grad, pass, unscale)?;
        }
        let reads = lockstep_npe::device::host_reads() - reads;
        let gradient_reads = lockstep_npe::device::gradient_reads() - gradient_reads;
        from_device(&mut model);
        let lines = settled_launches(&model, log)?;
        let steps = args.steps as f64;
        let mut kinds: std::collections::BTreeMap<String, usize> = Default::default();
        for l in &lines[before.min(lines.len())..] {
            let name = l["Executing ".len()..].split(" |").next().unwrap_or("?");
            *kinds.entry(name.trim().to_string()).or_default() += 1;
        }
        let mut kinds: Vec<(String, f64)> = kinds
            .into_iter()
            .map(|(k, c)| (k, c as f64 / steps))
            .collect();
        kinds.sort_by(|a, b| b.1.total_cmp(&a.1));
        counts.push(LaunchCount {
            precision: precision.to_string(),
            per_step: (lines.len() - before.min(lines.len())) as f64 / steps,
            syncs: reads as f64 / steps,
            gradient_syncs: gradient_reads as f64 / steps,
            kinds,
        });
    }
    println!("{}", serde_json::to_string(&counts)?);
    Ok(())
}

/// Part 2 of the bench: PyTorch eager on the same batch and initial parameters (a note when
/// torch is missing); returns PyTorch DDP's (processes, median s/step) when it ran.
fn compare_with_torch(
    args: &BenchNpeArgs,
    network: &NpeNetwork,
    initial: &[f32],
    batch: &lockstep_train::Batch,
    step: f64,
    initial_loss: f64,
) -> Option<(usize, f64)> {
    let n = args.batch;
    match torch(args, network, initial, &batch.targets, &batch.inputs) {
        Ok(t) => {
            println!("\nPyTorch eager ({}), same network, batch and initial parameters: {} parameters; loss at the initial parameters: torch {:.6}, lockstep {:.6} (relative difference {:.1e})",
                    t.version, t.parameters, t.initial_loss, initial_loss,
                    ((t.initial_loss - initial_loss) / initial_loss).abs());
            println!(
                "{:>24} {:>10} {:>12} {:>22}",
                "run", "s/step", "samples/s", "lockstep/torch time"
            );
            println!(
                "{:>24} {:>10.4} {:>12.0} {:>22}",
                "lockstep 1 core",
                step,
                n as f64 / step,
                ""
            );
            for (threads, s) in &t.steps {
                println!(
                    "{:>24} {:>10.4} {:>12.0} {:>22.2}",
                    format!("torch {threads} thread(s)"),
                    s,
                    n as f64 / s,
                    step / s
                );
            }
            for (threads, p) in &t.phases {
                println!("torch {threads} thread(s) phases: forward {:.2} ms, backward {:.2} ms, Adam {:.2} ms", 1e3 * p[0], 1e3 * p[1], 1e3 * p[2]);
            }
            match t.ddp {
                Some(Ok((p, times))) => Some((p, median(&times))),
                Some(Err(e)) => {
                    println!("note: no PyTorch DDP run: {e}");
                    None
                }
                None => None,
            }
        }
        Err(e) => {
            println!("\nnote: no PyTorch comparison: {e:#}");
            None
        }
    }
}

/// Part 3 of the bench, the engine: 1 replica vs N thread replicas vs N MPI ranks, same
/// global batch, and PyTorch DDP's (processes, s/step) when it ran.
fn replica_table(
    args: &BenchNpeArgs,
    world: &World,
    updates: usize,
    ddp: Option<(usize, f64)>,
) -> Result<()> {
    let n = args.batch;
    let r = args.replicas;
    let run = |replicas, workers| EngineRun {
        replicas,
        ..EngineRun::serial(workers)
    };
    let mut rows = vec![(
        "1 replica".to_string(),
        1,
        engine(world, n, updates, &run(1, 0))?,
    )];
    let bound = r > 1 && !args.no_independent && n.is_multiple_of(r);
    if bound {
        rows.push(("independent".to_string(), r, independent(args, r, updates)?));
    }
    if r > 1 {
        // Each parallel run without and with a loader thread (local.num_workers: 1).
        for workers in [0, 1] {
            let loader = if workers > 0 { " + loader" } else { "" };
            rows.push((
                format!("{r} threads{loader}"),
                r,
                engine(world, n, updates, &run(r, workers))?,
            ));
            if !args.no_mpi {
                match mpi_run(args, r, workers, None) {
                    Ok(t) => rows.push((format!("{r} MPI ranks{loader}"), r, t)),
                    Err(e) => println!("note: no MPI run: {e:#}"),
                }
            }
        }
    }
    println!("\nengine (lockstep npe training path, simulation included), global batch {n}: median of {} updates after {} warm-up", args.steps, args.warmup);
    println!(
        "{:>12} {:>9} {:>9} {:>10} {:>10} {:>10} {:>12} {:>9}",
        "run", "replicas", "s/update", "data s", "compute s", "comm s", "samples/s", "speed-up"
    );
    let width = rows.iter().map(|r| r.0.len()).max().unwrap_or(12);
    let col = |times: &[[f64; 4]], k: usize| {
        let timed = &times[args.warmup.min(times.len())..];
        median(&timed.iter().map(|t| t[k]).collect::<Vec<_>>())
    };
    let base = col(&rows[0].2, 3);
    for (name, reps, times) in &rows {
        let total = col(times, 3);
        println!(
            "{:>width$} {:>9} {:>9.4} {:>10.4} {:>10.4} {:>10.4} {:>12.0} {:>9.2}",
            name,
            reps,
            total,
            col(times, 0),
            col(times, 1),
            col(times, 2),
            n as f64 / total,
            base / total
        );
    }
    println!("speed-up = s/update of 1 replica / s/update of the run (the same global batch); each replica simulates its own slice of the global batch (data s); + loader: local.num_workers 1, a loader thread of each replica simulates its next slice during the step (data s is the wait left)");
    if bound {
        let of = |name: &str| {
            rows.iter()
                .find(|row| row.0 == name)
                .map(|row| col(&row.2, 3))
        };
        let independent = of("independent").unwrap_or(f64::NAN);
        println!(
            "independent = {r} 1-replica processes at once that never communicate, each with batch {} (a replica's slice), each update the slowest of the {r}: the machine's bound for {r} replicas ({:.2}x)",
            n / r,
            base / independent
        );
        for name in [format!("{r} threads"), format!("{r} MPI ranks")] {
            if let Some(t) = of(&name) {
                println!(
                    "{name}: {:.1}% of the bound ({:.2}x of {:.2}x)",
                    100.0 * independent / t,
                    base / t,
                    base / independent
                );
            }
        }
    }
    if let Some((p, s)) = ddp {
        let mpi = rows
            .iter()
            .find(|(name, _, _)| name.ends_with("MPI ranks"))
            .map(|(_, _, t)| col(t, 3));
        println!(
            "PyTorch DDP (gloo, {p} processes of 1 thread, same network and global batch, simulation not included): {s:.4} s/step, {:.0} samples/s{}",
            n as f64 / s,
            match mpi {
                Some(m) => format!("; lockstep {r} MPI ranks / DDP time = {:.2}", m / s),
                None => String::new(),
            }
        );
    }
    Ok(())
}

/// The batch and steps of the bench's phase timing ([`DeviceModel::step_phases`]).
fn phase_run<'a>(args: &BenchNpeArgs, theta: &'a [f32], x: &'a [f32]) -> PhaseRun<'a> {
    PhaseRun {
        theta,
        x,
        n: args.batch,
        warmup: args.warmup,
        steps: args.steps,
    }
}

/// Part 4: LayerNorm, BatchNorm, SyncBatchNorm and BatchNorm with local statistics in every
/// layer, at 1 and `--replicas` replicas (threads; SyncBatchNorm also MPI).
fn norm_table(args: &BenchNpeArgs, world: &World, updates: usize) -> Result<()> {
    let (n, r) = (args.batch, args.replicas);
    let run = |replicas, norm, local_statistics| EngineRun {
        replicas,
        workers: 0,
        launch: Launch::SingleProcess,
        norm: Some(norm),
        local_statistics,
    };
    let median_of = |times: &[[f64; 4]], k: usize| {
        let timed = &times[args.warmup.min(times.len())..];
        median(&timed.iter().map(|t| t[k]).collect::<Vec<_>>())
    };
    let mut rows: Vec<(String, Vec<[f64; 4]>)> = vec![
        (
            "LayerNorm, 1 replica".into(),
            engine(world, n, updates, &run(1, "layer_norm", false))?,
        ),
        (
            "BatchNorm, 1 replica".into(),
            engine(world, n, updates, &run(1, "batch_norm", false))?,
        ),
    ];
    if r > 1 {
        rows.push((
            format!("LayerNorm, {r} threads"),
            engine(world, n, updates, &run(r, "layer_norm", false))?,
        ));
        rows.push((
            format!("SyncBatchNorm, {r} threads"),
            engine(world, n, updates, &run(r, "batch_norm", false))?,
        ));
        if !args.no_mpi {
            for norm in ["layer_norm", "batch_norm"] {
                let name = if norm == "layer_norm" {
                    "LayerNorm"
                } else {
                    "SyncBatchNorm"
                };
                match mpi_run(args, r, 0, Some(norm)) {
                    Ok(t) => rows.push((format!("{name}, {r} MPI ranks"), t)),
                    Err(e) => println!("note: no MPI run: {e:#}"),
                }
            }
        }
        rows.push((
            format!("BatchNorm, local statistics, {r} threads"),
            engine(world, n, updates, &run(r, "batch_norm", true))?,
        ));
    }
    println!("\nnormalization in every embedding block and coupling conditioner, engine, global batch {n}: median of {} updates after {} warm-up", args.steps, args.warmup);
    let width = rows.iter().map(|r| r.0.len()).max().unwrap_or(12);
    println!(
        "{:>width$} {:>9} {:>10} {:>10} {:>12}",
        "run", "s/update", "compute s", "comm s", "vs LayerNorm"
    );
    let layer_norm = |replicas: &str| {
        rows.iter()
            .find(|(name, _)| name.starts_with("LayerNorm") && name.ends_with(replicas))
            .map(|(_, t)| median_of(t, 3))
    };
    for (name, times) in &rows {
        let total = median_of(times, 3);
        let suffix = name.rsplit(", ").next().unwrap_or_default();
        let versus = layer_norm(suffix)
            .map(|l| format!("{:.2}", total / l))
            .unwrap_or_else(|| "-".into());
        println!(
            "{:>width$} {:>9.4} {:>10.4} {:>10.4} {:>12}",
            name,
            total,
            median_of(times, 1),
            median_of(times, 2),
            versus
        );
    }
    println!("vs LayerNorm = s/update / s/update of LayerNorm with the same replicas; SyncBatchNorm sums the batch statistics over the replicas (one all-reduce per layer forward and one backward, inside compute s); local statistics: each replica normalizes by its own slice (not the same training as 1 replica; lockstep npe refuses it)");
    Ok(())
}

/// One engine measurement: `replicas` replicas launched as `launch`, `workers` as
/// `local.num_workers` (0: no loader thread), `norm` in every layer (`None`: the main
/// network's), and with `local_statistics` each replica's BatchNorm uses its own slice.
struct EngineRun<'a> {
    replicas: usize,
    workers: usize,
    launch: Launch,
    norm: Option<&'a str>,
    local_statistics: bool,
}

impl EngineRun<'_> {
    /// One replica in this process, the main network's norms.
    fn serial(workers: usize) -> Self {
        EngineRun {
            replicas: 1,
            workers,
            launch: Launch::SingleProcess,
            norm: None,
            local_statistics: false,
        }
    }
}

/// The machine's bound for `r` replicas: `r` 1-replica runs of a replica's slice (`batch /
/// r` samples) at once, as processes that never communicate (one core each, like a
/// replica); per update the slowest of them in every column.
///
/// Errors: a process fails, times out or prints no result.
fn independent(args: &BenchNpeArgs, r: usize, updates: usize) -> Result<Vec<[f64; 4]>> {
    let worker_args = worker_args(args, "--independent-worker", args.batch / r);
    let runs: Vec<Vec<[f64; 4]>> =
        super::mpi_worker::run_concurrent_workers(r, &worker_args, Duration::from_secs(1800))?;
    Ok((0..updates)
        .map(|u| {
            std::array::from_fn(|k| {
                runs.iter()
                    .filter_map(|t| t.get(u).map(|v| v[k]))
                    .fold(0.0, f64::max)
            })
        })
        .collect())
}

/// Per update: seconds of data, compute, communication, whole update (slowest rank), of
/// the engine training the benchmark network as `run` says.
fn engine(
    world: &World,
    batch: usize,
    updates: usize,
    run: &EngineRun<'_>,
) -> Result<Vec<[f64; 4]>> {
    let (s, raw) = settings(batch, updates, run.replicas, run.workers, run.norm)?;
    let times = |summary: &TrainSummary, _: &_, _: &_| Ok(summary.update_times.clone());
    if run.local_statistics {
        return train_quietly_as(world, &s, &raw, run.launch, LocalStatistics, times);
    }
    train_quietly(world, &s, &raw, run.launch, times)
}

/// The NPE model with BatchNorm over each replica's own slice: the engine's replicas do not
/// reach its pass (what PyTorch DDP trains without SyncBatchNorm). Bench only.
struct LocalStatistics(DeviceModel);

impl Model for LocalStatistics {
    fn trainable(&self) -> &[f32] {
        self.0.trainable()
    }
    fn trainable_mut(&mut self) -> &mut [f32] {
        self.0.trainable_mut()
    }
    fn frozen(&self) -> &[f32] {
        self.0.frozen()
    }
    fn frozen_mut(&mut self) -> &mut [f32] {
        self.0.frozen_mut()
    }
    fn loss_names(&self) -> Vec<String> {
        self.0.loss_names()
    }
    fn sample_separable(&self) -> bool {
        false
    }
    fn synchronizes_batch_statistics(&self) -> bool {
        true
    }
    fn loss_and_grad(
        &mut self,
        batch: &lockstep_train::Batch,
        grad: &mut [f32],
    ) -> anyhow::Result<Vec<f64>> {
        self.0.loss_and_grad(batch, grad)
    }
    /// The pass on the local slice alone, then the running statistics averaged over the
    /// replicas (DDP broadcasts rank 0's buffers instead; either keeps replicas identical).
    fn loss_and_grad_in(
        &mut self,
        batch: &lockstep_train::Batch,
        grad: &mut [f32],
        replicas: &lockstep_train::ReplicaContext<'_>,
    ) -> anyhow::Result<Vec<f64>> {
        let loss = self.0.loss_and_grad(batch, grad)?;
        let mut state: Vec<f64> = self.0.state().iter().map(|&v| v as f64).collect();
        replicas.all_reduce_sum(&mut state)?;
        let r = replicas.replicas() as f64;
        let mean: Vec<f32> = state.iter().map(|v| (v / r) as f32).collect();
        self.0.set_state(&mean)?;
        Ok(loss)
    }
}

/// Trains the NPE settings `s` (`raw`: their JSON) through the engine, launched as `launch`,
/// without progress output, in a temporary run folder; `inspect` gets the run's summary, the
/// task and the network before the folder is removed.
///
/// Errors: the settings do not make an engine config, or training fails.
pub(crate) fn train_quietly<T>(
    world: &World,
    s: &NpeSettings,
    raw: &serde_json::Value,
    launch: Launch,
    inspect: impl FnOnce(&TrainSummary, &Arc<dyn Task>, &NpeNetwork) -> Result<T>,
) -> Result<T> {
    train_quietly_as(world, s, raw, launch, |m| m, inspect)
}

/// [`train_quietly`] with each replica's model wrapped by `wrap`.
fn train_quietly_as<T, M: Model>(
    world: &World,
    s: &NpeSettings,
    raw: &serde_json::Value,
    launch: Launch,
    wrap: impl Fn(DeviceModel) -> M + Sync,
    inspect: impl FnOnce(&TrainSummary, &Arc<dyn Task>, &NpeNetwork) -> Result<T>,
) -> Result<T> {
    let tmp = tempfile::tempdir().context("cannot create a temporary folder")?;
    let json = s.engine_config(0, raw, launch, &tmp.path().join("run"), true)?;
    let cfg = EngineConfig::from_json(&json, Path::new("/"))?;
    let task = s.task()?;
    let network = trained::network(s, task.as_ref())?;
    let opts = EngineOptions {
        resolved_config: json,
        quiet: true,
        ..EngineOptions::default()
    };
    let (seed, n) = (s.data.seed, s.train_samples());
    let summary = run_job(world, &cfg, &opts, |_rank| {
        Ok((
            wrap(DeviceModel::new(network.clone(), seed, &Placement::Cpu)?),
            TaskSource::dataset(task.clone(), seed, n)
                .with_workers(s.local.num_workers.unwrap_or(1)),
        ))
    })?;
    inspect(&summary, &task, &network)
}

/// `bench npe <role> --batch <batch>` with this run's steps and warm-up: the command line of
/// a worker process.
fn worker_args(args: &BenchNpeArgs, role: &str, batch: usize) -> Vec<String> {
    let mut out: Vec<String> = ["bench", "npe", role].map(String::from).to_vec();
    for (flag, value) in [
        ("--batch", batch),
        ("--steps", args.steps),
        ("--warmup", args.warmup),
    ] {
        out.extend([flag.to_string(), value.to_string()]);
    }
    out
}

fn mpi_run(
    args: &BenchNpeArgs,
    ranks: usize,
    workers: usize,
    norm: Option<&str>,
) -> Result<Vec<[f64; 4]>> {
    let mut worker_args = worker_args(args, "--mpi-worker", args.batch);
    worker_args.extend(["--workers".to_string(), workers.to_string()]);
    if let Some(norm) = norm {
        worker_args.extend(["--norm".to_string(), norm.to_string()]);
    }
    super::mpi_worker::run_mpi_worker(ranks, worker_args, Duration::from_secs(1800))
}

struct TorchResult {
    version: String,
    parameters: u64,
    initial_loss: f64,
    /// (threads, median s/step)
    steps: Vec<(usize, f64)>,
    /// (threads, [forward, backward, Adam] s)
    phases: Vec<(usize, [f64; 3])>,
    /// DDP: (processes, seconds per step) or why it did not run; `None` when not asked.
    ddp: Option<std::result::Result<(usize, Vec<f64>), String>>,
}

const TORCH_SCRIPT: &str = include_str!("../../../../scripts/peers/npe_torch.py");

/// Runs `scripts/peers/npe_torch.py` on lockstep's network, initial parameters and batch,
/// with `extra` merged into its spec (`threads`, `ddp_processes`, `device`, ...); returns
/// its output, whose network was checked to have lockstep's parameter count.
fn torch_script(
    args: &BenchNpeArgs,
    network: &NpeNetwork,
    initial: &[f32],
    theta: &[f32],
    x: &[f32],
    extra: serde_json::Value,
) -> Result<serde_json::Value> {
    let python = &args.python;
    let probe = Command::new(python)
        .args(["-c", "import torch, numpy"])
        .output()
        .map_err(|e| anyhow!("could not start `{python}`: {e}"))?;
    if !probe.status.success() {
        bail!("`{python}` cannot import torch and numpy; pass --python with an interpreter that has them (pip install torch numpy)");
    }
    let dir = tempfile::tempdir().context("creating a temporary directory")?;
    let d = dir.path();
    let n = args.batch as u64;
    write_npy(&d.join("params.npy"), initial, &[initial.len() as u64])?;
    write_npy(&d.join("theta.npy"), theta, &[n, network.theta_dim as u64])?;
    write_npy(&d.join("x.npy"), x, &[n, network.x_dim as u64])?;
    let names: Vec<(String, Vec<usize>)> = network
        .layout()
        .specs()
        .iter()
        .map(|s| (s.name.clone(), s.shape.clone()))
        .collect();
    std::fs::write(d.join("names.json"), serde_json::to_string(&names)?)?;
    let c = &network.config;
    let st = &network.standardization;
    let spec = serde_json::json!({
        "x_dim": network.x_dim, "theta_dim": network.theta_dim,
        "hidden_dims": c.embedding.hidden_dims, "output_dim": c.embedding.output_dim,
        "num_flow_steps": c.flow.num_flow_steps, "hidden_dim": c.flow.hidden_dim,
        "num_transform_blocks": c.flow.num_transform_blocks, "num_bins": c.flow.num_bins,
        "tail_bound": c.flow.tail_bound, "permutations": network.permutations(),
        "theta_mean": st.theta_mean, "theta_std": st.theta_std,
        "x_mean": st.x_mean, "x_std": st.x_std,
        "batch": args.batch, "warmup": args.warmup, "steps": args.steps,
        "threads": [1, 2], "learning_rate": 1e-3, "dir": d,
        "ddp_processes": if args.no_replicas { 0 } else { args.replicas },
    });
    let mut spec = spec;
    if let (Some(s), Some(e)) = (spec.as_object_mut(), extra.as_object()) {
        s.extend(e.clone());
    }
    let spec_path = d.join("spec.json");
    std::fs::write(&spec_path, serde_json::to_string(&spec)?)?;
    let script = d.join("npe_torch.py");
    std::fs::write(&script, TORCH_SCRIPT)?;
    let out_path = d.join("out.json");
    let out = Command::new(python)
        .arg(&script)
        .arg(&spec_path)
        .arg(&out_path)
        .output()
        .map_err(|e| anyhow!("could not start `{python}`: {e}"))?;
    if !out.status.success() {
        bail!(
            "the PyTorch script failed ({}): {}",
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    let v: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&out_path)?)?;
    let parameters = v["parameters"].as_u64().unwrap_or(0);
    if parameters != initial.len() as u64 {
        bail!(
            "PyTorch's network has {parameters} parameters, lockstep's {}",
            initial.len()
        );
    }
    Ok(v)
}

fn torch(
    args: &BenchNpeArgs,
    network: &NpeNetwork,
    initial: &[f32],
    theta: &[f32],
    x: &[f32],
) -> Result<TorchResult> {
    let v = torch_script(args, network, initial, theta, x, serde_json::json!({}))?;
    let parameters = v["parameters"].as_u64().unwrap_or(0);
    let mut steps = Vec::new();
    let mut phases = Vec::new();
    for threads in [1usize, 2] {
        let key = threads.to_string();
        let s: Vec<f64> = v["s_per_step"][&key]
            .as_array()
            .map(|a| a.iter().filter_map(|x| x.as_f64()).collect())
            .unwrap_or_default();
        steps.push((threads, median(&s)));
        let p = &v["phases"][&key];
        phases.push((
            threads,
            [
                p["forward"].as_f64().unwrap_or(f64::NAN),
                p["backward"].as_f64().unwrap_or(f64::NAN),
                p["optimizer"].as_f64().unwrap_or(f64::NAN),
            ],
        ));
    }
    let ddp = v.get("ddp").map(|d| match d["error"].as_str() {
        Some(e) => Err(e.to_string()),
        None => Ok((
            d["processes"].as_u64().unwrap_or(0) as usize,
            d["s_per_step"]
                .as_array()
                .map(|a| a.iter().filter_map(|x| x.as_f64()).collect())
                .unwrap_or_default(),
        )),
    });
    Ok(TorchResult {
        ddp,
        version: v["torch_version"].as_str().unwrap_or("unknown").to_string(),
        parameters,
        initial_loss: v["initial_loss"].as_f64().unwrap_or(f64::NAN),
        steps,
        phases,
    })
}
