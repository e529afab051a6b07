//! Helpers for the workspace's tests; only `[dev-dependencies]` name this crate.
//!
//! It depends on no other lockstep crate and switches on no Cargo feature, so that
//! `cargo test --workspace` compiles the libraries with the same features as
//! `cargo build --workspace` and reuses them (`scripts/check_one_compile.py`, run by
//! `make lint`, fails when that stops being true).
//!
//! [`python`] and [`python_in`] run Python snippets that read lockstep's files (or write
//! inputs) with h5py and numpy, the way the tools users compare against read them;
//! [`require_libsonata`] adds libsonata (the SONATA reference reader, a PyPI wheel);
//! [`have_mpirun`] tells whether an `mpirun` is on the PATH. A test that needs python3 or its
//! packages fails with the fix (`make setup` installs python3, h5py, numpy and libsonata) when
//! they are missing: it never passes by skipping.

use std::ffi::OsStr;
use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::OnceLock;

/// Fails the calling test, with the fix, unless `python3` runs and imports h5py and numpy.
/// Checked once per test process.
///
/// Panics: python3 is missing or cannot import h5py/numpy.
pub fn require_h5py() {
    static PROBE: OnceLock<Result<(), String>> = OnceLock::new();
    let probe = PROBE.get_or_init(|| {
        match Command::new("python3")
            .args(["-c", "import h5py, numpy"])
            .output()
        {
            Ok(o) if o.status.success() => Ok(()),
            Ok(o) => Err(format!(
                "python3 cannot import h5py/numpy, which this test needs to read or write HDF5 files; run `make setup` (or pip install h5py numpy): {}",
                String::from_utf8_lossy(&o.stderr)
            )),
            Err(e) => Err(format!(
                "python3 is not available ({e}); this test needs python3 with h5py and numpy; run `make setup`"
            )),
        }
    });
    if let Err(message) = probe {
        panic!("{message}");
    }
}

/// The libsonata version `make setup` installs (scripts/setup.sh pins the same).
pub const LIBSONATA_VERSION: &str = "0.2.2";

/// Fails the calling test, with the fix, unless `python3` imports h5py, numpy and libsonata
/// (the SONATA reference reader the tests open lockstep's files with). Checked once per test
/// process.
///
/// Panics: python3, h5py, numpy or libsonata is missing.
pub fn require_libsonata() {
    require_h5py();
    static PROBE: OnceLock<Result<(), String>> = OnceLock::new();
    let probe = PROBE.get_or_init(|| {
        match Command::new("python3")
            .args(["-c", "import libsonata"])
            .output()
        {
            Ok(o) if o.status.success() => Ok(()),
            Ok(o) => Err(format!(
                "python3 cannot import libsonata, which this test reads lockstep's SONATA files with; run `make setup` (or pip install libsonata=={LIBSONATA_VERSION}): {}",
                String::from_utf8_lossy(&o.stderr)
            )),
            Err(e) => Err(format!(
                "python3 is not available ({e}); this test needs python3 with libsonata; run `make setup`"
            )),
        }
    });
    if let Err(message) = probe {
        panic!("{message}");
    }
}

/// Runs `python3 -c SCRIPT ARGS...` (the arguments are `sys.argv[1:]`) after
/// [`require_h5py`], and returns its standard output.
///
/// Panics: python3 with h5py/numpy is missing, or the script fails (with its output).
pub fn python(script: &str, args: &[&OsStr]) -> String {
    require_h5py();
    let out = Command::new("python3")
        .arg("-c")
        .arg(script)
        .args(args)
        .output()
        .expect("python3 could not be started");
    assert!(
        out.status.success(),
        "python3 failed:\n{}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// Runs `script` in the folder `dir` with `h5py`, `numpy as np` and `os` imported, and
/// returns its standard output (see [`python`]).
///
/// Panics: as [`python`].
pub fn python_in(dir: &Path, script: &str) -> String {
    python(
        &format!("import h5py, numpy as np, os\nos.chdir({dir:?})\n{script}"),
        &[],
    )
}

/// True when an `mpirun` is on the PATH and answers `mpirun --version`.
pub fn have_mpirun() -> bool {
    Command::new("mpirun")
        .arg("--version")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .map(|s| s.success())
        .unwrap_or(false)
}

#[cfg(test)]
mod tests {
    /// The workspace's `.cargo/config.toml` reaches test processes however `cargo test` is
    /// started (without `make test`'s exports): the HDF5 tests of several crates depend on it.
    #[test]
    fn cargo_env_reaches_the_tests() {
        assert_eq!(
            std::env::var("HDF5_USE_FILE_LOCKING").as_deref(),
            Ok("FALSE"),
            "HDF5_USE_FILE_LOCKING is not FALSE in a test process: .cargo/config.toml's [env] is missing or overridden"
        );
    }
}
