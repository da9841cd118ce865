// The attention of a layer read at first tokens only, its keys and values folded into the query
// (folded_first_token_attention in layers.py): per pair b, rows cu_seqlens[b]:[b + 1] of x (T, d), and head h,
// sum_j softmax_j(x_j . folded[h, b]) x_j, returned as (B, H, d) (zeros for empty pairs and for pairs past
// cu_seqlens). Two thin products and a softmax per pair, with torch's ops; the pairs are shared among the threads,
// each pair's ops single-threaded wherever it runs, so a pair's result depends on its rows alone.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/mm.h>
#include <ATen/ops/softmax.h>
#include <ATen/ops/zeros.h>
#include <c10/core/InferenceMode.h>
#include <c10/util/ParallelGuard.h>

#include <cstdint>

#include "ops.h"

namespace xenc_lab {

at::Tensor folded_pool(const at::Tensor& x, const at::Tensor& folded, const at::Tensor& cu_seqlens) {
  TORCH_CHECK(x.dim() == 2 && folded.dim() == 3 && folded.size(2) == x.size(1) &&
                  folded.scalar_type() == x.scalar_type() && x.device().is_cpu() && folded.device().is_cpu(),
              "folded_pool takes x (T, d) and folded (H, B, d) of one dtype on the CPU, got ", x.sizes(), " ",
              x.scalar_type(), " and ", folded.sizes(), " ", folded.scalar_type());
  TORCH_CHECK(cu_seqlens.dim() == 1 && cu_seqlens.scalar_type() == at::kInt && cu_seqlens.size(0) >= 1 &&
                  cu_seqlens.size(0) - 1 <= folded.size(1),
              "cu_seqlens must be int32 (P + 1,) with P <= ", folded.size(1), " pairs, got ", cu_seqlens.scalar_type(),
              " ", cu_seqlens.sizes());
  const at::Tensor cu = cu_seqlens.contiguous();
  const int32_t* bounds = cu.const_data_ptr<int32_t>();
  const int64_t pairs = cu.size(0) - 1;
  for (int64_t b = 0; b < pairs; ++b) {
    TORCH_CHECK(0 <= bounds[b] && bounds[b] <= bounds[b + 1] && bounds[b + 1] <= x.size(0),
                "cu_seqlens must rise within the ", x.size(0), " rows of x, got ", bounds[b], " then ", bounds[b + 1]);
  }
  at::Tensor pooled = at::zeros({folded.size(1), folded.size(0), x.size(1)}, x.options());
  const bool inference = c10::InferenceMode::is_enabled();  // thread-local: the worker threads take the caller's
  at::parallel_for(0, pairs, 1, [&](int64_t begin, int64_t end) {
    c10::InferenceMode mode(inference);
    c10::ParallelGuard single_threaded(true);
    for (int64_t b = begin; b < end; ++b) {
      if (bounds[b + 1] > bounds[b]) {
        const at::Tensor rows = x.narrow(0, bounds[b], bounds[b + 1] - bounds[b]);
        const at::Tensor weights = at::softmax(at::mm(rows, folded.select(1, b).t()), 0);  // (n, H)
        at::Tensor out = pooled.select(0, b);
        at::mm_out(out, weights.t(), rows);
      }
    }
  });
  return pooled;
}

}  // namespace xenc_lab
