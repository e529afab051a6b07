"""Shared fixtures of the lockstep package's tests: the `lockstep` command of the same
checkout (built by `cargo build --release --workspace`, as `make test` does), a small
trained NPE run, and copies of the bundled spiking-network example."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
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
    base_transform_kwargs:
      hidden_dim: 16
      num_transform_blocks: 1
      activation: elu
      dropout_probability: 0.0
      norm: none
      num_bins: 8
      base_transform_type: rq-coupling
      tail_bound: 3.0
  embedding_kwargs:
    output_dim: 8
    hidden_dims: [16, 16]
    activation: elu
    dropout: 0.0
    norm: none
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
"""


def run_cli(*args, cwd=None, check=True, timeout=300):
    """Runs the `lockstep` command; returns the CompletedProcess (text)."""
    if not LOCKSTEP.exists():
        pytest.fail(
            f"{LOCKSTEP} is missing: build it first (cargo build --release --workspace) "
            "or set LOCKSTEP_BIN"
        )
    proc = subprocess.run(
        [str(LOCKSTEP), *map(str, args)],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    if check and proc.returncode != 0:
        raise AssertionError(
            f"lockstep {' '.join(map(str, args))} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
        )
    return proc


@pytest.fixture(scope="session")
def npe_settings(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("npe_settings")
    p = d / "settings.yaml"
    p.write_text(NPE_SETTINGS)
    return p


@pytest.fixture(scope="session")
def npe_run(tmp_path_factory, npe_settings) -> Path:
    """A gaussian_linear posterior trained by the `lockstep npe train` command."""
    d = tmp_path_factory.mktemp("npe_run")
    run_cli("npe", "train", npe_settings, "--train-dir", d / "run")
    return d / "run"


@pytest.fixture()
def glif_example(tmp_path) -> Path:
    """A copy of examples/glif_all2all (its network and configs) in a fresh folder, with the
    cell models it names (examples/point_components) beside it."""
    shutil.copytree(ROOT / "examples" / "point_components", tmp_path / "point_components")
    dst = tmp_path / "glif_all2all"
    shutil.copytree(ROOT / "examples" / "glif_all2all", dst, ignore=shutil.ignore_patterns("runs", "output"))
    return dst
