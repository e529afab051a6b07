"""The Python package against the `lockstep` command for the same work (issue 59's
performance criterion: a benchmark, not a test). Needs the package installed (`make python`)
and the release build
(`LOCKSTEP_BIN` names another `lockstep` binary).

    python3 scripts/bench_python.py [--rounds 5] [--samples 1000000] [--bodies 300000]

Both sides compute with the same library functions; what is compared is the time of the work
itself, without process start and model loading, the two alternating round by round (A B A B)
so that a drifting machine affects both:

- sampling: `Posterior.sample(n)` in this process (the posterior loaded once) against the
  command's marginal time for n samples, `lockstep npe sample --num-samples n` minus
  `--num-samples 1` in the same round (the command's marginal time also writes the samples
  to HDF5, so it does more work than the Python call);
- forces: `lockstep.nbody.forces` on the particles of the command's own initial snapshot
  (read back with h5py) against the command's marginal time per force evaluation, a run of 3
  kick-drift-kick steps minus a run of 1 (2 evaluations more, with their kicks and drifts).

Prints each round, then medians and the ratio Python / command of the medians.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import h5py
import numpy as np

import lockstep

ROOT = Path(__file__).resolve().parents[1]
LOCKSTEP = Path(os.environ.get("LOCKSTEP_BIN", ROOT / "target" / "release" / "lockstep"))

NPE_SETTINGS = """data:
  task: {name: gaussian_linear, dim: 2}
  num_samples: 300
  train_fraction: 0.9
  seed: 5
model:
  posterior_model_type: normalizing_flow
  posterior_kwargs:
    num_flow_steps: 2
    base_transform_kwargs: {hidden_dim: 16, num_transform_blocks: 1, activation: elu,
      dropout_probability: 0.0, norm: none, num_bins: 8, base_transform_type: rq-coupling,
      tail_bound: 3.0}
  embedding_kwargs: {output_dim: 8, hidden_dims: [16, 16], activation: elu, dropout: 0.0, norm: none}
training:
  stage_0: {epochs: 2, batch_size: 64, optimizer: {type: adam, lr: 0.003}, scheduler: {type: cosine, T_max: 2}}
local: {device: cpu}
"""


def timed(f) -> float:
    t0 = time.perf_counter()
    f()
    return time.perf_counter() - t0


def command(*args) -> None:
    subprocess.run([str(LOCKSTEP), *map(str, args)], check=True, capture_output=True)


def sampling(d: Path, n: int, rounds: int) -> tuple:
    (d / "settings.yaml").write_text(NPE_SETTINGS)
    run = d / "npe"
    command("npe", "train", d / "settings.yaml", "--train-dir", run)
    post = lockstep.npe.Posterior.load(run)
    x = [0.3, -0.2]
    post.sample(1000, x=x)
    cli, py = [], []
    for r in range(rounds):
        def cli_run(k):
            return timed(lambda: command("npe", "sample", run, "--observation", "0.3,-0.2",
                                         "--num-samples", k, "--output", d / f"s{k}.h5"))
        base = cli_run(1)
        cli.append(cli_run(n) - base)
        py.append(timed(lambda: post.sample(n, x=x)))
        print(f"  round {r + 1}: sample {n}: command {cli[-1]:.3f} s (marginal), Python {py[-1]:.3f} s", flush=True)
    return cli, py


def forces(d: Path, n: int, rounds: int) -> tuple:
    forces_cfg = {"method": "fmm", "softening": 0.01, "order": 6, "theta": 0.6, "leaf_size": 32}

    def config(steps: int) -> Path:
        cfg = {
            "units": {"gravitational_constant": 1.0},
            "initial_conditions": {"kind": "plummer", "n": n, "total_mass": 1.0, "scale_radius": 1.0, "seed": 42},
            "forces": forces_cfg,
            "integrator": "kdk",
            "time": {"t_start": 0.0, "t_end": 1e-4 * steps, "steps": steps},
            "output": {"dir": f"run{steps}", "every": 1000, "hdf5": True},
        }
        p = d / f"nbody{steps}.json"
        p.write_text(json.dumps(cfg))
        return p

    short, long = config(1), config(3)
    command("nbody", short, "--quiet", "--overwrite")
    snap = sorted((d / "run1").glob("*.hdf5"))[0]
    with h5py.File(snap, "r") as f:
        pos = np.ascontiguousarray(f["PartType1/Coordinates"][()], dtype=np.float64)
        mass = np.ascontiguousarray(f["PartType1/Masses"][()], dtype=np.float64)
    kw = {k: v for k, v in forces_cfg.items() if k != "method"}
    cli, py = [], []
    for r in range(rounds):
        a = timed(lambda: command("nbody", short, "--quiet", "--overwrite"))
        b = timed(lambda: command("nbody", long, "--quiet", "--overwrite"))
        cli.append((b - a) / 2)
        py.append(timed(lambda: lockstep.nbody.forces(pos, mass, G=1.0, method="fmm", **kw)))
        print(f"  round {r + 1}: forces of {n} bodies: command {cli[-1]:.3f} s per evaluation (marginal), Python {py[-1]:.3f} s", flush=True)
    return cli, py


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--samples", type=int, default=1_000_000)
    ap.add_argument("--bodies", type=int, default=300_000)
    a = ap.parse_args()
    if not LOCKSTEP.exists():
        sys.exit(f"{LOCKSTEP} is missing: cargo build --release --workspace")
    with tempfile.TemporaryDirectory() as d:
        for name, (cli, py) in [
            ("sampling", sampling(Path(d), a.samples, a.rounds)),
            ("forces", forces(Path(d), a.bodies, a.rounds)),
        ]:
            c, p = statistics.median(cli), statistics.median(py)
            ratios = sorted(q / k for q, k in zip(py, cli))
            print(f"{name}: median command {c:.3f} s, Python {p:.3f} s; Python / command {p / c:.3f} "
                  f"(per round {ratios[0]:.3f}-{ratios[-1]:.3f})", flush=True)


if __name__ == "__main__":
    main()
