#!/usr/bin/env python3
"""PyTorch peer of one optimizer step of lockstep's float32 BPTT (`lockstep bench bptt
--python PY` runs it in the same invocation; `scripts/gpu-check.sh` on a GPU machine).

The network is read from the same SONATA files as lockstep reads (the training config's
`network`, its nodes, node types, cell models, edges, edge types and synapse models); the
step is the one docs/neuron-models.md specifies, in float32: GLIF3 cells (`nest:glif_psc`
with after-spike currents) with NEST's exact propagators, alpha-shaped currents per receptor
port, delays in whole steps, Poisson input drawn per step, the spike's surrogate derivative
(`gauss` or `triangle`), the hard reset with the soft reset's gradient, the
`TargetFiringRate` and `VoltageRegularization` losses, autograd through every step (BPTT,
no segments), Adam on the recurrent weights and the sign constraint. The recurrent and
input matrices are `torch.sparse` COO matrices, one per (delay, receptor port), as
DPointNet's `tf.sparse` ones are. What differs from lockstep: the Poisson draws (torch's
generator) and float32 arithmetic order, so spikes and losses agree in distribution, not
bit for bit; it is a timing peer.

Usage: bptt_torch.py --config TRAIN_CONFIG [--device cuda|cpu] [--repeats 3] [--warmup 1]
                     [--batch B] [--seq-len T] [--json OUT.json]
Prints the median seconds per step after warm-up with its split, and writes them as JSON.
Needs torch, numpy and h5py.
"""
import argparse
import json
import math
import os
import shlex
import statistics
import sys
import time

import h5py
import numpy as np
import torch


def resolve(value, manifest, base):
    """A config path with manifest variables substituted, relative to `base`."""
    if not isinstance(value, str):
        return value
    for _ in range(10):
        changed = False
        for k, v in manifest.items():
            if k in value:
                value = value.replace(k, v)
                changed = True
        if not changed:
            break
    value = value.replace("${configdir}", base)
    return value if os.path.isabs(value) else os.path.normpath(os.path.join(base, value))


def read_json_config(path):
    with open(path) as f:
        cfg = json.load(f)
    base = os.path.dirname(os.path.abspath(path))
    manifest = {k: v for k, v in cfg.get("manifest", {}).items()}
    # Manifest entries may use each other; resolve them in turn.
    for k in list(manifest):
        manifest[k] = resolve(manifest[k], {kk: vv for kk, vv in manifest.items() if kk != k}, base)
    return cfg, manifest, base


def read_types(path):
    with open(path) as f:
        lines = [l for l in f.read().splitlines() if l.strip()]
    head = shlex.split(lines[0])
    return {int(r[0]): dict(zip(head, r)) for r in (shlex.split(l) for l in lines[1:])}


class Network:
    """The SONATA network of a training config, compiled for the step."""

    def __init__(self, train_cfg_path):
        cfg, manifest, base = read_json_config(train_cfg_path)
        self.cfg = cfg
        circuit_path = resolve(cfg["network"], manifest, base)
        circ, cman, cbase = read_json_config(circuit_path)
        comps = circ.get("components", {})
        cells_dir = resolve(comps["point_neuron_models_dir"], cman, cbase)
        syn_dir = resolve(comps["synaptic_models_dir"], cman, cbase)
        nets = circ["networks"]
        pops = {}
        for entry in nets["nodes"]:
            types = read_types(resolve(entry["node_types_file"], cman, cbase))
            with h5py.File(resolve(entry["nodes_file"], cman, cbase), "r") as h:
                for name, g in h["nodes"].items():
                    tid = g["node_type_id"][()]
                    ids = g["node_id"][()] if "node_id" in g else np.arange(len(tid))
                    virtual = all(types[int(t)].get("model_type") == "virtual" for t in set(tid.tolist()))
                    pops[name] = dict(ids=ids, type_ids=tid, types=types, virtual=virtual)
        cells = [n for n, p in pops.items() if not p["virtual"]]
        virt = [n for n, p in pops.items() if p["virtual"]]
        if len(cells) != 1:
            sys.exit(f"bptt_torch: one population of cells expected, found {cells}")
        self.pop = cells[0]
        p = pops[self.pop]
        n = len(p["ids"])
        self.n = n
        h = float(cfg["run"]["dt"])
        self.h = h
        params = {}
        for t in set(p["type_ids"].tolist()):
            row = p["types"][int(t)]
            if row.get("model_template") != "nest:glif_psc":
                sys.exit(f"bptt_torch: only nest:glif_psc cells (type {t} is {row.get('model_template')})")
            with open(os.path.join(cells_dir, row["dynamics_params"])) as f:
                params[int(t)] = json.load(f)
        ports = max(len(v["tau_syn"]) for v in params.values())
        asc = max(len(v.get("asc_amps", [])) for v in params.values())
        self.ports, self.asc = ports, asc
        c = {k: np.zeros(n) for k in ["P33", "P30", "th", "reset", "refr"]}
        c.update({k: np.zeros((n, ports)) for k in ["P11", "P21", "P31", "P32", "jump"]})
        c.update({k: np.zeros((n, asc)) for k in ["decay", "stable", "refr_decay", "amps"]})
        for i, t in enumerate(p["type_ids"].tolist()):
            q = params[int(t)]
            tau = q["C_m"] / q["g"]
            c["P33"][i] = math.exp(-h / tau)
            c["P30"][i] = (1 - c["P33"][i]) * tau / q["C_m"]
            c["th"][i] = q["V_th"] - q["E_L"]
            c["reset"][i] = q["V_reset"] - q["E_L"]
            c["refr"][i] = round(q["t_ref"] / h)
            b = 1 / tau
            for k, ts in enumerate(q["tau_syn"]):
                a = 1 / ts
                if abs(a - b) < 1e-9:
                    a += 1e-6
                ea, eb = math.exp(-a * h), math.exp(-b * h)
                c["P11"][i, k] = ea
                c["P21"][i, k] = h * ea
                c["P32"][i, k] = (eb - ea) / ((a - b) * q["C_m"])
                c["P31"][i, k] = (h * ea / (b - a) - (ea - eb) / (b - a) ** 2) / q["C_m"]
                c["jump"][i, k] = math.e / ts
            for a_, kd in enumerate(q.get("asc_decay", [])):
                d = math.exp(-kd * h)
                c["decay"][i, a_] = d
                c["stable"][i, a_] = (1 - d) / (kd * h)
                r = q.get("asc_r", [1.0] * asc)[a_]
                c["refr_decay"][i, a_] = r * math.exp(-kd * q["t_ref"])
                c["amps"][i, a_] = q["asc_amps"][a_]
        self.c = c
        index = {int(v): i for i, v in enumerate(p["ids"].tolist())}
        self.rec, self.inp = None, []
        for entry in nets["edges"]:
            types = read_types(resolve(entry["edge_types_file"], cman, cbase))
            with h5py.File(resolve(entry["edges_file"], cman, cbase), "r") as hf:
                for name, g in hf["edges"].items():
                    src_pop = g["source_node_id"].attrs["node_population"]
                    tgt_pop = g["target_node_id"].attrs["node_population"]
                    if isinstance(src_pop, bytes):
                        src_pop, tgt_pop = src_pop.decode(), tgt_pop.decode()
                    if tgt_pop != self.pop:
                        continue
                    et = g["edge_type_id"][()]
                    grp = g["0"] if "0" in g else {}
                    w = grp["syn_weight"][()] if "syn_weight" in grp else np.array(
                        [float(types[int(t)]["syn_weight"]) for t in et])
                    if "nsyns" in grp:
                        w = w * grp["nsyns"][()]
                    if "delay" in grp:
                        delay = grp["delay"][()]
                    else:
                        delay = np.array([float(types[int(t)]["delay"]) for t in et])
                    port_of = {}
                    for t in set(et.tolist()):
                        with open(os.path.join(syn_dir, types[int(t)]["dynamics_params"])) as f:
                            port_of[t] = int(json.load(f).get("receptor_type", 1)) - 1
                    port = np.array([port_of[int(t)] for t in et])
                    src_index = {int(v): i for i, v in enumerate(pops[src_pop]["ids"].tolist())}
                    src = np.array([src_index[int(s)] for s in g["source_node_id"][()]])
                    tgt = np.array([index[int(t)] for t in g["target_node_id"][()]])
                    steps = np.maximum(1, np.round(delay / h)).astype(np.int64)
                    e = dict(src=src, tgt=tgt, w=w.astype(np.float64), port=port, steps=steps,
                             n_src=len(pops[src_pop]["ids"]))
                    if src_pop == self.pop:
                        self.rec = e
                    else:
                        e["pop"] = src_pop
                        self.inp.append(e)
        if self.rec is None:
            sys.exit("bptt_torch: the network has no recurrent edges")
        # Poisson inputs: rate per virtual population (the config's `inputs`).
        self.rates = {}
        for inp in cfg.get("inputs", {}).values():
            if inp.get("input_type") == "poisson":
                self.rates[inp.get("node_set")] = float(inp["rate"])
        # Target rates.
        self.target = np.zeros(n)
        self.vreg = 0.0
        for loss in cfg["training"]["losses"]:
            if loss["name"] == "TargetFiringRate":
                fr = loss["firing_rate"]
                if isinstance(fr, (int, float)):
                    self.target[:] = fr
                else:
                    path = resolve(fr, manifest, base)
                    with open(path) as f:
                        rows = [l.split(",") for l in f.read().splitlines()[1:] if l.strip()]
                    for r in rows:
                        if r[1] == self.pop:
                            self.target[index[int(r[0])]] = float(r[2])
            elif loss["name"] == "VoltageRegularization":
                self.vreg = float(loss.get("cost", 1e-5))
        pd = cfg["training"].get("pseudo_derivative", {})
        self.sg = (pd.get("name", "gauss"), float(pd.get("gain", 0.3)), float(pd.get("width", 0.5)))
        opt = cfg["training"]["optimizer"]
        self.lr = float(opt.get("learning_rate", 1e-3))


class Spike(torch.autograd.Function):
    """z = H(v - 1) with a surrogate derivative of the normalized voltage v."""

    @staticmethod
    def forward(ctx, v, kind, gain, width):
        ctx.save_for_backward(v)
        ctx.sg = (kind, gain, width)
        return (v > 1.0).to(v.dtype)

    @staticmethod
    def backward(ctx, g):
        (v,) = ctx.saved_tensors
        kind, gain, width = ctx.sg
        if kind == "triangle":
            d = gain * torch.clamp(1 - (v - 1).abs(), min=0)
        else:
            d = gain * torch.exp(-(((v - 1) / width) ** 2))
        return g * d, None, None, None


def groups(e, dev, n_tgt):
    """(steps, port, row-major COO indices [2, E_g], edge selection) per delay and port."""
    out = []
    for d in np.unique(e["steps"]):
        for k in np.unique(e["port"]):
            sel = np.nonzero((e["steps"] == d) & (e["port"] == k))[0]
            if len(sel) == 0:
                continue
            idx = torch.tensor(np.stack([e["tgt"][sel], e["src"][sel]]), dtype=torch.long, device=dev)
            out.append((int(d), int(k), idx, torch.tensor(sel, device=dev)))
    return out


def step_fn(net, dev, batch, T):
    c = {k: torch.tensor(v, dtype=torch.float32, device=dev) for k, v in net.c.items()}
    refr = c["refr"].round().to(torch.int32)
    n, P, A = net.n, net.ports, net.asc
    rec_groups = groups(net.rec, dev, n)
    w0 = torch.tensor(net.rec["w"], dtype=torch.float32, device=dev)
    sign = torch.sign(w0)
    inputs = []
    for e in net.inp:
        rate = net.rates.get(e["pop"], 0.0)
        w_in = torch.tensor(e["w"], dtype=torch.float32, device=dev)
        mats = [(d, k, torch.sparse_coo_tensor(idx, w_in[sel], (n, e["n_src"]), check_invariants=False).coalesce())
                for d, k, idx, sel in groups(e, dev, n)]
        inputs.append((rate * net.h / 1000.0, e["n_src"], mats))
    max_d = max([d for d, _, _, _ in rec_groups] + [d for _, _, ms in inputs for d, _, _ in ms])
    target = torch.tensor(net.target, dtype=torch.float32, device=dev)
    th = c["th"]
    kind, gain, width = net.sg

    def loss_and_grad(w, timing):
        t0 = time.perf_counter()
        mats = [(d, k, torch.sparse_coo_tensor(idx, w[sel], (n, n), check_invariants=False)) for d, k, idx, sel in rec_groups]
        U = torch.zeros(batch, n, device=dev)
        Ia = torch.zeros(batch, n, A, device=dev)
        y1 = torch.zeros(batch, n, P, device=dev)
        y2 = torch.zeros(batch, n, P, device=dev)
        r = torch.zeros(batch, n, dtype=torch.int32, device=dev)
        zs, xs = [], [[] for _ in inputs]
        zero = torch.zeros(batch, n, device=dev)
        count = torch.zeros(batch, n, device=dev)
        vreg = torch.zeros((), device=dev)
        for t in range(T):
            free = r == 0
            asc_sum = (c["stable"] * Ia).sum(-1)
            Ia_dec = Ia * c["decay"]
            Un = U * c["P33"] + asc_sum * c["P30"] + (c["P31"] * y1 + c["P32"] * y2).sum(-1)
            v = Un / th
            z = Spike.apply(v, kind, gain, width) * free
            soft = Un - (th - c["reset"]) * z
            hard = torch.where(z > 0, c["reset"].expand_as(Un), Un)
            Un = soft + (hard - soft).detach()
            U = torch.where(free, Un, U)
            Ia_new = Ia_dec + z.unsqueeze(-1) * (c["amps"] + Ia_dec * c["refr_decay"] - Ia_dec)
            Ia = torch.where(free.unsqueeze(-1), Ia_new, Ia)
            r = torch.where(z.detach() > 0, refr.expand_as(r), torch.clamp(r - 1, min=0))
            vreg = vreg + (torch.relu((v - 0.5).abs() - 0.5) ** 2).sum()
            count = count + z
            zs.append(z)
            # Arrivals of this step per port: recurrent spikes d steps ago and input spikes.
            arr = [torch.zeros(n, batch, device=dev) for _ in range(P)]
            for d, k, m in mats:
                if t - d >= 0:
                    arr[k] = arr[k] + torch.sparse.mm(m, zs[t - d].t())
            for j, (p, n_src, ms) in enumerate(inputs):
                xs[j].append((torch.rand(batch, n_src, device=dev) < p).float())
                for d, k, m in ms:
                    if t - d >= 0:
                        arr[k] = arr[k] + torch.sparse.mm(m, xs[j][t - d].t())
            a = torch.stack(arr, -1).transpose(0, 1)
            y2 = c["P21"] * y1 + c["P11"] * y2
            y1 = c["P11"] * y1 + c["jump"] * a
            if len(zs) > max_d:
                zs[t - max_d] = None
        rate = count / (T * net.h / 1000.0)
        loss = ((rate - target) ** 2).mean() + net.vreg * vreg / (batch * n * T)
        sync(dev)
        t1 = time.perf_counter()
        loss.backward()
        sync(dev)
        timing["forward"] = t1 - t0
        timing["backward"] = time.perf_counter() - t1
        return loss.item(), count.sum().item() / (batch * n) / (T * net.h / 1000.0)

    return w0, sign, loss_and_grad


def sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", required=True)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--batch", type=int)
    ap.add_argument("--seq-len", type=int)
    ap.add_argument("--json")
    a = ap.parse_args()
    dev = torch.device(a.device)
    t_build = time.perf_counter()
    net = Network(a.config)
    batch = a.batch or int(net.cfg["run"]["batch_size"])
    T = a.seq_len or int(net.cfg["run"]["seq_len"])
    w0, sign, lg = step_fn(net, dev, batch, T)
    build_s = time.perf_counter() - t_build
    w = w0.clone().requires_grad_(True)
    opt = torch.optim.Adam([w], lr=net.lr)
    steps, split = [], {"forward": [], "backward": [], "optimizer": []}
    loss = rate = float("nan")
    for i in range(a.warmup + max(1, a.repeats)):
        timing = {}
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss, rate = lg(w, timing)
        t1 = time.perf_counter()
        opt.step()
        with torch.no_grad():
            w.mul_((sign * w >= 0).float())
        sync(dev)
        timing["optimizer"] = time.perf_counter() - t1
        if i >= a.warmup:
            steps.append(time.perf_counter() - t0)
            for k in split:
                split[k].append(timing[k])
    med = {k: statistics.median(v) for k, v in split.items()}
    out = {
        "config": a.config, "device": str(dev),
        "gpu": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "",
        "torch": torch.__version__, "cells": net.n, "recurrent_edges": int(len(net.rec["w"])),
        "batch": batch, "seq_len": T, "s_per_step": statistics.median(steps),
        "forward_s": med["forward"], "backward_s": med["backward"], "optimizer_s": med["optimizer"],
        "loss": loss, "mean_rate_hz": rate, "build_s": build_s,
        "peak_device_bytes": torch.cuda.max_memory_allocated(dev) if dev.type == "cuda" else None,
    }
    print(f"PyTorch {torch.__version__} on {out['gpu'] or out['device']}: {a.config}: {net.n} cells, "
          f"{out['recurrent_edges']} recurrent edges, batch {batch}, seq_len {T}")
    print(f"  {out['s_per_step']:.3f} s/step = forward {med['forward']:.3f} + backward "
          f"{med['backward']:.3f} + optimizer {med['optimizer']:.3f} (median of {len(steps)} after "
          f"{a.warmup} warm-up); last loss {loss:.6f}, mean rate {rate:.2f} Hz")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f)


if __name__ == "__main__":
    main()
