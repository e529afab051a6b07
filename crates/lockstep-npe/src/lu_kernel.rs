//! The LU-factorized linear map of each flow step (nflows' `LULinear`, `crate::flow`) as
//! kernels for burn's CubeCL backends (wgpu, CUDA), float32: the step's whole affine map on
//! the flow state from the parameters in one launch each way, where burn's composed
//! operations launch about 23 kernels forward (softplus, the concatenations and gathers that
//! place the entries in `L` and `U`, the product `L U`, the log and the sum) and about 20
//! backward per flow step.
//!
//! `W = L U` (`n x n`), `L` unit lower-triangular with the strictly lower entries `lower`
//! (`n(n-1)/2`, row-major: numpy's `tril_indices(n, -1)`), `U` upper-triangular with the
//! strictly upper entries `upper` (row-major, `triu_indices(n, 1)`) and the diagonal
//! `u_jj = softplus(diag_j) + eps`; the map is `y = x[:, perm] Wᵀ + bias` with
//! `log|det| = Σ_j ln u_jj`.
//!
//! On the GPU the flow carries its state as one `[N, n + 2]` tensor: the `n` features, the
//! running log-determinant and a column of ones (see `crate::coupling_kernel`). The kernel
//! writes the `[n + 2, n + 2]` matrix `A` with `state A` the next state: `Wᵀ`'s rows
//! permuted into the top-left block, `A[perm[j], i] = W_ij` (so `x` is not gathered), a one
//! at `A[n, n]` carrying the log-determinant, and in the last row the bias, `Σ_j ln u_jj`
//! and a one. A flow step's map is then this launch and one matrix product (their
//! gradients: two products and one launch), where the weight, the product, the bias
//! addition and the log-determinant took four launches forward and six backward. The
//! products by the zeros and ones of `A` are exact, so the log-determinant and the bias
//! come out as when added.
//!
//! The backward kernel turns `dA` into the parameters' gradients: `dL_ik = Σ_{j>=k} dW_ij
//! U_kj` (`k < i`), `dU_kj = Σ_{i>=k} dW_ij L_ik` (`k <= j`), `ddiag_j = dU_jj
//! sigmoid(diag_j) + dA[n + 1, n] sigmoid(diag_j) / u_jj`, `dbias_i = dA[n + 1, i]`, with
//! `dW_ij = dA[perm[j], i]`. One thread per entry; `n` is θ's dimension (a few to a few
//! tens). The permutation travels as float32 values (exact below 2^24).
//!
//! softplus is computed as `max(u, 0) + ln(1 + e^-|u|)` (burn's `ln(1 + e^u)` overflows for
//! `u > 88`).

use burn::tensor::{DType, Shape, TensorMetadata};
use burn_cubecl::kernel::into_contiguous;
use burn_cubecl::ops::numeric::empty_device;
use burn_cubecl::tensor::CubeTensor;
use burn_cubecl::CubeRuntime;
use cubecl::prelude::*;
use cubecl::{calculate_cube_count_elemwise, CubeDim};

/// `ln(1 + e^u)`, overflow-free.
#[cube]
fn softplus(u: f32) -> f32 {
    f32::max(u, 0.0) + f32::ln(1.0 + f32::exp(-f32::abs(u)))
}

/// `L_ik` for `k <= i`.
#[cube]
fn l_at(lower: &Array<f32>, i: u32, k: u32) -> f32 {
    let mut v = 1.0f32;
    if k < i {
        v = lower[(i * (i - 1) / 2 + k) as usize];
    }
    v
}

/// `U_kj` for `k <= j`.
#[cube]
fn u_at(upper: &Array<f32>, diag: &Array<f32>, k: u32, j: u32, n: u32, eps: f32) -> f32 {
    let mut v = 0.0f32;
    if k == j {
        v += softplus(diag[j as usize]) + eps;
    } else {
        v += upper[(k * n - k * (k + 1) / 2 + (j - k - 1)) as usize];
    }
    v
}

/// The row of `M` that holds row `j` of `Wᵀ`: `perm[j]` when `permuted`, else `j`.
#[cube]
fn row_of(perm: &Array<f32>, j: u32, #[comptime] permuted: bool) -> u32 {
    let mut r = j;
    if permuted {
        r = u32::cast_from(perm[j as usize]);
    }
    r
}

/// The flow step's affine map on the state `[N, n + 2]` (features, log-determinant, one):
/// `a[row_of(j) w + i] = W_ij` for `i, j < n` (`w = n + 2`), `a[n, n] = 1` (the running
/// log-determinant carried), `a[n + 1, i] = bias_i`, `a[n + 1, n] = Σ_j ln u_jj` (added to
/// the log-determinant through the column of ones), `a[n + 1, n + 1] = 1`, zeros elsewhere.
#[cube(launch)]
#[allow(clippy::too_many_arguments)]
fn lu_affine_forward(
    lower: &Array<f32>,
    upper: &Array<f32>,
    diag: &Array<f32>,
    bias: &Array<f32>,
    perm: &Array<f32>,
    a: &mut Array<f32>,
    n: u32,
    eps: f32,
    #[comptime] permuted: bool,
) {
    let w = n + 2;
    let p = ABSOLUTE_POS as u32;
    if p >= w * w {
        terminate!();
    }
    let q = p / w;
    let i = p % w;
    if q < n && i < n {
        // Row j = q of Wᵀ, written at its permuted row.
        let kmax = u32::min(i, q);
        let mut s = 0.0f32;
        for k in 0..kmax + 1 {
            s += l_at(lower, i, k) * u_at(upper, diag, k, q, n, eps);
        }
        a[(row_of(perm, q, permuted) * w + i) as usize] = s;
    } else {
        let mut v = 0.0f32;
        if q == n + 1 {
            if i < n {
                v += bias[i as usize];
            } else if i == n {
                for j in 0..n {
                    v += f32::ln(softplus(diag[j as usize]) + eps);
                }
            } else {
                v += 1.0;
            }
        } else if q == n && i == n {
            v += 1.0;
        }
        a[p as usize] = v;
    }
}

/// The parameters' gradients from `da` (the gradient of the affine map): threads `0..t` the
/// lower entries, `t..2t` the upper ones, `2t..2t + n` the diagonal (the weight's part and
/// the log-determinant's, `da[n + 1, n] sigmoid(diag_j) / u_jj`), `2t + n..2t + 2n` the
/// bias (`t = n(n-1)/2`).
#[cube(launch)]
#[allow(clippy::too_many_arguments)]
fn lu_affine_backward(
    lower: &Array<f32>,
    upper: &Array<f32>,
    diag: &Array<f32>,
    perm: &Array<f32>,
    da: &Array<f32>,
    dlower: &mut Array<f32>,
    dupper: &mut Array<f32>,
    ddiag: &mut Array<f32>,
    dbias: &mut Array<f32>,
    n: u32,
    eps: f32,
    #[comptime] permuted: bool,
) {
    let w = n + 2;
    let p = ABSOLUTE_POS as u32;
    let t = n * (n - 1) / 2;
    if p >= 2 * t + 2 * n {
        terminate!();
    }
    if p < t {
        // Row i holds its i entries from i(i-1)/2 on: the last row starting at or before p.
        let mut i = 1u32;
        for r in 2..n {
            if r * (r - 1) / 2 <= p {
                i = r;
            }
        }
        let k = p - i * (i - 1) / 2;
        let mut s = 0.0f32;
        for j in k..n {
            s += da[(row_of(perm, j, permuted) * w + i) as usize] * u_at(upper, diag, k, j, n, eps);
        }
        dlower[p as usize] = s;
    } else if p < 2 * t {
        let q = p - t;
        // Row k holds its n - 1 - k entries from k n - k(k+1)/2 on: the last row starting
        // at or before q.
        let mut k = 0u32;
        for r in 1..n - 1 {
            if r * n - r * (r + 1) / 2 <= q {
                k = r;
            }
        }
        let j = k + 1 + (q - (k * n - k * (k + 1) / 2));
        let mut s = 0.0f32;
        for i in k..n {
            s += da[(row_of(perm, j, permuted) * w + i) as usize] * l_at(lower, i, k);
        }
        dupper[q as usize] = s;
    } else if p < 2 * t + n {
        let j = p - 2 * t;
        let mut s = 0.0f32;
        for i in j..n {
            s += da[(row_of(perm, j, permuted) * w + i) as usize] * l_at(lower, i, j);
        }
        let d = diag[j as usize];
        let sig = 1.0 / (1.0 + f32::exp(-d));
        ddiag[j as usize] = s * sig + da[((n + 1) * w + n) as usize] * sig / (softplus(d) + eps);
    } else {
        let i = p - 2 * t - n;
        dbias[i as usize] = da[((n + 1) * w + i) as usize];
    }
}

/// The launch grid for `threads` threads.
fn grid<R: CubeRuntime>(t: &CubeTensor<R>, threads: usize) -> (CubeCount, CubeDim) {
    let client = &t.client;
    let dim = CubeDim::new(client, threads.max(1));
    (
        calculate_cube_count_elemwise(client, threads.max(1), dim),
        dim,
    )
}

/// `n` from the diagonal, after checking the three parameter vectors' dtypes and lengths.
fn check<R: CubeRuntime>(
    lower: &CubeTensor<R>,
    upper: &CubeTensor<R>,
    diag: &CubeTensor<R>,
) -> u32 {
    for t in [lower, upper, diag] {
        assert_eq!(t.dtype, DType::F32, "LU kernel: float32 only");
    }
    let n = diag.shape().num_elements();
    let t = n * n.saturating_sub(1) / 2;
    assert_eq!(lower.shape().num_elements(), t, "LU kernel: lower entries");
    assert_eq!(upper.shape().num_elements(), t, "LU kernel: upper entries");
    u32::try_from(n).expect("LU kernel: n below 2^16")
}

/// The permutation's values (contiguous, `[n]`, float32), or `diag` as a placeholder that
/// the kernels do not read when there is none.
fn checked_perm<R: CubeRuntime>(
    perm: Option<CubeTensor<R>>,
    diag: &CubeTensor<R>,
    n: u32,
) -> CubeTensor<R> {
    match perm {
        Some(p) => {
            assert!(
                p.dtype == DType::F32 && p.shape().num_elements() == n as usize,
                "LU kernel: the permutation is not [n] float32"
            );
            into_contiguous(p)
        }
        None => diag.clone(),
    }
}

/// The affine map `[n + 2, n + 2]` (row-major) of a flow step on the state (see
/// the kernel's docs and the module's) for the LU map with strictly lower entries
/// `lower`, strictly upper entries `upper` (`[n(n-1)/2]` each), unconstrained diagonal
/// `diag: [n]` and bias `bias: [n]`, the rows of `Wᵀ` permuted by `perm` (`[n]`, float32
/// values of a permutation of `0..n`) when given. One launch.
///
/// Panics on lengths that do not fit or a dtype other than float32.
pub fn affine_forward<R: CubeRuntime>(
    lower: CubeTensor<R>,
    upper: CubeTensor<R>,
    diag: CubeTensor<R>,
    bias: CubeTensor<R>,
    perm: Option<CubeTensor<R>>,
    eps: f64,
) -> CubeTensor<R> {
    let n = check(&lower, &upper, &diag);
    assert!(
        bias.dtype == DType::F32 && bias.shape().num_elements() == n as usize,
        "LU kernel: the bias is not [n] float32"
    );
    let permuted = perm.is_some();
    let perm = checked_perm(perm, &diag, n);
    let [lower, upper, diag, bias] = [lower, upper, diag, bias].map(into_contiguous);
    let w = n as usize + 2;
    let a = empty_device::<R, f32>(diag.client.clone(), diag.device.clone(), Shape::new([w, w]));
    let (count, dim) = grid(&diag, w * w);
    lu_affine_forward::launch::<R>(
        &diag.client.clone(),
        count,
        dim,
        lower.into_array_arg(),
        upper.into_array_arg(),
        diag.into_array_arg(),
        bias.into_array_arg(),
        perm.into_array_arg(),
        a.clone().into_array_arg(),
        n,
        eps as f32,
        permuted,
    );
    a
}

/// The gradients `[dlower, dupper, ddiag, dbias]` of [`affine_forward`] (with the same
/// `perm`) for the gradient `da: [n + 2, n + 2]` of its output. One launch.
///
/// Panics on shapes that do not fit or a dtype other than float32.
pub fn affine_backward<R: CubeRuntime>(
    lower: CubeTensor<R>,
    upper: CubeTensor<R>,
    diag: CubeTensor<R>,
    perm: Option<CubeTensor<R>>,
    da: CubeTensor<R>,
    eps: f64,
) -> [CubeTensor<R>; 4] {
    let n = check(&lower, &upper, &diag);
    let permuted = perm.is_some();
    let perm = checked_perm(perm, &diag, n);
    let w = n as usize + 2;
    assert_eq!(
        da.shape().num_elements(),
        w * w,
        "LU kernel: the map's gradient"
    );
    assert_eq!(da.dtype, DType::F32, "LU kernel: float32 only");
    let [lower, upper, diag, da] = [lower, upper, diag, da].map(into_contiguous);
    let t = (n * n.saturating_sub(1) / 2) as usize;
    let new = |len: usize| {
        empty_device::<R, f32>(diag.client.clone(), diag.device.clone(), Shape::new([len]))
    };
    let (dl, du, dd, db) = (new(t), new(t), new(n as usize), new(n as usize));
    let (count, dim) = grid(&diag, 2 * t + 2 * n as usize);
    lu_affine_backward::launch::<R>(
        &diag.client.clone(),
        count,
        dim,
        lower.into_array_arg(),
        upper.into_array_arg(),
        diag.into_array_arg(),
        perm.into_array_arg(),
        da.into_array_arg(),
        dl.clone().into_array_arg(),
        du.clone().into_array_arg(),
        dd.clone().into_array_arg(),
        db.clone().into_array_arg(),
        n,
        eps as f32,
        permuted,
    );
    [dl, du, dd, db]
}
