// Products of float activations with weights held in blocks of 32 integers, one scale and
// one offset per block (W[n, k] = scale[n, b] * q[n, k] + offset[n, b], b = k / 32): the
// layout of GGUF's Q4_0/Q4_1/Q5_x/Q8_0 and of 4-bit GPTQ/AWQ groups cut into 32s.
//
// Each activation row is quantized to int8 in blocks of 32 (d = max|x| / 127, q = round(x /
// d)), and each block's integer dot product runs on u8 x s8 instructions (AVX-512 VNNI
// vpdpbusd where the CPU has it, AVX2 vpmaddubsw + vpmaddwd otherwise), as llama.cpp's
// Q4_1 x Q8_1 product does (ggml-quants.c). The offset term uses the exact float sum of the
// block's activations: y = sum_b scale * d * <q_w, q_x> + offset * sum(x_b).
//
// A row's result depends only on that row: blocks add up in a fixed order and threads split
// the output columns, so the output of one request does not change with the batch.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

namespace {

constexpr int64_t kBlock = 32;

// x [K] -> q [K] int8, d [K / 32] block scales, s [K / 32] float sums of the blocks.
void quantize_row(const float* x, int64_t k, int8_t* q, float* d, float* s) {
  for (int64_t b = 0; b < k / kBlock; ++b) {
    const float* xb = x + b * kBlock;
    float amax = 0.f, sum = 0.f;
    for (int64_t j = 0; j < kBlock; ++j) {
      amax = std::max(amax, std::fabs(xb[j]));
      sum += xb[j];
    }
    const float db = amax / 127.f;
    const float inv = db > 0.f ? 1.f / db : 0.f;
    for (int64_t j = 0; j < kBlock; ++j) {
      q[b * kBlock + j] = static_cast<int8_t>(std::nearbyint(xb[j] * inv));
    }
    d[b] = db;
    s[b] = sum;
  }
}

#if defined(__AVX2__)
// 16 bytes of nibbles -> 32 u8: low nibbles are elements 0..15, high nibbles 16..31 (GGUF's
// order within a block).
inline __m256i unpack_nibbles(const uint8_t* p) {
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  const __m128i mask = _mm_set1_epi8(0x0F);
  const __m128i lo = _mm_and_si128(bytes, mask);
  const __m128i hi = _mm_and_si128(_mm_srli_epi16(bytes, 4), mask);
  return _mm256_set_m128i(hi, lo);
}

// Eight int32 partial sums of a (u8) x b (s8) over 32 lanes.
inline __m256i dot_u8s8(__m256i a, __m256i b) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpbusd_epi32(_mm256_setzero_si256(), a, b);
#else
  return _mm256_madd_epi16(_mm256_maddubs_epi16(a, b), _mm256_set1_epi16(1));
#endif
}

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// Rows m0..m0+MT of y[:, n] for one weight row. kNibble: w holds 16 bytes of nibbles per
// block (values 0..15); else 32 int8 per block.
template <bool kNibble, int MT>
inline void block_dot(const uint8_t* wn, const float* sn, const float* on, int64_t nb,
                      const int8_t* xq, const float* xd, const float* xs, int64_t k,
                      float* y, int64_t ldy) {
  __m256 acc[MT];
  for (int r = 0; r < MT; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    __m256i wa, wsign;
    if constexpr (kNibble) {
      wa = unpack_nibbles(wn + b * (kBlock / 2));
    } else {
      wsign = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wn + b * kBlock));
      wa = _mm256_sign_epi8(wsign, wsign);  // |w| as u8 (-128 -> 128)
    }
    for (int r = 0; r < MT; ++r) {
      __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + r * k + b * kBlock));
      if constexpr (!kNibble) xv = _mm256_sign_epi8(xv, wsign);
      const __m256i p = dot_u8s8(wa, xv);
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_set1_ps(sn[b] * xd[r * nb + b]),
                               acc[r]);
    }
  }
  for (int r = 0; r < MT; ++r) {
    float off = 0.f;
    for (int64_t b = 0; b < nb; ++b) off += on[b] * xs[r * nb + b];
    y[r * ldy] = hsum(acc[r]) + off;
  }
}
#else
template <bool kNibble, int MT>
inline void block_dot(const uint8_t* wn, const float* sn, const float* on, int64_t nb,
                      const int8_t* xq, const float* xd, const float* xs, int64_t k,
                      float* y, int64_t ldy) {
  for (int r = 0; r < MT; ++r) {
    float acc = 0.f, off = 0.f;
    for (int64_t b = 0; b < nb; ++b) {
      int32_t dot = 0;
      for (int64_t j = 0; j < kBlock; ++j) {
        int32_t w;
        if constexpr (kNibble) {
          const uint8_t byte = wn[b * (kBlock / 2) + (j & 15)];
          w = j < 16 ? (byte & 15) : (byte >> 4);
        } else {
          w = static_cast<int8_t>(wn[b * kBlock + j]);
        }
        dot += w * xq[r * k + b * kBlock + j];
      }
      acc += static_cast<float>(dot) * (sn[b] * xd[r * nb + b]);
      off += on[b] * xs[r * nb + b];
    }
    y[r * ldy] = acc + off;
  }
}
#endif

template <bool kNibble>
void gemm(const int8_t* xq, const float* xd, const float* xs, int64_t m, int64_t k,
          const uint8_t* w, const float* scales, const float* offsets, int64_t n, float* y) {
  const int64_t nb = k / kBlock;
  const int64_t row_bytes = kNibble ? k / 2 : k;
  // Columns per task: enough work to amortize a task, and every thread busy on wide outputs.
  const int64_t grain = std::max<int64_t>(8, 4096 / std::max<int64_t>(1, m * nb));
  at::parallel_for(0, n, grain, [&](int64_t n0, int64_t n1) {
    for (int64_t j = n0; j < n1; ++j) {
      const uint8_t* wn = w + j * row_bytes;
      const float* sn = scales + j * nb;
      const float* on = offsets + j * nb;
      int64_t r = 0;
      for (; r + 4 <= m; r += 4) {
        block_dot<kNibble, 4>(wn, sn, on, nb, xq + r * k, xd + r * nb, xs + r * nb, k,
                              y + r * n + j, n);
      }
      const int64_t left = m - r;
      const int8_t* q = xq + r * k;
      const float* d = xd + r * nb;
      const float* s = xs + r * nb;
      if (left == 3) block_dot<kNibble, 3>(wn, sn, on, nb, q, d, s, k, y + r * n + j, n);
      if (left == 2) block_dot<kNibble, 2>(wn, sn, on, nb, q, d, s, k, y + r * n + j, n);
      if (left == 1) block_dot<kNibble, 1>(wn, sn, on, nb, q, d, s, k, y + r * n + j, n);
    }
  });
}

// x [M, K] float32, w [N, K / 2] (nibbles) or [N, K] (int8, as uint8) -> [M, N] float32.
at::Tensor block_gemm(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scales,
                      const at::Tensor& offsets, bool nibbles) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(),
              "block_gemm: x must be a contiguous float32 [M, K]");
  TORCH_CHECK(w.scalar_type() == at::kByte && w.is_contiguous(), "block_gemm: w must be uint8");
  const int64_t m = x.size(0), k = x.size(1), n = w.size(0);
  TORCH_CHECK(k % kBlock == 0, "block_gemm: K must be a multiple of 32");
  TORCH_CHECK(w.size(1) == (nibbles ? k / 2 : k), "block_gemm: w does not match K");
  TORCH_CHECK(scales.scalar_type() == at::kFloat && offsets.scalar_type() == at::kFloat &&
                  scales.is_contiguous() && offsets.is_contiguous() &&
                  scales.numel() == n * (k / kBlock) && offsets.numel() == n * (k / kBlock),
              "block_gemm: scales and offsets must be contiguous float32 [N, K / 32]");
  at::Tensor y = at::empty({m, n}, x.options());
  if (m == 0 || n == 0) return y;
  const int64_t nb = k / kBlock;
  std::vector<int8_t> xq(m * k);
  std::vector<float> xd(m * nb), xs(m * nb);
  const float* xp = x.data_ptr<float>();
  for (int64_t r = 0; r < m; ++r) {
    quantize_row(xp + r * k, k, xq.data() + r * k, xd.data() + r * nb, xs.data() + r * nb);
  }
  const uint8_t* wp = w.data_ptr<uint8_t>();
  if (nibbles) {
    gemm<true>(xq.data(), xd.data(), xs.data(), m, k, wp, scales.data_ptr<float>(),
               offsets.data_ptr<float>(), n, y.data_ptr<float>());
  } else {
    gemm<false>(xq.data(), xd.data(), xs.data(), m, k, wp, scales.data_ptr<float>(),
                offsets.data_ptr<float>(), n, y.data_ptr<float>());
  }
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tokenmill_cpu, m) {
  m.def("block_gemm(Tensor x, Tensor w, Tensor scales, Tensor offsets, bool nibbles) -> Tensor");
  m.impl("block_gemm", c10::DispatchKey::CPU, TORCH_FN(block_gemm));
}
