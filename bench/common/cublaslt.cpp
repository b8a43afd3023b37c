// SPDX-License-Identifier: MIT
// cuBLASLt GEMMs for the benchmarks (cublaslt.hpp).
#include "common/cublaslt.hpp"

#include <cstring>
#include <string>

#include "weft/runtime/error.hpp"

/// Checks a cuBLAS call: a weft::Error naming the call and its status.
#define BENCH_CUBLAS(call)                                                                  \
    do {                                                                                    \
        const cublasStatus_t bench_status_ = (call);                                        \
        WEFT_CHECK(bench_status_ == CUBLAS_STATUS_SUCCESS,                                  \
                   #call << " returned cuBLAS status " << static_cast<int>(bench_status_)); \
    } while (0)

namespace weft::bench {
namespace {

cudaDataType cuda_type(DType t) {
    switch (t) {
        case DType::kBF16:
            return CUDA_R_16BF;
        case DType::kF16:
            return CUDA_R_16F;
        case DType::kF32:
            return CUDA_R_32F;
        default:
            break;
    }
    WEFT_FAIL("cuBLASLt GEMM: dtype " << dtype_name(t) << " is not one of bf16, f16, f32");
}

}  // namespace

LtGemm::LtGemm(cublasLtHandle_t handle, DType in, DType out, LtLayout layout, const Shape& s, void* workspace,
               size_t workspace_bytes, int max_algos)
    : handle_(handle), workspace_(workspace), workspace_bytes_(workspace_bytes) {
    WEFT_CHECK(max_algos >= 1 && max_algos <= kMaxAlgos,
               "LtGemm: max_algos " << max_algos << " not in 1.." << kMaxAlgos);
    BENCH_CUBLAS(cublasLtMatmulDescCreate(&desc_, CUBLAS_COMPUTE_32F, CUDA_R_32F));
    // Column-major view of the row-major product: D^T [n, m] = op(B) [n, k] * A^T [k, m].
    const cublasOperation_t ta = layout == LtLayout::kNK ? CUBLAS_OP_T : CUBLAS_OP_N, tb = CUBLAS_OP_N;
    BENCH_CUBLAS(cublasLtMatmulDescSetAttribute(desc_, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof(ta)));
    BENCH_CUBLAS(cublasLtMatmulDescSetAttribute(desc_, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof(tb)));
    const auto u = [](int64_t v) { return static_cast<uint64_t>(v); };
    if (layout == LtLayout::kNK) {
        BENCH_CUBLAS(cublasLtMatrixLayoutCreate(&la_, cuda_type(in), u(s.k), u(s.n), s.ldb));
    } else {
        BENCH_CUBLAS(cublasLtMatrixLayoutCreate(&la_, cuda_type(in), u(s.n), u(s.k), s.ldb));
    }
    BENCH_CUBLAS(cublasLtMatrixLayoutCreate(&lb_, cuda_type(in), u(s.k), u(s.m), s.lda));
    BENCH_CUBLAS(cublasLtMatrixLayoutCreate(&ld_, cuda_type(out), u(s.n), u(s.m), s.ldd));
    cublasLtMatmulPreference_t pref = nullptr;
    BENCH_CUBLAS(cublasLtMatmulPreferenceCreate(&pref));
    BENCH_CUBLAS(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &workspace_bytes_,
                                                      sizeof(workspace_bytes_)));
    int found = 0;
    const cublasStatus_t st =
        cublasLtMatmulAlgoGetHeuristic(handle_, desc_, la_, lb_, ld_, ld_, pref, max_algos, algos_, &found);
    cublasLtMatmulPreferenceDestroy(pref);
    BENCH_CUBLAS(st);
    num_algos_ = static_cast<size_t>(found);
    WEFT_CHECK(num_algos_ > 0, "cuBLASLt has no algorithm for the GEMM " << s.m << "x" << s.n << "x" << s.k);
}

LtGemm::~LtGemm() {
    cublasLtMatrixLayoutDestroy(la_);
    cublasLtMatrixLayoutDestroy(lb_);
    cublasLtMatrixLayoutDestroy(ld_);
    cublasLtMatmulDescDestroy(desc_);
}

void LtGemm::run(size_t algo, const void* a, const void* b, void* d, cudaStream_t stream) const {
    WEFT_CHECK(algo < num_algos_, "LtGemm::run: algorithm " << algo << " of " << num_algos_);
    const float alpha = 1.f, beta = 0.f;
    BENCH_CUBLAS(cublasLtMatmul(handle_, desc_, &alpha, b, la_, a, lb_, &beta, d, ld_, d, ld_, &algos_[algo].algo,
                                workspace_, workspace_bytes_, stream));
}

std::string LtGemm::describe(size_t algo) const {
    WEFT_CHECK(algo < num_algos_, "LtGemm::describe: algorithm " << algo << " of " << num_algos_);
    const auto get = [&](cublasLtMatmulAlgoConfigAttributes_t attr, size_t bytes) {
        uint32_t v = 0;
        size_t written = 0;
        cublasLtMatmulAlgoConfigGetAttribute(&algos_[algo].algo, attr, &v, bytes, &written);
        return std::to_string(bytes == 2 ? (v & 0xffffu) : v);
    };
    return "id " + get(CUBLASLT_ALGO_CONFIG_ID, 4) + " tile " + get(CUBLASLT_ALGO_CONFIG_TILE_ID, 2) + " stages " +
           get(CUBLASLT_ALGO_CONFIG_STAGES_ID, 2) + " cluster " + get(CUBLASLT_ALGO_CONFIG_CLUSTER_SHAPE_ID, 2) +
           " splitk " + get(CUBLASLT_ALGO_CONFIG_SPLITK_NUM, 4) + " reduction " +
           get(CUBLASLT_ALGO_CONFIG_REDUCTION_SCHEME, 4) + " swizzle " + get(CUBLASLT_ALGO_CONFIG_CTA_SWIZZLING, 4) +
           " waves " + std::to_string(algos_[algo].wavesCount);
}

size_t LtGemm::fastest(const void* a, const void* b, void* d, cudaStream_t stream, int reps) const {
    WEFT_CHECK(reps >= 1, "LtGemm::fastest: reps " << reps << " must be at least 1");
    struct Events {
        cudaEvent_t start = nullptr, stop = nullptr;
        ~Events() {
            if (start != nullptr) cudaEventDestroy(start);
            if (stop != nullptr) cudaEventDestroy(stop);
        }
    } ev;
    WEFT_CUDA_CHECK(cudaEventCreate(&ev.start));
    WEFT_CUDA_CHECK(cudaEventCreate(&ev.stop));
    cudaEvent_t start = ev.start, stop = ev.stop;
    size_t best = num_algos_;
    float best_ms = 0;
    for (size_t algo = 0; algo < num_algos_; ++algo) {
        try {
            run(algo, a, b, d, stream);  // untimed: the first launch of an algorithm loads its kernel
            WEFT_CUDA_CHECK(cudaEventRecord(start, stream));
            for (int r = 0; r < reps; ++r) run(algo, a, b, d, stream);
            WEFT_CUDA_CHECK(cudaEventRecord(stop, stream));
            WEFT_CUDA_CHECK(cudaEventSynchronize(stop));
        } catch (const Error&) {
            (void)cudaGetLastError();
            continue;  // an algorithm that fails to run is skipped
        }
        float ms = 0;
        WEFT_CUDA_CHECK(cudaEventElapsedTime(&ms, start, stop));
        if (best == num_algos_ || ms < best_ms) {
            best = algo;
            best_ms = ms;
        }
    }
    WEFT_CHECK(best < num_algos_, "cuBLASLt: none of the " << num_algos_ << " heuristic algorithm(s) ran");
    return best;
}

CublasLt::CublasLt(size_t workspace_bytes) : workspace_bytes_(workspace_bytes) {
    BENCH_CUBLAS(cublasLtCreate(&handle_));
    WEFT_CUDA_CHECK(cudaMalloc(&workspace_, workspace_bytes_));
}

CublasLt::~CublasLt() {
    plans_.clear();
    cudaFree(workspace_);
    cublasLtDestroy(handle_);
}

void CublasLt::gemm(DType t, const void* a, int64_t lda, const void* b, int64_t ldb, void* d, int64_t ldd, int64_t m,
                    int64_t n, int64_t k, cudaStream_t stream) {
    const auto key = std::make_tuple(static_cast<int>(t), m, n, k, lda, ldb, ldd);
    auto it = plans_.find(key);
    if (it == plans_.end()) {
        Plan plan;
        plan.gemm = std::make_unique<LtGemm>(handle_, t, t, LtLayout::kNK, LtGemm::Shape{m, n, k, lda, ldb, ldd},
                                             workspace_, workspace_bytes_, LtGemm::kMaxAlgos);
        plan.algo = plan.gemm->fastest(a, b, d, stream);
        it = plans_.emplace(key, std::move(plan)).first;
    }
    it->second.gemm->run(it->second.algo, a, b, d, stream);
}

}  // namespace weft::bench
