// bfloat16 <-> float on the host. bf16 is stored as uint16_t (the top half of an IEEE float).
#pragma once

#include <cstdint>
#include <cstring>

namespace ds {

using bf16_t = uint16_t;

inline float bf16_to_f32(bf16_t v) {
  uint32_t bits = static_cast<uint32_t>(v) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// Round to nearest even, NaN kept quiet (as torch and __float2bfloat16_rn do).
inline bf16_t f32_to_bf16(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<bf16_t>((bits >> 16) | 0x40);
  uint32_t rounding = 0x7fffu + ((bits >> 16) & 1u);
  return static_cast<bf16_t>((bits + rounding) >> 16);
}

// Rounds a float through bf16 and back (the residual stream is bf16, as in HF).
inline float round_bf16(float f) { return bf16_to_f32(f32_to_bf16(f)); }

// IEEE half -> float (f16 checkpoints).
inline float f16_to_f32(uint16_t h) {
  uint32_t sign = (h & 0x8000u) << 16, exp = (h >> 10) & 0x1f, mant = h & 0x3ffu, bits;
  if (exp == 0) {
    if (mant == 0) {
      bits = sign;
    } else {  // subnormal: normalise
      exp = 127 - 15 + 1;
      while (!(mant & 0x400u)) { mant <<= 1; --exp; }
      bits = sign | (exp << 23) | ((mant & 0x3ffu) << 13);
    }
  } else if (exp == 31) {
    bits = sign | 0x7f800000u | (mant << 13);
  } else {
    bits = sign | ((exp + 127 - 15) << 23) | (mant << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

}  // namespace ds
