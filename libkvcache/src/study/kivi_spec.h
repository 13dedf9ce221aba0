// SPDX-License-Identifier: Apache-2.0
#pragma once
// The KIVI scheme spec as the study reads it (memory formula, reconstruction error):
// kivi[:k<b>][:v<b>][:g<G>][:r<R>], defaults k2 v2 g32 r128 (arXiv 2402.02750).
#include "kvcache/spec.h"

namespace kvcache::study {

inline const ParamTable& kivi_table() {
  static const ParamTable t{"kivi", "KIVI: per-channel keys, per-token values, fp16 residual (arXiv 2402.02750)",
                            {{"k", "key bits", ParamDef::Kind::kInt, 2, 1, 8, {}},
                             {"v", "value bits", ParamDef::Kind::kInt, 2, 1, 8, {}},
                             {"g", "group size", ParamDef::Kind::kInt, 32, 1, 65536, {}},
                             {"r", "fp16 residual tokens", ParamDef::Kind::kInt, 128, 0, 1 << 30, {}}}};
  return t;
}

}  // namespace kvcache::study
