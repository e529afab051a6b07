//! A training run leaves `config.simulate.json` beside its trained weights: the trained network
//! simulates with one command, from anywhere (lockstep, and BMTK through the manifest
//! `"$BASE_DIR": "${configdir}"`), and reads the trained edges. libsonata reads what the run
//! wrote: the training spikes, the exported edges' indices, the simulated spikes.

use std::path::PathBuf;
use std::process::Command;

use lockstep_testkit::{python, require_libsonata};

const LOCKSTEP: &str = env!("CARGO_BIN_EXE_lockstep");

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..")
}

#[test]
fn a_trained_network_simulates_with_one_command() {
    let tmp = tempfile::tempdir().unwrap();
    let run = tmp.path().join("run");
    let out = Command::new(LOCKSTEP)
        .current_dir(repo())
        .args([
            "train",
            "examples/glif_all2all/config.train.json",
            "--updates",
            "1",
        ])
        .arg("--output-dir")
        .arg(&run)
        .arg("--overwrite")
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let cfg_path = run.join("config.simulate.json");
    let cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&cfg_path).unwrap()).unwrap();
    // 500 steps of 1 ms, the training seed and inputs, the trained edges in the run folder
    // through the manifest BMTK resolves from any working directory.
    assert_eq!(
        cfg["manifest"],
        serde_json::json!({"$BASE_DIR": "${configdir}"})
    );
    assert_eq!(cfg["run"]["tstop"], 500.0);
    assert_eq!(cfg["run"]["dt"], 1.0);
    assert_eq!(cfg["run"]["seed"], 3000);
    // lockstep's Poisson input, which BMTK's pointnet lacks, becomes the spike trains it
    // draws, as a SONATA spike file BMTK reads (issue 60 item 4).
    assert_eq!(
        cfg["inputs"]["lgn_poisson"],
        serde_json::json!({"input_type": "spikes", "module": "h5",
            "input_file": "$BASE_DIR/inputs/lgn_poisson.h5", "node_set": "lgn"})
    );
    assert_eq!(cfg["output"]["output_dir"], "$BASE_DIR/simulation");
    let edges: Vec<&str> = cfg["networks"]["edges"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["edges_file"].as_str().unwrap())
        .collect();
    assert_eq!(
        edges,
        [
            "$BASE_DIR/network/v1_v1_edges.h5",
            "$BASE_DIR/network/lgn_v1_edges.h5"
        ]
    );
    for e in &edges {
        let e = e.replace("$BASE_DIR", run.to_str().unwrap());
        assert!(std::path::Path::new(&e).is_file(), "{e} was not exported");
    }

    // Run it from another working directory: every path resolves.
    let out = Command::new(LOCKSTEP)
        .current_dir(tmp.path())
        .arg("simulate")
        .arg(&cfg_path)
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{text}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(text.contains("simulated 300 neurons for 500 ms"), "{text}");
    assert!(run.join("simulation/spikes.h5").is_file());
    assert!(run.join("simulation/spikes.csv").is_file());

    // The drawn trains are what lockstep's Poisson input draws with the run's seed: the
    // config with the Poisson input put back simulates the same spikes.
    let mut poisson = cfg.clone();
    poisson["inputs"]["lgn_poisson"] =
        serde_json::json!({"input_type": "poisson", "rate": 20.0, "node_set": "lgn"});
    poisson["output"]["output_dir"] = serde_json::json!("$BASE_DIR/simulation_poisson");
    let poisson_path = run.join("config.poisson.json");
    std::fs::write(&poisson_path, poisson.to_string()).unwrap();
    let out = Command::new(LOCKSTEP)
        .arg("simulate")
        .arg(&poisson_path)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let spikes = |d: &str| std::fs::read_to_string(run.join(d).join("spikes.csv")).unwrap();
    assert!(spikes("simulation").lines().count() > 10);
    assert_eq!(spikes("simulation"), spikes("simulation_poisson"));

    // BMTK's resolution (bmtk.utils.sonata.config): `${configdir}` is the config's folder,
    // manifest variables are substituted, and what stays relative is taken against the
    // working directory. Started in another folder, every file the config names is found.
    require_libsonata();
    let script = r#"
import sys, os, json, re
cfg_path, elsewhere = sys.argv[1], sys.argv[2]
os.chdir(elsewhere)
cfg = json.load(open(cfg_path))
configdir = os.path.dirname(os.path.abspath(cfg_path))
manifest = {k: v.replace("${configdir}", configdir) for k, v in cfg["manifest"].items()}
def resolve(s):
    for k, v in manifest.items():
        s = s.replace(k, v)
    assert "$" not in s, s
    return s
files = [e[k] for e in cfg["networks"]["nodes"] + cfg["networks"]["edges"] for k in e]
files += [i["input_file"] for i in cfg["inputs"].values() if "input_file" in i]
files += list(cfg["components"].values())
for f in files:
    assert os.path.exists(resolve(f)), (f, resolve(f), os.getcwd())
assert resolve(cfg["output"]["output_dir"]) == os.path.join(configdir, "simulation")
print("ok")
"#;
    let out = python(script, &[cfg_path.as_os_str(), tmp.path().as_os_str()]);
    assert_eq!(out.trim(), "ok");

    // libsonata reads the training spikes (update 0), the spikes of the simulation, and
    // queries the exported edges' indices; the drawn input holds about 20 Hz of the 100 LGN
    // nodes over 500 ms, on the 1 ms grid.
    let script = r#"
import sys, libsonata, h5py, numpy as np
run = sys.argv[1]
lgn = libsonata.SpikeReader(run + "/inputs/lgn_poisson.h5")["lgn"]
assert lgn.sorting == "by_time", lgn.sorting
drawn = lgn.get()
assert 700 < len(drawn) < 1300, len(drawn)
ts = np.array([t for _, t in drawn])
assert np.all(ts > 0) and np.all(ts <= 500) and np.all(ts == np.round(ts)), ts[:10]
for name in ["spikes/update_000000.h5", "simulation/spikes.h5"]:
    with h5py.File(run + "/" + name, "r") as f:
        ids = f["spikes/v1/node_ids"][...]
        ts = f["spikes/v1/timestamps"][...]
    p = libsonata.SpikeReader(run + "/" + name)["v1"]
    assert p.sorting == "by_time", (name, p.sorting)
    got = p.get()
    assert len(got) == len(ids) > 0, (name, len(got), len(ids))
    assert [(int(i), float(t)) for i, t in got] == list(zip(ids.tolist(), ts.tolist())), name
for name in ["v1_v1_edges.h5", "lgn_v1_edges.h5"]:
    path = run + "/network/" + name
    with h5py.File(path, "r") as f:
        pops = list(f["edges"])
        src = f["edges/%s/source_node_id" % pops[0]][...]
        tgt = f["edges/%s/target_node_id" % pops[0]][...]
    p = libsonata.EdgeStorage(path).open_population(pops[0])
    for node in range(0, int(max(src.max(), tgt.max())) + 1, 7):
        aff = np.sort(p.afferent_edges([node]).flatten())
        eff = np.sort(p.efferent_edges([node]).flatten())
        assert np.array_equal(aff, np.flatnonzero(tgt == node)), (name, node)
        assert np.array_equal(eff, np.flatnonzero(src == node)), (name, node)
print("ok")
"#;
    let out = python(script, &[run.as_os_str()]);
    assert_eq!(out.trim(), "ok");
}

/// Copies a folder of the repository, without the outputs of earlier runs.
fn copy(src: &std::path::Path, dst: &std::path::Path) {
    std::fs::create_dir_all(dst).unwrap();
    for e in std::fs::read_dir(src).unwrap() {
        let p = e.unwrap().path();
        let name = p.file_name().unwrap();
        if p.is_dir() && !["output", "output_trained", "runs"].contains(&name.to_str().unwrap()) {
            copy(&p, &dst.join(name));
        } else if p.is_file() {
            std::fs::copy(&p, dst.join(name)).unwrap();
        }
    }
}

/// `examples/glif_all2all/config.simulation.trained.json` simulates the weights a training run
/// left in `runs/mpi/network` (issue 18, item 4), and says which file is missing before.
#[test]
fn the_bundled_trained_simulation_config_reads_the_demo_runs_weights() {
    let tmp = tempfile::tempdir().unwrap();
    let examples = tmp.path().join("examples");
    for ex in ["glif_all2all", "point_components"] {
        copy(&repo().join("examples").join(ex), &examples.join(ex));
    }
    let ex = examples.join("glif_all2all");
    let simulate = || {
        Command::new(LOCKSTEP)
            .arg("simulate")
            .arg(ex.join("config.simulation.trained.json"))
            .output()
            .unwrap()
    };
    let before = simulate();
    let err = String::from_utf8_lossy(&before.stderr);
    assert!(!before.status.success());
    assert!(err.contains("runs/mpi/network/v1_v1_edges.h5"), "{err}");

    let out = Command::new(LOCKSTEP)
        .arg("train")
        .arg(ex.join("config.train.json"))
        .args(["--updates", "1", "--output-dir"])
        .arg(ex.join("runs/mpi"))
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let after = simulate();
    let text = String::from_utf8_lossy(&after.stdout);
    assert!(
        after.status.success(),
        "{text}\n{}",
        String::from_utf8_lossy(&after.stderr)
    );
    assert!(text.contains("simulated 300 neurons for 1000 ms"), "{text}");
    assert!(ex.join("output_trained/spikes.h5").is_file());
}
