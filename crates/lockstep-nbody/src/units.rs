//! Units of docs/nbody.md: length kpc, velocity km/s, mass `mass_in_msol` solar masses,
//! time kpc/(km/s) (about 0.978 Gyr).

use serde::{Deserialize, Serialize};

/// Newton's constant in kpc (km/s)^2 / Msun (docs/nbody.md, "Units and kernel").
pub const G_KPC_KMS_MSUN: f64 = 4.30071057317063e-6;
/// One kpc in cm (IAU 2012 parsec).
pub const KPC_IN_CM: f64 = 3.085_677_581_491_367e21;
/// One km/s in cm/s.
pub const KMS_IN_CM_PER_S: f64 = 1.0e5;
/// One Gyr in s (10^9 Julian years of 365.25 days, the IAU year).
pub const GYR_IN_S: f64 = 3.15576e16;
/// The time unit, kpc/(km/s), in Gyr (about 0.978): `UnitLength_in_cm /
/// UnitVelocity_in_cm_per_s / GYR_IN_S`.
pub const TIME_UNIT_IN_GYR: f64 = KPC_IN_CM / KMS_IN_CM_PER_S / GYR_IN_S;
/// One solar mass in g (IAU 2015 nominal GM_sun / CODATA G).
pub const MSUN_IN_G: f64 = 1.988_409_870_698_051e33;

/// Unit system of a run. Length is kpc and velocity km/s; the mass unit is
/// `mass_in_msol` Msun, so `G = 4.30071057317063e-6 * mass_in_msol`.
///
/// `gravitational_constant` overrides G outright (for dimensionless "N-body units" with
/// `G = 1`); the snapshot `Units` group then records the override.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Units {
    /// Mass unit in solar masses (default 1).
    #[serde(default = "one")]
    pub mass_in_msol: f64,
    /// Optional override of G in code units (length^3 / (mass time^2)).
    #[serde(default)]
    pub gravitational_constant: Option<f64>,
}

fn one() -> f64 {
    1.0
}

impl Default for Units {
    fn default() -> Self {
        Units {
            mass_in_msol: 1.0,
            gravitational_constant: None,
        }
    }
}

impl Units {
    /// Units with a mass unit of `mass_in_msol` Msun.
    pub fn with_mass_unit(mass_in_msol: f64) -> Self {
        Units {
            mass_in_msol,
            gravitational_constant: None,
        }
    }

    /// Dimensionless N-body units with `G = g`.
    pub fn nbody(g: f64) -> Self {
        Units {
            mass_in_msol: 1.0,
            gravitational_constant: Some(g),
        }
    }

    /// G in code units: kpc (km/s)^2 / (mass unit), or the override.
    pub fn g(&self) -> f64 {
        self.gravitational_constant
            .unwrap_or(G_KPC_KMS_MSUN * self.mass_in_msol)
    }

    /// Checks that the mass unit and G are finite and positive.
    pub fn validate(&self) -> Result<(), crate::NbodyError> {
        if !(self.mass_in_msol.is_finite() && self.mass_in_msol > 0.0) {
            return Err(crate::NbodyError::param(
                "units.mass_in_msol",
                self.mass_in_msol,
                "use a finite positive mass unit in solar masses, e.g. 1e10",
            ));
        }
        if let Some(g) = self.gravitational_constant {
            if !(g.is_finite() && g > 0.0) {
                return Err(crate::NbodyError::param(
                    "units.gravitational_constant",
                    g,
                    "use a finite positive G or omit the key for physical units",
                ));
            }
        }
        Ok(())
    }
}
