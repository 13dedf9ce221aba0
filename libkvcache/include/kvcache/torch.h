// SPDX-License-Identifier: Apache-2.0
#pragma once
/// @file torch.h
/// The whole at::Tensor face of the core (kvcache::torch target): at::Tensor arguments to every
/// core call (tensor_view.h), the quantizers' tensor forms (quantizer.h), the reference
/// attention (attention.h), a tensor RoPE as the core's hook (rope.h), the runner's KVCache
/// over a core cache (cache.h) and KVQuant's fit over tensors (kvquant.h).

#include "kvcache/torch/attention.h"
#include "kvcache/torch/cache.h"
#include "kvcache/torch/kvquant.h"
#include "kvcache/torch/quantizer.h"
#include "kvcache/torch/rope.h"
#include "kvcache/torch/tensor_view.h"
