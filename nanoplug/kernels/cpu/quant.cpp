// nanoplug's CPU kernels for GGUF-quantized weights (Q4_0, Q4_1, Q5_0, Q8_0, Q4_K), kept quantized in memory.
//
// Layout. A weight [N, K] is repacked once at load into panels of 16 output rows. Inside a panel each
// 32-weight sub-block holds the 16 rows' scales (the file's float16 bits, or Q4_K's 6-bit scales and
// their float16 super-block factors) and their quants transposed in 4-byte groups:
// qs[g][row][4 bytes], g = 0..3 for the 4-bit formats (a byte's low nibble is weight k = 4g+j, its
// high nibble k = 16+4g+j, as in the file's own byte), g = 0..7 for Q8_0 (stored as w ^ 0x80, an
// unsigned byte). Q5_0 is Q4_0's layout plus its fifth bits: after the nibbles, 8 64-bit masks per
// sub-block, mask i's bit 4*row+j the fifth bit of weight 4i+j of that row (the bytes of quant group i
// once its nibbles are unpacked), so an AVX-512 mask register adds them back in one instruction. One 64-byte load then holds 4 consecutive weights of each of 16 rows: a VNNI
// vpdpbusd against 4 activation bytes broadcast gives the 16 rows' partial dot products in its 16
// lanes, with no horizontal sum. The bytes per weight stay the file's (Q4_K: 148 bytes per 256 instead
// of 144), so a decode step streams the quantized weights, not float32 copies.
//
// Activations are used in float32 (each sub-block dequantized in registers), or quantized on the fly to
// int8 per 32 values as llama.cpp's Q8_1 does (scale amax/127, round to nearest even, the block sum kept
// for the formats with an offset or minimum), or "int8x2": int8 blocks of x and of its residual, two
// integer dot products per weight group, which is float32 compute's quality (llama.cpp's int8 is not: it
// turns the default model's answer to "What is the capital of France?" into a loop) at int8's speed.
//
// Dispatch. Built without -march flags; the AVX-512 (VNNI), AVX2 and (aarch64) NEON dot-product paths of
// the integer GEMM are compiled for their targets with function attributes and chosen at run time from what
// the CPU reports, and a portable C++ path serves everywhere else (and Arm's float32-activation GEMM).
// Every entry point takes the path to use, so tests can run each one.
// Dequantization is exact: it equals gguf-py's (float32 d*q+m etc.; the products are exact in
// float32, so the order of operations cannot change a bit).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__x86_64__) || defined(_M_X64)
#define NP_X86 1
#include <immintrin.h>
#define T_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")))
#define T_AVX2 __attribute__((target("avx2,fma,f16c")))
#endif
#if defined(__aarch64__)
#define NP_ARM 1
#include <arm_neon.h>
#include <sys/auxv.h>
#define T_DOT __attribute__((target("arch=armv8.2-a+dotprod")))
#endif

namespace {

enum Format : int { Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q8_0 = 8, Q4_K = 12 };
enum Isa : int { PORTABLE = 0, AVX2 = 1, AVX512 = 2, NEON_DOT = 3 };
constexpr int64_t PR = 16;  // rows per panel
constexpr int64_t SB = 32;  // weights per sub-block

bool known(int fmt) { return fmt == Q4_0 || fmt == Q4_1 || fmt == Q5_0 || fmt == Q8_0 || fmt == Q4_K; }
int64_t file_block(int fmt) { return fmt == Q4_K ? 256 : 32; }
int64_t file_type_size(int fmt) {
  switch (fmt) {
    case Q4_0: return 18;
    case Q4_1: return 20;
    case Q5_0: return 22;
    case Q8_0: return 34;
    default: return 144;
  }
}
int64_t qs_bytes(int fmt) { return fmt == Q8_0 ? 512 : fmt == Q5_0 ? 320 : 256; }  // per sub-block per panel
// A panel is a run of units, each its sub-blocks' scales (a 64-byte header; Q4_K: its super-block's
// 320) followed by their quants, so one panel is read front to back as a single stream.
int64_t unit_subs(int fmt) { return fmt == Q4_1 ? 1 : fmt == Q4_K ? 8 : 2; }
int64_t unit_header(int fmt) { return fmt == Q4_K ? 320 : 64; }
int64_t unit_bytes(int fmt) { return unit_header(fmt) + unit_subs(fmt) * qs_bytes(fmt); }
int64_t panel_bytes(int fmt, int64_t K) { return (K / SB + unit_subs(fmt) - 1) / unit_subs(fmt) * unit_bytes(fmt); }
// sub-block b's header (Q4_0/Q5_0/Q8_0: d[16] of its pair at +32 * (b % 2); Q4_1: d[16], m[16]; Q4_K: d[16],
// dmin[16], sc[8][16], m[8][16] of its super-block) and its quants
inline const uint8_t* sub_header(int fmt, const uint8_t* panel, int64_t b) {
  return panel + b / unit_subs(fmt) * unit_bytes(fmt);
}
inline const uint8_t* sub_qs(int fmt, const uint8_t* panel, int64_t b) {
  return sub_header(fmt, panel, b) + unit_header(fmt) + b % unit_subs(fmt) * qs_bytes(fmt);
}

float half_to_float(uint16_t h) {
  const uint32_t sign = (h & 0x8000u) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ffu;
  uint32_t bits;
  if (exp == 0) {
    if (man == 0) {
      bits = sign;
    } else {  // subnormal: normalise
      int e = -1;
      uint32_t m = man;
      do { ++e; m <<= 1; } while (!(m & 0x400u));
      bits = sign | static_cast<uint32_t>(127 - 15 - e) << 23 | (m & 0x3ffu) << 13;
    }
  } else if (exp == 31) {
    bits = sign | 0x7f800000u | man << 13;
  } else {
    bits = sign | (exp + 127 - 15) << 23 | man << 13;
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}
inline uint16_t rd16(const uint8_t* p) { uint16_t v; std::memcpy(&v, p, 2); return v; }

// Q4_K's 6-bit scale and minimum of sub-block j from its 12 packed bytes (ggml's get_scale_min_k4)
inline void k4_scale_min(int j, const uint8_t* q, uint8_t* sc, uint8_t* m) {
  if (j < 4) {
    *sc = q[j] & 63;
    *m = q[j + 4] & 63;
  } else {
    *sc = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
    *m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
  }
}

// ---- repacking and exact dequantization ----

// Row n of the file's blocks -> its slot in panel layout (the panel is zeroed beforehand for padding rows).
void pack_row(int fmt, const uint8_t* src, int64_t K, uint8_t* panel, int lane) {
  for (int64_t b = 0; b < K / SB; ++b) {
    uint8_t* hdr = const_cast<uint8_t*>(sub_header(fmt, panel, b));
    uint8_t bytes[32];  // this row's 16 (4-bit) or 32 (Q8_0) quant bytes of sub-block b, file order
    if (fmt == Q4_0 || fmt == Q4_1 || fmt == Q5_0 || fmt == Q8_0) {
      const uint8_t* blk = src + b * file_type_size(fmt);
      std::memcpy(hdr + (fmt == Q4_1 ? 0 : b % 2 * 32) + lane * 2, blk, 2);
      if (fmt == Q4_1) std::memcpy(hdr + 32 + lane * 2, blk + 2, 2);
      const uint8_t* q = blk + (fmt == Q5_0 ? 6 : fmt == Q4_1 ? 4 : 2);
      if (fmt == Q5_0) {  // the fifth bits: weight k's (file bit k) into mask k % 16 / 4 + 4 * (k >= 16)
        uint32_t qh;
        std::memcpy(&qh, blk + 2, 4);
        uint64_t* masks = reinterpret_cast<uint64_t*>(const_cast<uint8_t*>(sub_qs(fmt, panel, b)) + 256);
        for (int k = 0; k < 32; ++k)
          if (qh >> k & 1u) masks[k % 16 / 4 + 4 * (k >= 16)] |= uint64_t{1} << (lane * 4 + k % 4);
      }
      if (fmt == Q8_0)
        for (int i = 0; i < 32; ++i) bytes[i] = q[i] ^ 0x80;
      else
        std::memcpy(bytes, q, 16);
    } else {  // Q4_K: sub-block b is sub-block j of super-block b / 8
      const int j = static_cast<int>(b % 8);
      const uint8_t* blk = src + b / 8 * 144;
      if (j == 0) {
        std::memcpy(hdr + lane * 2, blk, 2);
        std::memcpy(hdr + 32 + lane * 2, blk + 2, 2);
      }
      k4_scale_min(j, blk + 4, hdr + 64 + j * 16 + lane, hdr + 192 + j * 16 + lane);
      const uint8_t* q = blk + 16 + (j / 2) * 32;
      const int shift = (j % 2) * 4;
      for (int i = 0; i < 16; ++i)
        bytes[i] = static_cast<uint8_t>(((q[i] >> shift) & 0xF) | (((q[i + 16] >> shift) & 0xF) << 4));
    }
    uint8_t* dst = const_cast<uint8_t*>(sub_qs(fmt, panel, b));
    const int groups = fmt == Q8_0 ? 8 : 4;
    for (int g = 0; g < groups; ++g) std::memcpy(dst + (g * PR + lane) * 4, bytes + g * 4, 4);
  }
}

// The 32 quants of sub-block b of lane `lane` (4-bit: 0..15; Q5_0: 0..31; Q8_0: the signed value) as ints.
inline void lane_quants(int fmt, const uint8_t* qs_b, int lane, int32_t* q) {
  if (fmt == Q8_0) {
    for (int k = 0; k < 32; ++k) q[k] = static_cast<int8_t>(qs_b[((k / 4) * PR + lane) * 4 + k % 4] ^ 0x80);
  } else {
    for (int j = 0; j < 16; ++j) {
      const uint8_t v = qs_b[((j / 4) * PR + lane) * 4 + j % 4];
      q[j] = v & 0xF;
      q[j + 16] = v >> 4;
    }
    if (fmt == Q5_0) {
      const uint8_t* masks = qs_b + 256;
      for (int k = 0; k < 32; ++k) {
        const int i = k % 16 / 4 + 4 * (k >= 16), bit = lane * 4 + k % 4;
        q[k] |= (masks[i * 8 + bit / 8] >> (bit % 8) & 1) << 4;
      }
    }
  }
}

// Sub-block b of lane `lane`: its float factors, as gguf-py computes them: w = a * q + c
// (Q4_0: q - 8 folded into c = -8a would not be exact, so Q4_0 reports a and subtracts 8 from q; Q5_0 16).
inline void lane_factors(int fmt, const uint8_t* panel, int64_t b, int lane, float* a, float* c) {
  const uint8_t* hdr = sub_header(fmt, panel, b);
  switch (fmt) {
    case Q4_0:
    case Q5_0:
    case Q8_0:
      *a = half_to_float(rd16(hdr + b % 2 * 32 + lane * 2));
      *c = 0.f;
      return;
    case Q4_1:
      *a = half_to_float(rd16(hdr + lane * 2));
      *c = half_to_float(rd16(hdr + 32 + lane * 2));
      return;
    default: {
      const int j = static_cast<int>(b % 8);
      *a = half_to_float(rd16(hdr + lane * 2)) * static_cast<float>(hdr[64 + j * 16 + lane]);
      *c = -(half_to_float(rd16(hdr + 32 + lane * 2)) * static_cast<float>(hdr[192 + j * 16 + lane]));
    }
  }
}

void dequant_row(int fmt, const uint8_t* panel, int64_t K, int lane, float* out) {
  int32_t q[32];
  for (int64_t b = 0; b < K / SB; ++b) {
    float a, c;
    lane_factors(fmt, panel, b, lane, &a, &c);
    lane_quants(fmt, sub_qs(fmt, panel, b), lane, q);
    float* o = out + b * SB;
    switch (fmt) {
      case Q4_0: for (int k = 0; k < 32; ++k) o[k] = a * static_cast<float>(q[k] - 8); break;
      case Q5_0: for (int k = 0; k < 32; ++k) o[k] = a * static_cast<float>(q[k] - 16); break;
      case Q8_0: for (int k = 0; k < 32; ++k) o[k] = static_cast<float>(q[k]) * a; break;
      case Q4_1: for (int k = 0; k < 32; ++k) o[k] = a * static_cast<float>(q[k]) + c; break;
      default: for (int k = 0; k < 32; ++k) o[k] = a * static_cast<float>(q[k]) + c;  // d*sc*q - dmin*m
    }
  }
}

// ---- activations quantized to int8 (llama.cpp's Q8_1 blocks, float32 scales) ----

struct QAct {
  const int8_t* q;       // [M][K]
  const float* d;        // [M][nsub] scale
  const float* s;        // [M][nsub] d * sum(q) (int8x2: the float sum of the block's x)
  const int32_t* isum;   // [M][nsub] sum(q)
  int64_t K, nsub;
  // int8x2 only (else nullptr): the residual x - d * q quantized again, the same way. x = d*q + d2*q2 to
  // about 1/64,000 of a block's largest value (16 bits, as float32 compute on these weights needs), for
  // twice the integer dot products over weights unpacked once.
  const int8_t* q2 = nullptr;
  const float* d2 = nullptr;
  const int32_t* isum2 = nullptr;
};

// Quantize one block of 32 floats to int8 (scale amax/127, round to nearest even): q, its scale, the sum of q.
inline void quantize_block(const float* x, int8_t* q, float* d, int32_t* isum) {
  float amax = 0.f;
  for (int k = 0; k < 32; ++k) amax = std::max(amax, std::fabs(x[k]));
  const float db = amax / 127.f;
  const float id = db != 0.f ? 1.f / db : 0.f;
  int32_t sum = 0;
  for (int k = 0; k < 32; ++k) {
    const int32_t v = static_cast<int32_t>(std::nearbyint(x[k] * id));
    q[k] = static_cast<int8_t>(v);
    sum += v;
  }
  *d = db;
  *isum = sum;
}

// int8x2's second pass, portable: the residual of each block after q, d (quantize_rows' output)
void residual_rows_portable(const float* x, int64_t x_stride, int64_t M, int64_t K, const int8_t* q, const float* d,
                            int8_t* q2, float* d2, int32_t* isum2, float* s) {
  const int64_t nsub = K / SB;
  for (int64_t m = 0; m < M; ++m)
    for (int64_t b = 0; b < nsub; ++b) {
      const float* xb = x + m * x_stride + b * SB;
      const int8_t* qb = q + m * K + b * SB;
      float r[32], sum = 0.f;
      for (int k = 0; k < 32; ++k) {
        r[k] = xb[k] - d[m * nsub + b] * static_cast<float>(qb[k]);
        sum += xb[k];
      }
      quantize_block(r, q2 + m * K + b * SB, d2 + m * nsub + b, isum2 + m * nsub + b);
      s[m * nsub + b] = sum;
    }
}

void quantize_rows_portable(const float* x, int64_t x_stride, int64_t M, int64_t K, int8_t* q, float* d, float* s,
                            int32_t* isum) {
  const int64_t nsub = K / SB;
  for (int64_t m = 0; m < M; ++m)
    for (int64_t b = 0; b < nsub; ++b) {
      const int64_t i = m * nsub + b;
      quantize_block(x + m * x_stride + b * SB, q + m * K + b * SB, d + i, isum + i);
      s[i] = d[i] * static_cast<float>(isum[i]);
    }
}

// ---- portable path: the same math in plain loops ----

void panel_q8_portable(int fmt, const uint8_t* panel, const QAct& a, int64_t m0, int64_t rows, float* y, int64_t ldy,
                       int64_t valid, const float* bias) {
  float acc[PR * 64] = {};
  int32_t q[32];
  for (int lane = 0; lane < valid; ++lane)
    for (int64_t b = 0; b < a.nsub; ++b) {
      float wa, wc;
      lane_factors(fmt, panel, b, lane, &wa, &wc);
      lane_quants(fmt, sub_qs(fmt, panel, b), lane, q);
      for (int64_t r = 0; r < rows; ++r) {
        const int64_t m = m0 + r;
        const int8_t* xq = a.q + m * a.K + b * SB;
        int32_t sum = 0;
        for (int k = 0; k < 32; ++k) sum += q[k] * xq[k];
        if (fmt == Q4_0 || fmt == Q5_0) sum -= (fmt == Q4_0 ? 8 : 16) * a.isum[m * a.nsub + b];
        const float dx = a.d[m * a.nsub + b];
        acc[r * PR + lane] += static_cast<float>(sum) * (wa * dx);
        if (a.q2) {
          const int8_t* xq2 = a.q2 + m * a.K + b * SB;
          int32_t sum2 = 0;
          for (int k = 0; k < 32; ++k) sum2 += q[k] * xq2[k];
          if (fmt == Q4_0 || fmt == Q5_0) sum2 -= (fmt == Q4_0 ? 8 : 16) * a.isum2[m * a.nsub + b];
          acc[r * PR + lane] += static_cast<float>(sum2) * (wa * a.d2[m * a.nsub + b]);
        }
        if (fmt == Q4_1 || fmt == Q4_K) acc[r * PR + lane] += wc * a.s[m * a.nsub + b];
      }
    }
  for (int64_t r = 0; r < rows; ++r)
    for (int lane = 0; lane < valid; ++lane) y[r * ldy + lane] = acc[r * PR + lane] + (bias ? bias[lane] : 0.f);
}

void panel_f32_portable(int fmt, const uint8_t* panel, int64_t K, const float* x, int64_t x_stride, int64_t rows,
                        float* y, int64_t ldy, int64_t valid, const float* bias) {
  std::vector<float> w(K);
  for (int lane = 0; lane < valid; ++lane) {
    dequant_row(fmt, panel, K, lane, w.data());
    for (int64_t r = 0; r < rows; ++r) {
      const float* xr = x + r * x_stride;
      float acc = 0.f;
      for (int64_t k = 0; k < K; ++k) acc += w[k] * xr[k];
      y[r * ldy + lane] = acc + (bias ? bias[lane] : 0.f);
    }
  }
}

#ifdef NP_X86
// ---- AVX-512 with VNNI ----

// The 16 rows' float factors of sub-block b: w = a*q + c (Q4_0/Q5_0/Q8_0: c unused, their offsets are
// subtracted from the integer sums)
template <int F>
T_AVX512 inline void factors512(const uint8_t* panel, int64_t b, __m512& a, __m512& c) {
  const uint8_t* hdr = sub_header(F, panel, b);
  if (F == Q4_0 || F == Q5_0 || F == Q8_0) {
    a = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(hdr + b % 2 * 32)));
    c = _mm512_setzero_ps();
  } else if (F == Q4_1) {
    a = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(hdr)));
    c = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(hdr + 32)));
  } else {
    const int j = static_cast<int>(b % 8);
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(hdr)));
    const __m512 dmin = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(hdr + 32)));
    const __m512 sc = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(hdr + 64 + j * 16))));
    const __m512 mn = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(hdr + 192 + j * 16))));
    a = _mm512_mul_ps(d, sc);
    c = _mm512_sub_ps(_mm512_setzero_ps(), _mm512_mul_ps(dmin, mn));
  }
}

inline int32_t bcast4(const int8_t* p) { int32_t v; std::memcpy(&v, p, 4); return v; }

// Q5_0: the fifth bits (the 8 masks after a sub-block's nibbles) added to its unpacked quant groups w[8]
T_AVX512 inline void fifth_bits512(const uint8_t* qb, __m512i* w) {
  const __m512i sixteen = _mm512_set1_epi8(16);
  for (int i = 0; i < 8; ++i) {
    uint64_t m;
    std::memcpy(&m, qb + 256 + i * 8, 8);
    w[i] = _mm512_mask_add_epi8(w[i], _cvtu64_mask64(m), w[i], sixteen);  // + 16 where the bit is set
  }
}

// R activation rows x one panel (16 output rows), int8 activations
// Prefetch, spread over a panel's sub-blocks, the next panel (`next`, or nullptr) while this one is
// multiplied: the hardware prefetcher alone leaves the next panel's first lines to wait on DRAM (worst
// with several rows, where a panel is read once per row tile: 69 -> 170-200 GMAC/s for the Q8_0 head
// at 8 rows; 30 -> 35 GB/s at one row; benchmarks/cpu_quant_gemm.py).
inline void prefetch_share(const uint8_t* next, int64_t bytes, int64_t b, int64_t nsub) {
  if (!next) return;
  const int64_t lines = (bytes / 64 + nsub - 1) / nsub;
  for (int64_t l = b * lines; l < (b + 1) * lines && l * 64 < bytes; ++l) __builtin_prefetch(next + l * 64);
}

// The 16 rows' integer dot products with one activation block xb (w: the sub-block's unpacked weights)
template <int F, int R>
T_AVX512 inline __m512i dot_512(const __m512i* w, const int8_t* xb, int32_t isum) {
  // w[i] holds weights k = 4i..4i+3 of each row (both formats' layouts give that order). One row or
  // two: four independent chains, as a dot product's latency, not its throughput, would bound them;
  // more rows give the core independent work already.
  constexpr int C = R <= 2 ? 4 : 1;
  __m512i ch[C];
  for (int c = 0; c < C; ++c) ch[c] = _mm512_setzero_si512();
  for (int i = 0; i < 8; ++i) ch[i % C] = _mm512_dpbusd_epi32(ch[i % C], w[i], _mm512_set1_epi32(bcast4(xb + 4 * i)));
  __m512i s = ch[0];
  for (int c = 1; c < C; ++c) s = _mm512_add_epi32(s, ch[c]);
  if (F == Q4_0) s = _mm512_sub_epi32(s, _mm512_set1_epi32(8 * isum));
  if (F == Q5_0) s = _mm512_sub_epi32(s, _mm512_set1_epi32(16 * isum));
  if (F == Q8_0) s = _mm512_sub_epi32(s, _mm512_set1_epi32(128 * isum));
  return s;
}

template <int F, int R, bool X2>
T_AVX512 void tile_q8_512(const uint8_t* panel, const QAct& a, int64_t m0, float* y, int64_t ldy, int64_t valid,
                          const float* bias, const uint8_t* next) {
  const int64_t pb = panel_bytes(F, a.K);
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  const __m512i low = _mm512_set1_epi8(0x0F);
  for (int64_t b = 0; b < a.nsub; ++b) {
    __m512 fa, fc;
    factors512<F>(panel, b, fa, fc);
    prefetch_share(next, pb, b, a.nsub);
    __m512i w[8];
    const uint8_t* qb = sub_qs(F, panel, b);
    if (F == Q8_0) {
      for (int g = 0; g < 8; ++g) w[g] = _mm512_loadu_si512(qb + g * 64);
    } else {
      for (int g = 0; g < 4; ++g) {
        const __m512i v = _mm512_loadu_si512(qb + g * 64);
        w[g] = _mm512_and_si512(v, low);
        w[g + 4] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
      }
      if (F == Q5_0) fifth_bits512(qb, w);
    }
    for (int r = 0; r < R; ++r) {
      const int64_t m = m0 + r;
      const int64_t i = m * a.nsub + b;
      const __m512i s = dot_512<F, R>(w, a.q + m * a.K + b * SB, a.isum[i]);
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), _mm512_mul_ps(fa, _mm512_set1_ps(a.d[i])), acc[r]);
      if (X2) {
        const __m512i s2 = dot_512<F, R>(w, a.q2 + m * a.K + b * SB, a.isum2[i]);
        acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s2), _mm512_mul_ps(fa, _mm512_set1_ps(a.d2[i])), acc[r]);
      }
      if (F == Q4_1 || F == Q4_K) acc[r] = _mm512_fmadd_ps(fc, _mm512_set1_ps(a.s[i]), acc[r]);
    }
  }
  const __mmask16 mask = valid >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << valid) - 1);
  const __m512 bv = bias ? _mm512_maskz_loadu_ps(mask, bias) : _mm512_setzero_ps();
  for (int r = 0; r < R; ++r) _mm512_mask_storeu_ps(y + r * ldy, mask, _mm512_add_ps(acc[r], bv));
}

// R activation rows x one panel, float32 activations: each sub-block dequantized in registers
template <int F, int R>
T_AVX512 void tile_f32_512(const uint8_t* panel, int64_t K, const float* x, int64_t x_stride, float* y, int64_t ldy,
                           int64_t valid, const float* bias) {
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  const __m512i byte = _mm512_set1_epi32(0xFF);
  for (int64_t b = 0; b < K / SB; ++b) {
    __m512 fa, fc;
    factors512<F>(panel, b, fa, fc);
    const uint8_t* qb = sub_qs(F, panel, b);
    const float* xb = x + b * SB;
    if (F == Q5_0) {  // whole 5-bit quants, group by group, as Q8_0's bytes
      __m512i w[8];
      for (int g = 0; g < 4; ++g) {
        const __m512i v = _mm512_loadu_si512(qb + g * 64);
        w[g] = _mm512_and_si512(v, _mm512_set1_epi8(0x0F));
        w[g + 4] = _mm512_and_si512(_mm512_srli_epi16(v, 4), _mm512_set1_epi8(0x0F));
      }
      fifth_bits512(qb, w);
      for (int i = 0; i < 8; ++i)
        for (int j = 0; j < 4; ++j) {
          const __m512i u = _mm512_and_si512(_mm512_srli_epi32(w[i], 8 * j), byte);
          const __m512 wk = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(u, _mm512_set1_epi32(16))), fa);
          for (int r = 0; r < R; ++r) acc[r] = _mm512_fmadd_ps(wk, _mm512_set1_ps(xb[r * x_stride + 4 * i + j]), acc[r]);
        }
      continue;
    }
    constexpr int G = F == Q8_0 ? 8 : 4;
    for (int g = 0; g < G; ++g) {
      const __m512i v = _mm512_loadu_si512(qb + g * 64);
      for (int j = 0; j < 4; ++j) {
        const __m512i u = _mm512_and_si512(_mm512_srli_epi32(v, 8 * j), byte);
        if (F == Q8_0) {
          const __m512 wk = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(u, _mm512_set1_epi32(128))), fa);
          for (int r = 0; r < R; ++r) acc[r] = _mm512_fmadd_ps(wk, _mm512_set1_ps(xb[r * x_stride + 4 * g + j]), acc[r]);
        } else {
          const __m512i lo = _mm512_and_si512(u, _mm512_set1_epi32(0xF));
          const __m512i hi = _mm512_srli_epi32(u, 4);
          __m512 wl, wh;
          if (F == Q4_0) {
            wl = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(lo, _mm512_set1_epi32(8))), fa);
            wh = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(hi, _mm512_set1_epi32(8))), fa);
          } else {
            wl = _mm512_fmadd_ps(_mm512_cvtepi32_ps(lo), fa, fc);
            wh = _mm512_fmadd_ps(_mm512_cvtepi32_ps(hi), fa, fc);
          }
          for (int r = 0; r < R; ++r) {
            acc[r] = _mm512_fmadd_ps(wl, _mm512_set1_ps(xb[r * x_stride + 4 * g + j]), acc[r]);
            acc[r] = _mm512_fmadd_ps(wh, _mm512_set1_ps(xb[r * x_stride + 16 + 4 * g + j]), acc[r]);
          }
        }
      }
    }
  }
  const __mmask16 mask = valid >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << valid) - 1);
  const __m512 bv = bias ? _mm512_maskz_loadu_ps(mask, bias) : _mm512_setzero_ps();
  for (int r = 0; r < R; ++r) _mm512_mask_storeu_ps(y + r * ldy, mask, _mm512_add_ps(acc[r], bv));
}

T_AVX512 void quantize_rows_512(const float* x, int64_t x_stride, int64_t M, int64_t K, int8_t* q, float* d, float* s,
                                int32_t* isum) {
  const int64_t nsub = K / SB;
  const __m512 signless = _mm512_castsi512_ps(_mm512_set1_epi32(0x7fffffff));
  for (int64_t m = 0; m < M; ++m)
    for (int64_t b = 0; b < nsub; ++b) {
      const float* xb = x + m * x_stride + b * SB;
      const __m512 x0 = _mm512_loadu_ps(xb), x1 = _mm512_loadu_ps(xb + 16);
      const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_and_ps(x0, signless), _mm512_and_ps(x1, signless)));
      const float db = amax / 127.f;
      const float id = db != 0.f ? 1.f / db : 0.f;
      const __m512 iv = _mm512_set1_ps(id);
      const __m512i q0 = _mm512_cvtps_epi32(_mm512_mul_ps(x0, iv));  // round to nearest even
      const __m512i q1 = _mm512_cvtps_epi32(_mm512_mul_ps(x1, iv));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(q + m * K + b * SB), _mm512_cvtsepi32_epi8(q0));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(q + m * K + b * SB + 16), _mm512_cvtsepi32_epi8(q1));
      const int32_t sum = _mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1));
      d[m * nsub + b] = db;
      isum[m * nsub + b] = sum;
      s[m * nsub + b] = db * static_cast<float>(sum);
    }
}

T_AVX512 void residual_rows_512(const float* x, int64_t x_stride, int64_t M, int64_t K, const int8_t* q, const float* d,
                               int8_t* q2, float* d2, int32_t* isum2, float* s) {
  const int64_t nsub = K / SB;
  const __m512 signless = _mm512_castsi512_ps(_mm512_set1_epi32(0x7fffffff));
  for (int64_t m = 0; m < M; ++m)
    for (int64_t b = 0; b < nsub; ++b) {
      const float* xb = x + m * x_stride + b * SB;
      const int8_t* qb = q + m * K + b * SB;
      const __m512 x0 = _mm512_loadu_ps(xb), x1 = _mm512_loadu_ps(xb + 16), db = _mm512_set1_ps(d[m * nsub + b]);
      const __m512 r0 = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qb)))), db, x0);
      const __m512 r1 = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qb + 16)))), db, x1);
      const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_and_ps(r0, signless), _mm512_and_ps(r1, signless)));
      const float d2b = amax / 127.f;
      const __m512 iv = _mm512_set1_ps(d2b != 0.f ? 1.f / d2b : 0.f);
      const __m512i q0 = _mm512_cvtps_epi32(_mm512_mul_ps(r0, iv)), q1 = _mm512_cvtps_epi32(_mm512_mul_ps(r1, iv));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(q2 + m * K + b * SB), _mm512_cvtsepi32_epi8(q0));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(q2 + m * K + b * SB + 16), _mm512_cvtsepi32_epi8(q1));
      d2[m * nsub + b] = d2b;
      isum2[m * nsub + b] = _mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1));
      s[m * nsub + b] = _mm512_reduce_add_ps(_mm512_add_ps(x0, x1));
    }
}

// ---- AVX2 (no VNNI: maddubs + madd) ----

template <int F>
T_AVX2 inline void factors256(const uint8_t* panel, int64_t b, int h, __m256& a, __m256& c) {
  const uint8_t* hdr = sub_header(F, panel, b);
  if (F == Q4_0 || F == Q5_0 || F == Q8_0) {
    a = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(hdr + b % 2 * 32 + h * 16)));
    c = _mm256_setzero_ps();
  } else if (F == Q4_1) {
    a = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(hdr + h * 16)));
    c = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(hdr + 32 + h * 16)));
  } else {
    const int j = static_cast<int>(b % 8);
    const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(hdr + h * 16)));
    const __m256 dmin = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(hdr + 32 + h * 16)));
    const __m256 sc = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(hdr + 64 + j * 16 + h * 8))));
    const __m256 mn = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(hdr + 192 + j * 16 + h * 8))));
    a = _mm256_mul_ps(d, sc);
    c = _mm256_sub_ps(_mm256_setzero_ps(), _mm256_mul_ps(dmin, mn));
  }
}

// Q5_0, half h of a panel: the fifth bits (bits 32h.. of the 8 masks after the sub-block's nibbles) added to
// its unpacked quant groups w[8] (each mask bit spread to its byte, as 0 or 16)
T_AVX2 inline void fifth_bits256(const uint8_t* qb, int h, __m256i* w) {
  const __m256i pick = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1,
                                        2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3);
  const __m256i bit = _mm256_set1_epi64x(static_cast<long long>(0x8040201008040201ull));
  for (int i = 0; i < 8; ++i) {
    int32_t m;
    std::memcpy(&m, qb + 256 + i * 8 + h * 4, 4);
    const __m256i set = _mm256_cmpeq_epi8(_mm256_and_si256(_mm256_shuffle_epi8(_mm256_set1_epi32(m), pick), bit), bit);
    w[i] = _mm256_or_si256(w[i], _mm256_and_si256(set, _mm256_set1_epi8(16)));
  }
}

// sum of 4 u8*s8 products per int32 lane (no saturation for the operands used: |products pair| < 2^15)
T_AVX2 inline __m256i dot4(__m256i u, __m256i s) {
  return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
}

// R rows x one half (8 output rows, h = 0/1) of a panel, int8 activations
// The 8 rows' integer dot products with one activation block xb (w: the half sub-block's weights)
template <int F>
T_AVX2 inline __m256i dot_256(const __m256i* w, const int8_t* xb, int32_t isum) {
  __m256i s = _mm256_setzero_si256();
  if (F == Q8_0) {
    for (int g = 0; g < 8; ++g) {
      const __m256i xv = _mm256_set1_epi32(bcast4(xb + 4 * g));
      s = _mm256_add_epi32(s, dot4(_mm256_sign_epi8(w[g], w[g]), _mm256_sign_epi8(xv, w[g])));
    }
  } else {  // the 8 products of 4-bit quants (0..15) and int8 (|x| <= 127) sum in int16 without overflow
    // (8 x 2 x 15 x 127 = 30,480), so one widening a sub-block, as llama.cpp's AVX2 dot products do;
    // Q5_0's quants (0..31) widen every 4 products (4 x 2 x 31 x 127 = 31,496)
    constexpr int per = F == Q5_0 ? 2 : 4;
    for (int g0 = 0; g0 < 4; g0 += per) {
      __m256i p = _mm256_setzero_si256();
      for (int g = g0; g < g0 + per; ++g) {
        p = _mm256_add_epi16(p, _mm256_maddubs_epi16(w[g], _mm256_set1_epi32(bcast4(xb + 4 * g))));
        p = _mm256_add_epi16(p, _mm256_maddubs_epi16(w[g + 4], _mm256_set1_epi32(bcast4(xb + 16 + 4 * g))));
      }
      s = _mm256_add_epi32(s, _mm256_madd_epi16(p, _mm256_set1_epi16(1)));
    }
  }
  if (F == Q4_0) s = _mm256_sub_epi32(s, _mm256_set1_epi32(8 * isum));
  if (F == Q5_0) s = _mm256_sub_epi32(s, _mm256_set1_epi32(16 * isum));
  return s;
}

template <int F, int R, bool X2>
T_AVX2 void half_q8_256(const uint8_t* panel, const QAct& a, int64_t m0, int h, float* y, int64_t ldy, int64_t valid,
                        const float* bias) {
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  const __m256i low = _mm256_set1_epi8(0x0F);
  for (int64_t b = 0; b < a.nsub; ++b) {
    __m256 fa, fc;
    factors256<F>(panel, b, h, fa, fc);
    const uint8_t* qb = sub_qs(F, panel, b) + h * 32;
    __m256i w[8];
    if (F == Q8_0) {
      for (int g = 0; g < 8; ++g)  // back to signed weights: |w| as unsigned, the sign moved onto x
        w[g] = _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(qb + g * 64)), _mm256_set1_epi8(static_cast<char>(0x80)));
    } else {
      for (int g = 0; g < 4; ++g) {
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qb + g * 64));
        w[g] = _mm256_and_si256(v, low);
        w[g + 4] = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
      }
      if (F == Q5_0) fifth_bits256(sub_qs(F, panel, b), h, w);
    }
    for (int r = 0; r < R; ++r) {
      const int64_t m = m0 + r;
      const int64_t i = m * a.nsub + b;
      const __m256i s = dot_256<F>(w, a.q + m * a.K + b * SB, a.isum[i]);
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), _mm256_mul_ps(fa, _mm256_set1_ps(a.d[i])), acc[r]);
      if (X2) {
        const __m256i s2 = dot_256<F>(w, a.q2 + m * a.K + b * SB, a.isum2[i]);
        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s2), _mm256_mul_ps(fa, _mm256_set1_ps(a.d2[i])), acc[r]);
      }
      if (F == Q4_1 || F == Q4_K) acc[r] = _mm256_fmadd_ps(fc, _mm256_set1_ps(a.s[i]), acc[r]);
    }
  }
  const int64_t n = std::min<int64_t>(8, valid - h * 8);
  for (int r = 0; r < R; ++r) {
    float out[8];
    _mm256_storeu_ps(out, acc[r]);
    for (int64_t l = 0; l < n; ++l) y[r * ldy + h * 8 + l] = out[l] + (bias ? bias[h * 8 + l] : 0.f);
  }
}

template <int F, int R>
T_AVX2 void half_f32_256(const uint8_t* panel, int64_t K, const float* x, int64_t x_stride, int h, float* y,
                         int64_t ldy, int64_t valid, const float* bias) {
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  const __m256i byte = _mm256_set1_epi32(0xFF);
  for (int64_t b = 0; b < K / SB; ++b) {
    __m256 fa, fc;
    factors256<F>(panel, b, h, fa, fc);
    const uint8_t* qb = sub_qs(F, panel, b) + h * 32;
    const float* xb = x + b * SB;
    if (F == Q5_0) {  // whole 5-bit quants, group by group, as Q8_0's bytes
      __m256i w[8];
      for (int g = 0; g < 4; ++g) {
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qb + g * 64));
        w[g] = _mm256_and_si256(v, _mm256_set1_epi8(0x0F));
        w[g + 4] = _mm256_and_si256(_mm256_srli_epi16(v, 4), _mm256_set1_epi8(0x0F));
      }
      fifth_bits256(sub_qs(F, panel, b), h, w);
      for (int i = 0; i < 8; ++i)
        for (int j = 0; j < 4; ++j) {
          const __m256i u = _mm256_and_si256(_mm256_srli_epi32(w[i], 8 * j), byte);
          const __m256 wk = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(u, _mm256_set1_epi32(16))), fa);
          for (int r = 0; r < R; ++r) acc[r] = _mm256_fmadd_ps(wk, _mm256_set1_ps(xb[r * x_stride + 4 * i + j]), acc[r]);
        }
      continue;
    }
    constexpr int G = F == Q8_0 ? 8 : 4;
    for (int g = 0; g < G; ++g) {
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qb + g * 64));
      for (int j = 0; j < 4; ++j) {
        const __m256i u = _mm256_and_si256(_mm256_srli_epi32(v, 8 * j), byte);
        if (F == Q8_0) {
          const __m256 wk = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(u, _mm256_set1_epi32(128))), fa);
          for (int r = 0; r < R; ++r) acc[r] = _mm256_fmadd_ps(wk, _mm256_set1_ps(xb[r * x_stride + 4 * g + j]), acc[r]);
        } else {
          const __m256i lo = _mm256_and_si256(u, _mm256_set1_epi32(0xF));
          const __m256i hi = _mm256_srli_epi32(u, 4);
          __m256 wl, wh;
          if (F == Q4_0) {
            wl = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(lo, _mm256_set1_epi32(8))), fa);
            wh = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(hi, _mm256_set1_epi32(8))), fa);
          } else {
            wl = _mm256_fmadd_ps(_mm256_cvtepi32_ps(lo), fa, fc);
            wh = _mm256_fmadd_ps(_mm256_cvtepi32_ps(hi), fa, fc);
          }
          for (int r = 0; r < R; ++r) {
            acc[r] = _mm256_fmadd_ps(wl, _mm256_set1_ps(xb[r * x_stride + 4 * g + j]), acc[r]);
            acc[r] = _mm256_fmadd_ps(wh, _mm256_set1_ps(xb[r * x_stride + 16 + 4 * g + j]), acc[r]);
          }
        }
      }
    }
  }
  const int64_t n = std::min<int64_t>(8, valid - h * 8);
  for (int r = 0; r < R; ++r) {
    float out[8];
    _mm256_storeu_ps(out, acc[r]);
    for (int64_t l = 0; l < n; ++l) y[r * ldy + h * 8 + l] = out[l] + (bias ? bias[h * 8 + l] : 0.f);
  }
}

T_AVX2 void quantize_rows_256(const float* x, int64_t x_stride, int64_t M, int64_t K, int8_t* q, float* d, float* s,
                              int32_t* isum) {
  const int64_t nsub = K / SB;
  const __m256 signless = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  for (int64_t m = 0; m < M; ++m)
    for (int64_t b = 0; b < nsub; ++b) {
      const float* xb = x + m * x_stride + b * SB;
      __m256 v[4], mx = _mm256_setzero_ps();
      for (int i = 0; i < 4; ++i) {
        v[i] = _mm256_loadu_ps(xb + 8 * i);
        mx = _mm256_max_ps(mx, _mm256_and_ps(v[i], signless));
      }
      float lanes[8];
      _mm256_storeu_ps(lanes, mx);
      float amax = 0.f;
      for (float l : lanes) amax = std::max(amax, l);
      const float db = amax / 127.f;
      const float id = db != 0.f ? 1.f / db : 0.f;
      int32_t out[32], sum = 0;
      for (int i = 0; i < 4; ++i)
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + 8 * i), _mm256_cvtps_epi32(_mm256_mul_ps(v[i], _mm256_set1_ps(id))));
      for (int k = 0; k < 32; ++k) {
        q[m * K + b * SB + k] = static_cast<int8_t>(out[k]);
        sum += out[k];
      }
      d[m * nsub + b] = db;
      isum[m * nsub + b] = sum;
      s[m * nsub + b] = db * static_cast<float>(sum);
    }
}
T_AVX2 void residual_rows_256(const float* x, int64_t x_stride, int64_t M, int64_t K, const int8_t* q, const float* d,
                              int8_t* q2, float* d2, int32_t* isum2, float* s) {
  const int64_t nsub = K / SB;
  for (int64_t m = 0; m < M; ++m)
    for (int64_t b = 0; b < nsub; ++b) {
      const float* xb = x + m * x_stride + b * SB;
      const int8_t* qb = q + m * K + b * SB;
      const __m256 db = _mm256_set1_ps(d[m * nsub + b]);
      __m256 sum = _mm256_setzero_ps();
      float r[32];
      for (int i = 0; i < 4; ++i) {
        const __m256 xv = _mm256_loadu_ps(xb + 8 * i);
        const __m256 qv = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(qb + 8 * i))));
        _mm256_storeu_ps(r + 8 * i, _mm256_fnmadd_ps(qv, db, xv));
        sum = _mm256_add_ps(sum, xv);
      }
      quantize_block(r, q2 + m * K + b * SB, d2 + m * nsub + b, isum2 + m * nsub + b);
      float lanes[8];
      _mm256_storeu_ps(lanes, sum);
      s[m * nsub + b] = ((lanes[0] + lanes[4]) + (lanes[1] + lanes[5])) + ((lanes[2] + lanes[6]) + (lanes[3] + lanes[7]));
    }
}
#endif  // NP_X86

#ifdef NP_ARM
// ---- Arm NEON with the dot-product extension (sdot: 4 int8 products per int32 lane) ----
// One 64-byte group of a panel is 4 registers of 4 rows x 4 weights; sdot against 4 activation bytes
// broadcast gives those 4 rows' partial dot products in its 4 lanes, as vpdpbusd does for 16 rows.
// Weights are signed here (Q8_0's stored w ^ 0x80 flipped back; 4-bit quants 0..15 fit an int8), so
// only Q4_0's offset of 8 is subtracted from the sums.
T_DOT inline int32x4_t bcast4_neon(const int8_t* p) { int32_t v; std::memcpy(&v, p, 4); return vdupq_n_s32(v); }

template <int F>
T_DOT void panel_q8_neon(const uint8_t* panel, const QAct& a, int64_t m0, int64_t rows, float* y, int64_t ldy,
                         int64_t valid, const float* bias) {
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t m = m0 + r;
    float32x4_t acc[4] = {vdupq_n_f32(0.f), vdupq_n_f32(0.f), vdupq_n_f32(0.f), vdupq_n_f32(0.f)};
    for (int64_t b = 0; b < a.nsub; ++b) {
      float fa[PR], fc[PR];
      for (int lane = 0; lane < PR; ++lane) lane_factors(F, panel, b, lane, &fa[lane], &fc[lane]);
      const uint8_t* qb = sub_qs(F, panel, b);
      const int64_t i = m * a.nsub + b;
      for (int pass = 0; pass < (a.q2 ? 2 : 1); ++pass) {
        const int8_t* xb = (pass ? a.q2 : a.q) + m * a.K + b * SB;
        int32x4_t s[4] = {vdupq_n_s32(0), vdupq_n_s32(0), vdupq_n_s32(0), vdupq_n_s32(0)};
        if (F == Q8_0) {
          for (int g = 0; g < 8; ++g) {
            const int8x16_t xv = vreinterpretq_s8_s32(bcast4_neon(xb + 4 * g));
            for (int q = 0; q < 4; ++q) {
              const int8x16_t w = vreinterpretq_s8_u8(veorq_u8(vld1q_u8(qb + g * 64 + q * 16), vdupq_n_u8(0x80)));
              s[q] = vdotq_s32(s[q], w, xv);
            }
          }
        } else {
          for (int g = 0; g < 4; ++g) {
            const int8x16_t xl = vreinterpretq_s8_s32(bcast4_neon(xb + 4 * g));
            const int8x16_t xh = vreinterpretq_s8_s32(bcast4_neon(xb + 16 + 4 * g));
            for (int q = 0; q < 4; ++q) {
              const uint8x16_t v = vld1q_u8(qb + g * 64 + q * 16);
              s[q] = vdotq_s32(s[q], vreinterpretq_s8_u8(vandq_u8(v, vdupq_n_u8(0x0F))), xl);
              s[q] = vdotq_s32(s[q], vreinterpretq_s8_u8(vshrq_n_u8(v, 4)), xh);
            }
          }
        }
        const int32_t isum = pass ? a.isum2[i] : a.isum[i];
        const float dx = pass ? a.d2[i] : a.d[i];
        for (int q = 0; q < 4; ++q) {
          if (F == Q4_0) s[q] = vsubq_s32(s[q], vdupq_n_s32(8 * isum));
          acc[q] = vfmaq_f32(acc[q], vcvtq_f32_s32(s[q]), vmulq_n_f32(vld1q_f32(fa + 4 * q), dx));
        }
      }
      if (F == Q4_1 || F == Q4_K)
        for (int q = 0; q < 4; ++q) acc[q] = vfmaq_n_f32(acc[q], vld1q_f32(fc + 4 * q), a.s[i]);
    }
    float out[PR];
    for (int q = 0; q < 4; ++q) vst1q_f32(out + 4 * q, acc[q]);
    for (int64_t lane = 0; lane < valid; ++lane) y[r * ldy + lane] = out[lane] + (bias ? bias[lane] : 0.f);
  }
}
#endif  // NP_ARM

// ---- drivers: rows tiled, panels split over threads ----

template <int F, bool X2>
void panel_q8(int isa, const uint8_t* panel, const QAct& a, int64_t m0, int64_t rows, float* y, int64_t ldy,
              int64_t valid, const float* bias, const uint8_t* next) {
#ifdef NP_X86
  if (isa == AVX512) {
    for (int64_t r = 0; r < rows;) {
      const int64_t n = std::min<int64_t>(8, rows - r);
      float* yr = y + r * ldy;
      const uint8_t* pf = r == 0 ? next : nullptr;  // the first row tile fetches the next panel
      switch (n) {
        case 8: tile_q8_512<F, 8, X2>(panel, a, m0 + r, yr, ldy, valid, bias, pf); break;
        case 7: tile_q8_512<F, 7, X2>(panel, a, m0 + r, yr, ldy, valid, bias, pf); break;
        case 6: tile_q8_512<F, 6, X2>(panel, a, m0 + r, yr, ldy, valid, bias, pf); break;
        case 5: tile_q8_512<F, 5, X2>(panel, a, m0 + r, yr, ldy, valid, bias, pf); break;
        case 4: tile_q8_512<F, 4, X2>(panel, a, m0 + r, yr, ldy, valid, bias, pf); break;
        case 3: tile_q8_512<F, 3, X2>(panel, a, m0 + r, yr, ldy, valid, bias, pf); break;
        case 2: tile_q8_512<F, 2, X2>(panel, a, m0 + r, yr, ldy, valid, bias, pf); break;
        default: tile_q8_512<F, 1, X2>(panel, a, m0 + r, yr, ldy, valid, bias, pf);
      }
      r += n;
    }
    return;
  }
  if (isa == AVX2) {
    for (int h = 0; h < 2 && h * 8 < valid; ++h)
      for (int64_t r = 0; r < rows;) {
        const int64_t n = std::min<int64_t>(4, rows - r);
        float* yr = y + r * ldy;
        switch (n) {
          case 4: half_q8_256<F, 4, X2>(panel, a, m0 + r, h, yr, ldy, valid, bias); break;
          case 3: half_q8_256<F, 3, X2>(panel, a, m0 + r, h, yr, ldy, valid, bias); break;
          case 2: half_q8_256<F, 2, X2>(panel, a, m0 + r, h, yr, ldy, valid, bias); break;
          default: half_q8_256<F, 1, X2>(panel, a, m0 + r, h, yr, ldy, valid, bias);
        }
        r += n;
      }
    return;
  }
#endif
#ifdef NP_ARM
  if (isa == NEON_DOT && F != Q5_0) return panel_q8_neon<F>(panel, a, m0, rows, y, ldy, valid, bias);
#endif
  for (int64_t r = 0; r < rows; r += 64)
    panel_q8_portable(F, panel, a, m0 + r, std::min<int64_t>(64, rows - r), y + r * ldy, ldy, valid, bias);
}

template <int F>
void panel_f32(int isa, const uint8_t* panel, int64_t K, const float* x, int64_t x_stride, int64_t rows, float* y,
               int64_t ldy, int64_t valid, const float* bias) {
#ifdef NP_X86
  if (isa == AVX512) {
    for (int64_t r = 0; r < rows;) {
      const int64_t n = std::min<int64_t>(4, rows - r);
      const float* xr = x + r * x_stride;
      float* yr = y + r * ldy;
      switch (n) {
        case 4: tile_f32_512<F, 4>(panel, K, xr, x_stride, yr, ldy, valid, bias); break;
        case 3: tile_f32_512<F, 3>(panel, K, xr, x_stride, yr, ldy, valid, bias); break;
        case 2: tile_f32_512<F, 2>(panel, K, xr, x_stride, yr, ldy, valid, bias); break;
        default: tile_f32_512<F, 1>(panel, K, xr, x_stride, yr, ldy, valid, bias);
      }
      r += n;
    }
    return;
  }
  if (isa == AVX2) {
    for (int h = 0; h < 2 && h * 8 < valid; ++h)
      for (int64_t r = 0; r < rows;) {
        const int64_t n = std::min<int64_t>(4, rows - r);
        const float* xr = x + r * x_stride;
        float* yr = y + r * ldy;
        switch (n) {
          case 4: half_f32_256<F, 4>(panel, K, xr, x_stride, h, yr, ldy, valid, bias); break;
          case 3: half_f32_256<F, 3>(panel, K, xr, x_stride, h, yr, ldy, valid, bias); break;
          case 2: half_f32_256<F, 2>(panel, K, xr, x_stride, h, yr, ldy, valid, bias); break;
          default: half_f32_256<F, 1>(panel, K, xr, x_stride, h, yr, ldy, valid, bias);
        }
        r += n;
      }
    return;
  }
#endif
  panel_f32_portable(F, panel, K, x, x_stride, rows, y, ldy, valid, bias);
}

void quantize_rows(int isa, const float* x, int64_t x_stride, int64_t M, int64_t K, int8_t* q, float* d, float* s,
                   int32_t* isum) {
#ifdef NP_X86
  if (isa == AVX512) return quantize_rows_512(x, x_stride, M, K, q, d, s, isum);
  if (isa == AVX2) return quantize_rows_256(x, x_stride, M, K, q, d, s, isum);
#endif
  quantize_rows_portable(x, x_stride, M, K, q, d, s, isum);
}

void residual_rows(int isa, const float* x, int64_t x_stride, int64_t M, int64_t K, const int8_t* q, const float* d,
                   int8_t* q2, float* d2, int32_t* isum2, float* s) {
#ifdef NP_X86
  if (isa == AVX512) return residual_rows_512(x, x_stride, M, K, q, d, q2, d2, isum2, s);
  if (isa == AVX2) return residual_rows_256(x, x_stride, M, K, q, d, q2, d2, isum2, s);
#endif
  residual_rows_portable(x, x_stride, M, K, q, d, q2, d2, isum2, s);
}

// Row tiles above this many rows per task: large inputs split over rows as well as panels.
constexpr int64_t ROW_CHUNK = 64;

enum Act : int { ACT_FLOAT = 0, ACT_INT8 = 1, ACT_INT8X2 = 2 };

template <int F>
void linear_fmt(int isa, int act, const float* x, int64_t x_stride, int64_t M, const uint8_t* packed, int64_t N,
                int64_t K, const float* bias, float* y) {
  const int64_t panels = (N + PR - 1) / PR, pb = panel_bytes(F, K), nsub = K / SB;
  const int64_t chunks = (M + ROW_CHUNK - 1) / ROW_CHUNK;
  // the calling thread's activation blocks, kept between calls (a decode step makes ~120 calls: no malloc
  // each). Thread-local, so the parallel regions below see them only through the pointers taken here.
  static thread_local std::vector<int8_t> q_buf;
  static thread_local std::vector<float> d_buf, s_buf;
  static thread_local std::vector<int32_t> isum_buf;
  const bool x2 = act == ACT_INT8X2;
  QAct a{nullptr, nullptr, nullptr, nullptr, K, nsub};
  if (act != ACT_FLOAT) {
    const int64_t copies = x2 ? 2 : 1;
    if (static_cast<int64_t>(q_buf.size()) < copies * M * K) q_buf.resize(copies * M * K);
    if (static_cast<int64_t>(d_buf.size()) < copies * M * nsub) d_buf.resize(copies * M * nsub);
    if (static_cast<int64_t>(isum_buf.size()) < copies * M * nsub) isum_buf.resize(copies * M * nsub);
    if (static_cast<int64_t>(s_buf.size()) < M * nsub) s_buf.resize(M * nsub);
    int8_t* q = q_buf.data();
    float *d = d_buf.data(), *s = s_buf.data();
    int32_t* isum = isum_buf.data();
    int8_t* q2 = x2 ? q + M * K : nullptr;
    float* d2 = x2 ? d + M * nsub : nullptr;
    int32_t* isum2 = x2 ? isum + M * nsub : nullptr;
#pragma omp parallel for schedule(static) if (M >= 16)
    for (int64_t c = 0; c < chunks; ++c) {
      const int64_t m0 = c * ROW_CHUNK, rows = std::min(ROW_CHUNK, M - m0);
      quantize_rows(isa, x + m0 * x_stride, x_stride, rows, K, q + m0 * K, d + m0 * nsub, s + m0 * nsub,
                    isum + m0 * nsub);
      if (x2)
        residual_rows(isa, x + m0 * x_stride, x_stride, rows, K, q + m0 * K, d + m0 * nsub, q2 + m0 * K,
                      d2 + m0 * nsub, isum2 + m0 * nsub, s + m0 * nsub);
    }
    a = QAct{q, d, s, isum, K, nsub, q2, d2, isum2};
  }
#pragma omp parallel for collapse(2) schedule(static)
  for (int64_t c = 0; c < chunks; ++c)
    for (int64_t p = 0; p < panels; ++p) {
      const int64_t m0 = c * ROW_CHUNK, rows = std::min(ROW_CHUNK, M - m0);
      const int64_t valid = std::min(PR, N - p * PR);
      const uint8_t* panel = packed + p * pb;
      const float* bp = bias ? bias + p * PR : nullptr;
      float* yp = y + m0 * N + p * PR;
      const uint8_t* next = p + 1 < panels ? panel + pb : nullptr;
      if (x2)
        panel_q8<F, true>(isa, panel, a, m0, rows, yp, N, valid, bp, next);
      else if (act == ACT_INT8)
        panel_q8<F, false>(isa, panel, a, m0, rows, yp, N, valid, bp, next);
      else
        panel_f32<F>(isa, panel, K, x + m0 * x_stride, x_stride, rows, yp, N, valid, bp);
    }
}

bool isa_supported(int isa) {
  if (isa == PORTABLE) return true;
#ifdef NP_X86
  __builtin_cpu_init();
  if (isa == AVX2)
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
  if (isa == AVX512)
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
           __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("f16c") && __builtin_cpu_supports("fma");
#endif
#ifdef NP_ARM
  if (isa == NEON_DOT) return (getauxval(AT_HWCAP) & HWCAP_ASIMDDP) != 0;
#endif
  return false;
}

}  // namespace

extern "C" {

int np_q_abi_version() { return 3; }

// 1 when this CPU can run path `isa` (0 portable, 1 AVX2, 2 AVX-512 VNNI)
int np_q_isa_supported(int isa) { return isa_supported(isa) ? 1 : 0; }

// Bytes of the packed form of a [N, K] weight of format `fmt` (a GGML type id), or -1 when the format
// is not served or K is not a whole number of its blocks.
int64_t np_q_packed_size(int fmt, int64_t N, int64_t K) {
  if (!known(fmt) || K <= 0 || N <= 0 || K % file_block(fmt)) return -1;
  return (N + PR - 1) / PR * panel_bytes(fmt, K);
}

// Repack the file's blocks raw [N][K / block * type_size] into `out` (np_q_packed_size bytes).
int np_q_pack(int fmt, const uint8_t* raw, int64_t N, int64_t K, uint8_t* out) {
  const int64_t size = np_q_packed_size(fmt, N, K);
  if (size < 0) return -1;
  const int64_t panels = (N + PR - 1) / PR, pb = panel_bytes(fmt, K), row = K / file_block(fmt) * file_type_size(fmt);
#pragma omp parallel for schedule(static)
  for (int64_t p = 0; p < panels; ++p) {
    std::memset(out + p * pb, 0, pb);
    for (int64_t lane = 0; lane < PR && p * PR + lane < N; ++lane)
      pack_row(fmt, raw + (p * PR + lane) * row, K, out + p * pb, static_cast<int>(lane));
  }
  return 0;
}

// out[i] = row rows[i] of the weight, dequantized exactly (rows == nullptr: all N rows in order).
// Returns 0, or -1 for an unknown format / a row out of range (nothing written past the check).
int np_q_dequant_rows(int fmt, const uint8_t* packed, int64_t N, int64_t K, const int64_t* rows, int64_t n, float* out) {
  if (np_q_packed_size(fmt, N, K) < 0) return -1;
  if (rows)
    for (int64_t i = 0; i < n; ++i)
      if (rows[i] < 0 || rows[i] >= N) return -1;
  const int64_t pb = panel_bytes(fmt, K);
#pragma omp parallel for schedule(static) if (n * K >= 65536)
  for (int64_t i = 0; i < n; ++i) {
    const int64_t r = rows ? rows[i] : i;
    dequant_row(fmt, packed + (r / PR) * pb, K, static_cast<int>(r % PR), out + i * K);
  }
  return 0;
}

// Quantize rows of x [M, K] to int8 blocks of 32 (as the int8 path does): q [M, K], d, s (= d * sum),
// isum [M, K / 32]. Returns 0, or -1 when K is not a multiple of 32 or the path is not supported.
int np_q_quantize_act(int isa, const float* x, int64_t x_stride, int64_t M, int64_t K, int8_t* q, float* d, float* s,
                      int32_t* isum) {
  if (K % SB || !isa_supported(isa)) return -1;
  quantize_rows(isa, x, x_stride, M, K, q, d, s, isum);
  return 0;
}

// y [M, N] (dense) = x [M, K] (rows at x_stride floats) @ W^T (+ bias), W packed by np_q_pack.
// act: 0 x in float32 (each weight sub-block dequantized in registers); 1 x quantized to int8 blocks first
// (as llama.cpp: VNNI or maddubs dot products); 2 int8x2, x and its residual quantized (float32's quality).
// Returns 0; -1 unknown format or shape; -2 path not supported by this CPU.
int np_q_linear(int isa, int act, int fmt, const float* x, int64_t x_stride, int64_t M, const uint8_t* packed,
                int64_t N, int64_t K, const float* bias, float* y) {
  if (np_q_packed_size(fmt, N, K) < 0 || M < 0 || act < ACT_FLOAT || act > ACT_INT8X2) return -1;
  if (!isa_supported(isa)) return -2;
  if (M == 0) return 0;
  switch (fmt) {
    case Q4_0: linear_fmt<Q4_0>(isa, act, x, x_stride, M, packed, N, K, bias, y); break;
    case Q4_1: linear_fmt<Q4_1>(isa, act, x, x_stride, M, packed, N, K, bias, y); break;
    case Q5_0: linear_fmt<Q5_0>(isa, act, x, x_stride, M, packed, N, K, bias, y); break;
    case Q8_0: linear_fmt<Q8_0>(isa, act, x, x_stride, M, packed, N, K, bias, y); break;
    default: linear_fmt<Q4_K>(isa, act, x, x_stride, M, packed, N, K, bias, y);
  }
  return 0;
}

}  // extern "C"
