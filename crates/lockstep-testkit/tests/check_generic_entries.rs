//! `scripts/check_generic_entries.py` (run by `make lint`) fails, naming the file and line,
//! when a program's source names a burn backend type of lockstep-npe (which compiles the
//! network's generics again in that program), ignores comments, and passes on the
//! workspace's own programs.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn check(dirs: &[&Path]) -> Output {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..");
    Command::new("python3")
        .arg(root.join("scripts/check_generic_entries.py"))
        .args(dirs)
        .current_dir(&root)
        .output()
        .expect("python3 could not be started")
}

#[test]
fn a_program_naming_a_backend_type_fails_and_the_workspace_passes() {
    let dir = tempfile::tempdir().unwrap();
    let src = dir.path().join("src");
    std::fs::create_dir_all(src.join("bench")).unwrap();
    std::fs::write(
        src.join("main.rs"),
        "// NpeModel<CpuAutodiff> in a comment is no use\nfn main() {}\n",
    )
    .unwrap();
    let out = check(&[&src]);
    assert!(out.status.success(), "{out:?}");

    std::fs::write(
        src.join("bench/npe.rs"),
        "fn f() {}\nfn g<B: TrainBackend>(m: NpeModel<B>) {}\n",
    )
    .unwrap();
    let out = check(&[&src]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(
        err.contains("bench/npe.rs:2: names `TrainBackend`"),
        "{err}"
    );

    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..");
    let out = check(&[
        &root.join("crates/lockstep-cli/src"),
        &root.join("python/src"),
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(check(&[]).status.code(), Some(2));
}
