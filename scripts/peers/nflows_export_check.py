"""Rebuild a posterior that `lockstep npe export` wrote as nflows modules, load its state dict
with PyTorch's `load_state_dict` (strict), and compare the log-probabilities with lockstep's.

    lockstep npe export RUN_DIR --format nflows        # RUN_DIR/posterior.nflows.{safetensors,json}
    python scripts/peers/nflows_export_check.py RUN_DIR

The modules are built with nflows' own classes in the layout of Dingo's `FlowWrapper(flow,
embedding_net)` (dingo/core/nn/nsf.py, enets.py): `flow` as Dingo's `create_nsf_model` builds it
(per step a RandomPermutation + LULinear, then a PiecewiseRationalQuadraticCouplingTransform with
linear tails and a ResidualNet conditioner; one final RandomPermutation + LULinear), and
`embedding_net` an nn.Sequential of Dingo's LinearProjectionRB (when the run has a reduced-basis
layer) and DenseResidualNet, written out below with nflows' ResidualBlock as Dingo writes them.
The permutations come from the state dict (`_permutation` buffers), so nothing is drawn.

For the (theta, x) pairs stored in posterior.nflows.json it evaluates
`flow.log_prob((theta - theta_mean) / theta_std, context=embedding_net((x - x_mean) / x_std))
- sum(log theta_std)` and compares with lockstep's values (default tolerance 1e-5). Exit status
0 when every value agrees, 1 when one differs, 2 on bad usage or when torch/nflows are missing
(pip install torch nflows; the safetensors package is used when installed, else a small reader).

`--write-reference FILE` also writes what the Rust tests compare against
(crates/lockstep-npe/tests/data/nflows_export/reference.json): the names, shapes and dtypes of
the state dict nflows itself expects (`model.state_dict()` before loading), the pairs and nflows'
log-probabilities, with the versions used. Not run by `make test` (CI has no torch).
"""

import argparse
import datetime
import json
import os
import struct
import sys


def read_safetensors(path):
    """{name: torch tensor} of a safetensors file."""
    import numpy as np
    import torch

    try:
        from safetensors.torch import load_file

        return load_file(path)
    except ImportError:
        pass
    dtypes = {"F32": np.float32, "F64": np.float64, "I64": np.int64, "I32": np.int32}
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
        data = f.read()
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        a, b = info["data_offsets"]
        arr = np.frombuffer(data[a:b], dtype=dtypes[info["dtype"]]).reshape(info["shape"])
        out[name] = torch.from_numpy(arr.copy())
    return out


def build(settings):
    """Dingo's FlowWrapper(flow, embedding_net) for the exported settings, from nflows classes."""
    import torch
    from torch import nn
    from torch.nn import functional as F
    from nflows import distributions, flows, transforms, utils
    from nflows.nn.nets import ResidualNet
    from nflows.nn.nets.resnet import ResidualBlock

    pk = settings["posterior_kwargs"]
    bk = pk["base_transform_kwargs"]
    ek = settings["embedding_kwargs"]
    d, context_dim = pk["input_dim"], pk["context_dim"]

    class LinearProjectionRB(nn.Module):
        """Dingo's LinearProjectionRB on x flattened as lockstep lays it out: block k is
        x[:, k*block_inputs:(k+1)*block_inputs] (for complex data Dingo's
        [num_blocks, 2, num_bins] flattened)."""

        def __init__(self, blocks, block_inputs, block_outputs):
            super().__init__()
            self.block_inputs = block_inputs
            self.layers_rb = nn.ModuleList(
                [nn.Linear(block_inputs, block_outputs) for _ in range(blocks)]
            )

        def forward(self, x):
            w = self.block_inputs
            return torch.cat(
                [l(x[:, k * w : (k + 1) * w]) for k, l in enumerate(self.layers_rb)], dim=1
            )

    class DenseResidualNet(nn.Module):
        """Dingo's DenseResidualNet (dingo/core/nn/enets.py), nflows' ResidualBlock."""

        def __init__(self, input_dim, output_dim, hidden_dims):
            super().__init__()
            self.initial_layer = nn.Linear(input_dim, hidden_dims[0])
            self.blocks = nn.ModuleList(
                [
                    ResidualBlock(
                        features=h,
                        context_features=None,
                        activation=F.elu,
                        dropout_probability=0.0,
                        use_batch_norm=ek["batch_norm"],
                    )
                    for h in hidden_dims
                ]
            )
            self.resize_layers = nn.ModuleList(
                [
                    nn.Linear(hidden_dims[n - 1], hidden_dims[n])
                    if hidden_dims[n - 1] != hidden_dims[n]
                    else nn.Identity()
                    for n in range(1, len(hidden_dims))
                ]
                + [nn.Linear(hidden_dims[-1], output_dim)]
            )

        def forward(self, x):
            x = self.initial_layer(x)
            for block, resize in zip(self.blocks, self.resize_layers):
                x = resize(block(x))
            return x

    def linear_transform():
        return transforms.CompositeTransform(
            [
                transforms.RandomPermutation(features=d),
                transforms.LULinear(d, identity_init=True),
            ]
        )

    def base_transform(i):
        return transforms.PiecewiseRationalQuadraticCouplingTransform(
            mask=utils.create_alternating_binary_mask(d, even=(i % 2 == 0)),
            transform_net_create_fn=lambda n_in, n_out: ResidualNet(
                in_features=n_in,
                out_features=n_out,
                hidden_features=bk["hidden_dim"],
                context_features=context_dim,
                num_blocks=bk["num_transform_blocks"],
                activation=F.elu,
                dropout_probability=0.0,
                use_batch_norm=bk["batch_norm"],
            ),
            num_bins=bk["num_bins"],
            tails=pk["tails"],
            tail_bound=bk["tail_bound"],
            apply_unconditional_transform=False,
        )

    transform = transforms.CompositeTransform(
        [
            transforms.CompositeTransform([linear_transform(), base_transform(i)])
            for i in range(pk["num_flow_steps"])
        ]
        + [linear_transform()]
    )
    flow = flows.Flow(transform, distributions.StandardNormal((d,)))
    proj = ek.get("projection")
    modules = []
    if proj:
        modules.append(
            LinearProjectionRB(proj["blocks"], proj["block_inputs"], proj["block_outputs"])
        )
    resnet_inputs = proj["blocks"] * proj["block_outputs"] if proj else ek["input_dim"]
    modules.append(DenseResidualNet(resnet_inputs, ek["output_dim"], ek["hidden_dims"]))

    class FlowWrapper(nn.Module):
        """Dingo's FlowWrapper: `flow` and `embedding_net` attributes."""

        def __init__(self, flow, embedding_net):
            super().__init__()
            self.flow = flow
            self.embedding_net = embedding_net

    return FlowWrapper(flow, nn.Sequential(*modules))


def log_prob(model, settings, theta, x):
    """log q(theta | x) in theta's own units (the standardization's Jacobian included)."""
    import torch

    s = settings["standardization"]
    dt = next(model.parameters()).dtype
    t = lambda v: torch.tensor(v, dtype=torch.float64)
    ts = ((t(theta) - t(s["theta_mean"])) / t(s["theta_std"])).to(dt)
    xs = ((t(x) - t(s["x_mean"])) / t(s["x_std"])).to(dt)
    with torch.no_grad():
        lp = model.flow.log_prob(ts, context=model.embedding_net(xs)).double()
    return lp - torch.log(t(s["theta_std"])).sum()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("export", help="the folder holding posterior.nflows.{safetensors,json}")
    ap.add_argument("--tolerance", type=float, default=1e-5)
    ap.add_argument("--double", action="store_true", help="evaluate in float64")
    ap.add_argument("--write-reference", metavar="FILE")
    args = ap.parse_args()
    try:
        import torch
        import nflows
    except ImportError as e:
        print(f"needs torch and nflows ({e}); pip install torch nflows", file=sys.stderr)
        return 2
    settings_path = os.path.join(args.export, "posterior.nflows.json")
    if not os.path.isfile(settings_path):
        print(f"{settings_path}: no such file; run lockstep npe export first", file=sys.stderr)
        return 2
    with open(settings_path) as f:
        settings = json.load(f)
    state = read_safetensors(os.path.join(args.export, settings["state_dict"]))
    model = build(settings)
    expected = {k: (list(v.shape), str(v.dtype)) for k, v in model.state_dict().items()}
    got = {k: (list(v.shape), str(v.dtype)) for k, v in state.items()}
    if expected != got:
        for k in sorted(set(expected) | set(got)):
            if expected.get(k) != got.get(k):
                print(f"{k}: nflows expects {expected.get(k)}, export has {got.get(k)}")
        return 1
    model.load_state_dict(state, strict=True)
    model.eval()
    if args.double:
        model.double()
    perms = [
        m._permutation.tolist()
        for m in model.flow._transform.modules()
        if isinstance(m, nflows.transforms.RandomPermutation)
    ]
    if perms[:-1] != settings["permutations"]:
        print("the state dict's permutations differ from the settings' permutations")
        return 1
    from importlib.metadata import version

    nflows_version = version("nflows")
    check = settings["check"]
    lp = log_prob(model, settings, check["theta"], check["x"])
    ref = torch.tensor(check["log_prob"], dtype=torch.float64)
    diff = (lp - ref).abs().max().item()
    print(
        f"{len(ref)} pairs: nflows {nflows_version} / torch {torch.__version__} "
        f"log q(theta|x) vs lockstep's: largest difference {diff:.3g} "
        f"(tolerance {args.tolerance:g}); state dict: {len(state)} tensors, loaded strictly"
    )
    if args.write_reference:
        ref_out = {
            "provenance": {
                "script": "scripts/peers/nflows_export_check.py",
                "nflows": nflows_version,
                "torch": torch.__version__,
                "python": sys.version.split()[0],
                "date": datetime.date.today().isoformat(),
                "dtype": "float64" if args.double else "float32",
                "export_format": settings["format"],
                "note": "state_dict: names, shapes and dtypes nflows' modules expect (model.state_dict() before loading); log_prob: nflows' log q(theta|x) for theta, x with the exported parameters",
            },
            "state_dict": [[k, s, t] for k, (s, t) in sorted(expected.items())],
            "theta": check["theta"],
            "x": check["x"],
            "log_prob": lp.tolist(),
            "log_prob_lockstep": check["log_prob"],
        }
        with open(args.write_reference, "w") as f:
            json.dump(ref_out, f, indent=1)
            f.write("\n")
        print(f"wrote {args.write_reference}")
    return 0 if diff <= args.tolerance else 1


if __name__ == "__main__":
    sys.exit(main())
