// nanoplug's CPU kernels for the GGUF types quant.cpp does not serve: the K-quants Q2_K, Q3_K, Q5_K, Q6_K,
// IQ4_XS (super-blocks of 256) and Q5_0, Q5_1, IQ4_NL (blocks of 32), kept in the file's own blocks.
//
// Layout. A weight [N, K] is the file's rows of blocks, unchanged: memory is the file's bytes per weight
// (Q6_K 6.56 bits, Q5_0 5.5, ...). Each row is multiplied by dot products over its blocks, as llama.cpp's
// vec_dot does; rows are split over threads, and up to 4 activation rows share each weight block once it
// is unpacked.
//
// Activations are quantized to int8 on the fly, as llama.cpp does: for the K-quants and IQ4_XS into its
// Q8_K blocks (256 values, float scale 1/iscale with iscale = -127/x of largest |x|, the 16 sums of 16
// kept), for Q5_0/Q5_1/IQ4_NL into blocks of 32 like its Q8_0/Q8_1 (scale amax/127, kept in float32
// where llama.cpp rounds it to float16; the block sum kept). Every block is then integer dot products:
// each weight is read as an unsigned raw value (Q6_K's 6 bits, Q3_K's 3, ...) times the int8 activations,
// the type's offset (32, 4, 16) taken back with the activation sums, the sub-block scales applied in
// int32, the minimums (Q2_K, Q5_K, Q5_1) with the sums too; IQ4's non-linear values (a table of 16 int8)
// are multiplied with the sign moved onto the activations. So the result is exactly sum_k w_k * x'_k
// (x' the dequantized int8 activations), up to float32 rounding of the per-block sums.
//
// "int8x2" (the default, as quant.cpp's): x is quantized so, then its residual x - d * q is quantized again into
// a second set of the same blocks, and each block is two integer dot products against the weights unpacked
// once, added with each set's scale: d q + d2 q2 holds x to about 1/64,000 of its block's largest value,
// float32 compute's quality (llama.cpp's one int8 set is not: it is the int8 mode), for twice the integer
// dot products and no more weight bytes streamed.
//
// Dispatch. Built without -march flags (like quant.cpp): the AVX2 and AVX-512 VNNI paths (the same code on
// 256-bit vectors; a K-quant chunk's pair sums vpmaddubsw, then its sub-block scales by vpdpwssd on VNNI where
// AVX2 needs vpmaddwd + vpaddd; a block of 32 vpdpbusd against vpmaddubsw + vpmaddwd) are this file
// compiled again inside itself, each pass under its target attribute, chosen at run time; the portable
// C++ path serves everywhere (and in tests). Dequantization is exact: it equals gguf-py's, computed in
// float32 in gguf-py's order (-ffp-contract=off keeps it so).
#ifndef NP_KQ_SIMD_PASS
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__x86_64__) || defined(_M_X64)
#define NP_X86 1
#include <immintrin.h>
#endif

namespace {

enum Format : int { Q5_0 = 6, Q5_1 = 7, Q2_K = 10, Q3_K = 11, Q5_K = 13, Q6_K = 14, IQ4_NL = 20, IQ4_XS = 23 };
enum Isa : int { PORTABLE = 0, AVX2 = 1, AVX512 = 2 };
constexpr int64_t QK = 256;

bool known(int f) {
  return f == Q5_0 || f == Q5_1 || f == Q2_K || f == Q3_K || f == Q5_K || f == Q6_K || f == IQ4_NL || f == IQ4_XS;
}
bool is_k(int f) { return f == Q2_K || f == Q3_K || f == Q5_K || f == Q6_K || f == IQ4_XS; }
int64_t block_size(int f) { return is_k(f) ? QK : 32; }
int64_t type_size(int f) {
  switch (f) {
    case Q5_0: return 22;
    case Q5_1: return 24;
    case IQ4_NL: return 18;
    case Q2_K: return 84;
    case Q3_K: return 110;
    case Q5_K: return 176;
    case Q6_K: return 210;
    default: return 136;  // IQ4_XS
  }
}
// the offset taken from each raw (unsigned) value: w = scale * (raw - offset)
int offset_of(int f) { return f == Q6_K ? 32 : f == Q3_K ? 4 : f == Q5_0 ? 16 : 0; }
bool has_min(int f) { return f == Q2_K || f == Q5_K || f == Q5_1; }
bool is_iq4(int f) { return f == IQ4_NL || f == IQ4_XS; }

const int8_t KVALUES[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};

// inlined everywhere: the SIMD passes must not call non-VEX code with wide registers live (an SSE/AVX
// transition stall on each call: 5x the time of a Q5_K block)
#define NP_INLINE inline __attribute__((always_inline))

NP_INLINE float half_to_float(uint16_t h) {
  const uint32_t sign = (h & 0x8000u) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ffu;
  uint32_t bits;
  if (exp == 0) {
    if (man == 0) {
      bits = sign;
    } else {
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
NP_INLINE float f16(const uint8_t* p) { uint16_t v; std::memcpy(&v, p, 2); return half_to_float(v); }

// ---- a block's header: its float factors and per-16 integer scales and minimums ----

struct Header {
  float d, dmin;   // w = d * sc * (raw - offset) - dmin * mn   (32-weight blocks: sc = 1, dmin = -m)
  int32_t sc[16];  // per 16 weights (per-32 scales repeated)
  int32_t mn[16];
};

// Q4_K/Q5_K's 6-bit scale and minimum of sub-block j from the 12 packed bytes (gguf-py's get_scale_min)
NP_INLINE void k4_scale_min(int j, const uint8_t* q, int32_t* sc, int32_t* m) {
  if (j < 4) {
    *sc = q[j] & 63;
    *m = q[j + 4] & 63;
  } else {
    *sc = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
    *m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
  }
}

NP_INLINE void header(int f, const uint8_t* b, Header& h) {
  h.dmin = 0.f;
  for (int j = 0; j < 16; ++j) h.sc[j] = 1, h.mn[j] = 0;
  switch (f) {
    case Q6_K:
      h.d = f16(b + 208);
      for (int j = 0; j < 16; ++j) h.sc[j] = static_cast<int8_t>(b[192 + j]);
      return;
    case Q5_K:
      h.d = f16(b);
      h.dmin = f16(b + 2);
      for (int j = 0; j < 8; ++j) {
        int32_t s, m;
        k4_scale_min(j, b + 4, &s, &m);
        h.sc[2 * j] = h.sc[2 * j + 1] = s;
        h.mn[2 * j] = h.mn[2 * j + 1] = m;
      }
      return;
    case Q3_K: {
      h.d = f16(b + 108);
      const uint8_t* s = b + 96;
      for (int j = 0; j < 16; ++j) {
        const int lo = j < 8 ? s[j] & 0xF : s[j - 8] >> 4;
        const int hi = (s[8 + j % 4] >> (2 * (j / 4))) & 3;
        h.sc[j] = (lo | hi << 4) - 32;
      }
      return;
    }
    case Q2_K:
      h.d = f16(b + 80);
      h.dmin = f16(b + 82);
      for (int j = 0; j < 16; ++j) h.sc[j] = b[j] & 0xF, h.mn[j] = b[j] >> 4;
      return;
    case IQ4_XS: {
      h.d = f16(b);
      uint16_t sh;
      std::memcpy(&sh, b + 2, 2);
      for (int c = 0; c < 8; ++c) {
        const int ls = ((b[4 + c / 2] >> (4 * (c % 2))) & 0xF) | (((sh >> (2 * c)) & 3) << 4);
        h.sc[2 * c] = h.sc[2 * c + 1] = ls - 32;
      }
      return;
    }
    case Q5_1:
      h.d = f16(b);
      h.dmin = -f16(b + 2);  // w = d * raw + m
      return;
    default:  // Q5_0, IQ4_NL
      h.d = f16(b);
  }
}

// The raw value (unsigned; IQ4: the nibble) of weight k of a block, in gguf-py's order.
inline int raw_at(int f, const uint8_t* b, int k) {
  switch (f) {
    case Q6_K: {
      const int h = k / 128, c = (k % 128) / 32, l = k % 32;
      const int ql = (b[64 * h + 32 * (c & 1) + l] >> (4 * (c >> 1))) & 0xF;
      const int qh = (b[128 + 32 * h + l] >> (2 * c)) & 3;
      return ql | qh << 4;
    }
    case Q5_K: {
      const int c = k / 32, l = k % 32;
      const int ql = (b[48 + 32 * (c / 2) + l] >> (4 * (c % 2))) & 0xF;
      return ql | ((b[16 + l] >> c) & 1) << 4;
    }
    case Q3_K: {
      const int c = k / 32, l = k % 32;
      const int ql = (b[32 + 32 * (c / 4) + l] >> (2 * (c % 4))) & 3;
      return ql | ((b[l] >> c) & 1) << 2;
    }
    case Q2_K: {
      const int c = k / 32, l = k % 32;
      return (b[16 + 32 * (c / 4) + l] >> (2 * (c % 4))) & 3;
    }
    case IQ4_XS: {
      const int c = k / 32, l = k % 32;
      return (b[8 + 16 * c + l % 16] >> (4 * (l / 16))) & 0xF;
    }
    default: {  // the 32-weight blocks: nibbles (weights j and j + 16 share byte j), Q5's fifth bit in qh
      const int qs = f == IQ4_NL ? 2 : f == Q5_0 ? 6 : 8;
      const int nib = (b[qs + k % 16] >> (4 * (k / 16))) & 0xF;
      if (f == IQ4_NL) return nib;
      uint32_t qh;
      std::memcpy(&qh, b + qs - 4, 4);
      return nib | ((qh >> k) & 1) << 4;
    }
  }
}

// The integer value of a raw value: raw - offset, or IQ4's table entry.
inline int value_of(int f, int raw) { return is_iq4(f) ? KVALUES[raw] : raw - offset_of(f); }

// Row of K weights, exactly as gguf-py computes them (float32, its order of operations).
void dequant_row(int f, const uint8_t* row, int64_t K, float* out) {
  const int64_t bs = block_size(f), ts = type_size(f);
  Header h;
  for (int64_t i = 0; i < K / bs; ++i) {
    const uint8_t* b = row + i * ts;
    header(f, b, h);
    float* o = out + i * bs;
    for (int k = 0; k < bs; ++k) {
      const float q = static_cast<float>(value_of(f, raw_at(f, b, k)));
      if (!is_k(f)) {  // Q5_0, IQ4_NL: d * q; Q5_1: d * q + m
        o[k] = f == Q5_1 ? h.d * q + -h.dmin : h.d * q;
      } else {  // (d * sc) * q, minus (dmin * mn) where the type has minimums
        const float dl = h.d * static_cast<float>(h.sc[k / 16]);
        o[k] = has_min(f) ? dl * q - h.dmin * static_cast<float>(h.mn[k / 16]) : dl * q;
      }
    }
  }
}

// ---- activations quantized to int8 ----

struct Act {
  const int8_t* q;     // [M][K]
  const float* d;      // [M][K / block] scale
  const int32_t* sum;  // [M][K / 16] (K-quants: the Q8_K sums of 16) or [M][K / 32] (blocks of 32)
  int64_t K;
  // int8x2 only (else nullptr): the residual x - d * q quantized into the same blocks
  const int8_t* q2 = nullptr;
  const float* d2 = nullptr;
  const int32_t* sum2 = nullptr;
};

// llama.cpp's quantize_row_q8_K_ref: iscale = -127 / (the x of largest |x|), q = round(iscale x), d = 1/iscale
NP_INLINE void quantize_q8k(const float* x, int64_t K, int8_t* q, float* d, int32_t* sums) {
  for (int64_t i = 0; i < K / QK; ++i) {
    const float* xb = x + i * QK;
    float amax = 0.f, max = 0.f;
    for (int j = 0; j < QK; ++j) {
      const float ax = std::fabs(xb[j]);
      if (ax > amax) amax = ax, max = xb[j];
    }
    int8_t* qb = q + i * QK;
    if (amax == 0.f) {
      d[i] = 0.f;
      std::memset(qb, 0, QK);
      for (int j = 0; j < 16; ++j) sums[i * 16 + j] = 0;
      continue;
    }
    const float iscale = -127.f / max;
    for (int j = 0; j < QK; ++j) qb[j] = static_cast<int8_t>(std::min(127, static_cast<int>(std::nearbyint(iscale * xb[j]))));
    for (int j = 0; j < 16; ++j) {
      int32_t s = 0;
      for (int l = 0; l < 16; ++l) s += qb[16 * j + l];
      sums[i * 16 + j] = s;
    }
    d[i] = 1.f / iscale;
  }
}

// blocks of 32: d = amax / 127 (float32), q = round(x / d), the block's sum
NP_INLINE void quantize_q8_32(const float* x, int64_t K, int8_t* q, float* d, int32_t* sums) {
  for (int64_t i = 0; i < K / 32; ++i) {
    const float* xb = x + i * 32;
    float amax = 0.f;
    for (int j = 0; j < 32; ++j) amax = std::max(amax, std::fabs(xb[j]));
    const float db = amax / 127.f, id = db != 0.f ? 1.f / db : 0.f;
    int32_t s = 0;
    for (int j = 0; j < 32; ++j) {
      const int v = static_cast<int>(std::nearbyint(xb[j] * id));
      q[i * 32 + j] = static_cast<int8_t>(v);
      s += v;
    }
    d[i] = db;
    sums[i] = s;
  }
}

int64_t act_blocks(int f, int64_t K) { return K / block_size(f); }
int64_t act_sums(int f, int64_t K) { return is_k(f) ? K / 16 : K / 32; }

NP_INLINE void quantize_act(int f, const float* x, int64_t K, int8_t* q, float* d, int32_t* sums) {
  if (is_k(f))
    quantize_q8k(x, K, q, d, sums);
  else
    quantize_q8_32(x, K, q, d, sums);
}

// int8x2's second set: the residual x - d * q of each block (quantize_act's output) quantized the same way
NP_INLINE void quantize_residual(int f, const float* x, int64_t K, const int8_t* q, const float* d, int8_t* q2,
                                 float* d2, int32_t* sums2) {
  const int64_t bs = block_size(f), per = is_k(f) ? 16 : 1;  // sums a block
  float r[QK];
  for (int64_t i = 0; i < K / bs; ++i) {
    for (int64_t j = 0; j < bs; ++j) r[j] = x[i * bs + j] - d[i] * static_cast<float>(q[i * bs + j]);
    quantize_act(f, r, bs, q2 + i * bs, d2 + i, sums2 + i * per);
  }
}

// One activation row's blocks (q2 not nullptr: int8x2's residual set too). Inlined into each SIMD pass as well,
// where rounding is an instruction rather than a call to nearbyintf (the same values: rounding, the float
// steps and the integer sums are the same operations in any order).
NP_INLINE void quantize_row_inline(int f, const float* x, int64_t K, int8_t* q, float* d, int32_t* sums, int8_t* q2,
                                   float* d2, int32_t* sums2) {
  quantize_act(f, x, K, q, d, sums);
  if (q2) quantize_residual(f, x, K, q, d, q2, d2, sums2);
}

// ---- portable path ----

// block i of weight values v (header h) . block i of activation row m of one set (q, d, sum)
float block_dot_portable(int f, const Header& h, const int8_t* v, int64_t i, int64_t m, int64_t K, const int8_t* q,
                         const float* d, const int32_t* sum) {
  const int64_t bs = block_size(f), nb = K / bs;
  const int8_t* x = q + m * K + i * bs;
  const float dx = d[m * nb + i];
  if (is_k(f)) {
    int32_t isum = 0, msum = 0;
    for (int j = 0; j < 16; ++j) {
      int32_t s = 0;
      for (int l = 0; l < 16; ++l) s += v[16 * j + l] * x[16 * j + l];
      isum += h.sc[j] * s;
      msum += h.mn[j] * sum[m * (K / 16) + i * 16 + j];
    }
    return dx * (h.d * static_cast<float>(isum)) - dx * (h.dmin * static_cast<float>(msum));
  }
  int32_t s = 0;
  for (int l = 0; l < 32; ++l) s += v[l] * x[l];
  return (h.d * dx) * static_cast<float>(s) - h.dmin * (dx * static_cast<float>(sum[m * nb + i]));
}

// out[r] = row . activation row r (r < R), int8 activations (int8x2: both sets, each block unpacked once)
void dot_rows_portable(int f, const uint8_t* row, int64_t K, const Act* a, const int64_t* ms, int R, float* out) {
  const int64_t bs = block_size(f), ts = type_size(f), nb = K / bs;
  int8_t v[QK];
  Header h;
  for (int r = 0; r < R; ++r) out[r] = 0.f;
  for (int64_t i = 0; i < nb; ++i) {
    const uint8_t* b = row + i * ts;
    header(f, b, h);
    for (int k = 0; k < bs; ++k) v[k] = static_cast<int8_t>(value_of(f, raw_at(f, b, k)));
    for (int r = 0; r < R; ++r) {
      out[r] += block_dot_portable(f, h, v, i, ms[r], K, a->q, a->d, a->sum);
      if (a->q2) out[r] += block_dot_portable(f, h, v, i, ms[r], K, a->q2, a->d2, a->sum2);
    }
  }
}

}  // namespace

#ifdef NP_X86
#define NP_KQ_SIMD_PASS 1
#define KQ_T __attribute__((target("avx2,fma,f16c")))
#define KQ_VNNI 0
namespace kq_avx2 {
#include "kquants.cpp"  // this file again, as the SIMD pass
}
#undef KQ_T
#undef KQ_VNNI
#define KQ_T __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")))
#define KQ_VNNI 1
namespace kq_avx512 {
#include "kquants.cpp"  // this file again, as the SIMD pass
}
#undef KQ_T
#undef KQ_VNNI
#undef NP_KQ_SIMD_PASS
#endif

namespace {

bool isa_supported(int isa) {
  if (isa == PORTABLE) return true;
#ifdef NP_X86
  __builtin_cpu_init();
  const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
  if (isa == AVX2) return avx2;
  if (isa == AVX512)
    return avx2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
           __builtin_cpu_supports("avx512vnni");
#endif
  return false;
}

void quantize_row(int isa, int f, const float* x, int64_t K, int8_t* q, float* d, int32_t* sums, int8_t* q2,
                  float* d2, int32_t* sums2) {
#ifdef NP_X86
  if (isa == AVX512) return kq_avx512::quantize_row(f, x, K, q, d, sums, q2, d2, sums2);
  if (isa == AVX2) return kq_avx2::quantize_row(f, x, K, q, d, sums, q2, d2, sums2);
#endif
  quantize_row_inline(f, x, K, q, d, sums, q2, d2, sums2);
}

// up to 4 activation rows against one weight row
void dot_rows(int isa, int f, const uint8_t* row, int64_t K, const Act* a, const int64_t* ms, int R, float* out) {
#ifdef NP_X86
  if (isa == AVX512) return kq_avx512::dot_rows(f, row, K, a, ms, R, out);
  if (isa == AVX2) return kq_avx2::dot_rows(f, row, K, a, ms, R, out);
#endif
  dot_rows_portable(f, row, K, a, ms, R, out);
}

constexpr int64_t ROW_TILE = 4;

enum ActMode : int { ACT_FLOAT = 0, ACT_INT8 = 1, ACT_INT8X2 = 2 };  // quant.cpp's ids (quant_ops.ACTS)

void linear(int isa, int act, int f, const float* x, int64_t x_stride, int64_t M, const uint8_t* w, int64_t N,
            int64_t K, const float* bias, float* y) {
  const int64_t rb = K / block_size(f) * type_size(f);
  if (act == ACT_FLOAT) {  // float32 activations: each weight row dequantized, then float32 dot products
#pragma omp parallel
    {
      std::vector<float> wr(K);
#pragma omp for schedule(static)
      for (int64_t n = 0; n < N; ++n) {
        dequant_row(f, w + n * rb, K, wr.data());
        for (int64_t m = 0; m < M; ++m) {
          const float* xr = x + m * x_stride;
          float acc = 0.f;
          for (int64_t k = 0; k < K; ++k) acc += wr[k] * xr[k];
          y[m * N + n] = acc + (bias ? bias[n] : 0.f);
        }
      }
    }
    return;
  }
  // the calling thread's activation blocks, kept between calls (a decode step makes ~200 calls)
  static thread_local std::vector<int8_t> q_buf;
  static thread_local std::vector<float> d_buf;
  static thread_local std::vector<int32_t> s_buf;
  const int64_t nd = act_blocks(f, K), ns = act_sums(f, K);
  const bool x2 = act == ACT_INT8X2;
  const int64_t copies = x2 ? 2 : 1;  // int8x2: the residual's set after x's
  if (static_cast<int64_t>(q_buf.size()) < copies * M * K) q_buf.resize(copies * M * K);
  if (static_cast<int64_t>(d_buf.size()) < copies * M * nd) d_buf.resize(copies * M * nd);
  if (static_cast<int64_t>(s_buf.size()) < copies * M * ns) s_buf.resize(copies * M * ns);
  int8_t* q = q_buf.data();
  float* d = d_buf.data();
  int32_t* s = s_buf.data();
  int8_t* q2 = x2 ? q + M * K : nullptr;
  float* d2 = x2 ? d + M * nd : nullptr;
  int32_t* s2 = x2 ? s + M * ns : nullptr;
#pragma omp parallel for schedule(static) if (M >= 16)
  for (int64_t m = 0; m < M; ++m)
    quantize_row(isa, f, x + m * x_stride, K, q + m * K, d + m * nd, s + m * ns, x2 ? q2 + m * K : nullptr,
                 x2 ? d2 + m * nd : nullptr, x2 ? s2 + m * ns : nullptr);
  const Act a{q, d, s, K, q2, d2, s2};
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < N; ++n) {
    for (int64_t m0 = 0; m0 < M; m0 += ROW_TILE) {
      const int R = static_cast<int>(std::min(ROW_TILE, M - m0));
      int64_t ms[ROW_TILE];
      float out[ROW_TILE];
      for (int r = 0; r < R; ++r) ms[r] = m0 + r;
      dot_rows(isa, f, w + n * rb, K, &a, ms, R, out);
      for (int r = 0; r < R; ++r) y[(m0 + r) * N + n] = out[r] + (bias ? bias[n] : 0.f);
    }
  }
}

}  // namespace

extern "C" {

int np_kq_abi_version() { return 2; }

// 1 when this CPU can run path `isa` (0 portable, 1 AVX2, 2 AVX-512 VNNI)
int np_kq_isa_supported(int isa) { return isa_supported(isa) ? 1 : 0; }

// Bytes of one row of K weights of format `fmt` (a GGML type id), or -1 (not served, or K not whole blocks).
int64_t np_kq_row_bytes(int fmt, int64_t K) {
  if (!known(fmt) || K <= 0 || K % block_size(fmt)) return -1;
  return K / block_size(fmt) * type_size(fmt);
}

// out[i] = row rows[i] of the weight (the file's blocks, rows of np_kq_row_bytes), dequantized exactly
// (rows == nullptr: all N rows). Returns 0, or -1 for an unknown format / shape / a row out of range.
int np_kq_dequant_rows(int fmt, const uint8_t* w, int64_t N, int64_t K, const int64_t* rows, int64_t n, float* out) {
  const int64_t rb = np_kq_row_bytes(fmt, K);
  if (rb < 0 || N <= 0) return -1;
  if (rows)
    for (int64_t i = 0; i < n; ++i)
      if (rows[i] < 0 || rows[i] >= N) return -1;
#pragma omp parallel for schedule(static) if (n * K >= 65536)
  for (int64_t i = 0; i < n; ++i) dequant_row(fmt, w + (rows ? rows[i] : i) * rb, K, out + i * K);
  return 0;
}

// The int8 activation blocks the int8 path multiplies `fmt` with: q [M, K], d [M, K / block], sums
// [M, K / 16] (K-quants: Q8_K) or [M, K / 32]; q2, d2, sums2 (the same shapes, or all nullptr): int8x2's
// second set, the residual's; computed by path `isa`. Returns 0, -1 for an unknown format or shape, -2 for a
// path this CPU does not run.
int np_kq_quantize_act(int isa, int fmt, const float* x, int64_t x_stride, int64_t M, int64_t K, int8_t* q, float* d,
                       int32_t* sums, int8_t* q2, float* d2, int32_t* sums2) {
  if (np_kq_row_bytes(fmt, K) < 0) return -1;
  if (!isa_supported(isa)) return -2;
  const int64_t nd = act_blocks(fmt, K), ns = act_sums(fmt, K);
  for (int64_t m = 0; m < M; ++m)
    quantize_row(isa, fmt, x + m * x_stride, K, q + m * K, d + m * nd, sums + m * ns, q2 ? q2 + m * K : nullptr,
                 q2 ? d2 + m * nd : nullptr, q2 ? sums2 + m * ns : nullptr);
  return 0;
}

// y [M, N] = x [M, K] (rows at x_stride floats) @ W^T (+ bias), W the file's blocks [N, row bytes].
// act: 0 float32 activations; 1 int8 blocks (Q8_K / blocks of 32, as llama.cpp); 2 int8x2, x and its
// residual quantized (float32's quality). Returns 0; -1 unknown format, shape or act; -2 path not
// supported by this CPU.
int np_kq_linear(int isa, int act, int fmt, const float* x, int64_t x_stride, int64_t M, const uint8_t* w,
                 int64_t N, int64_t K, const float* bias, float* y) {
  if (np_kq_row_bytes(fmt, K) < 0 || M < 0 || N <= 0 || act < ACT_FLOAT || act > ACT_INT8X2) return -1;
  if (!isa_supported(isa)) return -2;
  if (M == 0) return 0;
  linear(isa, act, fmt, x, x_stride, M, w, N, K, bias, y);
  return 0;
}

}  // extern "C"

#else  // NP_KQ_SIMD_PASS: the SIMD dot products, compiled once per target (KQ_T, KQ_VNNI)

// sums of 4 u8 x s8 products per int32 lane
KQ_T static inline __m256i dot_us(__m256i u, __m256i s) {
#if KQ_VNNI
  return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s);
#else
  return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
#endif
}

KQ_T static inline __m256i srl16(__m256i v, int n) { return _mm256_srl_epi16(v, _mm_cvtsi32_si128(n)); }
KQ_T static inline __m256i ld(const uint8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }

// 16 bytes -> their low nibbles (lanes 0-15) and high nibbles (lanes 16-31): weights j and j + 16
KQ_T static inline __m256i nibbles16(const uint8_t* p) {
  const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  const __m128i m = _mm_set1_epi8(0x0F);
  return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(v, 4), m), _mm_and_si128(v, m));
}

// bit j of the 32-bit mask -> 0xFF in byte j (llama.cpp's bytes_from_bits_32)
KQ_T static inline __m256i bytes_from_bits(const uint8_t* p) {
  uint32_t x32;
  std::memcpy(&x32, p, 4);
  const __m256i shuf = _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202, 0x0101010101010101, 0);
  __m256i bytes = _mm256_shuffle_epi8(_mm256_set1_epi32(static_cast<int>(x32)), shuf);
  bytes = _mm256_or_si256(bytes, _mm256_set1_epi64x(0x7fbfdfeff7fbfdfe));
  return _mm256_cmpeq_epi8(bytes, _mm256_set1_epi64x(-1));
}

// The 32 raw values of chunk c (weights 32c..32c+31) of a block (IQ4: the int8 table values).
template <int F>
KQ_T static inline __m256i chunk(const uint8_t* b, int c) {
  const __m256i m3 = _mm256_set1_epi8(3), m1 = _mm256_set1_epi8(1), m15 = _mm256_set1_epi8(0x0F);
  if (F == Q6_K) {
    const int h = c / 4, t = c % 4;
    const __m256i ql = _mm256_and_si256(srl16(ld(b + 64 * h + 32 * (t & 1)), 4 * (t >> 1)), m15);
    const __m256i qh = _mm256_and_si256(srl16(ld(b + 128 + 32 * h), 2 * t), m3);
    return _mm256_or_si256(ql, _mm256_slli_epi16(qh, 4));
  } else if (F == Q5_K) {
    const __m256i ql = _mm256_and_si256(srl16(ld(b + 48 + 32 * (c / 2)), 4 * (c % 2)), m15);
    const __m256i qh = _mm256_and_si256(srl16(ld(b + 16), c), m1);
    return _mm256_or_si256(ql, _mm256_slli_epi16(qh, 4));
  } else if (F == Q3_K) {
    const __m256i ql = _mm256_and_si256(srl16(ld(b + 32 + 32 * (c / 4)), 2 * (c % 4)), m3);
    const __m256i qh = _mm256_and_si256(srl16(ld(b), c), m1);
    return _mm256_or_si256(ql, _mm256_slli_epi16(qh, 2));
  } else if (F == Q2_K) {
    return _mm256_and_si256(srl16(ld(b + 16 + 32 * (c / 4)), 2 * (c % 4)), m3);
  } else {
    const __m256i table = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(KVALUES)));
    if (F == IQ4_XS) return _mm256_shuffle_epi8(table, nibbles16(b + 8 + 16 * c));
    if (F == IQ4_NL) return _mm256_shuffle_epi8(table, nibbles16(b + 2));
    const int qs = F == Q5_0 ? 6 : 8;
    const __m256i hi = _mm256_and_si256(bytes_from_bits(b + qs - 4), _mm256_set1_epi8(0x10));
    return _mm256_or_si256(nibbles16(b + qs), hi);
  }
}

// chunk (raw u8, or IQ4's signed values) . 32 int8 activations, as 8 int32 sums of 4
template <int F>
KQ_T static inline __m256i chunk_dot(__m256i w, const int8_t* x) {
  const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x));
  if (F == IQ4_NL || F == IQ4_XS) return dot_us(_mm256_sign_epi8(w, w), _mm256_sign_epi8(xv, w));
  return dot_us(w, xv);
}

// acc + s16 * (the chunk's sums of 4 products): its u8 x s8 pairs (maddubs: pair sums stay inside int16 for
// every format's raw values, IQ4's signed ones included) times each lane's sub-block scale s16 (int16), summed
// into int32 lanes in one vpdpwssd (VNNI) or vpmaddwd + add, no 32-bit multiply
template <int F>
KQ_T static inline __m256i chunk_dot_scaled(__m256i acc, __m256i w, const int8_t* x, __m256i s16) {
  const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x));
  const __m256i pairs = F == IQ4_NL || F == IQ4_XS ? _mm256_maddubs_epi16(_mm256_sign_epi8(w, w), _mm256_sign_epi8(xv, w))
                                                   : _mm256_maddubs_epi16(w, xv);
#if KQ_VNNI
  return _mm256_dpwssd_epi32(acc, pairs, s16);
#else
  return _mm256_add_epi32(acc, _mm256_madd_epi16(pairs, s16));
#endif
}

KQ_T static inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// a super-block's float terms for one activation set into accf: the integer sums acc less the offset's
// (OFF times the sub-block scales . the set's sums of 16, in int32 lanes) scaled by d * dx, the minimums'
// (mn . sums) by -dmin * dx; sc and mn the header's 16 scales and minimums as two int32 vectors each
template <int F>
KQ_T static inline void finish_k(const Header& h, const __m256i* sc, const __m256i* mn, __m256i acc, float dx,
                                 const int32_t* bs, __m256& accf) {
  constexpr int OFF_SHIFT = F == Q6_K ? 5 : F == Q3_K ? 2 : -1;  // offset 32 or 4
  constexpr bool MIN = F == Q2_K || F == Q5_K;
  const __m256i b0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(bs));
  const __m256i b1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(bs + 8));
  if (OFF_SHIFT >= 0) {
    const __m256i off = _mm256_add_epi32(_mm256_mullo_epi32(sc[0], b0), _mm256_mullo_epi32(sc[1], b1));
    acc = _mm256_sub_epi32(acc, _mm256_slli_epi32(off, OFF_SHIFT < 0 ? 0 : OFF_SHIFT));
  }
  accf = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc), _mm256_set1_ps(h.d * dx), accf);
  if (MIN) {
    const __m256i m = _mm256_add_epi32(_mm256_mullo_epi32(mn[0], b0), _mm256_mullo_epi32(mn[1], b1));
    accf = _mm256_fmadd_ps(_mm256_cvtepi32_ps(m), _mm256_set1_ps(-(h.dmin * dx)), accf);
  }
}

// X2: the residual's set too, against each chunk unpacked once
template <int F, int R, bool X2>
KQ_T void dot_k(const uint8_t* row, int64_t K, const Act* a, const int64_t* ms, float* out) {
  const int64_t nb = K / QK, ts = type_size(F);
  __m256 accf[R];
  for (int r = 0; r < R; ++r) accf[r] = _mm256_setzero_ps();
  Header h;
  for (int64_t i = 0; i < nb; ++i) {
    const uint8_t* b = row + i * ts;
    header(F, b, h);
    const __m256i sc[2] = {_mm256_loadu_si256(reinterpret_cast<const __m256i*>(h.sc)),
                           _mm256_loadu_si256(reinterpret_cast<const __m256i*>(h.sc + 8))};
    __m256i mn[2];
    // Q5_K: built from its 8 minimums in registers; loaded back from h.mn just after header()'s scalar stores, they
    // made the AVX-512 pass's one-row GEMV slower than the scalar sums they replaced
    if (F == Q5_K) {
      int32_t m8[8];
      for (int j = 0; j < 8; ++j) m8[j] = h.mn[2 * j];
      const __m128i lo = _mm_setr_epi32(m8[0], m8[0], m8[1], m8[1]), lo2 = _mm_setr_epi32(m8[2], m8[2], m8[3], m8[3]);
      const __m128i hi = _mm_setr_epi32(m8[4], m8[4], m8[5], m8[5]), hi2 = _mm_setr_epi32(m8[6], m8[6], m8[7], m8[7]);
      mn[0] = _mm256_set_m128i(lo2, lo), mn[1] = _mm256_set_m128i(hi2, hi);
    } else {
      mn[0] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(h.mn));
      mn[1] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(h.mn + 8));
    }
    // chunk c's 16 int16 lanes: scale 2c in lanes 0-7, 2c + 1 in lanes 8-15 (a permute of the 8 scales of its
    // half, then each int32's low half doubled: every scale fits in int16)
    const __m256i dup = _mm256_setr_epi8(0, 1, 0, 1, 4, 5, 4, 5, 8, 9, 8, 9, 12, 13, 12, 13,
                                         0, 1, 0, 1, 4, 5, 4, 5, 8, 9, 8, 9, 12, 13, 12, 13);
    __m256i acc[R], acc2[R];
    for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_si256(), acc2[r] = _mm256_setzero_si256();
    for (int c = 0; c < 8; ++c) {
      const __m256i w = chunk<F>(b, c);
      const int e = 2 * (c % 4);
      const __m256i idx = _mm256_setr_epi32(e, e, e, e, e + 1, e + 1, e + 1, e + 1);
      const __m256i s = _mm256_shuffle_epi8(_mm256_permutevar8x32_epi32(sc[c / 4], idx), dup);
      for (int r = 0; r < R; ++r) {
        const int64_t at = ms[r] * K + i * QK + 32 * c;
        acc[r] = chunk_dot_scaled<F>(acc[r], w, a->q + at, s);
        if (X2) acc2[r] = chunk_dot_scaled<F>(acc2[r], w, a->q2 + at, s);
      }
    }
    for (int r = 0; r < R; ++r) {
      const int64_t at = ms[r] * (K / 16) + i * 16, id = ms[r] * nb + i;
      finish_k<F>(h, sc, mn, acc[r], a->d[id], a->sum + at, accf[r]);
      if (X2) finish_k<F>(h, sc, mn, acc2[r], a->d2[id], a->sum2 + at, accf[r]);
    }
  }
  for (int r = 0; r < R; ++r) out[r] = hsum(accf[r]);
}

// one block of 32 against one activation set (q, d, sum at block id): into accf, its offset or minimum into corr
template <int F>
KQ_T static inline void block_32(__m256i w, float d, const uint8_t* b, const int8_t* q, float dx, int32_t sum,
                                 __m256& accf, float& corr) {
  accf = _mm256_fmadd_ps(_mm256_cvtepi32_ps(chunk_dot<F>(w, q)), _mm256_set1_ps(d * dx), accf);
  const float xs = dx * static_cast<float>(sum);
  if (F == Q5_0) corr -= (16.f * d) * xs;
  if (F == Q5_1) {
    uint16_t mh;
    std::memcpy(&mh, b + 2, 2);
    corr += _cvtsh_ss(mh) * xs;
  }
}

template <int F, int R, bool X2>
KQ_T void dot_32(const uint8_t* row, int64_t K, const Act* a, const int64_t* ms, float* out) {
  const int64_t nb = K / 32, ts = type_size(F);
  __m256 accf[R];
  float corr[R];
  for (int r = 0; r < R; ++r) accf[r] = _mm256_setzero_ps(), corr[r] = 0.f;
  for (int64_t i = 0; i < nb; ++i) {
    const uint8_t* b = row + i * ts;
    const __m256i w = chunk<F>(b, 0);
    uint16_t dh;
    std::memcpy(&dh, b, 2);
    const float d = _cvtsh_ss(dh);
    for (int r = 0; r < R; ++r) {
      const int64_t at = ms[r] * K + i * 32, id = ms[r] * nb + i;
      block_32<F>(w, d, b, a->q + at, a->d[id], a->sum[id], accf[r], corr[r]);
      if (X2) block_32<F>(w, d, b, a->q2 + at, a->d2[id], a->sum2[id], accf[r], corr[r]);
    }
  }
  for (int r = 0; r < R; ++r) out[r] = hsum(accf[r]) + corr[r];
}

KQ_T void quantize_row(int f, const float* x, int64_t K, int8_t* q, float* d, int32_t* sums, int8_t* q2, float* d2,
                       int32_t* sums2) {
  quantize_row_inline(f, x, K, q, d, sums, q2, d2, sums2);
}

template <int F, bool X2>
KQ_T void dot_tile(const uint8_t* row, int64_t K, const Act* a, const int64_t* ms, int R, float* out) {
  constexpr bool KQ = F == Q2_K || F == Q3_K || F == Q5_K || F == Q6_K || F == IQ4_XS;
  switch (R) {
    case 4: return KQ ? dot_k<F, 4, X2>(row, K, a, ms, out) : dot_32<F, 4, X2>(row, K, a, ms, out);
    case 3: return KQ ? dot_k<F, 3, X2>(row, K, a, ms, out) : dot_32<F, 3, X2>(row, K, a, ms, out);
    case 2: return KQ ? dot_k<F, 2, X2>(row, K, a, ms, out) : dot_32<F, 2, X2>(row, K, a, ms, out);
    default: return KQ ? dot_k<F, 1, X2>(row, K, a, ms, out) : dot_32<F, 1, X2>(row, K, a, ms, out);
  }
}

template <int F>
KQ_T void dot_fmt(const uint8_t* row, int64_t K, const Act* a, const int64_t* ms, int R, float* out) {
  return a->q2 ? dot_tile<F, true>(row, K, a, ms, R, out) : dot_tile<F, false>(row, K, a, ms, R, out);
}

KQ_T void dot_rows(int f, const uint8_t* row, int64_t K, const Act* a, const int64_t* ms, int R, float* out) {
  switch (f) {
    case Q6_K: return dot_fmt<Q6_K>(row, K, a, ms, R, out);
    case Q5_K: return dot_fmt<Q5_K>(row, K, a, ms, R, out);
    case Q3_K: return dot_fmt<Q3_K>(row, K, a, ms, R, out);
    case Q2_K: return dot_fmt<Q2_K>(row, K, a, ms, R, out);
    case IQ4_XS: return dot_fmt<IQ4_XS>(row, K, a, ms, R, out);
    case Q5_0: return dot_fmt<Q5_0>(row, K, a, ms, R, out);
    case Q5_1: return dot_fmt<Q5_1>(row, K, a, ms, R, out);
    default: return dot_fmt<IQ4_NL>(row, K, a, ms, R, out);
  }
}

#endif  // NP_KQ_SIMD_PASS
