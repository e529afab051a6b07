//! Seeded random streams for initial conditions: xoshiro256** (Blackman & Vigna 2018)
//! seeded through SplitMix64. Every particle draws from its own stream keyed by
//! `(seed, global id)`, so the initial conditions do not depend on the number of ranks.

use lockstep_core::rng::{splitmix64, SplitMix64};

/// xoshiro256** generator.
#[derive(Debug, Clone)]
pub struct Rng {
    s: [u64; 4],
}

impl Rng {
    /// Generator seeded from `seed`: the state is the first four outputs of SplitMix64
    /// started at `seed` (as Vigna recommends for seeding xoshiro).
    pub fn new(seed: u64) -> Self {
        let mut sm = SplitMix64::new(seed);
        let s = [sm.next_u64(), sm.next_u64(), sm.next_u64(), sm.next_u64()];
        Rng { s }
    }

    /// Independent stream `stream` of `seed` (e.g. the particle id): seeded from
    /// `splitmix64(stream * K ^ splitmix64(seed ^ C))`.
    pub fn for_stream(seed: u64, stream: u64) -> Self {
        let a = splitmix64(seed ^ 0x6A09_E667_F3BC_C909);
        Rng::new(splitmix64(stream.wrapping_mul(0xD605_BBB5_8C8A_BBB7) ^ a))
    }

    /// Next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        let result = self.s[1].wrapping_mul(5).rotate_left(7).wrapping_mul(9);
        let t = self.s[1] << 17;
        self.s[2] ^= self.s[0];
        self.s[3] ^= self.s[1];
        self.s[1] ^= self.s[2];
        self.s[0] ^= self.s[3];
        self.s[2] ^= t;
        self.s[3] = self.s[3].rotate_left(45);
        result
    }

    /// Uniform in [0, 1).
    pub fn uniform(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
    }

    /// Uniform in (0, 1].
    pub fn uniform_open0(&mut self) -> f64 {
        1.0 - self.uniform()
    }

    /// Standard normal deviate (Box-Muller).
    pub fn normal(&mut self) -> f64 {
        let u1 = self.uniform_open0();
        let u2 = self.uniform();
        (-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos()
    }

    /// Uniform index in `0..n` (n > 0).
    pub fn below(&mut self, n: u64) -> u64 {
        ((self.next_u64() as u128 * n as u128) >> 64) as u64
    }

    /// Isotropic unit vector.
    pub fn unit_vector(&mut self) -> [f64; 3] {
        let cos_t = 2.0 * self.uniform() - 1.0;
        let sin_t = (1.0 - cos_t * cos_t).max(0.0).sqrt();
        let phi = 2.0 * std::f64::consts::PI * self.uniform();
        [sin_t * phi.cos(), sin_t * phi.sin(), cos_t]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn uniform_moments_and_streams_differ() {
        let mut r = Rng::new(7);
        let n = 100_000;
        let mean: f64 = (0..n).map(|_| r.uniform()).sum::<f64>() / n as f64;
        assert!((mean - 0.5).abs() < 0.01, "mean {mean}");
        let mut g = Rng::new(8);
        let var: f64 = (0..n).map(|_| g.normal().powi(2)).sum::<f64>() / n as f64;
        assert!((var - 1.0).abs() < 0.03, "var {var}");
        let a = Rng::for_stream(1, 0).next_u64();
        let b = Rng::for_stream(1, 1).next_u64();
        let c = Rng::for_stream(2, 0).next_u64();
        assert!(a != b && a != c && b != c);
        assert_eq!(a, Rng::for_stream(1, 0).next_u64());
    }

    #[test]
    fn streams_are_unchanged_by_the_shared_splitmix64() {
        // Values of the crate's former private SplitMix64 seeding (initial conditions of
        // earlier runs must reproduce bit for bit).
        fn old_splitmix64(state: &mut u64) -> u64 {
            *state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
            let mut z = *state;
            z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            z ^ (z >> 31)
        }
        for (seed, stream) in [(0u64, 0u64), (1, 0), (42, 7), (u64::MAX, 123_456_789)] {
            let mut sm = seed ^ 0x6A09_E667_F3BC_C909;
            let a = old_splitmix64(&mut sm);
            let mut sm2 = stream.wrapping_mul(0xD605_BBB5_8C8A_BBB7) ^ a;
            let mut st = old_splitmix64(&mut sm2);
            let s = [
                old_splitmix64(&mut st),
                old_splitmix64(&mut st),
                old_splitmix64(&mut st),
                old_splitmix64(&mut st),
            ];
            let mut old = Rng { s };
            let mut new = Rng::for_stream(seed, stream);
            for _ in 0..8 {
                assert_eq!(old.next_u64(), new.next_u64());
            }
        }
    }
}
