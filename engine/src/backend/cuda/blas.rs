//! How the GPU forward pass's row-major products map onto cuBLAS's column-major GEMM. Kept
//! free of CUDA so the mapping (the classic place for a transposition bug) is tested on every
//! machine, against a reference GEMM written from cuBLAS's documented semantics.

/// cuBLAS's `transa`/`transb`: use the stored matrix as is, or its transpose.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Op {
    N,
    T,
}

/// The shape arguments of `cublasGemmEx(transa, transb, m, n, k, A, lda, B, ldb, C, ldc)`,
/// which computes `C (m × n) = op(A) (m × k) · op(B) (k × n)`, every matrix column-major.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GemmCall {
    pub transa: Op,
    pub transb: Op,
    pub m: usize,
    pub n: usize,
    pub k: usize,
    pub lda: usize,
    pub ldb: usize,
    pub ldc: usize,
}

/// `out[rows × n] = x[rows × k] · Wᵀ`, all row-major, `W` being `n × k` (output features by
/// input features, as [`crate::backend::cpu::kernels::Matrix`] stores them), with A = W, B = x, C = out.
///
/// Read column-major, a row-major `r × c` buffer is its `c × r` transpose: W's buffer is
/// `Wᵀ (k × n)`, x's is `xᵀ (k × rows)`, out's is `outᵀ (n × rows)`. And
/// `outᵀ = W · xᵀ = op(Wᵀ) · xᵀ` with `op = T` on A and `N` on B.
pub fn linear_call(rows: usize, n: usize, k: usize) -> GemmCall {
    GemmCall {
        transa: Op::T,
        transb: Op::N,
        m: n,
        n: rows,
        k,
        lda: k,
        ldb: k,
        ldc: n,
    }
}

/// `C = op(A) · op(B) + beta · C` exactly as cuBLAS defines it (column-major, leading
/// dimensions; beta 0 ignores what C held), checking the leading-dimension rules cuBLAS
/// enforces (it panics where cuBLAS would refuse the call). Slow: for tests and emulated
/// devices.
pub fn reference_gemm(c: &GemmCall, a: &[f32], b: &[f32], beta: f32, out: &mut [f32]) {
    let (a_rows, b_rows) = (
        if c.transa == Op::N { c.m } else { c.k },
        if c.transb == Op::N { c.k } else { c.n },
    );
    assert!(c.lda >= a_rows.max(1), "lda below the rows of A");
    assert!(c.ldb >= b_rows.max(1), "ldb below the rows of B");
    assert!(c.ldc >= c.m.max(1), "ldc below m");
    let op_a = |i: usize, p: usize| match c.transa {
        Op::N => a[i + p * c.lda],
        Op::T => a[p + i * c.lda],
    };
    let op_b = |p: usize, j: usize| match c.transb {
        Op::N => b[p + j * c.ldb],
        Op::T => b[j + p * c.ldb],
    };
    for j in 0..c.n {
        for i in 0..c.m {
            let product: f32 = (0..c.k).map(|p| op_a(i, p) * op_b(p, j)).sum();
            let at = i + j * c.ldc;
            out[at] = if beta == 0.0 {
                product
            } else {
                product + beta * out[at]
            };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn linear_call_computes_x_times_w_transposed_row_major() {
        // Non-square everywhere, so a swapped dimension cannot pass by accident.
        let (rows, n, k) = (3, 5, 4);
        let x: Vec<f32> = (0..rows * k).map(|i| (i as f32 * 0.37).sin()).collect();
        let w: Vec<f32> = (0..n * k).map(|i| (i as f32 * 0.91).cos()).collect();
        let mut out = vec![0f32; rows * n];
        reference_gemm(&linear_call(rows, n, k), &w, &x, 0.0, &mut out);
        for r in 0..rows {
            for j in 0..n {
                let want: f32 = (0..k).map(|p| x[r * k + p] * w[j * k + p]).sum();
                let got = out[r * n + j];
                assert!(
                    (got - want).abs() < 1e-5,
                    "out[{r}][{j}] = {got}, want {want}"
                );
            }
        }
    }

    #[test]
    fn a_single_row_is_a_matrix_vector_product() {
        let call = linear_call(1, 7, 2);
        assert_eq!((call.m, call.n, call.k), (7, 1, 2));
        let w: Vec<f32> = (0..14).map(|i| i as f32).collect();
        let mut out = vec![0f32; 7];
        reference_gemm(&call, &w, &[1.0, -1.0], 0.0, &mut out);
        assert_eq!(out, vec![-1.0; 7]);
        // beta 1 adds to what the output held (the residual folded into a projection).
        reference_gemm(&call, &w, &[1.0, -1.0], 1.0, &mut out);
        assert_eq!(out, vec![-2.0; 7]);
    }
}
