//! `lockstep-snn`: GLIF3 / LIF point-neuron networks for lockstep.
//!
//! * NEST-exact forward dynamics of `nest:glif_psc` (GLIF1/GLIF3) and `nest:iaf_psc_alpha`
//!   on NEST's time grid (`../shared/GLIF3.md`, NEST 3.x sources): [`model`], [`step`], [`nest`].
//! * Networks in CSR form per presynaptic source, grouped by delay and receptor port:
//!   [`network`]; inputs from spike files and counter-based Poisson sources: [`input`].
//! * Batched trials `[batch, neuron]`, optionally parallel over trials: [`sim`].
//! * SONATA adapter and `lockstep simulate`: [`sonata`], [`mod@simulate`].
//! * BPTT with surrogate gradients, losses, segmented recompute: [`train`], [`loss`].
//!
//! The single-step update is generic over [`scalar::Scalar`] (f32, f64, `num_dual::Dual64`),
//! so the forward-mode dual-number oracle runs the very code the simulator runs.

#![warn(missing_docs)]

pub mod bench_net;
pub mod error;
pub mod input;
pub mod loss;
pub mod model;
pub mod nest;
pub mod network;
pub mod replica;
pub mod scalar;
pub mod sim;
pub mod simulate;
pub mod sonata;
pub mod step;
pub mod train;

pub use error::{Result, SnnError};
pub use input::{InputSpec, Inputs, PoissonSpec};
pub use loss::{losses_from_json, Loss, RateTarget, RateUnits};
pub use model::{CellConsts, CellModel, GlifParams, IafPscAlphaParams};
pub use network::{CellType, EdgeSpec, Network, NetworkSpec, NeuronSpec, VirtualNodeSpec};
pub use scalar::{PseudoDerivative, Scalar, Surrogate};
pub use sim::{simulate, InitialState, SimOptions, SimOutput, TrialSpikes, TrialState};
pub use simulate::{
    bench_simulate, simulate_config, BenchOptions, BenchReport, SimulateOptions, SimulationSummary,
};
pub use train::{
    bench_train, model_from_config, LossAndGrad, SnnModel, TrainBenchOptions, TrainBenchReport,
    TrainOptions,
};
