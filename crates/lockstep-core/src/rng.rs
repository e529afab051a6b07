//! SplitMix64 (Steele, Lea & Flood 2014, "Fast splittable pseudorandom number generators",
//! OOPSLA; the constants of Vigna's reference `splitmix64.c`).
//!
//! [`splitmix64`] is the bijective 64-bit finalizer used to key counter-based streams
//! (`keyed(seed, sample, node, step)` in the models); [`SplitMix64`] is the sequential generator
//! (state advanced by the golden-ratio increment, output through the same finalizer).

/// The golden-ratio increment of SplitMix64 (`2^64 / phi`, odd).
pub const GOLDEN_GAMMA: u64 = 0x9E37_79B9_7F4A_7C15;

/// SplitMix64's output function applied to `x + GOLDEN_GAMMA`: a bijective 64-bit mixer.
///
/// `splitmix64(s)` equals the first output of [`SplitMix64::new(s)`](SplitMix64::new).
#[inline]
pub fn splitmix64(x: u64) -> u64 {
    let mut z = x.wrapping_add(GOLDEN_GAMMA);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// The 53 high bits of `bits` as a uniform number in `[0, 1)`.
#[inline]
pub fn unit_f64(bits: u64) -> f64 {
    (bits >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
}

/// Sequential SplitMix64 generator.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SplitMix64 {
    state: u64,
}

impl SplitMix64 {
    /// A generator whose state starts at `seed`.
    pub fn new(seed: u64) -> Self {
        SplitMix64 { state: seed }
    }

    /// Next 64 random bits.
    #[inline]
    pub fn next_u64(&mut self) -> u64 {
        let out = splitmix64(self.state);
        self.state = self.state.wrapping_add(GOLDEN_GAMMA);
        out
    }

    /// Uniform in `[0, 1)` with 53 random bits.
    #[inline]
    pub fn uniform(&mut self) -> f64 {
        unit_f64(self.next_u64())
    }

    /// Standard normal deviate (Box-Muller, cosine branch; two uniforms per call).
    pub fn normal(&mut self) -> f64 {
        let u1 = 1.0 - self.uniform(); // (0, 1]
        let u2 = self.uniform();
        (-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reference_values_of_vignas_splitmix64() {
        // splitmix64.c seeded with 1234567: the first outputs.
        let mut g = SplitMix64::new(1234567);
        assert_eq!(g.next_u64(), 6457827717110365317);
        assert_eq!(g.next_u64(), 3203168211198807973);
        assert_eq!(g.next_u64(), 9817491932198370423);
        assert_eq!(splitmix64(1234567), 6457827717110365317);
    }

    #[test]
    fn uniforms_are_in_the_unit_interval() {
        let mut g = SplitMix64::new(7);
        for _ in 0..1000 {
            let u = g.uniform();
            assert!((0.0..1.0).contains(&u));
            assert!(g.normal().is_finite());
        }
    }
}
