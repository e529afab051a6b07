//! Flat parameter buffers and their named, shaped views.
//!
//! The engine (lockstep-train) holds every trainable value in one flat f32 buffer and reduces
//! one flat gradient buffer per update. A [`Layout`] fixes, at model construction, the name,
//! shape and offset of every parameter in that buffer (in the order the network is built), so
//! the order is identical on every replica and in every checkpoint. [`Params`] turns the flat
//! buffer into one tensor per parameter for a forward pass (leaves that track gradients on an
//! autodiff backend) and writes their gradients back into the flat buffer in the same order:
//! packing and unpacking are one copy each.

use crate::fused_ops::Precision;
use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::tensor::{Tensor, TensorData, Transaction};

/// One named parameter: `shape` (row-major) stored at `offset .. offset + numel` of the flat
/// buffer. Names follow PyTorch's `module.submodule.weight` convention (nflows/Dingo names).
#[derive(Debug, Clone, PartialEq)]
pub struct ParamSpec {
    /// Dotted name, e.g. `embedding.blocks.0.linear_layers.0.weight`.
    pub name: String,
    /// Shape, e.g. `[out_features, in_features]` for a linear weight.
    pub shape: Vec<usize>,
    /// Offset of the first element in the flat buffer.
    pub offset: usize,
}

impl ParamSpec {
    /// Number of elements (product of the shape).
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }
}

/// The fixed order of all parameters of a network in one flat buffer.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Layout {
    specs: Vec<ParamSpec>,
    len: usize,
}

impl Layout {
    /// Appends a parameter; returns its index (a handle for [`Params::vector`] and [`Params::matrix`]).
    pub fn add(&mut self, name: impl Into<String>, shape: &[usize]) -> usize {
        let spec = ParamSpec {
            name: name.into(),
            shape: shape.to_vec(),
            offset: self.len,
        };
        self.len += spec.numel();
        self.specs.push(spec);
        self.specs.len() - 1
    }

    /// Total number of f32 values.
    pub fn len(&self) -> usize {
        self.len
    }

    /// True when the layout holds no values.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// All parameters in buffer order.
    pub fn specs(&self) -> &[ParamSpec] {
        &self.specs
    }

    /// The values of parameter `index` inside `flat`.
    pub fn slice<'a>(&self, flat: &'a [f32], index: usize) -> &'a [f32] {
        let s = &self.specs[index];
        &flat[s.offset..s.offset + s.numel()]
    }

    /// The values of parameter `index` inside `flat`, mutable.
    pub fn slice_mut<'a>(&self, flat: &'a mut [f32], index: usize) -> &'a mut [f32] {
        let s = &self.specs[index];
        &mut flat[s.offset..s.offset + s.numel()]
    }
}

/// Which parameters of a [`Layout`] train (a training stage's choice; Dingo's
/// `freeze_rb_layer` and frozen blocks) and where each lives: the trainable ones packed in
/// layout order into the engine's trainable buffer, the frozen ones packed into the frozen
/// buffer. With nothing frozen the trainable buffer is the layout's flat buffer itself.
#[derive(Debug, Clone, PartialEq)]
pub struct Partition {
    /// Per parameter: trainable?
    trainable: Vec<bool>,
    /// Per parameter: offset in its buffer (trainable or frozen).
    offsets: Vec<usize>,
    trainable_len: usize,
    frozen_len: usize,
}

impl Partition {
    /// Every parameter trainable.
    pub fn all_trainable(layout: &Layout) -> Partition {
        Self::with(layout, |_| true)
    }

    /// The parameters whose dotted name equals a prefix or starts with `prefix.` are frozen;
    /// the rest train. Returns the partition and, per prefix, how many parameters it froze.
    pub fn freezing(layout: &Layout, prefixes: &[String]) -> (Partition, Vec<usize>) {
        let matches = |name: &str, p: &str| {
            name == p || (name.starts_with(p) && name.as_bytes().get(p.len()) == Some(&b'.'))
        };
        let counts = prefixes
            .iter()
            .map(|p| {
                layout
                    .specs()
                    .iter()
                    .filter(|s| matches(&s.name, p))
                    .count()
            })
            .collect();
        let part = Self::with(layout, |name| !prefixes.iter().any(|p| matches(name, p)));
        (part, counts)
    }

    fn with(layout: &Layout, trains: impl Fn(&str) -> bool) -> Partition {
        let (mut t, mut f) = (0, 0);
        let mut trainable = Vec::with_capacity(layout.specs().len());
        let mut offsets = Vec::with_capacity(layout.specs().len());
        for s in layout.specs() {
            let on = trains(&s.name);
            let len = if on { &mut t } else { &mut f };
            offsets.push(*len);
            *len += s.numel();
            trainable.push(on);
        }
        Partition {
            trainable,
            offsets,
            trainable_len: t,
            frozen_len: f,
        }
    }

    /// Values in the trainable buffer.
    pub fn trainable_len(&self) -> usize {
        self.trainable_len
    }

    /// Values in the frozen buffer.
    pub fn frozen_len(&self) -> usize {
        self.frozen_len
    }

    /// Whether parameter `index` trains.
    pub fn is_trainable(&self, index: usize) -> bool {
        self.trainable[index]
    }

    /// Where parameter `index` starts in its buffer (the trainable or the frozen one).
    pub fn offset(&self, index: usize) -> usize {
        self.offsets[index]
    }

    /// Parameter `index` (of `numel` values) inside `trainable` or `frozen`.
    fn slice<'a>(
        &self,
        index: usize,
        numel: usize,
        trainable: &'a [f32],
        frozen: &'a [f32],
    ) -> &'a [f32] {
        let o = self.offsets[index];
        let buf = if self.trainable[index] {
            trainable
        } else {
            frozen
        };
        &buf[o..o + numel]
    }

    /// Splits the layout's flat buffer into (trainable, frozen) buffers.
    pub fn split(&self, layout: &Layout, flat: &[f32]) -> (Vec<f32>, Vec<f32>) {
        let mut t = vec![0.0; self.trainable_len];
        let mut f = vec![0.0; self.frozen_len];
        for (i, s) in layout.specs().iter().enumerate() {
            let o = self.offsets[i];
            let buf = if self.trainable[i] { &mut t } else { &mut f };
            buf[o..o + s.numel()].copy_from_slice(layout.slice(flat, i));
        }
        (t, f)
    }

    /// Joins (trainable, frozen) buffers back into the layout's flat buffer.
    pub fn join(&self, layout: &Layout, trainable: &[f32], frozen: &[f32]) -> Vec<f32> {
        let mut flat = vec![0.0; layout.len()];
        for (i, s) in layout.specs().iter().enumerate() {
            layout.slice_mut(&mut flat, i).copy_from_slice(self.slice(
                i,
                s.numel(),
                trainable,
                frozen,
            ));
        }
        flat
    }
}

/// One tensor per parameter of a [`Layout`], made from a flat buffer for one forward pass.
#[derive(Debug, Clone)]
pub struct Params<B: Backend> {
    tensors: Vec<Tensor<B, 1>>,
    shapes: Vec<Vec<usize>>,
    /// The precision the linear layers and activations of the pass compute in.
    precision: Precision,
    /// Per parameter, its float16 copy where the pass made them (mixed precision on a
    /// device: [`crate::resident::Resident::params_f16`]); empty otherwise.
    halves: Vec<Option<Tensor<B, 1>>>,
}

impl<B: Backend> Params<B> {
    /// One tensor per parameter of `layout`, in its order (`tensors[i]` holds parameter
    /// `i`'s values, `[numel]`).
    ///
    /// Panics when the count differs from the layout's.
    pub fn from_tensors(layout: &Layout, tensors: Vec<Tensor<B, 1>>) -> Self {
        assert_eq!(
            tensors.len(),
            layout.specs().len(),
            "one tensor per parameter"
        );
        Params {
            tensors,
            shapes: layout.specs().iter().map(|s| s.shape.clone()).collect(),
            precision: Precision::F32,
            halves: Vec::new(),
        }
    }

    /// The tensors, one per parameter in the layout's order.
    pub fn tensors(&self) -> &[Tensor<B, 1>] {
        &self.tensors
    }

    /// Copies every parameter of `layout` out of `flat` (length `layout.len()`) onto `device`.
    pub fn from_flat(layout: &Layout, flat: &[f32], device: &B::Device) -> Self {
        assert_eq!(
            flat.len(),
            layout.len(),
            "flat buffer does not match the layout"
        );
        let tensors = layout
            .specs()
            .iter()
            .map(|s| {
                let v = flat[s.offset..s.offset + s.numel()].to_vec();
                Tensor::<B, 1>::from_data(TensorData::new(v, [s.numel()]), device)
            })
            .collect();
        Params {
            tensors,
            shapes: layout.specs().iter().map(|s| s.shape.clone()).collect(),
            precision: Precision::F32,
            halves: Vec::new(),
        }
    }

    /// These parameters for a pass whose linear layers and activations compute at
    /// `precision` (default [`Precision::F32`]; [`Precision::Half`] for mixed precision).
    #[must_use]
    pub fn with_precision(mut self, precision: Precision) -> Self {
        self.precision = precision;
        self
    }

    /// The precision of the pass's linear layers and activations.
    pub fn precision(&self) -> Precision {
        self.precision
    }

    /// These parameters with their float16 copies (`halves[i]` parameter `i`'s values in
    /// float16, `[numel]`, not tracked by autodiff; `None` where there is none), which a
    /// mixed-precision pass's linear layers read in place of casting their weights one by
    /// one ([`crate::fused_ops::FusedOps::linear_at`]).
    ///
    /// Panics when the count differs from the parameters'.
    #[must_use]
    pub fn with_halves(mut self, halves: Vec<Option<Tensor<B, 1>>>) -> Self {
        assert_eq!(halves.len(), self.tensors.len(), "one entry per parameter");
        self.halves = halves;
        self
    }

    /// Parameter `index`'s float16 copy `[numel]` when the pass computes at
    /// [`Precision::Half`] and made one ([`Params::with_halves`]), else `None`.
    pub fn weight_f16(&self, index: usize) -> Option<Tensor<B, 1>> {
        match self.precision {
            Precision::Half => self.halves.get(index).cloned().flatten(),
            Precision::F32 => None,
        }
    }

    /// Parameter `index` as a 1-D tensor `[numel]`.
    pub fn vector(&self, index: usize) -> Tensor<B, 1> {
        self.tensors[index].clone()
    }

    /// Parameter `index` as a 2-D tensor of its stored shape (`[rows, cols]`).
    pub fn matrix(&self, index: usize) -> Tensor<B, 2> {
        let s = &self.shapes[index];
        assert_eq!(s.len(), 2, "parameter {index} is not a matrix");
        self.tensors[index].clone().reshape([s[0], s[1]])
    }

    /// Parameter `index` as a row `[1, numel]` (broadcast over a batch).
    pub fn row(&self, index: usize) -> Tensor<B, 2> {
        self.tensors[index].clone().unsqueeze_dim(0)
    }
}

impl<B: AutodiffBackend> Params<B> {
    /// Like [`Params::from_flat`], with every tensor a gradient-tracking leaf.
    pub fn leaves(layout: &Layout, flat: &[f32], device: &B::Device) -> Self {
        let mut p = Self::from_flat(layout, flat, device);
        p.tensors = p.tensors.into_iter().map(|t| t.require_grad()).collect();
        p
    }

    /// The parameters of `layout` from the `partition`'s (trainable, frozen) buffers, the
    /// trainable ones gradient-tracking leaves and the frozen ones constants (the backward
    /// pass computes no gradient for them).
    pub fn partitioned_leaves(
        layout: &Layout,
        partition: &Partition,
        trainable: &[f32],
        frozen: &[f32],
        device: &B::Device,
    ) -> Self {
        let tensors = layout
            .specs()
            .iter()
            .enumerate()
            .map(|(i, s)| {
                let v = partition.slice(i, s.numel(), trainable, frozen).to_vec();
                let t = Tensor::<B, 1>::from_data(TensorData::new(v, [s.numel()]), device);
                if partition.is_trainable(i) {
                    t.require_grad()
                } else {
                    t
                }
            })
            .collect();
        Params {
            tensors,
            shapes: layout.specs().iter().map(|s| s.shape.clone()).collect(),
            precision: Precision::F32,
            halves: Vec::new(),
        }
    }

    /// [`Params::partitioned_leaves`] for a device backend: every parameter crosses to the
    /// device in one call, without kernels ([`crate::fused_ops::FusedOps::upload_vectors`]:
    /// one allocation and one transfer on burn's GPU backends), instead of one transfer per
    /// parameter or a copy kernel per parameter cut out of one uploaded buffer.
    pub fn partitioned_leaves_packed(
        layout: &Layout,
        partition: &Partition,
        trainable: &[f32],
        frozen: &[f32],
        device: &B::Device,
    ) -> Self
    where
        B::InnerBackend: crate::fused_ops::FusedOps,
    {
        use crate::fused_ops::FusedOps;
        let slices: Vec<&[f32]> = layout
            .specs()
            .iter()
            .enumerate()
            .map(|(i, s)| partition.slice(i, s.numel(), trainable, frozen))
            .collect();
        let tensors = B::InnerBackend::upload_vectors(&slices, device)
            .into_iter()
            .enumerate()
            .map(|(i, t)| {
                let t = Tensor::<B, 1>::from_inner(t);
                if partition.is_trainable(i) {
                    t.require_grad()
                } else {
                    t
                }
            })
            .collect();
        Params {
            tensors,
            shapes: layout.specs().iter().map(|s| s.shape.clone()).collect(),
            precision: Precision::F32,
            halves: Vec::new(),
        }
    }

    /// [`Params::write_partitioned_gradients`] for a device backend, with whatever else the
    /// step needs from the device read in the same transfer: the trainable parameters'
    /// gradients and every tensor of `also` are read back together ([`read_together`]: one
    /// host synchronisation, and no packing kernels: each buffer is copied to the host as it
    /// is) and the gradients are written at their offsets in `grad` (length
    /// `partition.trainable_len()`; zeros, written on the host, for a parameter the loss
    /// does not depend on). Returns the values of `also`, in order, as f32.
    pub fn read_partitioned_gradients_with(
        &self,
        layout: &Layout,
        partition: &Partition,
        grads: &mut B::Gradients,
        grad: &mut [f32],
        also: Vec<Tensor<B::InnerBackend, 1>>,
    ) -> Vec<Vec<f32>> {
        let mut read = Vec::new();
        let mut slots = Vec::new();
        for (i, (t, s)) in self.tensors.iter().zip(layout.specs()).enumerate() {
            if !partition.is_trainable(i) {
                continue;
            }
            let o = partition.offsets[i];
            match t.grad_remove(grads) {
                Some(g) => {
                    read.push(g);
                    slots.push(o..o + s.numel());
                }
                None => grad[o..o + s.numel()].fill(0.0),
            }
        }
        let n_grads = read.len();
        if n_grads > 0 {
            crate::device::count_gradient_read();
        }
        read.extend(also);
        let mut values = read_together(read);
        let rest = values.split_off(n_grads);
        for (slot, v) in slots.into_iter().zip(values) {
            grad[slot].copy_from_slice(&v);
        }
        rest
    }

    /// Moves the gradients of the `partition`'s trainable parameters out of `grads` into the
    /// packed trainable gradient `grad` (length `partition.trainable_len()`).
    pub fn write_partitioned_gradients(
        &self,
        layout: &Layout,
        partition: &Partition,
        grads: &mut B::Gradients,
        grad: &mut [f32],
    ) {
        for (i, (t, s)) in self.tensors.iter().zip(layout.specs()).enumerate() {
            if partition.is_trainable(i) {
                let o = partition.offsets[i];
                move_gradient(t, grads, &mut grad[o..o + s.numel()]);
            }
        }
    }

    /// Moves the gradient of every leaf out of `grads` into `grad` (length `layout.len()`) at
    /// the layout's offsets; a parameter the loss does not depend on gets zeros.
    ///
    /// The gradients are removed from `grads`, so each tensor's buffer is owned here and is
    /// read without a copy (reading a gradient still shared with `grads` makes the CPU
    /// backend copy it element by element: ~20% of a training step in `lockstep bench npe`).
    pub fn write_gradients(&self, layout: &Layout, grads: &mut B::Gradients, grad: &mut [f32]) {
        for (t, s) in self.tensors.iter().zip(layout.specs()) {
            move_gradient(t, grads, &mut grad[s.offset..s.offset + s.numel()]);
        }
    }
}

/// Moves the gradient of leaf `t` out of `grads` into `out` (zeros when the loss does not
/// depend on it).
fn move_gradient<B: AutodiffBackend>(t: &Tensor<B, 1>, grads: &mut B::Gradients, out: &mut [f32]) {
    match t.grad_remove(grads) {
        Some(g) => {
            crate::device::count_host_read();
            let data = g.into_data();
            match data.as_slice::<f32>() {
                Ok(v) => out.copy_from_slice(v),
                Err(_) => {
                    let v = data.convert::<f32>();
                    out.copy_from_slice(v.as_slice::<f32>().unwrap_or(&[]));
                }
            }
        }
        None => out.iter_mut().for_each(|x| *x = 0.0),
    }
}

/// Reads a tensor back to the host as f32 values (row-major): one host synchronisation on
/// a device backend, counted by [`crate::device::host_reads`].
pub fn to_vec<B: Backend, const D: usize>(t: Tensor<B, D>) -> Vec<f32> {
    crate::device::count_host_read();
    let data = t.into_data().convert::<f32>();
    data.to_vec::<f32>().unwrap_or_default()
}

/// Reads the 1-D `tensors` back to the host in one transfer (burn's [`Transaction`]: on the
/// CubeCL backends every buffer is queued for copying and the host waits once), as f32
/// values in the order given; `[]` without a read for no tensors. One host synchronisation,
/// counted by [`crate::device::host_reads`]; a tensor that is not contiguous is made so by
/// one kernel first.
pub fn read_together<B: Backend>(tensors: Vec<Tensor<B, 1>>) -> Vec<Vec<f32>> {
    if tensors.is_empty() {
        return Vec::new();
    }
    crate::device::count_host_read();
    let transaction = tensors
        .into_iter()
        .fold(Transaction::<B>::default(), |tr, t| tr.register(t));
    transaction
        .execute()
        .into_iter()
        .map(|d| match d.as_slice::<f32>() {
            Ok(v) => v.to_vec(),
            Err(_) => d.convert::<f32>().to_vec::<f32>().unwrap_or_default(),
        })
        .collect()
}
