//! The chief-owned run directory (invariant 8): created (or refused) before anything is
//! written, holding `run.log`, the resolved config (`config.json`), `callbacks/losses.csv`,
//! `callbacks/performance.csv`, `checkpoints/` and the exported weights. Only the chief
//! creates a [`RunDir`]. Whether an existing directory may be replaced is decided by
//! [`lockstep_core::output_dir`] (only marked or empty folders are).

use crate::checkpoint::write_atomic;
use crate::TrainError;
use lockstep_core::output_dir::{check_replaceable, OutputDirError, MARKER};
use std::fs::{File, OpenOptions};
use std::io::Write;
use std::path::{Path, PathBuf};

/// Open files of a run directory.
#[derive(Debug)]
pub struct RunDir {
    root: PathBuf,
    log: File,
    losses: File,
    performance: File,
    progress: Option<indicatif::ProgressBar>,
    quiet: bool,
    /// Whether [`RunDir::create`] replaced an earlier lockstep run in `root`.
    replaced_earlier_run: bool,
}

impl RunDir {
    /// Creates `root` (refusing an existing one unless `overwrite`), writes the resolved config
    /// atomically, opens the log and the CSV callbacks with their headers. Whether it replaced an
    /// earlier run: [`RunDir::replaced_earlier_run`].
    ///
    /// Errors: [`TrainError::OutputDir`] when the directory exists and may not be replaced,
    /// [`TrainError::Io`] naming the file that cannot be written. An existing directory is
    /// left untouched unless `overwrite` is set *and* it is empty or a lockstep output
    /// directory (see [`check_replaceable`]).
    pub fn create(
        root: &Path,
        overwrite: bool,
        log_file: &str,
        resolved_config: &serde_json::Value,
        loss_names: &[String],
    ) -> Result<RunDir, TrainError> {
        let mut replaced = false;
        if root.exists() || root.is_symlink() {
            if !overwrite {
                return Err(OutputDirError::Exists(root.to_path_buf()).into());
            }
            check_replaceable(root, &[])?;
            replaced = root.join(MARKER).is_file();
            if root.is_symlink() || root.is_file() {
                std::fs::remove_file(root)
                    .map_err(|e| TrainError::io(root, "cannot remove the old output", e))?;
            } else {
                std::fs::remove_dir_all(root).map_err(|e| {
                    TrainError::io(root, "cannot remove the old output directory", e)
                })?;
            }
        }
        let mut dir = Self::open(root, log_file, resolved_config, loss_names, None)?;
        dir.replaced_earlier_run = replaced;
        Ok(dir)
    }

    /// Whether [`RunDir::create`] replaced an earlier lockstep run (a folder with the
    /// output marker) in the root; the engine says so in the new log.
    pub fn replaced_earlier_run(&self) -> bool {
        self.replaced_earlier_run
    }

    /// Reopens the run directory `root` of an interrupted run to continue it after update
    /// `update` (resume in place): keeps its files, drops CSV rows of later updates, appends.
    ///
    /// Errors: [`TrainError::Io`] naming the directory.
    pub fn reopen(
        root: &Path,
        log_file: &str,
        resolved_config: &serde_json::Value,
        loss_names: &[String],
        update: u64,
    ) -> Result<RunDir, TrainError> {
        Self::open(root, log_file, resolved_config, loss_names, Some(update))
    }

    fn open(
        root: &Path,
        log_file: &str,
        resolved_config: &serde_json::Value,
        loss_names: &[String],
        continue_after: Option<u64>,
    ) -> Result<RunDir, TrainError> {
        let mkdir = |p: PathBuf| {
            std::fs::create_dir_all(&p)
                .map_err(|e| TrainError::io(p, "cannot create the output directory", e))
        };
        mkdir(root.join("callbacks"))?;
        mkdir(root.join("checkpoints"))?;
        lockstep_core::output_dir::write_marker(
            root,
            "written by lockstep; overwrite_output_dir may replace this directory\n",
        )
        .map_err(|e| TrainError::io(root.join(MARKER), "cannot write", e))?;
        // Serializing a `Value` cannot fail (its map keys are strings).
        let text = serde_json::to_string_pretty(resolved_config).unwrap_or_default();
        write_atomic(&root.join("config.json"), text.as_bytes())?;
        let header = format!("step,epoch,{},total", loss_names.join(","));
        let perf_header = "step,data_s,compute_s,comm_s,step_s,samples_per_s,peak_rss_mib";
        let losses_path = root.join("callbacks/losses.csv");
        let perf_path = root.join("callbacks/performance.csv");
        for (path, head) in [(&losses_path, header.as_str()), (&perf_path, perf_header)] {
            let mut text = format!("{head}\n");
            if let Some(update) = continue_after {
                // Keep the rows up to the checkpoint; later ones are recomputed.
                if let Ok(old) = std::fs::read_to_string(path) {
                    for line in old.lines().skip(1) {
                        let step: Option<u64> = line.split(',').next().and_then(|s| s.parse().ok());
                        if step.is_some_and(|s| s <= update) {
                            text.push_str(line);
                            text.push('\n');
                        }
                    }
                }
            }
            write_atomic(path, text.as_bytes())?;
        }
        let open = |p: PathBuf| -> Result<File, TrainError> {
            OpenOptions::new()
                .create(true)
                .append(true)
                .open(&p)
                .map_err(|e| TrainError::io(p, "cannot open", e))
        };
        Ok(RunDir {
            root: root.to_path_buf(),
            log: open(root.join(log_file))?,
            losses: open(losses_path)?,
            performance: open(perf_path)?,
            progress: None,
            quiet: false,
            replaced_earlier_run: false,
        })
    }

    /// With `quiet`, log lines go to the log file only (no stdout, no progress bar).
    pub fn set_quiet(&mut self, quiet: bool) {
        self.quiet = quiet;
    }

    /// Shows a progress bar of `total` updates when stderr is a terminal (the log lines then
    /// go above the bar); otherwise the periodic log lines on stdout are the progress.
    pub fn start_progress(&mut self, done: u64, total: u64) {
        use std::io::IsTerminal;
        // indicatif draws on stderr: show the bar only where stderr is a terminal (under
        // mpirun it is a pipe, and the periodic log lines are the progress).
        if self.quiet || !std::io::stderr().is_terminal() {
            return;
        }
        let bar = indicatif::ProgressBar::new(total);
        bar.set_style(
            indicatif::ProgressStyle::with_template("{bar:30} update {pos}/{len} {msg} ETA {eta}")
                .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
        );
        bar.set_position(done);
        self.progress = Some(bar);
    }

    /// True when a progress bar is shown.
    pub fn has_progress(&self) -> bool {
        self.progress.is_some()
    }

    /// Moves the progress bar to update `step` with a short message (loss, samples/s).
    pub fn progress(&mut self, step: u64, message: String) {
        if let Some(bar) = &self.progress {
            bar.set_position(step);
            bar.set_message(message);
        }
    }

    /// Removes the progress bar.
    pub fn finish_progress(&mut self) {
        if let Some(bar) = self.progress.take() {
            bar.finish_and_clear();
        }
    }

    /// The directory.
    pub fn root(&self) -> &Path {
        &self.root
    }

    /// Appends a line to the log file and prints it on stdout.
    pub fn log(&mut self, line: &str) -> Result<(), TrainError> {
        match &self.progress {
            Some(bar) => bar.println(line),
            None if !self.quiet => println!("{line}"),
            None => {}
        }
        self.log_quiet(line)
    }

    /// Appends a line to the log file only.
    pub fn log_quiet(&mut self, line: &str) -> Result<(), TrainError> {
        writeln!(self.log, "{line}")
            .map_err(|e| TrainError::io(&self.root, "cannot write the log", e))
    }

    /// Appends one row to `callbacks/losses.csv`.
    pub fn losses_row(&mut self, step: u64, epoch: u64, terms: &[f64]) -> Result<(), TrainError> {
        let total: f64 = terms.iter().sum();
        let cols: Vec<String> = terms.iter().map(|t| format!("{t:.9e}")).collect();
        writeln!(self.losses, "{step},{epoch},{},{total:.9e}", cols.join(","))
            .map_err(|e| TrainError::io(self.root.join("callbacks/losses.csv"), "cannot write", e))
    }

    /// Appends one row to `callbacks/performance.csv` (times in s, the slowest rank's).
    pub fn performance_row(
        &mut self,
        step: u64,
        times: [f64; 3],
        step_s: f64,
        samples_per_s: f64,
    ) -> Result<(), TrainError> {
        writeln!(
            self.performance,
            "{step},{:.6},{:.6},{:.6},{step_s:.6},{samples_per_s:.3},{:.1}",
            times[0],
            times[1],
            times[2],
            lockstep_core::memory::peak_rss_bytes().unwrap_or(0) as f64 / (1 << 20) as f64
        )
        .map_err(|e| {
            TrainError::io(
                self.root.join("callbacks/performance.csv"),
                "cannot write",
                e,
            )
        })
    }
}
