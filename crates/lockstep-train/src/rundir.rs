//! The chief-owned run directory (invariant 8): created (or refused) before anything is
//! written, holding `run.log`, the resolved config (`config.json`), `callbacks/losses.csv`,
//! `callbacks/performance.csv`, `checkpoints/` and the exported weights. Only the chief
//! creates a [`RunDir`].

use crate::checkpoint::write_atomic;
use crate::TrainError;
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
}

impl RunDir {
    /// Creates `root` (refusing an existing one unless `overwrite`), writes the resolved config
    /// atomically, opens the log and the CSV callbacks with their headers.
    ///
    /// Errors: [`TrainError::Io`] naming the directory; an existing directory with
    /// `overwrite == false` is left untouched and the error names `output.overwrite_output_dir`.
    pub fn create(
        root: &Path,
        overwrite: bool,
        log_file: &str,
        resolved_config: &serde_json::Value,
        loss_names: &[String],
    ) -> Result<RunDir, TrainError> {
        if root.exists() {
            if !overwrite {
                return Err(TrainError::io(
                    root,
                    "the output directory already exists; set output.overwrite_output_dir to true to replace it, or choose another output.output_dir",
                ));
            }
            std::fs::remove_dir_all(root).map_err(|e| TrainError::io(root, e))?;
        }
        std::fs::create_dir_all(root.join("callbacks")).map_err(|e| TrainError::io(root, e))?;
        std::fs::create_dir_all(root.join("checkpoints")).map_err(|e| TrainError::io(root, e))?;
        let text = serde_json::to_string_pretty(resolved_config)
            .map_err(|e| TrainError::io(root.join("config.json"), e))?;
        write_atomic(&root.join("config.json"), text.as_bytes())?;
        let open = |p: PathBuf| -> Result<File, TrainError> {
            OpenOptions::new()
                .create(true)
                .append(true)
                .open(&p)
                .map_err(|e| TrainError::io(p, e))
        };
        let log = open(root.join(log_file))?;
        let mut losses = open(root.join("callbacks/losses.csv"))?;
        let mut performance = open(root.join("callbacks/performance.csv"))?;
        let header = format!("step,epoch,{},total", loss_names.join(","));
        writeln!(losses, "{header}").map_err(|e| TrainError::io(root, e))?;
        writeln!(
            performance,
            "step,data_s,compute_s,comm_s,step_s,samples_per_s,peak_rss_mib"
        )
        .map_err(|e| TrainError::io(root, e))?;
        Ok(RunDir {
            root: root.to_path_buf(),
            log,
            losses,
            performance,
            progress: None,
            quiet: false,
        })
    }

    /// With `quiet`, log lines go to the log file only (no stdout, no progress bar).
    pub fn set_quiet(&mut self, quiet: bool) {
        self.quiet = quiet;
    }

    /// Shows a progress bar of `total` updates on stdout when stdout is a terminal (the log
    /// lines then go above the bar); otherwise the periodic log lines are the progress.
    pub fn start_progress(&mut self, done: u64, total: u64) {
        use std::io::IsTerminal;
        if self.quiet || !std::io::stdout().is_terminal() {
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
        writeln!(self.log, "{line}").map_err(|e| TrainError::io(&self.root, e))
    }

    /// Appends a line to the log file only.
    pub fn log_quiet(&mut self, line: &str) -> Result<(), TrainError> {
        writeln!(self.log, "{line}").map_err(|e| TrainError::io(&self.root, e))
    }

    /// Appends one row to `callbacks/losses.csv`.
    pub fn losses_row(&mut self, step: u64, epoch: u64, terms: &[f64]) -> Result<(), TrainError> {
        let total: f64 = terms.iter().sum();
        let cols: Vec<String> = terms.iter().map(|t| format!("{t:.9e}")).collect();
        writeln!(self.losses, "{step},{epoch},{},{total:.9e}", cols.join(","))
            .map_err(|e| TrainError::io(self.root.join("callbacks/losses.csv"), e))
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
            peak_rss_mib()
        )
        .map_err(|e| TrainError::io(self.root.join("callbacks/performance.csv"), e))
    }
}

/// Peak resident memory of this process in MiB (`VmHWM` of `/proc/self/status`; 0 elsewhere).
pub fn peak_rss_mib() -> f64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmHWM:"))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|kb| kb.parse::<f64>().ok())
        })
        .map(|kb| kb / 1024.0)
        .unwrap_or(0.0)
}
