//! Where the network computes: Dingo's `local.device` (`cpu`, `gpu`, `cuda`) turned into a
//! burn device for one replica ([`Placement::for_slot`]).
//!
//! - `cpu`: burn's ndarray backend ([`crate::CpuAutodiff`]).
//! - `gpu`: burn's wgpu backend ([`WgpuAutodiff`]) on any Vulkan, Metal or DX12 adapter
//!   (Mesa's software driver lavapipe included). The adapter is chosen by lockstep-gpu, as for
//!   the spiking network's GPU engine ([`lockstep_gpu::select_adapter`]: the replica's slot,
//!   its thread index or node-local rank, among the adapters `CUDA_VISIBLE_DEVICES` leaves),
//!   and burn runs on the device and queue lockstep-gpu opened
//!   ([`lockstep_gpu::GpuContext::wgpu_handles`], `burn::backend::wgpu::init_device`): one
//!   device per adapter and process, whoever computes on it.
//! - `cuda`: burn's CUDA backend (feature `cuda`). burn loads libcuda and NVRTC at run time
//!   and panics in a background thread when they are missing, so [`check_cuda`] opens both
//!   libraries and counts the devices first, and a missing piece is an error that names the
//!   fix.
//!
//! Two replicas on one GPU are allowed (they share its device); [`Placement::shared`] says so,
//! and the callers log it.

use crate::error::NpeError;
use burn::backend::wgpu::{init_device, RuntimeOptions, WgpuDevice, WgpuSetup};
use std::collections::HashMap;
use std::sync::{Mutex, OnceLock};

/// burn's wgpu backend (f32), on an adapter lockstep-gpu opened.
pub type WgpuBackend = burn::backend::Wgpu;
/// burn's wgpu backend with reverse-mode autodiff (what `local.device: gpu` trains on).
pub type WgpuAutodiff = burn::backend::Autodiff<WgpuBackend>;

/// The device kinds of `local.device` (Dingo's keys).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum DeviceKind {
    /// CPU cores (burn's ndarray backend), the default.
    #[default]
    Cpu,
    /// A GPU through wgpu (Vulkan, Metal, DX12; lavapipe without a GPU).
    Gpu,
    /// An NVIDIA GPU through CUDA (feature `cuda`).
    Cuda,
}

impl DeviceKind {
    /// The accepted spellings, for messages.
    pub const CHOICES: &'static str = "cpu, gpu (any Vulkan/Metal/DX12 GPU through wgpu) or cuda (NVIDIA, a build with the cuda feature)";
}

impl std::str::FromStr for DeviceKind {
    type Err = NpeError;

    /// `cpu`, `gpu` or `cuda`.
    fn from_str(s: &str) -> Result<Self, NpeError> {
        match s {
            "cpu" => Ok(DeviceKind::Cpu),
            "gpu" => Ok(DeviceKind::Gpu),
            "cuda" => Ok(DeviceKind::Cuda),
            other => Err(NpeError::Invalid(format!(
                "{other:?} is not a device; use {}",
                DeviceKind::CHOICES
            ))),
        }
    }
}

impl std::fmt::Display for DeviceKind {
    /// The settings' spelling.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            DeviceKind::Cpu => "cpu",
            DeviceKind::Gpu => "gpu",
            DeviceKind::Cuda => "cuda",
        })
    }
}

/// The burn device one replica computes on.
#[derive(Debug, Clone)]
pub enum Placement {
    /// burn's ndarray backend.
    Cpu,
    /// burn's wgpu backend on a device lockstep-gpu opened.
    Gpu {
        /// burn's handle of the device.
        device: WgpuDevice,
        /// What it is (`adapter name (Vulkan, Cpu), slot ...`), for logs.
        description: String,
        /// Whether another replica of this node shares the adapter.
        shared: bool,
        /// Whether the adapter runs float16 in shaders (wgpu's `SHADER_F16`), which mixed
        /// precision needs.
        f16: bool,
        /// The warning for a software adapter (lavapipe and the like, far slower than the
        /// CPU backend); `None` on hardware.
        software_warning: Option<String>,
    },
    /// burn's CUDA backend on CUDA device `index` (feature `cuda`).
    Cuda {
        /// The CUDA ordinal (among the devices `CUDA_VISIBLE_DEVICES` leaves).
        index: usize,
        /// How many CUDA devices this process sees.
        count: usize,
    },
}

impl Placement {
    /// The device of `kind` for the replica in `slot` (its thread index, or under MPI its
    /// node-local rank): the slot's adapter (`gpu`) or CUDA device (`cuda`), round-robin
    /// when the node has fewer GPUs than replicas.
    ///
    /// Errors: no adapter (`gpu`), a build without the `cuda` feature, missing libcuda or
    /// NVRTC, no CUDA device (`cuda`); each message names the fix.
    pub fn for_slot(kind: DeviceKind, slot: usize) -> Result<Placement, NpeError> {
        match kind {
            DeviceKind::Cpu => Ok(Placement::Cpu),
            DeviceKind::Gpu => {
                let all = lockstep_gpu::process_adapters();
                let cuda = std::env::var("CUDA_VISIBLE_DEVICES").ok();
                let sel = lockstep_gpu::select_adapter(&all, None, slot, cuda.as_deref())
                    .map_err(gpu_error)?;
                let device = wgpu_device(sel.adapter.index)?;
                Ok(Placement::Gpu {
                    device,
                    description: format!(
                        "GPU adapter [{}] {} ({}, {}; {})",
                        sel.adapter.index,
                        sel.adapter.name,
                        sel.adapter.backend,
                        sel.adapter.device_type,
                        sel.note
                    ),
                    shared: sel.shared,
                    f16: sel.adapter.shader_f16,
                    software_warning: sel.adapter.software_warning("local.device: cpu"),
                })
            }
            DeviceKind::Cuda => {
                let count = check_cuda()?;
                Ok(Placement::Cuda {
                    index: slot % count,
                    count,
                })
            }
        }
    }

    /// The device kind.
    pub fn kind(&self) -> DeviceKind {
        match self {
            Placement::Cpu => DeviceKind::Cpu,
            Placement::Gpu { .. } => DeviceKind::Gpu,
            Placement::Cuda { .. } => DeviceKind::Cuda,
        }
    }

    /// Checks that this device computes in float16, for mixed precision
    /// (`automatic_mixed_precision`): a CUDA device always does; a wgpu adapter when it has
    /// `SHADER_F16`; the CPU backend never.
    ///
    /// Errors: the reason and the fix, as the settings key's message.
    pub fn half_precision(&self) -> Result<(), String> {
        match self {
            Placement::Cpu => Err("is true, but local.device is cpu, and lockstep computes in float32 on the CPU; set local.device to gpu or cuda, or set automatic_mixed_precision to false".to_string()),
            Placement::Gpu { f16: false, description, .. } => Err(format!(
                "is true, but the {description} has no float16 in shaders (wgpu's SHADER_F16); set automatic_mixed_precision to false, or choose an adapter with float16 (CUDA_VISIBLE_DEVICES, `lockstep info` lists the adapters) or local.device: cuda on NVIDIA"
            )),
            Placement::Gpu { .. } | Placement::Cuda { .. } => Ok(()),
        }
    }

    /// The one-line warning a job prints (chief only) when it computes on a software GPU
    /// adapter; `None` on the CPU, on CUDA and on hardware adapters.
    pub fn software_warning(&self) -> Option<&str> {
        match self {
            Placement::Gpu {
                software_warning, ..
            } => software_warning.as_deref(),
            _ => None,
        }
    }

    /// Whether another replica on this node computes on the same GPU.
    pub fn shared(&self, slot: usize) -> bool {
        match self {
            Placement::Cpu => false,
            Placement::Gpu { shared, .. } => *shared,
            Placement::Cuda { count, .. } => slot >= *count,
        }
    }

    /// The device memory burn's allocator holds on this placement's GPU: (bytes in use,
    /// bytes reserved); `None` on the CPU.
    pub fn memory(&self) -> Option<(u64, u64)> {
        use cubecl::Runtime;
        let usage = match self {
            Placement::Cpu => return None,
            Placement::Gpu { device, .. } => {
                cubecl::wgpu::WgpuRuntime::client(device).memory_usage()
            }
            #[cfg(feature = "cuda")]
            Placement::Cuda { index, .. } => {
                let device = burn::backend::cuda::CudaDevice::new(*index);
                cubecl::cuda::CudaRuntime::client(&device).memory_usage()
            }
            #[cfg(not(feature = "cuda"))]
            Placement::Cuda { .. } => return None,
        };
        usage.ok().map(|u| (u.bytes_in_use, u.bytes_reserved))
    }

    /// What the replica computes on, for logs (`cpu`, the adapter, `CUDA device i of n`).
    pub fn describe(&self) -> String {
        match self {
            Placement::Cpu => "cpu".to_string(),
            Placement::Gpu { description, .. } => description.clone(),
            Placement::Cuda { index, count } => format!("CUDA device {index} of {count}"),
        }
    }
}

/// A lockstep-gpu error as a settings error of `local.device` (its messages speak of
/// `run.device`, the spiking network's key).
fn gpu_error(e: lockstep_gpu::GpuError) -> NpeError {
    let text = e.to_string().replace("run.device", "local.device");
    NpeError::Invalid(format!("local.device: gpu: {text}"))
}

/// burn's handle of adapter `index`'s device, created once per process on the device and
/// queue of [`lockstep_gpu::GpuContext::open`] (burn's `init_device` must run once per
/// device).
///
/// Errors: the adapter cannot be opened.
pub fn wgpu_device(index: usize) -> Result<WgpuDevice, NpeError> {
    let mut devices = wgpu_devices();
    if let Some(d) = devices.get(&index) {
        return Ok(d.clone());
    }
    let ctx = lockstep_gpu::GpuContext::open(index).map_err(gpu_error)?;
    let (instance, adapter) = ctx.wgpu_handles();
    let backend = adapter.get_info().backend;
    let setup = WgpuSetup {
        instance,
        adapter,
        device: ctx.device.clone(),
        queue: ctx.queue.clone(),
        backend,
    };
    let memory_config = match *MEMORY_POOLS.lock().unwrap_or_else(|p| p.into_inner()) {
        MemoryPools::SubSlices => cubecl::wgpu::MemoryConfiguration::SubSlices,
        MemoryPools::ExclusivePages => cubecl::wgpu::MemoryConfiguration::ExclusivePages,
    };
    let options = RuntimeOptions {
        memory_config,
        ..RuntimeOptions::default()
    };
    let device = init_device(setup, options);
    devices.insert(index, device.clone());
    Ok(device)
}

/// The wgpu devices this process created, by adapter index (locked).
fn wgpu_devices() -> std::sync::MutexGuard<'static, HashMap<usize, WgpuDevice>> {
    static DEVICES: OnceLock<Mutex<HashMap<usize, WgpuDevice>>> = OnceLock::new();
    DEVICES
        .get_or_init(Default::default)
        .lock()
        .unwrap_or_else(|p| p.into_inner())
}

/// How CubeCL's memory management places the tensors of burn's wgpu backend in device
/// memory ([`set_memory_pools`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum MemoryPools {
    /// CubeCL's default: pools of large pages, each tensor a slice of one (few allocations
    /// from the driver, a search for a free slice per tensor).
    #[default]
    SubSlices,
    /// One page per tensor, pages of a size class reused (no slicing; on lavapipe it
    /// reserved less for a training step: 40-56 against 64 MiB).
    ExclusivePages,
}

impl std::str::FromStr for MemoryPools {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "sub-slices" => Ok(MemoryPools::SubSlices),
            "exclusive-pages" => Ok(MemoryPools::ExclusivePages),
            other => Err(format!(
                "unknown memory pools '{other}': sub-slices (the default) or exclusive-pages"
            )),
        }
    }
}

static MEMORY_POOLS: Mutex<MemoryPools> = Mutex::new(MemoryPools::SubSlices);

/// Sets the memory pools of the wgpu devices this process creates from now on (for
/// `lockstep bench npe --memory-pools`, which measures both on one training step). CUDA
/// devices keep CubeCL's default.
///
/// Errors: a wgpu device exists already (its pools are fixed).
pub fn set_memory_pools(pools: MemoryPools) -> Result<(), NpeError> {
    // Under the devices' lock, so that no device is created meanwhile.
    let devices = wgpu_devices();
    if !devices.is_empty() {
        return Err(NpeError::Invalid(
            "the memory pools must be set before the first GPU device is created".to_string(),
        ));
    }
    *MEMORY_POOLS.lock().unwrap_or_else(|p| p.into_inner()) = pools;
    Ok(())
}

/// Makes burn's GPU backends (CubeCL) write one line per kernel launch to `path`
/// (`Executing KERNEL | ... | RUNTIME`, flushed line by line from CubeCL's logging task),
/// for counting launches per training step (`lockstep bench npe --device gpu|cuda`). No
/// timing is added: the launches stay asynchronous.
///
/// This replaces CubeCL's configuration for the process (including any `cubecl.toml` or
/// `burn.toml` in the working directory's ancestry), so it must be called before the first
/// GPU device is created.
///
/// Errors: CubeCL's configuration was already read (a device exists).
pub fn log_kernel_launches(path: &std::path::Path) -> Result<(), NpeError> {
    use cubecl::config::profiling::ProfilingLogLevel;
    use cubecl::config::{CubeClRuntimeConfig, RuntimeConfig};
    let mut config = CubeClRuntimeConfig::default();
    config.profiling.logger.level = ProfilingLogLevel::Minimal;
    config.profiling.logger.file = Some(path.to_path_buf());
    config.profiling.logger.append = false;
    let mut slot = CubeClRuntimeConfig::storage().lock();
    if slot.is_some() {
        return Err(NpeError::Invalid(
            "the kernel launch log must be set up before the first GPU device is created"
                .to_string(),
        ));
    }
    *slot = Some(std::sync::Arc::new(config));
    Ok(())
}

/// Read-backs from a device to the host made by this crate on the calling thread since it
/// started: every tensor read (`into_data`, burn's `Transaction`) in lockstep-npe's passes
/// goes through [`crate::params::to_vec`], [`crate::params::read_together`], the
/// host-memory gradient copy or SyncBatchNorm's statistics, and each counts one. On a GPU
/// backend each is a host synchronisation: the host waits for the queued kernels and the
/// copy. What is not counted: reads inside burn or CubeCL themselves (burn's matmul
/// autotuning times kernels on the first pass of each shape; no other operation the passes
/// use reads back) and reads by other crates. On the CPU backends a read is a copy, not a
/// wait. Per thread, so each replica thread (and each test) sees its own passes' reads.
pub fn host_reads() -> u64 {
    HOST_READS.with(|c| c.get())
}

thread_local! {
    static HOST_READS: std::cell::Cell<u64> = const { std::cell::Cell::new(0) };
}

/// Counts one read-back for [`host_reads`].
pub(crate) fn count_host_read() {
    HOST_READS.with(|c| c.set(c.get() + 1));
}

/// How many of this thread's [`host_reads`] so far brought a training pass's gradient back
/// (on a device backend: the pass's gradients read with log q when the engine's optimizer
/// runs on the host, or the packed gradient the engine reduces over replicas when the
/// training state is on the device, [`crate::resident`]); the rest are losses, flags,
/// statistics and state. Per thread, as [`host_reads`].
pub fn gradient_reads() -> u64 {
    GRADIENT_READS.with(|c| c.get())
}

thread_local! {
    static GRADIENT_READS: std::cell::Cell<u64> = const { std::cell::Cell::new(0) };
}

/// Marks the read-back being made as a gradient's for [`gradient_reads`].
pub(crate) fn count_gradient_read() {
    GRADIENT_READS.with(|c| c.set(c.get() + 1));
}

/// The fix for a CUDA run that cannot start, appended to each CUDA error.
const CUDA_FIX: &str = "install the NVIDIA driver (libcuda.so.1) and NVRTC (the CUDA toolkit, or `pip install nvidia-cuda-nvrtc` with its lib folder on LD_LIBRARY_PATH), or set local.device to gpu (wgpu) or cpu";

/// Checks that CUDA can start before burn touches it: the binary has the `cuda` feature,
/// libcuda and NVRTC load, and the driver sees at least one device. Returns the device
/// count.
///
/// Errors: each missing piece, with what to install (or the build command).
pub fn check_cuda() -> Result<usize, NpeError> {
    if !cfg!(feature = "cuda") {
        return Err(NpeError::Invalid(
            "local.device: cuda: this lockstep was built without CUDA; rebuild it with `cargo build --release -p lockstep-cli --features cuda` (no CUDA toolkit needed to build), or set local.device to gpu (wgpu) or cpu".to_string(),
        ));
    }
    probe_cuda(&["libcuda.so.1", "libcuda.so"], &NVRTC_NAMES)
}

/// The NVRTC sonames burn's CUDA backend may load, newest first.
const NVRTC_NAMES: [&str; 3] = ["libnvrtc.so.13", "libnvrtc.so.12", "libnvrtc.so"];

/// The library part of [`check_cuda`]: opens the first loadable of `libcuda` (names or
/// paths, as `dlopen` takes them) and of `nvrtc`, initialises the driver and counts its
/// devices.
///
/// Errors: libcuda or NVRTC not found, `cuInit` or `cuDeviceGetCount` failing (with the
/// CUresult's name: `CUDA_ERROR_STUB_LIBRARY` is the toolkit's link stub found before the
/// driver, `CUDA_ERROR_NO_DEVICE` a machine without a usable GPU), or no device.
fn probe_cuda(libcuda: &[&str], nvrtc: &[&str]) -> Result<usize, NpeError> {
    let cuda = dlopen_any(libcuda).ok_or_else(|| {
        NpeError::Invalid(format!(
            "local.device: cuda: libcuda (the NVIDIA driver's library) is not found; {CUDA_FIX}"
        ))
    })?;
    if dlopen_any(nvrtc).is_none() {
        return Err(NpeError::Invalid(format!(
            "local.device: cuda: NVRTC (libnvrtc.so.13, the CUDA run-time compiler burn compiles its kernels with) is not found; {CUDA_FIX}"
        )));
    }
    let count = cuda_device_count(cuda).map_err(|e| {
        NpeError::Invalid(format!(
            "local.device: cuda: the CUDA driver {e}; {CUDA_FIX}"
        ))
    })?;
    if count == 0 {
        return Err(NpeError::Invalid(format!(
            "local.device: cuda: the CUDA driver sees no device (CUDA_VISIBLE_DEVICES={}); {CUDA_FIX}",
            std::env::var("CUDA_VISIBLE_DEVICES").unwrap_or_else(|_| "unset".into())
        )));
    }
    Ok(count)
}

/// The name of a CUDA driver API result code (`CUresult`, from CUDA's `cuda.h`) for the
/// codes a starting job meets, else `CUresult N`.
fn cu_result(code: i32) -> String {
    let name = match code {
        1 => "CUDA_ERROR_INVALID_VALUE",
        2 => "CUDA_ERROR_OUT_OF_MEMORY",
        3 => "CUDA_ERROR_NOT_INITIALIZED",
        34 => "CUDA_ERROR_STUB_LIBRARY (the CUDA toolkit's link stub libcuda was loaded instead of the driver's: take its stubs folder off LD_LIBRARY_PATH)",
        35 => "CUDA_ERROR_INSUFFICIENT_DRIVER (the driver is older than the CUDA version burn was built for)",
        46 => "CUDA_ERROR_DEVICES_UNAVAILABLE (the GPUs are busy or in exclusive-process mode)",
        100 => "CUDA_ERROR_NO_DEVICE",
        101 => "CUDA_ERROR_INVALID_DEVICE",
        304 => "CUDA_ERROR_OPERATING_SYSTEM",
        804 => "CUDA_ERROR_COMPAT_NOT_SUPPORTED_ON_DEVICE",
        999 => "CUDA_ERROR_UNKNOWN",
        _ => return format!("CUresult {code}"),
    };
    format!("{name} (CUresult {code})")
}

/// The first of `names` that `dlopen` loads (the handle stays open for the process).
fn dlopen_any(names: &[&str]) -> Option<*mut libc::c_void> {
    names.iter().find_map(|name| {
        let c = std::ffi::CString::new(*name).ok()?;
        // SAFETY: `c` is a valid NUL-terminated string; dlopen has no other precondition and
        // returns null on failure.
        let h = unsafe { libc::dlopen(c.as_ptr(), libc::RTLD_NOW | libc::RTLD_GLOBAL) };
        (!h.is_null()).then_some(h)
    })
}

/// `cuInit(0)` and `cuDeviceGetCount` from the open libcuda `lib`.
fn cuda_device_count(lib: *mut libc::c_void) -> Result<usize, String> {
    type CuInit = unsafe extern "C" fn(u32) -> i32;
    type CuCount = unsafe extern "C" fn(*mut i32) -> i32;
    let sym = |name: &str| {
        let c = std::ffi::CString::new(name).expect("no NUL in a symbol name");
        // SAFETY: `lib` is a handle dlopen returned and `c` a valid C string.
        let p = unsafe { libc::dlsym(lib, c.as_ptr()) };
        (!p.is_null())
            .then_some(p)
            .ok_or_else(|| format!("library lacks {name}"))
    };
    let (init, count) = (sym("cuInit")?, sym("cuDeviceGetCount")?);
    // SAFETY: these symbols of libcuda have these C signatures (CUDA driver API:
    // `CUresult cuInit(unsigned int)`, `CUresult cuDeviceGetCount(int*)`).
    let (init, count) = unsafe {
        (
            std::mem::transmute::<*mut libc::c_void, CuInit>(init),
            std::mem::transmute::<*mut libc::c_void, CuCount>(count),
        )
    };
    // SAFETY: cuInit takes flags 0; it is safe to call more than once.
    let r = unsafe { init(0) };
    if r != 0 {
        return Err(format!("fails to initialise (cuInit: {})", cu_result(r)));
    }
    let mut n = 0i32;
    // SAFETY: `n` is a valid, writable int.
    let r = unsafe { count(&mut n) };
    if r != 0 {
        return Err(format!(
            "cannot count devices (cuDeviceGetCount: {})",
            cu_result(r)
        ));
    }
    Ok(n.max(0) as usize)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn device_kinds_parse_and_print() {
        for (s, k) in [
            ("cpu", DeviceKind::Cpu),
            ("gpu", DeviceKind::Gpu),
            ("cuda", DeviceKind::Cuda),
        ] {
            assert_eq!(s.parse::<DeviceKind>().unwrap(), k);
            assert_eq!(k.to_string(), s);
        }
        for bad in ["CUDA", "gpu:0", "", "mps"] {
            let e = bad.parse::<DeviceKind>().unwrap_err().to_string();
            assert!(e.contains("cpu, gpu") && e.contains("cuda"), "{e}");
        }
    }

    /// Mixed precision needs float16: refused on the CPU and on an adapter without
    /// `SHADER_F16`, each naming the fix; accepted with it and on CUDA.
    #[test]
    fn half_precision_needs_a_device_with_float16() {
        let gpu = |f16| Placement::Gpu {
            device: WgpuDevice::DefaultDevice,
            description: "GPU adapter [0] Old GPU (Vulkan, DiscreteGpu; slot 0)".to_string(),
            shared: false,
            f16,
            software_warning: None,
        };
        let e = gpu(false).half_precision().unwrap_err();
        assert!(
            e.contains("Old GPU")
                && e.contains("SHADER_F16")
                && e.contains("automatic_mixed_precision to false"),
            "{e}"
        );
        let e = Placement::Cpu.half_precision().unwrap_err();
        assert!(
            e.contains("local.device is cpu") && e.contains("gpu or cuda"),
            "{e}"
        );
        gpu(true).half_precision().unwrap();
        Placement::Cuda { index: 0, count: 1 }
            .half_precision()
            .unwrap();
    }

    /// Builds a stand-in shared library from C source `c` into `dir/name` with the machine's
    /// C compiler (`cc`, which the -sys crates of the build need anyway).
    fn stub_library(dir: &std::path::Path, name: &str, c: &str) -> String {
        let src = dir.join(format!("{name}.c"));
        std::fs::write(&src, c).unwrap();
        let out = dir.join(name);
        let status = std::process::Command::new("cc")
            .args(["-shared", "-fPIC", "-o"])
            .arg(&out)
            .arg(&src)
            .status()
            .expect("the C compiler `cc` runs (the test builds stand-in CUDA libraries with it)");
        assert!(status.success(), "cc failed on {}", src.display());
        out.to_str().unwrap().to_string()
    }

    /// A stand-in libcuda whose `cuInit` returns `init` and which reports `count` devices.
    fn stub_libcuda(dir: &std::path::Path, name: &str, init: i32, count: i32) -> String {
        stub_library(
            dir,
            name,
            &format!(
                "int cuInit(unsigned int f) {{ (void)f; return {init}; }}\n\
                 int cuDeviceGetCount(int *n) {{ *n = {count}; return 0; }}\n"
            ),
        )
    }

    /// Each way CUDA can be missing stops with its own message and the fix, before burn
    /// touches the driver: no libcuda, libcuda without NVRTC, the toolkit's link stub found
    /// before the driver (cuInit's CUDA_ERROR_STUB_LIBRARY), a driver that sees no device;
    /// with all of them present the devices are counted. Stand-in libraries built with `cc`
    /// play the driver and NVRTC.
    #[test]
    fn missing_cuda_pieces_each_name_the_fix() {
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path();
        let nowhere = d.join("no/libcuda.so.1");
        let nowhere = nowhere.to_str().unwrap();
        let no_nvrtc = d.join("no/libnvrtc.so.13");
        let no_nvrtc = no_nvrtc.to_str().unwrap();
        let nvrtc = stub_library(
            d,
            "libnvrtc.so.13",
            "int nvrtcVersion(int *a, int *b) { *a = 13; *b = 0; return 0; }\n",
        );
        let two = stub_libcuda(d, "libcuda_two.so", 0, 2);
        let stub = stub_libcuda(d, "libcuda_stub.so", 34, 0);
        let none = stub_libcuda(d, "libcuda_none.so", 0, 0);
        let fix = |e: &str| {
            e.contains("local.device: cuda")
                && e.contains("LD_LIBRARY_PATH")
                && e.contains("set local.device to gpu")
        };

        let e = probe_cuda(&[nowhere], &[&nvrtc]).unwrap_err().to_string();
        assert!(
            e.contains("libcuda (the NVIDIA driver's library) is not found") && fix(&e),
            "{e}"
        );
        let e = probe_cuda(&[&two], &[no_nvrtc]).unwrap_err().to_string();
        assert!(
            e.contains("NVRTC (libnvrtc.so.13") && e.contains("nvidia-cuda-nvrtc") && fix(&e),
            "{e}"
        );
        let e = probe_cuda(&[&stub], &[&nvrtc]).unwrap_err().to_string();
        assert!(
            e.contains("CUDA_ERROR_STUB_LIBRARY") && e.contains("stubs folder") && fix(&e),
            "{e}"
        );
        let e = probe_cuda(&[&none], &[&nvrtc]).unwrap_err().to_string();
        assert!(
            e.contains("sees no device") && e.contains("CUDA_VISIBLE_DEVICES") && fix(&e),
            "{e}"
        );
        // The first loadable name wins; all present: the driver's device count.
        assert_eq!(
            probe_cuda(&[nowhere, &two], &[no_nvrtc, &nvrtc]).unwrap(),
            2
        );
        assert_eq!(cu_result(100), "CUDA_ERROR_NO_DEVICE (CUresult 100)");
        assert_eq!(cu_result(7), "CUresult 7");
    }

    /// Without the `cuda` feature, `cuda` is refused naming the build command.
    #[cfg(not(feature = "cuda"))]
    #[test]
    fn cuda_without_the_feature_names_the_build() {
        let e = check_cuda().unwrap_err().to_string();
        assert!(
            e.contains("--features cuda") && e.contains("local.device"),
            "{e}"
        );
    }
}
