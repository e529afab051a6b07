//! Every cause of an error is printed once (issue 18, item 8): the OS error of a file that
//! cannot be read appears once in the message `lockstep` prints, whether it is a config, a
//! file a config names, or a recipe.

use std::process::Command;

const LOCKSTEP: &str = env!("CARGO_BIN_EXE_lockstep");
const OS_CAUSE: &str = "No such file or directory";

/// Runs lockstep with `args` in `dir`; returns stderr (the command must fail).
fn stderr_of(dir: &std::path::Path, args: &[&str]) -> String {
    let out = Command::new(LOCKSTEP)
        .args(args)
        .current_dir(dir)
        .output()
        .unwrap();
    assert!(!out.status.success());
    String::from_utf8_lossy(&out.stderr).into_owned()
}

#[test]
fn os_causes_are_printed_once() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    std::fs::write(
        d.join("config.json"),
        r#"{"run": {"tstop": 10.0, "dt": 0.1}, "networks": {"nodes": [
            {"nodes_file": "missing_nodes.h5", "node_types_file": "types.csv"}]},
            "output": {"output_dir": "out"}}"#,
    )
    .unwrap();
    for args in [
        &["train", "nothere.json"][..],
        &["simulate", "nothere.json"],
        &["simulate", "config.json"],
        &["build-network", "nothere.json", "--output", "net"],
    ] {
        let err = stderr_of(d, args);
        assert_eq!(err.matches(OS_CAUSE).count(), 1, "{args:?}: {err}");
    }
    // The message names the file and where its path came from.
    let err = stderr_of(d, &["simulate", "config.json"]);
    assert!(
        err.contains("missing_nodes.h5") && err.contains("networks.nodes[0].nodes_file"),
        "{err}"
    );
}
