// cuda_fp16.h for the CPU emulation: __half / __half2 and the cuda_fp16.h functions, in software.
// Conversions round to nearest even, bit for bit as __float2half and numpy's astype; arithmetic is
// done in float (or double for fma) and rounded once, which is the correctly rounded fp16 result.
#pragma once

#include "../cuda_shim.h"

// float <-> binary16 in software, round to nearest even (as __float2half and numpy's astype)
inline unsigned short lkv_f2h(float f) {
  const uint32_t x = lkv_bits<uint32_t>(f);
  const uint32_t sign = (x >> 16) & 0x8000u, ax = x & 0x7fffffffu;
  if (ax > 0x7f800000u) return (unsigned short)(sign | 0x7fffu);  // NaN: CUDA's canonical quiet NaN
  if (ax >= 0x477ff000u) return (unsigned short)(sign | 0x7c00u);  // >= 65520 (or inf) rounds to inf
  if (ax >= 0x38800000u) {                                         // a normal half
    uint32_t r = ax - 0x38000000u;
    r += 0x0fffu + ((r >> 13) & 1u);
    return (unsigned short)(sign | (r >> 13));
  }
  const int shift = 126 - (int)(ax >> 23);  // a subnormal half (or zero): round(|f| * 2^24)
  if (shift > 24) return (unsigned short)sign;
  const uint32_t m = (ax & 0x7fffffu) | 0x800000u;
  uint32_t n = m >> shift;
  const uint32_t rem = m & ((1u << shift) - 1u), half = 1u << (shift - 1);
  if (rem > half || (rem == half && (n & 1u))) ++n;
  return (unsigned short)(sign | n);
}
inline float lkv_h2f(unsigned short h) {
  const uint32_t sign = (uint32_t)(h & 0x8000u) << 16, e = (h >> 10) & 0x1fu, m = h & 0x3ffu;
  if (e == 0) {
    const float f = (float)m * 5.9604644775390625e-08f;  // m * 2^-24, exact
    return sign ? -f : f;
  }
  if (e == 31) return lkv_bits<float>(sign | 0x7f800000u | (m << 13));
  return lkv_bits<float>(sign | ((e + 112u) << 23) | (m << 13));
}

struct __half_raw {
  unsigned short x;
};
struct __attribute__((aligned(2))) __half {
  unsigned short __x;
  __half() = default;
  __half(const __half_raw& r) : __x(r.x) {}
  __half(float f) : __x(lkv_f2h(f)) {}
  __half(double d) : __x(lkv_f2h((float)d)) {}
  __half(int i) : __x(lkv_f2h((float)i)) {}
  __half(unsigned i) : __x(lkv_f2h((float)i)) {}
  operator float() const { return lkv_h2f(__x); }
  operator __half_raw() const { return __half_raw{__x}; }
};
struct __attribute__((aligned(4))) __half2 {
  __half x, y;
  __half2() = default;
  constexpr __half2(__half a, __half b) : x(a), y(b) {}
  __half2(const __half2& o) : x(o.x), y(o.y) { lkv_emu::check_align(&o, 4, "__half2"); }
  __half2& operator=(const __half2& o) {
    lkv_emu::check_align(this, 4, "__half2");
    lkv_emu::check_align(&o, 4, "__half2");
    x = o.x;
    y = o.y;
    return *this;
  }
};
typedef __half half;
typedef __half2 half2;

inline __half lkv_h(float f) { return __half(f); }
inline __half __float2half(float f) { return __half(f); }
inline __half __float2half_rn(float f) { return __half(f); }
inline float __half2float(__half h) { return lkv_h2f(h.__x); }
inline __half __int2half_rn(int i) { return __half((float)i); }
inline int __half2int_rn(__half h) { return (int)nearbyintf(__half2float(h)); }
inline unsigned short __half_as_ushort(__half h) { return h.__x; }
inline __half __ushort_as_half(unsigned short x) { return __half(__half_raw{x}); }
inline short __half_as_short(__half h) { return (short)h.__x; }
inline __half __short_as_half(short x) { return __half(__half_raw{(unsigned short)x}); }
inline __half2 __float2half2_rn(float f) { return __half2(__half(f), __half(f)); }
inline __half2 __floats2half2_rn(float a, float b) { return __half2(__half(a), __half(b)); }
inline __half2 __float22half2_rn(float2 f) { return __half2(__half(f.x), __half(f.y)); }
inline float2 __half22float2(__half2 h) { return float2(__half2float(h.x), __half2float(h.y)); }
inline float __low2float(__half2 h) { return __half2float(h.x); }
inline float __high2float(__half2 h) { return __half2float(h.y); }
inline __half __low2half(__half2 h) { return h.x; }
inline __half __high2half(__half2 h) { return h.y; }
inline __half2 __halves2half2(__half a, __half b) { return __half2(a, b); }
inline __half2 __half2half2(__half a) { return __half2(a, a); }
inline __half2 __lows2half2(__half2 a, __half2 b) { return __half2(a.x, b.x); }
inline __half2 __highs2half2(__half2 a, __half2 b) { return __half2(a.y, b.y); }
inline __half2 __low2half2(__half2 a) { return __half2(a.x, a.x); }
inline __half2 __high2half2(__half2 a) { return __half2(a.y, a.y); }
inline __half2 __lowhigh2highlow(__half2 a) { return __half2(a.y, a.x); }

// fp16 arithmetic: computed in float, rounded once to fp16. For + - * / that is the correctly
// rounded fp16 result (float has more than 2 * 11 + 2 bits); fma rounds a * b + c in double.
inline __half __hadd(__half a, __half b) { return __half((float)a + (float)b); }
inline __half __hsub(__half a, __half b) { return __half((float)a - (float)b); }
inline __half __hmul(__half a, __half b) { return __half((float)a * (float)b); }
inline __half __hdiv(__half a, __half b) { return __half((float)a / (float)b); }
inline __half __hfma(__half a, __half b, __half c) { return __half((float)((double)a * (double)b + (double)c)); }
inline __half __hneg(__half a) { return __half(__half_raw{(unsigned short)(a.__x ^ 0x8000u)}); }
inline __half __habs(__half a) { return __half(__half_raw{(unsigned short)(a.__x & 0x7fffu)}); }
inline __half __hmax(__half a, __half b) { return __half(fmaxf(a, b)); }
inline __half __hmin(__half a, __half b) { return __half(fminf(a, b)); }
inline bool __heq(__half a, __half b) { return (float)a == (float)b; }
inline bool __hne(__half a, __half b) { return (float)a != (float)b; }
inline bool __hlt(__half a, __half b) { return (float)a < (float)b; }
inline bool __hle(__half a, __half b) { return (float)a <= (float)b; }
inline bool __hgt(__half a, __half b) { return (float)a > (float)b; }
inline bool __hge(__half a, __half b) { return (float)a >= (float)b; }
inline bool __hisnan(__half a) { return (a.__x & 0x7fffu) > 0x7c00u; }
inline bool __hisinf(__half a) { return (a.__x & 0x7fffu) == 0x7c00u; }
inline __half hexp(__half a) { return __half(expf(a)); }
inline __half hlog(__half a) { return __half(logf(a)); }
inline __half hsqrt(__half a) { return __half(sqrtf(a)); }
inline __half hrsqrt(__half a) { return __half(1.f / sqrtf(a)); }
#define LKV_H2(name, f) \
  inline __half2 name(__half2 a, __half2 b) { return __half2(f(a.x, b.x), f(a.y, b.y)); }
LKV_H2(__hadd2, __hadd)
LKV_H2(__hsub2, __hsub)
LKV_H2(__hmul2, __hmul)
LKV_H2(__h2div, __hdiv)
LKV_H2(__hmax2, __hmax)
LKV_H2(__hmin2, __hmin)
#undef LKV_H2
inline __half2 __hfma2(__half2 a, __half2 b, __half2 c) { return __half2(__hfma(a.x, b.x, c.x), __hfma(a.y, b.y, c.y)); }
inline __half2 __hneg2(__half2 a) { return __half2(__hneg(a.x), __hneg(a.y)); }
inline __half2 __habs2(__half2 a) { return __half2(__habs(a.x), __habs(a.y)); }
inline __half operator+(__half a, __half b) { return __hadd(a, b); }
inline __half operator-(__half a, __half b) { return __hsub(a, b); }
inline __half operator*(__half a, __half b) { return __hmul(a, b); }
inline __half operator/(__half a, __half b) { return __hdiv(a, b); }
inline __half operator-(__half a) { return __hneg(a); }
inline __half& operator+=(__half& a, __half b) { return a = __hadd(a, b); }
inline __half& operator-=(__half& a, __half b) { return a = __hsub(a, b); }
inline __half& operator*=(__half& a, __half b) { return a = __hmul(a, b); }
inline __half& operator/=(__half& a, __half b) { return a = __hdiv(a, b); }
inline bool operator==(__half a, __half b) { return __heq(a, b); }
inline bool operator!=(__half a, __half b) { return __hne(a, b); }
inline bool operator<(__half a, __half b) { return __hlt(a, b); }
inline bool operator<=(__half a, __half b) { return __hle(a, b); }
inline bool operator>(__half a, __half b) { return __hgt(a, b); }
inline bool operator>=(__half a, __half b) { return __hge(a, b); }
inline __half2 operator+(__half2 a, __half2 b) { return __hadd2(a, b); }
inline __half2 operator-(__half2 a, __half2 b) { return __hsub2(a, b); }
inline __half2 operator*(__half2 a, __half2 b) { return __hmul2(a, b); }
inline __half2 operator/(__half2 a, __half2 b) { return __h2div(a, b); }

