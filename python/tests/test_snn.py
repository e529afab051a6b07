"""lockstep.simulate and lockstep.train on the bundled glif_all2all example: the same spikes,
reports and losses as the `lockstep simulate` / `lockstep train` commands."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import h5py
import numpy as np
import pytest

import lockstep
from conftest import ROOT, run_cli


def short_simulation(example, name, tstop=200.0):
    cfg = json.loads((example / "config.simulate.json").read_text())
    cfg["run"]["tstop"] = tstop
    cfg["manifest"]["$OUTPUT_DIR"] = f"$BASE_DIR/{name}"
    cfg["reports"] = {
        "v": {"cells": "v1", "variable_name": "V_m", "module": "multimeter_report", "sections": "soma", "interval": 1.0}
    }
    path = example / f"{name}.json"
    path.write_text(json.dumps(cfg))
    return path


def test_simulate_equals_the_command(glif_example):
    cli_cfg = short_simulation(glif_example, "cli")
    py_cfg = short_simulation(glif_example, "py")
    run_cli("simulate", cli_cfg, cwd=glif_example)
    out = lockstep.simulate(py_cfg, progress=False)
    sp = out["spikes"]
    assert sp["node_ids"].dtype == np.uint64 and sp["timestamps"].dtype == np.float64
    assert len(sp["population"]) == len(sp["node_ids"]) == out["n_spikes"] > 0
    with h5py.File(glif_example / "cli" / "spikes.h5", "r") as f:
        pops = list(f["spikes"].keys())
        ids = np.concatenate([f["spikes"][p]["node_ids"][()] for p in pops])
        ts = np.concatenate([f["spikes"][p]["timestamps"][()] for p in pops])
        names = sum(([p] * len(f["spikes"][p]["node_ids"]) for p in pops), [])
    assert np.array_equal(sp["node_ids"], ids) and np.array_equal(sp["timestamps"], ts)
    assert list(sp["population"]) == names
    rep = out["reports"]["v"]
    with h5py.File(rep["file"], "r") as f:
        pop = list(f["report"].keys())[0]
        data = f["report"][pop]["data"][()]
    with h5py.File(glif_example / "cli" / "v.h5", "r") as f:
        cli_data = f["report"][pop]["data"][()]
    got = rep["populations"][pop]["data"]
    assert got.shape == data.shape and np.array_equal(got, data.astype(np.float64))
    assert np.array_equal(cli_data, data)
    assert len(rep["populations"][pop]["times"]) == got.shape[0]


def test_simulate_errors(tmp_path, glif_example):
    with pytest.raises(FileNotFoundError):
        lockstep.simulate(tmp_path / "none.json")
    cfg = json.loads((glif_example / "config.simulate.json").read_text())
    cfg["run"]["tsop"] = 5
    bad = glif_example / "bad.json"
    bad.write_text(json.dumps(cfg))
    with pytest.raises(ValueError) as e:
        lockstep.simulate(bad)
    assert "tsop" in str(e.value) and "tstop" in str(e.value)
    with pytest.raises(ValueError):
        lockstep.simulate(bad, trials=0)


def short_training(example, name):
    cfg = json.loads((example / "config.train.json").read_text())
    cfg["run"].update({"seq_len": 100, "batch_size": 2})
    cfg["training"].update({"optimizer_updates": 3, "checkpoint_every": 3})
    cfg["manifest"]["$OUTPUT_DIR"] = f"$BASE_DIR/{name}"
    path = example / f"{name}.json"
    path.write_text(json.dumps(cfg))
    return path


def test_train_equals_the_command(glif_example):
    cfg = short_training(glif_example, "runs_train")
    run_cli("train", cfg, "--output-dir", glif_example / "cli", cwd=glif_example)
    result = lockstep.train(cfg, output_dir=glif_example / "py")
    assert result.run_dir == str(glif_example / "py")
    cli_rows = (glif_example / "cli" / "callbacks" / "losses.csv").read_text().splitlines()
    py_rows = (glif_example / "py" / "callbacks" / "losses.csv").read_text().splitlines()
    assert cli_rows == py_rows and len(result.loss_history) == 3
    for row, losses in zip(cli_rows[1:], result.loss_history):
        # losses.csv holds 10 significant digits (Rust's {:.9e}).
        assert [float(c) for c in row.split(",")[2:-1]] == [float(f"{v:.9e}") for v in losses]
    # updates= overrides training.optimizer_updates, as --updates does.
    short = lockstep.train(cfg, updates=1, output_dir=glif_example / "py1")
    assert len(short.loss_history) == 1 and short.loss_history[0] == result.loss_history[0]
    with pytest.raises(ValueError) as e:
        lockstep.train(cfg, updates=-1)
    assert "updates=-1" in str(e.value)
    bad = json.loads(cfg.read_text())
    bad["training"]["optimiser"] = bad["training"].pop("optimizer")
    bad_path = glif_example / "bad_train.json"
    bad_path.write_text(json.dumps(bad))
    with pytest.raises(ValueError) as e:
        lockstep.train(bad_path)
    assert "optimiser" in str(e.value) and "optimizer" in str(e.value), str(e.value)


MPI_SCRIPT = """
import sys
import lockstep
rank, size = lockstep.mpi_rank_and_size()
import mpi4py
mpi4py.rc.initialize = False
mpi4py.rc.finalize = False
from mpi4py import MPI
assert MPI.Is_initialized() and MPI.COMM_WORLD.Get_rank() == rank and MPI.COMM_WORLD.Get_size() == size
result = lockstep.train(sys.argv[1], output_dir=sys.argv[2], updates=2)
total = MPI.COMM_WORLD.allreduce(len(result.loss_history))
# One write per line (atomic on a pipe), so the two ranks' lines do not interleave.
sys.stdout.write(f"rank {rank} of {size} updates {total}\\n")
sys.stdout.flush()
"""


def test_mpi_job_with_mpi4py(glif_example, tmp_path):
    pytest.importorskip("mpi4py", reason="mpi4py is not installed (pip install mpi4py)")
    cfg = json.loads((glif_example / "config.mpi.json").read_text())
    cfg["run"].update({"seq_len": 100, "batch_size": 2})
    cfg["run"]["distribution"]["global_batch_size"] = 4
    path = glif_example / "mpi.json"
    path.write_text(json.dumps(cfg))
    script = tmp_path / "job.py"
    script.write_text(MPI_SCRIPT)
    proc = subprocess.run(
        ["mpirun", "-n", "2", "--oversubscribe", "--bind-to", "none", sys.executable, str(script),
         str(path), str(glif_example / "mpi_run")],
        capture_output=True, text=True, timeout=600,
        # mpirun refuses to run as root (CI, containers) unless told; harmless otherwise.
        env=dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1"),
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "rank 0 of 2 updates 4" in proc.stdout and "rank 1 of 2 updates 4" in proc.stdout, proc.stdout
