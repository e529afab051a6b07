//! The LU-factorized linear map of each flow step (nflows' `LULinear`,
//! `crate::flow`) as kernels for burn's CubeCL backends (wgpu, CUDA), float32: its weight
//! from the parameters in one launch each way, and its log-determinant added to the
//! running one in one launch each way, where burn's composed operations launch about 23
//! kernels forward (softplus, the concatenations and gathers that place the entries in
//! `L` and `U`, the product `L U`, the log and the sum) and about 20 backward per flow step.
//!
//! `W = L U` (`n x n`), `L` unit lower-triangular with the strictly lower entries `lower`
//! (`n(n-1)/2`, row-major: numpy's `tril_indices(n, -1)`), `U` upper-triangular with the
//! strictly upper entries `upper` (row-major, `triu_indices(n, 1)`) and the diagonal
//! `u_jj = softplus(diag_j) + eps`. The weight kernel writes `Wᵀ` (so that `x Wᵀ` is a
//! plain product, whose gradient with respect to `Wᵀ` comes contiguous); its backward
//! kernel turns `dWᵀ` into the parameters' gradients: `dL_ik = Σ_{j>=k} dW_ij U_kj`
//! (`k < i`), `dU_kj = Σ_{i>=k} dW_ij L_ik` (`k <= j`), `ddiag_j = dU_jj sigmoid(diag_j)`.
//! The log-determinant is `Σ_j ln u_jj`; its gradient `ddiag_j = (Σ_rows g) sigmoid(diag_j)
//! / u_jj`. One thread per entry; `n` is θ's dimension (a few to a few tens).
//!
//! With the flow step's permutation `perm` (the features `z[:, perm]` go into the map) the
//! weight kernel writes the rows of `Wᵀ` permuted, `M[perm[j], i] = Wᵀ[j, i]`, so that
//! `z M = z[:, perm] Wᵀ` needs no gather of `z` (one launch forward, two backward saved per
//! flow step); its backward reads `dWᵀ[j, i] = dM[perm[j], i]`. The permutation travels as
//! float32 values (exact below 2^24).
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

/// `wt[row_of(j) n + i] = W_ij = Σ_{k <= min(i, j)} L_ik U_kj`.
#[cube(launch)]
#[allow(clippy::too_many_arguments)]
fn lu_weight_forward(
    lower: &Array<f32>,
    upper: &Array<f32>,
    diag: &Array<f32>,
    perm: &Array<f32>,
    wt: &mut Array<f32>,
    n: u32,
    eps: f32,
    #[comptime] permuted: bool,
) {
    let p = ABSOLUTE_POS as u32;
    if p >= n * n {
        terminate!();
    }
    let i = p % n;
    let j = p / n;
    let kmax = u32::min(i, j);
    let mut s = 0.0f32;
    for k in 0..kmax + 1 {
        s += l_at(lower, i, k) * u_at(upper, diag, k, j, n, eps);
    }
    wt[(row_of(perm, j, permuted) * n + i) as usize] = s;
}

/// The parameters' gradients from `dwt` (the gradient of `Wᵀ`): threads `0..t` the lower
/// entries, `t..2t` the upper ones, `2t..2t + n` the diagonal (`t = n(n-1)/2`).
#[cube(launch)]
#[allow(clippy::too_many_arguments)]
fn lu_weight_backward(
    lower: &Array<f32>,
    upper: &Array<f32>,
    diag: &Array<f32>,
    perm: &Array<f32>,
    dwt: &Array<f32>,
    dlower: &mut Array<f32>,
    dupper: &mut Array<f32>,
    ddiag: &mut Array<f32>,
    n: u32,
    eps: f32,
    #[comptime] permuted: bool,
) {
    let p = ABSOLUTE_POS as u32;
    let t = n * (n - 1) / 2;
    if p >= 2 * t + n {
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
            s +=
                dwt[(row_of(perm, j, permuted) * n + i) as usize] * u_at(upper, diag, k, j, n, eps);
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
            s += dwt[(row_of(perm, j, permuted) * n + i) as usize] * l_at(lower, i, k);
        }
        dupper[q as usize] = s;
    } else {
        let j = p - 2 * t;
        let mut s = 0.0f32;
        for i in j..n {
            s += dwt[(row_of(perm, j, permuted) * n + i) as usize] * l_at(lower, i, j);
        }
        let d = diag[j as usize];
        ddiag[j as usize] = s / (1.0 + f32::exp(-d));
    }
}

/// `out[r] = acc[r] + Σ_j ln(softplus(diag_j) + eps)` for `r < rows`.
#[cube(launch)]
fn lu_logdet_forward(
    acc: &Array<f32>,
    diag: &Array<f32>,
    out: &mut Array<f32>,
    rows: u32,
    n: u32,
    eps: f32,
) {
    let r = ABSOLUTE_POS as u32;
    if r >= rows {
        terminate!();
    }
    let mut s = 0.0f32;
    for j in 0..n {
        s += f32::ln(softplus(diag[j as usize]) + eps);
    }
    out[r as usize] = acc[r as usize] + s;
}

/// `ddiag_j = (Σ_r g_r) sigmoid(diag_j) / (softplus(diag_j) + eps)` for `j < n`.
#[cube(launch)]
fn lu_logdet_backward(
    g: &Array<f32>,
    diag: &Array<f32>,
    ddiag: &mut Array<f32>,
    rows: u32,
    n: u32,
    eps: f32,
) {
    let j = ABSOLUTE_POS as u32;
    if j >= n {
        terminate!();
    }
    let mut total = 0.0f32;
    for r in 0..rows {
        total += g[r as usize];
    }
    let d = diag[j as usize];
    ddiag[j as usize] = total / (1.0 + f32::exp(-d)) / (softplus(d) + eps);
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

/// `Wᵀ: [n, n]` (row-major) of the LU map with strictly lower entries `lower`, strictly
/// upper entries `upper` (`[n(n-1)/2]` each) and unconstrained diagonal `diag: [n]`, its
/// rows permuted by `perm` (`[n]`, float32 values of a permutation of `0..n`) when given
/// (see the module docs). One launch.
///
/// Panics on lengths that do not fit or a dtype other than float32.
pub fn weight_forward<R: CubeRuntime>(
    lower: CubeTensor<R>,
    upper: CubeTensor<R>,
    diag: CubeTensor<R>,
    perm: Option<CubeTensor<R>>,
    eps: f64,
) -> CubeTensor<R> {
    let n = check(&lower, &upper, &diag);
    let permuted = perm.is_some();
    let perm = checked_perm(perm, &diag, n);
    let [lower, upper, diag] = [lower, upper, diag].map(into_contiguous);
    let wt = empty_device::<R, f32>(
        diag.client.clone(),
        diag.device.clone(),
        Shape::new([n as usize, n as usize]),
    );
    let (count, dim) = grid(&diag, (n * n) as usize);
    lu_weight_forward::launch::<R>(
        &diag.client.clone(),
        count,
        dim,
        lower.into_array_arg(),
        upper.into_array_arg(),
        diag.into_array_arg(),
        perm.into_array_arg(),
        wt.clone().into_array_arg(),
        n,
        eps as f32,
        permuted,
    );
    wt
}

/// The gradients `(dlower, dupper, ddiag)` of [`weight_forward`] (with the same `perm`)
/// for the gradient `dwt: [n, n]` of its output. One launch.
///
/// Panics on shapes that do not fit or a dtype other than float32.
pub fn weight_backward<R: CubeRuntime>(
    lower: CubeTensor<R>,
    upper: CubeTensor<R>,
    diag: CubeTensor<R>,
    perm: Option<CubeTensor<R>>,
    dwt: CubeTensor<R>,
    eps: f64,
) -> [CubeTensor<R>; 3] {
    let n = check(&lower, &upper, &diag);
    let permuted = perm.is_some();
    let perm = checked_perm(perm, &diag, n);
    assert_eq!(
        dwt.shape().num_elements(),
        (n * n) as usize,
        "LU kernel: dWᵀ"
    );
    assert_eq!(dwt.dtype, DType::F32, "LU kernel: float32 only");
    let [lower, upper, diag, dwt] = [lower, upper, diag, dwt].map(into_contiguous);
    let t = (n * (n - 1) / 2) as usize;
    let new = |len: usize| {
        empty_device::<R, f32>(diag.client.clone(), diag.device.clone(), Shape::new([len]))
    };
    let (dl, du, dd) = (new(t), new(t), new(n as usize));
    let (count, dim) = grid(&diag, 2 * t + n as usize);
    lu_weight_backward::launch::<R>(
        &diag.client.clone(),
        count,
        dim,
        lower.into_array_arg(),
        upper.into_array_arg(),
        diag.into_array_arg(),
        perm.into_array_arg(),
        dwt.into_array_arg(),
        dl.clone().into_array_arg(),
        du.clone().into_array_arg(),
        dd.clone().into_array_arg(),
        n,
        eps as f32,
        permuted,
    );
    [dl, du, dd]
}

/// `acc + Σ_j ln(softplus(diag_j) + eps)` for the running log-determinant `acc: [rows]`.
/// One launch.
///
/// Panics on a dtype other than float32.
pub fn logdet_forward<R: CubeRuntime>(
    acc: CubeTensor<R>,
    diag: CubeTensor<R>,
    eps: f64,
) -> CubeTensor<R> {
    assert!(
        acc.dtype == DType::F32 && diag.dtype == DType::F32,
        "LU kernel: float32 only"
    );
    let rows = acc.shape().num_elements();
    let n = diag.shape().num_elements() as u32;
    let [acc, diag] = [acc, diag].map(into_contiguous);
    let out = empty_device::<R, f32>(acc.client.clone(), acc.device.clone(), acc.shape());
    let (count, dim) = grid(&acc, rows);
    lu_logdet_forward::launch::<R>(
        &acc.client.clone(),
        count,
        dim,
        acc.into_array_arg(),
        diag.into_array_arg(),
        out.clone().into_array_arg(),
        rows as u32,
        n,
        eps as f32,
    );
    out
}

/// The gradient of [`logdet_forward`] with respect to `diag` for the incoming gradient `g:
/// [rows]` (that of `acc` is `g`). One launch.
///
/// Panics on a dtype other than float32.
pub fn logdet_backward<R: CubeRuntime>(
    g: CubeTensor<R>,
    diag: CubeTensor<R>,
    eps: f64,
) -> CubeTensor<R> {
    assert!(
        g.dtype == DType::F32 && diag.dtype == DType::F32,
        "LU kernel: float32 only"
    );
    let rows = g.shape().num_elements() as u32;
    let n = diag.shape().num_elements();
    let [g, diag] = [g, diag].map(into_contiguous);
    let dd = empty_device::<R, f32>(diag.client.clone(), diag.device.clone(), diag.shape());
    let (count, dim) = grid(&diag, n);
    lu_logdet_backward::launch::<R>(
        &diag.client.clone(),
        count,
        dim,
        g.into_array_arg(),
        diag.into_array_arg(),
        dd.clone().into_array_arg(),
        rows,
        n as u32,
        eps as f32,
    );
    dd
}
