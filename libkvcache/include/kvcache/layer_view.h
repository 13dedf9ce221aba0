// SPDX-License-Identifier: Apache-2.0
#pragma once
/// @file layer_view.h
/// LayerView, TensorLayerView, QueryNeed and QueryRows now live in kvcache/eviction_inputs.h,
/// beside the other inputs of an eviction policy; this header stays for code that includes it.

#include "kvcache/eviction_inputs.h"
