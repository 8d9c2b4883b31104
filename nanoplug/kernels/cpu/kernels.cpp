// nanoplug's CPU kernels for float32 steps: the small ops of a decoder layer fused into one pass each
// (RMSNorm with the residual add, SiLU-and-mul, RoPE) and decode attention that reads the paged KV
// cache in place. Plain C++ with GCC/Clang vector extensions as wide as the machine's registers (16
// floats with AVX-512, 8 with AVX2, 4 with NEON or SSE), so the compiler lowers it to the SIMD of the
// machine it is built on (a vector wider than the registers is lowered through memory: 64-byte vectors on
// an AVX2 build made its packed GEMM 4-30x slower than MKL's); OpenMP splits the rows over torch's own threads (the library
// links the libgomp that torch has already loaded). Built and loaded by build.py, called through ops.py.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>
#if defined(__F16C__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

// LANES(x) is a vector's initializer of W copies of x (a broadcast the compiler folds into its FMAs)
#if defined(__AVX512F__)
constexpr int W = 16;
#define LANES(x) x, x, x, x, x, x, x, x, x, x, x, x, x, x, x, x
#elif defined(__AVX__)
constexpr int W = 8;
#define LANES(x) x, x, x, x, x, x, x, x
#else
constexpr int W = 4;
#define LANES(x) x, x, x, x
#endif
typedef float vf __attribute__((vector_size(W * 4)));
typedef int32_t vi __attribute__((vector_size(W * 4)));
typedef float vf8 __attribute__((vector_size(32)));
typedef float vf4 __attribute__((vector_size(16)));
constexpr int64_t PARALLEL_MIN = 32768;  // fewer elements than this: one thread (a fork-join costs more)

inline vf load(const float* p) { vf v; std::memcpy(&v, p, sizeof(v)); return v; }
inline void store(float* p, vf v) { std::memcpy(p, &v, sizeof(v)); }
// float16 values (IEEE half, as torch.float16 stores them) widened to float32
inline float half_to_float(uint16_t h) {
  const uint32_t sign = (h & 0x8000u) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff;
  uint32_t bits;
  if (exp == 0x1f) bits = sign | 0x7f800000u | (man << 13);
  else if (exp != 0) bits = sign | ((exp + 112) << 23) | (man << 13);
  else if (man == 0) bits = sign;
  else {  // subnormal: normalise
    int e = -1;
    uint32_t m = man;
    do { m <<= 1; ++e; } while (!(m & 0x400));
    bits = sign | ((112 - e) << 23) | ((m & 0x3ff) << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}
inline vf load(const uint16_t* p) {
#if defined(__AVX512F__)
  return (vf)_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
#elif defined(__F16C__) && defined(__AVX__)
  return (vf)_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
#else
  vf v;
  for (int i = 0; i < W; ++i) v[i] = half_to_float(p[i]);
  return v;
#endif
}
// `vf{} + x` would cost an add per use: 0 + x is not x for x = -0, so it cannot be folded away (with it
// the AVX-512 decode step was 12% slower: the GEMM's broadcasts and the attention's dot products)
inline vf splat(float x) { return vf{LANES(x)}; }
// the sum of the lanes by vector halves (lane i + lane i + W/2, ...), down to 4 lanes added in pairs
inline float hsum(vf v) {
#if defined(__AVX512F__)
  vf8 a, b;
  std::memcpy(&a, &v, 32);
  std::memcpy(&b, reinterpret_cast<const char*>(&v) + 32, 32);
  a += b;
#elif defined(__AVX__)
  vf8 a = v;
#endif
#if defined(__AVX__)
  vf4 c, d;
  std::memcpy(&c, &a, 16);
  std::memcpy(&d, reinterpret_cast<const char*>(&a) + 16, 16);
  c += d;
#else
  vf4 c = v;
#endif
  return (c[0] + c[2]) + (c[1] + c[3]);
}
inline float hmax(vf v) {
  float m = v[0];
  for (int i = 1; i < W; ++i) m = std::max(m, v[i]);
  return m;
}

// e^x by the Cephes polynomial: within 2 ulp on [-87, 88], inputs clamped to it
inline vf vexp(vf x) {
  x = x < splat(-87.f) ? splat(-87.f) : x;
  x = x > splat(88.f) ? splat(88.f) : x;
  vf t = x * 1.44269504088896341f + 0.5f;
  vf fx = __builtin_convertvector(__builtin_convertvector(t, vi), vf);
  fx = fx > t ? fx - 1.f : fx;  // floor
  vf r = x - fx * 0.693359375f + fx * 2.12194440e-4f;
  vf p = splat(1.9875691500e-4f);
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  vf y = p * (r * r) + r + 1.0f;
  vi e = (__builtin_convertvector(fx, vi) + 127) << 23;
  vf scale;
  std::memcpy(&scale, &e, sizeof(scale));
  return y * scale;
}
inline float sexp(float x) { return vexp(splat(x))[0]; }

// out = x * rsqrt(mean(x^2) + eps) * w over one row of `dim` floats
inline void norm_row(const float* x, const float* w, float* out, int64_t dim, float eps) {
  vf acc = {};
  float tail = 0.f;
  int64_t j = 0;
  for (; j + W <= dim; j += W) { vf v = load(x + j); acc += v * v; }
  for (; j < dim; ++j) tail += x[j] * x[j];
  const float inv = 1.0f / std::sqrt((hsum(acc) + tail) / dim + eps);
  for (j = 0; j + W <= dim; j += W) store(out + j, load(w + j) * (load(x + j) * inv));
  for (; j < dim; ++j) out[j] = w[j] * (x[j] * inv);
}

// rotate-half RoPE of one head in place
inline void rope_head(float* x, const float* c, const float* s, int64_t half) {
  int64_t j = 0;
  for (; j + W <= half; j += W) {
    vf a = load(x + j), b = load(x + j + half);
    store(x + j, a * load(c + j) - b * load(s + j));
    store(x + j + half, b * load(c + j + half) + a * load(s + j + half));
  }
  for (; j < half; ++j) {
    float a = x[j], b = x[j + half];
    x[j] = a * c[j] - b * s[j];
    x[j + half] = b * c[j + half] + a * s[j + half];
  }
}

// fn(t, row) for each of a sequence's L cached tokens in order, row pointing at token t's vector for
// one KV head: the block table is walked block by block (no division per token)
template <class T, class Fn>
inline void for_each_token(const T* cache, const int32_t* table, int64_t L, int64_t block_size,
                           int64_t tok_stride, Fn fn) {
  for (int64_t t0 = 0, blk = 0; t0 < L; t0 += block_size, ++blk) {
    const T* base = cache + static_cast<int64_t>(table[blk]) * block_size * tok_stride;
    const int64_t n = std::min(block_size, L - t0);
    for (int64_t i = 0; i < n; ++i) fn(t0 + i, base + i * tok_stride);
  }
}

// One sequence's decode query heads that share KV head `kh` (G of them, head size NV * W) against its
// L cached tokens: scores, softmax, weighted sum of values. K and V rows are read where they lie.
template <int NV, int G, class T>
void decode_group(const float* qb, const T* k_cache, const T* v_cache, const int32_t* table, int64_t L,
                  int64_t block_size, int64_t tok_stride, int64_t group, float scale, float* scores, float* ob) {
  const int64_t gn = G ? G : group;
  vf qv[16][NV];
  for (int64_t g = 0; g < gn; ++g)
    for (int v = 0; v < NV; ++v) qv[g][v] = load(qb + (g * NV + v) * W) * scale;
  for_each_token(k_cache, table, L, block_size, tok_stride, [&](int64_t t, const T* row) {
    vf kv[NV];
    for (int v = 0; v < NV; ++v) kv[v] = load(row + v * W);
    for (int64_t g = 0; g < gn; ++g) {
      vf acc = qv[g][0] * kv[0];
      for (int v = 1; v < NV; ++v) acc += qv[g][v] * kv[v];
      scores[g * L + t] = hsum(acc);
    }
  });
  float inv_sum[16];
  for (int64_t g = 0; g < gn; ++g) {
    float* sg = scores + g * L;
    vf mv = splat(-INFINITY);
    float m = -INFINITY;
    int64_t t = 0;
    for (; t + W <= L; t += W) { vf x = load(sg + t); mv = x > mv ? x : mv; }
    for (; t < L; ++t) m = std::max(m, sg[t]);
    m = std::max(m, hmax(mv));
    vf sumv = {};
    float sum = 0.f;
    for (t = 0; t + W <= L; t += W) { vf e = vexp(load(sg + t) - m); store(sg + t, e); sumv += e; }
    for (; t < L; ++t) { float e = sexp(sg[t] - m); sg[t] = e; sum += e; }
    inv_sum[g] = 1.0f / (sum + hsum(sumv));
  }
  vf acc[16][NV];
  for (int64_t g = 0; g < gn; ++g)
    for (int v = 0; v < NV; ++v) acc[g][v] = vf{};
  for_each_token(v_cache, table, L, block_size, tok_stride, [&](int64_t t, const T* row) {
    vf vv[NV];
    for (int v = 0; v < NV; ++v) vv[v] = load(row + v * W);
    for (int64_t g = 0; g < gn; ++g) {
      vf p = splat(scores[g * L + t]);
      for (int v = 0; v < NV; ++v) acc[g][v] += p * vv[v];
    }
  });
  for (int64_t g = 0; g < gn; ++g)
    for (int v = 0; v < NV; ++v) store(ob + (g * NV + v) * W, acc[g][v] * inv_sum[g]);
}

template <int NV, class T>
void decode_all(const float* q, int64_t q_stride, const T* k_cache, const T* v_cache,
                const int32_t* block_tables, int64_t table_stride, const int32_t* seq_lens, float* out,
                int64_t B, int64_t H, int64_t Hkv, int64_t block_size, float scale) {
  const int64_t group = H / Hkv, D = NV * W, tok_stride = Hkv * D;
#pragma omp parallel
  {
    std::vector<float> scores;
#pragma omp for collapse(2) schedule(static)
    for (int64_t b = 0; b < B; ++b) {
      for (int64_t kh = 0; kh < Hkv; ++kh) {
        const int64_t L = seq_lens[b];
        float* ob = out + (b * H + kh * group) * D;
        if (L <= 0) {  // nothing to attend to: a zero output, not uninitialized memory
          std::fill(ob, ob + group * D, 0.f);
          continue;
        }
        if (static_cast<int64_t>(scores.size()) < group * L) scores.resize(group * L);
        const float* qb = q + b * q_stride + kh * group * D;
        const int32_t* table = block_tables + b * table_stride;
        const T* kc = k_cache + kh * D;
        const T* vc = v_cache + kh * D;
        float* s = scores.data();
        switch (group) {
          case 1: decode_group<NV, 1, T>(qb, kc, vc, table, L, block_size, tok_stride, group, scale, s, ob); break;
          case 2: decode_group<NV, 2, T>(qb, kc, vc, table, L, block_size, tok_stride, group, scale, s, ob); break;
          case 3: decode_group<NV, 3, T>(qb, kc, vc, table, L, block_size, tok_stride, group, scale, s, ob); break;
          case 4: decode_group<NV, 4, T>(qb, kc, vc, table, L, block_size, tok_stride, group, scale, s, ob); break;
          default: decode_group<NV, 0, T>(qb, kc, vc, table, L, block_size, tok_stride, group, scale, s, ob);
        }
      }
    }
  }
}


template <class T>
int paged_decode(const float* q, int64_t q_stride, const T* k_cache, const T* v_cache, const int32_t* block_tables,
                 int64_t table_stride, const int32_t* seq_lens, float* out, int64_t B, int64_t H, int64_t Hkv,
                 int64_t D, int64_t block_size, float scale) {
  if (Hkv <= 0 || H % Hkv || H / Hkv > 16) return -1;
  switch (D) {
    case 64: decode_all<64 / W>(q, q_stride, k_cache, v_cache, block_tables, table_stride, seq_lens, out, B, H, Hkv, block_size, scale); return 0;
    case 128: decode_all<128 / W>(q, q_stride, k_cache, v_cache, block_tables, table_stride, seq_lens, out, B, H, Hkv, block_size, scale); return 0;
    case 256: decode_all<256 / W>(q, q_stride, k_cache, v_cache, block_tables, table_stride, seq_lens, out, B, H, Hkv, block_size, scale); return 0;
    default: return -1;
  }
}

// ---- GEMM for decode-sized inputs: y [M, N] = x [M, K] @ W^T (+ bias), M <= 64 ----
// W is packed once into panels of NR columns, k-major inside ([N/NR][K][NR], zero-padded), so a panel
// streams from memory front to back. A decode step's GEMMs are as much memory as compute: while the
// rows of one k-block are multiplied, the next k-block is prefetched, so the two overlap (MKL's packed
// sgemm leaves them mostly in sequence here: 185 vs 225 GFLOPS on SmolLM2's 121 GEMMs at 32 rows).
// The tile is sized to the register file: MR rows x NR columns of accumulators, the NR weights of one k
// and a broadcast. AVX-512's 32 zmm hold 8 x 48 (24 + 3 + 1); AVX2's 16 ymm hold 6 x 16 (12 + 2 + 1: an
// 8 x 48 tile there spills most of its accumulators to the stack, and packing then halved batch-16 decode
// on an AVX2 EPYC); NEON's 32 q registers hold 6 x 16 too (24 + 4 + 1).
#if defined(__AVX512F__)
constexpr int64_t NR = 48, MR = 8;
#else
constexpr int64_t NR = 16, MR = 6;
#endif
static_assert(NR % W == 0, "a panel is whole vectors");
constexpr int64_t KB = 64, MAX_GEMM_ROWS = 64;
constexpr int NV = NR / W;  // vectors per row of a tile

template <int R>
void gemm_tile(const float* x, int64_t x_stride, const float* w, float* y, int64_t ldy, int64_t k0, int64_t k1,
               const float* bias, const float* prefetch, int64_t prefetch_first, int64_t prefetch_lines) {
  vf acc[R][NV];
  for (int i = 0; i < R; ++i)
    for (int j = 0; j < NV; ++j) acc[i][j] = k0 == 0 ? vf{} : load(y + i * ldy + j * W);
  for (int64_t k = k0; k < k1; ++k) {
    const int64_t line = prefetch_first + (k - k0);
    if (line < prefetch_lines) __builtin_prefetch(prefetch + line * W);
    const float* wk = w + k * NR;
    vf wv[NV];
    for (int j = 0; j < NV; ++j) wv[j] = load(wk + j * W);
    for (int i = 0; i < R; ++i) {
      vf b = splat(x[i * x_stride + k]);
      for (int j = 0; j < NV; ++j) acc[i][j] += b * wv[j];
    }
  }
  if (bias)
    for (int i = 0; i < R; ++i)
      for (int j = 0; j < NV; ++j) acc[i][j] += load(bias + j * W);
  for (int i = 0; i < R; ++i)
    for (int j = 0; j < NV; ++j) store(y + i * ldy + j * W, acc[i][j]);
}

void gemm_rows(int64_t rows, const float* x, int64_t x_stride, const float* w, float* y, int64_t ldy, int64_t k0,
               int64_t k1, const float* bias, const float* pf, int64_t pf_first, int64_t pf_lines) {
  switch (rows) {
    case 8: gemm_tile<8>(x, x_stride, w, y, ldy, k0, k1, bias, pf, pf_first, pf_lines); break;
    case 7: gemm_tile<7>(x, x_stride, w, y, ldy, k0, k1, bias, pf, pf_first, pf_lines); break;
    case 6: gemm_tile<6>(x, x_stride, w, y, ldy, k0, k1, bias, pf, pf_first, pf_lines); break;
    case 5: gemm_tile<5>(x, x_stride, w, y, ldy, k0, k1, bias, pf, pf_first, pf_lines); break;
    case 4: gemm_tile<4>(x, x_stride, w, y, ldy, k0, k1, bias, pf, pf_first, pf_lines); break;
    case 3: gemm_tile<3>(x, x_stride, w, y, ldy, k0, k1, bias, pf, pf_first, pf_lines); break;
    case 2: gemm_tile<2>(x, x_stride, w, y, ldy, k0, k1, bias, pf, pf_first, pf_lines); break;
    default: gemm_tile<1>(x, x_stride, w, y, ldy, k0, k1, bias, pf, pf_first, pf_lines);
  }
}

}  // namespace

extern "C" {

// The ABI version ops.py checks, so a stale cached build is never called with new arguments.
int np_abi_version() { return 4; }

// rows of `dim` floats; row r starts at x + (r / heads) * outer_stride + (r % heads) * dim; out is dense
void np_rms_norm(const float* x, int64_t heads, int64_t outer_stride, const float* w, float* out,
                 int64_t rows, int64_t dim, float eps) {
#pragma omp parallel for if (rows * dim >= PARALLEL_MIN)
  for (int64_t r = 0; r < rows; ++r)
    norm_row(x + (r / heads) * outer_stride + (r % heads) * dim, w, out + r * dim, dim, eps);
}

// residual_out = x + residual; out = rms_norm(residual_out) * w (all dense [rows, dim])
void np_add_rms_norm(const float* x, const float* residual, const float* w, float* out, float* residual_out,
                     int64_t rows, int64_t dim, float eps) {
#pragma omp parallel for if (rows * dim >= PARALLEL_MIN)
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * dim;
    const float* rr = residual + r * dim;
    float* ro = residual_out + r * dim;
    int64_t j = 0;
    for (; j + W <= dim; j += W) store(ro + j, load(xr + j) + load(rr + j));
    for (; j < dim; ++j) ro[j] = xr[j] + rr[j];
    norm_row(ro, w, out + r * dim, dim, eps);
  }
}

// out[r] = silu(x[r, :d]) * x[r, d:] for dense x [rows, 2d]
void np_silu_and_mul(const float* x, float* out, int64_t rows, int64_t d) {
#pragma omp parallel for if (rows * d >= PARALLEL_MIN)
  for (int64_t r = 0; r < rows; ++r) {
    const float* g = x + r * 2 * d;
    const float* u = g + d;
    float* o = out + r * d;
    int64_t j = 0;
    for (; j + W <= d; j += W) { vf gv = load(g + j); store(o + j, gv / (1.0f + vexp(-gv)) * load(u + j)); }
    for (; j < d; ++j) o[j] = g[j] / (1.0f + sexp(-g[j])) * u[j];
  }
}

// In place rotate-half RoPE of q [n, hq, dim] and k [n, hk, dim] (heads dense, rows at q_stride and
// k_stride floats), with cos/sin tables [positions, dim]
void np_rope(const int64_t* positions, float* q, int64_t q_stride, float* k, int64_t k_stride,
             const float* cos, const float* sin, int64_t n, int64_t hq, int64_t hk, int64_t dim) {
  const int64_t half = dim / 2;
#pragma omp parallel for if (n * (hq + hk) * dim >= PARALLEL_MIN)
  for (int64_t i = 0; i < n; ++i) {
    const float* c = cos + positions[i] * dim;
    const float* s = sin + positions[i] * dim;
    for (int64_t h = 0; h < hq; ++h) rope_head(q + i * q_stride + h * dim, c, s, half);
    for (int64_t h = 0; h < hk; ++h) rope_head(k + i * k_stride + h * dim, c, s, half);
  }
}

// out[r] = the index of the first largest value of row r of x [rows, n] (rows at `stride` floats)
void np_argmax_rows(const float* x, int64_t stride, int64_t rows, int64_t n, int64_t* out) {
#pragma omp parallel for if (rows * n >= 16 * PARALLEL_MIN)
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * stride;
    vi lane;
    for (int i = 0; i < W; ++i) lane[i] = i;
    vf best = splat(-INFINITY);
    vi at = lane;
    int64_t j = 0;
    for (; j + W <= n && j + W <= INT32_MAX; j += W) {
      vf v = load(xr + j);
      vi better = v > best;  // strict: a lane keeps its first maximum
      best = better ? v : best;
      at = better ? lane + static_cast<int32_t>(j) : at;
    }
    float m = -INFINITY;
    int64_t idx = 0;
    for (int i = 0; i < W; ++i)
      if (best[i] > m || (best[i] == m && at[i] < idx)) { m = best[i]; idx = at[i]; }
    for (; j < n; ++j)
      if (xr[j] > m) { m = xr[j]; idx = j; }
    out[r] = idx;
  }
}

// The packed size, in floats, of a weight [N, K] (np_pack_weight's output)
int64_t np_packed_size(int64_t N, int64_t K) { return (N + NR - 1) / NR * NR * K; }

// Pack a row-major weight [N, K] into panels (see the GEMM above)
void np_pack_weight(const float* w, int64_t N, int64_t K, float* out) {
  const int64_t panels = (N + NR - 1) / NR;
#pragma omp parallel for
  for (int64_t p = 0; p < panels; ++p)
    for (int64_t k = 0; k < K; ++k)
      for (int64_t j = 0; j < NR; ++j) {
        const int64_t n = p * NR + j;
        out[(p * K + k) * NR + j] = n < N ? w[n * K + k] : 0.f;
      }
}

// y [M, N] (dense) = x [M, K] (rows at x_stride floats) @ W^T + bias (nullable); W packed by
// np_pack_weight. Returns 0, or -1 when M is above 64 (use an ordinary GEMM).
int np_linear(const float* x, int64_t x_stride, const float* packed, const float* bias, float* y, int64_t M,
              int64_t N, int64_t K) {
  if (M > MAX_GEMM_ROWS) return -1;
  const int64_t panels = (N + NR - 1) / NR;
#pragma omp parallel for schedule(static)
  for (int64_t p = 0; p < panels; ++p) {
    const float* w = packed + p * K * NR;
    const bool full = (p + 1) * NR <= N;
    float scratch[MAX_GEMM_ROWS * NR];  // the last, partial panel is computed here, then copied out
    float* yp = full ? y + p * NR : scratch;
    const int64_t ldy = full ? N : NR;
    for (int64_t k0 = 0; k0 < K; k0 += KB) {
      const int64_t k1 = std::min(k0 + KB, K);
      // prefetch the next k-block of this panel, or the first of the next panel (contiguous), spread
      // over the row tiles of this block
      const float* next = w + k1 * NR;
      const int64_t next_k = k1 < K ? std::min(KB, K - k1) : (p + 1 < panels ? std::min(KB, K) : 0);
      const int64_t lines = next_k * NR / W;
      const float* b = full && k1 == K ? bias : nullptr;
      for (int64_t m = 0, t = 0; m < M; m += MR, ++t)
        gemm_rows(std::min(MR, M - m), x + m * x_stride, x_stride, w, yp + m * ldy, ldy, k0, k1, b ? b + p * NR : nullptr,
                  next, t * (k1 - k0), lines);
    }
    if (!full)
      for (int64_t i = 0; i < M; ++i)
        for (int64_t n = p * NR; n < N; ++n) y[i * N + n] = scratch[i * NR + n - p * NR] + (bias ? bias[n] : 0.f);
  }
  return 0;
}

// Decode attention, one query token per sequence: q [B, H, D] (rows at q_stride floats, heads dense);
// caches [blocks, block_size, Hkv, D]; block_tables [B, table_stride] int32; seq_lens [B] int32 (the
// context including the new token, already stored); out [B, H, D] dense.
// Returns 0, or -1 for a shape it does not serve (D not 64/128/256, or more than 16 heads per KV head).
int np_paged_decode(const float* q, int64_t q_stride, const float* k_cache, const float* v_cache,
                    const int32_t* block_tables, int64_t table_stride, const int32_t* seq_lens, float* out,
                    int64_t B, int64_t H, int64_t Hkv, int64_t D, int64_t block_size, float scale) {
  return paged_decode(q, q_stride, k_cache, v_cache, block_tables, table_stride, seq_lens, out, B, H, Hkv, D,
                      block_size, scale);
}

// The same over a float16 cache (torch.float16 bits), each K/V row widened to float32 as it is read.
int np_paged_decode_f16(const float* q, int64_t q_stride, const uint16_t* k_cache, const uint16_t* v_cache,
                        const int32_t* block_tables, int64_t table_stride, const int32_t* seq_lens, float* out,
                        int64_t B, int64_t H, int64_t Hkv, int64_t D, int64_t block_size, float scale) {
  return paged_decode(q, q_stride, k_cache, v_cache, block_tables, table_stride, seq_lens, out, B, H, Hkv, D,
                      block_size, scale);
}

// The KV store of n new tokens: row i of k and v (row_bytes each, rows at k_stride / v_stride bytes) copied to
// row slots[i] of the dense caches (rows of row_bytes); a negative slot is skipped. One call for K and V.
void np_kv_store(const uint8_t* k, int64_t k_stride, const uint8_t* v, int64_t v_stride, uint8_t* k_cache,
                 uint8_t* v_cache, const int64_t* slots, int64_t n, int64_t row_bytes) {
  for (int64_t i = 0; i < n; ++i) {
    const int64_t slot = slots[i];
    if (slot < 0) continue;
    std::memcpy(k_cache + slot * row_bytes, k + i * k_stride, row_bytes);
    std::memcpy(v_cache + slot * row_bytes, v + i * v_stride, row_bytes);
  }
}

}  // extern "C"
