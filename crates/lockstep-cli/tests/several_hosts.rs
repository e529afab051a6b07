//! Several hosts (issue 48): MPI jobs across two hosts, simulated on this machine by
//! `scripts/two-hosts.sh` (two network namespaces joined by a veth pair, each with its own
//! host name and address; Open MPI starts its daemon on hostb through the script's launch
//! agent instead of ssh; TCP restricted to the pair's link; one shared filesystem).
//!
//! On 2 hosts x 1 rank and 2 hosts x 2 ranks: `lockstep train` and `lockstep npe train`
//! log the losses of the same job on one host (to 1e-6) while hostb sees the run folder
//! read-only (only the chief, on hosta, writes it), and their checkpoints resume on one
//! host; `lockstep nbody` computes the forces of one rank and every rank writes its
//! snapshot files into the one folder; `lockstep info` and the memory check count the ranks
//! of each host (node-local rank 0 or 1 of 2), not of the job; a rank on hostb that fails or
//! is killed ends the job within 10 s, naming the rank and hostb; a config that does not
//! match the launch is refused before any output.
//!
//! The bed needs root (network namespaces); without it every test fails saying so. The
//! tests take the bed in turn (one at a time in this process); each sets it up and tears
//! it down, also when it fails. Every job runs under an external time limit.

use lockstep_comm::launch::{mpirun_command, run_with_limit, JobOutput};
use serde_json::{json, Value};
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::{Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

const LOCKSTEP: &str = env!("CARGO_BIN_EXE_lockstep");
/// The limit of every job (they take seconds); a job that reaches it fails its test.
const LIMIT: Duration = Duration::from_secs(180);

/// One test at a time holds the bed (the namespaces are machine-wide).
static BED: Mutex<()> = Mutex::new(());

fn script() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../scripts/two-hosts.sh")
}

/// The two-host bed, up while this value lives; dropping it (also while a failed test
/// unwinds) tears the bed down with every process still inside.
struct TwoHosts {
    _turn: MutexGuard<'static, ()>,
}

impl TwoHosts {
    fn up() -> TwoHosts {
        let turn = BED.lock().unwrap_or_else(PoisonError::into_inner);
        let out = Command::new(script()).arg("up").output().unwrap();
        assert!(
            out.status.success(),
            "the two-host test bed could not be set up (scripts/two-hosts.sh up needs root and network namespaces):\n{}",
            String::from_utf8_lossy(&out.stderr)
        );
        TwoHosts { _turn: turn }
    }

    /// `mpirun` on hosta with `per_host` ranks on each of hosta and hostb, running
    /// `lockstep ARGS`. The command's `TWO_HOSTS_READONLY` and `TWO_HOSTS_LOCAL` change what
    /// hostb sees (scripts/two-hosts.sh).
    fn mpirun(&self, per_host: usize, args: &[&str]) -> Command {
        let mut cmd = Command::new(script());
        cmd.arg("mpirun")
            .arg("-n")
            .arg((2 * per_host).to_string())
            .arg("--host")
            .arg(format!("hosta:{per_host},hostb:{per_host}"))
            .args(["--oversubscribe", "--bind-to", "none"])
            .arg(LOCKSTEP)
            .args(args)
            .env("OMPI_ALLOW_RUN_AS_ROOT", "1")
            .env("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1");
        cmd
    }

    /// The inode of hostb's network namespace (to tell where a process runs).
    fn hostb_netns(&self) -> u64 {
        let prefix = std::env::var("TWO_HOSTS_PREFIX").unwrap_or_else(|_| "lockstep".into());
        std::fs::metadata(format!("/run/netns/{prefix}-hostb"))
            .unwrap()
            .ino()
    }
}

impl Drop for TwoHosts {
    fn drop(&mut self) {
        let out = Command::new(script()).arg("down").output();
        if !matches!(&out, Ok(o) if o.status.success()) {
            eprintln!("scripts/two-hosts.sh down failed: {out:?}");
        }
    }
}

fn run(cmd: Command) -> JobOutput {
    let out = run_with_limit(cmd, LIMIT).unwrap();
    assert!(!out.timed_out, "the job timed out:\n{}", out.all_output());
    out
}

fn ok(out: JobOutput) -> JobOutput {
    assert!(out.success(), "{}", out.all_output());
    out
}

/// `mpirun -n ranks lockstep ARGS` on this machine alone (one host).
fn one_host(ranks: usize, args: &[&str]) -> Command {
    let mut cmd = mpirun_command(ranks);
    cmd.arg(LOCKSTEP).args(args);
    cmd
}

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

/// The last column (the total loss) of each row of a losses CSV.
fn losses(run: &Path) -> Vec<f64> {
    let path = run.join("callbacks/losses.csv");
    let text = std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("cannot read {}: {e}", path.display()));
    text.lines()
        .skip(1)
        .map(|l| l.rsplit(',').next().unwrap().parse().unwrap())
        .collect()
}

/// `got` equals `want` (row by row, to 1e-6 relative) over `want`'s rows.
fn assert_losses_match(got: &[f64], want: &[f64], what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: {got:?} vs {want:?}");
    for (a, b) in got.iter().zip(want) {
        assert!(
            (a - b).abs() <= 1e-6 * b.abs(),
            "{what}: losses {got:?}, one host {want:?}"
        );
    }
}

fn rel_l2(a: &[f32], b: &[f32]) -> f64 {
    assert_eq!(a.len(), b.len());
    let num: f64 = a.iter().zip(b).map(|(x, y)| ((x - y) as f64).powi(2)).sum();
    let den: f64 = b.iter().map(|y| (*y as f64).powi(2)).sum();
    (num / den).sqrt()
}

/// Every file under `dir`, relative to it, sorted.
fn files(dir: &Path) -> Vec<String> {
    fn walk(base: &Path, dir: &Path, out: &mut Vec<String>) {
        for e in std::fs::read_dir(dir).unwrap().flatten() {
            let p = e.path();
            if p.is_dir() {
                walk(base, &p, out);
            } else {
                out.push(p.strip_prefix(base).unwrap().display().to_string());
            }
        }
    }
    let mut out = Vec::new();
    walk(dir, dir, &mut out);
    out.sort();
    out
}

/// A `lockstep train` config on the bundled 300-cell network: global batch 4 of 40 steps,
/// `local` samples per rank (`None`: a serial config, no run.distribution).
fn train_config(dir: &Path, name: &str, local: Option<usize>, updates: usize) -> PathBuf {
    let ex = std::path::absolute(
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../examples/glif_all2all"),
    )
    .unwrap();
    let mut run = json!({"dt": 1.0, "seq_len": 40, "batch_size": local.unwrap_or(4), "seed": 77});
    if let Some(b) = local {
        run["distribution"] = json!({"strategy": "mpi", "global_batch_size": 4});
        assert_eq!(4 % b, 0);
    }
    let c = json!({
        "network": ex.join("config.circuit.json"),
        "inputs": {"lgn": {"input_type": "poisson", "rate": 20.0, "node_set": "lgn"}},
        "run": run,
        "training": {
            "optimizer": {"name": "adam", "learning_rate": 0.01},
            "optimizer_updates": updates,
            "losses": [{"name": "TargetFiringRate", "firing_rate": ex.join("target_rates.csv")}],
            "checksum_every": 1,
        },
        "output": {"output_dir": dir.join("runs").join(name)},
    });
    let path = dir.join(format!("{name}.json"));
    std::fs::write(&path, serde_json::to_string_pretty(&c).unwrap()).unwrap();
    path
}

/// The trainable parameters of a checkpoint.
fn checkpoint(path: &Path) -> Vec<f32> {
    lockstep_train::checkpoint::read(path)
        .unwrap_or_else(|e| panic!("{}: {e}", path.display()))
        .trainable
}

/// `lockstep info` on 2 hosts x 1 and x 2 ranks: every rank reports its host and its
/// node-local rank among the ranks of that host (0 or 1 of 2 on 2 x 2), not its global rank.
#[test]
fn info_reports_node_local_ranks_per_host() {
    let bed = TwoHosts::up();
    for per_host in [1usize, 2] {
        let out = ok(run(bed.mpirun(per_host, &["info"])));
        let size = 2 * per_host;
        let mut seen = Vec::new();
        for rank in 0..size {
            let line = out
                .stdout
                .lines()
                .find(|l| l.starts_with(&format!("rank {rank}/{size}: ")))
                .unwrap_or_else(|| panic!("no line of rank {rank}:\n{}", out.stdout));
            let host = line
                .split("host ")
                .nth(1)
                .unwrap()
                .split(',')
                .next()
                .unwrap();
            let local: usize = line
                .split("node-local rank ")
                .nth(1)
                .unwrap()
                .split(' ')
                .next()
                .unwrap()
                .parse()
                .unwrap();
            assert!(
                line.contains(&format!(
                    "rank {rank} of {size}, node-local rank {local} of {per_host},"
                )),
                "{line}"
            );
            seen.push((host.to_string(), local));
        }
        seen.sort();
        let want: Vec<(String, usize)> = ["hosta", "hostb"]
            .iter()
            .flat_map(|h| (0..per_host).map(move |l| (h.to_string(), l)))
            .collect();
        assert_eq!(seen, want, "{}", out.stdout);
    }
}

/// The memory check multiplies a rank's need by the ranks on its node: 2 on 2 hosts x 2
/// ranks (4 on one host with 4 ranks, the same job). The run is too large either way, so
/// it is refused, by one message, before any output.
#[test]
fn the_memory_check_counts_the_ranks_of_each_host() {
    let bed = TwoHosts::up();
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let cfg = train_config(d, "too_large", Some(1), 2);
    let mut v: Value = serde_json::from_str(&std::fs::read_to_string(&cfg).unwrap()).unwrap();
    // 1e8 steps of forward state per sample: far beyond any test machine.
    v["run"]["seq_len"] = json!(100_000_000);
    std::fs::write(&cfg, v.to_string()).unwrap();
    for (out, per_node) in [
        (run(bed.mpirun(2, &["train", s(&cfg)])), 2),
        (run(one_host(4, &["train", s(&cfg)])), 4),
    ] {
        let text = out.all_output();
        assert!(!out.success(), "{text}");
        assert_eq!(text.matches("this training run needs").count(), 1, "{text}");
        assert!(
            text.contains(&format!("x {per_node} MPI ranks on this node")),
            "expected {per_node} ranks per node:\n{text}"
        );
        assert!(!d.join("runs/too_large").exists());
    }
    // The N-body code counts the same way.
    let nb = nbody_config(d, "too_large_nbody", 2_000_000_000, 1);
    let out = run(bed.mpirun(2, &["nbody", s(&nb)]));
    let text = out.all_output();
    assert!(
        !out.success() && text.contains("x 2 ranks on this machine"),
        "{text}"
    );
    assert!(!d.join("runs/too_large_nbody").exists());
}

/// `lockstep train` on 2 hosts x 1 and x 2 ranks (global batch 4): the losses of the same
/// job on one host, the same weights on either layout; hostb sees the run folders
/// read-only, so only the chief (hosta) can have written them; the 2 x 2 run's checkpoint
/// resumes on one host and ends where the one-host run ends.
#[test]
fn train_on_two_hosts_matches_one_host_and_resumes_on_one() {
    let bed = TwoHosts::up();
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let runs = d.join("runs");
    std::fs::create_dir(&runs).unwrap();
    let one = train_config(d, "one_host", Some(2), 3);
    let start = Instant::now();
    ok(run(one_host(2, &["train", s(&one)])));
    let reference = losses(&runs.join("one_host"));
    assert_eq!(reference.len(), 3);
    for (per_host, local) in [(1usize, 2usize), (2, 1)] {
        let name = format!("two_hosts_x{per_host}");
        let cfg = train_config(d, &name, Some(local), 2);
        let mut cmd = bed.mpirun(per_host, &["train", s(&cfg)]);
        cmd.env("TWO_HOSTS_READONLY", &runs);
        let out = ok(run(cmd));
        assert_eq!(
            out.stdout.matches("Completed 2 optimizer updates.").count(),
            1,
            "{}",
            out.stdout
        );
        assert!(
            out.stdout.contains(&format!(
                "{} replica(s) (mpi), local batch {local}, global batch 4",
                2 * per_host
            )),
            "{}",
            out.stdout
        );
        assert_losses_match(&losses(&runs.join(&name)), &reference[..2], &name);
    }
    let (w1, w2) = (
        checkpoint(&runs.join("two_hosts_x1/checkpoints/update_000002.safetensors")),
        checkpoint(&runs.join("two_hosts_x2/checkpoints/update_000002.safetensors")),
    );
    assert!(
        rel_l2(&w2, &w1) <= 1e-6,
        "2x2 vs 2x1: {:e}",
        rel_l2(&w2, &w1)
    );
    // The same files, whichever the layout (no rank wrote files of its own).
    assert_eq!(
        files(&runs.join("two_hosts_x1")),
        files(&runs.join("two_hosts_x2"))
    );
    // The 2 x 2 run's checkpoint resumes on one host (2 ranks there).
    let cfg = train_config(d, "resumed", Some(2), 3);
    let resume = runs.join("two_hosts_x2");
    let out = ok(run(one_host(
        2,
        &["train", s(&cfg), "--resume", s(&resume)],
    )));
    assert!(out.stdout.contains("updates 2..3"), "{}", out.stdout);
    let resumed = losses(&runs.join("resumed"));
    assert_losses_match(&resumed[resumed.len() - 1..], &reference[2..], "resumed");
    let (wr, wo) = (
        checkpoint(&runs.join("resumed/checkpoints/update_000003.safetensors")),
        checkpoint(&runs.join("one_host/checkpoints/update_000003.safetensors")),
    );
    assert!(
        rel_l2(&wr, &wo) <= 1e-6,
        "resumed vs one host: {:e}",
        rel_l2(&wr, &wo)
    );
    eprintln!("train on two hosts: {:.1} s", start.elapsed().as_secs_f64());
}

/// Dingo-shaped settings for gaussian_linear in 2 dimensions: 356 simulations (320 for
/// training), total batch 64: 5 updates per epoch, 2 epochs, a checkpoint every epoch.
fn npe_settings(dir: &Path) -> PathBuf {
    let text = "data:
  task: {name: gaussian_linear, dim: 2}
  num_samples: 356
  train_fraction: 0.9
  seed: 5
model:
  posterior_model_type: normalizing_flow
  posterior_kwargs:
    num_flow_steps: 2
    base_transform_kwargs:
      hidden_dim: 16
      num_transform_blocks: 1
      activation: elu
      dropout_probability: 0.0
      norm: layer_norm
      num_bins: 8
      base_transform_type: rq-coupling
      tail_bound: 3.0
  embedding_kwargs:
    output_dim: 8
    hidden_dims: [16, 16]
    activation: elu
    dropout: 0.0
    norm: layer_norm
training:
  stage_0:
    epochs: 2
    batch_size: 64
    optimizer:
      type: adam
      lr: 0.003
    scheduler:
      type: cosine
      T_max: 2
local:
  device: cpu
  checkpoint_epochs: 1
";
    let path = dir.join("gaussian_linear.yaml");
    std::fs::write(&path, text).unwrap();
    path
}

/// The trainable and frozen parameters of an NPE checkpoint.
fn npe_checkpoint(path: &Path) -> Vec<f32> {
    let state = lockstep_train::checkpoint::read(path)
        .unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    [state.trainable, state.frozen].concat()
}

/// `lockstep npe train` on 2 hosts x 1 and x 2 ranks: the losses of the same job on one
/// host (2 ranks), only the chief writes the train folder (hostb sees it read-only), and
/// the 2 x 2 run's mid-training checkpoint resumes on one host to the one-host end.
#[test]
fn npe_train_on_two_hosts_matches_one_host_and_resumes_on_one() {
    let bed = TwoHosts::up();
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let runs = d.join("runs");
    std::fs::create_dir(&runs).unwrap();
    let cfg = npe_settings(d);
    let start = Instant::now();
    let one = runs.join("one_host");
    ok(run(one_host(
        2,
        &["npe", "train", s(&cfg), "--train-dir", s(&one)],
    )));
    let reference = losses(&one);
    assert_eq!(reference.len(), 10, "{reference:?}");
    for per_host in [1usize, 2] {
        let r = runs.join(format!("two_hosts_x{per_host}"));
        let mut cmd = bed.mpirun(per_host, &["npe", "train", s(&cfg), "--train-dir", s(&r)]);
        cmd.env("TWO_HOSTS_READONLY", &runs);
        let out = ok(run(cmd));
        assert_eq!(
            out.stdout
                .matches("Completed 10 optimizer updates.")
                .count(),
            1,
            "{}",
            out.stdout
        );
        let log = std::fs::read_to_string(r.join("run.log")).unwrap();
        let local = 64 / (2 * per_host);
        assert!(
            log.contains(&format!("{} replica(s)", 2 * per_host))
                && log.contains(&format!("local batch {local},")),
            "{log}"
        );
        assert_losses_match(&losses(&r), &reference, &format!("npe {per_host} per host"));
    }
    assert_eq!(
        files(&runs.join("two_hosts_x1")),
        files(&runs.join("two_hosts_x2"))
    );
    // Resume the 2 x 2 run after its first epoch on one host, into a new folder.
    let mid = runs.join("two_hosts_x2/checkpoints/update_000005.safetensors");
    let resumed = runs.join("resumed");
    let out = ok(run(one_host(
        2,
        &[
            "npe",
            "train",
            s(&cfg),
            "--train-dir",
            s(&resumed),
            "--resume",
            s(&mid),
        ],
    )));
    let log = std::fs::read_to_string(resumed.join("run.log")).unwrap();
    assert!(log.contains("updates 5..10"), "{log}\n{}", out.stdout);
    let rl = losses(&resumed);
    assert_losses_match(&rl[rl.len() - 5..], &reference[5..], "npe resumed");
    let last = "checkpoints/update_000010.safetensors";
    let dr = rel_l2(
        &npe_checkpoint(&resumed.join(last)),
        &npe_checkpoint(&one.join(last)),
    );
    assert!(dr <= 1e-5, "resumed vs one host: {dr:e}");
    eprintln!(
        "npe train on two hosts: {:.1} s",
        start.elapsed().as_secs_f64()
    );
}

/// An N-body config: a Plummer sphere of `n` particles, FMM forces, `steps` steps of 0.01
/// with a snapshot after each.
fn nbody_config(dir: &Path, name: &str, n: u64, steps: usize) -> PathBuf {
    let cfg = json!({
        "units": {"gravitational_constant": 1.0},
        "initial_conditions": {"kind": "plummer", "n": n, "seed": 7},
        "forces": {"method": "fmm", "softening": 0.05},
        "time": {"t_start": 0.0, "t_end": 0.01 * steps as f64, "steps": steps},
        "output": {"dir": dir.join("runs").join(name), "every": 1}
    });
    let path = dir.join(format!("{name}.json"));
    std::fs::write(&path, cfg.to_string()).unwrap();
    path
}

/// The particles of output `index` (the union of every rank's file), by id.
fn snapshot(dir: &Path, index: usize) -> lockstep_nbody::Particles {
    let path = dir.join(format!("snap_{index:03}.0.hdf5"));
    let p = lockstep_nbody::snapshot::read_gadget_hdf5(&path, 0, 1, 1.0)
        .unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let mut order: Vec<usize> = (0..p.num).collect();
    order.sort_by_key(|&i| p.id[i]);
    lockstep_nbody::Particles::from_arrays(
        order.iter().map(|&i| p.pos[i]).collect(),
        order.iter().map(|&i| p.vel[i]).collect(),
        order.iter().map(|&i| p.mass[i]).collect(),
        order.iter().map(|&i| p.id[i]).collect(),
    )
    .unwrap()
}

/// The acceleration of each particle over the first step, from its velocities before and
/// after (a drift-kick-drift step kicks once: `v1 = v0 + a dt`).
fn accelerations(dir: &Path, dt: f64) -> lockstep_nbody::Forces {
    let (p0, p1) = (snapshot(dir, 0), snapshot(dir, 1));
    assert_eq!(p0.id, p1.id);
    let mut f = lockstep_nbody::Forces::zeros(p0.num);
    for i in 0..p0.num {
        for k in 0..3 {
            f.acc[i][k] = (p1.vel[i][k] - p0.vel[i][k]) / dt;
        }
        // The potential is not in the snapshot; compare accelerations only.
        f.pot[i] = 1.0;
    }
    f
}

/// `lockstep nbody` on 2 hosts x 1 and x 2 ranks: the forces of a 1-rank run to the sharded
/// tests' tolerance (99th percentile of the relative acceleration error at most 1e-3), and
/// every rank's snapshot files, numbered by rank, in the one output folder.
#[test]
fn nbody_on_two_hosts_matches_one_rank() {
    let bed = TwoHosts::up();
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let start = Instant::now();
    let one = nbody_config(d, "one_rank", 4000, 2);
    let mut cmd = Command::new(LOCKSTEP);
    cmd.args(["nbody", s(&one), "--quiet"]);
    ok(run(cmd));
    let reference_dir = d.join("runs/one_rank");
    let reference = accelerations(&reference_dir, 0.01);
    let final_one = snapshot(&reference_dir, 2);
    for per_host in [1usize, 2] {
        let ranks = 2 * per_host;
        let name = format!("two_hosts_x{per_host}");
        let cfg = nbody_config(d, &name, 4000, 2);
        let out = ok(run(bed.mpirun(per_host, &["nbody", s(&cfg), "--quiet"])));
        assert!(
            out.stdout
                .contains(&format!("4000 particles on {ranks} rank(s)")),
            "{}",
            out.stdout
        );
        let out_dir = d.join("runs").join(&name);
        // Exactly one file of each kind per rank and output, numbered 0..ranks.
        let mut want: Vec<String> = Vec::new();
        for index in 0..=2 {
            for r in 0..ranks {
                want.push(format!("snapshot_{index:04}_rank_{r:04}.npz"));
                want.push(format!("snap_{index:03}.{r}.hdf5"));
            }
        }
        want.sort();
        let got: Vec<String> = files(&out_dir)
            .into_iter()
            .filter(|f| f.starts_with("snap"))
            .collect();
        assert_eq!(got, want);
        for r in 0..ranks {
            let f = hdf5::File::open(out_dir.join(format!("snap_001.{r}.hdf5"))).unwrap();
            let n: Vec<u32> = f
                .group("Header")
                .unwrap()
                .attr("NumFilesPerSnapshot")
                .unwrap()
                .read_raw()
                .unwrap();
            assert_eq!(n, vec![ranks as u32], "rank {r}'s file");
        }
        let acc = accelerations(&out_dir, 0.01);
        assert_eq!(acc.acc.len(), 4000, "every particle once");
        let err = lockstep_nbody::accuracy::compare(&acc, &reference);
        assert!(err.acc.p99 <= 1e-3, "{name}: {:?}", err.acc);
        let last = snapshot(&out_dir, 2);
        assert_eq!(last.id, final_one.id);
    }
    eprintln!("nbody on two hosts: {:.1} s", start.elapsed().as_secs_f64());
}

/// The pids of the processes of `lockstep` whose command line contains `marker` and whose
/// environment says `OMPI_COMM_WORLD_RANK=rank`.
fn rank_pids(marker: &str, rank: usize) -> Vec<i32> {
    let want = format!("OMPI_COMM_WORLD_RANK={rank}");
    std::fs::read_dir("/proc")
        .unwrap()
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<i32>().ok())
        .filter(|pid| {
            let cmd = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
            let cmd = String::from_utf8_lossy(&cmd);
            let env = std::fs::read(format!("/proc/{pid}/environ")).unwrap_or_default();
            cmd.starts_with(LOCKSTEP)
                && cmd.contains(marker)
                && env.split(|&b| b == 0).any(|v| v == want.as_bytes())
        })
        .collect()
}

/// The inode of a process's network namespace.
fn netns_of(pid: i32) -> u64 {
    std::fs::metadata(format!("/proc/{pid}/ns/net"))
        .unwrap()
        .ino()
}

/// A rank on hostb killed (SIGKILL) in the middle of a 2 x 2 training run ends the whole
/// job within 10 s, and mpirun's report names the rank and hostb.
#[test]
fn a_rank_killed_on_the_second_host_ends_the_job_within_10_s() {
    let bed = TwoHosts::up();
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let cfg = train_config(d, "killed", Some(1), 100_000);
    let run_dir = d.join("runs/killed");
    let hostb = bed.hostb_netns();
    let marker = s(&cfg).to_string();
    let killer = std::thread::spawn(move || -> Result<(Instant, i32), String> {
        let started = Instant::now();
        let log = run_dir.join("callbacks/losses.csv");
        // Wait for the first logged updates, then kill rank 3.
        while std::fs::read_to_string(&log).map_or(0, |t| t.lines().count()) < 3 {
            if started.elapsed() > Duration::from_secs(120) {
                return Err("training never started".into());
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        let pids = rank_pids(&marker, 3);
        let [pid] = pids[..] else {
            return Err(format!("expected one process of rank 3, found {pids:?}"));
        };
        if netns_of(pid) != hostb {
            return Err(format!("rank 3 (pid {pid}) does not run on hostb"));
        }
        // SAFETY: kill has no memory-safety preconditions; the pid is rank 3 of this job.
        if unsafe { libc::kill(pid, libc::SIGKILL) } != 0 {
            return Err(format!("cannot kill {pid}"));
        }
        Ok((Instant::now(), pid))
    });
    // A shorter limit: should the kill go wrong, the job (of 100,000 updates) ends here.
    let out = run_with_limit(bed.mpirun(2, &["train", s(&cfg)]), Duration::from_secs(60)).unwrap();
    let ended = Instant::now();
    let (killed, pid) = killer
        .join()
        .unwrap()
        .unwrap_or_else(|e| panic!("{e}\n{}", out.all_output()));
    let text = out.all_output();
    let after = ended.duration_since(killed);
    eprintln!("the job ended {after:?} after rank 3 (pid {pid}) was killed");
    assert!(!out.success(), "{text}");
    assert!(after < Duration::from_secs(10), "took {after:?}:\n{text}");
    // Open MPI's report: "mpirun noticed that process rank 3 with PID .. on node hostb ..".
    assert!(
        text.contains(&format!("process rank 3 with PID {pid} on node hostb")),
        "the report does not name rank 3 on hostb:\n{text}"
    );
    assert!(
        rank_pids(s(&cfg), 0).is_empty() && rank_pids(s(&cfg), 2).is_empty(),
        "a rank outlived the job"
    );
}

/// The ranks on hostb fail mid-run with an error of their own: hostb sees the N-body
/// output folder read-only (a node without the shared filesystem), so writing their first
/// snapshot files fails once the chief has prepared the folder. The job ends within 10 s;
/// the error names the rank and hostb.
#[test]
fn a_rank_failing_on_the_second_host_ends_the_job_within_10_s() {
    let bed = TwoHosts::up();
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let runs = d.join("runs");
    std::fs::create_dir(&runs).unwrap();
    let cfg = nbody_config(d, "unwritable", 4000, 1000);
    let start = Instant::now();
    let mut cmd = bed.mpirun(1, &["nbody", s(&cfg)]);
    cmd.env("TWO_HOSTS_READONLY", &runs);
    let out = run(cmd);
    let elapsed = start.elapsed();
    let text = out.all_output();
    eprintln!("the job ended after {elapsed:?}");
    assert!(!out.success(), "{text}");
    assert!(
        text.contains("error on rank 1 (host hostb)") && text.contains("Read-only file system"),
        "{text}"
    );
    assert!(
        elapsed < Duration::from_secs(10),
        "took {elapsed:?}:\n{text}"
    );
    // The chief did prepare the folder and write its own first snapshot.
    assert!(runs.join("unwritable/snap_000.0.hdf5").exists(), "{text}");
}

/// A config that does not match the launch (a serial config under mpirun on 2 x 2) is
/// refused once, by the chief, before any output, without an MPI abort, as on one host.
#[test]
fn a_launch_that_does_not_match_the_config_is_refused_before_outputs() {
    let bed = TwoHosts::up();
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let cfg = train_config(d, "serial", None, 2);
    let out = run(bed.mpirun(2, &["train", s(&cfg)]));
    let text = out.all_output();
    assert!(!out.success(), "{text}");
    assert_eq!(
        text.matches("launched by Open MPI (mpirun) with 4 ranks")
            .count(),
        1,
        "{text}"
    );
    assert!(text.contains("error on rank 0 (host hosta)"), "{text}");
    assert!(!text.contains("MPI_ABORT"), "{text}");
    assert!(!d.join("runs/serial").exists());
}

/// An output folder that hostb does not share (it sees an empty folder of its own, as on a
/// node-local disk): the N-body ranks there say so, naming rank and host, before any
/// snapshot is written, and the job ends within 10 s.
#[test]
fn an_output_folder_the_second_host_does_not_share_is_named() {
    let bed = TwoHosts::up();
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let runs = d.join("runs");
    std::fs::create_dir(&runs).unwrap();
    let cfg = nbody_config(d, "not_shared", 4000, 1000);
    let start = Instant::now();
    let mut cmd = bed.mpirun(1, &["nbody", s(&cfg)]);
    cmd.env("TWO_HOSTS_LOCAL", &runs);
    let out = run(cmd);
    let elapsed = start.elapsed();
    let text = out.all_output();
    assert!(!out.success(), "{text}");
    assert!(
        text.contains("rank 1 (host hostb) does not see this folder")
            && text.contains("a filesystem that every host shares"),
        "{text}"
    );
    assert!(
        elapsed < Duration::from_secs(10),
        "took {elapsed:?}:\n{text}"
    );
    let written: Vec<String> = files(&runs.join("not_shared"))
        .into_iter()
        .filter(|f| f.starts_with("snap"))
        .collect();
    assert!(written.is_empty(), "{written:?}");
}
