//! `lockstep-gpu`: the device layer of lockstep's GPU engines, shared by the spiking-network
//! kernels and the NPE.
//!
//! * [`list_adapters`]: the GPUs wgpu sees (Vulkan, Metal, DX12), with the limits and shader
//!   features the engines depend on (`lockstep info` prints them).
//! * [`select_adapter`]: which adapter a rank computes on (`run.device: "gpu"` binds the
//!   node-local rank's adapter; `"gpu:N"` names one).
//! * [`GpuContext`]: one device and queue per adapter and process, shared by every model on
//!   it; buffers checked against the adapter's limits before they are made; blocking
//!   read-back; device errors turned into [`GpuError`].
//! * [`windows`]: arrays larger than one storage binding, bound as windows of one buffer.
//!
//! No adapter is an error that says what to install ([`GpuError::NoAdapter`]), never a
//! silent fall-back to the CPU. Without a GPU, Mesa's software Vulkan driver (lavapipe,
//! Debian's `mesa-vulkan-drivers`) is an adapter: every kernel runs on it in CI.

mod adapter;
mod context;
mod error;
pub mod windows;

pub use adapter::{
    candidates, hidden_features, list_adapters, select_adapter, AdapterSummary, Selected,
    HIDE_FEATURES_VAR,
};
pub use context::{process_adapters, GpuContext, GpuCounters, ReadRange};
pub use error::{GpuError, Result, MAX_BINDING_VAR, TIMEOUT_VAR};
pub use wgpu;

/// Where a model computes (`run.device` of a training config).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum DeviceRequest {
    /// CPU cores (the default).
    #[default]
    Cpu,
    /// A GPU: `None` binds the adapter of the rank's slot ([`select_adapter`]); `Some(N)`
    /// adapter N of [`list_adapters`] (`"gpu:N"`, a single process).
    Gpu(Option<usize>),
}

impl std::str::FromStr for DeviceRequest {
    type Err = GpuError;

    /// `"cpu"`, `"gpu"` or `"gpu:N"`.
    fn from_str(s: &str) -> Result<Self> {
        let bad = || GpuError::BadDevice {
            value: s.to_string(),
        };
        match s {
            "cpu" => Ok(DeviceRequest::Cpu),
            "gpu" => Ok(DeviceRequest::Gpu(None)),
            _ => {
                let n = s.strip_prefix("gpu:").ok_or_else(bad)?;
                n.parse()
                    .map(|n| DeviceRequest::Gpu(Some(n)))
                    .map_err(|_| bad())
            }
        }
    }
}

impl std::fmt::Display for DeviceRequest {
    /// The config's spelling.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            DeviceRequest::Cpu => f.write_str("cpu"),
            DeviceRequest::Gpu(None) => f.write_str("gpu"),
            DeviceRequest::Gpu(Some(n)) => write!(f, "gpu:{n}"),
        }
    }
}

impl<'de> serde::Deserialize<'de> for DeviceRequest {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        s.parse().map_err(serde::de::Error::custom)
    }
}

impl serde::Serialize for DeviceRequest {
    fn serialize<S: serde::Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        s.serialize_str(&self.to_string())
    }
}

#[cfg(test)]
mod tests {
    use super::DeviceRequest;

    #[test]
    fn device_requests_parse_and_print() {
        for (s, d) in [
            ("cpu", DeviceRequest::Cpu),
            ("gpu", DeviceRequest::Gpu(None)),
            ("gpu:3", DeviceRequest::Gpu(Some(3))),
        ] {
            assert_eq!(s.parse::<DeviceRequest>().unwrap(), d);
            assert_eq!(d.to_string(), s);
        }
        for bad in ["cuda", "gpu:", "gpu:x", "GPU", ""] {
            let e = bad.parse::<DeviceRequest>().unwrap_err().to_string();
            assert!(e.contains("run.device") && e.contains("gpu:N"), "{e}");
        }
    }
}
