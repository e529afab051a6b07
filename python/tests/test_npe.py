"""lockstep.npe: samples equal `lockstep npe sample` bit for bit (same seed), log-probabilities
equal the library's (the check pairs `lockstep npe export` writes), training equals
`lockstep npe train`, bad input raises with the library's message, long calls release the
GIL and stop on Ctrl-C, and sampling holds one copy of its result."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import h5py
import numpy as np
import pytest

import lockstep
from lockstep.npe import Posterior
from conftest import LOCKSTEP, run_cli

OBS = [0.3, -0.2]


def cli_samples(run, tmp_path, n, seed, *extra):
    out = tmp_path / f"s{seed}_{n}_{len(extra)}.h5"
    run_cli("npe", "sample", run, "--observation", ",".join(map(str, OBS)), "--num-samples", n,
            "--seed", seed, "--output", out, *extra)
    with h5py.File(out, "r") as f:
        return f["samples"][()], f["fraction_outside_prior"][0]


def test_load_and_attributes(npe_run):
    post = Posterior.load(npe_run)
    assert post.parameter_names == ["theta_1", "theta_2"] or len(post.parameter_names) == 2
    assert len(post.prior) == 2 and all(isinstance(b.periodic, bool) for b in post.prior)
    assert post.task == "gaussian_linear" and post.x_dim == 2
    assert post.device == "cpu"
    assert "gaussian_linear" in repr(post)


@pytest.mark.parametrize("seed", [0, 7, -1])
def test_samples_equal_the_command_bit_for_bit(npe_run, tmp_path, seed):
    post = Posterior.load(npe_run)
    # 70,000 rows: more than one chunk of 65,536, as the command draws them.
    n = 70_000
    ref, outside = cli_samples(npe_run, tmp_path, n, seed)
    got = post.sample(n, x=np.array(OBS), seed=seed)
    assert got.dtype == np.float32 and got.shape == (n, 2)
    assert np.array_equal(got, ref)
    assert post.last_drawn == n and post.last_outside / n == pytest.approx(outside)


def test_inside_prior_equals_the_command(npe_run, tmp_path):
    post = Posterior.load(npe_run)
    ref, _ = cli_samples(npe_run, tmp_path, 5000, 3, "--inside-prior")
    got = post.sample(5000, x=OBS, seed=3, inside_prior=True)
    assert np.array_equal(got, ref)


def test_log_prob_equals_the_library(npe_run, tmp_path):
    run_cli("npe", "export", npe_run, "--output-dir", tmp_path, "--check-pairs", 16)
    check = json.loads((tmp_path / "posterior.nflows.json").read_text())["check"]
    theta = np.array(check["theta"], dtype=np.float32)
    x = np.array(check["x"], dtype=np.float64)
    want = np.array(check["log_prob"], dtype=np.float32)
    post = Posterior.load(npe_run)
    got = post.log_prob(theta, x=x)
    assert got.dtype == np.float32 and got.shape == (16,)
    assert np.array_equal(got, want), (got, want)
    # One observation for all rows equals repeating it. Other chunk sizes change the matrix
    # products' blocking, so only the last bits (documented at batch_size).
    one = post.log_prob(theta, x=x[0])
    assert np.array_equal(one, post.log_prob(theta, x=np.repeat(x[:1], 16, axis=0)))
    np.testing.assert_allclose(post.log_prob(theta, x=x[0], batch_size=3), one, rtol=1e-5, atol=1e-6)
    s, lp = post.sample(100, x=x[0], seed=1, return_log_prob=True)
    assert np.array_equal(lp, post.log_prob(s, x=x[0]))


def test_sample_inputs_convert(npe_run):
    post = Posterior.load(npe_run)
    a = post.sample(10, x=np.array(OBS), seed=2)
    for x in (OBS, np.array(OBS, dtype=np.float32).astype(np.float64), np.array([OBS, OBS]).T[:, 0]):
        assert np.array_equal(post.sample(10, x=x, seed=2), a)
    assert np.array_equal(post.sample(10, x=np.array(OBS), seed=2, batch_size=3).shape, (10, 2))


@pytest.mark.parametrize(
    "call, exc, words",
    [
        (lambda p: p.sample(10), ValueError, ["x is missing"]),
        (lambda p: p.sample(10, x=[0.1, np.nan]), ValueError, ["x: value 2 is NaN"]),
        (lambda p: p.sample(10, x=[0.1, np.inf]), ValueError, ["x: value 2"]),
        (lambda p: p.sample(10, x=[0.1, 0.2, 0.3]), ValueError, ["3 values", "gaussian_linear expects 2"]),
        (lambda p: p.sample(10, x=[[0.1, 0.2]]), ValueError, ["x has shape (1, 2)", "1-D"]),
        (lambda p: p.sample(10, x=["a", "b"]), ValueError, ["x is not an array of real numbers"]),
        (lambda p: p.sample(0, x=OBS), ValueError, ["n=0"]),
        (lambda p: p.sample(10, x=OBS, batch_size=0), ValueError, ["batch_size=0"]),
        (lambda p: p.sample(10, x=OBS, seed=2**70), ValueError, ["seed="]),
        (lambda p: p.sample(10**15, x=OBS), RuntimeError, ["memory", "n"]),
        (lambda p: p.log_prob(np.zeros((3, 5)), x=OBS), ValueError, ["theta has 5 columns"]),
        (lambda p: p.log_prob(np.zeros((3, 2)), x=np.zeros((2, 2))), ValueError, ["x has 2 rows but theta has 3"]),
        (lambda p: p.log_prob(np.array([[0.0, np.nan]]), x=OBS), ValueError, ["theta[0, 1] is NaN"]),
        (lambda p: p.log_prob(np.zeros((2, 2)), x=[[0.0, 0.0], [0.0, np.nan]]), ValueError, ["x[1]: value 2 is NaN"]),
    ],
)
def test_bad_input_raises_with_the_message(npe_run, call, exc, words):
    post = Posterior.load(npe_run)
    with pytest.raises(exc) as e:
        call(post)
    assert isinstance(e.value, lockstep.LockstepError)
    for w in words:
        assert w in str(e.value), (w, str(e.value))


def test_load_refuses_missing_and_other_runs(tmp_path, glif_example):
    with pytest.raises(FileNotFoundError) as e:
        Posterior.load(tmp_path / "nothing")
    assert "nothing" in str(e.value)
    with pytest.raises(lockstep.LockstepError) as e:
        Posterior.load(glif_example)
    assert str(glif_example) in str(e.value) or "glif_all2all" in str(e.value)
    with pytest.raises(ValueError) as e:
        Posterior.load(tmp_path, device="tpu")
    assert '"tpu" is not a device' in str(e.value)


def test_sampling_releases_the_gil(npe_run):
    post = Posterior.load(npe_run)
    ticks = []
    stop = threading.Event()

    def count():
        while not stop.is_set():
            ticks.append(time.perf_counter())
            time.sleep(0.001)

    th = threading.Thread(target=count)
    th.start()
    t0 = time.perf_counter()
    post.sample(400_000, x=OBS, seed=1)
    t1 = time.perf_counter()
    stop.set()
    th.join()
    during = [t for t in ticks if t0 < t < t1]
    assert t1 - t0 > 0.1 and len(during) >= 20, (t1 - t0, len(during))


# The child installs Python's Ctrl-C handler itself: a job started in the background by a
# non-interactive shell (`make test &`, nohup) inherits SIGINT ignored, and Python then raises
# no KeyboardInterrupt; at a terminal the handler is always there.
SCRIPT = """
import signal, sys, time, numpy as np
signal.signal(signal.SIGINT, signal.default_int_handler)
from lockstep.npe import Posterior
post = Posterior.load(sys.argv[1])
post.sample(1000, x=[0.3, -0.2])
print("ready", flush=True)
t0 = time.perf_counter()
try:
    post.sample(50_000_000, x=[0.3, -0.2], batch_size=20_000)
    print("finished", time.perf_counter() - t0, flush=True)
except KeyboardInterrupt:
    print("interrupted", time.perf_counter() - t0, flush=True)
"""


def test_ctrl_c_stops_sampling(npe_run):
    proc = subprocess.Popen([sys.executable, "-c", SCRIPT, str(npe_run)], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "ready"
        time.sleep(1.0)
        t0 = time.perf_counter()
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=60)
        assert out.startswith("interrupted"), out
        assert time.perf_counter() - t0 < 10
    finally:
        # A child that ignored the signal would go on sampling 50 million rows after a failure.
        proc.kill()
        proc.wait()


MEMORY = """
import resource, sys, numpy as np
from lockstep.npe import Posterior
n = int(sys.argv[2])
post = Posterior.load(sys.argv[1])
post.sample(1000, x=[0.3, -0.2])
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
s = post.sample(n, x=[0.3, -0.2])
after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
print(before, after, s.nbytes)
"""


def test_sampling_holds_one_copy_of_the_result(npe_run):
    # 1e7 draws of 2 float32 parameters: 80 MB; the peak may grow by the result and the
    # working memory of one chunk, not by a second copy of the result.
    n = 10_000_000 if os.environ.get("LOCKSTEP_PY_FULL_MEMORY_TEST") else 3_000_000
    out = subprocess.run([sys.executable, "-c", MEMORY, str(npe_run), str(n)], capture_output=True,
                         text=True, timeout=900, check=True).stdout.split()
    before, after, nbytes = map(int, out)
    grown = after - before
    assert nbytes == n * 2 * 4
    assert grown < 1.5 * nbytes, (grown, nbytes)


def test_train_equals_the_command(tmp_path, npe_settings):
    result = lockstep.npe.train(npe_settings, tmp_path / "py")
    run_cli("npe", "train", npe_settings, "--train-dir", tmp_path / "cli")
    assert Path(result.run_dir) == tmp_path / "py"
    cli_rows = (tmp_path / "cli" / "callbacks" / "losses.csv").read_text().splitlines()[1:]
    py_rows = (tmp_path / "py" / "callbacks" / "losses.csv").read_text().splitlines()[1:]
    assert cli_rows == py_rows and len(py_rows) == len(result.loss_history) > 0
    for row, losses in zip(cli_rows, result.loss_history):
        cols = row.split(",")[2:-1]
        # losses.csv holds 10 significant digits (Rust's {:.9e}).
        assert [float(c) for c in cols] == [float(f"{v:.9e}") for v in losses]
    # The trained posteriors are the same network: the same samples.
    a = Posterior.load(tmp_path / "py").sample(100, x=OBS, seed=4)
    b = Posterior.load(tmp_path / "cli").sample(100, x=OBS, seed=4)
    assert np.array_equal(a, b)
    with pytest.raises(lockstep.LockstepError) as e:
        lockstep.npe.train(npe_settings, tmp_path / "py")
    assert "--overwrite" in str(e.value) or "overwrite" in str(e.value)
