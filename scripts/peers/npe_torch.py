"""The NPE network of `lockstep bench npe` in PyTorch eager, timed on the same batch.

Run by `lockstep bench npe --python PY` (when PY imports torch and numpy). Written for
lockstep: the same architecture as lockstep-npe (Dingo's DenseResidualNet embedding with
LayerNorm; flow steps of a random permutation, an LU-factorized linear map and a
rational-quadratic spline coupling with linear tails whose conditioner is a context-gated
residual network; standard-normal base), with the parameter names lockstep writes. The
parameters are loaded from lockstep's initial values with `load_state_dict(strict=True)`, so
the names, shapes and count must all match, and the loss of the batch at those parameters is
reported for lockstep to compare with its own.

Usage: python npe_torch.py SPEC.json OUT.json

SPEC: {"x_dim", "theta_dim", "hidden_dims", "output_dim", "num_flow_steps", "hidden_dim",
  "num_transform_blocks", "num_bins", "tail_bound", "permutations": [[...] per step],
  "theta_mean", "theta_std", "x_mean", "x_std", "batch", "warmup", "steps", "threads": [..],
  "learning_rate", "ddp_processes" (0: no DDP run), "dir": folder with params.npy (flat
  f32), names.json ([[name, shape]...]), theta.npy [batch, theta_dim], x.npy [batch, x_dim]}
OUT: {"torch_version", "parameters", "initial_loss", "s_per_step": {threads: [seconds...]},
  "phases": {threads: {"forward": s, "backward": s, "optimizer": s}},
  "ddp": {"processes": P, "s_per_step": [seconds...]} or {"error": text}}

With "device" in SPEC (a torch device such as "cuda"; `lockstep bench npe --device gpu|cuda`
passes "cuda"), the network and batch also run there: OUT gets "device_name" and
"device_runs": {"float32": [seconds...], "amp": [seconds...]}, each step ended by a device
synchronization; "amp" is Dingo's `automatic_mixed_precision`: the forward pass and loss
under `torch.autocast` (float16 on CUDA, bfloat16 on the CPU, the only autocast type
there) with `torch.amp.GradScaler` scaling the loss and unscaling before Adam. When torch
cannot use the device, OUT has "device_error" instead.

The DDP run is PyTorch DistributedDataParallel over the gloo backend on this machine: P
processes of 1 thread each, each with its contiguous slice of the same batch (batch / P
samples), the same initial parameters and Adam; the step time is rank 0's (forward,
backward with DDP's bucketed gradient all-reduce, optimizer step).
"""

import json
import math
import sys
import time

import numpy as np
import torch
from torch import nn
import torch.nn.functional as F


class Block(nn.Module):
    """Residual block: x + lin1(elu(norm1(lin0(elu(norm0(x)))))) [* sigmoid(ctx(c))]."""

    def __init__(self, h, context=None, layer_norm=False):
        super().__init__()
        self.context_layer = nn.Linear(context, h) if context is not None else None
        if layer_norm:
            self.norm_layers = nn.ModuleList([nn.LayerNorm(h), nn.LayerNorm(h)])
        else:
            self.norm_layers = None
        self.linear_layers = nn.ModuleList([nn.Linear(h, h), nn.Linear(h, h)])

    def forward(self, x, c=None):
        t = x
        if self.norm_layers is not None:
            t = self.norm_layers[0](t)
        t = self.linear_layers[0](F.elu(t))
        if self.norm_layers is not None:
            t = self.norm_layers[1](t)
        t = self.linear_layers[1](F.elu(t))
        if self.context_layer is not None:
            t = t * torch.sigmoid(self.context_layer(c))
        return x + t


class Embedding(nn.Module):
    def __init__(self, x_dim, hidden_dims, output_dim):
        super().__init__()
        self.initial_layer = nn.Linear(x_dim, hidden_dims[0])
        self.blocks = nn.ModuleList([Block(h, layer_norm=True) for h in hidden_dims])
        resize = []
        for n, h in enumerate(hidden_dims):
            to = hidden_dims[n + 1] if n + 1 < len(hidden_dims) else output_dim
            last = n + 1 == len(hidden_dims)
            resize.append(nn.Linear(h, to) if (to != h or last) else nn.Identity())
        self.resize_layers = nn.ModuleList(resize)

    def forward(self, x):
        x = self.initial_layer(x)
        for b, r in zip(self.blocks, self.resize_layers):
            x = r(b(x))
        return x


class Conditioner(nn.Module):
    def __init__(self, inputs, context, hidden, outputs, blocks):
        super().__init__()
        self.initial_layer = nn.Linear(inputs + context, hidden)
        self.blocks = nn.ModuleList([Block(hidden, context=context) for _ in range(blocks)])
        self.final_layer = nn.Linear(hidden, outputs)

    def forward(self, x, c):
        h = self.initial_layer(torch.cat([x, c], dim=1))
        for b in self.blocks:
            h = b(h, c)
        return self.final_layer(h)


class LULinear(nn.Module):
    def __init__(self, n):
        super().__init__()
        t = n * (n - 1) // 2
        self.n = n
        self.lower_entries = nn.Parameter(torch.zeros(t))
        self.upper_entries = nn.Parameter(torch.zeros(t))
        self.unconstrained_upper_diag = nn.Parameter(torch.zeros(n))
        self.bias = nn.Parameter(torch.zeros(n))
        self.register_buffer("li", torch.tril_indices(n, n, -1), persistent=False)
        self.register_buffer("ui", torch.triu_indices(n, n, 1), persistent=False)

    def forward(self, x):
        n = self.n
        diag = F.softplus(self.unconstrained_upper_diag) + 1e-3
        # On the parameters' dtype and device (under autocast x may be half precision).
        p = self.lower_entries
        lower = p.new_zeros(n, n).index_put((self.li[0], self.li[1]), p)
        lower = lower + torch.eye(n, dtype=p.dtype, device=p.device)
        upper = p.new_zeros(n, n).index_put((self.ui[0], self.ui[1]), self.upper_entries)
        upper = upper + torch.diag(diag)
        w = lower @ upper
        return x @ w.T + self.bias, torch.log(diag).sum()


def knots(u, min_size, bound):
    k = u.shape[1]
    sizes = F.softmax(u, dim=1) * (1 - min_size * k) + min_size
    cum = torch.cumsum(sizes, dim=1) * 2 * bound - bound
    m = u.shape[0]
    return torch.cat([u.new_full((m, 1), -bound), cum[:, : k - 1], u.new_full((m, 1), bound)], 1)


def spline(x, uw, uh, ud, bound):
    """Forward rational-quadratic spline with linear tails (Durkan et al. 2019), [M, 1]."""
    m, k = uw.shape
    inside = (x >= -bound) & (x <= bound)
    xc = x.clamp(-bound, bound)
    c = math.log(math.exp(1 - 1e-3) - 1)
    d = F.softplus(torch.cat([x.new_full((m, 1), c), ud, x.new_full((m, 1), c)], 1)) + 1e-3
    cw = knots(uw, 1e-3, bound)
    ch = knots(uh, 1e-3, bound)
    w = cw[:, 1:] - cw[:, :-1]
    h = ch[:, 1:] - ch[:, :-1]
    delta = h / w
    loc = cw.detach().clone()
    loc[:, -1] += 1e-6
    idx = ((xc.detach() >= loc).sum(1, keepdim=True) - 1).clamp(0, k - 1)
    g = lambda t: t.gather(1, idx)
    icw, iw, ich, ih, idl = g(cw[:, :k]), g(w), g(ch[:, :k]), g(h), g(delta)
    d0, d1 = g(d[:, :k]), g(d[:, 1:])
    curv = d0 + d1 - 2 * idl
    th = (xc - icw) / iw
    tomt = th * (1 - th)
    num = ih * (idl * th**2 + d0 * tomt)
    den = idl + curv * tomt
    y = ich + num / den
    dnum = idl**2 * (d1 * th**2 + 2 * idl * tomt + d0 * (1 - th) ** 2)
    ld = torch.log(dnum) - 2 * torch.log(den)
    return torch.where(inside, y, x), torch.where(inside, ld, torch.zeros_like(ld))


class Coupling(nn.Module):
    def __init__(self, features, context, step, hidden, blocks, bins, bound):
        super().__init__()
        start = 0 if step % 2 == 0 else 1
        self.transform = list(range(start, features, 2))
        self.identity = [i for i in range(features) if i not in self.transform]
        order = [0] * features
        for pos, f in enumerate(self.identity + self.transform):
            order[f] = pos
        self.order = order
        self.bins, self.bound, self.hidden = bins, bound, hidden
        self.transform_net = Conditioner(
            len(self.identity), context, hidden, len(self.transform) * (3 * bins - 1), blocks
        )

    def forward(self, x, c):
        n, t, k = x.shape[0], len(self.transform), self.bins
        xi = x[:, self.identity]
        xt = x[:, self.transform]
        raw = self.transform_net(xi, c).reshape(n * t, 3 * k - 1)
        s = 1 / math.sqrt(self.hidden)
        y, ld = spline(xt.reshape(n * t, 1), raw[:, :k] * s, raw[:, k : 2 * k] * s, raw[:, 2 * k :], self.bound)
        out = torch.cat([xi, y.reshape(n, t)], 1)[:, self.order]
        return out, ld.reshape(n, t).sum(1)


class Step(nn.Module):
    def __init__(self, features, context, step, perm, spec):
        super().__init__()
        self.perm = perm
        self.lu_linear = LULinear(features)
        self.coupling = Coupling(
            features, context, step, spec["hidden_dim"], spec["num_transform_blocks"],
            spec["num_bins"], spec["tail_bound"],
        )


class Flow(nn.Module):
    def __init__(self, spec):
        super().__init__()
        d, ctx = spec["theta_dim"], spec["output_dim"]
        self.steps = nn.ModuleList(
            [Step(d, ctx, i, p, spec) for i, p in enumerate(spec["permutations"])]
        )


class Npe(nn.Module):
    def __init__(self, spec):
        super().__init__()
        self.embedding_net = Embedding(spec["x_dim"], spec["hidden_dims"], spec["output_dim"])
        self.flow = Flow(spec)
        self.jac = float(np.log(np.asarray(spec["theta_std"])).sum())

    def forward(self, theta, x):
        """log q(theta | x) per sample (DDP calls the module)."""
        return self.log_prob(theta, x)

    def log_prob(self, theta, x):
        c = self.embedding_net(x)
        z = theta
        n, d = z.shape
        logdet = z.new_zeros(n)
        for step in self.flow.steps:
            z = z[:, step.perm]
            z, ld = step.lu_linear(z)
            logdet = logdet + ld
            z, ld = step.coupling(z, c)
            logdet = logdet + ld
        base = -0.5 * (z**2).sum(1) - 0.5 * d * math.log(2 * math.pi)
        return base + logdet - self.jac


def load(spec):
    """The network with lockstep's initial parameters, its state dict, and the standardized
    (theta, x) batch."""
    d = spec["dir"]
    net = Npe(spec)
    names = json.load(open(d + "/names.json"))
    flat = np.load(d + "/params.npy")
    state, off = {}, 0
    for name, shape in names:
        size = int(np.prod(shape))
        state[name] = torch.from_numpy(flat[off : off + size].reshape(shape).copy())
        off += size
    count = sum(p.numel() for p in net.parameters())
    if count != flat.size:
        raise SystemExit(f"parameter count differs: torch {count}, lockstep {flat.size}")
    net.load_state_dict(state, strict=True)
    theta = (torch.from_numpy(np.load(d + "/theta.npy")) - torch.tensor(spec["theta_mean"], dtype=torch.float32)) / torch.tensor(spec["theta_std"], dtype=torch.float32)
    x = (torch.from_numpy(np.load(d + "/x.npy")) - torch.tensor(spec["x_mean"], dtype=torch.float32)) / torch.tensor(spec["x_std"], dtype=torch.float32)
    return net, state, count, theta, x


def ddp_worker(rank, spec, port, out_path):
    """One DDP process: its slice of the batch, timed steps; rank 0 writes the times."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    torch.set_num_threads(1)
    world = spec["ddp_processes"]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    net, _, _, theta, x = load(spec)
    per = theta.shape[0] // world
    theta, x = theta[rank * per : (rank + 1) * per], x[rank * per : (rank + 1) * per]
    model = DistributedDataParallel(net)
    opt = torch.optim.Adam(model.parameters(), lr=spec["learning_rate"])
    times = []
    for i in range(spec["warmup"] + spec["steps"]):
        dist.barrier()
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss = -model(theta, x).mean()
        loss.backward()
        opt.step()
        if i >= spec["warmup"]:
            times.append(time.perf_counter() - t0)
    if rank == 0:
        json.dump(times, open(out_path, "w"))
    dist.destroy_process_group()


def ddp(spec):
    """Runs the DDP measurement; returns its entry of OUT."""
    import socket
    import tempfile

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        out_path = tmp + "/ddp.json"
        mp.spawn(ddp_worker, args=(spec, port, out_path), nprocs=spec["ddp_processes"], join=True)
        return {"processes": spec["ddp_processes"], "s_per_step": json.load(open(out_path))}


def on_device(spec, state, theta, x):
    """The float32 and autocast (AMP) steps on spec["device"]; the entries of OUT."""
    name = spec["device"]
    dev = torch.device(name)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError(f"torch {torch.__version__} sees no CUDA device (a CPU-only build, or no driver)")
    sync = (lambda: torch.cuda.synchronize(dev)) if dev.type == "cuda" else (lambda: None)
    theta, x = theta.to(dev), x.to(dev)
    half = torch.float16 if dev.type == "cuda" else torch.bfloat16
    runs = {}
    for amp in (False, True):
        net = Npe(spec)
        net.load_state_dict(state, strict=True)
        net.to(dev)
        opt = torch.optim.Adam(net.parameters(), lr=spec["learning_rate"])
        scaler = torch.amp.GradScaler(dev.type, enabled=amp and dev.type == "cuda")
        times = []
        for i in range(spec["warmup"] + spec["steps"]):
            sync()
            t0 = time.perf_counter()
            opt.zero_grad(set_to_none=True)
            with torch.autocast(dev.type, dtype=half, enabled=amp):
                loss = -net.log_prob(theta, x).float().mean()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            sync()
            if i >= spec["warmup"]:
                times.append(time.perf_counter() - t0)
        runs["amp" if amp else "float32"] = times
    label = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
    return {"device_name": f"{label} ({name})", "device_runs": runs}


def main():
    spec = json.load(open(sys.argv[1]))
    net, state, count, theta, x = load(spec)
    with torch.no_grad():
        initial = float(-net.log_prob(theta, x).mean())
    out = {"torch_version": torch.__version__, "parameters": count, "initial_loss": initial,
           "s_per_step": {}, "phases": {}}
    for threads in spec["threads"]:
        torch.set_num_threads(threads)
        net.load_state_dict(state, strict=True)
        opt = torch.optim.Adam(net.parameters(), lr=spec["learning_rate"])
        times, fw, bw, op = [], [], [], []
        for i in range(spec["warmup"] + spec["steps"]):
            t0 = time.perf_counter()
            opt.zero_grad(set_to_none=True)
            loss = -net.log_prob(theta, x).mean()
            t1 = time.perf_counter()
            loss.backward()
            t2 = time.perf_counter()
            opt.step()
            t3 = time.perf_counter()
            if i >= spec["warmup"]:
                times.append(t3 - t0)
                fw.append(t1 - t0)
                bw.append(t2 - t1)
                op.append(t3 - t2)
        out["s_per_step"][str(threads)] = times
        out["phases"][str(threads)] = {
            "forward": float(np.median(fw)), "backward": float(np.median(bw)),
            "optimizer": float(np.median(op)),
        }
    if "device" in spec:
        try:
            out.update(on_device(spec, state, theta, x))
        except Exception as e:  # reported by lockstep next to its own figures
            out["device_error"] = f"{type(e).__name__}: {e}"
    if spec.get("ddp_processes", 0) > 1:
        try:
            out["ddp"] = ddp(spec)
        except Exception as e:  # reported by lockstep next to its own figures
            out["ddp"] = {"error": f"{type(e).__name__}: {e}"}
    json.dump(out, open(sys.argv[2], "w"))


if __name__ == "__main__":
    main()
