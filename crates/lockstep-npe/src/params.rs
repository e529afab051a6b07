//! Flat parameter buffers and their named, shaped views.
//!
//! The engine (lockstep-train) holds every trainable value in one flat f32 buffer and reduces
//! one flat gradient buffer per update. A [`Layout`] fixes, at model construction, the name,
//! shape and offset of every parameter in that buffer (in the order the network is built), so
//! the order is identical on every replica and in every checkpoint. [`Params`] turns the flat
//! buffer into one tensor per parameter for a forward pass (leaves that track gradients on an
//! autodiff backend) and writes their gradients back into the flat buffer in the same order:
//! packing and unpacking are one copy each.

use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::tensor::{Tensor, TensorData};

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

/// One tensor per parameter of a [`Layout`], made from a flat buffer for one forward pass.
#[derive(Debug, Clone)]
pub struct Params<B: Backend> {
    tensors: Vec<Tensor<B, 1>>,
    shapes: Vec<Vec<usize>>,
}

impl<B: Backend> Params<B> {
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

    /// Moves the gradient of every leaf out of `grads` into `grad` (length `layout.len()`) at
    /// the layout's offsets; a parameter the loss does not depend on gets zeros.
    ///
    /// The gradients are removed from `grads`, so each tensor's buffer is owned here and is
    /// read without a copy (reading a gradient still shared with `grads` makes the CPU
    /// backend copy it element by element: ~20% of a training step in `lockstep bench npe`).
    pub fn write_gradients(&self, layout: &Layout, grads: &mut B::Gradients, grad: &mut [f32]) {
        for (t, s) in self.tensors.iter().zip(layout.specs()) {
            let out = &mut grad[s.offset..s.offset + s.numel()];
            match t.grad_remove(grads) {
                Some(g) => {
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
    }
}

/// Reads a tensor back to the host as f32 values (row-major).
pub fn to_vec<B: Backend, const D: usize>(t: Tensor<B, D>) -> Vec<f32> {
    let data = t.into_data().convert::<f32>();
    data.to_vec::<f32>().unwrap_or_default()
}
