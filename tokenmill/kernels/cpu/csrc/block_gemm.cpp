// Products of float activations with weights held in blocks of 32 integers, one scale and
// one offset per block (W[n, k] = scale[n, b] * q[n, k] + offset[n, b], b = k / 32): the
// layout of GGUF's Q4_0/Q4_1/Q5_x/Q8_0 and of 4-bit GPTQ/AWQ groups cut into 32s.
//
// Each activation row is quantized in blocks of 32 to two int8 digits (quantize_row: the
// int8 of llama.cpp's Q8 activations, ggml-quants.c, plus a second digit for its rounding
// error), and each block's integer dot products run on AVX-512 VNNI (vpdpbusd: u8 x s8,
// four products per 32-bit lane). The weights are packed for it (pack_blocks): a 64-byte
// vector holds four consecutive K of sixteen output columns, so one vpdpbusd with four
// broadcast activation bytes advances sixteen dot products, and a block of 32 K takes
// eight. Nibbles are the unsigned operand; against int8 weights the digits enter as u8
// (digit + 128) and the 128 * sum(q_w) this adds is the accumulator's starting value, a
// per-block constant of the weights. The two digits' dot
// products join exactly in int32 (256 * hi + lo) before one float multiply by scale * d /
// 256. The offset term uses the exact float sum of the block's activations:
// y = sum_b scale * d * <q_w, hi + lo / 256> + offset * sum(x_b).
//
// Scales and offsets are float16 where each value is one exactly (GGUF stores its block
// scales in float16), float32 otherwise; a weight without offsets (symmetric blocks) has
// none stored, and the offset term is skipped.
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
#include <cstring>
#include <type_traits>
#include <vector>

namespace {

constexpr int64_t kBlock = 32;

// x [K] -> two int8 digits per value, x ~ d * (hi + lo / 256), block by block of 32: d =
// max|x| / 127, hi = round(x / d), lo = round(256 * (x - d * hi) / d) (|lo| <= 128, held
// to 127); d [K / 32] the block scales and s [K / 32] the float sums of the blocks. The
// second digit makes the activations exact to about 2^-16 of the block's largest, finer than
// bfloat16, so the products match float32 ones closely.
void quantize_row(const float* x, int64_t k, int bias, uint8_t* hi, uint8_t* lo, float* d,
                  float* s) {
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
      const float h = std::nearbyint(xb[j] * inv);
      const float l = std::nearbyint((xb[j] * inv - h) * 256.f);
      // bias 128: held as u8 for vpdpbusd's unsigned operand; 0: the int8 bits
      hi[b * kBlock + j] = static_cast<uint8_t>(static_cast<int>(h) + bias);
      lo[b * kBlock + j] = static_cast<uint8_t>(static_cast<int>(std::min(l, 127.f)) + bias);
    }
    d[b] = db;
    s[b] = sum;
  }
}

constexpr int64_t kTile = 16;  // output columns per vector

bool vnni_built() {
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
  return true;
#else
  return false;
#endif
}

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
// Sixteen scales (or offsets) of a tile's block as floats.
template <typename S>
inline __m512 load16(const S* p) {
  if constexpr (std::is_same_v<S, float>) {
    return _mm512_loadu_ps(p);
  } else {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
}

// Rows r0..r0+MT of y[:, 16 t .. 16 t + 16]. Packed weights of the tile: per block, 4 x 64
// bytes of nibbles (low nibbles K 0..3 of a group of 8, high nibbles K 4..7) or 8 x 64
// bytes of int8, lane-major (16 columns x 4 K).
template <bool kNibble, int MT, typename S>
inline void tile_rows(const uint8_t* wt, const int32_t* corr, const S* sc, const S* of,
                      int64_t nb, const uint8_t* xh, const uint8_t* xl, const float* xd,
                      const float* xs, int64_t k, float* y, int64_t ldy) {
  __m512 acc[MT];
  for (int r = 0; r < MT; ++r) acc[r] = _mm512_setzero_ps();
  const __m512i mask = _mm512_set1_epi8(0x0F);
  for (int64_t b = 0; b < nb; ++b) {
    __m512i w[8];
    if constexpr (kNibble) {
      const uint8_t* p = wt + b * 256;
      for (int j = 0; j < 4; ++j) {
        const __m512i v = _mm512_loadu_si512(p + j * 64);
        w[2 * j] = _mm512_and_si512(v, mask);
        w[2 * j + 1] = _mm512_and_si512(_mm512_srli_epi16(v, 4), mask);
      }
    } else {
      const uint8_t* p = wt + b * 512;
      for (int j = 0; j < 8; ++j) w[j] = _mm512_loadu_si512(p + j * 64);
    }
    // int8 weights are the signed operand and the digits enter as u8 (+ 128): the sums start
    // at -128 * sum(q_w); nibbles are the unsigned operand and the digits the signed one.
    const __m512i init = kNibble ? _mm512_setzero_si512() : _mm512_loadu_si512(corr + b * kTile);
    const __m512 svec = load16(sc + b * kTile);
    const __m512 ovec = of != nullptr ? load16(of + b * kTile) : _mm512_setzero_ps();
    for (int r = 0; r < MT; ++r) {
      const uint8_t* hb = xh + r * k + b * kBlock;
      const uint8_t* lb = xl + r * k + b * kBlock;
      __m512i ph = init, pl = init;
      for (int j = 0; j < 8; ++j) {
        int32_t four;
        std::memcpy(&four, hb + 4 * j, 4);
        const __m512i xh4 = _mm512_set1_epi32(four);
        std::memcpy(&four, lb + 4 * j, 4);
        const __m512i xl4 = _mm512_set1_epi32(four);
        if constexpr (kNibble) {
          ph = _mm512_dpbusd_epi32(ph, w[j], xh4);
          pl = _mm512_dpbusd_epi32(pl, w[j], xl4);
        } else {
          ph = _mm512_dpbusd_epi32(ph, xh4, w[j]);
          pl = _mm512_dpbusd_epi32(pl, xl4, w[j]);
        }
      }
      // exact in int32: |<q_w, hi>| <= 32 * 127 * 128 < 2^23
      const __m512i p = _mm512_add_epi32(_mm512_slli_epi32(ph, 8), pl);
      const __m512 scale = _mm512_mul_ps(svec, _mm512_set1_ps(xd[r * nb + b] * (1.f / 256.f)));
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p), scale, acc[r]);
      if (of != nullptr) acc[r] = _mm512_fmadd_ps(ovec, _mm512_set1_ps(xs[r * nb + b]), acc[r]);
    }
  }
  for (int r = 0; r < MT; ++r) _mm512_storeu_ps(y + r * ldy, acc[r]);
}

template <bool kNibble, typename S>
void gemm(const uint8_t* xh, const uint8_t* xl, const float* xd, const float* xs, int64_t m, int64_t k,
          const uint8_t* w, const int32_t* corr, const S* scales, const S* offsets,
          int64_t n, float* y) {
  const int64_t nb = k / kBlock;
  const int64_t tile_bytes = kTile * (kNibble ? k / 2 : k);
  const int64_t tiles = n / kTile;
  // Chunks of at least ~256 row-blocks: a one-row product of a few hundred columns still
  // splits over the threads, which stream its weights from memory faster together.
  const int64_t grain = std::max<int64_t>(1, 256 / std::max<int64_t>(1, m * nb));
  at::parallel_for(0, tiles, grain, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const uint8_t* wt = w + t * tile_bytes;
      const int32_t* ct = corr + t * nb * kTile;
      const S* st = scales + t * nb * kTile;
      const S* ot = offsets != nullptr ? offsets + t * nb * kTile : nullptr;
      float* yt = y + t * kTile;
      int64_t r = 0;
      for (; r + 4 <= m; r += 4) {
        tile_rows<kNibble, 4, S>(wt, ct, st, ot, nb, xh + r * k, xl + r * k, xd + r * nb,
                              xs + r * nb, k, yt + r * n, n);
      }
      const int64_t left = m - r;
      const uint8_t* h = xh + r * k;
      const uint8_t* l = xl + r * k;
      const float* d = xd + r * nb;
      const float* s = xs + r * nb;
      float* yr = yt + r * n;
      if (left == 3) tile_rows<kNibble, 3, S>(wt, ct, st, ot, nb, h, l, d, s, k, yr, n);
      if (left == 2) tile_rows<kNibble, 2, S>(wt, ct, st, ot, nb, h, l, d, s, k, yr, n);
      if (left == 1) tile_rows<kNibble, 1, S>(wt, ct, st, ot, nb, h, l, d, s, k, yr, n);
    }
  });
}
#endif

// x [M, K] float32 through packed weights (pack_blocks) -> [M, N] float32.
at::Tensor block_gemm(const at::Tensor& x, const at::Tensor& w, const at::Tensor& corr,
                      const at::Tensor& scales, const at::Tensor& offsets, bool nibbles) {
  TORCH_CHECK(vnni_built(), "block_gemm: built without AVX-512 VNNI");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(),
              "block_gemm: x must be a contiguous float32 [M, K]");
  const int64_t m = x.size(0), k = x.size(1), nb = k / kBlock;
  TORCH_CHECK(k % kBlock == 0, "block_gemm: K must be a multiple of 32");
  TORCH_CHECK(scales.dim() == 3 && scales.size(1) == nb && scales.size(2) == kTile,
              "block_gemm: scales must be [N / 16, K / 32, 16]");
  const int64_t n = scales.size(0) * kTile;
  TORCH_CHECK(w.scalar_type() == at::kByte && w.is_contiguous() &&
                  w.numel() == n * (nibbles ? k / 2 : k),
              "block_gemm: w does not match [N, K]");
  const bool half = scales.scalar_type() == at::kHalf;
  TORCH_CHECK(corr.scalar_type() == at::kInt && corr.is_contiguous() &&
                  corr.numel() == (nibbles ? 0 : scales.numel()) &&
                  (half || scales.scalar_type() == at::kFloat) && scales.is_contiguous() &&
                  offsets.scalar_type() == scales.scalar_type() && offsets.is_contiguous() &&
                  (offsets.numel() == scales.numel() || offsets.numel() == 0),
              "block_gemm: corr (int32; empty for nibbles), scales and offsets (float32 or "
              "float16, one dtype; offsets may be empty) must be contiguous [N / 16, K / 32, 16]");
  at::Tensor y = at::empty({m, n}, x.options());
  if (m == 0 || n == 0) return y;
  std::vector<uint8_t> xh(m * k), xl(m * k);
  std::vector<float> xd(m * nb), xs(m * nb);
  const float* xp = x.data_ptr<float>();
  for (int64_t r = 0; r < m; ++r) {
    quantize_row(xp + r * k, k, nibbles ? 0 : 128, xh.data() + r * k, xl.data() + r * k, xd.data() + r * nb,
                 xs.data() + r * nb);
  }
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
  const uint8_t* wp = w.data_ptr<uint8_t>();
  const int32_t* cp = nibbles ? nullptr : corr.data_ptr<int32_t>();
  const bool has_offsets = offsets.numel() > 0;
  auto run = [&](auto* sp, auto* op) {
    if (nibbles) {
      gemm<true>(xh.data(), xl.data(), xd.data(), xs.data(), m, k, wp, cp, sp, op, n,
                 y.data_ptr<float>());
    } else {
      gemm<false>(xh.data(), xl.data(), xd.data(), xs.data(), m, k, wp, cp, sp, op, n,
                  y.data_ptr<float>());
    }
  };
  if (half) {
    const auto* sp = reinterpret_cast<const uint16_t*>(scales.data_ptr<at::Half>());
    const auto* op = has_offsets ? reinterpret_cast<const uint16_t*>(offsets.data_ptr<at::Half>())
                                 : nullptr;
    run(sp, op);
  } else {
    run(scales.data_ptr<float>(), has_offsets ? offsets.data_ptr<float>() : nullptr);
  }
#endif
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tokenmill_cpu, m) {
  m.def("block_gemm(Tensor x, Tensor w, Tensor corr, Tensor scales, Tensor offsets, "
        "bool nibbles) -> Tensor");
  m.impl("block_gemm", c10::DispatchKey::CPU, TORCH_FN(block_gemm));
  m.def("block_gemm_available() -> bool", [] { return vnni_built(); });
}
