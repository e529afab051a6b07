"""Run a config lockstep wrote (RUN_DIR/config.simulate.json) in BMTK's pointnet, started from
another working directory, and compare its spikes with lockstep's.

The config gives its paths through the manifest "$BASE_DIR": "${configdir}", which BMTK
resolves to the config's folder wherever it is started (without it, BMTK takes relative paths
against the working directory and finds nothing). This script checks that with BMTK itself:

    lockstep simulate RUN_DIR/config.simulate.json      # lockstep's spikes
    python scripts/peers/bmtk_from_elsewhere.py RUN_DIR/config.simulate.json

It reads lockstep's spikes (RUN_DIR/simulation/spikes.h5, written by the first command), then
runs BMTK from a fresh temporary folder with the config unchanged (so BMTK replaces
RUN_DIR/simulation/ with its own output), and prints both spike counts and the largest time
difference of matching spikes. Exit status 0 when BMTK ran and the spikes are the same (same
(node, time) pairs to 1e-6 ms), 1 when they differ, 2 on bad usage or when bmtk/nest are
missing (pip install bmtk nest-simulator h5py).

Not run by the tests (BMTK and NEST are not installed there); the tests check the manifest
form and BMTK's path resolution (crates/lockstep-cli/tests/trained_simulation.rs).
"""

import json
import os
import sys
import tempfile


def spikes(path):
    import h5py
    import numpy as np

    with h5py.File(path, "r") as f:
        out = []
        for pop in f["spikes"]:
            g = f["spikes"][pop]
            ids = np.asarray(g["node_ids"][...], dtype=np.int64)
            ts = np.asarray(g["timestamps"][...], dtype=np.float64)
            out += [(pop, int(i), float(t)) for i, t in zip(ids, ts)]
    return sorted(out)


def main(cfg_path):
    cfg_path = os.path.abspath(cfg_path)
    try:
        from bmtk.simulator import pointnet
    except ImportError as e:
        print(f"bmtk_from_elsewhere: bmtk with NEST is needed ({e})", file=sys.stderr)
        return 2
    with open(cfg_path) as f:
        cfg = json.load(f)
    run_dir = os.path.dirname(cfg_path)
    ours_path = os.path.join(run_dir, "simulation", cfg["output"].get("spikes_file", "spikes.h5"))
    if not os.path.isfile(ours_path):
        print(f"bmtk_from_elsewhere: {ours_path} is missing; run `lockstep simulate {cfg_path}` first",
              file=sys.stderr)
        return 2
    ours = spikes(ours_path)
    with tempfile.TemporaryDirectory() as elsewhere:
        os.chdir(elsewhere)
        conf = pointnet.Config.from_json(cfg_path)
        conf.build_env()
        net = pointnet.PointNetwork.from_config(conf)
        sim = pointnet.PointSimulator.from_config(conf, net)
        sim.run()
        theirs = spikes(os.path.join(conf.output_dir, cfg["output"].get("spikes_file", "spikes.h5")))
    print(f"lockstep: {len(ours)} spikes, BMTK (started in another folder): {len(theirs)} spikes")
    same = len(ours) == len(theirs) and all(
        a[0] == b[0] and a[1] == b[1] and abs(a[2] - b[2]) <= 1e-6 for a, b in zip(ours, theirs))
    if len(ours) == len(theirs):
        worst = max((abs(a[2] - b[2]) for a, b in zip(ours, theirs)), default=0.0)
        print(f"largest time difference of paired spikes: {worst:.3g} ms")
    print("same spikes" if same else "the spikes differ")
    return 0 if same else 1


if __name__ == "__main__":
    if len(sys.argv) != 2:
        print(__doc__.strip().splitlines()[0], file=sys.stderr)
        print("usage: python bmtk_from_elsewhere.py RUN_DIR/config.simulate.json", file=sys.stderr)
        sys.exit(2)
    sys.exit(main(sys.argv[1]))
