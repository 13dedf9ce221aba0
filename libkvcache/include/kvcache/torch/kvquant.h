// SPDX-License-Identifier: Apache-2.0
#pragma once
/// @file torch/kvquant.h
/// KVQuant's fit over at::Tensors (kvcache::torch target): kvcache/kvquant.h's
/// fit_kvquant_calibration with captured activations as tensors.

#include <ATen/ATen.h>

#include <string>
#include <vector>

#include "kvcache/kvquant.h"
#include "kvcache/torch/tensor_view.h"

namespace kvcache {

/// fit_kvquant_calibration(views(keys), views(values), ...): `keys[l]`, `values[l]` float
/// `[N, H_kv, D]` CPU tensors. @throws as the core's fit.
KvquantCalibration fit_kvquant_calibration(const std::vector<at::Tensor>& keys, const std::vector<at::Tensor>& values,
                                           const KvquantFitOptions& options, const std::string& source,
                                           const KvquantWeights* weights = nullptr);

/// Weights from tensors (`keys[l]`, `values[l]` float `[N, H_kv, D]`), copied into Buffers.
KvquantWeights kvquant_weights(const std::vector<at::Tensor>& keys, const std::vector<at::Tensor>& values);

}  // namespace kvcache
