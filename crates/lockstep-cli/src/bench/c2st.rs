//! `lockstep bench c2st`: posterior accuracy of lockstep's NPE on the SBI benchmark tasks
//! `two_moons` and `slcp` (sbibm, Lueckmann et al. 2021), as the benchmark scores it: for each
//! simulation budget, lockstep NPE is trained through the engine (as `lockstep npe train`),
//! posterior samples are drawn for sbibm's observations, and the classifier two-sample test
//! ([`lockstep_npe::c2st`]) compares them with sbibm's reference posterior samples (0.5:
//! indistinguishable). When `--python` imports `sbi`, sbi's NPE is trained on the same
//! simulations (`scripts/peers/sbi_npe.py`) and its samples are scored by the same C2ST.
//!
//! Every row also shows sbi's NPE as published by the SBI benchmark's rerun with sbi 0.23
//! ([`PUBLISHED_SBI_NPE`]), for budgets where running sbi here takes too long.
//!
//! Like sbi, the posterior samples are restricted to the prior's support (draws outside the
//! prior box are rejected and redrawn).

use super::npe::train_quietly;
use super::npy::{read_npy, write_npy};
use anyhow::{anyhow, bail, Context, Result};
use lockstep_comm::World;
use lockstep_npe::c2st::{c2st, C2stOptions};
use lockstep_npe::sbibm::reference;
use lockstep_npe::settings::Launch;
use lockstep_npe::{trained, NpeSettings, TaskSource};
use lockstep_train::BatchSource;
use std::process::Command;
use std::time::Instant;

/// Options of `lockstep bench c2st`.
#[derive(Debug, clap::Args)]
pub struct BenchC2stArgs {
    /// Tasks (sbibm names).
    #[arg(long, value_delimiter = ',', default_value = "two_moons,slcp")]
    pub tasks: Vec<String>,
    /// Simulation budgets.
    #[arg(
        allow_hyphen_values = true,
        long,
        value_delimiter = ',',
        default_value = "10000"
    )]
    pub simulations: Vec<u64>,
    /// sbibm observation numbers (1-3 are bundled).
    #[arg(
        allow_hyphen_values = true,
        long,
        value_delimiter = ',',
        default_value = "1,2,3"
    )]
    pub observations: Vec<usize>,
    /// Posterior samples per observation (sbibm: 10000, as many as the reference).
    #[arg(allow_negative_numbers = true, long, default_value_t = 10_000)]
    pub samples: usize,
    /// Training epochs of lockstep NPE (default: 1e6 / simulations, within 10..=200).
    #[arg(allow_negative_numbers = true, long)]
    pub epochs: Option<u64>,
    /// Thread replicas training lockstep NPE.
    #[arg(allow_negative_numbers = true, long, default_value_t = 2)]
    pub replicas: usize,
    /// Seed of the simulations, the network and the samples.
    #[arg(allow_negative_numbers = true, long, default_value_t = 1, value_parser = crate::flags::parse_seed)]
    pub seed: u64,
    /// Python interpreter that imports sbi, torch and numpy (the sbi comparison is skipped,
    /// with a note, when it cannot).
    #[arg(long, default_value = "python3")]
    pub python: String,
    /// Skip the sbi comparison.
    #[arg(long)]
    pub no_sbi: bool,
}

/// sbi's NPE on sbibm's observations 1-3, as published by the SBI benchmark's rerun of
/// Lueckmann et al. (2021) with sbi 0.23: `benchmarking_sbi_023/results/re-sbibm_sbi_023.csv`
/// in github.com/sbi-benchmark/results (MIT licence), algorithm `NPE`, column `C2ST` (the
/// row index of the file in the comments): `(task, simulations, observation, C2ST)`.
pub const PUBLISHED_SBI_NPE: &[(&str, u64, usize, f64)] = &[
    ("two_moons", 10_000, 1, 0.5654),   // row 305
    ("two_moons", 10_000, 2, 0.5463),   // row 288
    ("two_moons", 10_000, 3, 0.5862),   // row 297
    ("two_moons", 100_000, 1, 0.5061),  // row 294
    ("two_moons", 100_000, 2, 0.5437),  // row 296
    ("two_moons", 100_000, 3, 0.52305), // row 299
    ("slcp", 10_000, 1, 0.93675),       // row 275
    ("slcp", 10_000, 2, 0.9111),        // row 258
    ("slcp", 10_000, 3, 0.84815),       // row 267
    ("slcp", 100_000, 1, 0.8672),       // row 264
    ("slcp", 100_000, 2, 0.91405),      // row 266
    ("slcp", 100_000, 3, 0.80155),      // row 269
];

/// The published C2ST of sbi's NPE for `(task, simulations, observation)`, when listed in
/// [`PUBLISHED_SBI_NPE`].
fn published_sbi(task: &str, sims: u64, observation: usize) -> Option<f64> {
    PUBLISHED_SBI_NPE
        .iter()
        .find(|(t, n, o, _)| *t == task && *n == sims && *o == observation)
        .map(|r| r.3)
}

const SBI_SCRIPT: &str = include_str!("../../../../scripts/peers/sbi_npe.py");

/// The prior box of an sbibm task (`two_moons`: U(-1, 1)², `slcp`: U(-3, 3)⁵).
fn prior_box(task: &str) -> Result<(Vec<f32>, Vec<f32>)> {
    Ok(match task {
        "two_moons" => (vec![-1.0; 2], vec![1.0; 2]),
        "slcp" => (vec![-3.0; 5], vec![3.0; 5]),
        other => {
            bail!("--tasks: `{other}` has no bundled reference posterior; use two_moons or slcp")
        }
    })
}

fn settings(
    task: &str,
    sims: u64,
    epochs: u64,
    replicas: usize,
    seed: u64,
) -> Result<(NpeSettings, serde_json::Value)> {
    let text = format!(
        "
data:
  task: {task}
  num_samples: {sims}
  train_fraction: 1.0
  seed: {seed}
model:
  posterior_kwargs:
    num_flow_steps: 5
    base_transform_kwargs: {{hidden_dim: 64, num_transform_blocks: 2, num_bins: 10,
                            norm: none, tail_bound: 3.0}}
  embedding_kwargs: {{output_dim: 32, hidden_dims: [64], norm: none}}
training:
  stage_0:
    epochs: {epochs}
    batch_size: 200
    optimizer: {{type: adam, lr: 0.001}}
    scheduler: {{type: cosine, T_max: {epochs}}}
local:
  replicas: {replicas}
"
    );
    Ok(NpeSettings::from_yaml(&text)?)
}

/// `n` posterior samples inside the prior box `[lo, hi]` (rejection, at most 200 rounds of
/// `n` draws), and the fraction of all draws that fell inside.
fn sample_in_prior(
    model: &trained::Trained,
    x: &[f32],
    n: usize,
    seed: u64,
    lo: &[f32],
    hi: &[f32],
) -> Result<(Vec<f32>, f64)> {
    let d = lo.len();
    let mut out = Vec::with_capacity(n * d);
    let (mut drawn, mut inside) = (0usize, 0usize);
    for round in 0..200u64 {
        let s = model.sample(x, n, seed.wrapping_add(round));
        for row in s.chunks_exact(d) {
            drawn += 1;
            if row
                .iter()
                .zip(lo)
                .zip(hi)
                .all(|((v, l), h)| v >= l && v <= h)
            {
                inside += 1;
                if out.len() < n * d {
                    out.extend_from_slice(row);
                }
            }
        }
        if out.len() == n * d {
            return Ok((out, inside as f64 / drawn as f64));
        }
    }
    bail!("fewer than {n} of {drawn} posterior samples fell inside the prior")
}

/// Runs the benchmark and prints its table.
pub fn run(args: &BenchC2stArgs, world: &World) -> Result<()> {
    if world.comm().size() > 1 {
        bail!("run `lockstep bench c2st` without mpirun");
    }
    let opts = C2stOptions::default();
    let sbi_ok = !args.no_sbi && sbi_importable(&args.python);
    let mut rows: Vec<String> = Vec::new();
    for task_name in &args.tasks {
        let (lo, hi) = prior_box(task_name)?;
        let refs = args
            .observations
            .iter()
            .map(|&o| reference(task_name, o))
            .collect::<Result<Vec<_>, _>>()?;
        for &sims in &args.simulations {
            let (trained, task, train_s) = train_lockstep(args, world, task_name, sims)?;
            let sbi = if sbi_ok {
                eprintln!("{task_name}, {sims} simulations: training sbi NPE ...");
                match run_sbi(
                    args,
                    task.clone(),
                    sims,
                    &lo,
                    &hi,
                    &refs.iter().map(|r| r.x.clone()).collect::<Vec<_>>(),
                ) {
                    Ok(v) => Some(v),
                    Err(e) => {
                        println!("note: sbi failed: {e:#}");
                        None
                    }
                }
            } else {
                None
            };
            for (k, r) in refs.iter().enumerate() {
                let (ours, accept) = sample_in_prior(
                    &trained,
                    &r.x,
                    args.samples,
                    args.seed ^ 0x5A3 ^ k as u64,
                    &lo,
                    &hi,
                )?;
                eprintln!(
                    "{task_name}, {sims} simulations, observation {}: C2ST ...",
                    r.observation
                );
                let c_ours = c2st(&r.samples, &ours, r.theta_dim, &opts)?;
                let c_sbi = match &sbi {
                    Some((samples, _)) => Some(c2st(&r.samples, &samples[k], r.theta_dim, &opts)?),
                    None => None,
                };
                let fmt = |v: Option<f64>| v.map_or("-".to_string(), |v| format!("{v:.3}"));
                let c_pub = published_sbi(task_name, sims, r.observation);
                rows.push(format!(
                    "{:>10} {:>11} {:>4} {:>14.3} {:>10} {:>10} {:>14} {:>9} {:>10.3} {:>10.1} {:>9}",
                    task_name,
                    sims,
                    r.observation,
                    c_ours,
                    fmt(c_sbi),
                    fmt(c_sbi.map(|s| c_ours - s)),
                    fmt(c_pub),
                    fmt(c_pub.map(|s| c_ours - s)),
                    accept,
                    train_s,
                    sbi.as_ref()
                        .map_or("-".to_string(), |(_, t)| format!("{t:.1}")),
                ));
            }
        }
    }
    println!(
        "C2ST accuracy against sbibm's reference posterior samples ({} samples each; 0.5 = indistinguishable), {}-fold, MLP (10 dim, 10 dim), as sbibm",
        args.samples, opts.folds
    );
    println!(
        "{:>10} {:>11} {:>4} {:>14} {:>10} {:>10} {:>14} {:>9} {:>10} {:>10} {:>9}",
        "task",
        "simulations",
        "obs",
        "lockstep C2ST",
        "sbi C2ST",
        "diff",
        "sbi published",
        "diff pub",
        "in prior",
        "train s",
        "sbi s"
    );
    for r in rows {
        println!("{r}");
    }
    println!("diff = lockstep - sbi (negative: lockstep closer to the reference); sbi published: sbi 0.23's NPE in the SBI benchmark's rerun (github.com/sbi-benchmark/results, benchmarking_sbi_023), diff pub = lockstep - that; in prior = fraction of lockstep's draws inside the prior box (draws outside are rejected, as sbi does)");
    Ok(())
}

/// Whether `python` imports sbi, torch and numpy (a note on stdout when not).
fn sbi_importable(python: &str) -> bool {
    let probe = Command::new(python)
        .args(["-c", "import sbi, torch, numpy"])
        .output();
    match probe {
        Ok(o) if o.status.success() => true,
        _ => {
            println!("note: `{python}` cannot import sbi, torch and numpy: no sbi comparison (pass --python with an interpreter that has them)");
            false
        }
    }
}

/// Trains lockstep's NPE on `sims` simulations of `task_name` (in a temporary run folder)
/// and returns the trained posterior, the task and the training seconds.
fn train_lockstep(
    args: &BenchC2stArgs,
    world: &World,
    task_name: &str,
    sims: u64,
) -> Result<(
    trained::Trained,
    std::sync::Arc<dyn lockstep_npe::Task>,
    f64,
)> {
    let epochs = args
        .epochs
        .unwrap_or((1_000_000 / sims.max(1)).clamp(10, 200));
    let (s, raw) = settings(task_name, sims, epochs, args.replicas, args.seed)?;
    eprintln!("{task_name}, {sims} simulations: training lockstep NPE ({epochs} epochs) ...");
    let t = Instant::now();
    train_quietly(
        world,
        &s,
        &raw,
        Launch::SingleProcess,
        |summary, task, network| {
            let train_s = t.elapsed().as_secs_f64();
            eprintln!(
                "{task_name}, {sims} simulations: trained {} parameters in {train_s:.1} s",
                network.layout().len()
            );
            Ok((trained::load(&summary.output_dir)?, task.clone(), train_s))
        },
    )
}

/// Trains sbi's NPE on simulations `0..sims` (the lockstep training set) and returns its
/// samples per observation and its training seconds.
fn run_sbi(
    args: &BenchC2stArgs,
    task: std::sync::Arc<dyn lockstep_npe::Task>,
    sims: u64,
    lo: &[f32],
    hi: &[f32],
    observations: &[Vec<f32>],
) -> Result<(Vec<Vec<f32>>, f64)> {
    let dir = tempfile::tempdir().context("creating a temporary directory")?;
    let d = dir.path();
    let (td, xd) = (task.theta_dim() as u64, task.x_dim() as u64);
    let b = TaskSource::dataset(task, args.seed, sims).global_batch(0, sims as usize)?;
    write_npy(&d.join("theta.npy"), &b.targets, &[sims, td])?;
    write_npy(&d.join("x.npy"), &b.inputs, &[sims, xd])?;
    let spec = serde_json::json!({
        "dir": d, "low": lo, "high": hi, "observations": observations,
        "num_samples": args.samples, "seed": args.seed, "threads": 2,
    });
    std::fs::write(d.join("spec.json"), serde_json::to_string(&spec)?)?;
    std::fs::write(d.join("sbi_npe.py"), SBI_SCRIPT)?;
    // Run in the temporary folder: sbi writes its training logs (`sbi-logs/`) to the working
    // directory. A relative interpreter path is made absolute first.
    // Absolute, but not through `canonicalize`: a venv's python is a link to the base
    // interpreter, and resolving it would leave the venv (and its packages) behind.
    let python = match args.python.contains('/') {
        true => std::path::absolute(&args.python).unwrap_or_else(|_| args.python.clone().into()),
        false => std::path::PathBuf::from(&args.python),
    };
    let out = Command::new(&python)
        .current_dir(d)
        .arg(d.join("sbi_npe.py"))
        .arg(d.join("spec.json"))
        .output()
        .map_err(|e| anyhow!("could not start `{}`: {e}", args.python))?;
    if !out.status.success() {
        bail!(
            "the sbi script failed ({}): {}",
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    let stdout = String::from_utf8_lossy(&out.stdout);
    // sbi's progress messages end in carriage returns and its last one in nothing, so the
    // result may follow them on the same line.
    let start = stdout.rfind("{\"sbi_version\"").with_context(|| {
        let out = stdout.trim();
        let tail = &out[out.floor_char_boundary(out.len().saturating_sub(400))..];
        format!("the sbi script printed no result; its output ended with: {tail}")
    })?;
    let line = stdout[start..].lines().next().unwrap_or_default();
    let v: serde_json::Value = serde_json::from_str(line)?;
    let samples = (0..observations.len())
        .map(|k| read_npy::<f32>(&d.join(format!("samples_{k}.npy"))))
        .collect::<Result<Vec<_>>>()?;
    Ok((samples, v["train_s"].as_f64().unwrap_or(f64::NAN)))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every bundled observation (1-3) of both tasks has a published sbi figure at the two
    /// budgets the README compares, each a C2ST accuracy (0.5 to 1), and nothing else
    /// matches.
    #[test]
    fn published_sbi_figures_cover_the_bundled_observations() {
        for task in ["two_moons", "slcp"] {
            for sims in [10_000, 100_000] {
                for obs in 1..=3 {
                    let c = published_sbi(task, sims, obs).expect("listed");
                    assert!((0.5..=1.0).contains(&c), "{task} {sims} {obs}: {c}");
                }
            }
            assert_eq!(published_sbi(task, 1_000, 1), None);
            assert_eq!(published_sbi(task, 10_000, 4), None);
        }
        assert_eq!(published_sbi("gaussian_linear", 10_000, 1), None);
        assert_eq!(PUBLISHED_SBI_NPE.len(), 12);
    }
}
