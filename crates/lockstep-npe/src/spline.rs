//! The monotonic rational-quadratic spline (Durkan, Bekasov, Murray, Papamakarios 2019,
//! "Neural Spline Flows", NeurIPS, arXiv:1906.04032, eqs. 4-8 and appendix A), with linear
//! tails, exactly as nflows' `unconstrained_rational_quadratic_spline` (used by Dingo and
//! glasflow): `K` bins on `[-B, B]`, identity outside; bin widths and heights are a softmax of
//! unnormalized values rescaled so every bin is at least `min_bin_width`/`min_bin_height` wide;
//! interior knot derivatives are `min_derivative + softplus(u)`, and the two boundary
//! derivatives are fixed to 1 so the spline joins the identity tails smoothly.
//!
//! Shapes: `M` scalar inputs (batch x transformed features, flattened), each with its own
//! spline: inputs `[M, 1]`, unnormalized widths and heights `[M, K]`, unnormalized interior
//! derivatives `[M, K-1]`. Outputs `[M, 1]` and `log|dy/dx|` `[M, 1]`.

use burn::tensor::activation::{softmax, softplus};
use burn::tensor::backend::Backend;
use burn::tensor::{Int, Tensor};

/// Spline hyper-parameters (nflows defaults: 1e-3 minima).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SplineParams {
    /// Number of bins `K`.
    pub num_bins: usize,
    /// Tail bound `B`: the spline maps `[-B, B]` onto itself; identity outside.
    pub tail_bound: f64,
    /// Minimum bin width (fraction of `2B`).
    pub min_bin_width: f64,
    /// Minimum bin height (fraction of `2B`).
    pub min_bin_height: f64,
    /// Minimum knot derivative.
    pub min_derivative: f64,
}

impl SplineParams {
    /// `K` bins on `[-B, B]` with the nflows minima of 1e-3.
    pub fn new(num_bins: usize, tail_bound: f64) -> Self {
        SplineParams {
            num_bins,
            tail_bound,
            min_bin_width: 1e-3,
            min_bin_height: 1e-3,
            min_derivative: 1e-3,
        }
    }

    /// Values per transformed scalar the conditioner must produce: `3K - 1`.
    pub fn params_per_feature(&self) -> usize {
        3 * self.num_bins - 1
    }
}

/// Knot positions `[M, K+1]` from unnormalized bin sizes `[M, K]`: softmax, floor at `min`,
/// cumulative sum mapped to `[-B, B]` with the end knots exactly at `±B`.
fn knots<B: Backend>(unnormalized: Tensor<B, 2>, min: f64, bound: f64) -> Tensor<B, 2> {
    let [m, k] = unnormalized.dims();
    // Constants take the dtype of the data (`full_like`): the backend's default float type
    // may differ from its element type (see the crate docs).
    let column = unnormalized.clone().slice([0..m, 0..1]);
    let sizes = softmax(unnormalized, 1)
        .mul_scalar(1.0 - min * k as f64)
        .add_scalar(min);
    let cum = sizes.cumsum(1).mul_scalar(2.0 * bound).sub_scalar(bound);
    let interior = cum.slice([0..m, 0..k - 1]);
    Tensor::cat(
        vec![
            column.clone().full_like(-bound),
            interior,
            column.full_like(bound),
        ],
        1,
    )
}

/// Index of the bin `[loc_i, loc_{i+1})` holding each input: `[M, 1]` in `0..K`
/// (nflows `searchsorted`, the last knot nudged up by 1e-6 so `x = B` falls in the last bin).
fn search_bins<B: Backend>(locations: Tensor<B, 2>, x: Tensor<B, 2>) -> Tensor<B, 2, Int> {
    let [m, k1] = locations.dims();
    let loc = locations.detach();
    let nudge = Tensor::cat(
        vec![
            loc.clone().slice([0..m, 0..k1 - 1]).zeros_like(),
            loc.clone().slice([0..m, 0..1]).full_like(1e-6),
        ],
        1,
    );
    let loc = loc + nudge;
    let ge = x.detach().expand([m, k1]).greater_equal(loc);
    ge.int().sum_dim(1).sub_scalar(1).clamp(0, k1 as i64 - 2)
}

/// Applies the spline (or its inverse) to `x: [M, 1]`; returns `(y, log|dy/dx|)`, both
/// `[M, 1]`. For `inverse = true` the log-determinant is that of the inverse map.
/// Inputs outside `[-B, B]` pass through unchanged with log-determinant 0.
pub fn rational_quadratic_spline<B: Backend>(
    x: Tensor<B, 2>,
    unnormalized_widths: Tensor<B, 2>,
    unnormalized_heights: Tensor<B, 2>,
    unnormalized_derivatives: Tensor<B, 2>,
    inverse: bool,
    sp: &SplineParams,
) -> (Tensor<B, 2>, Tensor<B, 2>) {
    let bound = sp.tail_bound;
    let [m, k] = unnormalized_widths.dims();
    let inside = x
        .clone()
        .greater_equal_elem(-bound)
        .bool_and(x.clone().lower_equal_elem(bound));
    let xc = x.clone().clamp(-bound, bound);

    // Boundary derivatives fixed to 1: softplus(c) + min_derivative = 1.
    let c = ((1.0 - sp.min_derivative).exp() - 1.0).ln();
    let ud = Tensor::cat(
        vec![
            x.clone().full_like(c),
            unnormalized_derivatives,
            x.clone().full_like(c),
        ],
        1,
    );
    let derivatives = softplus(ud, 1.0).add_scalar(sp.min_derivative); // [M, K+1]
    let cumwidths = knots(unnormalized_widths, sp.min_bin_width, bound); // [M, K+1]
    let cumheights = knots(unnormalized_heights, sp.min_bin_height, bound);
    let widths = cumwidths.clone().slice([0..m, 1..k + 1]) - cumwidths.clone().slice([0..m, 0..k]);
    let heights =
        cumheights.clone().slice([0..m, 1..k + 1]) - cumheights.clone().slice([0..m, 0..k]);
    let delta = heights.clone() / widths.clone();

    let idx = if inverse {
        search_bins(cumheights.clone(), xc.clone())
    } else {
        search_bins(cumwidths.clone(), xc.clone())
    };
    let pick = |t: Tensor<B, 2>| t.gather(1, idx.clone());
    let in_cumwidths = pick(cumwidths.slice([0..m, 0..k]));
    let in_widths = pick(widths);
    let in_cumheights = pick(cumheights.slice([0..m, 0..k]));
    let in_heights = pick(heights);
    let in_delta = pick(delta);
    let in_d = pick(derivatives.clone().slice([0..m, 0..k]));
    let in_d1 = pick(derivatives.slice([0..m, 1..k + 1]));
    let curv = in_d.clone() + in_d1.clone() - in_delta.clone().mul_scalar(2.0);

    let (y, logdet) = if inverse {
        let dy = xc.clone() - in_cumheights;
        let a = dy.clone() * curv.clone() + in_heights.clone() * (in_delta.clone() - in_d.clone());
        let b = in_heights * in_d.clone() - dy.clone() * curv.clone();
        let c = -(in_delta.clone() * dy);
        let disc = (b.clone().powi_scalar(2) - a * c.clone().mul_scalar(4.0)).clamp_min(0.0);
        let root = c.mul_scalar(2.0) / (-b - disc.sqrt());
        let y = root.clone() * in_widths + in_cumwidths;
        let tomt = root.clone() * (root.clone().neg().add_scalar(1.0));
        let denominator = in_delta.clone() + curv * tomt.clone();
        let numerator = in_delta.clone().powi_scalar(2)
            * (in_d1 * root.clone().powi_scalar(2)
                + in_delta.mul_scalar(2.0) * tomt
                + in_d * root.neg().add_scalar(1.0).powi_scalar(2));
        let ld = numerator.log() - denominator.log().mul_scalar(2.0);
        (y, ld.neg())
    } else {
        let theta = (xc - in_cumwidths) / in_widths;
        let tomt = theta.clone() * (theta.clone().neg().add_scalar(1.0));
        let numerator = in_heights
            * (in_delta.clone() * theta.clone().powi_scalar(2) + in_d.clone() * tomt.clone());
        let denominator = in_delta.clone() + curv * tomt.clone();
        let y = in_cumheights + numerator / denominator.clone();
        let dnum = in_delta.clone().powi_scalar(2)
            * (in_d1 * theta.clone().powi_scalar(2)
                + in_delta.mul_scalar(2.0) * tomt
                + in_d * theta.neg().add_scalar(1.0).powi_scalar(2));
        let ld = dnum.log() - denominator.log().mul_scalar(2.0);
        (y, ld)
    };
    let out = x.mask_where(inside.clone(), y);
    let ld = logdet.mask_fill(inside.bool_not(), 0.0);
    (out, ld)
}

/// The spline of a coupling transform from its conditioner's raw output: `x: [M, 1]`,
/// `raw: [M, 3K-1]` holding the unnormalized widths (`raw[.., 0..K] * scale`), heights
/// (`raw[.., K..2K] * scale`) and interior derivatives (`raw[.., 2K..3K-1]`), as nflows'
/// `PiecewiseRationalQuadraticCouplingTransform` splits it (`scale` is
/// `1 / sqrt(hidden_features)`). Returns `(y, log|dy/dx|)`, both `[M, 1]`, of
/// [`rational_quadratic_spline`] (or its inverse).
pub fn coupling_spline<B: Backend>(
    x: Tensor<B, 2>,
    raw: Tensor<B, 2>,
    scale: f64,
    inverse: bool,
    sp: &SplineParams,
) -> (Tensor<B, 2>, Tensor<B, 2>) {
    let [m, _] = raw.dims();
    let k = sp.num_bins;
    let uw = raw.clone().slice([0..m, 0..k]).mul_scalar(scale);
    let uh = raw.clone().slice([0..m, k..2 * k]).mul_scalar(scale);
    let ud = raw.slice([0..m, 2 * k..3 * k - 1]);
    rational_quadratic_spline(x, uw, uh, ud, inverse, sp)
}
