// The training state on the device (training_state.rs): the parameters, the update's
// gradient and the optimizer's slots of one replica, and the three kernels that touch them.
//
// The parameters are bound as windows (each within the adapter's binding limit; one window
// for any network that fits): one dispatch per window, every binding of group 0 starting at
// the window's first parameter, and the window's length is `arrayLength(&params)`. Every
// kernel runs one invocation per parameter i of the window, 256 to a workgroup, the
// workgroups folded into (x, y) under 65,535 per dimension.
// Each value is owned by one invocation and read and written once: no atomics, the same
// bits on every run.
//
// The arithmetic is the host optimizer's (lockstep-train's `Optimizer::update` followed by
// `SnnModel::constrain`), term by term in its order, as `DeviceUpdate` documents it, so an
// adapter that does not fuse multiply-adds (lavapipe) trains bit for bit like the host.

// One update's scalars (`DeviceUpdate`, computed on the host).
struct Update {
    lr: f32,
    grad_factor: f32,
    unscale: f32,
    keep: f32,
    beta1: f32,
    one_minus_beta1: f32,
    beta2: f32,
    one_minus_beta2: f32,
    epsilon: f32,
    c1: f32,
    c2: f32,
    momentum: f32,
}

// The window's parameters (pA): recurrent weights, then input weights when trained.
@group(0) @binding(0) var<storage, read_write> params: array<f32>;
// The sum over the update's micro-batches of their mean gradients.
@group(0) @binding(1) var<storage, read_write> grad: array<f32>;
// Adam's first moment, or SGD's velocity.
@group(0) @binding(2) var<storage, read_write> slot0: array<f32>;
// Adam's second moment (a placeholder for SGD).
@group(0) @binding(3) var<storage, read_write> slot1: array<f32>;
// The sign constraint of each parameter, 2 bits each, 16 to a word: 0 free, 1 kept
// non-negative, 2 kept non-positive.
@group(0) @binding(4) var<storage, read> signs: array<u32>;
@group(0) @binding(5) var<uniform> u: Update;
// Set (to 1) by an update that leaves a parameter infinite or NaN; read with the next
// call's loss sums (the flag stays set until the training state is uploaded again).
// Touched only on that error, so no atomic on the hot path.
@group(0) @binding(6) var<storage, read_write> bad: atomic<u32>;
// The pass's mean gradient as the BPTT kernels accumulate it (bptt.wgsl `grad`: float64, or
// float32 on an adapter without 64-bit types; `alias wide` is prepended by the host).
@group(1) @binding(0) var<storage, read> pass_grad: array<wide>;

fn index_of(wg: vec3<u32>, nwg: vec3<u32>, li: u32) -> u32 {
    return (wg.y * nwg.x + wg.x) * 256u + li;
}

// A weight whose update crossed zero is clipped to zero (`SnnModel::constrain`); a value
// that is infinite or NaN (all exponent bits set: a test no compiler folds away) sets `bad`.
fn constrained(i: u32, p: f32) -> f32 {
    if ((bitcast<u32>(p) & 0x7f800000u) == 0x7f800000u) {
        atomicOr(&bad, 1u);
    }
    let code = (signs[i / 16u] >> (2u * (i % 16u))) & 3u;
    if ((code == 1u && p < 0.0) || (code == 2u && p > 0.0)) {
        return 0.0;
    }
    return p;
}

// After each pass: its mean gradient, rounded to float32 as the host path rounds it, added
// into the update's gradient (which the host cleared at the update's start).
@compute @workgroup_size(256)
fn accumulate(@builtin(workgroup_id) wg: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
              @builtin(local_invocation_index) li: u32) {
    let i = index_of(wg, nwg, li);
    if (i >= arrayLength(&params)) {
        return;
    }
    grad[i] = grad[i] + f32(pass_grad[i]);
}

// Adam / AdamW, then the sign constraint.
@compute @workgroup_size(256)
fn adam(@builtin(workgroup_id) wg: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
        @builtin(local_invocation_index) li: u32) {
    let i = index_of(wg, nwg, li);
    if (i >= arrayLength(&params)) {
        return;
    }
    let g = grad[i] * u.grad_factor * u.unscale;
    var p = params[i] * u.keep;
    let m = u.beta1 * slot0[i] + u.one_minus_beta1 * g;
    let v = u.beta2 * slot1[i] + u.one_minus_beta2 * g * g;
    slot0[i] = m;
    slot1[i] = v;
    p = p - u.lr * (m / u.c1) / (sqrt(v / u.c2) + u.epsilon);
    params[i] = constrained(i, p);
}

// SGD with momentum, then the sign constraint.
@compute @workgroup_size(256)
fn sgd(@builtin(workgroup_id) wg: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
       @builtin(local_invocation_index) li: u32) {
    let i = index_of(wg, nwg, li);
    if (i >= arrayLength(&params)) {
        return;
    }
    let g = grad[i] * u.grad_factor * u.unscale;
    let vel = u.momentum * slot0[i] + g;
    slot0[i] = vel;
    params[i] = constrained(i, params[i] - u.lr * vel);
}
