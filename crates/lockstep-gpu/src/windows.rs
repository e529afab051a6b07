//! Arrays larger than one storage binding ([`Windowed`]): one buffer (up to the adapter's
//! `max_buffer_size`; [`crate::GpuContext::storage_windowed`]) bound as consecutive windows,
//! each within `max_storage_buffer_binding_size` (lavapipe: 128 MiB; NVIDIA through wgpu:
//! 2 GiB - 1; [`crate::GpuContext::max_storage`]), read and written in the kernels through
//! generated WGSL accessors (`NAME_at(i)`, `NAME_set(i, v)`) that pick the window of element
//! `i`. With one window (every array that fits one binding) the accessors are the plain
//! index. Used by the spiking network's BPTT kernels and the N-body's.

use std::fmt::Write as _;

/// Window lengths are multiples of this many elements, so that every window's byte offset
/// is a multiple of 256 (every adapter's storage offset alignment) for 4- and 8-byte
/// elements, and for the sign words of the training state (16 to a word: 256 bytes).
pub const WINDOW_ALIGN: usize = 1024;

/// One array of `len` elements of `elem_bytes` bytes bound as windows of `window` elements
/// at bindings `first_binding..` of its bind group.
#[derive(Debug, Clone)]
pub struct Windowed {
    /// The array's name in the kernels (`NAME_0`, `NAME_1`, ... and `NAME_at`).
    pub name: &'static str,
    /// Its WGSL element type (`u32`, `f32`, `f64`).
    pub wgsl_type: &'static str,
    /// Bytes per element.
    pub elem_bytes: u64,
    /// Elements.
    pub len: usize,
    /// Elements per window (a multiple of [`WINDOW_ALIGN`]).
    pub window: usize,
    /// The binding of the first window.
    pub first_binding: u32,
    /// Whether the kernels only read it.
    pub read_only: bool,
}

/// A storage-buffer entry of a compute bind group layout at `binding` (any size, no
/// dynamic offset).
pub fn storage_entry(binding: u32, read_only: bool) -> wgpu::BindGroupLayoutEntry {
    wgpu::BindGroupLayoutEntry {
        binding,
        visibility: wgpu::ShaderStages::COMPUTE,
        ty: wgpu::BindingType::Buffer {
            ty: wgpu::BufferBindingType::Storage { read_only },
            has_dynamic_offset: false,
            min_binding_size: None,
        },
        count: None,
    }
}

/// Elements per window of `elem_bytes`-byte values under a binding limit of `max_binding`
/// bytes: the largest multiple of [`WINDOW_ALIGN`] that fits (at least one multiple).
pub fn window_len(elem_bytes: u64, max_binding: u64) -> usize {
    let fit = (max_binding / elem_bytes) as usize;
    (fit / WINDOW_ALIGN).max(1) * WINDOW_ALIGN
}

/// The windows of `len` elements of `window` each: `(first element, elements)`, none for an
/// empty array.
pub fn windows_of(len: usize, window: usize) -> Vec<(usize, usize)> {
    (0..len.div_ceil(window))
        .map(|c| (c * window, window.min(len - c * window)))
        .collect()
}

impl Windowed {
    /// `len` elements of `wgsl_type` (`elem_bytes` each) under a binding limit of
    /// `max_binding` bytes, from binding `first_binding`.
    pub fn new(
        name: &'static str,
        wgsl_type: &'static str,
        elem_bytes: u64,
        len: usize,
        max_binding: u64,
        first_binding: u32,
        read_only: bool,
    ) -> Windowed {
        Windowed {
            name,
            wgsl_type,
            elem_bytes,
            len,
            window: window_len(elem_bytes, max_binding),
            first_binding,
            read_only,
        }
    }

    /// Bindings (windows) it takes: at least one.
    pub fn count(&self) -> usize {
        self.len.div_ceil(self.window).max(1)
    }

    /// The binding after its last.
    pub fn next_binding(&self) -> u32 {
        self.first_binding + self.count() as u32
    }

    /// Its declarations (group 0, bindings `first_binding..`) and accessors in WGSL.
    pub fn wgsl(&self) -> String {
        let (name, ty, w, k) = (self.name, self.wgsl_type, self.window, self.count());
        let access = if self.read_only { "read" } else { "read_write" };
        let mut s = String::new();
        for c in 0..k {
            let _ = writeln!(
                s,
                "@group(0) @binding({}) var<storage, {access}> {name}_{c}: array<{ty}>;",
                self.first_binding + c as u32
            );
        }
        // Element i: window i / w at i - c w, as a chain of comparisons (k is small).
        let _ = writeln!(s, "fn {name}_at(i: u32) -> {ty} {{");
        for c in 0..k - 1 {
            let _ = writeln!(
                s,
                "    if (i < {}u) {{ return {name}_{c}[i - {}u]; }}",
                (c + 1) * w,
                c * w
            );
        }
        let _ = writeln!(s, "    return {name}_{}[i - {}u];\n}}", k - 1, (k - 1) * w);
        if !self.read_only {
            let _ = writeln!(s, "fn {name}_set(i: u32, v: {ty}) {{");
            for c in 0..k - 1 {
                let _ = writeln!(
                    s,
                    "    if (i < {}u) {{ {name}_{c}[i - {}u] = v; return; }}",
                    (c + 1) * w,
                    c * w
                );
            }
            let _ = writeln!(s, "    {name}_{}[i - {}u] = v;\n}}", k - 1, (k - 1) * w);
        }
        s
    }

    /// Its bind group layout entries (storage buffers, compute stage).
    pub fn layout_entries(&self) -> Vec<wgpu::BindGroupLayoutEntry> {
        (0..self.count())
            .map(|c| storage_entry(self.first_binding + c as u32, self.read_only))
            .collect()
    }

    /// Its bind group entries: the windows of `buffer` (which holds at least `len` elements;
    /// the last window runs to the buffer's end).
    pub fn entries<'a>(&self, buffer: &'a wgpu::Buffer) -> Vec<wgpu::BindGroupEntry<'a>> {
        let step = self.window as u64 * self.elem_bytes;
        (0..self.count())
            .map(|c| {
                let offset = c as u64 * step;
                let size = if c + 1 == self.count() {
                    buffer.size() - offset
                } else {
                    step
                };
                wgpu::BindGroupEntry {
                    binding: self.first_binding + c as u32,
                    resource: wgpu::BindingResource::Buffer(wgpu::BufferBinding {
                        buffer,
                        offset,
                        size: wgpu::BufferSize::new(size),
                    }),
                }
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn windows_fit_the_limit_and_cover_the_array() {
        assert_eq!(window_len(8, 128 << 20), 16_777_216);
        assert!(window_len(8, 128 << 20) * 8 <= 128 << 20);
        assert_eq!(window_len(4, 100), WINDOW_ALIGN);
        assert_eq!(windows_of(0, 1024), vec![]);
        assert_eq!(
            windows_of(2500, 1024),
            vec![(0, 1024), (1024, 1024), (2048, 452)]
        );
        let w = Windowed::new("grad", "f64", 8, 24_435_130, 128 << 20, 16, false);
        assert_eq!((w.count(), w.next_binding()), (2, 18));
        let src = w.wgsl();
        assert!(src.contains("@group(0) @binding(17) var<storage, read_write> grad_1: array<f64>;"));
        assert!(src.contains("if (i < 16777216u) { return grad_0[i - 0u]; }"));
        assert!(src.contains("grad_1[i - 16777216u] = v;"));
        let one = Windowed::new("edges", "u32", 4, 10, 128 << 20, 3, true);
        assert_eq!(one.count(), 1);
        assert!(!one.wgsl().contains("_set"));
        assert!(one.wgsl().contains("return edges_0[i - 0u];"));
    }
}
