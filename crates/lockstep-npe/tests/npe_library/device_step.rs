//! The training step on the machine's Vulkan adapter (Mesa's lavapipe in CI; no adapter is
//! a failure, never a skip) reads back once: the gradient and log q in one transfer after
//! the backward pass, not log q before it and the gradient after a chain of `cat`s. The
//! packed gradient and the loss must still be the CPU's, with frozen parameters in the
//! middle of the layout (so the trainable buffer's offsets differ from the layout's) and a
//! batch that is no multiple of a workgroup.
//!
//! The models are [`DeviceModel`]s, whose (non-generic) methods run the network code compiled
//! in lockstep-npe: an `NpeModel<WgpuAutodiff>` here would compile every layer on the GPU
//! backend again in this test binary (minutes of `make test`).

use crate::common::{random_params, small_network};
use lockstep_npe::device::{host_reads, DeviceKind, Placement};
use lockstep_npe::layers::Norm;
use lockstep_npe::DeviceModel;
use lockstep_train::Model;

#[test]
fn a_gpu_step_reads_back_once_and_packs_the_cpu_gradient() {
    let (td, xd, n) = (3, 6, 37);
    let net = small_network(td, xd, Norm::LayerNorm, 3.0);
    let (values, _) = random_params(&net, 0.1, 11);
    let mut cpu = DeviceModel::new(net.clone(), 3, &Placement::Cpu).unwrap();
    cpu.set_parameters(&values).unwrap();
    // Freeze the first flow step's parameters: trainable ones sit on both sides of them.
    let frozen_block = net
        .layout()
        .specs()
        .iter()
        .map(|s| s.name.clone())
        .find(|name| name.contains("steps.0."))
        .map(|name| name.split("steps.0.").next().unwrap().to_string() + "steps.0")
        .expect("a flow step 0");
    let frozen = cpu.freeze(std::slice::from_ref(&frozen_block)).unwrap();
    assert!(frozen > 0 && cpu.trainable().len() + frozen == values.len());
    let DeviceModel::Cpu(on_cpu) = &cpu else {
        unreachable!("a model placed on the CPU")
    };
    let placement = Placement::for_slot(DeviceKind::Gpu, 0).expect("a Vulkan adapter (lavapipe)");
    let mut gpu = DeviceModel::from_model(on_cpu, &placement).unwrap();
    assert!(matches!(gpu, DeviceModel::Gpu(_)));

    let mut rng = lockstep_core::rng::SplitMix64::new(5);
    let mut draw = |k: usize| -> Vec<f32> { (0..k).map(|_| rng.normal() as f32).collect() };
    let (theta, x) = (draw(n * td), draw(n * xd));
    let p = cpu.trainable().len();
    let (mut g_cpu, mut g_gpu) = (vec![0.0f32; p], vec![f32::NAN; p]);
    let loss_cpu = cpu.nll_and_grad(&theta, &x, n, &mut g_cpu);
    // Twice: the first pass compiles the kernels (and burn's autotuning may time them).
    gpu.nll_and_grad(&theta, &x, n, &mut g_gpu);
    let before = host_reads();
    let loss_gpu = gpu.nll_and_grad(&theta, &x, n, &mut g_gpu);
    assert_eq!(
        host_reads() - before,
        1,
        "one read-back per training pass (gradient and log q together)"
    );
    assert!(
        ((loss_gpu - loss_cpu) / loss_cpu).abs() < 1e-4,
        "loss: gpu {loss_gpu}, cpu {loss_cpu}"
    );
    let scale = g_cpu.iter().fold(0.0f32, |m, g| m.max(g.abs()));
    assert!(scale > 0.0);
    for (i, (a, b)) in g_gpu.iter().zip(&g_cpu).enumerate() {
        assert!(
            (a - b).abs() <= 1e-3 * scale,
            "gradient {i} of {p} ({frozen_block} frozen): gpu {a}, cpu {b}"
        );
    }
}

/// burn's fusion over the GPU backend (feature `fusion`; not in CI's build): one training
/// pass gives the plain GPU backend's loss and packed gradient, and still reads back once.
#[cfg(feature = "fusion")]
#[test]
fn a_gpu_step_under_burn_fusion_gives_the_plain_gpu_step() {
    let (td, xd, n) = (3, 6, 37);
    let net = small_network(td, xd, Norm::LayerNorm, 3.0);
    let (values, _) = random_params(&net, 0.1, 11);
    let mut cpu = DeviceModel::new(net.clone(), 3, &Placement::Cpu).unwrap();
    cpu.set_parameters(&values).unwrap();
    let DeviceModel::Cpu(on_cpu) = &cpu else {
        unreachable!("a model placed on the CPU")
    };
    let placement = Placement::for_slot(DeviceKind::Gpu, 0).expect("a Vulkan adapter (lavapipe)");
    let mut plain = DeviceModel::from_model(on_cpu, &placement).unwrap();
    let mut fused = DeviceModel::with_fusion(on_cpu, &placement).unwrap();
    assert!(matches!(fused, DeviceModel::GpuFusion(_)));
    let mut rng = lockstep_core::rng::SplitMix64::new(5);
    let mut draw = |k: usize| -> Vec<f32> { (0..k).map(|_| rng.normal() as f32).collect() };
    let (theta, x) = (draw(n * td), draw(n * xd));
    let p = plain.trainable().len();
    let (mut g_plain, mut g_fused) = (vec![0.0f32; p], vec![f32::NAN; p]);
    let loss_plain = plain.nll_and_grad(&theta, &x, n, &mut g_plain);
    fused.nll_and_grad(&theta, &x, n, &mut g_fused);
    let before = host_reads();
    let loss_fused = fused.nll_and_grad(&theta, &x, n, &mut g_fused);
    assert_eq!(host_reads() - before, 1, "one read-back per training pass");
    assert!(
        ((loss_fused - loss_plain) / loss_plain).abs() < 1e-5,
        "loss: fused {loss_fused}, plain {loss_plain}"
    );
    let scale = g_plain.iter().fold(0.0f32, |m, g| m.max(g.abs()));
    for (i, (a, b)) in g_fused.iter().zip(&g_plain).enumerate() {
        assert!(
            (a - b).abs() <= 1e-4 * scale,
            "gradient {i} of {p}: fused {a}, plain {b}"
        );
    }
}
