//! `lockstep-snn`: GLIF3 / LIF point-neuron networks for lockstep.
//!
//! What this crate guarantees:
//! * **NEST-exact forward dynamics** of `nest:glif_psc` (GLIF1/GLIF3) and
//!   `nest:iaf_psc_alpha` on NEST's time grid (`docs/neuron-models.md`, NEST 3.x sources): the
//!   same spikes, at the same steps, as NEST for the same network and inputs
//!   (`tests/reference_point450.rs`).
//! * **Reproducible trials:** trials are independent and batched `[batch, neuron]`; Poisson
//!   inputs are drawn per (seed, global sample index, node, step), so results do not depend
//!   on the thread count, the batch split or the replica count.
//! * **Exact gradients of the surrogate model:** BPTT is the hand-written adjoint of the very
//!   forward recursion the simulator runs; segmented recompute (`gradient_checkpointing`)
//!   gives bitwise the same gradients; the single-step update is generic over [`Scalar`]
//!   (f32, f64, `num_dual::Dual64`) so a dual-number oracle checks them.
//! * **Fast float32 training** (`run.dtype: float32`): batch-innermost kernels whose forward
//!   pass is bitwise the per-sample float32 one and whose gradient matches it to 1e-5
//!   relative L2, bitwise independent of the thread count (`tests/bptt_float32.rs`).
//! * **Bad input is refused, not guessed:** unsupported models, parameters, receptors, delays
//!   and config keys are errors ([`SnnError`]) naming the node type, edge, file or key.
//!
//! Layout: cell models and NEST's propagators (`model`, `nest`, `step`), networks in CSR form
//! per presynaptic source grouped by delay and receptor port (`network`), inputs (`input`),
//! the batched forward simulation (`forward`, with its f64 structure-of-arrays kernel in
//! `simulation_kernel`), BPTT and losses (`bptt`: per-sample f64 and the
//! f32 reference; `bptt_batch`: the batch-innermost float32 kernels; `loss`), the SONATA
//! adapter (`sonata`), config reading (`config`), the `lockstep simulate` run
//! (`simulate_config`) and the trainer's replica (`replica`). Every public item is
//! re-exported here, at one path.

mod all_to_all;
mod bptt;
mod bptt_batch;
mod bptt_scatter;
mod config;
mod error;
mod forward;
mod input;
mod loss;
mod model;
mod nest;
mod network;
mod replica;
mod scalar;
mod simulate_config;
mod simulation_kernel;
mod sonata;
mod step;
mod trained_simulation;

pub use all_to_all::all_to_all_glif3;
pub use bptt::{BpttOptions, Dtype, LossAndGrad, SnnModel, SpmvForm};
pub use bptt_batch::StepTiming;
pub use bptt_scatter::SCATTER_BLOCK;
pub use config::{
    loss_names, model_from_config, GradientCheckpointing, InputSection, SnnOutput, SnnRun,
    SnnTrainConfig, SnnTraining, TrainingSpikes, TRAINING_SPIKES_DIR,
};
pub use error::{Result, SnnError};
pub use forward::{
    simulate, simulate_with, InitialState, SimExtras, SimOptions, SimOutput, TrialSpikes,
    TrialState, VmRecorder, PROGRESS_CHUNK,
};
pub use input::{InputSpec, Inputs, PoissonSpec};
pub use loss::{Loss, LossesSection, RateTarget, RateUnits};
pub use model::{
    AscConsts, CellConsts, CellModel, GlifParams, IafPscAlphaParams, ModelKind, PortConsts,
    ReceptorError,
};
pub use nest::{TimeGrid, TICS_PER_MS};
pub use network::{
    CellType, Csr, EdgeSpec, Group, Network, NetworkSpec, NeuronSpec, Segment, VirtualNodeSpec,
};
pub use replica::{PoissonTrials, SnnReplica};
pub use scalar::{PseudoDerivative, Scalar, Surrogate, SurrogateSection, SurrogateSpec};
pub use simulate_config::{
    firing_rates, simulate_config, RateGroup, RateRow, ReportSummary, RunProgress, SimulateOptions,
    SimulationConfig, SimulationOutput, SimulationRun, SimulationSummary,
};
pub use sonata::{
    export_trained_weights, network_spec_from_circuit, spike_trains_for_virtual_nodes,
};
pub use trained_simulation::{write_trained_simulation_config, TRAINED_SIMULATION_CONFIG};
