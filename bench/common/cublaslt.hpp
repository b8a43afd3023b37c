// SPDX-License-Identifier: MIT
// cuBLASLt GEMMs for the benchmarks' baselines and the measured tensor-core peak: row-major D = A * op(B) with
// fp32 accumulation, on heuristic algorithms.
#pragma once

#include <cublasLt.h>
#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <tuple>

#include "weft/common/dtype.hpp"

namespace weft::bench {

/// How B is stored: [N, K] row-major (D = A * B^T, the layout of a linear layer's weight) or [K, N] (D = A * B).
enum class LtLayout { kNK, kKN };

/// One planned GEMM: row-major D[m, n] (row pitch ldd) = A[m, k] (lda) * B (ldb; [n, k] or [k, n] by `layout`),
/// inputs of `in`, D of `out`, fp32 accumulation and scale, through cuBLASLt's column-major view D^T = op(B) A^T.
/// Holds the first `max_algos` (<= 8) algorithms of cuBLASLt's heuristic for a workspace of `workspace_bytes`;
/// throws weft::Error when there is none. run() uses the workspace given at construction.
class LtGemm {
public:
    struct Shape {
        int64_t m, n, k;
        int64_t lda, ldb, ldd;  // row pitches in elements
    };
    LtGemm(cublasLtHandle_t handle, DType in, DType out, LtLayout layout, const Shape& shape, void* workspace,
           size_t workspace_bytes, int max_algos);
    ~LtGemm();
    LtGemm(const LtGemm&) = delete;
    LtGemm& operator=(const LtGemm&) = delete;

    size_t num_algos() const { return num_algos_; }
    /// Enqueues D = A * op(B) with algorithm `algo` (< num_algos()) on `stream`.
    void run(size_t algo, const void* a, const void* b, void* d, cudaStream_t stream = nullptr) const;
    /// The algorithm's configuration as cuBLASLt reports it (id, tile, stages, cluster, split-K, ...).
    std::string describe(size_t algo) const;
    /// The fastest of the held algorithms on these operands: each runs once untimed, then `reps` times between two
    /// events on `stream` (synchronised); one that fails to run is skipped. Throws weft::Error when none runs.
    size_t fastest(const void* a, const void* b, void* d, cudaStream_t stream, int reps = 5) const;

    static constexpr int kMaxAlgos = 8;

private:
    cublasLtHandle_t handle_;
    void* workspace_;
    size_t workspace_bytes_;
    cublasLtMatmulDesc_t desc_ = nullptr;
    cublasLtMatrixLayout_t la_ = nullptr, lb_ = nullptr, ld_ = nullptr;
    // WAR(CUDA 13.0): nvcc's front end crashes on std::vector<cublasLtMatmulHeuristicResult_t>.
    cublasLtMatmulHeuristicResult_t algos_[kMaxAlgos] = {};
    size_t num_algos_ = 0;
};

/// A cuBLASLt handle and workspace with GEMM plans cached by shape, each on the fastest of the heuristic's first
/// kMaxAlgos algorithms, timed on the operands of the shape's first call (LtGemm::fastest): the plain "cuBLAS GEMM"
/// baseline beside weft's ops. Not thread-safe: one per thread; not for a stream being captured (the first call of
/// a shape synchronises it).
class CublasLt {
public:
    explicit CublasLt(size_t workspace_bytes = size_t{32} << 20);
    ~CublasLt();
    CublasLt(const CublasLt&) = delete;
    CublasLt& operator=(const CublasLt&) = delete;

    cublasLtHandle_t handle() const { return handle_; }
    void* workspace() const { return workspace_; }
    size_t workspace_bytes() const { return workspace_bytes_; }
    /// Row-major D[m, n] (ldd) = A[m, k] (lda) * B[n, k]^T (ldb), all of dtype `t`.
    void gemm(DType t, const void* a, int64_t lda, const void* b, int64_t ldb, void* d, int64_t ldd, int64_t m,
              int64_t n, int64_t k, cudaStream_t stream);

private:
    cublasLtHandle_t handle_ = nullptr;
    void* workspace_ = nullptr;
    size_t workspace_bytes_;
    struct Plan {
        std::unique_ptr<LtGemm> gemm;
        size_t algo = 0;
    };
    std::map<std::tuple<int, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t>, Plan> plans_;
};

}  // namespace weft::bench
