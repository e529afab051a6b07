//! The conditional normalizing flow `q(θ | x)` of Dingo (Dax et al. 2021, PRL 127, 241103;
//! nflows transforms, Durkan et al. 2019): an embedding network maps the observation `x` to a
//! context vector; `num_flow_steps` steps, each a random permutation, an LU-factorized linear
//! map and a rational-quadratic spline coupling transform whose spline parameters come from a
//! context-gated residual network on the untransformed half, map standardized θ to `z`;
//! the base is a standard normal. `log q(θ|x) = log N(z; 0, I) + Σ log|det J|`.
//!
//! θ and x are standardized with fixed means and standard deviations (as Dingo does); the
//! returned `log_prob` is the density of θ in its own units (the standardization's Jacobian
//! `-Σ log σ_θ` included).

use crate::backend::NpeBackend;
use crate::error::NpeError;
use crate::fused_ops::{index_of, lu_weight_composed};
use crate::layers::{
    Builder, DenseResidualNet, Init, LinearProjection, Norm, Pass, ResidualNet, ResidualNetShape,
};
use crate::params::{to_vec, Layout, Params, Partition};
use crate::spline::{coupling_spline, SplineParams};
use crate::task::BasisLayout;
pub use crate::task::Standardization;
use burn::tensor::backend::Backend;
use burn::tensor::{DType, Tensor, TensorData};
use lockstep_core::rng::{splitmix64, SplitMix64};
use serde::{Deserialize, Serialize};

/// The embedding network (Dingo's `embedding_kwargs`): an optional reduced-basis linear layer
/// (Dingo's `LinearProjectionRB`, see [`crate::svd`]), then the residual network.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EmbeddingConfig {
    /// Widths of the residual blocks, e.g. `[1024, 1024, 512, 256, 128]`.
    pub hidden_dims: Vec<usize>,
    /// Context features produced (Dingo: 128).
    pub output_dim: usize,
    /// Normalization inside the blocks.
    #[serde(default)]
    pub norm: Norm,
    /// The reduced-basis first layer (`None`: x goes straight into the residual network).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub projection: Option<ProjectionConfig>,
}

/// The flow (Dingo's `posterior_kwargs` with `base_transform_type: rq-coupling`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FlowConfig {
    /// Flow steps (permutation + LU linear + spline coupling each). Dingo: 30.
    pub num_flow_steps: usize,
    /// Hidden width of each coupling's conditioner. Dingo: 1024.
    pub hidden_dim: usize,
    /// Residual blocks per conditioner. Dingo: 5.
    pub num_transform_blocks: usize,
    /// Spline bins `K`. Dingo: 8.
    pub num_bins: usize,
    /// Spline tail bound `B` (standardized units). Dingo: 1.0.
    pub tail_bound: f64,
    /// Normalization inside the conditioners.
    #[serde(default)]
    pub norm: Norm,
}

/// The whole network: embedding + flow.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NetworkConfig {
    /// Embedding network of the observation.
    pub embedding: EmbeddingConfig,
    /// Conditional flow over θ.
    pub flow: FlowConfig,
    /// The eps of every BatchNorm layer (settings key `model.batch_norm_eps`; default
    /// [`crate::layers::DINGO_BATCH_NORM_EPS`], 1e-3 as nflows/Dingo). A network stored
    /// without it (`posterior.safetensors` of earlier runs) used
    /// [`crate::layers::LEGACY_BATCH_NORM_EPS`]. Unused without BatchNorm.
    #[serde(default = "legacy_batch_norm_eps")]
    pub batch_norm_eps: f64,
}

fn legacy_batch_norm_eps() -> f64 {
    crate::layers::LEGACY_BATCH_NORM_EPS
}

impl NetworkConfig {
    /// True when the embedding or the flow normalizes with BatchNorm.
    pub fn uses_batch_norm(&self) -> bool {
        self.embedding.norm == Norm::BatchNorm || self.flow.norm == Norm::BatchNorm
    }
}

/// The reduced-basis layer of a network: its basis size and the input layout.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ProjectionConfig {
    /// Basis elements per block.
    pub size: usize,
    /// How x is cut into blocks.
    pub layout: BasisLayout,
}

impl ProjectionConfig {
    /// The layer's outputs: `blocks x block_outputs(size)`.
    pub fn outputs(&self) -> usize {
        self.layout.blocks() * self.layout.block_outputs(self.size)
    }
}

/// nflows `RandomPermutation`: `y[:, i] = x[:, perm[i]]`, log-determinant 0.
#[derive(Debug, Clone)]
struct Permutation {
    perm: Vec<usize>,
    inverse: Vec<usize>,
}

impl Permutation {
    fn random(n: usize, seed: u64) -> Self {
        let mut perm: Vec<usize> = (0..n).collect();
        let mut rng = SplitMix64::new(seed);
        for i in (1..n).rev() {
            let j = (rng.next_u64() % (i as u64 + 1)) as usize;
            perm.swap(i, j);
        }
        Self::from_indices(perm)
    }

    /// The permutation `perm` (checked by the caller to hold each of `0..n` once).
    fn from_indices(perm: Vec<usize>) -> Self {
        let n = perm.len();
        let mut inverse = vec![0; n];
        for (i, &p) in perm.iter().enumerate() {
            inverse[p] = i;
        }
        Permutation { perm, inverse }
    }
}

/// nflows `LULinear`: `y = x Wᵀ + b` with `W = L U`, `L` unit lower-triangular (strictly lower
/// entries `lower_entries`), `U` upper-triangular with diagonal `softplus(u) + 1e-3` and
/// strictly upper entries `upper_entries`; `log|det W| = Σ log diag(U)`. Identity at start.
/// The weight is built by [`lu_weight_composed`]; on a backend with
/// [`crate::fused_ops::FusedOps::LAYER_KERNELS`] the whole step's map on the flow state is
/// one kernel ([`crate::fused_ops::FusedOps::lu_affine`]) and one product.
#[derive(Debug, Clone)]
struct LuLinear {
    n: usize,
    lower: usize,
    upper: usize,
    diag: usize,
    bias: usize,
}

const LU_EPS: f64 = 1e-3;

impl LuLinear {
    fn new(b: &mut Builder, name: &str, n: usize) -> Self {
        let t = n * (n - 1) / 2;
        let c = ((1.0 - LU_EPS).exp() - 1.0).ln() as f32;
        let lower = b.param(format!("{name}.lower_entries"), &[t], Init::Constant(0.0));
        let upper = b.param(format!("{name}.upper_entries"), &[t], Init::Constant(0.0));
        let diag = b.param(
            format!("{name}.unconstrained_upper_diag"),
            &[n],
            Init::Constant(c),
        );
        let bias = b.param(format!("{name}.bias"), &[n], Init::Constant(0.0));
        LuLinear {
            n,
            lower,
            upper,
            diag,
            bias,
        }
    }

    /// `(W [n, n], diag(U) [n])`.
    fn weight<B: Backend>(&self, p: &Params<B>) -> (Tensor<B, 2>, Tensor<B, 1>) {
        let (l, u, d) = (
            p.vector(self.lower),
            p.vector(self.upper),
            p.vector(self.diag),
        );
        lu_weight_composed(l, u, d, LU_EPS)
    }

    /// `x: [N, n]` permuted by `perm` (`x[:, perm]`), the running log-determinant `logdet:
    /// [N]` -> `(y [N, n], logdet + log|det W|)`, composed from burn's operations.
    fn forward<B: NpeBackend>(
        &self,
        p: &Params<B>,
        x: Tensor<B, 2>,
        perm: &[usize],
        logdet: Tensor<B, 1>,
    ) -> (Tensor<B, 2>, Tensor<B, 1>) {
        let device = x.device();
        let x = x.select(1, index_of::<B>(perm, &device));
        let (w, diag) = self.weight(p);
        let n = x.dims()[0];
        (
            x.matmul(w.transpose()) + p.row(self.bias),
            logdet + diag.log().sum().expand([n]),
        )
    }

    /// The map on the flow state `[N, n + 2]` (features, log-determinant, ones; see
    /// [`crate::coupling_kernel`]): one kernel for the step's matrix, one product.
    fn forward_state<B: NpeBackend>(
        &self,
        p: &Params<B>,
        state: Tensor<B, 2>,
        perm: &[usize],
    ) -> Tensor<B, 2> {
        let (l, u, d, b) = (
            p.vector(self.lower),
            p.vector(self.upper),
            p.vector(self.diag),
            p.vector(self.bias),
        );
        state.matmul(B::lu_affine(l, u, d, b, LU_EPS, Some(perm)))
    }

    /// Inverse map (sampling; the weight is inverted on the host in f64).
    fn inverse<B: Backend>(&self, p: &Params<B>, y: Tensor<B, 2>) -> Tensor<B, 2> {
        let device = y.device();
        let (w, _) = self.weight(p);
        let w: Vec<f64> = to_vec(w).into_iter().map(f64::from).collect();
        let inv = invert(&w, self.n);
        let inv: Vec<f32> = inv.into_iter().map(|v| v as f32).collect();
        let winv = Tensor::<B, 2>::from_data(TensorData::new(inv, [self.n, self.n]), &device);
        (y - p.row(self.bias)).matmul(winv.transpose())
    }
}

/// Inverse of a square row-major matrix by Gauss-Jordan elimination with partial pivoting.
fn invert(a: &[f64], n: usize) -> Vec<f64> {
    let mut m = a.to_vec();
    let mut inv = vec![0.0; n * n];
    for i in 0..n {
        inv[i * n + i] = 1.0;
    }
    for col in 0..n {
        let piv = (col..n)
            .max_by(|&i, &j| m[i * n + col].abs().total_cmp(&m[j * n + col].abs()))
            .unwrap_or(col);
        for j in 0..n {
            m.swap(col * n + j, piv * n + j);
            inv.swap(col * n + j, piv * n + j);
        }
        let d = m[col * n + col];
        for j in 0..n {
            m[col * n + j] /= d;
            inv[col * n + j] /= d;
        }
        for i in 0..n {
            if i != col {
                let f = m[i * n + col];
                if f != 0.0 {
                    for j in 0..n {
                        m[i * n + j] -= f * m[col * n + j];
                        inv[i * n + j] -= f * inv[col * n + j];
                    }
                }
            }
        }
    }
    inv
}

/// nflows `PiecewiseRationalQuadraticCouplingTransform` with linear tails: the features with
/// mask 1 (`transform`) go through a [`crate::spline::rational_quadratic_spline`] whose `3K-1` parameters
/// per feature come from a [`ResidualNet`] of the others (`identity`) and the context.
#[derive(Debug, Clone)]
struct Coupling {
    identity: Vec<usize>,
    transform: Vec<usize>,
    /// `order[i]`: where output feature `i` sits in `cat(identity, transform)`.
    order: Vec<usize>,
    net: ResidualNet,
    spline: SplineParams,
}

impl Coupling {
    /// Dingo's `create_alternating_binary_mask(features, even = step % 2 == 0)`.
    fn new(
        b: &mut Builder,
        name: &str,
        features: usize,
        context: usize,
        step: usize,
        cfg: &FlowConfig,
    ) -> Self {
        let start = if step.is_multiple_of(2) { 0 } else { 1 };
        let transform: Vec<usize> = (start..features).step_by(2).collect();
        let identity: Vec<usize> = (0..features).filter(|i| !transform.contains(i)).collect();
        let mut order = vec![0; features];
        for (pos, &f) in identity.iter().chain(&transform).enumerate() {
            order[f] = pos;
        }
        let spline = SplineParams::new(cfg.num_bins, cfg.tail_bound);
        let net = ResidualNet::new(
            b,
            &format!("{name}.transform_net"),
            ResidualNetShape {
                inputs: identity.len(),
                context,
                hidden: cfg.hidden_dim,
                outputs: transform.len() * spline.params_per_feature(),
                num_blocks: cfg.num_transform_blocks,
                norm: cfg.norm,
            },
        );
        Coupling {
            identity,
            transform,
            order,
            net,
            spline,
        }
    }

    /// `x: [N, features]` -> `(y, log|det| [N])`; `inverse` runs the inverse spline.
    fn apply<B: NpeBackend>(
        &self,
        pass: &mut Pass<'_, B>,
        x: Tensor<B, 2>,
        context: &Tensor<B, 2>,
        inverse: bool,
    ) -> (Tensor<B, 2>, Tensor<B, 1>) {
        let device = x.device();
        let n = x.dims()[0];
        let t = self.transform.len();
        let k = self.spline.num_bins;
        let x_id = x.clone().select(1, index_of::<B>(&self.identity, &device));
        let x_tr = x.select(1, index_of::<B>(&self.transform, &device));
        let raw = self.net.forward(pass, x_id.clone(), context);
        let raw = raw.reshape([n * t, 3 * k - 1]);
        let scale = 1.0 / (self.net.hidden as f64).sqrt();
        let x_tr = x_tr.reshape([n * t, 1]);
        // The density direction (training, log-probabilities) runs as one operation where
        // the backend has a spline kernel (GPUs); sampling composes the inverse.
        let (y, ld) = if inverse {
            coupling_spline(x_tr, raw, scale, true, &self.spline)
        } else {
            B::spline(x_tr, raw, scale, &self.spline)
        };
        let y = y.reshape([n, t]);
        let ld = ld.reshape([n, t]).sum_dim(1).reshape([n]);
        let out = Tensor::cat(vec![x_id, y], 1).select(1, index_of::<B>(&self.order, &device));
        (out, ld)
    }

    /// The density direction on the flow state `[N, features + 2]` (features,
    /// log-determinant, ones; a backend with the spline and layer kernels, float32): the
    /// conditioner's input by [`crate::fused_ops::FusedOps::coupling_split`], the spline
    /// reading the state's transformed columns (in float32 adding the conditioner's final
    /// bias itself), the next state by
    /// [`crate::fused_ops::FusedOps::coupling_place`] (a kernel each way each, where the
    /// composed form gathers, slices, sums, concatenates and gathers again).
    fn forward_state<B: NpeBackend>(
        &self,
        pass: &mut Pass<'_, B>,
        state: Tensor<B, 2>,
        context: &Tensor<B, 2>,
    ) -> Tensor<B, 2> {
        let n = state.dims()[0];
        let t = self.transform.len();
        let k = self.spline.num_bins;
        let start = self.transform[0];
        let input = B::coupling_split(state.clone(), context.clone(), start);
        let (raw, bias) = self.net.forward_input_unbiased(pass, input, context);
        let raw = raw.reshape([n * t, 3 * k - 1]);
        let scale = 1.0 / (self.net.hidden as f64).sqrt();
        let both = B::spline_joint(state.clone(), raw, scale, &self.spline, Some(start), bias);
        B::coupling_place(state, both, start)
    }
}

/// One flow step: permutation, LU linear, spline coupling.
#[derive(Debug, Clone)]
struct Step {
    permutation: Permutation,
    lu: LuLinear,
    coupling: Coupling,
}

/// The conditional flow with its embedding network: parameter layout and forward/inverse maps.
#[derive(Debug, Clone)]
pub struct NpeNetwork {
    /// The configuration it was built from.
    pub config: NetworkConfig,
    /// θ components.
    pub theta_dim: usize,
    /// x components.
    pub x_dim: usize,
    /// Fixed standardization of θ and x.
    pub standardization: Standardization,
    /// The seed the permutations were drawn from (part of the structure: a network is
    /// rebuilt from its config, widths, standardization and this seed, or from the
    /// permutations `posterior.safetensors` stores, see [`NpeNetwork::set_permutations`]).
    pub structure_seed: u64,
    builder: Builder,
    projection: Option<LinearProjection>,
    embedding: DenseResidualNet,
    steps: Vec<Step>,
}

impl NpeNetwork {
    /// Builds the layout for `theta_dim` parameters and `x_dim` observation values.
    /// Permutations are drawn from `structure_seed` (fixed per model, like nflows' at
    /// construction). Errors when `theta_dim < 2` (a coupling needs two halves) or a width
    /// is zero.
    pub fn new(
        config: NetworkConfig,
        theta_dim: usize,
        x_dim: usize,
        standardization: Standardization,
        structure_seed: u64,
    ) -> Result<Self, NpeError> {
        if theta_dim < 2 {
            return Err(NpeError::Invalid(format!(
                "θ has {theta_dim} component(s); the coupling flow needs at least 2"
            )));
        }
        if x_dim == 0 {
            return Err(NpeError::Invalid(
                "the observation x has no components".into(),
            ));
        }
        let e = &config.embedding;
        let f = &config.flow;
        if e.hidden_dims.is_empty() || e.hidden_dims.contains(&0) || e.output_dim == 0 {
            return Err(NpeError::Invalid("embedding.hidden_dims must be a non-empty list of positive widths and embedding.output_dim positive".into()));
        }
        if f.num_flow_steps == 0
            || f.hidden_dim == 0
            || f.num_bins < 2
            || !f.tail_bound.is_finite()
            || f.tail_bound <= 0.0
        {
            return Err(NpeError::Invalid("flow: num_flow_steps and hidden_dim must be positive, num_bins at least 2 and tail_bound positive".into()));
        }
        if standardization.theta_std.len() != theta_dim || standardization.x_std.len() != x_dim {
            return Err(NpeError::Invalid(
                "the standardization has the wrong widths".into(),
            ));
        }
        if !(config.batch_norm_eps.is_finite() && config.batch_norm_eps > 0.0) {
            return Err(NpeError::Invalid(format!(
                "batch_norm_eps: {} is not a positive number",
                config.batch_norm_eps
            )));
        }
        let mut b = Builder::default();
        b.batch_norm_eps = config.batch_norm_eps;
        let projection = match &e.projection {
            None => None,
            Some(pc) => {
                let l = &pc.layout;
                if l.blocks() * l.block_inputs() != x_dim || pc.size == 0 {
                    return Err(NpeError::Invalid(format!("embedding.projection: {} blocks of {} values do not make the {x_dim} values of x (or size is 0)",
                        l.blocks(),
                        l.block_inputs())));
                }
                Some(LinearProjection::new(
                    &mut b,
                    "embedding_net.layers_rb",
                    l.blocks(),
                    l.block_inputs(),
                    l.block_outputs(pc.size),
                ))
            }
        };
        let embedding_inputs = projection.as_ref().map_or(x_dim, LinearProjection::outputs);
        let embedding = DenseResidualNet::new(
            &mut b,
            "embedding_net",
            embedding_inputs,
            &e.hidden_dims,
            e.output_dim,
            e.norm,
        );
        let steps = (0..f.num_flow_steps)
            .map(|i| {
                let name = format!("flow.steps.{i}");
                Step {
                    permutation: Permutation::random(
                        theta_dim,
                        splitmix64(structure_seed ^ (i as u64 + 1)),
                    ),
                    lu: LuLinear::new(&mut b, &format!("{name}.lu_linear"), theta_dim),
                    coupling: Coupling::new(
                        &mut b,
                        &format!("{name}.coupling"),
                        theta_dim,
                        e.output_dim,
                        i,
                        f,
                    ),
                }
            })
            .collect();
        Ok(NpeNetwork {
            config,
            theta_dim,
            x_dim,
            standardization,
            structure_seed,
            builder: b,
            projection,
            embedding,
            steps,
        })
    }

    /// Writes `(weight [outputs x inputs], bias [outputs])` per block into the reduced-basis
    /// layer's parameters in `params` (the trainable buffer).
    ///
    /// Errors: the network has no reduced-basis layer, or the values have other shapes.
    pub fn set_projection(
        &self,
        params: &mut [f32],
        values: &[(Vec<f32>, Vec<f32>)],
    ) -> Result<(), NpeError> {
        let Some(proj) = &self.projection else {
            return Err(NpeError::Invalid(
                "the network has no reduced-basis (SVD) layer".into(),
            ));
        };
        let handles = proj.handles();
        if values.len() != handles.len() {
            return Err(NpeError::Invalid(format!(
                "{} blocks of values for a layer of {} blocks",
                values.len(),
                handles.len()
            )));
        }
        let layout = self.layout();
        for (&(w, b), (wv, bv)) in handles.iter().zip(values) {
            let (wd, bd) = (layout.slice_mut(params, w), bv);
            if wd.len() != wv.len() || layout.specs()[b].numel() != bd.len() {
                return Err(NpeError::Invalid(
                    "the reduced-basis values do not fit the layer's shape".into(),
                ));
            }
            wd.copy_from_slice(wv);
            layout.slice_mut(params, b).copy_from_slice(bv);
        }
        Ok(())
    }

    /// The reduced-basis layer's output `[N, outputs]` for observations `x` (`[N * x_dim]`
    /// row-major, raw units), or `None` without that layer.
    pub fn projection_output<B: NpeBackend>(
        &self,
        params: &Params<B>,
        x: &[f32],
        n: usize,
    ) -> Option<Tensor<B, 2>> {
        let proj = self.projection.as_ref()?;
        let device = params.vector(0).device();
        let s = &self.standardization;
        let xs = Self::standardize::<B>(x, n, &s.x_mean, &s.x_std, &device);
        Some(proj.forward(params, xs))
    }

    /// Trainable parameter layout (fixed order).
    pub fn layout(&self) -> &Layout {
        &self.builder.params
    }

    /// State layout (BatchNorm running statistics).
    pub fn state_layout(&self) -> &Layout {
        &self.builder.state
    }

    /// Initial (trainable, state) values from `seed`.
    pub fn initial_values(&self, seed: u64) -> (Vec<f32>, Vec<f32>) {
        self.builder.initial_values(seed)
    }

    /// f32 values the forward pass keeps per sample for the backward pass (an upper-end
    /// estimate: every layer's inputs and outputs, each normalization's and activation's
    /// intermediates, and the spline's ~40 per-bin tensors per transformed component).
    pub fn activation_floats_per_sample(&self) -> u64 {
        let e = &self.config.embedding;
        let f = &self.config.flow;
        let per_block = |h: usize| 12 * h as u64;
        let projected = self.projection.as_ref().map_or(0, |p| p.outputs() as u64);
        let embed: u64 = self.x_dim as u64
            + projected
            + e.hidden_dims
                .iter()
                .map(|&h| per_block(h) + h as u64)
                .sum::<u64>()
            + e.output_dim as u64;
        let d = self.theta_dim as u64;
        let t = d.div_ceil(2);
        let hidden = f.hidden_dim as u64;
        let k = f.num_bins as u64;
        let conditioner = (d + e.output_dim as u64)
            + f.num_transform_blocks as u64 * (per_block(f.hidden_dim) + 3 * hidden)
            + hidden
            + t * (3 * k - 1);
        let spline = 40 * t * (k + 1);
        embed + f.num_flow_steps as u64 * (6 * d + conditioner + spline)
    }

    /// The permutation of each flow step, in step order: step `i` maps `z` to
    /// `z[:, perm[i]]` (nflows' `RandomPermutation` indices; e.g. for a PyTorch replica).
    pub fn permutations(&self) -> Vec<Vec<usize>> {
        self.steps
            .iter()
            .map(|s| s.permutation.perm.clone())
            .collect()
    }

    /// Each flow step's coupling split `(identity, transform)`: the θ components passed
    /// through and those the spline maps (nflows' `identity_features` and
    /// `transform_features`: Dingo's alternating mask, the even components at even steps).
    pub fn coupling_features(&self) -> Vec<(Vec<usize>, Vec<usize>)> {
        self.steps
            .iter()
            .map(|s| (s.coupling.identity.clone(), s.coupling.transform.clone()))
            .collect()
    }

    /// Replaces the permutation of every flow step by `permutations` (step order, as
    /// [`NpeNetwork::permutations`] returns them): the permutations a checkpoint stored, so
    /// the network is rebuilt from them rather than drawn again from `structure_seed`.
    ///
    /// Errors: not one permutation per flow step, or one that does not hold each of
    /// `0..theta_dim` exactly once.
    pub fn set_permutations(&mut self, permutations: &[Vec<usize>]) -> Result<(), NpeError> {
        let d = self.theta_dim;
        if permutations.len() != self.steps.len() {
            return Err(NpeError::Invalid(format!(
                "{} stored permutation(s) for a flow of {} steps",
                permutations.len(),
                self.steps.len()
            )));
        }
        for (i, p) in permutations.iter().enumerate() {
            let mut seen = vec![false; d];
            let valid = p.len() == d
                && p.iter()
                    .all(|&k| k < d && !std::mem::replace(&mut seen[k], true));
            if !valid {
                return Err(NpeError::Invalid(format!(
                    "stored permutation {i} ({p:?}) is not a permutation of 0..{d}"
                )));
            }
        }
        for (step, p) in self.steps.iter_mut().zip(permutations) {
            step.permutation = Permutation::from_indices(p.clone());
        }
        Ok(())
    }

    /// The network's blocks, as names a stage can freeze (`embedding_net.layers_rb.0`,
    /// `embedding_net.initial_layer`, `embedding_net.blocks.0`, `flow.steps.0`, ...): each
    /// parameter name up to its first numeric component (at most three components, else
    /// two), in layout order without repeats. Any dotted prefix of a parameter name freezes.
    pub fn block_names(&self) -> Vec<String> {
        let mut out: Vec<String> = Vec::new();
        for s in self.layout().specs() {
            let parts: Vec<&str> = s.name.split('.').collect();
            let numeric = parts
                .iter()
                .take(3)
                .position(|p| p.chars().all(|c| c.is_ascii_digit()));
            let n = numeric.map_or(2, |i| i + 1).min(parts.len());
            let block = parts[..n].join(".");
            if !out.contains(&block) {
                out.push(block);
            }
        }
        out
    }

    /// The partition of the parameters that freezes `blocks` (dotted name prefixes, see
    /// [`NpeNetwork::block_names`]) and trains the rest.
    ///
    /// Errors: a prefix that names no parameter (with the network's block names), or blocks
    /// that together freeze every parameter.
    pub fn freezing(&self, blocks: &[String]) -> Result<Partition, NpeError> {
        let (partition, counts) = Partition::freezing(self.layout(), blocks);
        if let Some((block, _)) = blocks.iter().zip(&counts).find(|(_, &c)| c == 0) {
            return Err(NpeError::Invalid(format!(
                "`{block}` names no parameter of the network; its blocks are: {}",
                self.block_names().join(", ")
            )));
        }
        if partition.trainable_len() == 0 {
            return Err(NpeError::Invalid(format!(
                "[{}] freezes every parameter of the network, so there would be nothing to train; leave at least one block trainable (the blocks are: {})",
                blocks.join(", "),
                self.block_names().join(", ")
            )));
        }
        Ok(partition)
    }

    /// True when some layer is BatchNorm (the loss then couples the samples of a batch).
    pub fn uses_batch_norm(&self) -> bool {
        self.config.embedding.norm == Norm::BatchNorm || self.config.flow.norm == Norm::BatchNorm
    }

    fn standardize<B: Backend>(
        v: &[f32],
        rows: usize,
        mean: &[f64],
        std: &[f64],
        device: &B::Device,
    ) -> Tensor<B, 2> {
        let out = Self::standardized(v, mean, std);
        Tensor::from_data(TensorData::new(out, [rows, mean.len()]), device)
    }

    /// `(v - mean) / std` per component of row-major rows of `mean.len()` values.
    fn standardized(v: &[f32], mean: &[f64], std: &[f64]) -> Vec<f32> {
        let d = mean.len();
        v.iter()
            .enumerate()
            .map(|(i, &x)| ((x as f64 - mean[i % d]) / std[i % d]) as f32)
            .collect()
    }

    /// The context `[N, output_dim]` of observations `x` (`[N * x_dim]` row-major, raw units).
    pub fn context<B: NpeBackend>(
        &self,
        pass: &mut Pass<'_, B>,
        x: &[f32],
        n: usize,
    ) -> Tensor<B, 2> {
        let device = pass.params.vector(0).device();
        let s = &self.standardization;
        let xs = Self::standardize::<B>(x, n, &s.x_mean, &s.x_std, &device);
        let xs = match &self.projection {
            Some(p) => p.forward(pass.params, xs),
            None => xs,
        };
        self.embedding.forward(pass, xs)
    }

    /// `log q(θ | x)` per sample `[N]`, θ `[N * theta_dim]` and x `[N * x_dim]` row-major in
    /// raw units. Differentiable in the parameters on an autodiff backend.
    pub fn log_prob<B: NpeBackend>(
        &self,
        pass: &mut Pass<'_, B>,
        theta: &[f32],
        x: &[f32],
        n: usize,
    ) -> Tensor<B, 1> {
        let context = self.context(pass, x, n);
        self.log_prob_with_context(pass, theta, &context, n)
    }

    /// The flow's map from θ (raw units, `[N * theta_dim]`) to the base variable:
    /// `(z [N, theta_dim], Σ log|det ∂z/∂θ_std| [N])`, the log-determinant taken with
    /// respect to standardized θ (add `-Σ log σ_θ` for raw θ).
    pub fn transform<B: NpeBackend>(
        &self,
        pass: &mut Pass<'_, B>,
        theta: &[f32],
        context: &Tensor<B, 2>,
        n: usize,
    ) -> (Tensor<B, 2>, Tensor<B, 1>) {
        if Self::state_kernels::<B>(context) {
            return crate::fused_ops::state_parts(self.transform_state(pass, theta, context, n));
        }
        let device = context.device();
        let s = &self.standardization;
        let mut z = Self::standardize::<B>(theta, n, &s.theta_mean, &s.theta_std, &device);
        let mut logdet = Tensor::<B, 1>::zeros([n], &device);
        for step in &self.steps {
            let (y, ld) = step
                .lu
                .forward(pass.params, z, &step.permutation.perm, logdet);
            let (y, coupling_ld) = step.coupling.apply(pass, y, context, false);
            z = y;
            logdet = ld + coupling_ld;
        }
        (z, logdet)
    }

    /// Whether a pass runs the flow on the state (a backend with the spline and layer
    /// kernels, a float32 context).
    fn state_kernels<B: NpeBackend>(context: &Tensor<B, 2>) -> bool {
        B::LAYER_KERNELS && B::SPLINE_KERNEL && context.dtype() == DType::F32
    }

    /// The flow state `[N, theta_dim + 2]` after the last step: `z`, `Σ log|det ∂z/∂θ_std|`
    /// and a column of ones (see [`crate::coupling_kernel`]), from θ in raw units.
    fn transform_state<B: NpeBackend>(
        &self,
        pass: &mut Pass<'_, B>,
        theta: &[f32],
        context: &Tensor<B, 2>,
        n: usize,
    ) -> Tensor<B, 2> {
        let device = context.device();
        let s = &self.standardization;
        let d = self.theta_dim;
        let z = Self::standardized(&theta[..n * d], &s.theta_mean, &s.theta_std);
        let mut values = Vec::with_capacity(n * (d + 2));
        for row in z.chunks_exact(d) {
            values.extend_from_slice(row);
            values.extend([0.0, 1.0]);
        }
        let mut state = Tensor::<B, 2>::from_data(TensorData::new(values, [n, d + 2]), &device);
        for step in &self.steps {
            state = step
                .lu
                .forward_state(pass.params, state, &step.permutation.perm);
            state = step.coupling.forward_state(pass, state, context);
        }
        state
    }

    /// `log q(θ | context)` per sample `[N]` for a precomputed context `[N, output_dim]`.
    pub fn log_prob_with_context<B: NpeBackend>(
        &self,
        pass: &mut Pass<'_, B>,
        theta: &[f32],
        context: &Tensor<B, 2>,
        n: usize,
    ) -> Tensor<B, 1> {
        let d = self.theta_dim as f64;
        let c = 0.5 * d * (2.0 * std::f64::consts::PI).ln();
        let jac: f64 = self.standardization.theta_std.iter().map(|v| v.ln()).sum();
        if Self::state_kernels::<B>(context) {
            return B::base_log_prob(self.transform_state(pass, theta, context, n), c, jac);
        }
        let (z, logdet) = self.transform(pass, theta, context, n);
        crate::fused_ops::base_log_prob_composed(z, logdet, c, jac)
    }

    /// `n` samples of θ from `q(θ | x)` for one observation `x` (`[x_dim]`, raw units):
    /// `[n * theta_dim]` row-major, raw units. The base draws come from SplitMix64(`seed`).
    /// Call with the network in evaluation mode (`pass.training == false`).
    pub fn sample<B: NpeBackend>(
        &self,
        pass: &mut Pass<'_, B>,
        x: &[f32],
        n: usize,
        seed: u64,
    ) -> Vec<f32> {
        self.sample_from(pass, x, n, &mut SplitMix64::new(seed))
    }

    /// [`NpeNetwork::sample`] with the base draws taken from `rng` (which advances by
    /// `n * theta_dim` normal draws): consecutive calls on one stream give the rows of one
    /// call for all of them, so a large draw can be made in chunks.
    pub fn sample_from<B: NpeBackend>(
        &self,
        pass: &mut Pass<'_, B>,
        x: &[f32],
        n: usize,
        rng: &mut SplitMix64,
    ) -> Vec<f32> {
        // One context row, repeated: in evaluation mode every row of the embedding is
        // computed independently, so this equals embedding n copies of x.
        let context = self.context(pass, x, 1).repeat_dim(0, n);
        let device = context.device();
        let d = self.theta_dim;
        let zv: Vec<f32> = (0..n * d).map(|_| rng.normal() as f32).collect();
        let mut z = Tensor::<B, 2>::from_data(TensorData::new(zv, [n, d]), &device);
        for step in self.steps.iter().rev() {
            let (y, _) = step.coupling.apply(pass, z, &context, true);
            z = step.lu.inverse(pass.params, y);
            z = z.select(1, index_of::<B>(&step.permutation.inverse, &device));
        }
        let s = &self.standardization;
        to_vec(z)
            .into_iter()
            .enumerate()
            .map(|(i, v)| (v as f64 * s.theta_std[i % d] + s.theta_mean[i % d]) as f32)
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn invert_matches_identity() {
        let a = [2.0, 1.0, 0.5, 0.0, 3.0, 1.0, 1.0, 0.0, 4.0];
        let inv = invert(&a, 3);
        for i in 0..3 {
            for j in 0..3 {
                let v: f64 = (0..3).map(|k| a[i * 3 + k] * inv[k * 3 + j]).sum();
                assert!((v - if i == j { 1.0 } else { 0.0 }).abs() < 1e-12);
            }
        }
    }
}
