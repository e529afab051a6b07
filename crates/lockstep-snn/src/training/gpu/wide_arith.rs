//! The kernels' wide arithmetic ([`Wide`]): float64 and 64-bit integers where the adapter
//! has `SHADER_F64` and `SHADER_INT64` (`with_64bit.wgsl`), else float32 and 32-bit
//! integers only (`without_64bit.wgsl`: Apple GPUs through Metal, or an adapter run with
//! `LOCKSTEP_GPU_HIDE_FEATURES=SHADER_F64,SHADER_INT64`).
//!
//! What the choice changes (issue 57 item 9):
//! * **Poisson draws** (spikes): with 64 bits, splitmix64 in `u64` and the inversion in
//!   float64, as the CPU draws them; without, splitmix64 on (low, high) pairs of `u32` and
//!   the inversion as integer thresholds on the uniform number's 53 bits
//!   ([`crate::input::poisson_thresholds`]). Both give the CPU's counts bit for bit.
//! * **The after-spike currents' jump at a spike** (spikes): `amp + A * refr_decay` in
//!   float64 rounded to float32, as the CPU engines compute it; without, in double-float32
//!   (Dekker's exact product, Knuth's two-sum, every rounded step through an opaque zero so
//!   that no compiler folds, reassociates or fuses it): an error of about 2^-47 of the larger
//!   of `amp` and `A * refr_decay` before the one rounding to float32, so the same float32
//!   except where the exact value lies that close to a rounding midpoint (about one jump in
//!   2^22, more where the two terms nearly cancel). Verified bit for bit on lavapipe; not yet
//!   run on Metal or an NVIDIA GPU.
//! * **Sums that do not decide spikes**: the weight gradient's accumulators, the voltage
//!   regularization and the loss sums in the wide type: float64, or float32 (the gradient
//!   then agrees with the CPU's to float32 rounding: 1e-7 to 1e-6 relative on the tests,
//!   instead of 1e-8). The spike count is summed in integers either way.

use lockstep_gpu::wgpu::Features;

/// The type of the kernels' wide accumulators and float64 constants (`wide` in the WGSL).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Wide {
    /// float64 and 64-bit integers (the adapter has `SHADER_F64` and `SHADER_INT64`).
    F64,
    /// float32 and 32-bit integers only.
    F32,
}

/// The WGSL of the draws and jumps with 64-bit types.
const WITH_64BIT: &str = include_str!("with_64bit.wgsl");
/// The WGSL of the draws and jumps without them.
const WITHOUT_64BIT: &str = include_str!("without_64bit.wgsl");

impl Wide {
    /// The wide type an adapter with `features` runs: float64 when it has both 64-bit
    /// shader features, else float32.
    pub fn of(features: Features) -> Wide {
        if features.contains(Features::SHADER_F64 | Features::SHADER_INT64) {
            Wide::F64
        } else {
            Wide::F32
        }
    }

    /// Bytes per value.
    pub fn bytes(self) -> u64 {
        match self {
            Wide::F64 => 8,
            Wide::F32 => 4,
        }
    }

    /// The WGSL type.
    pub fn wgsl_type(self) -> &'static str {
        match self {
            Wide::F64 => "f64",
            Wide::F32 => "f32",
        }
    }

    /// The WGSL that the kernels' header and `bptt.wgsl` sit around: the `wide` alias and
    /// the functions that need 64-bit types or emulate them.
    pub fn wgsl(self) -> String {
        let body = match self {
            Wide::F64 => WITH_64BIT,
            Wide::F32 => WITHOUT_64BIT,
        };
        format!("alias wide = {};\n{body}", self.wgsl_type())
    }

    /// `values` as this type's little-endian bytes (float32: each rounded to nearest).
    pub fn encode(self, values: &[f64]) -> Vec<u8> {
        match self {
            Wide::F64 => bytemuck::cast_slice(values).to_vec(),
            Wide::F32 => {
                let v: Vec<f32> = values.iter().map(|&x| x as f32).collect();
                bytemuck::cast_slice(&v).to_vec()
            }
        }
    }

    /// Values of this type from little-endian `bytes` (need not be aligned).
    pub fn decode(self, bytes: &[u8]) -> Vec<f64> {
        match self {
            Wide::F64 => bytes
                .chunks_exact(8)
                .map(|c| f64::from_le_bytes(c.try_into().expect("8 bytes")))
                .collect(),
            Wide::F32 => bytes
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes(c.try_into().expect("4 bytes")) as f64)
                .collect(),
        }
    }

    /// How the log names a float32 engine; empty for float64.
    pub fn note(self) -> &'static str {
        match self {
            Wide::F64 => "",
            Wide::F32 => "; 32-bit kernels (the adapter lacks SHADER_F64 or SHADER_INT64)",
        }
    }
}

#[cfg(test)]
mod tests {
    use super::{Wide, WITHOUT_64BIT};
    use lockstep_core::rng::{splitmix64, SplitMix64};
    use lockstep_gpu::wgpu::{self, Features};
    use lockstep_gpu::{list_adapters, select_adapter, GpuContext};

    /// The 32-bit kernels' emulations on the machine's adapter (lavapipe in CI; no adapter
    /// is a failure), against the CPU's 64-bit arithmetic on 20,000 random cases each:
    /// `keyed_unit_steps` (splitmix64 on u32 pairs) gives the 53 bits behind
    /// `input::keyed_uniform` exactly, and `asc_jump` (double-float32) gives
    /// `(amp + ad as f64 * refr_decay) as f32` bit for bit, for amplitudes and currents over
    /// twelve decades and both signs, the last 2,000 cases within 0.1% of cancelling. A jump in plain float32 differs in 5,673 of the cases,
    /// and without `opaque` (Mesa then folds the error terms away) in 4,302; the spike
    /// tests alone do not see either.
    #[test]
    fn the_32_bit_kernels_give_the_64_bit_bits() {
        let all = list_adapters();
        assert!(
            !all.is_empty(),
            "no GPU adapter (make setup installs lavapipe)"
        );
        let ctx =
            GpuContext::open(select_adapter(&all, None, 0, None).unwrap().adapter.index).unwrap();
        let cases = 20_000usize;
        const CANCELLING: usize = 2_000;
        let mut rng = SplitMix64::new(57);
        let mut uniform = || (rng.next_u64() >> 11) as f64 / (1u64 << 53) as f64;
        // Per case a group of three wide constants (th, amp, refr_decay) and their
        // remainders after rounding to float32; the current before the jump.
        let mut wide = Vec::with_capacity(6 * cases);
        let mut ad = Vec::with_capacity(cases);
        let mut expect_jump = Vec::with_capacity(cases);
        for c in 0..cases {
            let sign = if uniform() < 0.5 { -1.0 } else { 1.0 };
            let amp = sign * 10f64.powf(12.0 * uniform() - 6.0);
            let dec = uniform();
            let sign_a = if uniform() < 0.5 { -1.0 } else { 1.0 };
            let mut a = (sign_a * 10f64.powf(12.0 * uniform() - 6.0)) as f32;
            if c >= cases - CANCELLING {
                // amp and ad * refr_decay within 0.1% of cancelling.
                a = (-amp / dec * (1.0 + 2e-3 * (uniform() - 0.5))) as f32;
            }
            wide.extend_from_slice(&[0.0, amp, dec]);
            ad.push(a);
            expect_jump.push((amp + a as f64 * dec) as f32);
        }
        let lo: Vec<f64> = wide.iter().map(|&x| x - x as f32 as f64).collect();
        wide.extend(lo);
        let mut words = vec![0u32; 4 * cases];
        let mut expect_m = Vec::with_capacity(2 * cases);
        for c in 0..cases {
            let (seed, sample) = (rng.next_u64(), rng.next_u64());
            let (node, t) = (rng.next_u64() as u32, rng.next_u64() as u32 % 100_000);
            words[4 * c..4 * c + 4].copy_from_slice(&[
                seed as u32,
                (seed >> 32) as u32,
                sample as u32,
                (sample >> 32) as u32,
            ]);
            words.extend_from_slice(&[node, t]);
            let mut x = splitmix64(seed ^ 0x005E_ED0F_1A57);
            x = splitmix64(x ^ sample);
            x = splitmix64(x ^ (node as u64).wrapping_mul(0x9E37_79B9));
            x = splitmix64(x ^ t as u64);
            let m = x >> 11;
            expect_m.extend_from_slice(&[m as u32, (m >> 32) as u32]);
        }
        words.push(0); // O_ZERO
        let header = format!(
            "alias wide = f32;\nconst GD: u32 = 3u;\nconst O_GDLO: u32 = {}u;\nconst O_ZERO: u32 = {}u;\nconst CASES: u32 = {cases}u;\nconst O_SEED: u32 = 0u;\nconst O_S0: u32 = 0u;\nconst O_PTPTR: u32 = 0u;\nconst O_PTHR: u32 = 0u;\n",
            3 * cases,
            words.len() - 1
        );
        let kernels = r#"
@group(0) @binding(0) var<storage, read> net_u32: array<u32>;
@group(0) @binding(1) var<storage, read> net_wide: array<f32>;
@group(0) @binding(2) var<storage, read> currents: array<f32>;
@group(0) @binding(3) var<storage, read_write> out: array<u32>;
fn net_u32_at(i: u32) -> u32 { return net_u32[i]; }
fn gd(g: u32, k: u32) -> f32 { return net_wide[g * GD + k]; }
@compute @workgroup_size(64)
fn main(@builtin(global_invocation_id) id: vec3<u32>) {
    let c = id.x + id.y * 65535u * 64u;
    if (c >= CASES) { return; }
    out[c] = bitcast<u32>(asc_jump(c, 0u, currents[c]));
    let seed = vec2<u32>(net_u32[4u * c], net_u32[4u * c + 1u]);
    let sample = vec2<u32>(net_u32[4u * c + 2u], net_u32[4u * c + 3u]);
    let node = net_u32[4u * CASES + 2u * c];
    let t = net_u32[4u * CASES + 2u * c + 1u];
    let m = keyed_unit_steps(seed, sample, node, t);
    out[CASES + 2u * c] = m.x;
    out[CASES + 2u * c + 1u] = m.y;
}
"#;
        let module = ctx
            .device
            .create_shader_module(wgpu::ShaderModuleDescriptor {
                label: Some("without_64bit.wgsl under test"),
                source: wgpu::ShaderSource::Wgsl(
                    format!("{header}{WITHOUT_64BIT}{kernels}").into(),
                ),
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
        let wide32: Vec<f32> = wide.iter().map(|&x| x as f32).collect();
        let buffers = [
            ctx.storage_from("net_u32", &words, "").unwrap(),
            ctx.storage_from("net_wide", &wide32, "").unwrap(),
            ctx.storage_from("currents", &ad, "").unwrap(),
            ctx.storage("out", 4 * 3 * cases as u64, "").unwrap(),
        ];
        let entries: Vec<wgpu::BindGroupEntry> = buffers
            .iter()
            .enumerate()
            .map(|(b, buf)| wgpu::BindGroupEntry {
                binding: b as u32,
                resource: buf.as_entire_binding(),
            })
            .collect();
        let group = ctx.device.create_bind_group(&wgpu::BindGroupDescriptor {
            label: None,
            layout: &pipeline.get_bind_group_layout(0),
            entries: &entries,
        });
        let mut enc = ctx.device.create_command_encoder(&Default::default());
        {
            let mut pass = enc.begin_compute_pass(&Default::default());
            pass.set_pipeline(&pipeline);
            pass.set_bind_group(0, &group, &[]);
            pass.dispatch_workgroups((cases as u32).div_ceil(64), 1, 1);
        }
        ctx.submit_and_wait(enc.finish()).unwrap();
        let out: Vec<u32> = ctx.read(&buffers[3], 0, 3 * cases).unwrap();
        let apart: Vec<usize> = (0..cases)
            .filter(|&c| out[c] != expect_jump[c].to_bits())
            .collect();
        assert!(
            apart.is_empty(),
            "{} of {cases} jumps differ, the first at case {}: {} vs {}",
            apart.len(),
            apart[0],
            f32::from_bits(out[apart[0]]),
            expect_jump[apart[0]]
        );
        assert_eq!(&out[cases..], &expect_m[..], "keyed_unit_steps");
    }

    #[test]
    fn both_64_bit_features_pick_float64() {
        assert_eq!(
            Wide::of(Features::SHADER_F64 | Features::SHADER_INT64),
            Wide::F64
        );
        assert_eq!(Wide::of(Features::SHADER_F64), Wide::F32);
        assert_eq!(Wide::of(Features::SHADER_INT64), Wide::F32);
        assert_eq!(Wide::of(Features::empty()), Wide::F32);
        for w in [Wide::F64, Wide::F32] {
            let v = [1.5, -0.25, 3.0];
            assert_eq!(w.decode(&w.encode(&v)), v);
            assert_eq!(w.encode(&v).len() as u64, 3 * w.bytes());
        }
    }
}
