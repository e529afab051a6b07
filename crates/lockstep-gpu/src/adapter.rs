//! The GPUs wgpu sees ([`list_adapters`]), and which one a rank computes on
//! ([`select_adapter`]).
//!
//! The adapters are listed in a fixed order: hardware adapters (discrete, integrated,
//! virtual, other) before software ones (Mesa's lavapipe reports type `Cpu`), and within a
//! type by backend, PCI bus id and name. When a hardware adapter exists, software adapters are
//! not offered to `gpu`. A rank binds the adapter at its slot (the node-local rank under MPI,
//! the replica's index for thread replicas), wrapping around when there are more ranks than
//! adapters: two ranks may share one GPU, which is reported ([`Selected::shared`]).
//!
//! `CUDA_VISIBLE_DEVICES`, when set to a list of integers, restricts the NVIDIA adapters to
//! those CUDA ordinals, counted in PCI bus order (CUDA's order under
//! `CUDA_DEVICE_ORDER=PCI_BUS_ID`, which Slurm's GPU binding uses); UUID and MIG tokens cannot
//! be matched to a Vulkan adapter and leave the list unchanged (said in the selection's note).

use crate::error::{GpuError, Result};

/// One adapter as wgpu reports it, with the limits the engines depend on.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct AdapterSummary {
    /// Index in [`list_adapters`]'s order (what `gpu:N` names).
    pub index: usize,
    /// The adapter's name (e.g. `NVIDIA H200`, `llvmpipe (LLVM 15.0.6, 256 bits)`).
    pub name: String,
    /// Backend (`Vulkan`, `Metal`, `Dx12`).
    pub backend: String,
    /// Device type (`DiscreteGpu`, `IntegratedGpu`, `VirtualGpu`, `Cpu`, `Other`).
    pub device_type: String,
    /// Driver name and version.
    pub driver: String,
    /// PCI bus id (empty where the backend does not report it).
    pub pci_bus_id: String,
    /// PCI vendor id (0x10de NVIDIA, 0x1002 AMD, 0x8086 Intel).
    pub vendor: u32,
    /// Largest storage-buffer binding (bytes).
    pub max_storage_binding: u64,
    /// Largest buffer (bytes).
    pub max_buffer: u64,
    /// Storage buffers per shader stage.
    pub max_storage_buffers_per_stage: u32,
    /// Workgroups per dispatch dimension.
    pub max_workgroups_per_dimension: u32,
    /// Whether the adapter runs float64 in shaders (`SHADER_F64`).
    pub shader_f64: bool,
    /// Whether the adapter runs 64-bit integers in shaders (`SHADER_INT64`).
    pub shader_int64: bool,
    /// Whether the adapter runs float16 in shaders (`SHADER_F16`).
    pub shader_f16: bool,
    /// Whether it is a software adapter (type `Cpu`, e.g. lavapipe).
    pub software: bool,
}

impl std::fmt::Display for AdapterSummary {
    /// `[index] name (backend, type, driver), PCI bus, limits and shader features`.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mib = |b: u64| b as f64 / (1u64 << 20) as f64;
        write!(
            f,
            "[{}] {} ({}, {}, {}){}; max storage binding {:.0} MiB, max buffer {:.0} MiB, {} storage buffers per stage, {} workgroups per dimension; f64 {}, i64 {}, f16 {}",
            self.index,
            self.name,
            self.backend,
            self.device_type,
            self.driver,
            if self.pci_bus_id.is_empty() {
                String::new()
            } else {
                format!(", PCI {}", self.pci_bus_id)
            },
            mib(self.max_storage_binding),
            mib(self.max_buffer),
            self.max_storage_buffers_per_stage,
            self.max_workgroups_per_dimension,
            yes_no(self.shader_f64),
            yes_no(self.shader_int64),
            yes_no(self.shader_f16),
        )?;
        if self.software {
            write!(f, "; software: emulates a GPU on CPU cores")?;
        }
        Ok(())
    }
}

impl AdapterSummary {
    /// The one-line warning a job prints (chief only) when it computes on a software adapter
    /// (wgpu's device type `Cpu`: Mesa's llvmpipe/lavapipe, SwiftShader, WARP), which trains
    /// at about a hundredth of the CPU engine's speed; `None` for a hardware adapter.
    /// `cpu_setting` is how the command's own settings choose the CPU (e.g.
    /// `run.device: "cpu"`, `local.device: cpu`).
    pub fn software_warning(&self, cpu_setting: &str) -> Option<String> {
        self.software.then(|| {
            format!(
                "warning: GPU adapter [{}] {} is a software adapter: it emulates a GPU on CPU cores and computes far slower (about 100x for training) than lockstep's CPU engine; {cpu_setting} is faster",
                self.index, self.name
            )
        })
    }
}

fn yes_no(b: bool) -> &'static str {
    if b {
        "yes"
    } else {
        "no"
    }
}

/// The native backends this build searches.
pub(crate) fn backends() -> wgpu::Backends {
    wgpu::Backends::VULKAN | wgpu::Backends::METAL | wgpu::Backends::DX12
}

/// A wgpu instance over [`backends`], honouring wgpu's environment variables
/// (`WGPU_BACKEND`, ...).
pub(crate) fn instance() -> wgpu::Instance {
    let mut desc = wgpu::InstanceDescriptor::new_without_display_handle_from_env();
    desc.backends &= backends();
    if desc.backends.is_empty() {
        desc.backends = backends();
    }
    wgpu::Instance::new(desc)
}

/// Rank of a device type in the listing (hardware first).
fn type_rank(t: wgpu::DeviceType) -> u8 {
    match t {
        wgpu::DeviceType::DiscreteGpu => 0,
        wgpu::DeviceType::IntegratedGpu => 1,
        wgpu::DeviceType::VirtualGpu => 2,
        wgpu::DeviceType::Other => 3,
        wgpu::DeviceType::Cpu => 4,
    }
}

/// The adapters of `instance` in the listing's order, with their summaries.
pub(crate) fn ordered_adapters(instance: &wgpu::Instance) -> Vec<(wgpu::Adapter, AdapterSummary)> {
    let mut adapters: Vec<wgpu::Adapter> =
        futures_lite::future::block_on(instance.enumerate_adapters(backends()));
    adapters.sort_by_cached_key(|a| {
        let i = a.get_info();
        (
            type_rank(i.device_type),
            format!("{:?}", i.backend),
            i.device_pci_bus_id.clone(),
            i.name.clone(),
        )
    });
    adapters
        .into_iter()
        .enumerate()
        .map(|(index, a)| {
            let s = summary(index, &a);
            (a, s)
        })
        .collect()
}

/// The environment variable that hides shader features of every adapter
/// ([`hidden_features`]).
pub const HIDE_FEATURES_VAR: &str = "LOCKSTEP_GPU_HIDE_FEATURES";

/// The shader features [`HIDE_FEATURES_VAR`] names (a comma-separated list of `SHADER_F16`,
/// `SHADER_F64`, `SHADER_INT64`, wgpu's names), which lockstep then treats as absent on
/// every adapter: the listing reports them as missing and devices are opened without them.
/// It reproduces a GPU without a feature on one that has it (a run that needs float16 on
/// an older GPU, say), as the tests do on lavapipe.
///
/// Errors: a name that is not one of the three, with the accepted ones.
pub fn hidden_features() -> std::result::Result<wgpu::Features, String> {
    let Ok(list) = std::env::var(HIDE_FEATURES_VAR) else {
        return Ok(wgpu::Features::empty());
    };
    let mut hidden = wgpu::Features::empty();
    for name in list.split(',').map(str::trim).filter(|n| !n.is_empty()) {
        hidden |= match name.to_ascii_uppercase().as_str() {
            "SHADER_F16" => wgpu::Features::SHADER_F16,
            "SHADER_F64" => wgpu::Features::SHADER_F64,
            "SHADER_INT64" => wgpu::Features::SHADER_INT64,
            _ => {
                return Err(format!(
                    "{HIDE_FEATURES_VAR}={list:?}: {name:?} is not a feature lockstep can hide; use SHADER_F16, SHADER_F64 or SHADER_INT64, comma-separated"
                ))
            }
        };
    }
    Ok(hidden)
}

/// An adapter's features less the hidden ones ([`hidden_features`]; a bad variable hides
/// nothing here: [`crate::GpuContext::open`] reports it).
pub(crate) fn features(a: &wgpu::Adapter) -> wgpu::Features {
    a.features() - hidden_features().unwrap_or(wgpu::Features::empty())
}

fn summary(index: usize, a: &wgpu::Adapter) -> AdapterSummary {
    let i = a.get_info();
    let l = a.limits();
    let f = features(a);
    AdapterSummary {
        index,
        name: i.name.clone(),
        backend: format!("{:?}", i.backend),
        device_type: format!("{:?}", i.device_type),
        driver: format!("{} {}", i.driver, i.driver_info).trim().to_string(),
        pci_bus_id: i.device_pci_bus_id.clone(),
        vendor: i.vendor,
        max_storage_binding: l.max_storage_buffer_binding_size,
        max_buffer: l.max_buffer_size,
        max_storage_buffers_per_stage: l.max_storage_buffers_per_shader_stage,
        max_workgroups_per_dimension: l.max_compute_workgroups_per_dimension,
        shader_f64: f.contains(wgpu::Features::SHADER_F64),
        shader_int64: f.contains(wgpu::Features::SHADER_INT64),
        shader_f16: f.contains(wgpu::Features::SHADER_F16),
        software: i.device_type == wgpu::DeviceType::Cpu,
    }
}

/// Every adapter wgpu sees on this machine's native backends, in the listing's order (the
/// order `gpu:N` counts in). Empty when there is none (no driver or loader).
pub fn list_adapters() -> Vec<AdapterSummary> {
    ordered_adapters(&instance())
        .into_iter()
        .map(|(_, s)| s)
        .collect()
}

/// Which adapter a rank computes on.
#[derive(Debug, Clone, PartialEq)]
pub struct Selected {
    /// The adapter (its `index` is in the full listing).
    pub adapter: AdapterSummary,
    /// Whether other slots map to the same adapter (more ranks on this node than adapters).
    pub shared: bool,
    /// How the choice was made, for the log (e.g. `node-local rank 1 of 2 adapters`).
    pub note: String,
}

/// The adapters `gpu` may bind, as indices into `all` (in order): hardware adapters when any
/// exists, else the software ones; restricted by `cuda_visible_devices` as the module docs
/// say. Returns the indices and a note when the variable could not be applied.
pub fn candidates(
    all: &[AdapterSummary],
    cuda_visible_devices: Option<&str>,
) -> (Vec<usize>, Option<String>) {
    let hardware = all.iter().any(|a| !a.software);
    let mut idx: Vec<usize> = all
        .iter()
        .filter(|a| !hardware || !a.software)
        .map(|a| a.index)
        .collect();
    let mut note = None;
    if let Some(list) = cuda_visible_devices
        .map(str::trim)
        .filter(|s| !s.is_empty())
    {
        let tokens: Vec<&str> = list.split(',').map(str::trim).collect();
        let ordinals: Option<Vec<usize>> = tokens.iter().map(|t| t.parse().ok()).collect();
        match ordinals {
            Some(ordinals) => {
                let mut nvidia: Vec<&AdapterSummary> = idx
                    .iter()
                    .map(|&i| &all[i])
                    .filter(|a| a.vendor == 0x10de)
                    .collect();
                if !nvidia.is_empty() {
                    nvidia.sort_by(|a, b| a.pci_bus_id.cmp(&b.pci_bus_id));
                    let chosen: Vec<usize> = ordinals
                        .iter()
                        .filter_map(|&o| nvidia.get(o).map(|a| a.index))
                        .collect();
                    idx.retain(|i| all[*i].vendor != 0x10de);
                    let mut kept = chosen;
                    kept.extend(idx);
                    idx = kept;
                }
            }
            None => {
                note = Some(format!(
                    "CUDA_VISIBLE_DEVICES={list:?} names GPUs by UUID or MIG instance, which a Vulkan adapter does not report; every adapter stays a candidate"
                ));
            }
        }
    }
    (idx, note)
}

/// The adapter for `slot` (node-local rank, or thread replica index): `gpu:N` (`index`
/// `Some(N)`) names adapter N of the full listing; `gpu` takes candidate `slot` modulo the
/// candidates' count.
///
/// Errors: no adapter at all ([`GpuError::NoAdapter`]), or `gpu:N` beyond the listing
/// ([`GpuError::NoSuchAdapter`]).
pub fn select_adapter(
    all: &[AdapterSummary],
    index: Option<usize>,
    slot: usize,
    cuda_visible_devices: Option<&str>,
) -> Result<Selected> {
    if all.is_empty() {
        return Err(GpuError::NoAdapter {
            backends: format!("{:?}", backends()),
        });
    }
    if let Some(i) = index {
        let a = all.get(i).ok_or_else(|| GpuError::NoSuchAdapter {
            index: i,
            count: all.len(),
            names: all
                .iter()
                .map(|a| format!("[{}] {}", a.index, a.name))
                .collect::<Vec<_>>()
                .join(", "),
        })?;
        return Ok(Selected {
            adapter: a.clone(),
            shared: false,
            note: format!("gpu:{i} as configured"),
        });
    }
    let (cands, cuda_note) = candidates(all, cuda_visible_devices);
    let cands = if cands.is_empty() {
        (0..all.len()).collect()
    } else {
        cands
    };
    let pick = cands[slot % cands.len()];
    let mut note = format!(
        "slot {slot} (node-local rank or replica) of {} candidate adapter(s)",
        cands.len()
    );
    if let Some(n) = cuda_note {
        note.push_str("; ");
        note.push_str(&n);
    }
    Ok(Selected {
        adapter: all[pick].clone(),
        shared: slot >= cands.len(),
        note,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn adapter(index: usize, name: &str, software: bool, vendor: u32, bus: &str) -> AdapterSummary {
        AdapterSummary {
            index,
            name: name.into(),
            backend: "Vulkan".into(),
            device_type: if software { "Cpu" } else { "DiscreteGpu" }.into(),
            driver: String::new(),
            pci_bus_id: bus.into(),
            vendor,
            max_storage_binding: 1 << 27,
            max_buffer: 1 << 31,
            max_storage_buffers_per_stage: 32,
            max_workgroups_per_dimension: 65535,
            shader_f64: true,
            shader_int64: true,
            shader_f16: true,
            software,
        }
    }

    /// Hardware adapters hide the software one; slots wrap and are reported as shared.
    #[test]
    fn slots_bind_hardware_adapters_and_wrap() {
        let all = vec![
            adapter(0, "A", false, 0x10de, "0000:41:00.0"),
            adapter(1, "B", false, 0x10de, "0000:01:00.0"),
            adapter(2, "llvmpipe", true, 0x10005, ""),
        ];
        let s0 = select_adapter(&all, None, 0, None).unwrap();
        let s1 = select_adapter(&all, None, 1, None).unwrap();
        let s2 = select_adapter(&all, None, 2, None).unwrap();
        assert_eq!((s0.adapter.index, s0.shared), (0, false));
        assert_eq!((s1.adapter.index, s1.shared), (1, false));
        assert_eq!((s2.adapter.index, s2.shared), (0, true));
        // gpu:2 names the software adapter explicitly.
        assert_eq!(
            select_adapter(&all, Some(2), 0, None)
                .unwrap()
                .adapter
                .index,
            2
        );
        assert!(matches!(
            select_adapter(&all, Some(3), 0, None),
            Err(GpuError::NoSuchAdapter {
                index: 3,
                count: 3,
                ..
            })
        ));
        // CUDA ordinal 0 is the NVIDIA GPU with the lowest PCI bus id (B).
        let s = select_adapter(&all, None, 0, Some("0")).unwrap();
        assert_eq!(s.adapter.name, "B");
        let s = select_adapter(&all, None, 0, Some("1")).unwrap();
        assert_eq!(s.adapter.name, "A");
        let s = select_adapter(&all, None, 0, Some("GPU-8a7c")).unwrap();
        assert!(s.note.contains("UUID"), "{}", s.note);
    }

    /// Software adapters are candidates when no hardware one exists; no adapter is an error
    /// that says what to install.
    #[test]
    fn software_only_and_none() {
        let all = vec![adapter(0, "llvmpipe", true, 0x10005, "")];
        let s = select_adapter(&all, None, 1, None).unwrap();
        assert_eq!((s.adapter.index, s.shared), (0, true));
        let e = select_adapter(&[], None, 0, None).unwrap_err().to_string();
        assert!(
            e.contains("no GPU adapter") && e.contains("libvulkan1"),
            "{e}"
        );
    }

    /// A software adapter is marked in the listing and warned about; a hardware one is not.
    #[test]
    fn software_adapters_are_marked_and_warned_about() {
        let soft = adapter(0, "llvmpipe", true, 0x10005, "");
        let hard = adapter(1, "NVIDIA H200", false, 0x10de, "0000:01:00.0");
        assert!(soft
            .to_string()
            .ends_with("software: emulates a GPU on CPU cores"));
        assert!(!hard.to_string().contains("software"));
        let w = soft.software_warning("run.device: \"cpu\"").unwrap();
        assert!(
            w.contains("[0] llvmpipe") && w.contains("emulates a GPU on CPU cores"),
            "{w}"
        );
        assert!(w.ends_with("run.device: \"cpu\" is faster"), "{w}");
        assert_eq!(hard.software_warning("run.device: \"cpu\""), None);
    }
}
