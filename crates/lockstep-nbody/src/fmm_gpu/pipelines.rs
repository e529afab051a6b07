//! The bind group layouts and compute pipelines of one WGSL module, set up the way both GPU
//! engines of the N-body use them (`fmm.wgsl` for the forces, `resident.wgsl` for the
//! resident shard): group 0 holds the storage arrays, group 1 one uniform record per
//! dispatch at a dynamic offset.
//!
//! Each array may exceed one storage binding (the particles' 32 bytes each pass lavapipe's
//! 128 MiB at 4.2M particles, and an NVIDIA GPU's 2 GiB through wgpu at 67M): it is then bound
//! as windows of its buffer ([`lockstep_gpu::windows`]), and the kernels read and write it
//! through the generated `NAME_at` / `NAME_set`. A [`Module`] compiles its kernels once per
//! count of windows of its arrays (one window each for every problem that fits) and keeps
//! them.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use lockstep_gpu::windows::Windowed;
use lockstep_gpu::{wgpu, GpuContext, GpuError};

/// One storage array of a module's group 0, in binding order: its name in the kernels,
/// element type and bytes, and whether they only read it.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Array {
    /// The name the kernels use (`NAME_at(i)`, `NAME_set(i, v)`).
    pub(crate) name: &'static str,
    /// The WGSL element type.
    pub(crate) ty: &'static str,
    /// Bytes per element.
    pub(crate) elem: u64,
    /// Whether the kernels only read it.
    pub(crate) read_only: bool,
}

impl Array {
    /// An array the kernels read and write: `name` in the kernels, WGSL element type `ty`
    /// of `elem` bytes.
    pub(crate) const fn rw(name: &'static str, ty: &'static str, elem: u64) -> Array {
        Array {
            name,
            ty,
            elem,
            read_only: false,
        }
    }

    /// An array the kernels only read.
    pub(crate) const fn ro(name: &'static str, ty: &'static str, elem: u64) -> Array {
        Array {
            name,
            ty,
            elem,
            read_only: true,
        }
    }
}

/// The kernels of a module for one count of windows per array.
pub(crate) struct Compiled {
    /// Group 0: the arrays' windows.
    layout0: wgpu::BindGroupLayout,
    /// The pipelines, in the order of the module's entry points.
    pub(crate) pipelines: Vec<wgpu::ComputePipeline>,
    /// The arrays' windows.
    windows: Vec<Windowed>,
}

/// A WGSL module whose storage arrays are bound as windows: its source and arrays, the
/// layout of its dispatch records (group 1), and the kernels compiled so far.
pub(crate) struct Module {
    label: &'static str,
    source: &'static str,
    arrays: &'static [Array],
    entries: &'static [&'static str],
    /// Group 1: the dispatch record (uniform, dynamic offset).
    layout1: wgpu::BindGroupLayout,
    compiled: Mutex<HashMap<Vec<usize>, Arc<Compiled>>>,
}

/// A module's group 0 for a set of buffers, with the kernels compiled for its windows.
pub(crate) struct Bound {
    /// The kernels (one per entry point, in order).
    pub(crate) compiled: Arc<Compiled>,
    /// The bind group.
    pub(crate) group: wgpu::BindGroup,
}

impl Module {
    /// The module `source` (named `label` in errors) with storage `arrays` in group 0, a
    /// uniform record of `record_bytes` at group 1 binding 0, and a pipeline for each of
    /// `entries`; the kernels for one window per array are compiled now.
    ///
    /// Errors: a device error compiling them.
    pub(crate) fn new(
        ctx: &GpuContext,
        label: &'static str,
        source: &'static str,
        arrays: &'static [Array],
        record_bytes: u64,
        entries: &'static [&'static str],
    ) -> Result<Module, GpuError> {
        let layout1 = ctx
            .device
            .create_bind_group_layout(&wgpu::BindGroupLayoutDescriptor {
                label: Some(label),
                entries: &[wgpu::BindGroupLayoutEntry {
                    binding: 0,
                    visibility: wgpu::ShaderStages::COMPUTE,
                    ty: wgpu::BindingType::Buffer {
                        ty: wgpu::BufferBindingType::Uniform,
                        has_dynamic_offset: true,
                        min_binding_size: wgpu::BufferSize::new(record_bytes),
                    },
                    count: None,
                }],
            });
        let m = Module {
            label,
            source,
            arrays,
            entries,
            layout1,
            compiled: Mutex::default(),
        };
        m.compiled_for(ctx, &vec![1; arrays.len()])?;
        Ok(m)
    }

    /// The layout of the dispatch records (group 1).
    pub(crate) fn layout1(&self) -> &wgpu::BindGroupLayout {
        &self.layout1
    }

    /// The arrays' windows for `lens` elements each (at least one window each).
    fn windows(&self, ctx: &GpuContext, lens: &[usize]) -> Vec<Windowed> {
        let max = ctx.max_storage();
        let mut first = 0;
        self.arrays
            .iter()
            .zip(lens)
            .map(|(a, &len)| {
                let w = Windowed::new(a.name, a.ty, a.elem, len, max, first, a.read_only);
                first = w.next_binding();
                w
            })
            .collect()
    }

    /// The kernels for `counts` windows per array (compiled at the first use of a count).
    ///
    /// Errors: more windows than the adapter binds storage buffers per kernel; a device error.
    fn compiled_for(&self, ctx: &GpuContext, counts: &[usize]) -> Result<Arc<Compiled>, GpuError> {
        let mut cache = self.compiled.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(c) = cache.get(counts) {
            return Ok(c.clone());
        }
        let window_lens: Vec<usize> = {
            let probe = self.windows(ctx, &vec![1; counts.len()]);
            probe
                .iter()
                .zip(counts)
                .map(|(w, &k)| w.window * k)
                .collect()
        };
        let windows = self.windows(ctx, &window_lens);
        let bindings: usize = windows.iter().map(Windowed::count).sum();
        let per_stage = ctx.limits.max_storage_buffers_per_shader_stage as usize;
        if bindings > per_stage {
            return Err(GpuError::Device {
                adapter: ctx.adapter.name.clone(),
                message: format!(
                    "{}: its arrays need {bindings} storage bindings in windows of at most {} bytes ({}), more than the {per_stage} the adapter binds per kernel; use fewer particles per rank (more ranks)",
                    self.label,
                    ctx.max_storage(),
                    windows
                        .iter()
                        .map(|w| format!("{} {}", w.name, w.count()))
                        .collect::<Vec<_>>()
                        .join(", ")
                ),
            });
        }
        let entries: Vec<wgpu::BindGroupLayoutEntry> =
            windows.iter().flat_map(Windowed::layout_entries).collect();
        let layout0 = ctx
            .device
            .create_bind_group_layout(&wgpu::BindGroupLayoutDescriptor {
                label: Some(self.label),
                entries: &entries,
            });
        let header: String = windows.iter().map(Windowed::wgsl).collect();
        let module = ctx
            .device
            .create_shader_module(wgpu::ShaderModuleDescriptor {
                label: Some(self.label),
                source: wgpu::ShaderSource::Wgsl(format!("{header}\n{}", self.source).into()),
            });
        let layout = ctx
            .device
            .create_pipeline_layout(&wgpu::PipelineLayoutDescriptor {
                label: Some(self.label),
                bind_group_layouts: &[Some(&layout0), Some(&self.layout1)],
                immediate_size: 0,
            });
        let pipelines = self
            .entries
            .iter()
            .map(|entry| ctx.compute_pipeline(&layout, &module, entry))
            .collect();
        ctx.check()?;
        let c = Arc::new(Compiled {
            layout0,
            pipelines,
            windows,
        });
        cache.insert(counts.to_vec(), c.clone());
        Ok(c)
    }

    /// Group 0 for `buffers` (one per array, in order; each holding its array), with the
    /// kernels compiled for their windows.
    ///
    /// Errors: those of compiling the kernels for a new count of windows.
    pub(crate) fn bind(
        &self,
        ctx: &GpuContext,
        label: &str,
        buffers: &[&wgpu::Buffer],
    ) -> Result<Bound, GpuError> {
        let lens: Vec<usize> = buffers
            .iter()
            .zip(self.arrays)
            .map(|(b, a)| (b.size() / a.elem) as usize)
            .collect();
        let counts: Vec<usize> = self
            .windows(ctx, &lens)
            .iter()
            .map(Windowed::count)
            .collect();
        let compiled = self.compiled_for(ctx, &counts)?;
        let entries: Vec<wgpu::BindGroupEntry> = compiled
            .windows
            .iter()
            .zip(buffers)
            .flat_map(|(w, b)| w.entries(b))
            .collect();
        let group = ctx.device.create_bind_group(&wgpu::BindGroupDescriptor {
            label: Some(label),
            layout: &compiled.layout0,
            entries: &entries,
        });
        Ok(Bound { compiled, group })
    }
}

/// Bytes between two dispatch records of a uniform buffer (the dynamic-offset alignment wgpu
/// guarantees).
pub(crate) const RECORD_STRIDE: u64 = 256;

/// A uniform buffer of the dispatch `records` (each `record_bytes` long, at multiples of
/// [`RECORD_STRIDE`]) and its bind group for group 1 of `layout1` (record `k` at dynamic
/// offset `k * RECORD_STRIDE`).
pub(crate) fn records_group(
    ctx: &GpuContext,
    layout1: &wgpu::BindGroupLayout,
    label: &str,
    records: &[&[u32]],
    record_bytes: u64,
) -> wgpu::BindGroup {
    let mut bytes = vec![0u8; records.len().max(1) * RECORD_STRIDE as usize];
    for (k, r) in records.iter().enumerate() {
        let at = k * RECORD_STRIDE as usize;
        bytes[at..at + record_bytes as usize].copy_from_slice(bytemuck::cast_slice(r));
    }
    let buf = wgpu::util::DeviceExt::create_buffer_init(
        &ctx.device,
        &wgpu::util::BufferInitDescriptor {
            label: Some(label),
            contents: &bytes,
            usage: wgpu::BufferUsages::UNIFORM,
        },
    );
    ctx.device.create_bind_group(&wgpu::BindGroupDescriptor {
        label: Some(label),
        layout: layout1,
        entries: &[wgpu::BindGroupEntry {
            binding: 0,
            resource: wgpu::BindingResource::Buffer(wgpu::BufferBinding {
                buffer: &buf,
                offset: 0,
                size: wgpu::BufferSize::new(record_bytes),
            }),
        }],
    })
}
