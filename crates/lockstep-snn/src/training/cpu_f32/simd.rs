//! The float32 engine's low-level helpers, at the bottom of its files (nothing here imports
//! the engine): raw shared access to disjoint ranges of a buffer ([`Shared`]), cache-line
//! aligned buffers ([`LineAligned`]), cache prefetch hints, the AVX2 check done once per call,
//! the adjoint gather of one CSR segment in register-sized blocks of lanes ([`segment_dot`])
//! and the exact division of the delivery ([`exact_div`]).
//!
//! Every `unsafe` block of the engine outside the scatter form's row update is here or
//! goes through [`Shared`], whose contract (disjoint ranges per task) the callers state.

/// Raw shared access to a buffer whose disjoint ranges are written by different tasks.
#[derive(Clone, Copy)]
pub(super) struct Shared<T>(pub(super) *mut T, pub(super) usize);

// SAFETY: the pointer is only dereferenced through `slice`, whose callers guarantee that
// ranges used at the same time by different tasks are disjoint; T is plain data.
unsafe impl<T: Send> Send for Shared<T> {}
// SAFETY: as above.
unsafe impl<T: Send> Sync for Shared<T> {}

impl<T> Shared<T> {
    pub(super) fn new(v: &mut [T]) -> Self {
        Shared(v.as_mut_ptr(), v.len())
    }
    /// Adds `v` to element `i`.
    ///
    /// # Safety
    /// No other task may access element `i` at the same time.
    #[inline]
    pub(super) unsafe fn add(&self, i: usize, v: T)
    where
        T: std::ops::AddAssign,
    {
        assert!(i < self.1, "index {i} outside 0..{}", self.1);
        // SAFETY: in bounds (checked above), exclusive by the caller's contract.
        unsafe { *self.0.add(i) += v }
    }

    /// The elements `a..b`.
    ///
    /// # Safety
    /// No other live reference may overlap `a..b` while the returned slice is used.
    #[allow(clippy::mut_from_ref)]
    pub(super) unsafe fn slice(&self, a: usize, b: usize) -> &mut [T] {
        assert!(
            a <= b && b <= self.1,
            "range {a}..{b} outside 0..{}",
            self.1
        );
        // SAFETY: in bounds (checked above), exclusive by the caller's contract.
        unsafe { std::slice::from_raw_parts_mut(self.0.add(a), b - a) }
    }
}

/// One 64-byte cache line of `f32`s.
#[derive(Clone, Copy)]
#[repr(C, align(64))]
pub(super) struct Line([f32; 16]);

/// A zeroed `f32` buffer that starts on a cache-line boundary, so that the 16-sample rows of
/// the arrival ring, its adjoint and the spikes' adjoint (64 bytes at batch 16) each fill
/// exactly one line instead of straddling two.
pub(super) struct LineAligned {
    pub(super) lines: Vec<Line>,
    pub(super) len: usize,
}

impl LineAligned {
    pub(super) fn zeros(len: usize) -> Self {
        LineAligned {
            lines: vec![Line([0.0; 16]); len.div_ceil(16)],
            len,
        }
    }
}

impl std::fmt::Debug for LineAligned {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "LineAligned({} f32)", self.len)
    }
}

impl std::ops::Deref for LineAligned {
    type Target = [f32];
    fn deref(&self) -> &[f32] {
        // SAFETY: `lines` holds `16 * lines.len() >= len` initialized f32s, contiguous
        // (`Line` is `repr(C)` over `[f32; 16]`, whose size is a multiple of its alignment).
        unsafe { std::slice::from_raw_parts(self.lines.as_ptr().cast::<f32>(), self.len) }
    }
}

impl std::ops::DerefMut for LineAligned {
    fn deref_mut(&mut self) -> &mut [f32] {
        // SAFETY: as in `deref`, and `&mut self` makes the access exclusive.
        unsafe { std::slice::from_raw_parts_mut(self.lines.as_mut_ptr().cast::<f32>(), self.len) }
    }
}

/// True when the CPU runs AVX2 (the SpMV then uses 256-bit vectors; same results, IEEE
/// operations in the same order).
pub(super) fn has_avx2() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        std::is_x86_feature_detected!("avx2")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// Edges ahead of the current one whose adjoint rows the SpMV asks the cache for: the rows
/// are random reads (a target's row per edge), so on networks whose rows do not fit in the
/// core's cache their latency is hidden only by requesting them early.
pub(super) const PREFETCH_EDGES: usize = 16;

/// Where the adjoint gather of one segment reads: `mu` (`[row, nb]`, the adjoint of the
/// arrivals), the row of the segment's delay slot and port (`row_e = base + offs[e]`), and
/// whether to ask the cache for rows ahead ([`PREFETCH_EDGES`]).
#[derive(Clone, Copy)]
pub(super) struct Gather<'a> {
    pub(super) mu: &'a [f32],
    pub(super) base: usize,
    pub(super) nb: usize,
    pub(super) prefetch: bool,
}

/// [`segment_dot`] compiled for AVX2.
///
/// # Safety
/// The CPU must support AVX2.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
pub(super) unsafe fn segment_dot_avx2(ws: &[f32], offs: &[u32], g: Gather, acc: &mut [f32]) {
    segment_dot(ws, offs, g, acc)
}

/// Stand-in where AVX2 does not exist (never called: [`has_avx2`] is false).
///
/// # Safety
/// None beyond [`segment_dot`]'s.
#[cfg(not(target_arch = "x86_64"))]
pub(super) unsafe fn segment_dot_avx2(ws: &[f32], offs: &[u32], g: Gather, acc: &mut [f32]) {
    segment_dot(ws, offs, g, acc)
}

/// The adjoint gather of one CSR segment (or of its edges into one SpMV pass) for all `nb`
/// samples: `acc[l] += (p0 + p1) + (p2 + p3) + tail` with
/// `p_k = sum_{e = k mod 4} w_e mu[row_e][l]` over whole groups of four edges and `tail`
/// over the rest, in edge order (the four partial sums of the per-sample kernel). The lanes
/// go in register-sized blocks of 16, 8, 4 and 1.
#[inline(always)]
pub(super) fn segment_dot(ws: &[f32], offs: &[u32], g: Gather, acc: &mut [f32]) {
    let mut l0 = 0;
    while l0 < g.nb {
        let rem = g.nb - l0;
        l0 += if rem >= 16 {
            segment_dot_lanes::<16>(ws, offs, g, l0, acc)
        } else if rem >= 8 {
            segment_dot_lanes::<8>(ws, offs, g, l0, acc)
        } else if rem >= 4 {
            segment_dot_lanes::<4>(ws, offs, g, l0, acc)
        } else {
            segment_dot_lanes::<1>(ws, offs, g, l0, acc)
        };
    }
}

/// Asks the cache for the line holding `v[i]` (no effect on results; nothing when `i` is
/// out of range).
#[inline(always)]
pub(super) fn prefetch<T>(v: &[T], i: usize) {
    if let Some(x) = v.get(i) {
        prefetch_ptr(x);
    }
}

/// Asks the cache for the line at `p` (nothing where the target has no prefetch
/// instruction). A hint: nothing is read, so any address is harmless.
#[inline(always)]
pub(super) fn prefetch_ptr<T>(p: *const T) {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: `_mm_prefetch` only hints the cache (SSE, in every x86_64 CPU); it never
    // faults and reads nothing.
    unsafe {
        std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T0 }>(p.cast::<i8>())
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = p;
}

/// Asks the cache for every line of the edge slots `a..b` of a CSR (target offsets `offs`
/// and weights `ws`, both indexed by slot): a piece of a source's edges that the kernel
/// reads next. Pieces of different sources lie apart in memory, so the hardware's stream
/// prefetcher does not fetch them; on V1-sized networks their misses would otherwise
/// dominate the delivery.
#[inline(always)]
pub(super) fn prefetch_edges(offs: &[u32], ws: &[f32], a: usize, b: usize) {
    // 16 slots of 4 bytes per 64-byte line; the last slot covers a piece straddling a line.
    for e in (a..b).step_by(16).chain((b > a).then(|| b - 1)) {
        prefetch(offs, e);
        prefetch(ws, e);
    }
}

/// [`segment_dot`] for lanes `l0 .. l0 + L`; returns `L`.
#[inline(always)]
pub(super) fn segment_dot_lanes<const L: usize>(
    ws: &[f32],
    offs: &[u32],
    g: Gather,
    l0: usize,
    acc: &mut [f32],
) -> usize {
    let (mu, base, nb) = (g.mu, g.base, g.nb);
    let mut p = [[0.0f32; L]; 4];
    let mut tail = [0.0f32; L];
    let row = |off: u32| -> &[f32; L] {
        let r = (base + off as usize) * nb + l0;
        mu[r..r + L].try_into().expect("L lanes")
    };
    let mut w4 = ws.chunks_exact(4);
    let mut o4 = offs.chunks_exact(4);
    let ahead = if g.prefetch {
        offs.get(PREFETCH_EDGES..).unwrap_or(&[])
    } else {
        &[]
    };
    for (q, (w, o)) in (&mut w4).zip(&mut o4).enumerate() {
        for &off in ahead.get(4 * q..4 * q + 4).unwrap_or(&[]) {
            prefetch(mu, (base + off as usize) * nb + l0);
        }
        for k in 0..4 {
            let m = row(o[k]);
            for l in 0..L {
                p[k][l] += w[k] * m[l];
            }
        }
    }
    for (&w, &o) in w4.remainder().iter().zip(o4.remainder()) {
        let m = row(o);
        for l in 0..L {
            tail[l] += w * m[l];
        }
    }
    let a = &mut acc[l0..l0 + L];
    for l in 0..L {
        a[l] += (p[0][l] + p[1][l]) + (p[2][l] + p[3][l]) + tail[l];
    }
    L
}

/// `(shift, inv)` with `x / d == (x >> shift).wrapping_mul(inv)` for every `u32` multiple `x`
/// of `d` (`d = 2^shift * odd`, `inv * odd == 1` modulo 2^32).
pub(super) fn exact_div(d: usize) -> (u32, u32) {
    let d = d.max(1) as u32;
    let shift = d.trailing_zeros();
    let odd = d >> shift;
    // Newton's iteration for the inverse modulo 2^32 (each doubles the correct bits).
    let mut inv = odd;
    for _ in 0..5 {
        inv = inv.wrapping_mul(2u32.wrapping_sub(odd.wrapping_mul(inv)));
    }
    (shift, inv)
}

#[cfg(test)]
mod tests {
    use super::exact_div;

    /// The exact division of the delivery gives `x / d` for multiples `x` of `d`, odd and
    /// even port counts alike, up to the largest multiple below 2^32.
    #[test]
    fn exact_div_divides_multiples() {
        for d in 1..=12u32 {
            let (sh, inv) = exact_div(d as usize);
            let top = u32::MAX / d;
            for q in (0..1000)
                .chain(top - 1000..=top)
                .chain((0..top).step_by(9_973))
            {
                assert_eq!(((q * d) >> sh).wrapping_mul(inv), q, "{q} * {d}");
            }
        }
    }
}
