// A Python-free test of the C++ kernels (kernels.cpp and quant.cpp, linked with this file into one binary),
// against plain loops here: so a machine without torch, or another architecture under emulation (an aarch64
// build run by qemu-user in CI, tests/test_cpu_selftest.py), checks the same code paths the engine calls.
// Prints one line per check and exits 0 when every one passes.
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <vector>

extern "C" {
int np_abi_version();
void np_rms_norm(const float*, int64_t, int64_t, const float*, float*, int64_t, int64_t, float);
void np_silu_and_mul(const float*, float*, int64_t, int64_t);
int64_t np_packed_size(int64_t, int64_t);
void np_pack_weight(const float*, int64_t, int64_t, float*);
int np_linear(const float*, int64_t, const float*, const float*, float*, int64_t, int64_t, int64_t);
int np_paged_decode(const float*, int64_t, const float*, const float*, const int32_t*, int64_t, const int32_t*,
                    float*, int64_t, int64_t, int64_t, int64_t, int64_t, float);
int np_q_isa_supported(int);
int64_t np_q_packed_size(int, int64_t, int64_t);
int np_q_pack(int, const uint8_t*, int64_t, int64_t, uint8_t*);
int np_q_dequant_rows(int, const uint8_t*, int64_t, int64_t, const int64_t*, int64_t, float*);
int np_q_linear(int, int, int, const float*, int64_t, int64_t, const uint8_t*, int64_t, int64_t, const float*, float*);
}

namespace {

int failures = 0;
std::mt19937 rng(0);

std::vector<float> randn(size_t n) {
  std::normal_distribution<float> dist;
  std::vector<float> v(n);
  for (auto& x : v) x = dist(rng);
  return v;
}

// |got - want| <= tol * (1 + |want|) everywhere
void check(const char* what, const std::vector<float>& got, const std::vector<double>& want, double tol) {
  double worst = 0;
  for (size_t i = 0; i < want.size(); ++i) {
    const double err = std::fabs(got[i] - want[i]) / (1 + std::fabs(want[i]));
    if (!(err <= worst)) worst = err;  // NaN is worst
  }
  const bool ok = worst <= tol;
  failures += !ok;
  std::printf("%s %s (worst relative error %.3g, tolerance %.3g)\n", ok ? "ok  " : "FAIL", what, worst, tol);
}

void test_linear(int64_t M, int64_t N, int64_t K) {
  auto w = randn(N * K), x = randn(M * K), bias = randn(N);
  std::vector<float> packed(np_packed_size(N, K)), y(M * N);
  np_pack_weight(w.data(), N, K, packed.data());
  if (np_linear(x.data(), K, packed.data(), bias.data(), y.data(), M, N, K) != 0) {
    std::printf("FAIL np_linear refused %lld rows\n", static_cast<long long>(M));
    ++failures;
    return;
  }
  std::vector<double> want(M * N);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t n = 0; n < N; ++n) {
      double acc = bias[n];
      for (int64_t k = 0; k < K; ++k) acc += static_cast<double>(x[m * K + k]) * w[n * K + k];
      want[m * N + n] = acc;
    }
  char what[96];
  std::snprintf(what, sizeof(what), "linear %lldx%lldx%lld", static_cast<long long>(M), static_cast<long long>(N),
                static_cast<long long>(K));
  check(what, y, want, 1e-4);
}

void test_norm_and_silu() {
  const int64_t rows = 5, dim = 100;
  auto x = randn(rows * 2 * dim), w = randn(dim);
  std::vector<float> out(rows * dim);
  np_rms_norm(x.data(), 1, dim, w.data(), out.data(), rows, dim, 1e-6f);
  std::vector<double> want(rows * dim);
  for (int64_t r = 0; r < rows; ++r) {
    double ss = 0;
    for (int64_t j = 0; j < dim; ++j) ss += static_cast<double>(x[r * dim + j]) * x[r * dim + j];
    const double inv = 1 / std::sqrt(ss / dim + 1e-6);
    for (int64_t j = 0; j < dim; ++j) want[r * dim + j] = w[j] * x[r * dim + j] * inv;
  }
  check("rms_norm 5x100", out, want, 1e-5);
  np_silu_and_mul(x.data(), out.data(), rows, dim);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t j = 0; j < dim; ++j) {
      const double g = x[r * 2 * dim + j], u = x[r * 2 * dim + dim + j];
      want[r * dim + j] = g / (1 + std::exp(-g)) * u;
    }
  check("silu_and_mul 5x100", out, want, 1e-5);
}

void test_paged_decode() {
  const int64_t B = 3, H = 9, Hkv = 3, D = 64, bs = 16, blocks = 8, max_blocks = 2;
  auto q = randn(B * H * D), kc = randn(blocks * bs * Hkv * D), vc = randn(blocks * bs * Hkv * D);
  const int32_t tables[B * max_blocks] = {3, 5, 0, 7, 6, 1};
  const int32_t lens[B] = {1, 20, 32};
  std::vector<float> out(B * H * D);
  const float scale = 0.125f;
  np_paged_decode(q.data(), H * D, kc.data(), vc.data(), tables, max_blocks, lens, out.data(), B, H, Hkv, D, bs, scale);
  std::vector<double> want(B * H * D);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < H; ++h) {
      const int64_t kh = h / (H / Hkv);
      std::vector<double> s(lens[b]);
      double mx = -1e300, sum = 0;
      auto row = [&](const std::vector<float>& c, int64_t t) {
        return &c[((tables[b * max_blocks + t / bs] * bs + t % bs) * Hkv + kh) * D];
      };
      for (int64_t t = 0; t < lens[b]; ++t) {
        double dot = 0;
        for (int64_t d = 0; d < D; ++d) dot += static_cast<double>(q[(b * H + h) * D + d]) * row(kc, t)[d];
        s[t] = dot * scale;
        mx = std::max(mx, s[t]);
      }
      for (auto& v : s) sum += (v = std::exp(v - mx));
      for (int64_t d = 0; d < D; ++d) {
        double acc = 0;
        for (int64_t t = 0; t < lens[b]; ++t) acc += s[t] * row(vc, t)[d];
        want[(b * H + h) * D + d] = acc / sum;
      }
    }
  check("paged_decode 3 seqs, 9/3 heads of 64", out, want, 1e-5);
}

// Q8_0 blocks of a random weight: the kernels' GEMM (each path, each activation mode) against the exact
// dequantized weight (the kernels' own dequantization, exact by construction) times x in double.
void test_q8_0(int64_t M, int64_t N, int64_t K) {
  std::vector<uint8_t> raw(N * K / 32 * 34);
  std::uniform_int_distribution<int> byte(-127, 127);
  for (int64_t b = 0; b < N * K / 32; ++b) {
    const uint16_t d = 0x1c00 + static_cast<uint16_t>(b % 64);  // about 0.004: a float16 scale
    std::memcpy(&raw[b * 34], &d, 2);
    for (int i = 0; i < 32; ++i) raw[b * 34 + 2 + i] = static_cast<uint8_t>(static_cast<int8_t>(byte(rng)));
  }
  std::vector<uint8_t> packed(np_q_packed_size(8, N, K));
  np_q_pack(8, raw.data(), N, K, packed.data());
  std::vector<float> w(N * K), y(M * N);
  np_q_dequant_rows(8, packed.data(), N, K, nullptr, N, w.data());
  auto x = randn(M * K);
  std::vector<double> want(M * N);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t n = 0; n < N; ++n) {
      double acc = 0;
      for (int64_t k = 0; k < K; ++k) acc += static_cast<double>(x[m * K + k]) * w[n * K + k];
      want[m * N + n] = acc;
    }
  const char* isas[] = {"portable", "avx2", "avx512", "neon_dot"};
  const char* acts[] = {"float", "int8", "int8x2"};
  const double tols[] = {1e-4, 1e-1, 1e-3};  // int8: half a step of 1/127 of a block's largest x per weight; int8x2: 1/254 of that
  for (int isa = 0; isa < 4; ++isa) {
    if (!np_q_isa_supported(isa)) continue;
    for (int act = 0; act < 3; ++act) {
      np_q_linear(isa, act, 8, x.data(), K, M, packed.data(), N, K, nullptr, y.data());
      char what[96];
      std::snprintf(what, sizeof(what), "Q8_0 linear %lldx%lldx%lld, %s path, %s activations",
                    static_cast<long long>(M), static_cast<long long>(N), static_cast<long long>(K), isas[isa], acts[act]);
      check(what, y, want, tols[act]);
    }
  }
}

}  // namespace

int main() {
  std::printf("kernels ABI %d\n", np_abi_version());
  for (int64_t m : {1, 3, 8, 17, 64}) test_linear(m, 100, 70);
  test_norm_and_silu();
  test_paged_decode();
  for (int64_t m : {1, 5, 70}) test_q8_0(m, 40, 96);
  std::printf("%s: %d failed\n", failures ? "FAILED" : "passed", failures);
  return failures ? 1 : 0;
}
