//! Batch-system submission files for `lockstep npe train`, as Dingo writes them for HTCondor
//! (`dingo_train --settings ... --train_dir ...` inside a submit description with the
//! resources of `local.condor`), plus a Slurm `sbatch` script.
//!
//! The replica count is `local.num_gpus` (Dingo's key) or `local.replicas`:
//! - HTCondor runs one process, so the replicas are threads; `request_gpus` is
//!   `local.num_gpus` (the deprecated `local.condor.num_gpus` when it is absent) and
//!   `request_cpus` is `local.condor.num_cpus` (default: the replica count plus
//!   `local.num_workers`).
//! - Slurm runs one MPI rank per replica under `srun` (`--ntasks` = replicas); GPUs are asked
//!   for per task (`--gpus-per-task=1`) or per node (`--gres=gpu:N`) when `local.num_gpus`
//!   is given.

use crate::settings::{GpuRequest, NpeSettings};
use std::fmt::Write as _;
use std::path::Path;

/// What the job runs and where it writes.
#[derive(Debug, Clone)]
pub struct Job<'a> {
    /// The `lockstep` executable (absolute).
    pub executable: &'a Path,
    /// The settings file (absolute).
    pub settings_file: &'a Path,
    /// The run directory (absolute).
    pub train_dir: &'a Path,
    /// The job's stdout, stderr and (HTCondor) event log, without extension: `.out`, `.err`,
    /// `.log` are appended.
    pub log_stem: &'a Path,
}

/// Quotes one argument for HTCondor's new-style `arguments = "..."` syntax: a value with
/// spaces is wrapped in single quotes, single quotes doubled, double quotes doubled.
fn condor_argument(a: &str) -> String {
    let a = a.replace('"', "\"\"");
    if a.contains([' ', '\t', '\'']) {
        format!("'{}'", a.replace('\'', "''"))
    } else {
        a
    }
}

/// Quotes one word for a POSIX shell (single quotes unless it is plain).
fn shell_word(a: &str) -> String {
    if !a.is_empty()
        && a.chars()
            .all(|c| c.is_ascii_alphanumeric() || "/._-+=:,@%".contains(c))
    {
        a.to_string()
    } else {
        format!("'{}'", a.replace('\'', "'\\''"))
    }
}

fn arguments(job: &Job) -> Vec<String> {
    [
        "npe",
        "train",
        &job.settings_file.display().to_string(),
        "--train-dir",
        &job.train_dir.display().to_string(),
    ]
    .iter()
    .map(|s| s.to_string())
    .collect()
}

/// The replica count and the GPUs to request (`None`: none requested), with the warning for
/// the deprecated `local.condor.num_gpus`.
fn replicas_and_gpus(settings: &NpeSettings) -> (usize, Option<usize>, Option<String>) {
    let l = &settings.local;
    let legacy = l.condor.as_ref().and_then(|c| c.num_gpus);
    let (gpus, warning) = match (l.num_gpus, legacy) {
        (Some(g), _) => (Some(g), None),
        (None, Some(g)) => (
            Some(g),
            Some("local.condor.num_gpus is deprecated: set local.num_gpus (the replica count, one per GPU) instead".to_string()),
        ),
        (None, None) => (None, None),
    };
    let replicas = l.replicas.or(gpus).unwrap_or(1);
    (replicas, gpus, warning)
}

/// The HTCondor submit description of `job`, and warnings for the user (deprecated keys).
pub fn condor(settings: &NpeSettings, job: &Job) -> (String, Vec<String>) {
    let (replicas, gpus, warning) = replicas_and_gpus(settings);
    let c = settings.local.condor.clone().unwrap_or_default();
    let stem = job.log_stem.display();
    let mut f = String::new();
    let line = |f: &mut String, k: &str, v: &dyn std::fmt::Display| {
        let _ = writeln!(f, "{k:<15}= {v}");
    };
    let _ = writeln!(
        f,
        "# HTCondor submit description written by `lockstep npe submit --condor`"
    );
    line(&mut f, "universe", &"vanilla");
    line(&mut f, "executable", &job.executable.display());
    let args: Vec<String> = arguments(job).iter().map(|a| condor_argument(a)).collect();
    line(&mut f, "arguments", &format!("\"{}\"", args.join(" ")));
    line(&mut f, "getenv", &"True");
    line(&mut f, "output", &format!("{stem}.out"));
    line(&mut f, "error", &format!("{stem}.err"));
    line(&mut f, "log", &format!("{stem}.log"));
    let loaders = settings.local.num_workers.unwrap_or(0);
    line(
        &mut f,
        "request_cpus",
        &c.num_cpus.unwrap_or(replicas + loaders),
    );
    if let Some(m) = c.memory_cpus {
        line(&mut f, "request_memory", &m);
    }
    if let Some(g) = gpus {
        line(&mut f, "request_gpus", &g);
    }
    if let Some(m) = c.memory_gpus {
        line(
            &mut f,
            "requirements",
            &format!("TARGET.CUDAGlobalMemoryMb > {m}"),
        );
    }
    for l in &c.extra_submit_lines {
        let _ = writeln!(f, "{l}");
    }
    let _ = writeln!(f, "queue");
    (f, warning.into_iter().collect())
}

/// The Slurm batch script of `job`: one MPI rank per replica under `srun`.
pub fn slurm(settings: &NpeSettings, job: &Job) -> String {
    let (replicas, gpus, _) = replicas_and_gpus(settings);
    let s = settings.local.slurm.clone().unwrap_or_default();
    let stem = job.log_stem.display();
    let mut f = String::new();
    let _ = writeln!(f, "#!/bin/bash");
    let _ = writeln!(
        f,
        "# Slurm batch script written by `lockstep npe submit --slurm`"
    );
    let sb = |f: &mut String, v: String| {
        let _ = writeln!(f, "#SBATCH {v}");
    };
    sb(&mut f, "--job-name=lockstep-npe".into());
    sb(&mut f, format!("--ntasks={replicas}"));
    sb(
        &mut f,
        format!("--cpus-per-task={}", s.cpus_per_task.unwrap_or(1)),
    );
    if let Some(m) = s.memory_per_cpu {
        sb(&mut f, format!("--mem-per-cpu={m}"));
    }
    if let Some(g) = gpus {
        match s.gpu_request.unwrap_or(GpuRequest::GpusPerTask) {
            GpuRequest::GpusPerTask => {
                sb(&mut f, format!("--gpus-per-task={}", g.div_ceil(replicas)))
            }
            GpuRequest::Gres => sb(&mut f, format!("--gres=gpu:{g}")),
        }
    }
    if let Some(p) = &s.partition {
        sb(&mut f, format!("--partition={p}"));
    }
    if let Some(t) = &s.time {
        sb(&mut f, format!("--time={t}"));
    }
    sb(&mut f, format!("--output={stem}.out"));
    sb(&mut f, format!("--error={stem}.err"));
    for l in &s.extra_lines {
        let _ = writeln!(f, "{l}");
    }
    let words: Vec<String> = std::iter::once(job.executable.display().to_string())
        .chain(arguments(job))
        .map(|w| shell_word(&w))
        .collect();
    let _ = writeln!(f, "srun {}", words.join(" "));
    f
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn arguments_are_quoted_for_condor_and_the_shell() {
        assert_eq!(condor_argument("/a/b.yaml"), "/a/b.yaml");
        assert_eq!(condor_argument("/my runs/x"), "'/my runs/x'");
        assert_eq!(condor_argument("it's"), "'it''s'");
        assert_eq!(shell_word("/a/b_c-1.yaml"), "/a/b_c-1.yaml");
        assert_eq!(shell_word("/my runs/it's"), "'/my runs/it'\\''s'");
    }
}
