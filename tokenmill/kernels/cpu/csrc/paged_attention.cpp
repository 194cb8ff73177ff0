// Paged decode attention: each request's one query token attends over its context read
// straight out of the paged KV cache [2, num_blocks, block_size, num_kv_heads, head_dim]
// through its block table (PagedAttention, Kwon et al., SOSP 2023), with no gather.
//
// One task is one (request, kv head) pair: the query heads that share the kv head (GQA,
// Ainslie et al. 2023) go through its keys together, up to four at a time, so each key and
// value row is read once per four query heads. A task takes two passes over its keys:
//   1. scores s_j = scale * <q, k_j> into a buffer, with their maximum m (the dot products
//      of four keys reduced across lanes together);
//   2. p_j = exp(s_j - m) (vectorized Cephes expf), l = sum_j p_j, then
//      out = (sum_j p_j v_j) / l, the value rows read in the same order.
// Each pass fetches rows a few keys ahead into cache (the blocks lie anywhere in memory). The
// keys of a sliding window are positions max(0, seq_len - window) .. seq_len - 1.
//
// The rotary variant (paged_decode_attention_rotary) also takes this step's unrotated key
// and value rows: each task rotates its kv head's key at position seq_len - 1 (RoPE, Su et
// al. 2021: the halves of the first rotary_dim dims, or adjacent pairs, by the cos | sin
// table row of that position), writes it and the value into the step's slot of that token
// (slot_mapping: block * block_size + offset; a negative slot writes nothing, as the cache
// write of the other paths), and rotates its query heads before attending, in place of
// three separate passes.
//
// Every sum runs in a fixed order over the request's own keys and threads split whole
// tasks, so a request's output is bit-identical whatever else is in the batch and however
// the work is spread over threads.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

namespace {

// Floats per vector step: head_dim must be a multiple.
constexpr int64_t kLanes = 16;
// Query heads that go through the keys together.
constexpr int kMaxHeads = 4;

#if defined(__AVX512F__)
// Value-row vectors accumulated per pass (4 x 16 = 64 dims; with four heads, 16 zmm).
constexpr int kMaxVecs = 4;

struct Vec {
  __m512 v;
};
inline Vec vzero() { return {_mm512_setzero_ps()}; }
inline Vec vset(float x) { return {_mm512_set1_ps(x)}; }
inline Vec vload(const float* p) { return {_mm512_loadu_ps(p)}; }
inline Vec vload(const c10::BFloat16* p) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return {_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16))};
}
inline Vec vload(const c10::Half* p) {
  return {_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)))};
}
inline void vstore(float* p, Vec a) { _mm512_storeu_ps(p, a.v); }
inline Vec vadd(Vec a, Vec b) { return {_mm512_add_ps(a.v, b.v)}; }
inline Vec vmul(Vec a, Vec b) { return {_mm512_mul_ps(a.v, b.v)}; }
inline Vec vmax(Vec a, Vec b) { return {_mm512_max_ps(a.v, b.v)}; }
inline Vec vfma(Vec a, Vec b, Vec c) { return {_mm512_fmadd_ps(a.v, b.v, c.v)}; }
inline Vec vround(Vec a) {
  return {_mm512_roundscale_ps(a.v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)};
}
// 2^n for integral n in [-126, 127].
inline Vec vpow2(Vec n) {
  const __m512i e = _mm512_add_epi32(_mm512_cvtps_epi32(n.v), _mm512_set1_epi32(127));
  return {_mm512_castsi512_ps(_mm512_slli_epi32(e, 23))};
}
inline float vsum(Vec a) {
  const __m256 s8 = _mm256_add_ps(_mm512_castps512_ps256(a.v),
                                  _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a.v), 1)));
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
// out[i] = the sum of v[i]'s lanes, i < 4, the four reduced together (13 shuffles and adds
// instead of 32).
inline void vsum4(const Vec* v, float* out) {
  const __m512 t01 = _mm512_add_ps(_mm512_shuffle_f32x4(v[0].v, v[1].v, 0x44),
                                   _mm512_shuffle_f32x4(v[0].v, v[1].v, 0xEE));
  const __m512 t23 = _mm512_add_ps(_mm512_shuffle_f32x4(v[2].v, v[3].v, 0x44),
                                   _mm512_shuffle_f32x4(v[2].v, v[3].v, 0xEE));
  // 128-bit lane i now holds four partial sums of v[i].
  __m512 u = _mm512_add_ps(_mm512_shuffle_f32x4(t01, t23, 0x88),
                           _mm512_shuffle_f32x4(t01, t23, 0xDD));
  u = _mm512_add_ps(u, _mm512_permute_ps(u, 0x4E));
  u = _mm512_add_ps(u, _mm512_permute_ps(u, 0xB1));
  const __m512i first = _mm512_set_epi32(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 12, 8, 4, 0);
  _mm_storeu_ps(out, _mm512_castps512_ps128(_mm512_permutexvar_ps(first, u)));
}
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
constexpr int kMaxVecs = 2;

struct Vec {
  __m256 lo, hi;
};
inline Vec vzero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
inline Vec vset(float x) { return {_mm256_set1_ps(x), _mm256_set1_ps(x)}; }
inline Vec vload(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
inline __m256 bf16x8(const c10::BFloat16* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
inline Vec vload(const c10::BFloat16* p) { return {bf16x8(p), bf16x8(p + 8)}; }
inline Vec vload(const c10::Half* p) {
  return {_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))),
          _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 8)))};
}
inline void vstore(float* p, Vec a) {
  _mm256_storeu_ps(p, a.lo);
  _mm256_storeu_ps(p + 8, a.hi);
}
inline Vec vadd(Vec a, Vec b) { return {_mm256_add_ps(a.lo, b.lo), _mm256_add_ps(a.hi, b.hi)}; }
inline Vec vmul(Vec a, Vec b) { return {_mm256_mul_ps(a.lo, b.lo), _mm256_mul_ps(a.hi, b.hi)}; }
inline Vec vmax(Vec a, Vec b) { return {_mm256_max_ps(a.lo, b.lo), _mm256_max_ps(a.hi, b.hi)}; }
inline Vec vfma(Vec a, Vec b, Vec c) {
  return {_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)};
}
inline Vec vround(Vec a) {
  constexpr int kMode = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
  return {_mm256_round_ps(a.lo, kMode), _mm256_round_ps(a.hi, kMode)};
}
inline __m256 pow2x8(__m256 n) {
  const __m256i e = _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127));
  return _mm256_castsi256_ps(_mm256_slli_epi32(e, 23));
}
inline Vec vpow2(Vec n) { return {pow2x8(n.lo), pow2x8(n.hi)}; }
inline float vsum(Vec a) {
  const __m256 s8 = _mm256_add_ps(a.lo, a.hi);
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
// out[i] = the sum of v[i]'s lanes, i < 4, the four reduced together.
inline void vsum4(const Vec* v, float* out) {
  __m256 x[4];
  for (int i = 0; i < 4; ++i) x[i] = _mm256_add_ps(v[i].lo, v[i].hi);
  const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(x[0], x[1]), _mm256_hadd_ps(x[2], x[3]));
  _mm_storeu_ps(out, _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1)));
}
#else
constexpr int kMaxVecs = 2;

struct Vec {
  float x[kLanes];
};
template <typename F>
inline Vec vmap(F f) {
  Vec r;
  for (int64_t i = 0; i < kLanes; ++i) r.x[i] = f(i);
  return r;
}
inline Vec vset(float x) { return vmap([&](int64_t) { return x; }); }
inline Vec vzero() { return vset(0.f); }
template <typename T>
inline Vec vload(const T* p) { return vmap([&](int64_t i) { return static_cast<float>(p[i]); }); }
inline void vstore(float* p, Vec a) { std::memcpy(p, a.x, sizeof(a.x)); }
inline Vec vadd(Vec a, Vec b) { return vmap([&](int64_t i) { return a.x[i] + b.x[i]; }); }
inline Vec vmul(Vec a, Vec b) { return vmap([&](int64_t i) { return a.x[i] * b.x[i]; }); }
inline Vec vmax(Vec a, Vec b) { return vmap([&](int64_t i) { return std::max(a.x[i], b.x[i]); }); }
inline Vec vfma(Vec a, Vec b, Vec c) {
  return vmap([&](int64_t i) { return std::fma(a.x[i], b.x[i], c.x[i]); });
}
inline Vec vround(Vec a) { return vmap([&](int64_t i) { return std::nearbyint(a.x[i]); }); }
inline Vec vpow2(Vec n) { return vmap([&](int64_t i) { return std::ldexp(1.f, int(n.x[i])); }); }
inline float vsum(Vec a) {
  float s = 0.f;
  for (int64_t i = 0; i < kLanes; ++i) s += a.x[i];
  return s;
}
inline void vsum4(const Vec* v, float* out) {
  for (int i = 0; i < 4; ++i) out[i] = vsum(v[i]);
}
#endif

// exp(x) for x <= 0, Cephes' expf (range reduction by ln 2 in two parts, degree-5
// polynomial; about 1 ulp); inputs below -87.3 give ~1e-38 instead of underflowing.
inline Vec vexp(Vec x) {
  x = vmax(x, vset(-87.3f));
  const Vec n = vround(vmul(x, vset(1.44269504088896341f)));
  Vec r = vfma(n, vset(-0.693359375f), x);
  r = vfma(n, vset(2.12194440e-4f), r);
  Vec p = vset(1.9875691500e-4f);
  p = vfma(p, r, vset(1.3981999507e-3f));
  p = vfma(p, r, vset(8.3334519073e-3f));
  p = vfma(p, r, vset(4.1665795894e-2f));
  p = vfma(p, r, vset(1.6666665459e-1f));
  p = vfma(p, r, vset(5.0000001201e-1f));
  p = vfma(p, vmul(r, r), vadd(r, vset(1.f)));
  return vmul(p, vpow2(n));
}

// Keys ahead whose rows are fetched into cache while the current ones are computed on: a
// request's blocks lie anywhere, which the hardware prefetchers cannot follow.
constexpr int64_t kPrefetchKeys = 8;

template <typename T>
inline void prefetch_row(const T* row, int64_t d) {
  const char* p = reinterpret_cast<const char*>(row);
  for (int64_t b = 0; b < d * static_cast<int64_t>(sizeof(T)); b += 64) {
    _mm_prefetch(p + b, _MM_HINT_T0);
  }
}

// Offsets (elements from slot 0's row) of the keys [start, end) of one request, through its
// block table row: offs[j] for key start + j.
void row_offsets(const int32_t* table, int64_t start, int64_t end, int64_t block_size,
                 int64_t row_stride, int64_t* offs) {
  for (int64_t b = start / block_size; b * block_size < end; ++b) {
    const int64_t base = static_cast<int64_t>(table[b]) * block_size;
    const int64_t r0 = std::max<int64_t>(start - b * block_size, 0);
    const int64_t r1 = std::min<int64_t>(end - b * block_size, block_size);
    for (int64_t r = r0; r < r1; ++r) offs[b * block_size + r - start] = (base + r) * row_stride;
  }
}

// Pass 1 for NQ heads q [NQ, d] over n keys: s[g * ld + j] = scale * <q[g], k_j>, and their
// maxima in mx. Four keys at a time, reduced together (a short last group repeats its last
// key, so every key's score takes the same operations). NV: d / kLanes where fixed (the
// query then stays in registers), 0 for any d.
template <int NQ, int NV, typename T>
void scores(const float* q, int64_t d, const T* k, const int64_t* offs, int64_t n,
            float scale, float* s, int64_t ld, float* mx) {
  constexpr bool kFixed = NV > 0;
  const int64_t nv = kFixed ? NV : d / kLanes;
  Vec qr[NQ][kFixed ? NV : 1];
  if constexpr (kFixed) {
    for (int g = 0; g < NQ; ++g)
      for (int c = 0; c < NV; ++c) qr[g][c] = vload(q + g * d + c * kLanes);
  }
  for (int g = 0; g < NQ; ++g) mx[g] = -std::numeric_limits<float>::infinity();
  for (int64_t j = 0; j < n; j += 4) {
    const T* rows[4];
    for (int r = 0; r < 4; ++r) rows[r] = k + offs[std::min<int64_t>(j + r, n - 1)];
    for (int64_t r = j + kPrefetchKeys; r < std::min(j + kPrefetchKeys + 4, n); ++r) {
      prefetch_row(k + offs[r], d);
    }
    Vec acc[NQ][4];
    for (int g = 0; g < NQ; ++g)
      for (int r = 0; r < 4; ++r) acc[g][r] = vzero();
    for (int64_t c = 0; c < nv; ++c) {
      for (int r = 0; r < 4; ++r) {
        const Vec kv = vload(rows[r] + c * kLanes);
        for (int g = 0; g < NQ; ++g) {
          Vec qv;
          if constexpr (kFixed) {
            qv = qr[g][c];
          } else {
            qv = vload(q + g * d + c * kLanes);
          }
          acc[g][r] = vfma(qv, kv, acc[g][r]);
        }
      }
    }
    const int64_t m = std::min<int64_t>(4, n - j);
    for (int g = 0; g < NQ; ++g) {
      float four[4];
      vsum4(acc[g], four);
      for (int64_t r = 0; r < m; ++r) {
        const float x = four[r] * scale;
        s[g * ld + j + r] = x;
        mx[g] = std::max(mx[g], x);
      }
    }
  }
}

// Softmax numerators in place over the n scores of each of nq rows (ld >= n rounded up to
// kLanes; the padding is zeroed); returns 1 / their sums in inv.
void softmax_rows(float* s, int64_t ld, int64_t n, int nq, const float* mx, float* inv) {
  for (int g = 0; g < nq; ++g) {
    float* row = s + g * ld;
    const Vec m = vset(mx[g]);
    const Vec neg = vset(-1.f);
    Vec total = vzero();
    int64_t j = 0;
    for (; j + kLanes <= n; j += kLanes) {
      const Vec p = vexp(vfma(m, neg, vload(row + j)));
      vstore(row + j, p);
      total = vadd(total, p);
    }
    if (j < n) {
      std::fill(row + n, row + j + kLanes, mx[g]);  // exp(0) = 1, zeroed below
      const Vec p = vexp(vfma(m, neg, vload(row + j)));
      vstore(row + j, p);
      std::fill(row + n, row + j + kLanes, 0.f);
      total = vadd(total, vload(row + j));
    }
    inv[g] = 1.f / vsum(total);
  }
}

// Pass 2 for NQ heads and NV vectors of dims from c0: out[g, c0:] = inv[g] * sum_j p[g][j]
// v_j[c0:], over the rows at offs; out rows are d floats apart.
template <int NQ, int NV, typename T>
void weighted_values(const float* p, int64_t ld, const float* inv, const T* v,
                     const int64_t* offs, int64_t n, int64_t c0, float* out, int64_t d) {
  Vec acc[NQ][NV];
  for (int g = 0; g < NQ; ++g)
    for (int i = 0; i < NV; ++i) acc[g][i] = vzero();
  for (int64_t j = 0; j < n; ++j) {
    if (j + kPrefetchKeys < n) prefetch_row(v + offs[j + kPrefetchKeys] + c0, NV * kLanes);
    const T* row = v + offs[j] + c0;
    for (int i = 0; i < NV; ++i) {
      const Vec vv = vload(row + i * kLanes);
      for (int g = 0; g < NQ; ++g) acc[g][i] = vfma(vset(p[g * ld + j]), vv, acc[g][i]);
    }
  }
  for (int g = 0; g < NQ; ++g)
    for (int i = 0; i < NV; ++i)
      vstore(out + g * d + c0 + i * kLanes, vmul(acc[g][i], vset(inv[g])));
}

// Both passes for NQ (1..4) query heads q [NQ, d] over one kv head's n keys; out [NQ, d].
template <int NQ, typename T>
void attend_heads(const float* q, int64_t d, const T* k, const T* v, const int64_t* offs,
                  int64_t n, float scale, float* s, int64_t ld, float* out) {
  float mx[NQ], inv[NQ];
  switch (d / kLanes) {
    case 4: scores<NQ, 4>(q, d, k, offs, n, scale, s, ld, mx); break;
    case 8: scores<NQ, 8>(q, d, k, offs, n, scale, s, ld, mx); break;
    default: scores<NQ, 0>(q, d, k, offs, n, scale, s, ld, mx); break;
  }
  softmax_rows(s, ld, n, NQ, mx, inv);
  for (int64_t c0 = 0; c0 < d; c0 += kMaxVecs * kLanes) {
    switch (std::min<int64_t>(kMaxVecs, (d - c0) / kLanes)) {
      case 1: weighted_values<NQ, 1>(s, ld, inv, v, offs, n, c0, out, d); break;
      case 2: weighted_values<NQ, 2>(s, ld, inv, v, offs, n, c0, out, d); break;
      case 3: weighted_values<NQ, 3>(s, ld, inv, v, offs, n, c0, out, d); break;
      default: weighted_values<NQ, 4>(s, ld, inv, v, offs, n, c0, out, d); break;
    }
  }
}

struct Problem {
  const float* q;  // [B, H, D], strides q_stride_b / q_stride_h, dims contiguous
  int64_t q_stride_b, q_stride_h;
  const int32_t* table;  // [B, W], rows table_stride apart
  int64_t table_stride;
  const int32_t* seq_lens;  // [B]
  int64_t num_heads, num_kv_heads, head_dim, block_size;
  int64_t window;  // 0: none
  float scale;
  float* out;  // [B, H, D] contiguous
  // Rotary variant: this step's unrotated K/V rows [B, Hkv * D] (k_stride, v_stride apart), written
  // at position seq_len - 1; the cos | sin table [positions, rotary_dim]. k_new null: none.
  const float* k_new = nullptr;
  const float* v_new = nullptr;
  int64_t k_stride = 0, v_stride = 0;
  const int64_t* slots = nullptr;  // [B] the new token's cache slot; negative: not written
  const float* cos_sin = nullptr;
  int64_t rotary_dim = 0;
  bool neox = true;
};

// x [d] rotated by one cos | sin table row ``cs`` [rot] into y [d] (the dims past rot copied).
inline void rotate(const float* x, const float* cs, int64_t rot, bool neox, int64_t d,
                   float* y) {
  const int64_t half = rot / 2;
  const float* cos = cs;
  const float* sin = cs + half;
  if (neox) {
    for (int64_t i = 0; i < half; ++i) {
      const float a = x[i], b = x[i + half];
      y[i] = a * cos[i] - b * sin[i];
      y[i + half] = b * cos[i] + a * sin[i];
    }
  } else {
    for (int64_t i = 0; i < half; ++i) {
      const float a = x[2 * i], b = x[2 * i + 1];
      y[2 * i] = a * cos[i] - b * sin[i];
      y[2 * i + 1] = b * cos[i] + a * sin[i];
    }
  }
  for (int64_t j = rot; j < d; ++j) y[j] = x[j];
}

template <typename T>
void run(const Problem& pb, T* k_cache, T* v_cache, int64_t num_reqs, int64_t max_keys) {
  const int64_t hkv = pb.num_kv_heads, d = pb.head_dim, group = pb.num_heads / hkv;
  const int64_t row_stride = hkv * d;
  const int64_t ld = (max_keys + kLanes - 1) / kLanes * kLanes;
  // NOTE: a task is (request, kv head) and never split, so a request's bits do not depend
  // on the split; the grain keeps short batches on one thread (waking threads costs more).
  int64_t total_keys = 0;
  for (int64_t b = 0; b < num_reqs; ++b) total_keys += pb.seq_lens[b];
  const int64_t keys_per_task = std::max<int64_t>(1, total_keys / num_reqs);
  const int64_t grain = std::max<int64_t>(1, 4096 / (keys_per_task * group));
  at::parallel_for(0, num_reqs * hkv, grain, [&](int64_t t0, int64_t t1) {
    std::vector<float> buffer(kMaxHeads * ld + kMaxHeads * d);
    std::vector<int64_t> offs(max_keys);
    float* s = buffer.data();
    float* qh = s + kMaxHeads * ld;
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t b = t / hkv, h = t % hkv;
      const int64_t len = pb.seq_lens[b];
      float* out = pb.out + (b * pb.num_heads + h * group) * d;
      if (len == 0) {
        std::fill(out, out + group * d, 0.f);
        continue;
      }
      const int64_t start = pb.window > 0 ? std::max<int64_t>(0, len - pb.window) : 0;
      const int64_t n = len - start;
      const float* cs = nullptr;
      if (pb.k_new != nullptr) {  // write this step's key (rotated) and value first
        const int64_t pos = len - 1;
        cs = pb.cos_sin + pos * pb.rotary_dim;
        if (pb.slots[b] >= 0) {
          const int64_t slot = pb.slots[b] * row_stride + h * d;
          rotate(pb.k_new + b * pb.k_stride + h * d, cs, pb.rotary_dim, pb.neox, d, qh);
          const float* vn = pb.v_new + b * pb.v_stride + h * d;
          for (int64_t j = 0; j < d; ++j) {
            k_cache[slot + j] = static_cast<T>(qh[j]);
            v_cache[slot + j] = static_cast<T>(vn[j]);
          }
        }
      }
      row_offsets(pb.table + b * pb.table_stride, start, len, pb.block_size, row_stride,
                  offs.data());
      const T* k = k_cache + h * d;
      const T* v = v_cache + h * d;
      for (int64_t g0 = 0; g0 < group; g0 += kMaxHeads) {
        const int nq = static_cast<int>(std::min<int64_t>(kMaxHeads, group - g0));
        for (int g = 0; g < nq; ++g) {
          const float* src = pb.q + b * pb.q_stride_b + (h * group + g0 + g) * pb.q_stride_h;
          if (cs != nullptr) {
            rotate(src, cs, pb.rotary_dim, pb.neox, d, qh + g * d);
          } else {
            std::memcpy(qh + g * d, src, d * sizeof(float));
          }
        }
        float* o = out + g0 * d;
        const int64_t* r = offs.data();
        switch (nq) {
          case 1: attend_heads<1>(qh, d, k, v, r, n, pb.scale, s, ld, o); break;
          case 2: attend_heads<2>(qh, d, k, v, r, n, pb.scale, s, ld, o); break;
          case 3: attend_heads<3>(qh, d, k, v, r, n, pb.scale, s, ld, o); break;
          default: attend_heads<4>(qh, d, k, v, r, n, pb.scale, s, ld, o); break;
        }
      }
    }
  });
}

struct NewKV {
  const at::Tensor* k = nullptr;
  const at::Tensor* v = nullptr;
  const at::Tensor* slots = nullptr;
  const at::Tensor* cos_sin = nullptr;
  int64_t rotary_dim = 0;
  bool neox = true;
};

at::Tensor attend(const at::Tensor& q, const at::Tensor& kv_cache, const at::Tensor& block_table,
                  const at::Tensor& seq_lens, double scale, int64_t window, const NewKV& nk);

// q [B, H, D] float32, kv_cache [2, NB, BS, Hkv, D] (float32, bfloat16 or float16),
// block_table [B, W] int32, seq_lens [B] int32 -> [B, H, D] float32.
at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& kv_cache,
                                  const at::Tensor& block_table, const at::Tensor& seq_lens,
                                  double scale, int64_t window) {
  return attend(q, kv_cache, block_table, seq_lens, scale, window, NewKV{});
}

// The same, after writing this step's K/V: q [B, H, D] and k, v [B, Hkv * D] float32 rows,
// unrotated; cos_sin [P, rotary_dim] float32 (cos | sin halves); the new token of request b
// is at position seq_lens[b] - 1 and goes to cache slot slot_mapping[b] (int64 [B]; negative:
// not written). kv_cache is written in place.
at::Tensor paged_decode_attention_rotary(const at::Tensor& q, const at::Tensor& k,
                                         const at::Tensor& v, const at::Tensor& kv_cache,
                                         const at::Tensor& slot_mapping,
                                         const at::Tensor& block_table,
                                         const at::Tensor& seq_lens, const at::Tensor& cos_sin,
                                         int64_t rotary_dim, bool neox, double scale,
                                         int64_t window) {
  const int64_t d = q.dim() == 3 ? q.size(2) : 0;
  TORCH_CHECK(rotary_dim > 0 && rotary_dim % 2 == 0 && rotary_dim <= d,
              "paged_decode_attention_rotary: rotary_dim must be even, in 1..head_dim");
  TORCH_CHECK(cos_sin.dim() == 2 && cos_sin.scalar_type() == at::kFloat &&
                  cos_sin.is_contiguous() && cos_sin.size(1) == rotary_dim,
              "paged_decode_attention_rotary: cos_sin must be contiguous float32 [P, rotary_dim]");
  const int64_t hkv = kv_cache.dim() == 5 ? kv_cache.size(3) : 0;
  for (const at::Tensor* t : {&k, &v}) {
    TORCH_CHECK(t->dim() == 2 && t->scalar_type() == at::kFloat && t->stride(1) == 1 &&
                    t->size(0) == q.size(0) && t->size(1) == hkv * d,
                "paged_decode_attention_rotary: k and v must be float32 [B, Hkv * D] rows");
  }
  TORCH_CHECK(slot_mapping.dim() == 1 && slot_mapping.scalar_type() == at::kLong &&
                  slot_mapping.is_contiguous() && slot_mapping.size(0) == q.size(0),
              "paged_decode_attention_rotary: slot_mapping must be contiguous int64 [B]");
  const int64_t num_slots = kv_cache.dim() == 5 ? kv_cache.size(1) * kv_cache.size(2) : 0;
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  for (int64_t b = 0; b < seq_lens.numel(); ++b) {
    TORCH_CHECK(slots[b] < num_slots, "paged_decode_attention_rotary: request ", b,
                "'s slot ", slots[b], " is past the cache's ", num_slots);
    TORCH_CHECK(lens[b] >= 1 && lens[b] <= cos_sin.size(0),
                "paged_decode_attention_rotary: request ", b, " is at position ", lens[b] - 1,
                "; the rotary table has ", cos_sin.size(0));
  }
  return attend(q, kv_cache, block_table, seq_lens, scale, window,
                NewKV{&k, &v, &slot_mapping, &cos_sin, rotary_dim, neox});
}

at::Tensor attend(const at::Tensor& q, const at::Tensor& kv_cache, const at::Tensor& block_table,
                  const at::Tensor& seq_lens, double scale, int64_t window, const NewKV& nk) {
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == at::kFloat && q.stride(2) == 1,
              "paged_decode_attention: q must be float32 [B, H, D] with contiguous dims");
  TORCH_CHECK(kv_cache.dim() == 5 && kv_cache.size(0) == 2 && kv_cache.is_contiguous(),
              "paged_decode_attention: kv_cache must be contiguous [2, NB, BS, Hkv, D]");
  const auto dtype = kv_cache.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf,
              "paged_decode_attention: kv_cache must be float32, bfloat16 or float16, got ",
              dtype);
  const int64_t num_reqs = q.size(0), num_heads = q.size(1), d = q.size(2);
  const int64_t num_blocks = kv_cache.size(1), bs = kv_cache.size(2);
  const int64_t hkv = kv_cache.size(3);
  TORCH_CHECK(kv_cache.size(4) == d, "paged_decode_attention: head_dim ", d,
              " of q does not match the cache's ", kv_cache.size(4));
  TORCH_CHECK(d % kLanes == 0, "paged_decode_attention: head_dim must be a multiple of ",
              kLanes, ", got ", d);
  TORCH_CHECK(hkv > 0 && num_heads % hkv == 0, "paged_decode_attention: ", num_heads,
              " query heads are not a multiple of ", hkv, " kv heads");
  TORCH_CHECK(block_table.dim() == 2 && block_table.scalar_type() == at::kInt &&
                  block_table.stride(1) == 1 && block_table.size(0) == num_reqs,
              "paged_decode_attention: block_table must be int32 [B, W] with contiguous rows");
  TORCH_CHECK(seq_lens.dim() == 1 && seq_lens.scalar_type() == at::kInt &&
                  seq_lens.is_contiguous() && seq_lens.size(0) == num_reqs,
              "paged_decode_attention: seq_lens must be contiguous int32 [B]");
  TORCH_CHECK(window >= 0, "paged_decode_attention: window must be >= 0 (0: none)");
  const int32_t* table = block_table.data_ptr<int32_t>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  const int64_t width = block_table.size(1), table_stride = block_table.stride(0);
  int64_t max_keys = 0;
  for (int64_t b = 0; b < num_reqs; ++b) {
    const int64_t len = lens[b];
    TORCH_CHECK(len >= 0 && len <= width * bs, "paged_decode_attention: request ", b,
                " has ", len, " tokens; its block table row covers ", width * bs);
    const int64_t start = window > 0 ? std::max<int64_t>(0, len - window) : 0;
    for (int64_t i = start / bs; i * bs < len; ++i) {
      const int32_t id = table[b * table_stride + i];
      TORCH_CHECK(id >= 0 && id < num_blocks, "paged_decode_attention: request ", b,
                  " reads block ", id, " of a cache of ", num_blocks);
    }
    max_keys = std::max(max_keys, len - start);
  }
  at::Tensor out = at::empty({num_reqs, num_heads, d}, q.options());
  if (num_reqs == 0 || num_heads == 0) return out;
  Problem pb{q.data_ptr<float>(), q.stride(0), q.stride(1), table, table_stride, lens,
             num_heads, hkv, d, bs, window, static_cast<float>(scale), out.data_ptr<float>()};
  if (nk.k != nullptr) {
    pb.k_new = nk.k->data_ptr<float>();
    pb.v_new = nk.v->data_ptr<float>();
    pb.k_stride = nk.k->stride(0);
    pb.v_stride = nk.v->stride(0);
    pb.slots = nk.slots->data_ptr<int64_t>();
    pb.cos_sin = nk.cos_sin->data_ptr<float>();
    pb.rotary_dim = nk.rotary_dim;
    pb.neox = nk.neox;
  }
  const int64_t half = num_blocks * bs * hkv * d;  // elements of the K (or V) half
  if (dtype == at::kFloat) {
    float* base = kv_cache.data_ptr<float>();
    run<float>(pb, base, base + half, num_reqs, max_keys);
  } else if (dtype == at::kBFloat16) {
    c10::BFloat16* base = kv_cache.data_ptr<c10::BFloat16>();
    run<c10::BFloat16>(pb, base, base + half, num_reqs, max_keys);
  } else {
    c10::Half* base = kv_cache.data_ptr<c10::Half>();
    run<c10::Half>(pb, base, base + half, num_reqs, max_keys);
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tokenmill_cpu, m) {
  m.def(
      "paged_decode_attention(Tensor q, Tensor kv_cache, Tensor block_table, Tensor seq_lens, "
      "float scale, int window) -> Tensor");
  m.impl("paged_decode_attention", c10::DispatchKey::CPU, TORCH_FN(paged_decode_attention));
  m.def(
      "paged_decode_attention_rotary(Tensor q, Tensor k, Tensor v, Tensor(a!) kv_cache, "
      "Tensor slot_mapping, Tensor block_table, Tensor seq_lens, Tensor cos_sin, int rotary_dim, bool neox, "
      "float scale, int window) -> Tensor");
  m.impl("paged_decode_attention_rotary", c10::DispatchKey::CPU,
         TORCH_FN(paged_decode_attention_rotary));
}
