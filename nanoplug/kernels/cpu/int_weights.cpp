// nanoplug's CPU kernels for pre-quantized checkpoints' integer weights, kept quantized in memory:
//
// - int4 W4A16 (compressed-tensors pack-quantized, GPTQ and AWQ repacked at load): qweight int32 [N, K/8]
//   (value k of a row at bits 4*(k % 8) of word k / 8), float32 scales [N, G] and uint8 zeros [N, G] (none:
//   8), w = (q - zero) * scale. Each row is dequantized into a buffer exactly as the torch reference does
//   (q - zero is exact, one float32 multiply), then multiplied with float32 activations (FMA, float32 sums).
// - int8 W8A8 (compressed-tensors int-quantized): int8 weights [N, K] and activations [M, K] (quantized per
//   token by the caller, with the checkpoint's formula), exact int32 dot products (int16 products summed in
//   pairs: no saturation), then float(acc) * x_scale[m] * w_scale[n].
//
// Dispatch as quant.cpp: built without -march flags, the AVX-512 and AVX2 paths compiled for their targets
// with function attributes and chosen at run time; the portable C++ path serves everywhere else. Every
// entry point takes the path to use, so the tests run each one this CPU has.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__x86_64__) || defined(_M_X64)
#define NP_X86 1
#include <immintrin.h>
#define T_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma")))
#define T_AVX2 __attribute__((target("avx2,fma")))
#endif

namespace {

enum Isa : int { PORTABLE = 0, AVX2 = 1, AVX512 = 2 };
constexpr int64_t MT = 4;  // activation rows per tile

bool isa_supported(int isa) {
  if (isa == PORTABLE) return true;
#ifdef NP_X86
  __builtin_cpu_init();
  if (isa == AVX2) return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  if (isa == AVX512)
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("fma");
#endif
  return false;
}

// ---- int4: one weight row dequantized, then dotted with a tile of activation rows ----

void dequant_row_portable(const int32_t* qw, const float* scales, const uint8_t* zeros, int64_t K, int64_t group,
                          float* w) {
  for (int64_t k = 0; k < K; ++k) {
    const int64_t g = k / group;
    const float q = static_cast<float>((static_cast<uint32_t>(qw[k / 8]) >> (4 * (k % 8))) & 0xF);
    const float z = zeros ? static_cast<float>(zeros[g]) : 8.f;
    w[k] = (q - z) * scales[g];
  }
}

void dot_tile_portable(const float* w, const float* x, int64_t x_stride, int64_t rows, int64_t K, float* out) {
  for (int64_t r = 0; r < rows; ++r) {
    float acc = 0.f;
    for (int64_t k = 0; k < K; ++k) acc += w[k] * x[r * x_stride + k];
    out[r] = acc;
  }
}

#ifdef NP_X86
// 16 weights of one row from two int32 words: bytes b0..b7 -> nibbles lo(b0), hi(b0), lo(b1), ... (k order)
T_AVX512 inline __m512 nibbles16_512(const int32_t* words) {
  const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(words));
  const __m128i lo = _mm_and_si128(b, _mm_set1_epi8(0x0F));
  const __m128i hi = _mm_and_si128(_mm_srli_epi16(b, 4), _mm_set1_epi8(0x0F));
  return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_unpacklo_epi8(lo, hi)));
}

T_AVX512 void dequant_row_512(const int32_t* qw, const float* scales, const uint8_t* zeros, int64_t K, int64_t group,
                              float* w) {
  for (int64_t g = 0; g < K / group; ++g) {
    const __m512 s = _mm512_set1_ps(scales[g]);
    const __m512 z = _mm512_set1_ps(zeros ? static_cast<float>(zeros[g]) : 8.f);
    for (int64_t k = g * group; k < (g + 1) * group; k += 16)
      _mm512_storeu_ps(w + k, _mm512_mul_ps(_mm512_sub_ps(nibbles16_512(qw + k / 8), z), s));
  }
}

T_AVX512 void dot_tile_512(const float* w, const float* x, int64_t x_stride, int64_t rows, int64_t K, float* out) {
  __m512 acc[MT];
  for (int64_t r = 0; r < MT; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; k += 16) {
    const __m512 wv = _mm512_loadu_ps(w + k);
    for (int64_t r = 0; r < rows; ++r) acc[r] = _mm512_fmadd_ps(wv, _mm512_loadu_ps(x + r * x_stride + k), acc[r]);
  }
  for (int64_t r = 0; r < rows; ++r) out[r] = _mm512_reduce_add_ps(acc[r]);
}

T_AVX2 inline __m256 nibbles8_256(const int32_t* word) {
  const __m128i b = _mm_cvtsi32_si128(*word);
  const __m128i lo = _mm_and_si128(b, _mm_set1_epi8(0x0F));
  const __m128i hi = _mm_and_si128(_mm_srli_epi16(b, 4), _mm_set1_epi8(0x0F));
  return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_unpacklo_epi8(lo, hi)));
}

T_AVX2 void dequant_row_256(const int32_t* qw, const float* scales, const uint8_t* zeros, int64_t K, int64_t group,
                            float* w) {
  for (int64_t g = 0; g < K / group; ++g) {
    const __m256 s = _mm256_set1_ps(scales[g]);
    const __m256 z = _mm256_set1_ps(zeros ? static_cast<float>(zeros[g]) : 8.f);
    for (int64_t k = g * group; k < (g + 1) * group; k += 8)
      _mm256_storeu_ps(w + k, _mm256_mul_ps(_mm256_sub_ps(nibbles8_256(qw + k / 8), z), s));
  }
}

T_AVX2 void dot_tile_256(const float* w, const float* x, int64_t x_stride, int64_t rows, int64_t K, float* out) {
  __m256 acc[MT];
  for (int64_t r = 0; r < MT; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; k += 8) {
    const __m256 wv = _mm256_loadu_ps(w + k);
    for (int64_t r = 0; r < rows; ++r) acc[r] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(x + r * x_stride + k), acc[r]);
  }
  for (int64_t r = 0; r < rows; ++r) {
    float lanes[8];
    _mm256_storeu_ps(lanes, acc[r]);
    float s = 0.f;
    for (float l : lanes) s += l;
    out[r] = s;
  }
}

// ---- int8: exact int32 dot products ----

T_AVX512 int32_t dot_i8_512(const int8_t* a, const int8_t* b, int64_t K) {
  __m512i acc = _mm512_setzero_si512();
  int64_t k = 0;
  for (; k + 32 <= K; k += 32) {
    const __m512i va = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(a + k)));
    const __m512i vb = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + k)));
    acc = _mm512_add_epi32(acc, _mm512_madd_epi16(va, vb));
  }
  int32_t s = _mm512_reduce_add_epi32(acc);
  for (; k < K; ++k) s += static_cast<int32_t>(a[k]) * b[k];
  return s;
}

T_AVX2 int32_t dot_i8_256(const int8_t* a, const int8_t* b, int64_t K) {
  __m256i acc = _mm256_setzero_si256();
  int64_t k = 0;
  for (; k + 16 <= K; k += 16) {
    const __m256i va = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(a + k)));
    const __m256i vb = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + k)));
    acc = _mm256_add_epi32(acc, _mm256_madd_epi16(va, vb));
  }
  int32_t lanes[8];
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(lanes), acc);
  int32_t s = 0;
  for (int32_t l : lanes) s += l;
  for (; k < K; ++k) s += static_cast<int32_t>(a[k]) * b[k];
  return s;
}
#endif  // NP_X86

int32_t dot_i8_portable(const int8_t* a, const int8_t* b, int64_t K) {
  int32_t s = 0;
  for (int64_t k = 0; k < K; ++k) s += static_cast<int32_t>(a[k]) * b[k];
  return s;
}

void dequant_row(int isa, const int32_t* qw, const float* scales, const uint8_t* zeros, int64_t K, int64_t group,
                 float* w) {
#ifdef NP_X86
  if (isa == AVX512) return dequant_row_512(qw, scales, zeros, K, group, w);
  if (isa == AVX2) return dequant_row_256(qw, scales, zeros, K, group, w);
#endif
  dequant_row_portable(qw, scales, zeros, K, group, w);
}

void dot_tile(int isa, const float* w, const float* x, int64_t x_stride, int64_t rows, int64_t K, float* out) {
#ifdef NP_X86
  if (isa == AVX512) return dot_tile_512(w, x, x_stride, rows, K, out);
  if (isa == AVX2) return dot_tile_256(w, x, x_stride, rows, K, out);
#endif
  dot_tile_portable(w, x, x_stride, rows, K, out);
}

int32_t dot_i8(int isa, const int8_t* a, const int8_t* b, int64_t K) {
#ifdef NP_X86
  if (isa == AVX512) return dot_i8_512(a, b, K);
  if (isa == AVX2) return dot_i8_256(a, b, K);
#endif
  return dot_i8_portable(a, b, K);
}

}  // namespace

extern "C" {

int np_iw_abi_version() { return 1; }

// Whether this CPU runs path `isa` (0 portable, 1 AVX2, 2 AVX-512).
int np_iw_isa_supported(int isa) { return isa_supported(isa) ? 1 : 0; }

// y [M, N] (row stride N) = x [M, K] (row stride x_stride) @ dequantized int4 weight [N, K].T with G groups
// of K / G columns (a multiple of 16). Returns 0, or -1 for a shape or path it does not take.
int np_iw_int4_linear(int isa, const float* x, int64_t x_stride, int64_t M, const int32_t* qweight, const float* scales,
                      const uint8_t* zeros, int64_t N, int64_t K, int64_t G, float* y) {
  if (!isa_supported(isa) || G <= 0 || K % G || (K / G) % 16) return -1;
  const int64_t group = K / G;
#pragma omp parallel
  {
    std::vector<float> w(K);
    float out[MT];
#pragma omp for schedule(static)
    for (int64_t n = 0; n < N; ++n) {
      dequant_row(isa, qweight + n * (K / 8), scales + n * G, zeros ? zeros + n * G : nullptr, K, group, w.data());
      for (int64_t m0 = 0; m0 < M; m0 += MT) {
        const int64_t rows = std::min(MT, M - m0);
        dot_tile(isa, w.data(), x + m0 * x_stride, x_stride, rows, K, out);
        for (int64_t r = 0; r < rows; ++r) y[(m0 + r) * N + n] = out[r];
      }
    }
  }
  return 0;
}

// y [M, N] = float(xq [M, K] . wq [N, K] in int32) * x_scale[m] * w_scale[n]. Returns 0, or -1 for a path
// this CPU does not run.
int np_iw_int8_linear(int isa, const int8_t* xq, const float* x_scale, int64_t M, const int8_t* wq,
                      const float* w_scale, int64_t N, int64_t K, float* y) {
  if (!isa_supported(isa)) return -1;
#pragma omp parallel for schedule(static) if (N * K >= 65536)
  for (int64_t n = 0; n < N; ++n)
    for (int64_t m = 0; m < M; ++m)
      y[m * N + n] = static_cast<float>(dot_i8(isa, xq + m * K, wq + n * K, K)) * x_scale[m] * w_scale[n];
  return 0;
}

}  // extern "C"
