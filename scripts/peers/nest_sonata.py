"""Simulate a SONATA point-neuron network in NEST, the way BMTK's `pointnet` maps it.

Run by `lockstep bench simulate` (when the Python module `nest` is importable) to time NEST on
the same network, input and settings as lockstep in the same invocation, and to compare the
spikes one by one. Reads the files with h5py (the NEST wheels on PyPI are built without
HDF5, so `nest.SonataNetwork` is not available there).

Usage: python nest_sonata.py SPEC.json OUT.json

SPEC (written by lockstep): {"dt": ms, "tstop": ms, "threads": n,
  "nodes": [{"file": h5, "types": csv, "population": name}],
  "edges": [{"file": h5, "types": csv, "population": name}],
  "cell_models_dir": dir, "synaptic_models_dir": dir,
  "inputs": [{"file": spikes_h5, "population": name}],
  "record": population}
OUT: {"nest_version", "build_s" (network and inputs, after importing nest), "simulate_s",
     "node_ids": [...], "times": [...]}

Mapping (BMTK pointnet on NEST 3): `model_template` "nest:<model>" -> NEST model <model> with
the node type's dynamics_params JSON; virtual nodes -> spike_generator (precise_times);
weight = syn_weight x nsyns (pA, sign kept); delay and synapse JSON from the edge types;
receptor_type from the synapse JSON (0 when absent); static_synapse.
"""

import csv
import json
import os
import sys
import time


def read_types(path):
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f, delimiter=" "))
    return {int(r["node_type_id"] if "node_type_id" in r else r["edge_type_id"]): r for r in rows}


def main(spec_path, out_path):
    import h5py
    import numpy as np

    spec = json.load(open(spec_path))
    import nest

    t0 = time.perf_counter()

    nest.set_verbosity("M_ERROR")
    nest.ResetKernel()
    nest.SetKernelStatus({"resolution": spec["dt"], "local_num_threads": spec.get("threads", 1)})

    populations = {}  # name -> (NodeCollection or list of generators, node_ids)
    for entry in spec["nodes"]:
        types = read_types(entry["types"])
        pop = entry["population"]
        with h5py.File(entry["file"], "r") as f:
            g = f["nodes"][pop]
            node_ids = g["node_id"][()]
            type_ids = g["node_type_id"][()]
        order = np.argsort(node_ids)
        node_ids, type_ids = node_ids[order], type_ids[order]
        first = types[int(type_ids[0])]
        if first.get("model_type") == "virtual":
            gens = nest.Create("spike_generator", len(node_ids), params={"precise_times": True})
            populations[pop] = (gens, node_ids)
            continue
        gids = [None] * len(node_ids)
        for tid in np.unique(type_ids):
            row = types[int(tid)]
            model = row["model_template"].split(":", 1)[1]
            params = json.load(open(os.path.join(spec["cell_models_dir"], row["dynamics_params"])))
            idx = np.nonzero(type_ids == tid)[0]
            nc = nest.Create(model, len(idx), params=params)
            for k, i in enumerate(idx):
                gids[i] = nc[k].global_id
        populations[pop] = (gids, node_ids)

    def gid_list(pop):
        handle, ids = populations[pop]
        if isinstance(handle, list):
            lookup = dict(zip(ids.tolist(), handle))
        else:
            lookup = dict(zip(ids.tolist(), handle.tolist()))
        return lookup

    lookups = {p: gid_list(p) for p in populations}

    for entry in spec["inputs"]:
        pop = entry["population"]
        gens, ids = populations[pop]
        with h5py.File(entry["file"], "r") as f:
            g = f["spikes"][pop] if pop in f["spikes"] else f["spikes"][list(f["spikes"].keys())[0]]
            nid = g["node_ids"][()]
            ts = g["timestamps"][()]
        by_node = {}
        for n, t in zip(nid.tolist(), ts.tolist()):
            by_node.setdefault(n, []).append(t)
        for k, n in enumerate(ids.tolist()):
            times = sorted(t for t in by_node.get(n, []) if t > 0.0)
            if times:
                nest.SetStatus(gens[k], {"spike_times": times})

    syn_cache = {}
    for entry in spec["edges"]:
        types = read_types(entry["types"])
        with h5py.File(entry["file"], "r") as f:
            g = f["edges"][entry["population"]]
            src_pop = g["source_node_id"].attrs["node_population"]
            tgt_pop = g["target_node_id"].attrs["node_population"]
            src_pop = src_pop.decode() if isinstance(src_pop, bytes) else src_pop
            tgt_pop = tgt_pop.decode() if isinstance(tgt_pop, bytes) else tgt_pop
            src = g["source_node_id"][()]
            tgt = g["target_node_id"][()]
            etype = g["edge_type_id"][()]
            grp = g["0"] if "0" in g else None
            nsyns = grp["nsyns"][()] if grp is not None and "nsyns" in grp else None
            sw = grp["syn_weight"][()] if grp is not None and "syn_weight" in grp else None
        smap, tmap = lookups[src_pop], lookups[tgt_pop]
        for et in np.unique(etype):
            row = types[int(et)]
            idx = np.nonzero(etype == et)[0]
            w = sw[idx] if sw is not None else np.full(len(idx), float(row["syn_weight"]))
            if nsyns is not None:
                w = w * nsyns[idx]
            fname = row["dynamics_params"]
            if fname not in syn_cache:
                syn_cache[fname] = json.load(open(os.path.join(spec["synaptic_models_dir"], fname)))
            syn = dict(syn_cache[fname])
            receptor = int(syn.get("receptor_type", 0))
            delay = float(row["delay"])
            s = np.array([smap[int(x)] for x in src[idx]])
            t = np.array([tmap[int(x)] for x in tgt[idx]])
            nest.Connect(
                s, t, "one_to_one",
                {"synapse_model": "static_synapse", "weight": w, "delay": np.full(len(idx), delay),
                 "receptor_type": receptor},
            )

    rec_pop = spec["record"]
    handle, ids = populations[rec_pop]
    sr = nest.Create("spike_recorder")
    nest.Connect(nest.NodeCollection(sorted(handle)), sr)
    t1 = time.perf_counter()
    nest.Simulate(spec["tstop"])
    t2 = time.perf_counter()
    ev = sr.get("events")
    back = {gid: n for n, gid in lookups[rec_pop].items()}
    out = {
        "nest_version": nest.__version__,
        "build_s": t1 - t0,
        "simulate_s": t2 - t1,
        "node_ids": [int(back[int(s)]) for s in ev["senders"]],
        "times": [float(t) for t in ev["times"]],
    }
    with open(out_path + ".tmp", "w") as f:
        json.dump(out, f)
    os.replace(out_path + ".tmp", out_path)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
