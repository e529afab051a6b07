//! Failure injection for the failure tests: they run the check binary (`lockstep-train-check`)
//! with a [`Fault`] to check that an error at each point of a run ends the whole job quickly.
//! The `lockstep` command never sets one ([`crate::EngineOptions::fault`] stays `None`).

use std::fmt;
use std::str::FromStr;

/// Where in a run a [`Fault`] can fire.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FaultPoint {
    /// Config validation, on every rank (before any output).
    Validation,
    /// The chief's output setup.
    OutputSetup,
    /// A replica's gradient computation.
    Update,
    /// The chief's per-update callbacks.
    Callback,
}

/// A failure to inject, written `validation`, `output_setup`, `update:K:RANK` or
/// `callback:K` (K counts updates from 0 for `update`, from 1 for `callback`, as the engine
/// numbers them at that point).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fault {
    /// Fail at config validation on every rank.
    Validation,
    /// Fail while the chief sets up the run directory.
    OutputSetup,
    /// Fail on rank `rank` while computing update `update`.
    Update {
        /// The update (0-based: the update being computed).
        update: u64,
        /// The rank.
        rank: usize,
    },
    /// Fail in the chief's callbacks after update `update` (1-based).
    Callback {
        /// The update.
        update: u64,
    },
}

impl Fault {
    /// True when this fault fires at `point` on `rank` during `update`.
    pub fn fires(&self, point: FaultPoint, rank: usize, update: u64) -> bool {
        match (*self, point) {
            (Fault::Validation, FaultPoint::Validation) => true,
            (Fault::OutputSetup, FaultPoint::OutputSetup) => true,
            (Fault::Update { update: u, rank: r }, FaultPoint::Update) => u == update && r == rank,
            (Fault::Callback { update: u }, FaultPoint::Callback) => u == update,
            _ => false,
        }
    }
}

impl fmt::Display for Fault {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Fault::Validation => write!(f, "validation"),
            Fault::OutputSetup => write!(f, "output setup"),
            Fault::Update { update, .. } => write!(f, "update {update}"),
            Fault::Callback { update } => write!(f, "callback at update {update}"),
        }
    }
}

impl FromStr for Fault {
    type Err = String;

    /// Parses `validation`, `output_setup`, `update:K:RANK` or `callback:K`.
    fn from_str(spec: &str) -> Result<Fault, String> {
        let parts: Vec<&str> = spec.split(':').collect();
        let num = |s: &str| {
            s.parse::<u64>()
                .map_err(|_| format!("{spec:?}: {s:?} is not a number"))
        };
        match parts.as_slice() {
            ["validation"] => Ok(Fault::Validation),
            ["output_setup"] => Ok(Fault::OutputSetup),
            ["update", k, r] => Ok(Fault::Update {
                update: num(k)?,
                rank: num(r)? as usize,
            }),
            ["callback", k] => Ok(Fault::Callback { update: num(k)? }),
            _ => Err(format!(
                "{spec:?} is not a fault; use validation, output_setup, update:K:RANK or callback:K"
            )),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn faults_parse_and_fire_where_named() {
        let f: Fault = "update:1:0".parse().unwrap();
        assert!(f.fires(FaultPoint::Update, 0, 1));
        assert!(!f.fires(FaultPoint::Update, 1, 1) && !f.fires(FaultPoint::Callback, 0, 1));
        assert_eq!("callback:2".parse(), Ok(Fault::Callback { update: 2 }));
        assert!("update:x:0".parse::<Fault>().is_err());
        assert!("nothing".parse::<Fault>().is_err());
    }
}
