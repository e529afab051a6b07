//! The per-rank particle shard of docs/nbody.md, "Data layout".

use crate::NbodyError;

/// The particles one rank owns, in padded arrays.
///
/// All arrays have length `capacity()`; entries `0..num` are valid particles, the rest is
/// padding that holds room for particles arriving during redistribution (issue 9) and is
/// never read as particles. `num_total` is the sum of `num` over all ranks and is constant
/// during a run. Positions in kpc, velocities in km/s, masses in the mass unit of
/// [`crate::Units`], ids are global and unique.
#[derive(Debug, Clone, PartialEq)]
pub struct Particles {
    /// Positions `[capacity][3]`, kpc.
    pub pos: Vec<[f64; 3]>,
    /// Velocities `[capacity][3]`, km/s.
    pub vel: Vec<[f64; 3]>,
    /// Masses `[capacity]`, mass units.
    pub mass: Vec<f64>,
    /// Global particle ids `[capacity]`.
    pub id: Vec<u64>,
    /// Number of valid particles on this rank (`<= capacity`).
    pub num: usize,
    /// Number of valid particles over all ranks.
    pub num_total: u64,
}

impl Particles {
    /// Empty shard with `capacity` padded slots (zeros) and the given global total.
    pub fn with_capacity(capacity: usize, num_total: u64) -> Self {
        Particles {
            pos: vec![[0.0; 3]; capacity],
            vel: vec![[0.0; 3]; capacity],
            mass: vec![0.0; capacity],
            id: vec![0; capacity],
            num: 0,
            num_total,
        }
    }

    /// Single-rank shard holding exactly the given particles (capacity = count).
    ///
    /// Errors when the array lengths differ.
    pub fn from_arrays(
        pos: Vec<[f64; 3]>,
        vel: Vec<[f64; 3]>,
        mass: Vec<f64>,
        id: Vec<u64>,
    ) -> Result<Self, NbodyError> {
        let n = pos.len();
        if vel.len() != n || mass.len() != n || id.len() != n {
            return Err(NbodyError::param(
                "Particles::from_arrays",
                format!(
                    "pos {} vel {} mass {} id {}",
                    n,
                    vel.len(),
                    mass.len(),
                    id.len()
                ),
                "pass arrays of equal length",
            ));
        }
        Ok(Particles {
            pos,
            vel,
            mass,
            id,
            num: n,
            num_total: n as u64,
        })
    }

    /// Length of the padded arrays.
    pub fn capacity(&self) -> usize {
        self.pos.len()
    }

    /// Appends one particle on rank `rank`; a full shard is a
    /// [`NbodyError::CapacityOverflow`] naming `capacity_factor`.
    pub fn push(
        &mut self,
        pos: [f64; 3],
        vel: [f64; 3],
        mass: f64,
        id: u64,
        rank: usize,
    ) -> Result<(), NbodyError> {
        if self.num >= self.capacity() {
            return Err(NbodyError::CapacityOverflow {
                rank,
                needed: self.num + 1,
                capacity: self.capacity(),
            });
        }
        let i = self.num;
        self.pos[i] = pos;
        self.vel[i] = vel;
        self.mass[i] = mass;
        self.id[i] = id;
        self.num += 1;
        Ok(())
    }

    /// Valid positions `[num][3]`.
    pub fn valid_pos(&self) -> &[[f64; 3]] {
        &self.pos[..self.num]
    }

    /// Valid velocities `[num][3]`.
    pub fn valid_vel(&self) -> &[[f64; 3]] {
        &self.vel[..self.num]
    }

    /// Valid masses `[num]`.
    pub fn valid_mass(&self) -> &[f64] {
        &self.mass[..self.num]
    }

    /// Valid ids `[num]`.
    pub fn valid_id(&self) -> &[u64] {
        &self.id[..self.num]
    }

    /// Checks internal consistency: equal array lengths, `num <= capacity`, finite valid
    /// entries, non-negative masses.
    pub fn validate(&self) -> Result<(), NbodyError> {
        let cap = self.capacity();
        if self.vel.len() != cap || self.mass.len() != cap || self.id.len() != cap {
            return Err(NbodyError::param(
                "Particles",
                format!(
                    "pos {} vel {} mass {} id {}",
                    cap,
                    self.vel.len(),
                    self.mass.len(),
                    self.id.len()
                ),
                "all padded arrays must have the same capacity",
            ));
        }
        if self.num > cap {
            return Err(NbodyError::param(
                "Particles.num",
                self.num,
                "num must not exceed the capacity",
            ));
        }
        for i in 0..self.num {
            let ok = self.pos[i]
                .iter()
                .chain(self.vel[i].iter())
                .all(|v| v.is_finite())
                && self.mass[i].is_finite()
                && self.mass[i] >= 0.0;
            if !ok {
                return Err(NbodyError::param(
                    "particle",
                    format!(
                        "id {} pos {:?} vel {:?} mass {}",
                        self.id[i], self.pos[i], self.vel[i], self.mass[i]
                    ),
                    "positions and velocities must be finite and masses finite and >= 0",
                ));
            }
        }
        Ok(())
    }
}

/// Contiguous global id range `[start, end)` that rank `rank` of `size` owns out of `n`.
pub fn rank_range(n: u64, rank: usize, size: usize) -> (u64, u64) {
    let s = size as u128;
    let start = (n as u128 * rank as u128 / s) as u64;
    let end = (n as u128 * (rank as u128 + 1) / s) as u64;
    (start, end)
}

/// Capacity for `local` particles with padding factor `capacity_factor` (>= 1).
pub fn padded_capacity(local: usize, capacity_factor: f64) -> Result<usize, NbodyError> {
    if !(capacity_factor.is_finite() && capacity_factor >= 1.0) {
        return Err(NbodyError::param(
            "capacity_factor",
            capacity_factor,
            "use a padding factor >= 1 (e.g. 1.25)",
        ));
    }
    Ok(((local as f64 * capacity_factor).ceil() as usize).max(local))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn push_overflow_names_option() {
        let mut p = Particles::with_capacity(1, 2);
        p.push([0.0; 3], [0.0; 3], 1.0, 0, 0).unwrap();
        let e = p.push([1.0; 3], [0.0; 3], 1.0, 1, 3).unwrap_err();
        let msg = e.to_string();
        assert!(
            msg.contains("capacity_factor") && msg.contains("rank 3"),
            "{msg}"
        );
        assert_eq!(p.num, 1);
        assert_eq!(p.valid_id(), &[0]);
    }
}
