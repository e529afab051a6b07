"""Extracts the sbibm reference data bundled under crates/lockstep-npe/data/sbibm.

Usage: python3 sbibm_reference.py SBIBM_CHECKOUT OUT_DIR [observations...]

For each task (two_moons, slcp) and observation number it copies observation.csv and
true_parameters.csv as they are, and converts reference_posterior_samples.csv.bz2 (10,000
rows, written by sbibm from float32 tensors) to reference_posterior_samples.npy
(float32 [10000, dim], the same values). Needs numpy.
"""

import bz2
import pathlib
import shutil
import sys

import numpy as np


def main():
    src = pathlib.Path(sys.argv[1]) / "sbibm" / "tasks"
    out = pathlib.Path(sys.argv[2])
    observations = [int(v) for v in sys.argv[3:]] or [1, 2, 3]
    for task in ["two_moons", "slcp"]:
        for n in observations:
            d = src / task / "files" / f"num_observation_{n}"
            o = out / task / f"num_observation_{n}"
            o.mkdir(parents=True, exist_ok=True)
            for name in ["observation.csv", "true_parameters.csv"]:
                shutil.copyfile(d / name, o / name)
            with bz2.open(d / "reference_posterior_samples.csv.bz2", "rt") as f:
                samples = np.loadtxt(f, delimiter=",", skiprows=1, dtype=np.float32)
            np.save(o / "reference_posterior_samples.npy", np.ascontiguousarray(samples))
            print(task, n, samples.shape)


if __name__ == "__main__":
    main()
