//! The output folder of `lockstep nbody`, owned by the chief like `train`'s and `simulate`'s
//! run directories:
//!
//! - a folder that does not exist, or exists and is empty, is used (created by the chief);
//! - an existing non-empty folder is refused unless `output.overwrite_output_dir` is true (or
//!   `--overwrite` is passed);
//! - with overwrite, only files lockstep nbody itself writes are deleted (snapshots
//!   `snapshot_NNNN_rank_RRRR.npz` and `snap_NNN.R.hdf5`, `diagnostics.csv`, the
//!   marker file [`MARKER`]); a folder holding anything else (a sub-folder, a foreign file) is refused
//!   and left untouched, so no old rank file survives next to the new ones and nothing lockstep
//!   did not write is lost.
//!
//! Every check runs before anything is deleted; only the chief deletes or creates.

use std::path::{Path, PathBuf};

use lockstep_core::output_dir::{list, write_marker, MARKER};

use crate::NbodyError;

/// Default output folder, relative to the current working directory (like GADGET's
/// `OutputDir`), used when the config gives no `output.dir` and no `--output-dir` is passed.
pub const DEFAULT_DIR: &str = "nbody_output";

/// Whether `name` is a file `lockstep nbody` writes into its output folder.
pub fn is_own_file(name: &str) -> bool {
    let digits = |s: &str| !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit());
    // A file being written (atomic writes go through NAME.partial).
    let name = name.strip_suffix(".partial").unwrap_or(name);
    if name == MARKER || name == "diagnostics.csv" {
        return true;
    }
    // snapshot_{index:04}_rank_{rank:04}.npz
    if let Some(rest) = name
        .strip_prefix("snapshot_")
        .and_then(|r| r.strip_suffix(".npz"))
    {
        if let Some((i, r)) = rest.split_once("_rank_") {
            return digits(i) && digits(r);
        }
    }
    // snap_{index:03}.{rank}.hdf5
    if let Some(rest) = name
        .strip_prefix("snap_")
        .and_then(|r| r.strip_suffix(".hdf5"))
    {
        if let Some((i, r)) = rest.split_once('.') {
            return digits(i) && digits(r);
        }
    }
    false
}

/// What the chief will do with the output folder; decided by [`plan`] before anything is
/// touched, carried out by [`prepare`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum OutputPlan {
    /// Create the folder (it does not exist or is empty).
    Create,
    /// Delete these files of an earlier `lockstep nbody` run, then use the folder.
    Replace(Vec<PathBuf>),
}

fn refuse(dir: &Path, problem: String) -> NbodyError {
    NbodyError::OutputDir {
        dir: dir.to_path_buf(),
        problem,
    }
}

/// Checks the output folder `dir` without changing anything.
///
/// Errors: [`NbodyError::OutputDir`] when `dir` is a file, cannot be read, is non-empty
/// without `overwrite`, or holds anything lockstep nbody did not write.
pub fn plan(dir: &Path, overwrite: bool) -> Result<OutputPlan, NbodyError> {
    if !dir.exists() {
        return Ok(OutputPlan::Create);
    }
    if !dir.is_dir() {
        return Err(refuse(
            dir,
            "is not a folder; choose another output.dir (or --output-dir)".into(),
        ));
    }
    let listing = list(dir, is_own_file).map_err(|e| NbodyError::io(dir, e))?;
    if listing.entries == 0 {
        return Ok(OutputPlan::Create);
    }
    if !overwrite {
        return Err(refuse(
            dir,
            format!(
                "the output folder exists and is not empty ({} entries); set \
                 output.overwrite_output_dir to true (or pass --overwrite) to replace an \
                 earlier lockstep nbody output there, or choose another output.dir \
                 (or --output-dir)",
                listing.entries
            ),
        ));
    }
    if let Some(name) = listing.foreign {
        return Err(refuse(
            dir,
            format!(
                "holds `{name}`, which lockstep nbody did not write, so \
                 overwrite_output_dir will not replace this folder; choose another \
                 output.dir (or --output-dir) or remove it yourself"
            ),
        ));
    }
    Ok(OutputPlan::Replace(listing.own))
}

/// Carries out `plan` on `dir`: deletes the earlier run's files, creates the folder, writes
/// the [`MARKER`]. Run by the chief only, after every check has passed.
///
/// Errors: [`NbodyError::Io`] naming the file or folder that could not be changed.
pub fn prepare(dir: &Path, plan: &OutputPlan) -> Result<(), NbodyError> {
    if let OutputPlan::Replace(files) = plan {
        for f in files {
            std::fs::remove_file(f).map_err(|e| NbodyError::io(f, e))?;
        }
    }
    std::fs::create_dir_all(dir).map_err(|e| NbodyError::io(dir, e))?;
    write_marker(
        dir,
        "written by lockstep nbody; overwrite_output_dir may replace the files it wrote here\n",
    )
    .map(drop)
    .map_err(|e| NbodyError::io(dir.join(MARKER), e))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn own_files_are_recognised() {
        for n in [
            "snapshot_0003_rank_0001.npz",
            "snap_012.3.hdf5",
            "diagnostics.csv",
            MARKER,
        ] {
            assert!(is_own_file(n), "{n}");
        }
        for n in [
            "snapshot_x_rank_0001.npz",
            "snap_012.hdf5",
            "notes.txt",
            "snap_000.0.hdf5.bak",
            "ics.hdf5",
        ] {
            assert!(!is_own_file(n), "{n}");
        }
    }
}
