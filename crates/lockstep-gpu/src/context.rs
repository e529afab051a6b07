//! One open GPU ([`GpuContext`]): the wgpu device and queue of an adapter, shared by every
//! model of the process that computes on that adapter, with buffers checked against the
//! adapter's limits and blocking read-back.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};

use wgpu::util::DeviceExt;

use crate::adapter::{ordered_adapters, AdapterSummary};
use crate::error::{GpuError, Result};

/// The shader features lockstep's engines use, requested wherever the adapter has them
/// (each engine checks the ones it needs with [`GpuContext::require`]). Subgroups and float32
/// atomics are for burn's wgpu backend (the NPE, [`GpuContext::wgpu_handles`]): its kernel
/// compiler emits them whenever the adapter reports them, so the shared device must enable
/// them too.
const WANTED_FEATURES: wgpu::Features = wgpu::Features::SHADER_F64
    .union(wgpu::Features::SHADER_INT64)
    .union(wgpu::Features::SHADER_F16)
    .union(wgpu::Features::SUBGROUP)
    .union(wgpu::Features::SHADER_FLOAT32_ATOMIC);

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
        let bytes = bytes.max(16).next_multiple_of(4);
        self.check_storage(name, bytes, reduce)?;
        Ok(self.device.create_buffer(&wgpu::BufferDescriptor {
            label: Some(name),
            size: bytes,
            usage: wgpu::BufferUsages::STORAGE
                | wgpu::BufferUsages::COPY_SRC
                | wgpu::BufferUsages::COPY_DST,
            mapped_at_creation: false,
        }))
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
        let mut bytes: Vec<u8> = bytemuck::cast_slice(data).to_vec();
        let len = bytes.len().max(16).next_multiple_of(4);
        bytes.resize(len, 0);
        self.check_storage(name, len as u64, reduce)?;
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

    /// Writes `data` into `buffer` at byte `offset` (queued; takes effect before the next
    /// submission's commands).
    pub fn write<T: bytemuck::Pod>(&self, buffer: &wgpu::Buffer, offset: u64, data: &[T]) {
        if !data.is_empty() {
            self.queue
                .write_buffer(buffer, offset, bytemuck::cast_slice(data));
        }
    }

    /// Submits `commands`, waits for the device to finish them and reports any device error.
    ///
    /// Errors: [`GpuError::Device`].
    pub fn submit_and_wait(&self, commands: wgpu::CommandBuffer) -> Result<()> {
        let index = self.queue.submit([commands]);
        self.device
            .poll(wgpu::PollType::Wait {
                submission_index: Some(index),
                timeout: None,
            })
            .map_err(|e| GpuError::Device {
                adapter: self.adapter.name.clone(),
                message: e.to_string(),
            })?;
        self.check()
    }

    /// Reads `len` elements of type `T` from `buffer` at byte `offset` (copies through a
    /// staging buffer, blocks until done).
    ///
    /// Errors: [`GpuError::Device`].
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
        let padded = bytes.next_multiple_of(4);
        let staging = self.device.create_buffer(&wgpu::BufferDescriptor {
            label: Some("read-back"),
            size: padded,
            usage: wgpu::BufferUsages::MAP_READ | wgpu::BufferUsages::COPY_DST,
            mapped_at_creation: false,
        });
        let mut enc = self.device.create_command_encoder(&Default::default());
        enc.copy_buffer_to_buffer(buffer, offset, &staging, 0, padded);
        self.submit_and_wait(enc.finish())?;
        let (tx, rx) = std::sync::mpsc::channel();
        staging.map_async(wgpu::MapMode::Read, .., move |r| {
            let _ = tx.send(r);
        });
        self.device
            .poll(wgpu::PollType::wait_indefinitely())
            .map_err(|e| GpuError::Device {
                adapter: self.adapter.name.clone(),
                message: e.to_string(),
            })?;
        match rx.recv() {
            Ok(Ok(())) => {}
            Ok(Err(e)) => {
                return Err(GpuError::Device {
                    adapter: self.adapter.name.clone(),
                    message: format!("cannot map the read-back buffer: {e}"),
                })
            }
            Err(_) => {
                return Err(GpuError::Device {
                    adapter: self.adapter.name.clone(),
                    message: "the read-back buffer was never mapped".into(),
                })
            }
        }
        let out = {
            let view = staging.get_mapped_range(..);
            bytemuck::pod_collect_to_vec::<u8, T>(&view[..bytes as usize])
        };
        staging.unmap();
        self.check()?;
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
