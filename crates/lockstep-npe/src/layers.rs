//! Layers of the embedding and conditioner networks: linear maps, normalization (LayerNorm,
//! BatchNorm or none), ELU residual blocks with an optional context gate, and the two
//! residual networks Dingo uses (`DenseResidualNet` for the embedding, nflows' `ResidualNet`
//! for the coupling conditioners).
//!
//! All layers are functional: they hold parameter handles into a [`Layout`] and read the
//! values from a [`Params`] at forward time. Activations are `[batch, features]` tensors.
//! Sources: nflows `nn/nets/resnet.py` (ResidualBlock, ResidualNet; Durkan et al. 2019) and
//! Dingo `core/nn/enets.py` (DenseResidualNet; Dax et al. 2021).

use crate::backend::NpeBackend;
use crate::fused_ops::{FusedOps, Precision};
use crate::params::{to_vec, Layout, Params};
use crate::sync_batch_norm::StatsReducer;
use burn::tensor::backend::Backend;
use burn::tensor::{Tensor, TensorData};
use lockstep_core::rng::SplitMix64;
use serde::{Deserialize, Serialize};

/// Normalization inside residual blocks, selectable per network.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum Norm {
    /// No normalization (`none`).
    #[default]
    #[serde(alias = "None")]
    None,
    /// `LayerNorm` over the features of each sample (eps 1e-5, affine); needs no
    /// communication between replicas (`layer_norm`, also `LayerNorm`).
    #[serde(alias = "LayerNorm")]
    LayerNorm,
    /// `BatchNorm1d` over the batch as nflows' `ResidualBlock` (and so Dingo) builds it: eps
    /// [`DINGO_BATCH_NORM_EPS`] (1e-3; runs stored before `model.batch_norm_eps` existed used
    /// [`LEGACY_BATCH_NORM_EPS`]), momentum 0.1, affine, running statistics updated by every
    /// training-mode forward pass and used in evaluation. Couples the samples of a batch, so it
    /// is not sample-separable; under replicas it runs as SyncBatchNorm over the global batch
    /// ([`crate::sync_batch_norm`]) (`batch_norm`, also `BatchNorm`).
    #[serde(alias = "BatchNorm")]
    BatchNorm,
}

/// How a parameter or state buffer starts.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Init {
    /// Uniform on `[-bound, bound]`.
    Uniform(f32),
    /// Every value equal to the constant.
    Constant(f32),
}

/// The BatchNorm eps of nflows' `ResidualBlock` (`nn.BatchNorm1d(features, eps=1e-3)`,
/// nflows `nn/nets/resnet.py`), which Dingo's networks use: lockstep's default.
pub const DINGO_BATCH_NORM_EPS: f64 = 1e-3;
/// The BatchNorm eps of runs stored before `model.batch_norm_eps` existed (PyTorch's
/// `BatchNorm1d` default): a stored run's settings without the key mean this value.
pub const LEGACY_BATCH_NORM_EPS: f64 = 1e-5;

/// Builds a network's parameter [`Layout`] (trainable), its state layout (BatchNorm running
/// statistics) and the initial values of both.
#[derive(Debug, Clone)]
pub struct Builder {
    /// Trainable parameters in buffer order.
    pub params: Layout,
    /// Non-trainable state (running statistics) in buffer order.
    pub state: Layout,
    /// The eps of the BatchNorm layers built from here on (default
    /// [`DINGO_BATCH_NORM_EPS`]).
    pub batch_norm_eps: f64,
    param_init: Vec<Init>,
    state_init: Vec<Init>,
}

impl Default for Builder {
    fn default() -> Self {
        Builder {
            params: Layout::default(),
            state: Layout::default(),
            batch_norm_eps: DINGO_BATCH_NORM_EPS,
            param_init: Vec::new(),
            state_init: Vec::new(),
        }
    }
}

impl Builder {
    /// Appends a trainable parameter.
    pub fn param(&mut self, name: String, shape: &[usize], init: Init) -> usize {
        self.param_init.push(init);
        self.params.add(name, shape)
    }

    /// Appends a state buffer.
    pub fn state(&mut self, name: String, shape: &[usize], init: Init) -> usize {
        self.state_init.push(init);
        self.state.add(name, shape)
    }

    /// Initial (trainable, state) values; uniform draws come from one SplitMix64 stream of
    /// `seed` in buffer order, so the same seed gives the same network everywhere.
    pub fn initial_values(&self, seed: u64) -> (Vec<f32>, Vec<f32>) {
        let mut rng = SplitMix64::new(seed);
        let mut fill = |layout: &Layout, inits: &[Init]| {
            let mut v = vec![0.0f32; layout.len()];
            for (i, init) in inits.iter().enumerate() {
                let out = layout.slice_mut(&mut v, i);
                match *init {
                    Init::Uniform(b) => out
                        .iter_mut()
                        .for_each(|x| *x = ((2.0 * rng.uniform() - 1.0) * b as f64) as f32),
                    Init::Constant(c) => out.iter_mut().for_each(|x| *x = c),
                }
            }
            v
        };
        let p = fill(&self.params, &self.param_init);
        let s = fill(&self.state, &self.state_init);
        (p, s)
    }
}

/// One forward pass: the parameters, and in training mode the state buffer whose BatchNorm
/// running statistics are updated from the batch.
pub struct Pass<'a, B: Backend> {
    /// Parameter tensors.
    pub params: &'a Params<B>,
    /// State values (running statistics) read in evaluation and updated in training.
    pub state: &'a mut [f32],
    /// State layout (offsets of the running statistics).
    pub state_layout: &'a Layout,
    /// Training mode: BatchNorm uses batch statistics and updates the running ones.
    pub training: bool,
    /// In training mode with replicas: BatchNorm becomes SyncBatchNorm, its batch statistics
    /// summed over all replicas through this reducer ([`crate::sync_batch_norm`]).
    pub sync: Option<&'a StatsReducer>,
}

impl<'a, B: Backend> Pass<'a, B> {
    /// An evaluation pass: BatchNorm uses the running statistics in `state`.
    pub fn evaluation(
        params: &'a Params<B>,
        state: &'a mut [f32],
        state_layout: &'a Layout,
    ) -> Self {
        Pass {
            params,
            state,
            state_layout,
            training: false,
            sync: None,
        }
    }
}

/// Affine map `y = x W^T + b`, `W: [out, in]`, `b: [out]` (PyTorch `nn.Linear`).
#[derive(Debug, Clone)]
pub struct Linear {
    weight: usize,
    bias: usize,
    /// Input features.
    pub inputs: usize,
    /// Output features.
    pub outputs: usize,
}

impl Linear {
    /// PyTorch's default initialization: weight and bias uniform on `±1/sqrt(in)`.
    pub fn new(b: &mut Builder, name: &str, inputs: usize, outputs: usize) -> Self {
        let bound = 1.0 / (inputs as f32).sqrt();
        Self::with_init(b, name, inputs, outputs, Init::Uniform(bound))
    }

    /// Weight and bias drawn with `init` (nflows' last block layer: uniform ±1e-3).
    pub fn with_init(
        b: &mut Builder,
        name: &str,
        inputs: usize,
        outputs: usize,
        init: Init,
    ) -> Self {
        Linear {
            weight: b.param(format!("{name}.weight"), &[outputs, inputs], init),
            bias: b.param(format!("{name}.bias"), &[outputs], init),
            inputs,
            outputs,
        }
    }

    /// `x: [batch, inputs]` -> `[batch, outputs]` (float32; in mixed precision the input
    /// may be float16).
    pub fn forward<B: FusedOps>(&self, p: &Params<B>, x: Tensor<B, 2>) -> Tensor<B, 2> {
        let (w, w16) = (p.vector(self.weight), p.weight_f16(self.weight));
        B::linear_at(x, w, w16, p.vector(self.bias), p.precision())
    }

    /// `elu(x Wᵀ + b)` at the pass's precision ([`FusedOps::linear_elu_at`]; in mixed
    /// precision the output is float16, for the next layer's float16 product).
    pub fn forward_elu<B: FusedOps>(&self, p: &Params<B>, x: Tensor<B, 2>) -> Tensor<B, 2> {
        let (w, w16) = (p.vector(self.weight), p.weight_f16(self.weight));
        B::linear_elu_at(x, w, w16, p.vector(self.bias), p.precision())
    }

    /// The layout handles `(weight, bias)`.
    pub fn handles(&self) -> (usize, usize) {
        (self.weight, self.bias)
    }
}

/// Dingo's `LinearProjectionRB`: x cut into `blocks` consecutive blocks of `block_inputs`
/// values, each mapped by its own [`Linear`] (`{name}.{block}.weight` `[block_outputs,
/// block_inputs]`), outputs concatenated: `[batch, blocks block_inputs]` ->
/// `[batch, blocks block_outputs]`. Initialized like any linear layer; the reduced basis is
/// written into it by [`crate::svd::ReducedBasis::initialize`].
#[derive(Debug, Clone)]
pub struct LinearProjection {
    layers: Vec<Linear>,
    block_inputs: usize,
}

impl LinearProjection {
    /// Builds the per-block layers under `name` (e.g. `embedding_net.layers_rb`).
    pub fn new(
        b: &mut Builder,
        name: &str,
        blocks: usize,
        block_inputs: usize,
        block_outputs: usize,
    ) -> Self {
        let layers = (0..blocks)
            .map(|i| Linear::new(b, &format!("{name}.{i}"), block_inputs, block_outputs))
            .collect();
        LinearProjection {
            layers,
            block_inputs,
        }
    }

    /// Output features (all blocks).
    pub fn outputs(&self) -> usize {
        self.layers.iter().map(|l| l.outputs).sum()
    }

    /// The `(weight, bias)` handles of each block's layer.
    pub fn handles(&self) -> Vec<(usize, usize)> {
        self.layers.iter().map(Linear::handles).collect()
    }

    /// `x: [batch, blocks * block_inputs]` -> `[batch, outputs]`.
    pub fn forward<B: FusedOps>(&self, p: &Params<B>, x: Tensor<B, 2>) -> Tensor<B, 2> {
        if self.layers.len() == 1 {
            return self.layers[0].forward(p, x);
        }
        let outs = self
            .layers
            .iter()
            .enumerate()
            .map(|(i, l)| {
                l.forward(
                    p,
                    x.clone()
                        .narrow(1, i * self.block_inputs, self.block_inputs),
                )
            })
            .collect();
        Tensor::cat(outs, 1)
    }
}

/// A normalization layer over `features` (see [`Norm`]).
#[derive(Debug, Clone)]
pub enum NormLayer {
    /// Identity.
    None,
    /// LayerNorm with affine `weight`, `bias` `[features]`.
    Layer {
        /// Handle of the scale.
        weight: usize,
        /// Handle of the shift.
        bias: usize,
    },
    /// BatchNorm1d with affine parameters and running mean/variance state `[features]`.
    Batch {
        /// Handle of the scale.
        weight: usize,
        /// Handle of the shift.
        bias: usize,
        /// State handle of the running mean.
        running_mean: usize,
        /// State handle of the running (unbiased) variance.
        running_var: usize,
        /// The eps added to the variance.
        eps: f64,
    },
}

/// LayerNorm's eps (PyTorch's `LayerNorm` default).
const NORM_EPS: f64 = 1e-5;
const BN_MOMENTUM: f32 = 0.1;

impl NormLayer {
    /// A normalization of kind `norm` named `name` over `features`.
    pub fn new(b: &mut Builder, name: &str, norm: Norm, features: usize) -> Self {
        match norm {
            Norm::None => NormLayer::None,
            Norm::LayerNorm => NormLayer::Layer {
                weight: b.param(format!("{name}.weight"), &[features], Init::Constant(1.0)),
                bias: b.param(format!("{name}.bias"), &[features], Init::Constant(0.0)),
            },
            Norm::BatchNorm => NormLayer::Batch {
                weight: b.param(format!("{name}.weight"), &[features], Init::Constant(1.0)),
                bias: b.param(format!("{name}.bias"), &[features], Init::Constant(0.0)),
                running_mean: b.state(
                    format!("{name}.running_mean"),
                    &[features],
                    Init::Constant(0.0),
                ),
                running_var: b.state(
                    format!("{name}.running_var"),
                    &[features],
                    Init::Constant(1.0),
                ),
                eps: b.batch_norm_eps,
            },
        }
    }

    /// `x: [batch, features]` -> normalized `[batch, features]`.
    pub fn forward<B: NpeBackend>(&self, pass: &mut Pass<'_, B>, x: Tensor<B, 2>) -> Tensor<B, 2> {
        match *self {
            NormLayer::None => x,
            NormLayer::Layer { weight, bias } => {
                let (var, mean) = x.clone().var_mean_bias(1);
                let y = (x - mean) / var.add_scalar(NORM_EPS).sqrt();
                y * pass.params.row(weight) + pass.params.row(bias)
            }
            NormLayer::Batch {
                weight,
                bias,
                running_mean,
                running_var,
                eps,
            } => {
                if let (true, Some(reducer)) = (pass.training, pass.sync) {
                    let (xhat, stats) = B::sync_batch_norm(x, reducer, running_mean as u64, eps);
                    let handles = (running_mean, running_var);
                    update_running(pass, handles, &stats.mean, &stats.variance, stats.count);
                    return xhat * pass.params.row(weight) + pass.params.row(bias);
                }
                let device = x.device();
                let n = x.dims()[0];
                let (mean, var) = if pass.training {
                    let (var, mean) = x.clone().var_mean_bias(0);
                    let f64s = |t: &Tensor<B, 2>| -> Vec<f64> {
                        to_vec(t.clone().detach())
                            .iter()
                            .map(|&v| v as f64)
                            .collect()
                    };
                    let handles = (running_mean, running_var);
                    update_running(pass, handles, &f64s(&mean), &f64s(&var), n as f64);
                    (mean, var)
                } else {
                    let f = x.dims()[1];
                    let m = pass.state_layout.slice(pass.state, running_mean).to_vec();
                    let v = pass.state_layout.slice(pass.state, running_var).to_vec();
                    (
                        Tensor::from_data(TensorData::new(m, [1, f]), &device),
                        Tensor::from_data(TensorData::new(v, [1, f]), &device),
                    )
                };
                let y = (x - mean) / var.add_scalar(eps).sqrt();
                y * pass.params.row(weight) + pass.params.row(bias)
            }
        }
    }

    /// `elu(norm(x))`: the block's normalization with the ELU after it. LayerNorm on a
    /// backend with [`FusedOps::LAYER_KERNELS`] is one operation (one kernel each way, the
    /// ELU in float32 also under mixed precision, where the normalization's output is
    /// float32 anyway); otherwise [`NormLayer::forward`] and then ELU at the pass's
    /// precision ([`FusedOps::elu_at`]: float16 output in mixed precision, read by the
    /// linear layer that follows as it is).
    pub fn forward_elu<B: NpeBackend>(
        &self,
        pass: &mut Pass<'_, B>,
        x: Tensor<B, 2>,
    ) -> Tensor<B, 2> {
        if let (NormLayer::Layer { weight, bias }, true) = (self, B::LAYER_KERNELS) {
            let (w, b) = (pass.params.vector(*weight), pass.params.vector(*bias));
            return B::fused_layer_norm(x, w, b, NORM_EPS, true);
        }
        let at = pass.params.precision();
        B::elu_at(self.forward(pass, x), at)
    }
}

/// Updates a BatchNorm layer's running statistics (state handles `(mean, var)`) from a
/// batch of `count` samples with per-channel `mean` and biased `variance` `[features]`, as
/// PyTorch `BatchNorm1d`: momentum 0.1, the variance made unbiased by `count / (count - 1)`.
fn update_running<B: Backend>(
    pass: &mut Pass<'_, B>,
    (running_mean, running_var): (usize, usize),
    mean: &[f64],
    variance: &[f64],
    count: f64,
) {
    let unbias = if count > 1.0 {
        count / (count - 1.0)
    } else {
        1.0
    };
    let m = BN_MOMENTUM as f64;
    let blend = |r: &mut f32, x: f64| *r = ((1.0 - m) * *r as f64 + m * x) as f32;
    let rm = pass.state_layout.slice_mut(pass.state, running_mean);
    rm.iter_mut().zip(mean).for_each(|(r, &x)| blend(r, x));
    let rv = pass.state_layout.slice_mut(pass.state, running_var);
    rv.iter_mut()
        .zip(variance)
        .for_each(|(r, &x)| blend(r, x * unbias));
}

/// Residual block (nflows `ResidualBlock`, as used by Dingo):
/// `t = lin1(elu(norm1(lin0(elu(norm0(x)))))`, optionally gated by the context,
/// `t = t * sigmoid(ctx(context))` (the GLU of `cat(t, ctx(context))`), output `x + t`.
/// The last linear layer starts uniform on ±1e-3, so each block starts near the identity.
#[derive(Debug, Clone)]
pub struct ResidualBlock {
    norm0: NormLayer,
    linear0: Linear,
    norm1: NormLayer,
    linear1: Linear,
    context: Option<Linear>,
}

impl ResidualBlock {
    /// A block over `features`, with a context gate when `context_features` is given.
    pub fn new(
        b: &mut Builder,
        name: &str,
        features: usize,
        context_features: Option<usize>,
        norm: Norm,
    ) -> Self {
        let context =
            context_features.map(|c| Linear::new(b, &format!("{name}.context_layer"), c, features));
        let norm0 = NormLayer::new(b, &format!("{name}.norm_layers.0"), norm, features);
        let norm1 = NormLayer::new(b, &format!("{name}.norm_layers.1"), norm, features);
        let linear0 = Linear::new(b, &format!("{name}.linear_layers.0"), features, features);
        let linear1 = Linear::with_init(
            b,
            &format!("{name}.linear_layers.1"),
            features,
            features,
            Init::Uniform(1e-3),
        );
        ResidualBlock {
            norm0,
            linear0,
            norm1,
            linear1,
            context,
        }
    }

    /// `x: [batch, features]`, `context: [batch, context_features]` -> `[batch, features]`.
    pub fn forward<B: NpeBackend>(
        &self,
        pass: &mut Pass<'_, B>,
        x: Tensor<B, 2>,
        context: Option<&Tensor<B, 2>>,
    ) -> Tensor<B, 2> {
        let t = self.norm0.forward_elu(pass, x.clone());
        let at = pass.params.precision();
        // On a backend with the layer kernels: the second ELU with the first linear layer's
        // bias in one kernel (without a normalization between them; in mixed precision its
        // output float16, read by the next float16 product as it is), and in float32 passes
        // the residual end in one.
        let kernels = B::LAYER_KERNELS && at == Precision::F32;
        let t = match (&self.norm1, B::LAYER_KERNELS) {
            (NormLayer::None, true) => self.linear0.forward_elu(pass.params, t),
            _ => {
                let t = self.linear0.forward(pass.params, t);
                self.norm1.forward_elu(pass, t)
            }
        };
        if let (Some(layer), Some(c)) = (&self.context, context) {
            // The gated tail's kernel also in mixed precision (its block product float16).
            if B::LAYER_KERNELS {
                let p = pass.params;
                let ((w1, b1), (wc, bc)) = (self.linear1.handles(), layer.handles());
                let (w1, w1_f16, b1) = (p.vector(w1), p.weight_f16(w1), p.vector(b1));
                let (wc, bc) = (p.vector(wc), p.vector(bc));
                return B::gated_residual(x, t, w1, w1_f16, b1, c.clone(), wc, bc, at);
            }
            let t = self.linear1.forward(pass.params, t);
            return x + t * B::sigmoid_at(layer.forward(pass.params, c.clone()), at);
        }
        if kernels {
            let (w1, b1) = self.linear1.handles();
            return B::linear_residual(x, t, pass.params.vector(w1), pass.params.vector(b1));
        }
        x + self.linear1.forward(pass.params, t)
    }
}

/// Dingo's embedding network (`DenseResidualNet`): `initial_layer: in -> hidden_dims[0]`, then
/// for each block `n` a [`ResidualBlock`] of width `hidden_dims[n]` followed by a resize layer
/// (linear to `hidden_dims[n+1]` when the width changes, identity otherwise; the last one is
/// linear to `output_dim`). `[batch, input_dim]` -> `[batch, output_dim]`.
#[derive(Debug, Clone)]
pub struct DenseResidualNet {
    initial: Linear,
    blocks: Vec<ResidualBlock>,
    resize: Vec<Option<Linear>>,
}

impl DenseResidualNet {
    /// Builds the network under `name` (e.g. `embedding`). `hidden_dims` must be non-empty.
    pub fn new(
        b: &mut Builder,
        name: &str,
        input_dim: usize,
        hidden_dims: &[usize],
        output_dim: usize,
        norm: Norm,
    ) -> Self {
        let initial = Linear::new(
            b,
            &format!("{name}.initial_layer"),
            input_dim,
            hidden_dims[0],
        );
        let mut blocks = Vec::new();
        let mut resize = Vec::new();
        for (n, &h) in hidden_dims.iter().enumerate() {
            blocks.push(ResidualBlock::new(
                b,
                &format!("{name}.blocks.{n}"),
                h,
                None,
                norm,
            ));
        }
        for n in 0..hidden_dims.len() {
            let from = hidden_dims[n];
            let to = hidden_dims.get(n + 1).copied().unwrap_or(output_dim);
            let last = n + 1 == hidden_dims.len();
            resize.push(if from != to || last {
                Some(Linear::new(
                    b,
                    &format!("{name}.resize_layers.{n}"),
                    from,
                    to,
                ))
            } else {
                None
            });
        }
        DenseResidualNet {
            initial,
            blocks,
            resize,
        }
    }

    /// `x: [batch, input_dim]` -> `[batch, output_dim]`.
    pub fn forward<B: NpeBackend>(&self, pass: &mut Pass<'_, B>, x: Tensor<B, 2>) -> Tensor<B, 2> {
        let mut x = self.initial.forward(pass.params, x);
        for (block, resize) in self.blocks.iter().zip(&self.resize) {
            x = block.forward(pass, x, None);
            if let Some(l) = resize {
                x = l.forward(pass.params, x);
            }
        }
        x
    }
}

/// The widths of a [`ResidualNet`].
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ResidualNetShape {
    /// Input features (the untransformed θ components).
    pub inputs: usize,
    /// Context features (the embedding's output).
    pub context: usize,
    /// Hidden width.
    pub hidden: usize,
    /// Output features (`3K - 1` per transformed component).
    pub outputs: usize,
    /// Residual blocks.
    pub num_blocks: usize,
    /// Normalization inside the blocks.
    pub norm: Norm,
}

/// nflows' `ResidualNet`, the conditioner of each coupling transform:
/// `initial_layer: cat(x, context) -> hidden`, `num_blocks` context-gated [`ResidualBlock`]s,
/// `final_layer: hidden -> out`. `[batch, in] x [batch, context] -> [batch, out]`.
#[derive(Debug, Clone)]
pub struct ResidualNet {
    initial: Linear,
    blocks: Vec<ResidualBlock>,
    final_layer: Linear,
    /// Hidden width (the spline divides its bin logits by `sqrt(hidden)`, as nflows does).
    pub hidden: usize,
}

impl ResidualNet {
    /// Builds the conditioner under `name`.
    pub fn new(b: &mut Builder, name: &str, shape: ResidualNetShape) -> Self {
        let ResidualNetShape {
            inputs,
            context,
            hidden,
            outputs,
            num_blocks,
            norm,
        } = shape;
        let initial = Linear::new(
            b,
            &format!("{name}.initial_layer"),
            inputs + context,
            hidden,
        );
        let blocks = (0..num_blocks)
            .map(|n| {
                ResidualBlock::new(
                    b,
                    &format!("{name}.blocks.{n}"),
                    hidden,
                    Some(context),
                    norm,
                )
            })
            .collect();
        let final_layer = Linear::new(b, &format!("{name}.final_layer"), hidden, outputs);
        ResidualNet {
            initial,
            blocks,
            final_layer,
            hidden,
        }
    }

    /// `x: [batch, inputs]`, `context: [batch, context]` -> `[batch, outputs]`.
    pub fn forward<B: NpeBackend>(
        &self,
        pass: &mut Pass<'_, B>,
        x: Tensor<B, 2>,
        context: &Tensor<B, 2>,
    ) -> Tensor<B, 2> {
        self.forward_input(pass, Tensor::cat(vec![x, context.clone()], 1), context)
    }

    /// [`ResidualNet::forward`] from the concatenated input `cat(x, context): [batch,
    /// inputs + context]` (built by one kernel on the GPU,
    /// [`crate::fused_ops::FusedOps::coupling_split`]) -> `[batch, outputs]`.
    pub fn forward_input<B: NpeBackend>(
        &self,
        pass: &mut Pass<'_, B>,
        input: Tensor<B, 2>,
        context: &Tensor<B, 2>,
    ) -> Tensor<B, 2> {
        let h = self.hidden(pass, input, context);
        self.final_layer.forward(pass.params, h)
    }

    /// [`ResidualNet::forward_input`] with the final layer's bias apart where the pass runs
    /// float32 on a backend with the layer kernels: `(h W_finalᵀ, Some(bias))` for the
    /// spline kernel to add the bias as it reads the product
    /// ([`crate::fused_ops::FusedOps::spline_joint`]), else `(output, None)`.
    pub fn forward_input_unbiased<B: NpeBackend>(
        &self,
        pass: &mut Pass<'_, B>,
        input: Tensor<B, 2>,
        context: &Tensor<B, 2>,
    ) -> (Tensor<B, 2>, Option<Tensor<B, 1>>) {
        let h = self.hidden(pass, input, context);
        let p = pass.params;
        if B::LAYER_KERNELS && p.precision() == Precision::F32 {
            let (w, b) = self.final_layer.handles();
            return (B::linear_product(h, p.vector(w)), Some(p.vector(b)));
        }
        (self.final_layer.forward(p, h), None)
    }

    /// The last block's output `[batch, hidden]` from the concatenated input.
    fn hidden<B: NpeBackend>(
        &self,
        pass: &mut Pass<'_, B>,
        input: Tensor<B, 2>,
        context: &Tensor<B, 2>,
    ) -> Tensor<B, 2> {
        let mut h = self.initial.forward(pass.params, input);
        for block in &self.blocks {
            h = block.forward(pass, h, Some(context));
        }
        h
    }
}
