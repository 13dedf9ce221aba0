// SPDX-License-Identifier: Apache-2.0
// KVQuant's fit over at::Tensors (kvcache/torch/kvquant.h).
#include "kvcache/torch/kvquant.h"

#include <cstring>

namespace kvcache {

KvquantCalibration fit_kvquant_calibration(const std::vector<at::Tensor>& keys, const std::vector<at::Tensor>& values,
                                           const KvquantFitOptions& options, const std::string& source,
                                           const KvquantWeights* weights) {
  return fit_kvquant_calibration(views(keys), views(values), options, source, weights);
}

KvquantWeights kvquant_weights(const std::vector<at::Tensor>& keys, const std::vector<at::Tensor>& values) {
  KvquantWeights w;
  for (const auto* src : {&keys, &values}) {
    for (const at::Tensor& t : *src) {
      Buffer b;
      if (t.defined()) {
        const at::Tensor c = t.contiguous();
        b = Buffer(dtype_of(c.scalar_type()), c.sizes().vec());
        if (b.nbytes() > 0) std::memcpy(b.data(), c.data_ptr(), static_cast<size_t>(b.nbytes()));
      }
      (src == &keys ? w.keys : w.values).push_back(std::move(b));
    }
  }
  return w;
}

}  // namespace kvcache
