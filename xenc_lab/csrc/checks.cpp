// Argument checks shared by the operators' entry points (checks.h).

#include "checks.h"

#include <c10/util/Exception.h>

namespace xenc_lab {
namespace {

std::vector<int64_t> read_offsets(const at::Tensor& cu, const char* name) {
  TORCH_CHECK(cu.dim() == 1 && cu.numel() >= 1, name, " must be 1-D with at least one element, got shape ",
              cu.sizes());
  TORCH_CHECK(cu.device().is_cpu(), name, " must be on the CPU");
  std::vector<int64_t> out(cu.numel());
  if (cu.scalar_type() == at::kInt) {
    const auto a = cu.accessor<int32_t, 1>();
    for (int64_t i = 0; i < cu.numel(); ++i) out[i] = a[i];
  } else {
    TORCH_CHECK(cu.scalar_type() == at::kLong, name, " must be int32 or int64, got ", cu.scalar_type());
    const auto a = cu.accessor<int64_t, 1>();
    for (int64_t i = 0; i < cu.numel(); ++i) out[i] = a[i];
  }
  return out;
}

}  // namespace

void check_float_dtype(const at::Tensor& x, const char* op) {
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kHalf,
              op, " supports float32, bfloat16 and float16, got ", x.scalar_type());
}

void check_like(const at::Tensor& t, const at::Tensor& x, at::IntArrayRef shape, const char* name) {
  TORCH_CHECK(t.sizes() == shape && t.is_contiguous() && t.scalar_type() == x.scalar_type() && t.device().is_cpu(),
              name, " must be a contiguous CPU tensor of shape ", shape, " and dtype ", x.scalar_type(), ", got ",
              t.sizes(), " ", t.scalar_type());
}

void check_stream(const at::Tensor& x, const char* name, const at::Tensor& q, const at::Tensor& like,
                  const char* like_name) {
  TORCH_CHECK(x.device().is_cpu(), name, " must be on the CPU");
  TORCH_CHECK(x.dim() == 2, name, " must be 2-D (tokens, heads * head_dim), got shape ", x.sizes());
  TORCH_CHECK(x.scalar_type() == q.scalar_type(), name, " has dtype ", x.scalar_type(), " but q has ",
              q.scalar_type());
  TORCH_CHECK(x.size(1) == like.size(1), name, " has ", x.size(1), " columns but ", like_name, " has ", like.size(1));
  TORCH_CHECK(x.size(1) <= 1 || x.stride(1) == 1, name, " must have contiguous columns (stride 1), got strides ",
              x.strides());
  TORCH_CHECK(x.size(0) <= 1 || x.stride(0) >= 0, name, " must have non-negative row stride");
}

Sequences read_sequences(const at::Tensor& cu_seqlens_q, const at::Tensor& cu_seqlens_k, int64_t query_rows,
                         int64_t key_rows, const std::string& keys, const char* queries_are) {
  Sequences s{read_offsets(cu_seqlens_q, "cu_seqlens_q"), read_offsets(cu_seqlens_k, "cu_seqlens_k")};
  TORCH_CHECK(s.q.size() == s.k.size(), "cu_seqlens_q and cu_seqlens_k must have the same length, got ", s.q.size(),
              " and ", s.k.size());
  TORCH_CHECK(s.q.front() >= 0 && s.q.back() <= query_rows, "cu_seqlens_q must lie within q's ", query_rows, " rows");
  TORCH_CHECK(s.k.front() >= 0 && s.k.back() <= key_rows, "cu_seqlens_k must lie within ", keys);
  for (size_t b = 0; b + 1 < s.q.size(); ++b) {
    const int64_t nq = s.q[b + 1] - s.q[b], nk = s.k[b + 1] - s.k[b];
    TORCH_CHECK(nq >= 0 && nk >= 0, "cu_seqlens must be non-decreasing (sequence ", b, ")");
    TORCH_CHECK(nq <= nk, "sequence ", b, " has ", nq, " queries but only ", nk, " keys; queries are the ",
                queries_are, " tokens of their sequence");
  }
  return s;
}

}  // namespace xenc_lab
