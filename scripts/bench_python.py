"""Python vs command-line time for the same sampling work (a benchmark, not a test).

    python3 scripts/bench_python.py RUN_DIR [N_SAMPLES]   (the package installed: make python)

`lockstep npe sample RUN_DIR --num-samples N --output x.h5` (the whole command: start, load,
sample, write HDF5) against `Posterior.load(RUN_DIR).sample(N)` in Python (load and sample),
each best of 3, on the same machine in the same run. The command's time includes writing the
file, so a ratio below 1 is expected; the bindings' own cost is what exceeds the command's.
"""

import subprocess
import sys
import tempfile
import time
from pathlib import Path

import lockstep

ROOT = Path(__file__).resolve().parents[1]
LOCKSTEP = ROOT / "target" / "release" / "lockstep"


def best(f, k=3):
    t = []
    for _ in range(k):
        t0 = time.perf_counter()
        f()
        t.append(time.perf_counter() - t0)
    return min(t)


def main():
    run = sys.argv[1]
    n = int(sys.argv[2]) if len(sys.argv) > 2 else 1_000_000
    with tempfile.TemporaryDirectory() as d:
        out = Path(d) / "s.h5"
        cli = best(lambda: subprocess.run(
            [str(LOCKSTEP), "npe", "sample", run, "--observation", "0.3,-0.2", "--num-samples", str(n),
             "--output", str(out)], check=True, capture_output=True))
    py = best(lambda: lockstep.npe.Posterior.load(run).sample(n, x=[0.3, -0.2]))
    print(f"sample {n}: command {cli:.3f} s (incl. start, HDF5 write), Python {py:.3f} s (incl. load); ratio {py / cli:.3f}")


if __name__ == "__main__":
    main()
