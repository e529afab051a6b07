//! One open GPU ([`GpuContext`]): the wgpu device and queue of an adapter, shared by every
//! model of the process that computes on that adapter, with buffers checked against the
//! adapter's limits and blocking read-back.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use wgpu::util::DeviceExt;

use crate::adapter::{ordered_adapters, AdapterSummary};
use crate::error::{GpuError, Result, MAX_BINDING_VAR, TIMEOUT_VAR};

/// The shader features lockstep's engines use, requested wherever the adapter has them
/// (an engine that cannot run without one checks it with [`GpuContext::require`]; the
/// spiking network's kernels pick 32-bit types where the 64-bit ones are missing, the NPE's
/// mixed precision refuses an adapter without float16). Subgroups and float32
/// atomics are for burn's wgpu backend (the NPE, [`GpuContext::wgpu_handles`]): its kernel
/// compiler emits them whenever the adapter reports them, so the shared device must enable
/// them too.
const WANTED_FEATURES: wgpu::Features = wgpu::Features::SHADER_F64
    .union(wgpu::Features::SHADER_INT64)
    .union(wgpu::Features::SHADER_F16)
    .union(wgpu::Features::SUBGROUP)
    .union(wgpu::Features::SHADER_FLOAT32_ATOMIC);

/// The default wait limit on a hardware adapter: a whole forward or backward pass of full V1
/// takes well under a second on an H200, so a minute means the device stopped answering.
const DEFAULT_TIMEOUT_GPU: Duration = Duration::from_secs(60);
/// The default wait limit on a software adapter (lavapipe), where one pass of a large network
/// takes minutes.
const DEFAULT_TIMEOUT_CPU: Duration = Duration::from_secs(3600);

/// How often a context made the host wait for its device, since it was opened: the counts
/// that `lockstep bench` prints per step and tests assert (they transfer to any GPU, unlike
/// lavapipe's wall time).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct GpuCounters {
    /// Command buffers submitted (each [`GpuContext::submit_and_wait`] or read-back).
    pub submits: u64,
    /// Blocking waits of the host for the device (host synchronisations).
    pub host_syncs: u64,
    /// Bytes read back to the host.
    pub bytes_read: u64,
    /// Bytes uploaded with [`GpuContext::write`].
    pub bytes_written: u64,
}

impl std::ops::Sub for GpuCounters {
    type Output = GpuCounters;

    /// The counts between two snapshots (`later - earlier`).
    fn sub(self, o: GpuCounters) -> GpuCounters {
        GpuCounters {
            submits: self.submits - o.submits,
            host_syncs: self.host_syncs - o.host_syncs,
            bytes_read: self.bytes_read - o.bytes_read,
            bytes_written: self.bytes_written - o.bytes_written,
        }
    }
}

/// One range to read back by [`GpuContext::submit_and_read`]: `bytes` of `buffer` from byte
/// `offset` (both multiples of 4).
pub struct ReadRange<'a> {
    /// The buffer (needs `COPY_SRC`).
    pub buffer: &'a wgpu::Buffer,
    /// Byte offset.
    pub offset: u64,
    /// Bytes.
    pub bytes: u64,
}

/// An open adapter: its device and queue, limits, features and the errors the device
/// reported since the last [`GpuContext::check`].
pub struct GpuContext {
    /// The wgpu device.
    pub device: wgpu::Device,
    /// Its queue.
    pub queue: wgpu::Queue,
    /// The adapter it was opened on.
    pub adapter: AdapterSummary,
    /// The limits the device was opened with: the adapter's own (wgpu's defaults are lower).
    pub limits: wgpu::Limits,
    /// The features the device was opened with.
    pub features: wgpu::Features,
    errors: Arc<Mutex<Vec<String>>>,
    /// The wait limit in milliseconds ([`GpuContext::wait_timeout`]).
    timeout_ms: AtomicU64,
    counters: Mutex<GpuCounters>,
    /// The read-back buffer, kept and grown as needed (one per context).
    staging: Mutex<Option<wgpu::Buffer>>,
}

impl std::fmt::Debug for GpuContext {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "GpuContext({})", self.adapter.name)
    }
}

/// The process's wgpu instance and its adapters, in the listing's order.
fn adapters() -> &'static (wgpu::Instance, Vec<(wgpu::Adapter, AdapterSummary)>) {
    static ADAPTERS: OnceLock<(wgpu::Instance, Vec<(wgpu::Adapter, AdapterSummary)>)> =
        OnceLock::new();
    ADAPTERS.get_or_init(|| {
        let instance = crate::adapter::instance();
        let list = ordered_adapters(&instance);
        (instance, list)
    })
}

/// The adapters of this process's instance (the same list, in the same order, as
/// [`crate::list_adapters`]; enumerated once per process).
pub fn process_adapters() -> Vec<AdapterSummary> {
    adapters().1.iter().map(|(_, s)| s.clone()).collect()
}

impl GpuContext {
    /// The device of adapter `index` (in [`process_adapters`]' order), opened once per
    /// process and shared: every model and thread that computes on that adapter uses the
    /// same device and queue.
    ///
    /// Errors: [`GpuError::NoAdapter`] / [`GpuError::NoSuchAdapter`], or
    /// [`GpuError::RequestDevice`] when the driver refuses to open it.
    pub fn open(index: usize) -> Result<Arc<GpuContext>> {
        static OPEN: OnceLock<Mutex<HashMap<usize, Arc<GpuContext>>>> = OnceLock::new();
        let open = OPEN.get_or_init(Default::default);
        let mut open = open.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(c) = open.get(&index) {
            return Ok(c.clone());
        }
        let (_, list) = adapters();
        if list.is_empty() {
            return Err(GpuError::NoAdapter {
                backends: format!("{:?}", crate::adapter::backends()),
            });
        }
        let (adapter, summary) = list.get(index).ok_or_else(|| GpuError::NoSuchAdapter {
            index,
            count: list.len(),
            names: list
                .iter()
                .map(|(_, s)| format!("[{}] {}", s.index, s.name))
                .collect::<Vec<_>>()
                .join(", "),
        })?;
        let limits = adapter.limits();
        crate::adapter::hidden_features().map_err(|message| GpuError::RequestDevice {
            adapter: summary.name.clone(),
            message,
        })?;
        let features = crate::adapter::features(adapter) & WANTED_FEATURES;
        let timeout = timeout_from_env(summary)?;
        let max_binding = max_binding_from_env(summary)?;
        let (device, queue) =
            futures_lite::future::block_on(adapter.request_device(&wgpu::DeviceDescriptor {
                label: Some("lockstep"),
                required_features: features,
                required_limits: limits.clone(),
                ..Default::default()
            }))
            .map_err(|e| GpuError::RequestDevice {
                adapter: summary.name.clone(),
                message: e.to_string(),
            })?;
        // The kernels' view of the limits: a lower binding limit when asked for.
        let mut limits = limits;
        if let Some(b) = max_binding {
            limits.max_storage_buffer_binding_size = limits.max_storage_buffer_binding_size.min(b);
        }
        let errors: Arc<Mutex<Vec<String>>> = Arc::default();
        let sink = errors.clone();
        device.on_uncaptured_error(Arc::new(move |e: wgpu::Error| {
            sink.lock()
                .unwrap_or_else(|p| p.into_inner())
                .push(e.to_string());
        }));
        let ctx = Arc::new(GpuContext {
            device,
            queue,
            adapter: summary.clone(),
            limits,
            features,
            errors,
            timeout_ms: AtomicU64::new(timeout.as_millis() as u64),
            counters: Mutex::default(),
            staging: Mutex::default(),
        });
        open.insert(index, ctx.clone());
        Ok(ctx)
    }

    /// The process's wgpu instance and this device's adapter, for libraries that run on an
    /// existing device (burn's wgpu backend: `burn::backend::wgpu::init_device` with the
    /// device and queue above), so the process opens one device per adapter whoever
    /// computes on it.
    pub fn wgpu_handles(&self) -> (wgpu::Instance, wgpu::Adapter) {
        let (instance, list) = adapters();
        let adapter = list
            .iter()
            .find(|(_, s)| s.index == self.adapter.index)
            .map(|(a, _)| a.clone())
            .expect("an open context's adapter is in the process's list");
        (instance.clone(), adapter)
    }

    /// Errors unless the device has `feature` (named `name` in the message), which
    /// `needed_for` needs.
    pub fn require(
        &self,
        feature: wgpu::Features,
        name: &'static str,
        needed_for: &'static str,
    ) -> Result<()> {
        if self.features.contains(feature) {
            Ok(())
        } else {
            Err(GpuError::MissingFeature {
                adapter: self.adapter.name.clone(),
                feature: name,
                needed_for,
            })
        }
    }

    /// The compute pipeline of `entry` in `module` with `layout` (default compilation
    /// options, no pipeline cache), labelled with the entry point.
    pub fn compute_pipeline(
        &self,
        layout: &wgpu::PipelineLayout,
        module: &wgpu::ShaderModule,
        entry: &str,
    ) -> wgpu::ComputePipeline {
        self.device
            .create_compute_pipeline(&wgpu::ComputePipelineDescriptor {
                label: Some(entry),
                layout: Some(layout),
                module,
                entry_point: Some(entry),
                compilation_options: Default::default(),
                cache: None,
            })
    }

    /// The errors the device reported since the last call, as one [`GpuError::Device`].
    pub fn check(&self) -> Result<()> {
        let mut e = self.errors.lock().unwrap_or_else(|p| p.into_inner());
        if e.is_empty() {
            return Ok(());
        }
        let message = e.join("; ");
        e.clear();
        Err(GpuError::Device {
            adapter: self.adapter.name.clone(),
            message,
        })
    }

    /// Checks that a storage buffer of `bytes` named `name` fits this adapter: at most
    /// `max_buffer_size` and `max_storage_buffer_binding_size` (lavapipe: 128 MiB). `reduce`
    /// names the config keys that shrink it, for the message.
    ///
    /// Errors: [`GpuError::BufferTooLarge`].
    pub fn check_storage(&self, name: &str, bytes: u64, reduce: &str) -> Result<()> {
        let limit = self
            .limits
            .max_storage_buffer_binding_size
            .min(self.limits.max_buffer_size);
        if bytes > limit {
            return Err(GpuError::BufferTooLarge {
                buffer: name.to_string(),
                bytes,
                mib: bytes as f64 / (1u64 << 20) as f64,
                limit,
                what: if limit == self.limits.max_buffer_size {
                    "buffer"
                } else {
                    "storage binding"
                },
                adapter: self.adapter.name.clone(),
                reduce: reduce.to_string(),
            });
        }
        Ok(())
    }

    /// The largest storage buffer this adapter binds (bytes).
    pub fn max_storage(&self) -> u64 {
        self.limits
            .max_storage_buffer_binding_size
            .min(self.limits.max_buffer_size)
    }

    /// A zeroed storage buffer of `bytes` (at least 16, so that any element type binds), usable as copy source and target.
    ///
    /// Errors: [`GpuError::BufferTooLarge`] (see [`GpuContext::check_storage`]).
    pub fn storage(&self, name: &str, bytes: u64, reduce: &str) -> Result<wgpu::Buffer> {
        self.zeroed(name, bytes, reduce, false)
    }

    /// A zeroed storage buffer of `bytes` (at least 16, a multiple of 4), checked against
    /// one binding's limit or, `windowed`, against `max_buffer_size` only.
    fn zeroed(&self, name: &str, bytes: u64, reduce: &str, windowed: bool) -> Result<wgpu::Buffer> {
        let bytes = bytes.max(16).next_multiple_of(4);
        if windowed {
            self.check_buffer(name, bytes, reduce)?;
        } else {
            self.check_storage(name, bytes, reduce)?;
        }
        Ok(self.device.create_buffer(&wgpu::BufferDescriptor {
            label: Some(name),
            size: bytes,
            usage: wgpu::BufferUsages::STORAGE
                | wgpu::BufferUsages::COPY_SRC
                | wgpu::BufferUsages::COPY_DST,
            mapped_at_creation: false,
        }))
    }

    /// A storage buffer holding `data` (padded to at least 16 bytes and a multiple of 4),
    /// checked as [`GpuContext::zeroed`] checks.
    fn filled<T: bytemuck::Pod>(
        &self,
        name: &str,
        data: &[T],
        reduce: &str,
        windowed: bool,
    ) -> Result<wgpu::Buffer> {
        let mut bytes: Vec<u8> = bytemuck::cast_slice(data).to_vec();
        let len = bytes.len().max(16).next_multiple_of(4);
        bytes.resize(len, 0);
        if windowed {
            self.check_buffer(name, len as u64, reduce)?;
        } else {
            self.check_storage(name, len as u64, reduce)?;
        }
        Ok(self
            .device
            .create_buffer_init(&wgpu::util::BufferInitDescriptor {
                label: Some(name),
                contents: &bytes,
                usage: wgpu::BufferUsages::STORAGE
                    | wgpu::BufferUsages::COPY_SRC
                    | wgpu::BufferUsages::COPY_DST,
            }))
    }

    /// A zeroed storage buffer of `bytes` that the kernels bind as windows (each within
    /// [`GpuContext::max_storage`]): checked against `max_buffer_size` only.
    ///
    /// Errors: [`GpuError::BufferTooLarge`] over `max_buffer_size`.
    pub fn storage_windowed(&self, name: &str, bytes: u64, reduce: &str) -> Result<wgpu::Buffer> {
        self.zeroed(name, bytes, reduce, true)
    }

    /// [`GpuContext::storage_windowed`] holding `data` (padded to at least 16 bytes and a
    /// multiple of 4).
    ///
    /// Errors: [`GpuError::BufferTooLarge`] over `max_buffer_size`.
    pub fn storage_windowed_from<T: bytemuck::Pod>(
        &self,
        name: &str,
        data: &[T],
        reduce: &str,
    ) -> Result<wgpu::Buffer> {
        self.filled(name, data, reduce, true)
    }

    /// Errors ([`GpuError::BufferTooLarge`]) when a buffer of `bytes` exceeds
    /// `max_buffer_size`.
    fn check_buffer(&self, name: &str, bytes: u64, reduce: &str) -> Result<()> {
        let limit = self.limits.max_buffer_size;
        if bytes > limit {
            return Err(GpuError::BufferTooLarge {
                buffer: name.to_string(),
                bytes,
                mib: bytes as f64 / (1u64 << 20) as f64,
                limit,
                what: "buffer",
                adapter: self.adapter.name.clone(),
                reduce: reduce.to_string(),
            });
        }
        Ok(())
    }

    /// A storage buffer holding `data` (at least 16 bytes; padded to a multiple of 4).
    ///
    /// Errors: [`GpuError::BufferTooLarge`].
    pub fn storage_from<T: bytemuck::Pod>(
        &self,
        name: &str,
        data: &[T],
        reduce: &str,
    ) -> Result<wgpu::Buffer> {
        self.filled(name, data, reduce, false)
    }

    /// Writes `data` into `buffer` at byte `offset` (queued; takes effect before the next
    /// submission's commands).
    pub fn write<T: bytemuck::Pod>(&self, buffer: &wgpu::Buffer, offset: u64, data: &[T]) {
        if !data.is_empty() {
            let bytes: &[u8] = bytemuck::cast_slice(data);
            self.count(|c| c.bytes_written += bytes.len() as u64);
            self.queue.write_buffer(buffer, offset, bytes);
        }
    }

    /// How long the host waits for this device before it gives up with
    /// [`GpuError::Timeout`]: [`TIMEOUT_VAR`] if set, else 60 s on a hardware adapter and an
    /// hour on a software one (lavapipe).
    pub fn wait_timeout(&self) -> Duration {
        Duration::from_millis(self.timeout_ms.load(Ordering::Relaxed))
    }

    /// Sets the wait limit of this device for the whole process (every model that shares it).
    pub fn set_wait_timeout(&self, limit: Duration) {
        self.timeout_ms
            .store(limit.as_millis().max(1) as u64, Ordering::Relaxed);
    }

    /// The counts of submissions, host waits and bytes moved since the device was opened
    /// (take the difference of two snapshots for one step).
    pub fn counters(&self) -> GpuCounters {
        *self.counters.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn count(&self, f: impl FnOnce(&mut GpuCounters)) {
        f(&mut self.counters.lock().unwrap_or_else(|p| p.into_inner()));
    }

    /// Waits at most [`GpuContext::wait_timeout`] for submission `index` (and the callbacks
    /// it triggers, such as a buffer mapping).
    fn wait(&self, index: wgpu::SubmissionIndex, what: &str) -> Result<()> {
        let limit = self.wait_timeout();
        self.count(|c| c.host_syncs += 1);
        match self.device.poll(wgpu::PollType::Wait {
            submission_index: Some(index),
            timeout: Some(limit),
        }) {
            Ok(_) => Ok(()),
            Err(wgpu::PollError::Timeout) => Err(GpuError::Timeout {
                adapter: self.adapter.name.clone(),
                what: what.to_string(),
                seconds: limit.as_secs_f64(),
            }),
            Err(e) => Err(GpuError::Device {
                adapter: self.adapter.name.clone(),
                message: e.to_string(),
            }),
        }
    }

    /// Submits `commands`, waits for the device to finish them (at most
    /// [`GpuContext::wait_timeout`]) and reports any device error.
    ///
    /// Errors: [`GpuError::Device`], [`GpuError::Timeout`].
    pub fn submit_and_wait(&self, commands: wgpu::CommandBuffer) -> Result<()> {
        let index = self.queue.submit([commands]);
        self.count(|c| c.submits += 1);
        self.wait(index, "a submitted pass")?;
        self.check()
    }

    /// Submits `commands` without waiting: the device runs them before anything submitted
    /// later, and a device error they raise surfaces at the next wait or
    /// [`GpuContext::check`].
    pub fn submit(&self, commands: wgpu::CommandBuffer) {
        self.queue.submit([commands]);
        self.count(|c| c.submits += 1);
    }

    /// Reads `len` elements of type `T` from `buffer` at byte `offset` (one submission and
    /// one wait; see [`GpuContext::submit_and_read`]).
    ///
    /// Errors: [`GpuError::Device`], [`GpuError::Timeout`].
    pub fn read<T: bytemuck::Pod>(
        &self,
        buffer: &wgpu::Buffer,
        offset: u64,
        len: usize,
    ) -> Result<Vec<T>> {
        let bytes = (len * std::mem::size_of::<T>()) as u64;
        if bytes == 0 {
            return Ok(Vec::new());
        }
        let enc = self.device.create_command_encoder(&Default::default());
        let mut out = self.submit_and_read(
            enc,
            &[ReadRange {
                buffer,
                offset,
                bytes: bytes.next_multiple_of(4),
            }],
        )?;
        let raw = out.pop().expect("one range");
        Ok(bytemuck::pod_collect_to_vec::<u8, T>(
            &raw[..bytes as usize],
        ))
    }

    /// Submits `enc` with copies of `ranges` appended into this context's read-back buffer
    /// (reused between calls, grown when too small), waits once (at most
    /// [`GpuContext::wait_timeout`]) and returns each range's bytes: a pass and the numbers
    /// the host needs from it in one host synchronisation.
    ///
    /// Errors: [`GpuError::Device`], [`GpuError::Timeout`].
    pub fn submit_and_read(
        &self,
        mut enc: wgpu::CommandEncoder,
        ranges: &[ReadRange<'_>],
    ) -> Result<Vec<Vec<u8>>> {
        let total: u64 = ranges.iter().map(|r| r.bytes.next_multiple_of(4)).sum();
        let mut slot = self.staging.lock().unwrap_or_else(|p| p.into_inner());
        if slot.as_ref().is_none_or(|b| b.size() < total.max(4)) {
            *slot = Some(self.device.create_buffer(&wgpu::BufferDescriptor {
                label: Some("read-back"),
                size: total.max(4).next_power_of_two(),
                usage: wgpu::BufferUsages::MAP_READ | wgpu::BufferUsages::COPY_DST,
                mapped_at_creation: false,
            }));
        }
        let staging = slot.as_ref().expect("read-back buffer");
        let mut at = 0u64;
        for r in ranges {
            let b = r.bytes.next_multiple_of(4);
            if b > 0 {
                enc.copy_buffer_to_buffer(r.buffer, r.offset, staging, at, b);
            }
            at += b;
        }
        let index = self.queue.submit([enc.finish()]);
        self.count(|c| c.submits += 1);
        let (tx, rx) = std::sync::mpsc::channel();
        let mapped = total > 0;
        if mapped {
            staging.map_async(wgpu::MapMode::Read, ..total, move |r| {
                let _ = tx.send(r);
            });
        }
        self.wait(index, "a pass and its read-back")?;
        self.check()?;
        if !mapped {
            return Ok(ranges.iter().map(|_| Vec::new()).collect());
        }
        let fail = |message: String| GpuError::Device {
            adapter: self.adapter.name.clone(),
            message,
        };
        match rx.recv_timeout(self.wait_timeout()) {
            Ok(Ok(())) => {}
            Ok(Err(e)) => return Err(fail(format!("cannot map the read-back buffer: {e}"))),
            Err(_) => return Err(fail("the read-back buffer was never mapped".into())),
        }
        let mut out = Vec::with_capacity(ranges.len());
        {
            let view = staging.get_mapped_range(..total);
            let mut at = 0usize;
            for r in ranges {
                out.push(view[at..at + r.bytes as usize].to_vec());
                at += r.bytes.next_multiple_of(4) as usize;
            }
        }
        staging.unmap();
        self.count(|c| c.bytes_read += total);
        Ok(out)
    }

    /// The device's copy bandwidth: a buffer of `bytes` (rounded up to a multiple of 4,
    /// capped at [`GpuContext::max_storage`]) copied device to device, best of `rounds`
    /// submissions, in bytes copied per second (host wall-clock around each submission, so
    /// a submission's overhead counts; use at least tens of MB). The yardstick of a
    /// kernel's achieved bandwidth (`lockstep bench bptt --device gpu`).
    ///
    /// Errors: [`GpuError::Device`].
    pub fn copy_bytes_per_s(&self, bytes: u64, rounds: usize) -> Result<f64> {
        let bytes = bytes.max(16).next_multiple_of(4).min(self.max_storage());
        let make = |label| {
            self.device.create_buffer(&wgpu::BufferDescriptor {
                label: Some(label),
                size: bytes,
                usage: wgpu::BufferUsages::COPY_SRC | wgpu::BufferUsages::COPY_DST,
                mapped_at_creation: false,
            })
        };
        let (src, dst) = (make("copy yardstick source"), make("copy yardstick target"));
        let mut best = f64::INFINITY;
        for round in 0..rounds.max(1) + 1 {
            let mut enc = self.device.create_command_encoder(&Default::default());
            enc.copy_buffer_to_buffer(&src, 0, &dst, 0, bytes);
            let clock = std::time::Instant::now();
            self.submit_and_wait(enc.finish())?;
            // The first round pays for the buffers' first touch; it is not counted.
            if round > 0 {
                best = best.min(clock.elapsed().as_secs_f64());
            }
        }
        Ok(bytes as f64 / best)
    }
}

/// The binding limit [`MAX_BINDING_VAR`] asks for, if set.
///
/// Errors: [`GpuError::RequestDevice`] when it is not a whole number of bytes of at least
/// 65,536 (a window holds at least 1,024 elements, 16 KiB of 16-byte ones; the limit leaves
/// room for several).
fn max_binding_from_env(adapter: &AdapterSummary) -> Result<Option<u64>> {
    match std::env::var(MAX_BINDING_VAR) {
        Ok(v) => match v.trim().parse::<u64>() {
            Ok(b) if b >= 65_536 => Ok(Some(b)),
            _ => Err(GpuError::RequestDevice {
                adapter: adapter.name.clone(),
                message: format!(
                    "{MAX_BINDING_VAR}={v:?} is not a storage binding limit of at least 65536 bytes"
                ),
            }),
        },
        Err(_) => Ok(None),
    }
}

/// The wait limit of `adapter`: [`TIMEOUT_VAR`] if set, else the default of its kind.
///
/// Errors: [`GpuError::RequestDevice`] when the variable is not a positive number of seconds.
fn timeout_from_env(adapter: &AdapterSummary) -> Result<Duration> {
    match std::env::var(TIMEOUT_VAR) {
        Ok(v) => match v.trim().parse::<f64>() {
            Ok(s) if s.is_finite() && s > 0.0 => Ok(Duration::from_secs_f64(s)),
            _ => Err(GpuError::RequestDevice {
                adapter: adapter.name.clone(),
                message: format!(
                    "{TIMEOUT_VAR}={v:?} is not a positive number of seconds (how long to wait for the GPU)"
                ),
            }),
        },
        Err(_) if adapter.device_type == "Cpu" => Ok(DEFAULT_TIMEOUT_CPU),
        Err(_) => Ok(DEFAULT_TIMEOUT_GPU),
    }
}
