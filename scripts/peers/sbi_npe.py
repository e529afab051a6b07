"""NPE with the `sbi` package on lockstep's simulations, for `lockstep bench c2st`.

Run by `lockstep bench c2st --python PY` when PY imports sbi. Trains sbi's NPE (single
round, as sbibm's `npe` baseline: a neural spline flow, `posterior_nn(model="nsf",
hidden_features=50)`, z-scored θ and x, sbi's default training loop with early stopping on
a 10% validation split) on the same (θ, x) simulations lockstep trains on, then draws
posterior samples for each observation (sbi rejects samples outside the prior's box).

Usage: python sbi_npe.py SPEC.json

SPEC: {"dir": folder with theta.npy [n, d] and x.npy [n, x_dim], "low": [d], "high": [d],
  "observations": [[x_dim values] ...], "num_samples": n, "seed": s, "threads": t}
Writes DIR/samples_<k>.npy ([num_samples, d] float32) per observation k and prints one JSON
line: {"sbi_version", "train_s", "sample_s", "epochs"}.
"""

import json
import sys
import time

import numpy as np
import torch

import sbi
from sbi.inference import NPE
from sbi.neural_nets import posterior_nn
from sbi.utils import BoxUniform


def main():
    spec = json.load(open(sys.argv[1]))
    d = spec["dir"]
    torch.manual_seed(spec["seed"])
    torch.set_num_threads(spec["threads"])
    theta = torch.from_numpy(np.load(d + "/theta.npy")).float()
    x = torch.from_numpy(np.load(d + "/x.npy")).float()
    prior = BoxUniform(
        low=torch.tensor(spec["low"], dtype=torch.float32),
        high=torch.tensor(spec["high"], dtype=torch.float32),
    )
    inference = NPE(prior=prior, density_estimator=posterior_nn(model="nsf", hidden_features=50))
    t0 = time.perf_counter()
    estimator = inference.append_simulations(theta, x).train()
    train_s = time.perf_counter() - t0
    epochs = inference.summary.get("epochs_trained", [None])[-1] if hasattr(inference, "summary") else None
    posterior = inference.build_posterior(estimator)
    t0 = time.perf_counter()
    for k, obs in enumerate(spec["observations"]):
        xo = torch.tensor(obs, dtype=torch.float32)
        s = posterior.sample((spec["num_samples"],), x=xo, show_progress_bars=False)
        np.save(d + f"/samples_{k}.npy", np.ascontiguousarray(s.numpy().astype(np.float32)))
    sample_s = time.perf_counter() - t0
    # sbi's last progress message ends without a newline.
    print()
    print(json.dumps({"sbi_version": sbi.__version__, "train_s": train_s,
                      "sample_s": sample_s, "epochs": epochs}))


if __name__ == "__main__":
    main()
