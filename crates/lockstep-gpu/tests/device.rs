//! The device layer on the machine's adapters. CI has Mesa's lavapipe (`make setup` installs
//! it); no adapter is a failure here, never a skip.

use lockstep_gpu::{list_adapters, select_adapter, wgpu, GpuContext};

/// At least one adapter exists, and the first opens with the features the spiking-network
/// engine needs.
#[test]
fn an_adapter_exists_and_opens() {
    let all = list_adapters();
    assert!(
        !all.is_empty(),
        "no GPU adapter: install mesa-vulkan-drivers and libvulkan1 (make setup does)"
    );
    for a in &all {
        eprintln!("{a}");
    }
    let sel = select_adapter(&all, None, 0, None).unwrap();
    let ctx = GpuContext::open(sel.adapter.index).unwrap();
    ctx.require(wgpu::Features::SHADER_F64, "SHADER_F64", "the test")
        .unwrap();
    ctx.require(wgpu::Features::SHADER_INT64, "SHADER_INT64", "the test")
        .unwrap();
    // The same adapter opens once per process.
    let again = GpuContext::open(sel.adapter.index).unwrap();
    assert!(std::sync::Arc::ptr_eq(&ctx, &again));
}

/// A kernel in f64 and u64 runs, and the read-back returns its values; a buffer over the
/// adapter's binding limit is refused by name before anything is allocated.
#[test]
fn a_kernel_runs_and_limits_are_enforced() {
    let all = list_adapters();
    let ctx = GpuContext::open(select_adapter(&all, None, 0, None).unwrap().adapter.index).unwrap();
    let src = r#"
@group(0) @binding(0) var<storage, read_write> x: array<f64>;
@group(0) @binding(1) var<storage, read_write> y: array<u64>;
@compute @workgroup_size(64)
fn main(@builtin(global_invocation_id) g: vec3<u32>) {
    let i = g.x;
    if (i >= arrayLength(&x)) { return; }
    x[i] = x[i] * 2.0lf + 0.5lf;
    y[i] = (y[i] ^ (y[i] >> 30u)) * 0xBF58476D1CE4E5B9lu;
}
"#;
    let module = ctx
        .device
        .create_shader_module(wgpu::ShaderModuleDescriptor {
            label: Some("test"),
            source: wgpu::ShaderSource::Wgsl(src.into()),
        });
    let pipeline = ctx
        .device
        .create_compute_pipeline(&wgpu::ComputePipelineDescriptor {
            label: Some("test"),
            layout: None,
            module: &module,
            entry_point: Some("main"),
            compilation_options: Default::default(),
            cache: None,
        });
    let xs: Vec<f64> = (0..100).map(|i| i as f64 / 3.0).collect();
    let ys: Vec<u64> = (0..100)
        .map(|i| 0x1234_5678_9abc_def0u64.wrapping_mul(i + 1))
        .collect();
    let bx = ctx.storage_from("x", &xs, "").unwrap();
    let by = ctx.storage_from("y", &ys, "").unwrap();
    let bg = ctx.device.create_bind_group(&wgpu::BindGroupDescriptor {
        label: None,
        layout: &pipeline.get_bind_group_layout(0),
        entries: &[
            wgpu::BindGroupEntry {
                binding: 0,
                resource: bx.as_entire_binding(),
            },
            wgpu::BindGroupEntry {
                binding: 1,
                resource: by.as_entire_binding(),
            },
        ],
    });
    let mut enc = ctx.device.create_command_encoder(&Default::default());
    {
        let mut pass = enc.begin_compute_pass(&Default::default());
        pass.set_pipeline(&pipeline);
        pass.set_bind_group(0, &bg, &[]);
        pass.dispatch_workgroups(2, 1, 1);
    }
    ctx.submit_and_wait(enc.finish()).unwrap();
    let gx: Vec<f64> = ctx.read(&bx, 0, xs.len()).unwrap();
    let gy: Vec<u64> = ctx.read(&by, 0, ys.len()).unwrap();
    for i in 0..xs.len() {
        assert_eq!(gx[i], xs[i] * 2.0 + 0.5, "f64 at {i}");
        let y = ys[i];
        assert_eq!(
            gy[i],
            (y ^ (y >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9),
            "u64 at {i}"
        );
    }
    let too_big = ctx.max_storage() + 4;
    let e = ctx
        .storage("tape x", too_big, "run.seq_len or run.batch_size")
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("\"tape x\"") && e.contains("run.seq_len") && e.contains(&ctx.adapter.name),
        "{e}"
    );
}
