// SPDX-License-Identifier: Apache-2.0
#pragma once
/// @file bit_stream.h (internal)
/// LSB-first bit streams of codes of up to 8 bits, as the codebook formats store them
/// (TurboQuant, its outlier split, PolarQuant; docs/quantizers.md): code bits are packed from
/// bit 0 of byte 0 upwards, a code may straddle two bytes. Writers OR into a zeroed buffer.

#include <cstdint>

namespace kvcache::quant::bit_stream {

/// ORs the `bits`-bit value v (bits ≤ 8, v < 2^bits) into `out` at bit offset `bit`; bits = 0
/// writes nothing.
inline void put_bits(uint8_t* out, int64_t bit, uint32_t v, int bits) {
  if (bits == 0) return;
  const uint32_t w = v << (bit % 8);
  out[bit / 8] = static_cast<uint8_t>(out[bit / 8] | (w & 0xffu));
  if ((bit % 8) + bits > 8) out[bit / 8 + 1] = static_cast<uint8_t>(out[bit / 8 + 1] | (w >> 8));
}

/// The `bits`-bit value at bit offset `bit` of `in` (bits ≤ 8; 0 when bits = 0).
inline uint32_t get_bits(const uint8_t* in, int64_t bit, int bits) {
  if (bits == 0) return 0;
  uint32_t v = in[bit / 8] >> (bit % 8);
  if ((bit % 8) + bits > 8) v |= static_cast<uint32_t>(in[bit / 8 + 1]) << (8 - bit % 8);
  return v & ((1u << bits) - 1u);
}

}  // namespace kvcache::quant::bit_stream
