//! The scalar type the single-step update is generic over.
//!
//! The forward recursion of `docs/neuron-models.md` is written once ([`crate::step`]) for any [`Scalar`]:
//! `f64` (NEST-exact simulation and the BPTT forward pass), `f32`, and the forward-mode dual
//! number [`num_dual::Dual64`] used as the gradient oracle. For dual numbers the spike function
//! has the Heaviside step as its value and the pseudo-derivative as its derivative, and the
//! reset is "hard forward, soft surrogate" (value = `V_reset`, derivative of
//! `U - (V_th - V_reset) * z`), exactly what the hand-written BPTT backward pass differentiates.

use std::fmt::Debug;
use std::ops::{Add, AddAssign, Mul, Neg, Sub};

use num_dual::Dual64;

/// Pseudo-derivative used for `dz/dU` of the spike nonlinearity (`docs/neuron-models.md`, "Training").
///
/// With normalized voltage `v = U / (V_th - E_L)` (threshold at `v = 1`):
/// `Gauss`: `gain * exp(-((v - 1) / width)^2)`; `Triangle`: `gain * max(0, 1 - |v - 1| / width)`
/// (the spec's triangle is `width = 1`). The pseudo-derivative is the derivative of
/// `z = H(v - 1)` with respect to the normalized voltage `v`, so by the chain rule
/// `dz/dU = pseudo_derivative(v) / (V_th - E_L)`. This keeps the soft-reset factor
/// `dU'/dU = 1 - (V_th - V_reset) dz/dU` of order one for any threshold in mV (with
/// `dz/dU = pseudo_derivative(v)` it would be about `1 - 20 * gain` for a 20 mV threshold and
/// gradients would explode over a few steps).
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Surrogate {
    /// Shape of the pseudo-derivative.
    pub kind: PseudoDerivative,
    /// Peak value (dimensionless per mV of `U`).
    pub gain: f64,
    /// Width in units of the normalized voltage `v`.
    pub width: f64,
}

/// Shape of the pseudo-derivative.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum PseudoDerivative {
    /// `gain * exp(-((v - 1) / width)^2)` (default).
    Gauss,
    /// `gain * max(0, 1 - |v - 1| / width)`.
    Triangle,
}

impl Default for Surrogate {
    fn default() -> Self {
        Surrogate {
            kind: PseudoDerivative::Gauss,
            gain: 0.3,
            width: 0.5,
        }
    }
}

/// `training.pseudo_derivative` as written: `"gauss"` / `"triangle"`, or
/// `{"name": "gauss" | "triangle", "gain": g, "width": w}` (unknown keys refused; missing
/// values: the defaults of that shape, gauss gain 0.3 width 0.5, triangle gain 0.3 width 1).
#[derive(Debug, Clone, Copy, PartialEq, Default, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SurrogateSection {
    /// The shape (default gauss).
    #[serde(default)]
    pub name: Option<PseudoDerivative>,
    /// Peak value (> 0).
    #[serde(default)]
    pub gain: Option<f64>,
    /// Width in units of the normalized voltage (> 0).
    #[serde(default)]
    pub width: Option<f64>,
}

impl<'de> serde::Deserialize<'de> for SurrogateSpec {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        use serde::de::{self, IntoDeserializer};
        use serde::Deserialize;
        struct V;
        impl<'de> de::Visitor<'de> for V {
            type Value = SurrogateSpec;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("\"gauss\", \"triangle\" or an object {name, gain, width}")
            }
            fn visit_str<E: de::Error>(self, s: &str) -> Result<SurrogateSpec, E> {
                let name = PseudoDerivative::deserialize(s.into_deserializer())?;
                Ok(SurrogateSpec(SurrogateSection {
                    name: Some(name),
                    ..Default::default()
                }))
            }
            fn visit_map<M: de::MapAccess<'de>>(self, m: M) -> Result<SurrogateSpec, M::Error> {
                SurrogateSection::deserialize(de::value::MapAccessDeserializer::new(m))
                    .map(SurrogateSpec)
            }
        }
        d.deserialize_any(V)
    }
}

/// `training.pseudo_derivative` in either form (a shape name or a [`SurrogateSection`]).
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct SurrogateSpec(pub SurrogateSection);

impl TryFrom<SurrogateSpec> for Surrogate {
    type Error = lockstep_core::config::ConfigError;

    /// The pseudo-derivative a section asks for. Errors: a gain or width that is not a
    /// positive number, naming `gain` / `width`.
    fn try_from(spec: SurrogateSpec) -> Result<Self, Self::Error> {
        let section = spec.0;
        let mut s = match section.name.unwrap_or(PseudoDerivative::Gauss) {
            PseudoDerivative::Gauss => Surrogate::default(),
            PseudoDerivative::Triangle => Surrogate {
                kind: PseudoDerivative::Triangle,
                gain: 0.3,
                width: 1.0,
            },
        };
        for (k, given, slot) in [
            ("gain", section.gain, &mut s.gain),
            ("width", section.width, &mut s.width),
        ] {
            if let Some(x) = given {
                if !(x.is_finite() && x > 0.0) {
                    return Err(lockstep_core::config::ConfigError::new(
                        k,
                        format!("{x} must be a positive number"),
                    ));
                }
                *slot = x;
            }
        }
        Ok(s)
    }
}

impl Surrogate {
    /// Pseudo-derivative at normalized voltage `v` (dimensionless).
    #[inline]
    pub fn eval(&self, v: f64) -> f64 {
        match self.kind {
            PseudoDerivative::Gauss => {
                let x = (v - 1.0) / self.width;
                self.gain * (-(x * x)).exp()
            }
            PseudoDerivative::Triangle => self.gain * (1.0 - (v - 1.0).abs() / self.width).max(0.0),
        }
    }

    /// `dz/dU = pseudo_derivative(u / th) / th` (1/mV) for a membrane potential `u` and
    /// threshold `th`, both in mV relative to `E_L`.
    #[inline]
    pub fn dz_du(&self, u: f64, th: f64) -> f64 {
        self.eval(u / th) / th
    }

    /// [`Surrogate::dz_du`] in float32 (1/mV), at the pre-reset potential `u` and threshold
    /// `th` (both mV rel. `E_L`): `pseudo_derivative(u / th) / th`, every operation in f32
    /// (the float32 engines and their per-sample oracle).
    #[inline]
    pub fn dz_du_f32(&self, u: f32, th: f32) -> f32 {
        let v = u / th;
        let pd = match self.kind {
            PseudoDerivative::Gauss => {
                let x = (v - 1.0) / self.width as f32;
                self.gain as f32 * (-(x * x)).exp()
            }
            PseudoDerivative::Triangle => {
                self.gain as f32 * (1.0 - (v - 1.0).abs() / self.width as f32).max(0.0)
            }
        };
        pd / th
    }
}

/// A number the single-step update can run on.
///
/// Arithmetic with constants goes through [`Scalar::mulc`] / [`Scalar::from_f64`] so that
/// `f64` reproduces NEST's double-precision operations exactly.
pub trait Scalar:
    Copy
    + Send
    + Sync
    + Debug
    + PartialEq
    + Add<Output = Self>
    + Sub<Output = Self>
    + Mul<Output = Self>
    + Neg<Output = Self>
    + AddAssign
    + 'static
{
    /// True when the type carries a derivative (dual numbers): spikes of value 0 may still
    /// carry a derivative, so the engine must propagate every neuron's `z`, not only spikes.
    const HAS_DERIVATIVE: bool;

    /// A constant (zero derivative).
    fn from_f64(x: f64) -> Self;
    /// The value (real part).
    fn re(self) -> f64;
    /// Multiplication by a constant.
    fn mulc(self, c: f64) -> Self;
    /// Same derivative, value replaced by `re` (identity on the value for plain floats).
    fn with_re(self, re: f64) -> Self;
    /// Spike nonlinearity: value `H(u - th)` (`u > th` when `strict`, else `u >= th`),
    /// derivative `surrogate.dz_du(u, th) * du`.
    fn spike(u: Self, th: f64, strict: bool, surrogate: &Surrogate) -> Self;
    /// Zero.
    #[inline]
    fn zero() -> Self {
        Self::from_f64(0.0)
    }
}

#[inline]
fn heaviside(u: f64, th: f64, strict: bool) -> f64 {
    let fired = if strict { u > th } else { u >= th };
    if fired {
        1.0
    } else {
        0.0
    }
}

impl Scalar for f64 {
    const HAS_DERIVATIVE: bool = false;
    #[inline]
    fn from_f64(x: f64) -> Self {
        x
    }
    #[inline]
    fn re(self) -> f64 {
        self
    }
    #[inline]
    fn mulc(self, c: f64) -> Self {
        self * c
    }
    #[inline]
    fn with_re(self, re: f64) -> Self {
        re
    }
    #[inline]
    fn spike(u: Self, th: f64, strict: bool, _surrogate: &Surrogate) -> Self {
        heaviside(u, th, strict)
    }
}

impl Scalar for f32 {
    const HAS_DERIVATIVE: bool = false;
    #[inline]
    fn from_f64(x: f64) -> Self {
        x as f32
    }
    #[inline]
    fn re(self) -> f64 {
        self as f64
    }
    #[inline]
    fn mulc(self, c: f64) -> Self {
        self * c as f32
    }
    #[inline]
    fn with_re(self, re: f64) -> Self {
        re as f32
    }
    #[inline]
    fn spike(u: Self, th: f64, strict: bool, _surrogate: &Surrogate) -> Self {
        heaviside(u as f64, th, strict) as f32
    }
}

impl Scalar for Dual64 {
    const HAS_DERIVATIVE: bool = true;
    #[inline]
    fn from_f64(x: f64) -> Self {
        Dual64::new(x, 0.0)
    }
    #[inline]
    fn re(self) -> f64 {
        self.re
    }
    #[inline]
    fn mulc(self, c: f64) -> Self {
        Dual64::new(self.re * c, self.eps * c)
    }
    #[inline]
    fn with_re(self, re: f64) -> Self {
        Dual64::new(re, self.eps)
    }
    #[inline]
    fn spike(u: Self, th: f64, strict: bool, surrogate: &Surrogate) -> Self {
        Dual64::new(
            heaviside(u.re, th, strict),
            surrogate.dz_du(u.re, th) * u.eps,
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dual_spike_has_heaviside_value_and_pseudo_derivative() {
        let sg = Surrogate {
            kind: PseudoDerivative::Triangle,
            gain: 0.5,
            width: 1.0,
        };
        let u = Dual64::new(9.0, 2.0);
        let z = <Dual64 as Scalar>::spike(u, 10.0, true, &sg);
        assert_eq!(z.re, 0.0);
        // v = 0.9 -> 0.5 * (1 - 0.1) = 0.45, divided by th = 10, times du = 2
        assert!((z.eps - 0.09).abs() < 1e-12);
        let z = <Dual64 as Scalar>::spike(Dual64::new(10.0, 1.0), 10.0, true, &sg);
        assert_eq!(z.re, 0.0, "strict threshold: u == th does not fire");
        let z = <Dual64 as Scalar>::spike(Dual64::new(10.0, 1.0), 10.0, false, &sg);
        assert_eq!(z.re, 1.0, "non-strict threshold: u == th fires");
    }

    #[test]
    fn gauss_peaks_at_threshold() {
        let sg = Surrogate::default();
        assert!((sg.eval(1.0) - 0.3).abs() < 1e-15);
        assert!(sg.eval(1.5) < sg.eval(1.1));
        let x: f64 = 0.5 / 0.5;
        assert!((sg.eval(1.5) - 0.3 * (-(x * x)).exp()).abs() < 1e-15);
    }

    #[test]
    fn surrogate_from_json() {
        use serde_json::json;
        let from_json = |v: Option<serde_json::Value>| -> Result<Surrogate, String> {
            match v {
                None => Ok(Surrogate::default()),
                Some(v) => {
                    let spec: SurrogateSpec =
                        lockstep_core::config::from_value(&v, "training.pseudo_derivative")
                            .map_err(|e| e.to_string())?;
                    Surrogate::try_from(spec).map_err(|e| e.to_string())
                }
            }
        };
        assert_eq!(from_json(None).unwrap(), Surrogate::default());
        let t = from_json(Some(json!({"name": "triangle", "gain": 0.5}))).unwrap();
        assert_eq!(
            t,
            Surrogate {
                kind: PseudoDerivative::Triangle,
                gain: 0.5,
                width: 1.0
            }
        );
        assert!(from_json(Some(json!("sigmoid"))).is_err());
        assert!(from_json(Some(json!({"name": "gauss", "width": -1}))).is_err());
        assert!(from_json(Some(json!({"nme": "gauss"}))).is_err());
        let e = from_json(Some(json!({"nme": "gauss"}))).unwrap_err();
        assert!(
            e.contains("training.pseudo_derivative.nme") && e.contains("`name`"),
            "{e}"
        );
        assert_eq!(from_json(Some(json!("triangle"))).unwrap().width, 1.0);
    }

    #[test]
    fn with_re_keeps_derivative() {
        let d = Dual64::new(3.0, -1.5).with_re(7.0);
        assert_eq!((d.re, d.eps), (7.0, -1.5));
        assert_eq!(3.0f64.with_re(7.0), 7.0);
    }
}
