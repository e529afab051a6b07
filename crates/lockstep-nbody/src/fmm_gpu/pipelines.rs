//! The bind group layouts and compute pipelines of one WGSL module, set up the way both GPU
//! engines of the N-body use them (`fmm.wgsl` for the forces, `resident.wgsl` for the
//! resident shard): group 0 holds storage buffers, group 1 one uniform record per dispatch
//! at a dynamic offset.

use lockstep_gpu::{wgpu, GpuContext};

/// A compiled module: its two bind group layouts and one pipeline per entry point.
pub(crate) struct Compiled {
    /// Group 0: the storage buffers.
    pub(crate) layout0: wgpu::BindGroupLayout,
    /// Group 1: the dispatch record (uniform, dynamic offset).
    pub(crate) layout1: wgpu::BindGroupLayout,
    /// The pipelines, in the order of the entry points asked for.
    pub(crate) pipelines: Vec<wgpu::ComputePipeline>,
}

/// Compiles the WGSL `source` (named `label` in errors) with storage bindings `0..` of group
/// 0 read-only where `read_only` says so, a uniform record of `record_bytes` at group 1
/// binding 0, and a pipeline for each of `entries`.
pub(crate) fn compile(
    ctx: &GpuContext,
    label: &str,
    source: &str,
    read_only: &[bool],
    record_bytes: u64,
    entries: &[&str],
) -> Compiled {
    let storage: Vec<wgpu::BindGroupLayoutEntry> = read_only
        .iter()
        .enumerate()
        .map(|(b, &read_only)| wgpu::BindGroupLayoutEntry {
            binding: b as u32,
            visibility: wgpu::ShaderStages::COMPUTE,
            ty: wgpu::BindingType::Buffer {
                ty: wgpu::BufferBindingType::Storage { read_only },
                has_dynamic_offset: false,
                min_binding_size: None,
            },
            count: None,
        })
        .collect();
    let layout0 = ctx
        .device
        .create_bind_group_layout(&wgpu::BindGroupLayoutDescriptor {
            label: Some(label),
            entries: &storage,
        });
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
    let module = ctx
        .device
        .create_shader_module(wgpu::ShaderModuleDescriptor {
            label: Some(label),
            source: wgpu::ShaderSource::Wgsl(source.into()),
        });
    let layout = ctx
        .device
        .create_pipeline_layout(&wgpu::PipelineLayoutDescriptor {
            label: Some(label),
            bind_group_layouts: &[Some(&layout0), Some(&layout1)],
            immediate_size: 0,
        });
    let pipelines = entries
        .iter()
        .map(|entry| {
            ctx.device
                .create_compute_pipeline(&wgpu::ComputePipelineDescriptor {
                    label: Some(entry),
                    layout: Some(&layout),
                    module: &module,
                    entry_point: Some(entry),
                    compilation_options: Default::default(),
                    cache: None,
                })
        })
        .collect();
    Compiled {
        layout0,
        layout1,
        pipelines,
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
