//! `scripts/check_one_compile.py` (run by `make lint`) fails when a dev-dependency switches on
//! a library feature, the way the `testing` features of earlier rounds made `cargo test`
//! compile the workspace a second time, and passes once the dev-dependency is gone. Checked on
//! a two-crate workspace made here (a few seconds of compiling, its own target folder).

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn write(path: &Path, text: &str) {
    std::fs::create_dir_all(path.parent().unwrap()).unwrap();
    std::fs::write(path, text).unwrap();
}

fn check(workspace: &Path) -> Output {
    let script =
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../scripts/check_one_compile.py");
    Command::new("python3")
        .arg(script)
        .args(["--profile", "release"])
        .current_dir(workspace)
        .env("CARGO_TARGET_DIR", workspace.join("target"))
        .output()
        .expect("python3 could not be started")
}

#[test]
fn a_feature_switched_on_by_a_dev_dependency_fails_the_check() {
    let dir = tempfile::tempdir().unwrap();
    let ws = dir.path();
    write(
        &ws.join("Cargo.toml"),
        "[workspace]\nresolver = \"2\"\nmembers = [\"a\", \"b\"]\n",
    );
    write(
        &ws.join("a/Cargo.toml"),
        "[package]\nname = \"a\"\nversion = \"0.1.0\"\nedition = \"2021\"\n[features]\ntesting = []\n",
    );
    write(&ws.join("a/src/lib.rs"), "//! a\npub fn f() -> u32 { 1 }\n");
    let b = "[package]\nname = \"b\"\nversion = \"0.1.0\"\nedition = \"2021\"\n[dependencies]\na = { path = \"../a\" }\n";
    write(
        &ws.join("b/Cargo.toml"),
        &format!("{b}[dev-dependencies]\na = {{ path = \"../a\", features = [\"testing\"] }}\n"),
    );
    write(
        &ws.join("b/src/lib.rs"),
        "//! b\npub fn g() -> u32 { a::f() }\n",
    );
    let out = check(ws);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains("a 0.1.0") && stderr.contains("test build features ['testing']"),
        "{stderr}"
    );
    // Without the dev-dependency's feature the test build reuses both libraries.
    write(&ws.join("b/Cargo.toml"), b);
    let out = check(ws);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(String::from_utf8_lossy(&out.stdout).contains("reuses all 2 libraries"));
}
