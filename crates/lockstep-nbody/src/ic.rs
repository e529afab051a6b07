//! Initial conditions (docs/nbody.md, "Snapshots"): Gaussian clumps, a Plummer sphere, a uniform
//! cube, or a GADGET-style HDF5 file.
//!
//! Generated models are seeded per particle: particle `id` draws from the random stream
//! `(seed, id)` and rank `r` of `size` generates the contiguous id range
//! `[r*n/size, (r+1)*n/size)`. The union over ranks therefore does not depend on the number
//! of ranks.

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use crate::particles::{padded_capacity, rank_range};
use crate::rng::Rng;
use crate::{NbodyError, Particles};

/// Initial-condition model; JSON form `{"kind": "plummer", ...}`. Lengths in kpc,
/// velocities km/s, masses in mass units.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case", deny_unknown_fields)]
pub enum InitialConditions {
    /// Plummer (1911) sphere in equilibrium, sampled as in Aarseth, Henon & Wielen (1974),
    /// truncated at `max_radius` scale radii.
    Plummer {
        /// Number of particles (all ranks).
        n: u64,
        /// Total mass.
        #[serde(default = "one")]
        total_mass: f64,
        /// Plummer scale radius `a`, kpc.
        #[serde(default = "one")]
        scale_radius: f64,
        /// Truncation radius in units of `a` (default 30).
        #[serde(default = "thirty")]
        max_radius: f64,
        /// Random seed.
        #[serde(default)]
        seed: u64,
    },
    /// `clumps` Gaussian clumps with centres uniform in a cube of side `box_size`, each of
    /// dispersion `clump_radius`; particle `id` belongs to clump `id % clumps`. Velocities
    /// Gaussian with dispersion `velocity_dispersion` per component.
    Clumps {
        /// Number of particles (all ranks).
        n: u64,
        /// Number of clumps.
        clumps: u64,
        /// Total mass.
        #[serde(default = "one")]
        total_mass: f64,
        /// Side of the cube holding the clump centres, kpc.
        #[serde(default = "one")]
        box_size: f64,
        /// Gaussian radius (sigma per axis) of a clump, kpc.
        clump_radius: f64,
        /// One-dimensional velocity dispersion, km/s.
        #[serde(default)]
        velocity_dispersion: f64,
        /// Random seed.
        #[serde(default)]
        seed: u64,
    },
    /// Particles uniform in the cube `[-box_size/2, box_size/2]^3`, Gaussian velocities.
    UniformCube {
        /// Number of particles (all ranks).
        n: u64,
        /// Total mass.
        #[serde(default = "one")]
        total_mass: f64,
        /// Side of the cube, kpc.
        #[serde(default = "one")]
        box_size: f64,
        /// One-dimensional velocity dispersion, km/s.
        #[serde(default)]
        velocity_dispersion: f64,
        /// Random seed.
        #[serde(default)]
        seed: u64,
    },
    /// GADGET-style HDF5 file (`PartType0`..`PartType5`, every type a gravitating point mass:
    /// `Coordinates`, `Velocities`, `ParticleIDs`, `Masses` or `Header/MassTable[T]`; see
    /// [`crate::snapshot::read_gadget_hdf5`]). Multi-file snapshots `name.0.hdf5` are read
    /// file by file.
    GadgetHdf5 {
        /// Path (relative paths are resolved against the config file by the runner).
        path: PathBuf,
    },
}

fn one() -> f64 {
    1.0
}
fn thirty() -> f64 {
    30.0
}

fn positive(name: &str, v: f64) -> Result<(), NbodyError> {
    if v.is_finite() && v > 0.0 {
        Ok(())
    } else {
        Err(NbodyError::param(
            name,
            v,
            "must be a finite positive number",
        ))
    }
}

fn non_negative(name: &str, v: f64) -> Result<(), NbodyError> {
    if v.is_finite() && v >= 0.0 {
        Ok(())
    } else {
        Err(NbodyError::param(name, v, "must be finite and >= 0"))
    }
}

impl InitialConditions {
    /// Total particle count of a generated model (None for files).
    pub fn count(&self) -> Option<u64> {
        match self {
            InitialConditions::Plummer { n, .. }
            | InitialConditions::Clumps { n, .. }
            | InitialConditions::UniformCube { n, .. } => Some(*n),
            InitialConditions::GadgetHdf5 { .. } => None,
        }
    }

    /// Generates (or reads) rank `rank`'s shard of `size` ranks, with padded capacity
    /// `capacity_factor * local count`. `g` is G in code units (Plummer velocities).
    pub fn generate(
        &self,
        g: f64,
        rank: usize,
        size: usize,
        capacity_factor: f64,
    ) -> Result<Particles, NbodyError> {
        if size == 0 || rank >= size {
            return Err(NbodyError::param(
                "rank",
                format!("{rank} of {size}"),
                "rank must be in 0..size and size >= 1",
            ));
        }
        if let InitialConditions::GadgetHdf5 { path } = self {
            return crate::snapshot::read_gadget_hdf5(path, rank, size, capacity_factor);
        }
        let n = self.count().unwrap_or(0);
        if n == 0 {
            return Err(NbodyError::param(
                "initial_conditions.n",
                n,
                "generate at least one particle",
            ));
        }
        let (start, end) = rank_range(n, rank, size);
        let local = (end - start) as usize;
        let cap = padded_capacity(local, capacity_factor)?;
        let mut p = Particles::with_capacity(cap, n);
        self.check_parameters(g)?;
        let total_mass = match *self {
            InitialConditions::Plummer { total_mass, .. }
            | InitialConditions::Clumps { total_mass, .. }
            | InitialConditions::UniformCube { total_mass, .. } => total_mass,
            InitialConditions::GadgetHdf5 { .. } => unreachable!("handled above"),
        };
        let m = total_mass / n as f64;
        for id in start..end {
            let (x, v) = self.particle(id, g);
            p.push(x, v, m, id, rank)?;
        }
        Ok(p)
    }

    /// Checks the parameters of a generated model (`g`: G in code units, for Plummer).
    ///
    /// Errors: [`NbodyError::InvalidParameter`] naming the `initial_conditions` key.
    fn check_parameters(&self, g: f64) -> Result<(), NbodyError> {
        match *self {
            InitialConditions::Plummer {
                total_mass,
                scale_radius,
                max_radius,
                ..
            } => {
                positive("initial_conditions.total_mass", total_mass)?;
                positive("initial_conditions.scale_radius", scale_radius)?;
                if !(max_radius.is_finite() && max_radius > 1.0) {
                    return Err(NbodyError::param(
                        "initial_conditions.max_radius",
                        max_radius,
                        "truncation radius in scale radii must be finite and > 1 (e.g. 30)",
                    ));
                }
                positive("G", g)
            }
            InitialConditions::Clumps {
                clumps,
                total_mass,
                box_size,
                clump_radius,
                velocity_dispersion,
                ..
            } => {
                if clumps == 0 {
                    return Err(NbodyError::param(
                        "initial_conditions.clumps",
                        clumps,
                        "use at least one clump",
                    ));
                }
                positive("initial_conditions.total_mass", total_mass)?;
                positive("initial_conditions.box_size", box_size)?;
                positive("initial_conditions.clump_radius", clump_radius)?;
                non_negative(
                    "initial_conditions.velocity_dispersion",
                    velocity_dispersion,
                )
            }
            InitialConditions::UniformCube {
                total_mass,
                box_size,
                velocity_dispersion,
                ..
            } => {
                positive("initial_conditions.total_mass", total_mass)?;
                positive("initial_conditions.box_size", box_size)?;
                non_negative(
                    "initial_conditions.velocity_dispersion",
                    velocity_dispersion,
                )
            }
            InitialConditions::GadgetHdf5 { .. } => Ok(()),
        }
    }

    /// Position (kpc) and velocity (km/s) of particle `id` of a generated model, from its
    /// own random stream `(seed, id)` (clump centres from the clump's stream).
    fn particle(&self, id: u64, g: f64) -> ([f64; 3], [f64; 3]) {
        match *self {
            InitialConditions::Plummer {
                total_mass,
                scale_radius,
                max_radius,
                seed,
                ..
            } => plummer_particle(seed, id, g, total_mass, scale_radius, max_radius),
            InitialConditions::Clumps {
                clumps,
                box_size,
                clump_radius,
                velocity_dispersion,
                seed,
                ..
            } => {
                let c = id % clumps;
                let mut cr = Rng::for_stream(seed ^ 0xC1C1_C1C1, c);
                let centre = [
                    (cr.uniform() - 0.5) * box_size,
                    (cr.uniform() - 0.5) * box_size,
                    (cr.uniform() - 0.5) * box_size,
                ];
                let mut r = Rng::for_stream(seed, id);
                let x = [
                    centre[0] + clump_radius * r.normal(),
                    centre[1] + clump_radius * r.normal(),
                    centre[2] + clump_radius * r.normal(),
                ];
                let v = [
                    velocity_dispersion * r.normal(),
                    velocity_dispersion * r.normal(),
                    velocity_dispersion * r.normal(),
                ];
                (x, v)
            }
            InitialConditions::UniformCube {
                box_size,
                velocity_dispersion,
                seed,
                ..
            } => {
                let mut r = Rng::for_stream(seed, id);
                let x = [
                    (r.uniform() - 0.5) * box_size,
                    (r.uniform() - 0.5) * box_size,
                    (r.uniform() - 0.5) * box_size,
                ];
                let v = [
                    velocity_dispersion * r.normal(),
                    velocity_dispersion * r.normal(),
                    velocity_dispersion * r.normal(),
                ];
                (x, v)
            }
            InitialConditions::GadgetHdf5 { .. } => unreachable!("files are read, not drawn"),
        }
    }
}

/// One Plummer-sphere particle: radius from the inverted cumulative mass
/// `r = a / sqrt(X^{-2/3} - 1)`, speed `q v_esc` with `q` drawn from
/// `g(q) = q^2 (1 - q^2)^{7/2}` by rejection (Aarseth, Henon & Wielen 1974).
fn plummer_particle(
    seed: u64,
    id: u64,
    g: f64,
    mass: f64,
    a: f64,
    max_radius: f64,
) -> ([f64; 3], [f64; 3]) {
    let mut r = Rng::for_stream(seed, id);
    let radius = loop {
        let x = r.uniform_open0();
        let denom = x.powf(-2.0 / 3.0) - 1.0;
        if denom > 0.0 {
            let rad = a / denom.sqrt();
            if rad <= max_radius * a {
                break rad;
            }
        }
    };
    let dir = r.unit_vector();
    let pos = [radius * dir[0], radius * dir[1], radius * dir[2]];
    let q = loop {
        let x4 = r.uniform();
        let x5 = 0.1 * r.uniform();
        if x5 < x4 * x4 * (1.0 - x4 * x4).powf(3.5) {
            break x4;
        }
    };
    let v_esc = (2.0 * g * mass / (radius * radius + a * a).sqrt()).sqrt();
    let speed = q * v_esc;
    let vd = r.unit_vector();
    (pos, [speed * vd[0], speed * vd[1], speed * vd[2]])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranks_partition_ids_and_union_is_rank_independent() {
        let ic = InitialConditions::Clumps {
            n: 1001,
            clumps: 5,
            total_mass: 2.0,
            box_size: 10.0,
            clump_radius: 0.3,
            velocity_dispersion: 1.0,
            seed: 3,
        };
        let one = ic.generate(1.0, 0, 1, 1.0).unwrap();
        let mut union = Vec::new();
        for r in 0..3 {
            let p = ic.generate(1.0, r, 3, 1.5).unwrap();
            assert!(p.capacity() >= p.num);
            assert_eq!(p.num_total, 1001);
            for i in 0..p.num {
                union.push((p.id[i], p.pos[i]));
            }
        }
        assert_eq!(union.len(), 1001);
        for (id, x) in union {
            assert_eq!(one.pos[id as usize], x);
        }
    }

    #[test]
    fn plummer_half_mass_radius_and_virial_ratio() {
        let ic = InitialConditions::Plummer {
            n: 20_000,
            total_mass: 1.0,
            scale_radius: 1.0,
            max_radius: 1e9,
            seed: 1,
        };
        let p = ic.generate(1.0, 0, 1, 1.0).unwrap();
        let mut r: Vec<f64> = p
            .valid_pos()
            .iter()
            .map(|x| (x[0] * x[0] + x[1] * x[1] + x[2] * x[2]).sqrt())
            .collect();
        r.sort_by(f64::total_cmp);
        // Plummer half-mass radius: a / sqrt(2^{2/3} - 1) = 1.3048 a.
        let rh = r[r.len() / 2];
        assert!((rh - 1.3048).abs() < 0.05, "half-mass radius {rh}");
        // Kinetic energy of the Plummer sphere: 3 pi G M^2 / (64 a).
        let k: f64 = p
            .valid_vel()
            .iter()
            .zip(p.valid_mass())
            .map(|(v, m)| 0.5 * m * (v[0] * v[0] + v[1] * v[1] + v[2] * v[2]))
            .sum();
        let k_exact = 3.0 * std::f64::consts::PI / 64.0;
        assert!((k / k_exact - 1.0).abs() < 0.03, "K {k} vs {k_exact}");
    }

    #[test]
    fn bad_parameters_are_errors() {
        let ic = InitialConditions::UniformCube {
            n: 10,
            total_mass: -1.0,
            box_size: 1.0,
            velocity_dispersion: 0.0,
            seed: 0,
        };
        let e = ic.generate(1.0, 0, 1, 1.0).unwrap_err().to_string();
        assert!(e.contains("total_mass") && e.contains("-1"), "{e}");
        let e = padded_capacity(10, 0.5).unwrap_err().to_string();
        assert!(e.contains("capacity_factor"), "{e}");
    }
}
