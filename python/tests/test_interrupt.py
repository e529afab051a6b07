"""Ctrl-C (SIGINT) stops every long call with KeyboardInterrupt and loses nothing: forces
(FMM and direct), lockstep.simulate, lockstep.train (which writes a checkpoint at the
update it stopped after, and resuming from it gives the losses of an uninterrupted run),
lockstep.npe.train and lockstep.nbody.simulate. Each call runs in a child process that gets a
real SIGINT one second into the call."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import lockstep

# The child installs Python's Ctrl-C handler itself: a job started in the background by a
# non-interactive shell (`make test &`, nohup) inherits SIGINT ignored, and Python then raises
# no KeyboardInterrupt; at a terminal the handler is always there. After the interruption
# the child makes one more call, which must work (the flag was cleared).
CHILD = """
import signal, sys, time
import numpy as np
signal.signal(signal.SIGINT, signal.default_int_handler)
import lockstep, lockstep.nbody, lockstep.npe
call = eval(sys.argv[1])
print("ready", flush=True)
t0 = time.perf_counter()
try:
    call()
    print("finished", time.perf_counter() - t0, flush=True)
except KeyboardInterrupt as e:
    took = time.perf_counter() - t0
    acc, _ = lockstep.nbody.forces(np.array([[0.0, 0, 0], [1, 0, 0]]), np.ones(2), method="direct")
    assert acc[0][0] == 1.0, acc
    print("interrupted", took, str(e).replace("\\n", " "), flush=True)
"""


def interrupt(call: str, cwd, delay: float = 1.0) -> str:
    """Runs `call` (a Python lambda's source) in a child, sends SIGINT `delay` s after it
    began and returns the child's line: `interrupted SECONDS MESSAGE`."""
    proc = subprocess.Popen([sys.executable, "-c", CHILD, call], cwd=cwd, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "ready"
        time.sleep(delay)
        t0 = time.perf_counter()
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=60)
        stopped = time.perf_counter() - t0
        last = out.strip().splitlines()[-1] if out.strip() else ""
        assert last.startswith("interrupted"), out
        assert stopped < 10, (stopped, last)
        return last
    finally:
        # A child that ignored the signal would go on computing after a failure.
        proc.kill()
        proc.wait()


@pytest.mark.parametrize(
    "method, n",
    # Both calls take well over a minute on 2 cores: the signal lands inside them.
    [("direct", 200_000), ("fmm", 1_000_000)],
)
def test_ctrl_c_stops_forces(tmp_path, method, n):
    call = (
        f"lambda: lockstep.nbody.forces(np.random.default_rng(0).normal(size=({n}, 3)), "
        f"np.full({n}, 1.0 / {n}), method={method!r}, order=6, theta=0.3, leaf_size=8)"
    )
    out = interrupt(call, tmp_path)
    assert "interrupted (Ctrl-C)" in out, out


def test_ctrl_c_stops_a_simulation_and_writes_nothing(glif_example):
    cfg = json.loads((glif_example / "config.simulate.json").read_text())
    cfg["run"]["tstop"] = 3e5  # about 10 s on 2 cores
    cfg["reports"] = {}
    cfg["manifest"]["$OUTPUT_DIR"] = "$BASE_DIR/long"
    path = glif_example / "long.json"
    path.write_text(json.dumps(cfg))
    out = interrupt(f"lambda: lockstep.simulate({str(path)!r}, progress=False)", glif_example)
    assert "nothing was written" in out, out
    long = glif_example / "long"
    assert not long.exists() or not list(long.glob("spikes*")), list(long.iterdir())


def test_ctrl_c_stops_training_with_a_checkpoint_that_resumes_exactly(glif_example):
    cfg = json.loads((glif_example / "config.train.json").read_text())
    cfg["run"].update({"seq_len": 100, "batch_size": 2})
    cfg["training"].update({"optimizer_updates": 1_000_000, "checkpoint_every": 100_000})
    cfg["manifest"]["$OUTPUT_DIR"] = "$BASE_DIR/long"
    path = glif_example / "long.json"
    path.write_text(json.dumps(cfg))
    out = interrupt(f"lambda: lockstep.train({str(path)!r})", glif_example)
    m = re.search(r"after update (\d+); checkpoint (\S+update_\d+\.safetensors)", out)
    assert m, out
    k = int(m.group(1))
    assert k >= 1 and (glif_example / "long" / "checkpoints" / f"update_{k:06d}.safetensors").is_file()
    assert f"update_{k:06d}" in (glif_example / "long" / "checkpoints" / "latest").read_text()
    resumed = lockstep.train(path, updates=k + 2, resume=glif_example / "long")
    straight = lockstep.train(path, updates=k + 2, output_dir=glif_example / "straight")
    assert len(resumed.loss_history) == 2
    assert resumed.loss_history == straight.loss_history[-2:]


def test_ctrl_c_stops_npe_training_with_a_checkpoint(tmp_path, npe_settings):
    run = tmp_path / "run"
    out = interrupt(f"lambda: lockstep.npe.train({str(npe_settings)!r}, {str(run)!r}, epochs=1_000_000)", tmp_path)
    m = re.search(r"after update (\d+); checkpoint (\S+\.safetensors)", out)
    assert m, out
    assert Path(m.group(2)).is_file() and Path(m.group(2)).is_relative_to(run), out


def test_ctrl_c_stops_an_nbody_run_keeping_its_snapshots(tmp_path):
    cfg = {
        "units": {"gravitational_constant": 1.0},
        "initial_conditions": {
            "kind": "clumps", "n": 2000, "clumps": 3, "total_mass": 1.0, "box_size": 4.0,
            "clump_radius": 0.3, "velocity_dispersion": 0.0, "seed": 11,
        },
        "forces": {"method": "direct", "softening": 0.05},
        "integrator": "kdk",
        "time": {"t_start": 0.0, "t_end": 100.0, "steps": 1_000_000},
        "output": {"dir": "run", "every": 100_000},
    }
    path = tmp_path / "long.json"
    path.write_text(json.dumps(cfg))
    out = interrupt(f"lambda: lockstep.nbody.simulate({str(path)!r})", tmp_path)
    assert "interrupted (Ctrl-C)" in out, out
    assert len(list((tmp_path / "run").glob("*.hdf5"))) == 1
