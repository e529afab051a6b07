//! The device layer on the machine's adapters. CI has Mesa's lavapipe (`make setup` installs
//! it); no adapter is a failure here, never a skip.

use std::sync::Mutex;
use std::time::{Duration, Instant};

use lockstep_gpu::{list_adapters, select_adapter, wgpu, GpuContext, GpuError, ReadRange};

/// The tests share the process's device; the one that shortens its wait limit runs alone.
static DEVICE: Mutex<()> = Mutex::new(());

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
    let _alone = DEVICE.lock().unwrap_or_else(|p| p.into_inner());
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

/// A submission that outlasts the wait limit ends with an error naming the adapter and the
/// variable that sets the limit, within a second of the limit, instead of hanging; one pass
/// with two ranges read back is one submission and one host synchronisation, counted.
#[test]
fn a_wait_past_its_limit_fails_and_waits_are_counted() {
    let _alone = DEVICE.lock().unwrap_or_else(|p| p.into_inner());
    let all = list_adapters();
    let ctx = GpuContext::open(select_adapter(&all, None, 0, None).unwrap().adapter.index).unwrap();
    // About 2e9 loop iterations: seconds on lavapipe, milliseconds on a GPU.
    let src = r#"
@group(0) @binding(0) var<storage, read_write> x: array<f32>;
@compute @workgroup_size(64)
fn main(@builtin(global_invocation_id) g: vec3<u32>) {
    var a = f32(g.x);
    for (var k = 0u; k < 60000u; k = k + 1u) {
        a = a * 0.999f + 1.0f;
    }
    x[g.x] = a;
}
"#;
    let module = ctx
        .device
        .create_shader_module(wgpu::ShaderModuleDescriptor {
            label: Some("slow"),
            source: wgpu::ShaderSource::Wgsl(src.into()),
        });
    let pipeline = ctx
        .device
        .create_compute_pipeline(&wgpu::ComputePipelineDescriptor {
            label: Some("slow"),
            layout: None,
            module: &module,
            entry_point: Some("main"),
            compilation_options: Default::default(),
            cache: None,
        });
    let groups = 512u32;
    let buf = ctx
        .storage("slow output", 4 * 64 * groups as u64, "")
        .unwrap();
    let bg = ctx.device.create_bind_group(&wgpu::BindGroupDescriptor {
        label: None,
        layout: &pipeline.get_bind_group_layout(0),
        entries: &[wgpu::BindGroupEntry {
            binding: 0,
            resource: buf.as_entire_binding(),
        }],
    });
    let record = || {
        let mut enc = ctx.device.create_command_encoder(&Default::default());
        {
            let mut pass = enc.begin_compute_pass(&Default::default());
            pass.set_pipeline(&pipeline);
            pass.set_bind_group(0, &bg, &[]);
            pass.dispatch_workgroups(groups, 1, 1);
        }
        enc
    };
    let limit = ctx.wait_timeout();
    let is_software = ctx.adapter.device_type == "Cpu";
    if is_software {
        ctx.set_wait_timeout(Duration::from_millis(10));
        let clock = Instant::now();
        let e = ctx.submit_and_wait(record().finish()).unwrap_err();
        let waited = clock.elapsed();
        ctx.set_wait_timeout(limit);
        let msg = e.to_string();
        assert!(matches!(e, GpuError::Timeout { .. }), "{msg}");
        assert!(
            msg.contains(&ctx.adapter.name) && msg.contains("LOCKSTEP_GPU_TIMEOUT_S"),
            "{msg}"
        );
        assert!(waited < Duration::from_secs(1), "waited {waited:?}");
        // Let the slow pass finish before the next test uses the device.
        ctx.device
            .poll(wgpu::PollType::Wait {
                submission_index: None,
                timeout: Some(Duration::from_secs(300)),
            })
            .unwrap();
    }
    let before = ctx.counters();
    let out = ctx
        .submit_and_read(
            record(),
            &[
                ReadRange {
                    buffer: &buf,
                    offset: 0,
                    bytes: 8,
                },
                ReadRange {
                    buffer: &buf,
                    offset: 4 * 64 * (groups as u64 - 1),
                    bytes: 4,
                },
            ],
        )
        .unwrap();
    let d = ctx.counters() - before;
    assert_eq!((d.submits, d.host_syncs, d.bytes_read), (1, 1, 12), "{d:?}");
    let first: Vec<f32> = bytemuck_f32(&out[0]);
    let last: Vec<f32> = bytemuck_f32(&out[1]);
    let expect = |x: f32| {
        let mut a = x;
        for _ in 0..60000 {
            a = a * 0.999 + 1.0;
        }
        a
    };
    // lavapipe does not fuse; a GPU may (a relative tolerance there).
    for (got, x) in [
        (first[0], 0.0),
        (first[1], 1.0),
        (last[0], 64.0 * (groups - 1) as f32),
    ] {
        let want = expect(x);
        if is_software {
            assert_eq!(got.to_bits(), want.to_bits(), "x = {x}");
        } else {
            assert!(
                (got - want).abs() <= 1e-3 * want.abs(),
                "x = {x}: {got} vs {want}"
            );
        }
    }
}

fn bytemuck_f32(raw: &[u8]) -> Vec<f32> {
    raw.chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}
