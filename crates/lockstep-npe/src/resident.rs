//! The NPE model's training state on its device ([`lockstep_train::device_state`]): the
//! trainable parameters, the gradient and the optimizer slots as packed float32 buffers on a
//! GPU backend (burn's wgpu or CUDA), so that one replica's update reads nothing of them
//! back.
//!
//! The device's packed order is the trainable buffer's (layout order, frozen parameters
//! left out), each parameter starting at a multiple of [`ALIGN`] values so that it can be
//! bound as a tensor of its own without a copy ([`FusedOps::view`]); the gaps are zeros in
//! every buffer, which the optimizer keeps at zero. A pass's trainable leaves are views of
//! the parameter buffer (no upload); each leaf's gradient is written into its place in the
//! gradient buffer, up to 16 gradients per kernel ([`FusedOps::pack_many_into`]: a copy for
//! an update's first micro-batch, an addition for the later ones); the update is one kernel over the whole
//! buffer ([`FusedOps::optimizer_update`]).

use crate::fused_ops::FusedOps;
use crate::params::{read_together, to_vec, Layout, Params, Partition};
use burn::tensor::{Tensor, TensorData};
use lockstep_train::DeviceUpdate;

/// The alignment of every parameter in the device's packed buffers, in values: 128, so that
/// a parameter starts at a multiple of 256 bytes (the largest minimum storage-buffer offset
/// alignment adapters ask for) in the float32 buffers and in the parameters' float16 copy
/// ([`Resident::params_f16`]) alike.
pub const ALIGN: usize = 128;

/// The packed training state of one replica on its device (see the [module docs](self)).
pub struct Resident<B: FusedOps> {
    /// Per parameter of the layout: `(offset in the host's trainable buffer, offset on the
    /// device, values)` when it trains.
    places: Vec<Option<(usize, usize, usize)>>,
    /// Values in the host's trainable buffer.
    host_len: usize,
    /// Values in each device buffer (gaps included).
    len: usize,
    params: Tensor<B, 1>,
    slots: Vec<Tensor<B, 1>>,
    grad: Tensor<B, 1>,
    /// The next gradient written starts a new update (a copy, not an addition).
    fresh: bool,
    /// Whether the gradient so far is finite, when the last pass read it with its loss.
    finite: Option<bool>,
}

impl<B: FusedOps> Resident<B> {
    /// Uploads the `trainable` buffer (`[partition.trainable_len()]`) and the optimizer
    /// `slots` (each as long) of `layout` split by `partition` onto `device`, with a zero
    /// gradient. One transfer per buffer.
    ///
    /// Panics when a slot's length differs from the trainable buffer's.
    pub fn new(
        layout: &Layout,
        partition: &Partition,
        trainable: &[f32],
        slots: &[Vec<f32>],
        device: &B::Device,
    ) -> Self {
        let mut len = 0;
        let places: Vec<_> = layout
            .specs()
            .iter()
            .enumerate()
            .map(|(i, s)| {
                partition.is_trainable(i).then(|| {
                    let at = len;
                    len = (len + s.numel()).div_ceil(ALIGN) * ALIGN;
                    (partition.offset(i), at, s.numel())
                })
            })
            .collect();
        let len = len.max(ALIGN);
        let upload = |values: &[f32]| {
            assert_eq!(values.len(), trainable.len(), "an optimizer slot's length");
            pad_upload::<B>(&places, len, values, device)
        };
        Resident {
            params: upload(trainable),
            slots: slots.iter().map(|s| upload(s)).collect(),
            grad: Tensor::from_data(TensorData::new(vec![0.0f32; len], [len]), device),
            places,
            host_len: trainable.len(),
            len,
            fresh: true,
            finite: None,
        }
    }

    /// The device's `padded` values into the host's packed `values`.
    fn unpad(&self, padded: &[f32], values: &mut [f32]) {
        for &(h, d, n) in self.places.iter().flatten() {
            values[h..h + n].copy_from_slice(&padded[d..d + n]);
        }
    }

    /// The parameters of a pass: the trainable ones views of the device's buffer (no copy),
    /// the frozen ones (`frozen`, the partition's frozen buffer) uploaded in one call.
    pub fn params(
        &self,
        layout: &Layout,
        partition: &Partition,
        frozen: &[f32],
        device: &B::Device,
    ) -> Params<B> {
        let slices: Vec<&[f32]> = layout
            .specs()
            .iter()
            .enumerate()
            .filter(|(i, _)| !partition.is_trainable(*i))
            .map(|(i, s)| &frozen[partition.offset(i)..partition.offset(i) + s.numel()])
            .collect();
        let mut uploaded = if slices.is_empty() {
            Vec::new()
        } else {
            B::upload_vectors(&slices, device)
        }
        .into_iter();
        let tensors = self
            .places
            .iter()
            .map(|place| match place {
                Some((_, d, n)) => B::view(&self.params, *d, *n),
                None => uploaded
                    .next()
                    .expect("one uploaded tensor per frozen parameter"),
            })
            .collect();
        Params::from_tensors(layout, tensors)
    }

    /// The trainable parameters' float16 copies for a mixed-precision pass, one cast of the
    /// whole parameter buffer (one launch, where casting each weight took one per linear
    /// layer), each a view of the copy (`[numel]`, float16); `None` for frozen parameters
    /// (their layers cast them). The entries follow the layout, as [`Resident::params`]'s.
    pub fn params_f16(&self) -> Vec<Option<Tensor<B, 1>>> {
        let half = self.params.clone().cast(burn::tensor::FloatDType::F16);
        self.places
            .iter()
            .map(|place| place.map(|(_, d, n)| B::view(&half, d, n)))
            .collect()
    }

    /// Writes the gradients of one micro-batch, `(parameter index, gradient)`, into their
    /// places in the packed gradient: a copy in an update's first pass, an addition in its
    /// later ones, `ceil(count / 16)` launches ([`FusedOps::pack_many_into`]); a missing
    /// gradient (the loss does not depend on the parameter) writes zeros in the first pass
    /// (one launch) and nothing later.
    ///
    /// Panics when a parameter does not train.
    pub fn add_gradients(&mut self, grads: Vec<(usize, Option<Tensor<B, 1>>)>) {
        let mut srcs = Vec::with_capacity(grads.len());
        for (index, grad) in grads {
            let (_, d, n) = self.places[index].expect("a trainable parameter");
            match grad {
                Some(g) => srcs.push((g.reshape([n]), d)),
                None if self.fresh => B::zero_into(&B::view(&self.grad, d, n)),
                None => {}
            }
        }
        if !srcs.is_empty() {
            B::pack_many_into(srcs, &self.grad, !self.fresh);
        }
    }

    /// Marks the end of a pass's gradient: the next pass adds to it (until
    /// [`Resident::update`]).
    pub fn end_pass(&mut self) {
        self.fresh = false;
        self.finite = None;
    }

    /// `[1]`: 1 when the gradient so far holds an infinity or NaN (one launch, not read).
    pub fn non_finite_flag(&self) -> Tensor<B, 1> {
        B::non_finite_flag(&self.grad)
    }

    /// Records the finiteness read with the pass's loss (from [`Resident::non_finite_flag`]).
    pub fn set_finite(&mut self, finite: bool) {
        self.finite = Some(finite);
    }

    /// Whether the gradient so far is finite: what the last pass read with its loss, else
    /// one launch and one read-back.
    pub fn gradient_is_finite(&mut self) -> bool {
        match self.finite {
            Some(f) => f,
            None => {
                let flag = to_vec(self.non_finite_flag());
                let f = flag.first() == Some(&0.0);
                self.finite = Some(f);
                f
            }
        }
    }

    /// Reads the gradient back into the host's packed `grad` (`[host_len]`). One
    /// read-back.
    ///
    /// Panics when `grad` has another length.
    pub fn read_gradient(&self, grad: &mut [f32]) {
        assert_eq!(grad.len(), self.host_len, "the gradient's length");
        crate::device::count_gradient_read();
        let padded = to_vec(self.grad.clone());
        self.unpad(&padded, grad);
    }

    /// Reads the parameters and the slots back into the host's packed buffers (one
    /// read-back for all).
    ///
    /// Panics on lengths that differ from the uploaded ones.
    pub fn download(&self, params: &mut [f32], slots: &mut [Vec<f32>]) {
        assert_eq!(params.len(), self.host_len, "the parameters' length");
        assert_eq!(slots.len(), self.slots.len(), "the optimizer's slots");
        let mut read = vec![self.params.clone()];
        read.extend(self.slots.iter().cloned());
        let values = read_together(read);
        self.unpad(&values[0], params);
        for (slot, v) in slots.iter_mut().zip(&values[1..]) {
            self.unpad(v, slot);
        }
    }

    /// Ends an update: applies `update` with the device's gradient, or with `reduced`
    /// (the host's, `[host_len]`, uploaded once) when given; `None` skips it. The next pass
    /// starts a new gradient.
    ///
    /// Panics when `reduced` has another length.
    pub fn update(&mut self, update: Option<&DeviceUpdate>, reduced: Option<&[f32]>) {
        if let Some(u) = update {
            let grad = match reduced {
                Some(h) => {
                    assert_eq!(h.len(), self.host_len, "the reduced gradient's length");
                    pad_upload::<B>(&self.places, self.len, h, &self.grad.device())
                }
                None => self.grad.clone(),
            };
            B::optimizer_update(&self.params, &self.slots, &grad, u);
        }
        self.fresh = true;
        self.finite = None;
    }
}

/// `values` (the host's packed order) in the device's order (`len` values, gaps zero),
/// uploaded to `device`.
fn pad_upload<B: FusedOps>(
    places: &[Option<(usize, usize, usize)>],
    len: usize,
    values: &[f32],
    device: &B::Device,
) -> Tensor<B, 1> {
    let mut padded = vec![0.0f32; len];
    for &(h, d, n) in places.iter().flatten() {
        padded[d..d + n].copy_from_slice(&values[h..h + n]);
    }
    Tensor::from_data(TensorData::new(padded, [len]), device)
}
