// The xenc_lab operators: their schemas, their CPU implementations (each op's own file), and the queries that say
// which optional paths this build has.

#include <torch/library.h>

#include "attention.h"
#include "ops.h"
#include "vec.h"

namespace xenc_lab {
namespace {

bool gemm_f32_built() { return XENC_GEMM_F32; }
bool half_gemm_built() { return XENC_HALF_GEMM; }
bool int8_gemm_built() { return XENC_GEMM_INT8; }
bool own_int8_products(bool on) {
#if XENC_GEMM_INT8
  return int8_own_products(on);
#else
  static_cast<void>(on);  // no int8 kernel: nothing to choose
  return false;
#endif
}
bool paired_bf16_built() { return kPairedKeys<BFloat16>; }
bool tiles_built() { return XENC_TILES; }

}  // namespace
}  // namespace xenc_lab

TORCH_LIBRARY(xenc_lab, m) {
  m.def(
      "packed_attention(Tensor q, Tensor k, Tensor v, Tensor cu_seqlens_q, Tensor cu_seqlens_k, int num_heads, "
      "float scale, int window) -> Tensor");
  m.def(
      "packed_attention_tiles(Tensor q, Tensor k, Tensor v, Tensor cu_seqlens_q, Tensor cu_seqlens_k, int num_heads, "
      "float scale, int window) -> Tensor");
  m.def(
      "paged_attention(Tensor q, Tensor k, Tensor v, Tensor k_cache, Tensor v_cache, Tensor key_index, "
      "Tensor cu_seqlens_q, Tensor cu_seqlens_k, int num_heads, float scale) -> Tensor");
  m.def("tiles_built() -> bool", &xenc_lab::tiles_built);
  m.def("folded_pool(Tensor x, Tensor folded, Tensor cu_seqlens) -> Tensor");
  m.def("layer_norm(Tensor x, Tensor? weight, Tensor? bias, float eps) -> Tensor");
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("rope(Tensor x, Tensor? weight, float eps, Tensor cos, Tensor sin) -> Tensor");
  m.def("gemm_f32_built() -> bool", &xenc_lab::gemm_f32_built);
  m.def("half_gemm_built() -> bool", &xenc_lab::half_gemm_built);
  m.def("int8_gemm_built() -> bool", &xenc_lab::int8_gemm_built);
  m.def("int8_own_products(bool on) -> bool", &xenc_lab::own_int8_products);
  m.def(
      "linear_int8(Tensor x, Tensor blocks, Tensor correction, Tensor weight_scale, Tensor bias, int out_features, "
      "str activation, Tensor? residual, int rotation=0, Tensor? norm_weight=None, Tensor? norm_bias=None, "
      "float norm_eps=0.0) -> Tensor");
  m.def(
      "mlp_int8(Tensor x, Tensor blocks, Tensor correction, Tensor weight_scale, Tensor bias, int hidden_features, "
      "str activation, int rotation, Tensor blocks2, Tensor correction2, Tensor weight_scale2, Tensor bias2, "
      "int out_features, Tensor? residual, int rotation2, Tensor? norm_weight=None, Tensor? norm_bias=None, "
      "float norm_eps=0.0) -> Tensor");
  m.def("paired_bf16_built() -> bool", &xenc_lab::paired_bf16_built);
  m.def(
      "linear_half(Tensor x, Tensor blocks, int weight_exponent, Tensor bias, int out_features, str activation, "
      "Tensor? residual) -> Tensor");
  m.def(
      "linear_widened(Tensor x, Tensor blocks, Tensor bias, int out_features, str activation, Tensor? residual) -> "
      "Tensor");
  m.def(
      "linear_f32(Tensor x, Tensor blocks, Tensor bias, int out_features, str activation, Tensor? residual) -> "
      "Tensor");
}

TORCH_LIBRARY_IMPL(xenc_lab, CPU, m) {
  m.impl("packed_attention", &xenc_lab::packed_attention);
  m.impl("packed_attention_tiles", &xenc_lab::packed_attention_tiles);
  m.impl("paged_attention", &xenc_lab::paged_attention);
  m.impl("layer_norm", &xenc_lab::layer_norm);
  m.impl("rms_norm", &xenc_lab::rms_norm);
  m.impl("rope", &xenc_lab::rope);
  m.impl("folded_pool", &xenc_lab::folded_pool);
#if XENC_GEMM_F32
  m.impl("linear_f32", &xenc_lab::linear_f32);
  m.impl("linear_widened", &xenc_lab::linear_widened);
#endif
#if XENC_GEMM_INT8
  m.impl("linear_int8", &xenc_lab::linear_int8);
  m.impl("mlp_int8", &xenc_lab::mlp_int8);
#endif
#if XENC_HALF_GEMM
  m.impl("linear_half", &xenc_lab::linear_half);
#endif
}
