//! Host memory probes (Linux): how much memory this process may still use, and how much it
//! has used at its peak.
//!
//! Commands estimate what a run needs during validation and compare it with
//! [`available_bytes`] before they create, replace or delete any output; benchmarks report
//! [`peak_rss_bytes`]. Where a probe cannot read its source (not Linux, no `/proc`), it returns
//! `None` and the caller skips the check rather than guessing.

use std::path::Path;

/// What a run will hold in memory, part by part, and the config keys that drive it.
///
/// Commands build one during validation (from the config alone, before allocating) and call
/// [`MemoryEstimate::check`] before they create, replace or delete any output.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct MemoryEstimate {
    /// `(what, bytes)` for each large allocation, e.g. `("per-sample state", 1 << 30)`.
    pub parts: Vec<(String, u64)>,
    /// The config keys (dotted paths) whose values drive the total, e.g. `run.seq_len`.
    pub keys: Vec<String>,
    /// The config keys whose larger values shrink the total, e.g. a time step `run.dt`.
    pub inverse_keys: Vec<String>,
}

impl MemoryEstimate {
    /// An empty estimate.
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds a part of `bytes` bytes (saturating).
    pub fn add(&mut self, what: impl Into<String>, bytes: u64) -> &mut Self {
        self.parts.push((what.into(), bytes));
        self
    }

    /// Names a config key that drives the estimate (listed in the error, once each).
    pub fn driven_by(&mut self, key: impl Into<String>) -> &mut Self {
        let key = key.into();
        if !self.keys.contains(&key) {
            self.keys.push(key);
        }
        self
    }

    /// Names a config key whose *larger* values shrink the estimate (a time step, a
    /// recording interval); the error advises raising it.
    pub fn shrunk_by(&mut self, key: impl Into<String>) -> &mut Self {
        let key = key.into();
        if !self.inverse_keys.contains(&key) {
            self.inverse_keys.push(key);
        }
        self
    }

    /// Every part `times` over (e.g. replicas in one process), saturating.
    #[must_use]
    pub fn times(mut self, times: u64, why: &str) -> Self {
        if times > 1 {
            for (what, bytes) in &mut self.parts {
                *bytes = bytes.saturating_mul(times);
                what.push_str(&format!(" x {times} {why}"));
            }
        }
        self
    }

    /// Sum of the parts in bytes (saturating).
    pub fn total(&self) -> u64 {
        self.parts
            .iter()
            .fold(0u64, |a, (_, b)| a.saturating_add(*b))
    }

    /// Refuses the run when the estimate exceeds `available` bytes (`None`: the machine's
    /// memory is unknown and nothing is refused). `what` names the run in the message
    /// (`"this training run"`).
    ///
    /// Errors: [`MemoryError`] with the estimate, the parts, the available memory and the keys.
    pub fn check(&self, available: Option<u64>, what: &str) -> Result<(), MemoryError> {
        match available {
            Some(avail) if self.total() > avail => Err(MemoryError {
                what: what.to_string(),
                need: self.total(),
                available: avail,
                estimate: self.clone(),
            }),
            _ => Ok(()),
        }
    }

    /// [`check`](Self::check) against [`available_bytes`] of this machine.
    ///
    /// Errors: as [`check`](Self::check).
    pub fn check_here(&self, what: &str) -> Result<(), MemoryError> {
        self.check(available_bytes(), what)
    }
}

/// A run that cannot fit in the memory available: what it needs, what is there, why.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "{what} needs about {} ({}) but only {} of memory is available; {}",
    human_bytes(*need),
    parts(&estimate.parts),
    human_bytes(*available),
    advice(&estimate.keys, &estimate.inverse_keys)
)]
pub struct MemoryError {
    /// The run, as the caller named it.
    pub what: String,
    /// Estimated bytes.
    pub need: u64,
    /// Available bytes.
    pub available: u64,
    /// The estimate itself.
    pub estimate: MemoryEstimate,
}

fn parts(p: &[(String, u64)]) -> String {
    let mut v: Vec<&(String, u64)> = p.iter().filter(|(_, b)| *b > 0).collect();
    v.sort_by_key(|x| std::cmp::Reverse(x.1));
    v.iter()
        .map(|(w, b)| format!("{w} {}", human_bytes(*b)))
        .collect::<Vec<_>>()
        .join(", ")
}

fn advice(reduce: &[String], raise: &[String]) -> String {
    match (reduce.is_empty(), raise.is_empty()) {
        (true, true) => "reduce the size of the run".to_string(),
        (false, true) => format!("reduce {}", reduce.join(", ")),
        (true, false) => format!("raise {}", raise.join(", ")),
        (false, false) => format!("reduce {} or raise {}", reduce.join(", "), raise.join(", ")),
    }
}

/// Bytes this process may still allocate: the smaller of the cgroup's remaining allowance
/// (cgroup v2 `memory.max - memory.current`, or v1 `memory.limit_in_bytes - memory.usage_in_bytes`)
/// and the kernel's `MemAvailable` (`/proc/meminfo`). `None` when neither can be read.
pub fn available_bytes() -> Option<u64> {
    let meminfo = std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|s| kib_field(&s, "MemAvailable:"));
    let cgroup = cgroup_remaining();
    match (meminfo, cgroup) {
        (Some(a), Some(b)) => Some(a.min(b)),
        (a, b) => a.or(b),
    }
}

/// Peak resident set size of this process in bytes (`VmHWM` of `/proc/self/status`).
pub fn peak_rss_bytes() -> Option<u64> {
    status_field("VmHWM:")
}

/// Current resident set size of this process in bytes (`VmRSS` of `/proc/self/status`).
pub fn rss_bytes() -> Option<u64> {
    status_field("VmRSS:")
}

/// Resets the peak resident set (`VmHWM`) to the current one by writing `5` to
/// `/proc/self/clear_refs` (Linux >= 4.0); `false` where the kernel does not allow it.
pub fn reset_peak_rss() -> bool {
    std::fs::write("/proc/self/clear_refs", "5").is_ok()
}

/// `n` bytes in the unit a person reads best (`512 B`, `3.2 MiB`, `4.10 GiB`).
pub fn human_bytes(n: u64) -> String {
    const KIB: f64 = 1024.0;
    let x = n as f64;
    if x < KIB {
        format!("{n} B")
    } else if x < KIB * KIB {
        format!("{:.1} KiB", x / KIB)
    } else if x < KIB * KIB * KIB {
        format!("{:.1} MiB", x / (KIB * KIB))
    } else {
        format!("{:.2} GiB", x / (KIB * KIB * KIB))
    }
}

fn status_field(name: &str) -> Option<u64> {
    let s = std::fs::read_to_string("/proc/self/status").ok()?;
    kib_field(&s, name)
}

/// The value in kB of the line starting with `name` (`/proc` files), in bytes.
fn kib_field(text: &str, name: &str) -> Option<u64> {
    let line = text.lines().find(|l| l.starts_with(name))?;
    let kib: u64 = line[name.len()..].split_whitespace().next()?.parse().ok()?;
    Some(kib * 1024)
}

fn read_u64(path: &Path) -> Option<u64> {
    std::fs::read_to_string(path).ok()?.trim().parse().ok()
}

/// Remaining allowance of this process's memory cgroup, if it has a limit.
fn cgroup_remaining() -> Option<u64> {
    let cgroup = std::fs::read_to_string("/proc/self/cgroup").ok()?;
    for line in cgroup.lines() {
        let mut parts = line.splitn(3, ':');
        let (_, controllers, rel) = (parts.next()?, parts.next()?, parts.next()?);
        let rel = rel.trim_start_matches('/');
        if controllers.is_empty() {
            // cgroup v2 (unified hierarchy).
            let dir = Path::new("/sys/fs/cgroup").join(rel);
            let max = std::fs::read_to_string(dir.join("memory.max")).ok()?;
            if max.trim() == "max" {
                return None;
            }
            let max: u64 = max.trim().parse().ok()?;
            let cur = read_u64(&dir.join("memory.current")).unwrap_or(0);
            return Some(max.saturating_sub(cur));
        }
        if controllers.split(',').any(|c| c == "memory") {
            let dir = Path::new("/sys/fs/cgroup/memory").join(rel);
            let max = read_u64(&dir.join("memory.limit_in_bytes"))?;
            if max >= (1 << 60) {
                return None; // "unlimited" is reported as a huge number
            }
            let cur = read_u64(&dir.join("memory.usage_in_bytes")).unwrap_or(0);
            return Some(max.saturating_sub(cur));
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn probes_read_this_machine() {
        let avail = available_bytes().expect("Linux has /proc/meminfo");
        assert!(avail > 1 << 20, "{avail}");
        let now = rss_bytes().expect("Linux has VmRSS");
        let peak = peak_rss_bytes().expect("Linux has VmHWM");
        assert!(peak >= now && now > 0, "{peak} {now}");
    }

    #[test]
    fn an_estimate_over_the_available_memory_names_parts_and_keys() {
        let mut e = MemoryEstimate::new();
        e.add("per-sample state", 3 << 30)
            .add("tapes", 1 << 30)
            .driven_by("run.seq_len")
            .driven_by("run.batch_size")
            .driven_by("run.seq_len");
        let e = e.times(2, "replicas");
        assert_eq!(e.total(), 8 << 30);
        assert!(e.check(Some(9 << 30), "this run").is_ok());
        assert!(e.check(None, "this run").is_ok());
        let err = e.check(Some(2 << 30), "this training run").unwrap_err();
        assert_eq!(
            err.to_string(),
            "this training run needs about 8.00 GiB (per-sample state x 2 replicas 6.00 GiB, \
             tapes x 2 replicas 2.00 GiB) but only 2.00 GiB of memory is available; reduce \
             run.seq_len, run.batch_size"
        );
        let mut e = MemoryEstimate::new();
        e.add("report", 4 << 30)
            .driven_by("run.tstop")
            .shrunk_by("reports.m.dt")
            .shrunk_by("reports.m.dt");
        let err = e.check(Some(1 << 30), "this simulation").unwrap_err();
        assert!(
            err.to_string()
                .ends_with("available; reduce run.tstop or raise reports.m.dt"),
            "{err}"
        );
        e.keys.clear();
        let err = e.check(Some(1 << 30), "this simulation").unwrap_err();
        assert!(err.to_string().ends_with("; raise reports.m.dt"), "{err}");
    }

    #[test]
    fn units() {
        assert_eq!(
            kib_field("MemAvailable:   2048 kB\n", "MemAvailable:"),
            Some(2 << 20)
        );
        assert_eq!(human_bytes(512), "512 B");
        assert_eq!(human_bytes(3 << 20), "3.0 MiB");
        assert_eq!(human_bytes(5 << 30), "5.00 GiB");
    }
}
