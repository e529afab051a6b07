//! The network builder: recipe -> build -> save -> `Circuit::from_config` round trips,
//! connection rules, determinism, per-edge weights, error messages, and the bundled
//! `examples/glif_all2all` network being the build of its recipe.

use std::path::{Path, PathBuf};

use lockstep_sonata::builder::{build, BuildError, BuiltNetwork, Recipe};
use lockstep_sonata::Circuit;
use serde_json::{json, Value};

/// A folder with `cells/` and `syns/` component folders.
fn components(dir: &Path) {
    let cells = dir.join("cells");
    let syns = dir.join("syns");
    std::fs::create_dir_all(&cells).unwrap();
    std::fs::create_dir_all(&syns).unwrap();
    std::fs::write(cells.join("exc.json"), r#"{"C_m": 58.0, "g": 5.0}"#).unwrap();
    std::fs::write(cells.join("inh.json"), r#"{"C_m": 81.0, "g": 9.0}"#).unwrap();
    for (f, port) in [
        ("e2e.json", 1),
        ("e2i.json", 3),
        ("i2e.json", 2),
        ("i2i.json", 4),
    ] {
        std::fs::write(syns.join(f), format!(r#"{{"receptor_type": {port}}}"#)).unwrap();
    }
}

fn recipe_json(n_exc: usize, n_inh: usize, n_in: usize) -> Value {
    json!({
        "seed": 7,
        "components": {"point_neuron_models_dir": "cells", "synaptic_models_dir": "syns"},
        "nodes": [
            {"population": "v1", "types": [
                {"node_type_id": 100, "count": n_exc, "model_template": "nest:glif_psc",
                 "dynamics_params": "exc.json", "ei": "e", "pop_name": "exc cells",
                 "target_rate_hz": 10.0},
                {"node_type_id": 101, "count": n_inh, "model_template": "nest:glif_psc",
                 "dynamics_params": "inh.json", "ei": "i", "pop_name": "inh",
                 "target_rate_hz": 20.0}
            ]},
            {"population": "lgn", "virtual": true, "types": [
                {"node_type_id": 7, "count": n_in, "ei": "e"}
            ]}
        ],
        "edges": [
            {"source": "v1", "target": "v1", "types": [
                {"edge_type_id": 1, "source_query": {"ei": "e"}, "target_query": {"ei": "e"},
                 "connection": {"rule": "all_to_all", "allow_self": false},
                 "syn_weight": 2.5, "delay": 1.5, "dynamics_params": "e2e.json", "nsyns": 2},
                {"edge_type_id": 2, "source_query": {"ei": "e"}, "target_query": {"ei": "i"},
                 "connection": {"rule": "all_to_all"},
                 "syn_weight": 5.0, "delay": 1.0, "dynamics_params": "e2i.json"},
                {"edge_type_id": 3, "source_query": {"ei": "i"}, "target_query": {"ei": "e"},
                 "connection": {"rule": "all_to_all"},
                 "syn_weight": -6.5, "delay": 2.0, "dynamics_params": "i2e.json"},
                {"edge_type_id": 4, "source_query": {"ei": "i"}, "target_query": {"ei": "i"},
                 "connection": {"rule": "all_to_all", "allow_self": false},
                 "syn_weight": -3.0, "delay": 1.25, "dynamics_params": "i2i.json"}
            ]},
            {"source": "lgn", "target": "v1", "types": [
                {"edge_type_id": 9, "connection": {"rule": "all_to_all"},
                 "syn_weight": 11.0, "delay": 2.0, "dynamics_params": "e2e.json"}
            ]}
        ]
    })
}

fn parse(dir: &Path, v: &Value) -> Result<Recipe, BuildError> {
    let file = dir.join("recipe.json");
    std::fs::write(&file, v.to_string()).unwrap();
    Recipe::from_file(&file)
}

fn build_in(dir: &Path, v: &Value) -> Result<BuiltNetwork, BuildError> {
    build(&parse(dir, v)?)
}

#[test]
fn all_to_all_build_save_read_back() {
    let dir = tempfile::tempdir().unwrap();
    components(dir.path());
    let (ne, ni, nin) = (6usize, 3usize, 4usize);
    let net = build_in(dir.path(), &recipe_json(ne, ni, nin)).unwrap();
    let out = dir.path().join("out");
    let files = net.save(&out, false).unwrap();
    for f in [
        "network/v1_nodes.h5",
        "network/v1_node_types.csv",
        "network/lgn_nodes.h5",
        "network/lgn_node_types.csv",
        "network/v1_v1_edges.h5",
        "network/v1_v1_edge_types.csv",
        "network/lgn_v1_edges.h5",
        "network/lgn_v1_edge_types.csv",
        "target_rates.csv",
        "config.circuit.json",
    ] {
        assert!(files.contains(&out.join(f)), "{f} not in {files:?}");
        assert!(out.join(f).is_file(), "{f}");
    }
    // Paths through the manifest `"$BASE_DIR": "${configdir}"`, which BMTK resolves from any
    // working directory (it takes "." against the working directory).
    let cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("config.circuit.json")).unwrap())
            .unwrap();
    assert_eq!(cfg["manifest"]["$BASE_DIR"], "${configdir}");
    assert_eq!(cfg["manifest"]["$NETWORK_DIR"], "$BASE_DIR/network");

    let c = Circuit::from_config(out.join("config.circuit.json")).unwrap();
    let v1 = c.node_population("v1").unwrap();
    let lgn = c.node_population("lgn").unwrap();
    assert_eq!(v1.len(), ne + ni);
    assert!(!v1.is_virtual);
    assert_eq!(lgn.len(), nin);
    assert!(lgn.is_virtual);
    assert_eq!(v1.count_by_type(), vec![(100, ne), (101, ni)]);
    assert_eq!(v1.model_template(0), Some("nest:glif_psc"));
    assert_eq!(v1.dynamics_params(0).unwrap()["C_m"], 58.0);
    assert_eq!(v1.dynamics_params(ne).unwrap()["C_m"], 81.0);

    let rec = c.edge_population("v1_to_v1").unwrap();
    let n = ne + ni;
    // all-to-all without self-connections: n (n - 1) edges
    assert_eq!(rec.len(), n * (n - 1));
    assert_eq!(
        rec.count_by_type(),
        vec![
            (1, ne * (ne - 1)),
            (2, ne * ni),
            (3, ni * ne),
            (4, ni * (ni - 1))
        ]
    );
    let w = rec.weights();
    #[allow(clippy::needless_range_loop)] // several parallel [edge] arrays
    for i in 0..rec.len() {
        let (s, t) = (rec.source_node_id[i], rec.target_node_id[i]);
        assert_ne!(s, t, "self-connection at edge {i}");
        let (se, te) = ((s as usize) < ne, (t as usize) < ne);
        let (ty, weight, delay, port) = match (se, te) {
            (true, true) => (1, 5.0, 1.5, 1), // 2.5 * nsyns 2
            (true, false) => (2, 5.0, 1.0, 3),
            (false, true) => (3, -6.5, 2.0, 2),
            (false, false) => (4, -3.0, 1.25, 4),
        };
        assert_eq!(rec.edge_type_id[i], ty, "edge {i}");
        assert_eq!(w[i], weight, "edge {i}");
        assert_eq!(rec.delay[i], delay, "edge {i}");
        assert_eq!(rec.synapse(i).receptor_type(), Some(port), "edge {i}");
        // sorted by target, then source
        if i > 0 {
            let prev = (rec.target_node_id[i - 1], rec.source_node_id[i - 1]);
            assert!(prev < (t, s), "edges not sorted at {i}");
        }
    }
    let input = c.edge_population("lgn_to_v1").unwrap();
    assert_eq!(input.len(), nin * n);
    assert!(input.weights().iter().all(|&w| w == 11.0));
    assert_eq!(input.source_population, "lgn");

    let rates = std::fs::read_to_string(out.join("target_rates.csv")).unwrap();
    let lines: Vec<&str> = rates.lines().collect();
    assert_eq!(lines[0], "node_id,population,firing_rate");
    assert_eq!(lines.len(), 1 + n);
    assert_eq!(lines[1], "0,v1,10");
    assert_eq!(lines[n], format!("{},v1,20", n - 1));

    // the types CSV keeps a quoted pop_name with a space
    let csv = std::fs::read_to_string(out.join("network/v1_node_types.csv")).unwrap();
    assert!(csv.contains("\"exc cells\""), "{csv}");
}

#[test]
fn allow_self_adds_the_diagonal() {
    let dir = tempfile::tempdir().unwrap();
    components(dir.path());
    let mut r = recipe_json(5, 2, 1);
    r["edges"][0]["types"][0]["connection"]["allow_self"] = json!(true);
    let net = build_in(dir.path(), &r).unwrap();
    let e = &net.edges[0].parts;
    let selfs = e
        .source_node_id
        .iter()
        .zip(&e.target_node_id)
        .filter(|(s, t)| s == t)
        .count();
    assert_eq!(selfs, 5);
    assert_eq!(e.source_node_id.len(), 7 * 6 + 5);
}

fn random_recipe(seed: u64, p: f64) -> Value {
    let mut r = recipe_json(50, 10, 2);
    r["seed"] = json!(seed);
    r["edges"][0]["types"][0]["connection"] = json!({"rule": "random", "p": p});
    r["edges"][0]["types"][0]["syn_weight"] =
        json!({"distribution": "normal", "mean": 2.0, "std": 0.5});
    r["edges"][0]["types"][3]["syn_weight"] =
        json!({"distribution": "uniform", "low": -4.0, "high": -1.0});
    r
}

#[test]
fn random_rule_is_deterministic_for_a_seed() {
    let dir = tempfile::tempdir().unwrap();
    components(dir.path());
    let a = build_in(dir.path(), &random_recipe(11, 0.3)).unwrap();
    let b = build_in(dir.path(), &random_recipe(11, 0.3)).unwrap();
    let c = build_in(dir.path(), &random_recipe(12, 0.3)).unwrap();
    assert_eq!(a.edges[0].parts, b.edges[0].parts);
    assert_ne!(
        a.edges[0].parts.source_node_id,
        c.edges[0].parts.source_node_id
    );
    // count of the random e->e type: Binomial(50*49, 0.3); 6 standard deviations
    let e = &a.edges[0].parts;
    let k = e.edge_type_id.iter().filter(|&&t| t == 1).count() as f64;
    let (n, p): (f64, f64) = (50.0 * 49.0, 0.3);
    let sd = (n * p * (1.0 - p)).sqrt();
    assert!(
        (k - n * p).abs() < 6.0 * sd,
        "{k} edges, expected {}",
        n * p
    );
    // no self-connections from the random rule either
    assert!(e
        .source_node_id
        .iter()
        .zip(&e.target_node_id)
        .all(|(s, t)| s != t));
    // p = 0 and p = 1 are exact
    let none = build_in(dir.path(), &random_recipe(11, 0.0)).unwrap();
    assert_eq!(
        none.edges[0]
            .parts
            .edge_type_id
            .iter()
            .filter(|&&t| t == 1)
            .count(),
        0
    );
    let all = build_in(dir.path(), &random_recipe(11, 1.0)).unwrap();
    assert_eq!(
        all.edges[0]
            .parts
            .edge_type_id
            .iter()
            .filter(|&&t| t == 1)
            .count(),
        50 * 49
    );
}

#[test]
fn per_edge_weights_are_written_and_read_back() {
    let dir = tempfile::tempdir().unwrap();
    components(dir.path());
    let net = build_in(dir.path(), &random_recipe(3, 0.5)).unwrap();
    let out = dir.path().join("o");
    net.save(&out, false).unwrap();
    let c = Circuit::from_config(out.join("config.circuit.json")).unwrap();
    let rec = c.edge_population("v1_to_v1").unwrap();
    let built = &net.edges[0].parts;
    assert_eq!(rec.source_node_id, built.source_node_id);
    let col = built.groups[0].column("syn_weight").unwrap();
    assert_eq!(rec.syn_weight, col.data.to_f64().unwrap());
    let mut normal = Vec::new();
    for i in 0..rec.len() {
        match rec.edge_type_id[i] {
            1 => normal.push(rec.syn_weight[i]),
            4 => assert!((-4.0..=-1.0).contains(&rec.syn_weight[i])),
            // fixed types keep their value (per-edge column holds the CSV value)
            2 => assert_eq!(rec.syn_weight[i], 5.0),
            3 => assert_eq!(rec.syn_weight[i], -6.5),
            t => panic!("unexpected type {t}"),
        }
    }
    let m = normal.iter().sum::<f64>() / normal.len() as f64;
    let sd = (normal.iter().map(|x| (x - m) * (x - m)).sum::<f64>() / normal.len() as f64).sqrt();
    assert!((m - 2.0).abs() < 0.1, "mean {m}");
    assert!((sd - 0.5).abs() < 0.1, "std {sd}");
    // nsyns of type 1 still applies: weights() = syn_weight * 2
    assert_eq!(rec.weights()[normal_index(rec)], 2.0 * normal[0]);
}

fn normal_index(rec: &lockstep_sonata::EdgePopulation) -> usize {
    rec.edge_type_id.iter().position(|&t| t == 1).unwrap()
}

fn expect_invalid(dir: &Path, r: &Value, key: &str, words: &[&str]) {
    let err = match build_in(dir, r) {
        Ok(_) => panic!("recipe accepted, expected an error at {key}"),
        Err(e) => e,
    };
    let msg = err.to_string();
    match &err {
        BuildError::Invalid { key: k, .. } => assert_eq!(k, key, "{msg}"),
        other => panic!("expected Invalid at {key}, got {other}"),
    }
    assert!(msg.contains("recipe.json"), "{msg}");
    for w in words {
        assert!(msg.contains(w), "'{w}' not in: {msg}");
    }
}

#[test]
fn bad_recipes_are_rejected_with_the_key() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    components(d);
    let mut r = recipe_json(3, 2, 1);
    r["edges"][1]["source"] = json!("lgm");
    expect_invalid(
        d,
        &r,
        "edges[1].source",
        &["unknown node population 'lgm'", "lgn"],
    );

    let mut r = recipe_json(3, 2, 1);
    r["nodes"][0]["types"][1]["count"] = json!(0);
    expect_invalid(d, &r, "nodes[0].types[1].count", &["count is 0"]);

    let mut r = recipe_json(3, 2, 1);
    r["edges"][1]["target"] = json!("lgn");
    r["edges"][1]["source"] = json!("v1");
    expect_invalid(d, &r, "edges[1].target", &["virtual"]);

    let mut r = recipe_json(3, 2, 1);
    r["edges"][0]["types"][2]["source_query"] = json!({"EI": "i"});
    expect_invalid(
        d,
        &r,
        "edges[0].types[2].source_query.EI",
        &["no node-type column 'EI'"],
    );

    let mut r = recipe_json(3, 2, 1);
    r["edges"][0]["types"][2]["source_query"] = json!({"ei": "x"});
    expect_invalid(
        d,
        &r,
        "edges[0].types[2].source_query",
        &["selects no node"],
    );

    let mut r = recipe_json(3, 2, 1);
    r["edges"][0]["types"][0]["connection"] = json!({"rule": "random", "p": 1.5});
    expect_invalid(d, &r, "edges[0].types[0].connection.p", &["1.5", "[0, 1]"]);

    let mut r = recipe_json(3, 2, 1);
    r["edges"][0]["types"][0]["delay"] = json!(0.0);
    expect_invalid(d, &r, "edges[0].types[0].delay", &["> 0"]);

    let mut r = recipe_json(3, 2, 1);
    r["edges"][0]["types"][0]["dynamics_params"] = json!("missing.json");
    expect_invalid(
        d,
        &r,
        "edges[0].types[0].dynamics_params",
        &["'missing.json'", "syns"],
    );

    let mut r = recipe_json(3, 2, 1);
    r["nodes"][0]["types"][0]["dynamics_params"] = json!("nope.json");
    expect_invalid(d, &r, "nodes[0].types[0].dynamics_params", &["'nope.json'"]);

    let mut r = recipe_json(3, 2, 1);
    r["edges"][0]["types"][0]["syn_weight"] = json!({"distribution": "gamma", "k": 1});
    expect_invalid(
        d,
        &r,
        "edges[0].types[0].syn_weight.distribution",
        &["'gamma'"],
    );

    let mut r = recipe_json(3, 2, 1);
    r["edges"][0]["types"][1]["edge_type_id"] = json!(1);
    expect_invalid(d, &r, "edges[0].types[1].edge_type_id", &["edge_type_id 1"]);

    let mut r = recipe_json(3, 2, 1);
    r["nodes"][1]["population"] = json!("v1");
    expect_invalid(d, &r, "nodes[1].population", &["defined twice"]);

    let mut r = recipe_json(3, 2, 1);
    r["components"]["synaptic_models_dir"] = json!("no_such_dir");
    expect_invalid(d, &r, "components.synaptic_models_dir", &["no_such_dir"]);

    let mut r = recipe_json(3, 2, 1);
    r["nodes"][1]["types"][0]["model_type"] = json!("point_neuron");
    expect_invalid(
        d,
        &r,
        "nodes[1].types[0].model_type",
        &["virtual population"],
    );

    let mut r = recipe_json(3, 2, 1);
    r["nodes"][0]["types"][0]["model_type"] = json!("virtual");
    expect_invalid(
        d,
        &r,
        "nodes[0].types[0].model_type",
        &["\"virtual\": true"],
    );

    let mut r = recipe_json(3, 2, 1);
    r["edges"][0]["types"][0]["nsyns"] = json!(0);
    expect_invalid(d, &r, "edges[0].types[0].nsyns", &[">= 1"]);

    let mut r = recipe_json(3, 2, 1);
    r["edges"]
        .as_array_mut()
        .unwrap()
        .push(json!({"source": "v1", "target": "v1", "types": []}));
    expect_invalid(d, &r, "edges[2]", &["second edge population"]);

    // an unknown rule is refused when the recipe is read, naming the key and the allowed rules
    let mut r = recipe_json(3, 2, 1);
    r["edges"][0]["types"][0]["connection"] = json!({"rule": "distance"});
    let err = parse(d, &r).unwrap_err();
    assert!(
        matches!(&err, BuildError::Invalid { key, .. } if key == "edges[0].types[0].connection.rule"),
        "{err}"
    );
    let msg = err.to_string();
    assert!(
        msg.contains("distance") && msg.contains("all_to_all"),
        "{msg}"
    );
    // a misspelt key is refused when read too, with the nearest key
    let mut r = recipe_json(3, 2, 1);
    r["edges"][0]["types"][0]["dealy"] = json!(1.0);
    let msg = parse(d, &r).unwrap_err().to_string();
    assert!(msg.contains("dealy"), "{msg}");
    assert!(msg.contains("did you mean `delay`"), "{msg}");
    // text that is not JSON is a parse error
    let err = Recipe::from_json_str("{\"nodes\": [", &d.join("recipe.json"), d).unwrap_err();
    assert!(matches!(err, BuildError::Parse { .. }), "{err}");
    // syn_weight is typed: a key its distribution does not take, a missing parameter, a
    // value that is neither a number nor an object
    for (w, key, words) in [
        (
            json!({"distribution": "normal", "mean": 1.0, "sdt": 0.5}),
            "edges[0].types[0].syn_weight.sdt",
            &["did you mean `std`"][..],
        ),
        (
            json!({"distribution": "uniform", "low": 1.0}),
            "edges[0].types[0].syn_weight",
            &["missing field `high`"][..],
        ),
        (
            json!({"distribution": "uniform", "low": "a", "high": 1.0}),
            "edges[0].types[0].syn_weight.low",
            &["invalid type"][..],
        ),
        (
            json!("2.5"),
            "edges[0].types[0].syn_weight",
            &["a number (pA) or a distribution object"][..],
        ),
        (
            json!({"distribution": "uniform", "low": 2.0, "high": 1.0}),
            "edges[0].types[0].syn_weight.low",
            &["exceeds high"][..],
        ),
    ] {
        let mut r = recipe_json(3, 2, 1);
        r["edges"][0]["types"][0]["syn_weight"] = w;
        expect_invalid(d, &r, key, words);
    }
}

#[test]
fn existing_output_needs_overwrite() {
    let dir = tempfile::tempdir().unwrap();
    components(dir.path());
    let net = build_in(dir.path(), &recipe_json(3, 2, 1)).unwrap();
    let out = dir.path().join("out");
    net.save(&out, false).unwrap();
    let before = std::fs::read(out.join("network/v1_v1_edge_types.csv")).unwrap();
    let err = net.save(&out, false).unwrap_err();
    let msg = err.to_string();
    assert!(matches!(err, BuildError::Exists { .. }), "{msg}");
    assert!(msg.contains("--overwrite"), "{msg}");
    // a second build with other weights, saved with overwrite, replaces the files
    let mut r = recipe_json(3, 2, 1);
    r["edges"][0]["types"][0]["syn_weight"] = json!(1.0);
    let net2 = build_in(dir.path(), &r).unwrap();
    net2.save(&out, true).unwrap();
    let after = std::fs::read(out.join("network/v1_v1_edge_types.csv")).unwrap();
    assert_ne!(before, after);
    let c = Circuit::from_config(out.join("config.circuit.json")).unwrap();
    let w = c.edge_population("v1_to_v1").unwrap().weights();
    assert_eq!(
        w[c.edge_population("v1_to_v1")
            .unwrap()
            .edge_type_id
            .iter()
            .position(|&t| t == 1)
            .unwrap()],
        2.0
    );
}

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// The committed example network is exactly what its recipe builds.
#[test]
fn bundled_example_matches_its_recipe() {
    let ex = repo().join("examples/glif_all2all");
    let recipe = Recipe::from_file(ex.join("network_recipe.json")).unwrap();
    let net = build(&recipe).unwrap();
    let c = Circuit::from_config(ex.join("config.circuit.json")).unwrap();
    let v1 = c.node_population("v1").unwrap();
    assert_eq!(v1.count_by_type(), vec![(100, 200), (101, 100)]);
    assert_eq!(c.node_population("lgn").unwrap().len(), 100);
    for e in &net.edges {
        let got = c.edge_population(&e.parts.name).unwrap();
        assert_eq!(
            got.source_node_id, e.parts.source_node_id,
            "{}",
            e.parts.name
        );
        assert_eq!(
            got.target_node_id, e.parts.target_node_id,
            "{}",
            e.parts.name
        );
        assert_eq!(got.edge_type_id, e.parts.edge_type_id, "{}", e.parts.name);
        let w = e.parts.groups[0].column("syn_weight").unwrap();
        assert_eq!(got.syn_weight, w.data.to_f64().unwrap(), "{}", e.parts.name);
    }
    let rec = c.edge_population("v1_to_v1").unwrap();
    assert_eq!(rec.len(), 300 * 299);
    for i in 0..rec.len() {
        let exc_src = rec.source_node_id[i] < 200;
        assert_eq!(rec.syn_weight[i] > 0.0, exc_src, "edge {i}");
    }
    let input = c.edge_population("lgn_to_v1").unwrap();
    assert_eq!(input.len(), 100 * 300);
    assert!(input.syn_weight.iter().all(|&w| w >= 0.0));
    let rates = std::fs::read_to_string(ex.join("target_rates.csv")).unwrap();
    assert_eq!(rates.lines().count(), 301);
}
