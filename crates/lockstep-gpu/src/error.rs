//! Errors of the device layer. Each says what to install, set or change.

/// The environment variable that sets how long a host waits for the GPU (seconds, a positive
/// number): a wait past it ends the job with [`GpuError::Timeout`] naming the adapter.
pub const TIMEOUT_VAR: &str = "LOCKSTEP_GPU_TIMEOUT_S";

/// Environment variable: a storage binding limit in bytes (at least 65,536) below the
/// adapter's, which lockstep's own kernels then respect as if the adapter had it: arrays
/// over it are bound as windows (the spiking network's edges, weights, gradient and
/// per-sample arrays, the N-body's particles, expansions, lists and fields), and
/// buffers that cannot be windowed are refused by name. For testing the paths that only
/// large networks take on a small one; unset, the adapter's limit.
pub const MAX_BINDING_VAR: &str = "LOCKSTEP_GPU_MAX_BINDING";

/// What can go wrong when finding, opening or using a GPU.
#[derive(Debug, thiserror::Error)]
pub enum GpuError {
    /// wgpu found no adapter at all (no Vulkan driver, no loader, no GPU).
    #[error(
        "no GPU adapter found (wgpu saw none on {backends}); install a Vulkan driver and its loader \
         (Debian/Ubuntu: apt-get install libvulkan1 and the GPU's driver; without a GPU, \
         mesa-vulkan-drivers gives the software adapter lavapipe), check VK_ICD_FILENAMES / \
         VK_DRIVER_FILES if set, or set run.device to \"cpu\""
    )]
    NoAdapter {
        /// The backends that were searched.
        backends: String,
    },
    /// `gpu:N` named an adapter that does not exist.
    #[error("run.device asks for GPU adapter {index}, but only {count} adapter(s) exist ({names}); `lockstep info` lists them")]
    NoSuchAdapter {
        /// The requested index.
        index: usize,
        /// How many adapters exist.
        count: usize,
        /// Their names.
        names: String,
    },
    /// The adapter lacks a feature the engine needs.
    #[error("GPU adapter {adapter:?} lacks the feature {feature} that {needed_for} needs; use another GPU or run.device \"cpu\"")]
    MissingFeature {
        /// The adapter's name.
        adapter: String,
        /// The wgpu feature's name.
        feature: &'static str,
        /// What needs it.
        needed_for: &'static str,
    },
    /// A buffer is larger than the adapter allows.
    #[error("the GPU buffer {buffer:?} needs {bytes} bytes ({mib:.1} MiB) but adapter {adapter:?} allows at most {limit} bytes per {what}; reduce {reduce}")]
    BufferTooLarge {
        /// The buffer's name.
        buffer: String,
        /// Its size in bytes.
        bytes: u64,
        /// Its size in MiB.
        mib: f64,
        /// The limit in bytes.
        limit: u64,
        /// Which limit (`buffer` or `storage binding`).
        what: &'static str,
        /// The adapter's name.
        adapter: String,
        /// The config keys that shrink it.
        reduce: String,
    },
    /// Opening the device failed.
    #[error("cannot open GPU adapter {adapter:?}: {message}")]
    RequestDevice {
        /// The adapter's name.
        adapter: String,
        /// wgpu's message.
        message: String,
    },
    /// The device reported an error (validation, out of memory, lost device).
    #[error("GPU adapter {adapter:?} reported an error: {message}")]
    Device {
        /// The adapter's name.
        adapter: String,
        /// wgpu's message.
        message: String,
    },
    /// A submission did not finish within the wait limit ([`crate::GpuContext::wait_timeout`]).
    #[error("GPU adapter {adapter:?} did not finish {what} within {seconds} s; the device may have stopped answering (the limit is {TIMEOUT_VAR} = seconds; check `nvidia-smi` or the driver's log)", TIMEOUT_VAR = TIMEOUT_VAR)]
    Timeout {
        /// The adapter's name.
        adapter: String,
        /// What was waited for.
        what: String,
        /// The limit in seconds.
        seconds: f64,
    },
    /// A bad `run.device` value.
    #[error("run.device: {value:?} is not a device; use \"cpu\", \"gpu\" or \"gpu:N\" (N from `lockstep info`)")]
    BadDevice {
        /// The value as written.
        value: String,
    },
}

/// Result of the device layer.
pub type Result<T> = std::result::Result<T, GpuError>;
