//! Ownership of output folders: the one rule by which `lockstep train`, `simulate` and `nbody`
//! decide whether an existing folder may be replaced.
//!
//! A folder lockstep writes carries a [`MARKER`] file. With `output.overwrite_output_dir`,
//! a command replaces only what it owns: a marked folder (train, simulate), an empty one, or
//! one holding nothing but plain files the command itself writes (named by the caller's
//! `is_own` predicate). A project folder, a data folder or any other directory is never
//! deleted, whatever the config says.
//!
//! Guarantees: [`list`] and [`check_replaceable`] only read; [`write_marker`] writes the
//! marker atomically (temporary file, then rename) and nothing else.

use std::io::Write;
use std::path::{Path, PathBuf};

/// The file that marks a folder as written by lockstep (a training run, a simulation output,
/// an N-body output).
pub const MARKER: &str = ".lockstep-output";

/// Whether `dir` carries the lockstep [`MARKER`] file.
pub fn is_marked(dir: &Path) -> bool {
    dir.join(MARKER).is_file()
}

/// Writes the [`MARKER`] into the existing folder `dir` with the text `note` (what wrote the
/// folder and what overwrite may replace), atomically. Returns the marker's path.
///
/// Errors: the I/O error of creating, writing or renaming the file.
pub fn write_marker(dir: &Path, note: &str) -> std::io::Result<PathBuf> {
    let marker = dir.join(MARKER);
    // The `.partial` suffix is what every lockstep writer uses for a file being written.
    let tmp = dir.join(format!("{MARKER}.partial"));
    let result = (|| {
        let mut f = std::fs::File::create(&tmp)?;
        f.write_all(note.as_bytes())?;
        f.sync_all()?;
        std::fs::rename(&tmp, &marker)
    })();
    if result.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    result.map(|()| marker)
}

/// What an existing folder holds, as far as replacing it is concerned.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Listing {
    /// Number of entries (files, folders, links) in the folder.
    pub entries: usize,
    /// The plain files the caller owns (`is_own` true), sorted.
    pub own: Vec<PathBuf>,
    /// The first entry (in directory order) that is not a plain file the caller owns: a
    /// sub-folder, a link or a foreign file. `None` when the caller owns everything.
    pub foreign: Option<String>,
}

/// Lists `dir`, sorting its entries into the plain files `is_own` accepts (by file name) and
/// the first foreign entry.
///
/// Errors: the I/O error of reading the folder.
pub fn list(dir: &Path, is_own: impl Fn(&str) -> bool) -> std::io::Result<Listing> {
    let mut listing = Listing::default();
    for entry in std::fs::read_dir(dir)? {
        let entry = entry?;
        listing.entries += 1;
        let name = entry.file_name().to_string_lossy().into_owned();
        let plain = entry.file_type().map(|t| t.is_file()).unwrap_or(false);
        if plain && is_own(&name) {
            listing.own.push(entry.path());
        } else if listing.foreign.is_none() {
            listing.foreign = Some(name);
        }
    }
    listing.own.sort();
    Ok(listing)
}

/// Why an output folder cannot be replaced. Each message names the folder and the fix.
#[derive(Debug, thiserror::Error)]
pub enum OutputDirError {
    /// The folder exists and the config does not allow replacing it.
    #[error("{}: the output directory already exists; set output.overwrite_output_dir to true to replace it, or choose another output.output_dir", .0.display())]
    Exists(PathBuf),
    /// The output path is a file.
    #[error("{} is a file, not an output directory; choose another output_dir", .0.display())]
    IsAFile(PathBuf),
    /// The folder holds something lockstep did not write.
    #[error("{} exists and was not written by lockstep (it has no {MARKER} file and holds {entry:?}), so overwrite_output_dir will not delete it; choose another output_dir or remove it yourself", dir.display())]
    Foreign {
        /// The folder.
        dir: PathBuf,
        /// An entry lockstep did not write.
        entry: String,
    },
    /// The folder cannot be listed (the OS error is part of the message, not a source).
    #[error("cannot read {}: {error}", dir.display())]
    Unreadable {
        /// The folder.
        dir: PathBuf,
        /// The OS error.
        error: std::io::Error,
    },
}

/// Whether `dir` may be deleted to be replaced by a new output: it must be a link (the link
/// is replaced, never its target), carry the [`MARKER`], or hold nothing but plain files
/// named in `own_files` (the files the command itself writes, e.g. an older simulation's
/// `spikes.h5` and `log.txt`; an empty folder qualifies).
///
/// Errors: [`OutputDirError`] naming the folder and the fix.
pub fn check_replaceable(dir: &Path, own_files: &[&str]) -> Result<(), OutputDirError> {
    if dir.is_symlink() {
        return Ok(());
    }
    if dir.is_file() {
        return Err(OutputDirError::IsAFile(dir.to_path_buf()));
    }
    if is_marked(dir) {
        return Ok(());
    }
    let listing = list(dir, |name| own_files.contains(&name)).map_err(|error| {
        OutputDirError::Unreadable {
            dir: dir.to_path_buf(),
            error,
        }
    })?;
    match listing.foreign {
        None => Ok(()),
        Some(entry) => Err(OutputDirError::Foreign {
            dir: dir.to_path_buf(),
            entry,
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A fresh empty folder under the system temp folder, removed on drop.
    struct TempDir(PathBuf);
    impl TempDir {
        fn new(tag: &str) -> TempDir {
            let p = std::env::temp_dir().join(format!(
                "lockstep-core-output-dir-{tag}-{}",
                std::process::id()
            ));
            let _ = std::fs::remove_dir_all(&p);
            std::fs::create_dir_all(&p).unwrap();
            TempDir(p)
        }
    }
    impl Drop for TempDir {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }

    #[test]
    fn marked_empty_and_own_folders_are_replaceable_others_are_not() {
        let t = TempDir::new("replaceable");
        let d = &t.0;
        check_replaceable(d, &[]).unwrap(); // empty
        std::fs::write(d.join("spikes.h5"), b"x").unwrap();
        check_replaceable(d, &["spikes.h5"]).unwrap(); // only own files
        let e = check_replaceable(d, &[]).unwrap_err();
        assert!(
            matches!(&e, OutputDirError::Foreign { entry, .. } if entry == "spikes.h5"),
            "{e}"
        );
        assert!(e.to_string().contains("no .lockstep-output file"), "{e}");
        std::fs::create_dir(d.join("data")).unwrap();
        let e = check_replaceable(d, &["spikes.h5", "data"]).unwrap_err();
        assert!(
            matches!(&e, OutputDirError::Foreign { entry, .. } if entry == "data"),
            "{e}"
        );
        let marker = write_marker(d, "written by a test\n").unwrap();
        assert_eq!(
            std::fs::read_to_string(marker).unwrap(),
            "written by a test\n"
        );
        assert!(is_marked(d));
        check_replaceable(d, &[]).unwrap(); // marked: anything inside is lockstep's
        let f = d.join("spikes.h5");
        assert!(matches!(
            check_replaceable(&f, &[]),
            Err(OutputDirError::IsAFile(_))
        ));
    }

    #[test]
    fn list_sorts_own_files_and_names_the_first_foreign_entry() {
        let t = TempDir::new("list");
        let d = &t.0;
        for n in ["b.npz", "a.npz", "notes.txt"] {
            std::fs::write(d.join(n), b"x").unwrap();
        }
        std::fs::create_dir(d.join("c.npz")).unwrap(); // a folder is never an own file
        let l = list(d, |n| n.ends_with(".npz")).unwrap();
        assert_eq!(l.entries, 4);
        assert_eq!(l.own, vec![d.join("a.npz"), d.join("b.npz")]);
        assert!(matches!(l.foreign.as_deref(), Some("notes.txt" | "c.npz")));
        let l = list(d, |_| true).unwrap();
        assert_eq!(l.foreign.as_deref(), Some("c.npz"));
        assert_eq!(l.own.len(), 3);
        assert!(list(&d.join("missing"), |_| true).is_err());
    }
}
