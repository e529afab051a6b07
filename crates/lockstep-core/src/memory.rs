//! Host memory probes (Linux): how much memory this process may still use, and how much it
//! has used at its peak.
//!
//! Commands estimate what a run needs during validation and compare it with
//! [`available_bytes`] before they create, replace or delete any output; benchmarks report
//! [`peak_rss_bytes`]. Where a probe cannot read its source (not Linux, no `/proc`), it returns
//! `None` and the caller skips the check rather than guessing.

use std::path::Path;

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
