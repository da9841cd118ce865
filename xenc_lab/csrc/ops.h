// The operators' entry points, registered in ops.cpp; each is defined in the file of its op.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/string_view.h>

#include <cstdint>
#include <optional>

#include "vec.h"

namespace xenc_lab {

// ops_attention.cpp: the kernel, and the tile path where it is built (XENC_TILES).
at::Tensor packed_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                            const at::Tensor& cu_seqlens_q, const at::Tensor& cu_seqlens_k, int64_t num_heads,
                            double scale, int64_t window);
at::Tensor packed_attention_tiles(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                  const at::Tensor& cu_seqlens_q, const at::Tensor& cu_seqlens_k, int64_t num_heads,
                                  double scale, int64_t window);
// Causal attention of chunks over a paged KV cache (decoders).
at::Tensor paged_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& k_cache,
                           const at::Tensor& v_cache, const at::Tensor& key_index, const at::Tensor& cu_seqlens_q,
                           const at::Tensor& cu_seqlens_k, int64_t num_heads, double scale);

// folded_pool.cpp
at::Tensor folded_pool(const at::Tensor& x, const at::Tensor& folded, const at::Tensor& cu_seqlens);

// layer_norm.cpp
at::Tensor layer_norm(const at::Tensor& x, const std::optional<at::Tensor>& weight, const std::optional<at::Tensor>& bias,
                      double eps);

// rms_norm.cpp: the decoders' row ops.
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps);
at::Tensor rope(const at::Tensor& x, const std::optional<at::Tensor>& weight, double eps, const at::Tensor& cos,
                const at::Tensor& sin);

#if XENC_GEMM_F32
// gemm_f32.cpp
at::Tensor linear_f32(const at::Tensor& x, const at::Tensor& blocks, const at::Tensor& bias, int64_t out_features,
                      c10::string_view activation, const std::optional<at::Tensor>& residual);
at::Tensor linear_widened(const at::Tensor& x, const at::Tensor& blocks, const at::Tensor& bias, int64_t out_features,
                          c10::string_view activation, const std::optional<at::Tensor>& residual);
#endif

#if XENC_GEMM_INT8
// gemm_int8.cpp
at::Tensor linear_int8(const at::Tensor& x, const at::Tensor& blocks, const at::Tensor& correction,
                       const at::Tensor& weight_scale, const at::Tensor& bias, int64_t out_features,
                       c10::string_view activation, const std::optional<at::Tensor>& residual, int64_t rotation,
                       const std::optional<at::Tensor>& norm_weight, const std::optional<at::Tensor>& norm_bias,
                       double norm_eps);
at::Tensor mlp_int8(const at::Tensor& x, const at::Tensor& blocks, const at::Tensor& correction,
                    const at::Tensor& weight_scale, const at::Tensor& bias, int64_t hidden_features,
                    c10::string_view activation, int64_t rotation, const at::Tensor& blocks2,
                    const at::Tensor& correction2, const at::Tensor& weight_scale2, const at::Tensor& bias2,
                    int64_t out_features, const std::optional<at::Tensor>& residual, int64_t rotation2,
                    const std::optional<at::Tensor>& norm_weight, const std::optional<at::Tensor>& norm_bias,
                    double norm_eps);
// Chooses the int8 products: our own on 256-bit registers (on) or ATen's brgemm (off, the default); returns whether
// this build has our own (AVX-VNNI, or AVX512-VNNI with 256-bit registers).
bool int8_own_products(bool on);
#endif

#if XENC_HALF_GEMM
// gemm_half.cpp
at::Tensor linear_half(const at::Tensor& x, const at::Tensor& blocks, int64_t weight_exponent, const at::Tensor& bias,
                       int64_t out_features, c10::string_view activation, const std::optional<at::Tensor>& residual);
#endif

}  // namespace xenc_lab
