//! What the global flags set for the whole process, read by the commands: `--cpu`
//! ([`cpu_only`], [`check_cpu_flag`]) and the seed options' parser ([`parse_seed`]). A leaf:
//! `main.rs` sets the flag, the command files read it, and neither imports the other.

/// Whether `--cpu` was given: every command that can compute on a GPU reads it here. A
/// config key that asks for a GPU (`run.device`, `local.device`) gives way to it (the run
/// says so); a `--device` option that asks for a GPU on the same command line is refused.
static CPU_ONLY: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// Whether the global `--cpu` flag was given ([`CPU_ONLY`]).
pub fn cpu_only() -> bool {
    CPU_ONLY.load(std::sync::atomic::Ordering::Relaxed)
}

/// Refuses `--cpu` together with `--device DEVICE` asking for a GPU on the same command line.
pub fn check_cpu_flag(device: &str) -> anyhow::Result<()> {
    if cpu_only() && !device.eq_ignore_ascii_case("cpu") {
        anyhow::bail!(
            "--cpu and --device {device} ask for different devices; give one of them (--device cpu, or leave out --cpu)"
        );
    }
    Ok(())
}

/// Parses a seed option: a whole number from 0 to 2^64-1, or a negative one from -2^63,
/// which stands for 2^64 plus it (as `torch.manual_seed` takes negative seeds), so that
/// `--seed -1` is a seed and not a flag.
pub fn parse_seed(s: &str) -> Result<u64, String> {
    let t = s.trim();
    if let Ok(v) = t.parse::<u64>() {
        return Ok(v);
    }
    match t.parse::<i64>() {
        Ok(v) => Ok(v as u64),
        Err(_) => Err(format!(
            "{s:?} is not a seed: give a whole number from -9223372036854775808 to 18446744073709551615"
        )),
    }
}

/// Records the global `--cpu` flag (once, in `main`, before any command runs).
pub fn set_cpu_only(cpu: bool) {
    CPU_ONLY.store(cpu, std::sync::atomic::Ordering::Relaxed);
}

/// `value` of the count option `flag` when given, which must be at least 1.
///
/// Errors: a value of 0, naming the flag.
pub fn positive(flag: &str, value: Option<u64>) -> anyhow::Result<Option<u64>> {
    match value {
        Some(0) => anyhow::bail!("{flag} 0: give a count of at least 1"),
        v => Ok(v),
    }
}
