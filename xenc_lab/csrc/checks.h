// Argument checks and dtype dispatch shared by the operators' entry points (attention, layer norm, RMSNorm, rotary):
// each check raises a RuntimeError (TORCH_CHECK) naming the argument, what was expected and what came.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <string>
#include <vector>

#include "vec.h"

namespace xenc_lab {

// x is float32, bfloat16 or float16, the dtypes every row op takes: "<op> supports float32, bfloat16 and float16".
void check_float_dtype(const at::Tensor& x, const char* op);

// f(T{}) with T the C++ type of x's dtype (float, BFloat16 or Half), which check_float_dtype has checked.
template <typename F>
void dispatch_float(const at::Tensor& x, F&& f) {
  if (x.scalar_type() == at::kFloat) {
    f(float{});
  } else if (x.scalar_type() == at::kBFloat16) {
    f(BFloat16{});
  } else {
    f(Half{});
  }
}

// t is a contiguous CPU tensor of `shape` and x's dtype (a weight, a rotary table).
void check_like(const at::Tensor& t, const at::Tensor& x, at::IntArrayRef shape, const char* name);

// x is a 2-D CPU token stream (tokens, columns) of q's dtype with the columns of `like` (a 2-D tensor named
// `like_name`, x itself allowed), contiguous columns and a non-negative row stride.
void check_stream(const at::Tensor& x, const char* name, const at::Tensor& q, const at::Tensor& like,
                  const char* like_name);

// The sequences of a packed batch: sequence b's queries are rows q[b]:q[b + 1], its keys k[b]:k[b + 1].
struct Sequences {
  std::vector<int64_t> q, k;
};

// cu_seqlens_q and cu_seqlens_k read (1-D int32 or int64 CPU tensors of one length) and checked: non-decreasing,
// the queries within `query_rows` rows, the keys within `key_rows` (`keys` says of what), no sequence with more
// queries than keys (its queries are its `queries_are` tokens: "first" or "last").
Sequences read_sequences(const at::Tensor& cu_seqlens_q, const at::Tensor& cu_seqlens_k, int64_t query_rows,
                         int64_t key_rows, const std::string& keys, const char* queries_are);

}  // namespace xenc_lab
