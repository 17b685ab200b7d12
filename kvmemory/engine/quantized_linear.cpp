// Linears over GGUF weight blocks in two forms, computed in fp32 (CPU), and the same with int8
// activations (VNNI; below). Other GGUF block types are read into these forms exactly (same
// weight values, see kvmemory/engine/gguf_blocks.py): Q4_K and Q4_0 as Q4_1 blocks with fp32
// scale and min per 32 weights, Q5_0 as Q8_0 blocks, Q6_K as byte codes with a scale per 16,
// Q5_K as byte codes with a scale and a min per 32. F16 linears keep their fp16 values.
//
// A Q4_1 block holds 32 weights of one output row as w_j = d * q_j + m (q_j a 4-bit code; bytes
// 0..15 hold codes 0..15 in their low nibbles and codes 16..31 in their high nibbles, as in GGUF).
// A Q8_0 block holds w_j = d * q_j (q_j a signed byte). d and m arrive as fp32 (converted once
// from the file's fp16). The portable and AVX2 paths use the factored form
//     y = sum_blocks d * (q . x_block) + m * sum(x_block)
// which equals x . dequantize(W) up to fp32 rounding (a different summation order than a dense
// GEMV, like any other kernel). The several-row kernels, and the AVX-512 decode kernels of the
// 4-bit and 16-value forms, instead dequantize each block once (w = d * q + m, one FMA) and
// multiply it with every activation row. Reading the codes instead of dense fp32 weights moves 1/5
// of the bytes per token, which is what bounds decoding speed on a CPU.
//
// Rows of the output are split over torch's intra-op threads (at::parallel_for).

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>
// SIMD paths: AVX-512 (F/BW/VL/DQ, + VNNI for int8 activations), else AVX2 + FMA, else portable
// scalar code. Which one a build gets is set by the flags kvmemory/engine/quantized.py compiles with.
#if defined(__AVX512F__)
#define KVMEMORY_AVX512 1
#elif defined(__AVX2__) && defined(__FMA__)
#define KVMEMORY_AVX2 1
#endif
#if defined(KVMEMORY_AVX512) || defined(KVMEMORY_AVX2)
#define KVMEMORY_SIMD 1
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kBlock = 32;
constexpr int64_t kRowsPerTask = 16;
constexpr int64_t kMaxM = 8;  // activation rows handled together (one pass over the codes)
constexpr int64_t kEachRows = 4;  // batched decoding: threads' rows per pass of the exact one-row arithmetic
// One-row (decode) kernels read each weight once per token from memory: they prefetch the rows
// this many rows ahead of use (prefetches never fault, also past the end).
constexpr int64_t kPrefetchRows = 16;

// Calls f(std::integral_constant<int, C>{}) with C = count clamped to [1, Max]: kernels that are
// templates on a small count (activation rows, query vectors) dispatch through this.
template <int Max, int C = 1, typename F>
void with_count(int64_t count, F&& f) {
  if constexpr (C >= Max) {
    f(std::integral_constant<int, Max>{});
  } else if (count <= C) {
    f(std::integral_constant<int, C>{});
  } else {
    with_count<Max, C + 1>(count, std::forward<F>(f));
  }
}

void check_inputs(const torch::Tensor& x, const torch::Tensor& codes, const torch::Tensor& d, int64_t code_bytes) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32 && x.is_contiguous(),
              "x must be a contiguous fp32 [M, K] tensor");
  TORCH_CHECK(x.size(1) % kBlock == 0, "K must be a multiple of 32");
  TORCH_CHECK(codes.dim() == 2 && codes.is_contiguous() && codes.size(1) == x.size(1) / kBlock * code_bytes,
              "codes must be contiguous [N, K/32*", code_bytes, "]");
  TORCH_CHECK(d.scalar_type() == torch::kFloat32 && d.is_contiguous() && d.size(0) == codes.size(0) &&
              d.size(1) == x.size(1) / kBlock, "scales must be contiguous fp32 [N, K/32]");
}

// Byte codes' optional mins: empty, or fp32 [N, K/32] like their scales (one per 32 weights).
void check_byte_mins(const torch::Tensor& m, const torch::Tensor& d) {
  TORCH_CHECK(m.numel() == 0 || (m.scalar_type() == torch::kFloat32 && m.is_contiguous() && m.sizes() == d.sizes()),
              "byte codes' mins must be empty or contiguous fp32 [N, K/32] like their scales");
}

// Sum of each 32-element block of every activation row: [M, K/32].
torch::Tensor block_sums(const torch::Tensor& x) {
  const int64_t M = x.size(0), nb = x.size(1) / kBlock;
  auto out = torch::empty({M, nb}, x.options());
  const float* xp = x.data_ptr<float>();
  float* op = out.data_ptr<float>();
  for (int64_t i = 0; i < M * nb; ++i) {
    float total = 0.f;
    for (int64_t j = 0; j < kBlock; ++j) total += xp[i * kBlock + j];
    op[i] = total;
  }
  return out;
}

// One output row of a Q4_1 weight (codes q, scales d and mins m of its nb blocks) times one
// activation row x [nb * 32] with per-block sums xs [nb], in the factored form
// sum_b d_b * (codes_b . x_b) + m_b * sum(x_b): the portable path of the linears below.
inline float q4_row_dot(const uint8_t* q, const float* d, const float* m, const float* x, const float* xs,
                        int64_t nb) {
  float total = 0.f;
  for (int64_t b = 0; b < nb; ++b) {
    float dot = 0.f;
    for (int64_t j = 0; j < 16; ++j) {
      dot += float(q[b * 16 + j] & 0xF) * x[b * kBlock + j] + float(q[b * 16 + j] >> 4) * x[b * kBlock + 16 + j];
    }
    total += d[b] * dot + m[b] * xs[b];
  }
  return total;
}

#if defined(KVMEMORY_AVX512)
inline float hsum(__m512 v) { return _mm512_reduce_add_ps(v); }
#elif defined(KVMEMORY_AVX2)
inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

// Part c (0..3) of a Q4_1 block's 32 codes as 8 floats: c = 0, 1 the low nibbles of bytes 0-7,
// 8-15 (codes 0-15), c = 2, 3 their high nibbles (codes 16-31); it meets x[8c .. 8c + 8).
inline __m256 q4_codes8(const uint8_t* block, int c) {
  const __m256i bytes = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(block + (c & 1) * 8)));
  return _mm256_cvtepi32_ps(c < 2 ? _mm256_and_si256(bytes, _mm256_set1_epi32(0xF)) : _mm256_srli_epi32(bytes, 4));
}

// 8 signed Q8_0 codes as floats
inline __m256 q8_codes8(const int8_t* q) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q))));
}
#endif

// a . b over n floats. Also a weight row's factored min term (sum_b m[b] * xs[b] over its blocks),
// in vector lanes: a batched step adds that per activation row (Qwen 1.5B, 2 K, 2 threads: a
// 4-row step 134 ms against 155-185 with a scalar loop).
float dot(const float* a, const float* b, int64_t n) {
  int64_t j = 0;
  float total = 0.f;
#if defined(KVMEMORY_AVX512)
  __m512 acc = _mm512_setzero_ps();
  for (; j + 16 <= n; j += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(a + j), _mm512_loadu_ps(b + j), acc);
  total = hsum(acc);
#elif defined(KVMEMORY_AVX2)
  __m256 acc = _mm256_setzero_ps();
  for (; j + 8 <= n; j += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + j), _mm256_loadu_ps(b + j), acc);
  total = hsum(acc);
#endif
  for (; j < n; ++j) total += a[j] * b[j];
  return total;
}

// Byte codes with a min per 32 weights (Q5_K: w = d * q + m): the min's share of output rows
// [begin, end) of y (row stride 1) for one activation row with block sums xs [nb], added in one
// fixed order on every path (one row, several rows, batched), so all of them agree bit for bit.
inline void add_min_terms(const float* m, int64_t nb, const float* xs, float* y, int64_t begin, int64_t end) {
  for (int64_t o = begin; o < end; ++o) y[o] += dot(m + o * nb, xs, nb);
}

#if defined(KVMEMORY_AVX512)
// q4_rows_each's AVX-512 pass over P output rows from o: each block is dequantized once for all R
// rows through a 16-entry table (w = d * q + m for q = 0..15, one FMA; a permute looks the codes
// up, reading only their low 4 bits), and each (output row, activation row) keeps its low and
// high halves in two chains. A row's arithmetic does not depend on P or R.
template <int R, int P>
void q4_each_pass(const float* x, int64_t K, const uint8_t* codes, const float* d, const float* m, float* y,
                  int64_t ldy, int64_t o) {
  const int64_t nb = K / kBlock;
  const __m512 codes16 = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  __m512 acc[P][R][2];
  for (int r = 0; r < P; ++r)
    for (int i = 0; i < R; ++i) acc[r][i][0] = acc[r][i][1] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    __m512 x0[R], x1[R];  // the rows' values of this block, loaded once for the P output rows
    for (int i = 0; i < R; ++i) {
      x0[i] = _mm512_loadu_ps(x + i * K + b * kBlock);
      x1[i] = _mm512_loadu_ps(x + i * K + b * kBlock + 16);
    }
    if ((b & 3) == 0) {
      _mm_prefetch(reinterpret_cast<const char*>(d + (o + kPrefetchRows) * nb + b), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(m + (o + kPrefetchRows) * nb + b), _MM_HINT_T0);
    }
    for (int r = 0; r < P; ++r) {
      const int64_t row = o + r;
      if ((b & 3) == 0) _mm_prefetch(reinterpret_cast<const char*>(codes + ((row + kPrefetchRows) * nb + b) * 16), _MM_HINT_T0);
      const __m512i bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + (row * nb + b) * 16)));
      const __m512 table = _mm512_fmadd_ps(_mm512_set1_ps(d[row * nb + b]), codes16, _mm512_set1_ps(m[row * nb + b]));
      const __m512 lo = _mm512_permutexvar_ps(bytes, table);
      const __m512 hi = _mm512_permutexvar_ps(_mm512_srli_epi32(bytes, 4), table);
      for (int i = 0; i < R; ++i) {
        acc[r][i][0] = _mm512_fmadd_ps(lo, x0[i], acc[r][i][0]);
        acc[r][i][1] = _mm512_fmadd_ps(hi, x1[i], acc[r][i][1]);
      }
    }
  }
  for (int r = 0; r < P; ++r)
    for (int i = 0; i < R; ++i) y[i * ldy + o + r] = hsum(_mm512_add_ps(acc[r][i][0], acc[r][i][1]));
}
#endif

// The decode kernel, for R activation rows at once: one row is a thread's decoded token (R = 1),
// several are different threads' tokens decoded together (batched decoding). Several output rows
// at a time share the activation loads and keep independent accumulation chains in flight; each
// activation row gets the same operations in the same order whatever R is (its result is bit for
// bit the same alone or batched), while every block of codes is read once for all R rows.
// x [R, K] (row stride K), xs [R, K/32], y row i at y + i * ldy. On AVX-512 the table form
// (q4_each_pass) costs a row 2 FMAs per block against a multiply, 2 FMAs and a min term in the
// factored form (Qwen 1.5B, a 4-row step about 22 % shorter: benchmarks/engine-measurements.md).
template <int R>
void q4_rows_each(const float* x, int64_t K, const uint8_t* codes, const float* d, const float* m,
                  const float* xs, float* y, int64_t ldy, int64_t row_begin, int64_t row_end) {
  const int64_t nb = K / kBlock;
  int64_t o = row_begin;
#if defined(KVMEMORY_AVX512)
  constexpr int P = R <= 2 ? 4 : 2;  // 2PR accumulators + 2R activation vectors fit in 32 registers
  for (; o + P <= row_end; o += P) q4_each_pass<R, P>(x, K, codes, d, m, y, ldy, o);
  for (; o < row_end; ++o) q4_each_pass<R, 1>(x, K, codes, d, m, y, ldy, o);
#elif defined(KVMEMORY_AVX2)
  for (; o + 4 <= row_end; o += 4) {
    __m256 acc[4][R];
    for (int r = 0; r < 4; ++r)
      for (int i = 0; i < R; ++i) acc[r][i] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; ++b) {
      if ((b & 3) == 0) {
        _mm_prefetch(reinterpret_cast<const char*>(d + (o + kPrefetchRows) * nb + b), _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char*>(m + (o + kPrefetchRows) * nb + b), _MM_HINT_T0);
      }
      for (int r = 0; r < 4; ++r) {
        const int64_t row = o + r;
        const uint8_t* q = codes + (row * nb + b) * 16;
        if ((b & 3) == 0) _mm_prefetch(reinterpret_cast<const char*>(codes + ((row + kPrefetchRows) * nb + b) * 16), _MM_HINT_T0);
        const __m256 c0 = q4_codes8(q, 0), c1 = q4_codes8(q, 1), c2 = q4_codes8(q, 2), c3 = q4_codes8(q, 3);
        const __m256 scale = _mm256_set1_ps(d[row * nb + b]);
        for (int i = 0; i < R; ++i) {
          const float* xb = x + i * K + b * kBlock;
          __m256 t = _mm256_mul_ps(c0, _mm256_loadu_ps(xb));
          t = _mm256_fmadd_ps(c1, _mm256_loadu_ps(xb + 8), t);
          t = _mm256_fmadd_ps(c2, _mm256_loadu_ps(xb + 16), t);
          t = _mm256_fmadd_ps(c3, _mm256_loadu_ps(xb + 24), t);
          acc[r][i] = _mm256_fmadd_ps(scale, t, acc[r][i]);
        }
      }
    }
    for (int r = 0; r < 4; ++r) {
      const float* mr = m + (o + r) * nb;
      for (int i = 0; i < R; ++i) {
        y[i * ldy + o + r] = hsum(acc[r][i]) + dot(mr, xs + i * nb, nb);
      }
    }
  }
#endif
  for (; o < row_end; ++o)
    for (int i = 0; i < R; ++i)
      y[i * ldy + o] = q4_row_dot(codes + o * nb * 16, d + o * nb, m + o * nb, x + i * K, xs + i * nb, nb);
}

// One activation row (decode).
void q4_rows_single(const float* x, int64_t K, const uint8_t* codes, const float* d, const float* m,
                    const float* xs, float* y, int64_t row_begin, int64_t row_end) {
  q4_rows_each<1>(x, K, codes, d, m, xs, y, 0, row_begin, row_end);
}

#if defined(KVMEMORY_AVX512)
// R activation rows (1 <= R <= 8) against P output rows from o (P = 2 share the activation loads):
// each block is dequantized once (w = d * q + m, one rounding) and multiplied with every row.
// Few rows keep separate accumulators for the low and high halves (2PR independent FMA chains);
// from 5 rows (P = 2) one per row and output row, so that every accumulator stays in one of the
// 32 vector registers (2 * 2 * 8 would spill to the stack: 8 rows cost 2.3x 4 rows before).
template <int R, int P>
void q4_pair(const float* x, int64_t K, const uint8_t* codes, const float* d, const float* m, float* y,
             int64_t ldy, int64_t o) {
  constexpr int A = 2 * P * R <= 16 ? 2 : 1;  // accumulators per (output row, activation row)
  const int64_t nb = K / kBlock;
  const __m512i low4 = _mm512_set1_epi32(0xF);
  __m512 acc[P][R][A];
  for (int r = 0; r < P; ++r)
    for (int i = 0; i < R; ++i)
      for (int a = 0; a < A; ++a) acc[r][i][a] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    __m512 lo[P], hi[P];
    for (int r = 0; r < P; ++r) {
      const int64_t row = o + r;
      const __m512i bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + (row * nb + b) * 16)));
      const __m512 scale = _mm512_set1_ps(d[row * nb + b]), low = _mm512_set1_ps(m[row * nb + b]);
      lo[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_and_si512(bytes, low4)), scale, low);
      hi[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32(bytes, 4)), scale, low);
    }
    for (int i = 0; i < R; ++i) {
      const __m512 x0 = _mm512_loadu_ps(x + i * K + b * kBlock), x1 = _mm512_loadu_ps(x + i * K + b * kBlock + 16);
      for (int r = 0; r < P; ++r) {
        acc[r][i][0] = _mm512_fmadd_ps(lo[r], x0, acc[r][i][0]);
        acc[r][i][A - 1] = _mm512_fmadd_ps(hi[r], x1, acc[r][i][A - 1]);
      }
    }
  }
  for (int r = 0; r < P; ++r)
    for (int i = 0; i < R; ++i)
      y[i * ldy + o + r] = hsum(A == 2 ? _mm512_add_ps(acc[r][i][0], acc[r][i][A - 1]) : acc[r][i][0]);
}

template <int R>
void q4_rows_r(const float* x, int64_t K, const uint8_t* codes, const float* d, const float* m, float* y,
               int64_t ldy, int64_t row_begin, int64_t row_end) {
  int64_t o = row_begin;
  for (; o + 2 <= row_end; o += 2) q4_pair<R, 2>(x, K, codes, d, m, y, ldy, o);
  if (o < row_end) q4_pair<R, 1>(x, K, codes, d, m, y, ldy, o);
}
#elif defined(KVMEMORY_AVX2)
// q4_pair above in 256-bit vectors, with 16 registers: each block is dequantized 8 weights at a
// time (part c, see q4_codes8) for P output rows and multiplied with the matching 8 values of
// every activation row. Accumulators: P * R * A; A = 2 (alternating parts) only while that leaves
// registers for the P weight vectors and their scale / min broadcasts.
template <int R, int P>
void q4_pair(const float* x, int64_t K, const uint8_t* codes, const float* d, const float* m, float* y,
             int64_t ldy, int64_t o) {
  constexpr int A = P * R <= 4 ? 2 : 1;
  const int64_t nb = K / kBlock;
  __m256 acc[P][R][A];
  for (int r = 0; r < P; ++r)
    for (int i = 0; i < R; ++i)
      for (int a = 0; a < A; ++a) acc[r][i][a] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    for (int c = 0; c < 4; ++c) {
      __m256 w[P];
      for (int r = 0; r < P; ++r) {
        const int64_t at = (o + r) * nb + b;
        w[r] = _mm256_fmadd_ps(q4_codes8(codes + at * 16, c), _mm256_set1_ps(d[at]), _mm256_set1_ps(m[at]));
      }
      for (int i = 0; i < R; ++i) {
        const __m256 xi = _mm256_loadu_ps(x + i * K + b * kBlock + c * 8);
        for (int r = 0; r < P; ++r) acc[r][i][c % A] = _mm256_fmadd_ps(w[r], xi, acc[r][i][c % A]);
      }
    }
  }
  for (int r = 0; r < P; ++r)
    for (int i = 0; i < R; ++i)
      y[i * ldy + o + r] = hsum(A == 2 ? _mm256_add_ps(acc[r][i][0], acc[r][i][A - 1]) : acc[r][i][0]);
}

// Two output rows per pass up to 4 activation rows (their accumulators fit); one beyond.
template <int R>
void q4_rows_r(const float* x, int64_t K, const uint8_t* codes, const float* d, const float* m, float* y,
               int64_t ldy, int64_t row_begin, int64_t row_end) {
  constexpr int P = R <= 4 ? 2 : 1;
  int64_t o = row_begin;
  for (; o + P <= row_end; o += P) q4_pair<R, P>(x, K, codes, d, m, y, ldy, o);
  if (o < row_end) q4_pair<R, 1>(x, K, codes, d, m, y, ldy, o);
}
#endif

// Several activation rows (M >= 2), up to 8 at a time.
void q4_rows(const float* x, int64_t M, int64_t K, const uint8_t* codes, const float* d, const float* m,
             const float* xs, float* y, int64_t N, int64_t row_begin, int64_t row_end) {
  const int64_t nb = K / kBlock;
#if defined(KVMEMORY_SIMD)
  for (int64_t m0 = 0; m0 < M; m0 += kMaxM) {
    const float* xm = x + m0 * K;
    float* ym = y + m0 * N;
    with_count<kMaxM>(M - m0, [&](auto rows) {
      q4_rows_r<decltype(rows)::value>(xm, K, codes, d, m, ym, N, row_begin, row_end);
    });
  }
  return;
#endif
  for (int64_t o = row_begin; o < row_end; ++o) {  // portable path: the factored form
    for (int64_t i = 0; i < M; ++i) {
      y[i * N + o] = q4_row_dot(codes + o * nb * 16, d + o * nb, m + o * nb, x + i * K, xs + i * nb, nb);
    }
  }
}

// One fp16 weight row (an F16 linear: the file's values, no blocks) times x [K], fp32 products and
// sums in one fixed order per build, so every path (one row, several rows, batched) agrees.
inline float f16_row_dot(const at::Half* w, const float* x, int64_t K) {
  int64_t j = 0;
  float total = 0.f;
#if defined(KVMEMORY_AVX512)
  __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps();
  for (; j + 32 <= K; j += 32) {
    a0 = _mm512_fmadd_ps(_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + j))),
                         _mm512_loadu_ps(x + j), a0);
    a1 = _mm512_fmadd_ps(_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + j + 16))),
                         _mm512_loadu_ps(x + j + 16), a1);
  }
  total = hsum(_mm512_add_ps(a0, a1));
#elif defined(KVMEMORY_AVX2)
  __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
  for (; j + 16 <= K; j += 16) {
    a0 = _mm256_fmadd_ps(_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + j))),
                         _mm256_loadu_ps(x + j), a0);
    a1 = _mm256_fmadd_ps(_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + j + 8))),
                         _mm256_loadu_ps(x + j + 8), a1);
  }
  total = hsum(_mm256_add_ps(a0, a1));
#endif
  for (; j < K; ++j) total += float(w[j]) * x[j];
  return total;
}

// Portable dot of one byte-code row with x: nb blocks of `block` weights (32, or 16 for Q6_K),
// one scale each. The SIMD kernels' remainder rows and the portable build use it.
inline float q8_row_dot(const int8_t* q, const float* d, const float* x, int64_t nb, int64_t block) {
  float total = 0.f;
  for (int64_t b = 0; b < nb; ++b) {
    float dot = 0.f;
    for (int64_t j = 0; j < block; ++j) dot += float(q[b * block + j]) * x[b * block + j];
    total += d[b] * dot;
  }
  return total;
}

// The byte-code decode kernel for R activation rows at once (see q4_rows_each).
template <int R>
void q8_rows_each(const float* x, int64_t K, const int8_t* codes, const float* d, float* y, int64_t ldy,
                  int64_t row_begin, int64_t row_end) {
  const int64_t nb = K / kBlock;
  int64_t o = row_begin;
#if defined(KVMEMORY_AVX512)
  for (; o + 4 <= row_end; o += 4) {
    __m512 acc[4][R];
    for (int r = 0; r < 4; ++r)
      for (int i = 0; i < R; ++i) acc[r][i] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; ++b) {
      __m512 x0[R], x1[R];
      for (int i = 0; i < R; ++i) {
        x0[i] = _mm512_loadu_ps(x + i * K + b * kBlock);
        x1[i] = _mm512_loadu_ps(x + i * K + b * kBlock + 16);
      }
      if ((b & 7) == 0) _mm_prefetch(reinterpret_cast<const char*>(d + (o + kPrefetchRows) * nb + b), _MM_HINT_T0);
      for (int r = 0; r < 4; ++r) {
        const int8_t* q = codes + (o + r) * K + b * kBlock;
        if ((b & 1) == 0) _mm_prefetch(reinterpret_cast<const char*>(q + kPrefetchRows * K), _MM_HINT_T0);
        const __m512 a = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q))));
        const __m512 c = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + 16))));
        const __m512 scale = _mm512_set1_ps(d[(o + r) * nb + b]);
        for (int i = 0; i < R; ++i) {
          __m512 t = _mm512_mul_ps(a, x0[i]);
          t = _mm512_fmadd_ps(c, x1[i], t);
          acc[r][i] = _mm512_fmadd_ps(scale, t, acc[r][i]);
        }
      }
    }
    for (int r = 0; r < 4; ++r)
      for (int i = 0; i < R; ++i) y[i * ldy + o + r] = hsum(acc[r][i]);
  }
#elif defined(KVMEMORY_AVX2)
  for (; o + 4 <= row_end; o += 4) {
    __m256 acc[4][R];
    for (int r = 0; r < 4; ++r)
      for (int i = 0; i < R; ++i) acc[r][i] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; ++b) {
      if ((b & 7) == 0) _mm_prefetch(reinterpret_cast<const char*>(d + (o + kPrefetchRows) * nb + b), _MM_HINT_T0);
      for (int r = 0; r < 4; ++r) {
        const int8_t* q = codes + (o + r) * K + b * kBlock;
        if ((b & 1) == 0) _mm_prefetch(reinterpret_cast<const char*>(q + kPrefetchRows * K), _MM_HINT_T0);
        const __m256 c0 = q8_codes8(q), c1 = q8_codes8(q + 8), c2 = q8_codes8(q + 16), c3 = q8_codes8(q + 24);
        const __m256 scale = _mm256_set1_ps(d[(o + r) * nb + b]);
        for (int i = 0; i < R; ++i) {
          const float* xb = x + i * K + b * kBlock;
          __m256 t = _mm256_mul_ps(c0, _mm256_loadu_ps(xb));
          t = _mm256_fmadd_ps(c1, _mm256_loadu_ps(xb + 8), t);
          t = _mm256_fmadd_ps(c2, _mm256_loadu_ps(xb + 16), t);
          t = _mm256_fmadd_ps(c3, _mm256_loadu_ps(xb + 24), t);
          acc[r][i] = _mm256_fmadd_ps(scale, t, acc[r][i]);
        }
      }
    }
    for (int r = 0; r < 4; ++r)
      for (int i = 0; i < R; ++i) y[i * ldy + o + r] = hsum(acc[r][i]);
  }
#endif
  for (; o < row_end; ++o)
    for (int i = 0; i < R; ++i) y[i * ldy + o] = q8_row_dot(codes + o * K, d + o * nb, x + i * K, nb, kBlock);
}

void q8_rows_single(const float* x, int64_t K, const int8_t* codes, const float* d, float* y,
                    int64_t row_begin, int64_t row_end) {
  q8_rows_each<1>(x, K, codes, d, y, 0, row_begin, row_end);
}

void q8_rows(const float* x, int64_t M, int64_t K, const int8_t* codes, const float* d, float* y, int64_t N,
             int64_t row_begin, int64_t row_end) {
  const int64_t nb = K / kBlock;
  for (int64_t o = row_begin; o < row_end; ++o) {
    const int8_t* q = codes + o * K;
    const float* dr = d + o * nb;
    for (int64_t m0 = 0; m0 < M; m0 += kMaxM) {
      const int64_t mc = std::min(kMaxM, M - m0);
#if defined(KVMEMORY_AVX512)
      __m512 acc[kMaxM];
      for (int64_t i = 0; i < mc; ++i) acc[i] = _mm512_setzero_ps();
      for (int64_t b = 0; b < nb; ++b) {
        const __m512 a = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + b * kBlock))));
        const __m512 c = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + b * kBlock + 16))));
        const __m512 scale = _mm512_set1_ps(dr[b]);
        for (int64_t i = 0; i < mc; ++i) {
          const float* xb = x + (m0 + i) * K + b * kBlock;
          __m512 t = _mm512_mul_ps(a, _mm512_loadu_ps(xb));
          t = _mm512_fmadd_ps(c, _mm512_loadu_ps(xb + 16), t);
          acc[i] = _mm512_fmadd_ps(scale, t, acc[i]);
        }
      }
      for (int64_t i = 0; i < mc; ++i) y[(m0 + i) * N + o] = hsum(acc[i]);
#elif defined(KVMEMORY_AVX2)
      __m256 acc[kMaxM];
      for (int64_t i = 0; i < mc; ++i) acc[i] = _mm256_setzero_ps();
      for (int64_t b = 0; b < nb; ++b) {
        const int8_t* qb = q + b * kBlock;
        const __m256 a0 = q8_codes8(qb), a1 = q8_codes8(qb + 8), a2 = q8_codes8(qb + 16), a3 = q8_codes8(qb + 24);
        const __m256 scale = _mm256_set1_ps(dr[b]);
        for (int64_t i = 0; i < mc; ++i) {
          const float* xb = x + (m0 + i) * K + b * kBlock;
          __m256 t = _mm256_mul_ps(a0, _mm256_loadu_ps(xb));
          t = _mm256_fmadd_ps(a1, _mm256_loadu_ps(xb + 8), t);
          t = _mm256_fmadd_ps(a2, _mm256_loadu_ps(xb + 16), t);
          t = _mm256_fmadd_ps(a3, _mm256_loadu_ps(xb + 24), t);
          acc[i] = _mm256_fmadd_ps(scale, t, acc[i]);
        }
      }
      for (int64_t i = 0; i < mc; ++i) y[(m0 + i) * N + o] = hsum(acc[i]);
#else
      for (int64_t i = 0; i < mc; ++i) y[(m0 + i) * N + o] = q8_row_dot(q, dr, x + (m0 + i) * K, nb, kBlock);
#endif
    }
  }
}

// Q8 codes with one scale per 16 weights (w_j = d * q_j): Q6_K's layout (16-value sub-blocks,
// each with its own scale) read exactly, its 6-bit codes widened to signed bytes. Same loop
// shapes as the Q8_0 kernels above, one scale per 16 lanes.
constexpr int64_t kHalf = 16;

// The decode kernel of byte codes with a scale per 16 values, R activation rows at once (see
// q4_rows_each). AVX-512 scales each block's codes once for all R rows (w = d * q), so a row
// costs one FMA per 16 weights.
template <int R>
void q8_16_rows_each(const float* x, int64_t K, const int8_t* codes, const float* d, float* y, int64_t ldy,
                     int64_t row_begin, int64_t row_end) {
  const int64_t nb = K / kHalf;
  int64_t o = row_begin;
#if defined(KVMEMORY_AVX512)
  for (; o + 4 <= row_end; o += 4) {
    __m512 acc[4][R];
    for (int r = 0; r < 4; ++r)
      for (int i = 0; i < R; ++i) acc[r][i] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; ++b) {
      __m512 xb[R];
      for (int i = 0; i < R; ++i) xb[i] = _mm512_loadu_ps(x + i * K + b * kHalf);
      if ((b & 15) == 0) _mm_prefetch(reinterpret_cast<const char*>(d + (o + kPrefetchRows) * nb + b), _MM_HINT_T0);
      for (int r = 0; r < 4; ++r) {
        const int8_t* q = codes + (o + r) * K + b * kHalf;
        if ((b & 3) == 0) _mm_prefetch(reinterpret_cast<const char*>(q + kPrefetchRows * K), _MM_HINT_T0);
        const __m512 w = _mm512_mul_ps(_mm512_set1_ps(d[(o + r) * nb + b]),
                                       _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q)))));
        for (int i = 0; i < R; ++i) acc[r][i] = _mm512_fmadd_ps(w, xb[i], acc[r][i]);
      }
    }
    for (int r = 0; r < 4; ++r)
      for (int i = 0; i < R; ++i) y[i * ldy + o + r] = hsum(acc[r][i]);
  }
#elif defined(KVMEMORY_AVX2)
  for (; o + 4 <= row_end; o += 4) {
    __m256 acc[4][R];
    for (int r = 0; r < 4; ++r)
      for (int i = 0; i < R; ++i) acc[r][i] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; ++b) {
      for (int r = 0; r < 4; ++r) {
        const int8_t* q = codes + (o + r) * K + b * kHalf;
        const __m256 c0 = q8_codes8(q), c1 = q8_codes8(q + 8);
        const __m256 scale = _mm256_set1_ps(d[(o + r) * nb + b]);
        for (int i = 0; i < R; ++i) {
          const float* xb = x + i * K + b * kHalf;
          const __m256 t = _mm256_fmadd_ps(c1, _mm256_loadu_ps(xb + 8), _mm256_mul_ps(c0, _mm256_loadu_ps(xb)));
          acc[r][i] = _mm256_fmadd_ps(scale, t, acc[r][i]);
        }
      }
    }
    for (int r = 0; r < 4; ++r)
      for (int i = 0; i < R; ++i) y[i * ldy + o + r] = hsum(acc[r][i]);
  }
#endif
  for (; o < row_end; ++o)
    for (int i = 0; i < R; ++i) y[i * ldy + o] = q8_row_dot(codes + o * K, d + o * nb, x + i * K, nb, kHalf);
}

void q8_16_rows_single(const float* x, int64_t K, const int8_t* codes, const float* d, float* y,
                       int64_t row_begin, int64_t row_end) {
  q8_16_rows_each<1>(x, K, codes, d, y, 0, row_begin, row_end);
}

void q8_16_rows(const float* x, int64_t M, int64_t K, const int8_t* codes, const float* d, float* y, int64_t N,
                int64_t row_begin, int64_t row_end) {
  const int64_t nb = K / kHalf;
  for (int64_t o = row_begin; o < row_end; ++o) {
    const int8_t* q = codes + o * K;
    const float* dr = d + o * nb;
    for (int64_t m0 = 0; m0 < M; m0 += kMaxM) {
      const int64_t mc = std::min(kMaxM, M - m0);
#if defined(KVMEMORY_AVX512)
      __m512 acc[kMaxM];
      for (int64_t i = 0; i < mc; ++i) acc[i] = _mm512_setzero_ps();
      for (int64_t b = 0; b < nb; ++b) {
        const __m512 a = _mm512_mul_ps(
            _mm512_set1_ps(dr[b]),
            _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + b * kHalf)))));
        for (int64_t i = 0; i < mc; ++i) acc[i] = _mm512_fmadd_ps(a, _mm512_loadu_ps(x + (m0 + i) * K + b * kHalf), acc[i]);
      }
      for (int64_t i = 0; i < mc; ++i) y[(m0 + i) * N + o] = hsum(acc[i]);
#elif defined(KVMEMORY_AVX2)
      __m256 acc[kMaxM];
      for (int64_t i = 0; i < mc; ++i) acc[i] = _mm256_setzero_ps();
      for (int64_t b = 0; b < nb; ++b) {
        const __m256 scale = _mm256_set1_ps(dr[b]);
        const __m256 a0 = _mm256_mul_ps(scale, q8_codes8(q + b * kHalf)), a1 = _mm256_mul_ps(scale, q8_codes8(q + b * kHalf + 8));
        for (int64_t i = 0; i < mc; ++i) {
          const float* xb = x + (m0 + i) * K + b * kHalf;
          acc[i] = _mm256_fmadd_ps(a1, _mm256_loadu_ps(xb + 8), _mm256_fmadd_ps(a0, _mm256_loadu_ps(xb), acc[i]));
        }
      }
      for (int64_t i = 0; i < mc; ++i) y[(m0 + i) * N + o] = hsum(acc[i]);
#else
      for (int64_t i = 0; i < mc; ++i) y[(m0 + i) * N + o] = q8_row_dot(q, dr, x + (m0 + i) * K, nb, kHalf);
#endif
    }
  }
}

// ---------------------------------------------------------------------------------------------
// int8 activations (opt-in, lossy like llama.cpp): each 32-value block of an activation row is
// quantized once per linear input to signed bytes a_j with one fp32 scale e (x_j ~ e * a_j,
// e = max|x| / 127, round to nearest), and the weights' codes are multiplied with it by VNNI
// integer dot products (_mm512_dpbusd_epi32: 64 unsigned x signed byte products per instruction):
//   Q4_1:  y = sum_blocks d * e * (q . a) + m * sum(x_block)     (the min term keeps exact fp32 sums)
//   Q8_0:  y = sum_blocks d * e * (q . a)                          (q + 128 as unsigned bytes, the
//                                                                   offset 128 * sum(a) subtracted)
// The only error against the fp32 path is the rounding of x to 8 bits per block (|x - e a| <= e / 2).

#if defined(__AVX512F__) && defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define KVMEMORY_VNNI 1
#endif

constexpr int64_t kGroup = 4;  // Q4_1 blocks per 512-bit step (64 code bytes = 128 weights)

inline int64_t q4_groups(int64_t K) { return (K / kBlock + kGroup - 1) / kGroup; }

// One activation row quantized for Q4_1 weights. Per group of 4 blocks: 64 bytes holding values
// 0..15 of each block (they meet the low nibbles), then 64 bytes holding values 16..31 (the high
// nibbles); `scales` repeats each block's e over its 4 dot-product lanes (16 floats per group);
// `sums` holds each block's exact fp32 sum. Missing blocks of the last group are zero.
struct Q4Activation {
  std::vector<int8_t> codes;
  std::vector<float> scales, sums;
};

// One activation row quantized for Q8_0 weights. Per pair of blocks: the 64 bytes in order;
// `scales` repeats each block's e over its 8 lanes; `offsets` holds 128 * (sum of the 4 bytes of
// each lane), what the unsigned form of the weights adds to each lane.
struct Q8Activation {
  std::vector<int8_t> codes;
  std::vector<float> scales;
  std::vector<int32_t> offsets;
};

// Quantize one 32-value block: writes the bytes to `out` (in order) and returns its scale e;
// `total` gets the block's fp32 sum.
inline float quantize_block(const float* x, int8_t* out, float* total) {
#if defined(__AVX512F__)
  const __m512 x0 = _mm512_loadu_ps(x), x1 = _mm512_loadu_ps(x + 16);
  const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(x0), _mm512_abs_ps(x1)));
  const float e = amax / 127.f;
  const __m512 inv = _mm512_set1_ps(e > 0.f ? 1.f / e : 0.f);
  // cvtps rounds to nearest even (the default rounding mode), as std::nearbyint does
  _mm_storeu_si128(reinterpret_cast<__m128i*>(out), _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(_mm512_mul_ps(x0, inv))));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(out + 16), _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(_mm512_mul_ps(x1, inv))));
  *total = _mm512_reduce_add_ps(_mm512_add_ps(x0, x1));
  return e;
#else
  float amax = 0.f, sum = 0.f;
  for (int64_t j = 0; j < kBlock; ++j) amax = std::max(amax, std::fabs(x[j]));
  const float e = amax / 127.f;
  const float inv = e > 0.f ? 1.f / e : 0.f;
  for (int64_t j = 0; j < kBlock; ++j) {
    out[j] = static_cast<int8_t>(std::nearbyint(x[j] * inv));
    sum += x[j];
  }
  *total = sum;
  return e;
#endif
}

void quantize_for_q4(const float* x, int64_t K, Q4Activation& a) {
  const int64_t nb = K / kBlock, groups = q4_groups(K);
  a.codes.assign(groups * 128, 0);
  a.scales.assign(groups * 16, 0.f);
  a.sums.assign(nb, 0.f);
  int8_t block[kBlock];
  for (int64_t b = 0; b < nb; ++b) {
    const float e = quantize_block(x + b * kBlock, block, &a.sums[b]);
    const int64_t g = b / kGroup, slot = b % kGroup;
    std::copy(block, block + 16, a.codes.begin() + g * 128 + slot * 16);
    std::copy(block + 16, block + 32, a.codes.begin() + g * 128 + 64 + slot * 16);
    std::fill(a.scales.begin() + g * 16 + slot * 4, a.scales.begin() + g * 16 + slot * 4 + 4, e);
  }
}

void quantize_for_q8(const float* x, int64_t K, Q8Activation& a) {
  const int64_t nb = K / kBlock, pairs = (nb + 1) / 2;
  a.codes.assign(pairs * 64, 0);
  a.scales.assign(pairs * 16, 0.f);
  a.offsets.assign(pairs * 16, 0);
  for (int64_t b = 0; b < nb; ++b) {
    float unused;
    const float e = quantize_block(x + b * kBlock, a.codes.data() + b * kBlock, &unused);
    std::fill(a.scales.begin() + b * 8, a.scales.begin() + b * 8 + 8, e);
  }
  for (int64_t lane = 0; lane < pairs * 16; ++lane) {
    int32_t total = 0;
    for (int j = 0; j < 4; ++j) total += a.codes[lane * 4 + j];
    a.offsets[lane] = 128 * total;
  }
}

#if defined(KVMEMORY_VNNI)
// Rows [row_begin, row_end) of y = x . W^T for R activation rows (R <= kMaxM) quantized in `acts`.
// Each 64-byte step of a weight row is unpacked once and multiplied with every activation row.
template <int R>
void q4_rows_i8(const Q4Activation* acts, int64_t K, const uint8_t* codes, const float* d, const float* m,
                float* y, int64_t ldy, int64_t row_begin, int64_t row_end) {
  const int64_t nb = K / kBlock, groups = q4_groups(K);
  const __m512i low4 = _mm512_set1_epi8(0x0F);
  const __m512i spread = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
  for (int64_t o = row_begin; o < row_end; ++o) {
    const uint8_t* q = codes + o * nb * 16;
    const float* dr = d + o * nb;
    __m512 acc[R];
    for (int i = 0; i < R; ++i) acc[i] = _mm512_setzero_ps();
    for (int64_t g = 0; g < groups; ++g) {
      const int64_t blocks = std::min<int64_t>(kGroup, nb - g * kGroup);
      const __mmask64 bytes_mask = blocks == kGroup ? ~__mmask64(0) : ((__mmask64(1) << (16 * blocks)) - 1);
      const __m512i c = _mm512_maskz_loadu_epi8(bytes_mask, q + g * 64);
      const __m512i lo = _mm512_and_si512(c, low4);
      const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(c, 4), low4);
      const __m512 dw = _mm512_permutexvar_ps(
          spread, _mm512_castps128_ps512(_mm_maskz_loadu_ps(__mmask8((1 << blocks) - 1), dr + g * kGroup)));
      for (int i = 0; i < R; ++i) {
        const int8_t* ac = acts[i].codes.data() + g * 128;
        __m512i t = _mm512_dpbusd_epi32(_mm512_setzero_si512(), lo, _mm512_loadu_si512(ac));
        t = _mm512_dpbusd_epi32(t, hi, _mm512_loadu_si512(ac + 64));
        const __m512 scale = _mm512_mul_ps(dw, _mm512_loadu_ps(acts[i].scales.data() + g * 16));
        acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(t), scale, acc[i]);
      }
    }
    const float* mr = m + o * nb;
    for (int i = 0; i < R; ++i) {
      float mins = 0.f;
      for (int64_t b = 0; b < nb; ++b) mins += mr[b] * acts[i].sums[b];
      y[i * ldy + o] = _mm512_reduce_add_ps(acc[i]) + mins;
    }
  }
}

// One activation row, four weight rows per step (they share the activation loads).
void q4_rows_i8_single(const Q4Activation& a, int64_t K, const uint8_t* codes, const float* d, const float* m,
                       float* y, int64_t row_begin, int64_t row_end) {
  const int64_t nb = K / kBlock, groups = q4_groups(K);
  const __m512i low4 = _mm512_set1_epi8(0x0F);
  const __m512i spread = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
  int64_t o = row_begin;
  for (; o + 4 <= row_end; o += 4) {
    __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
    for (int64_t g = 0; g < groups; ++g) {
      const int64_t blocks = std::min<int64_t>(kGroup, nb - g * kGroup);
      const __mmask64 bytes_mask = blocks == kGroup ? ~__mmask64(0) : ((__mmask64(1) << (16 * blocks)) - 1);
      const __mmask8 scale_mask = __mmask8((1 << blocks) - 1);
      const __m512i a_lo = _mm512_loadu_si512(a.codes.data() + g * 128);
      const __m512i a_hi = _mm512_loadu_si512(a.codes.data() + g * 128 + 64);
      const __m512 e = _mm512_loadu_ps(a.scales.data() + g * 16);
      _mm_prefetch(reinterpret_cast<const char*>(d + (o + kPrefetchRows) * nb + g * 16), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(m + (o + kPrefetchRows) * nb + g * 16), _MM_HINT_T0);
      for (int r = 0; r < 4; ++r) {
        const int64_t row = o + r;
        _mm_prefetch(reinterpret_cast<const char*>(codes + (row + kPrefetchRows) * nb * 16 + g * 64), _MM_HINT_T0);
        const __m512i c = _mm512_maskz_loadu_epi8(bytes_mask, codes + row * nb * 16 + g * 64);
        __m512i t = _mm512_dpbusd_epi32(_mm512_setzero_si512(), _mm512_and_si512(c, low4), a_lo);
        t = _mm512_dpbusd_epi32(t, _mm512_and_si512(_mm512_srli_epi16(c, 4), low4), a_hi);
        const __m512 dw = _mm512_permutexvar_ps(
            spread, _mm512_castps128_ps512(_mm_maskz_loadu_ps(scale_mask, d + row * nb + g * kGroup)));
        acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(t), _mm512_mul_ps(dw, e), acc[r]);
      }
    }
    for (int r = 0; r < 4; ++r) {
      const float* mr = m + (o + r) * nb;
      float mins = 0.f;
      for (int64_t b = 0; b < nb; ++b) mins += mr[b] * a.sums[b];
      y[o + r] = _mm512_reduce_add_ps(acc[r]) + mins;
    }
  }
  if (o < row_end) q4_rows_i8<1>(&a, K, codes, d, m, y, 0, o, row_end);
}

// Rows [row_begin, row_end) of y = x . W^T for one activation row against Q8_0 codes.
void q8_rows_i8_single(const Q8Activation& a, int64_t K, const int8_t* codes, const float* d, float* y,
                       int64_t row_begin, int64_t row_end) {
  const int64_t nb = K / kBlock, pairs = (nb + 1) / 2;
  const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
  const __m512i spread = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
  int64_t o = row_begin;
  auto step = [&](int64_t row, int64_t p, const __m512i& ac, const __m512i& off, const __m512& e, __m512& acc) {
    const int64_t blocks = std::min<int64_t>(2, nb - p * 2);
    const __mmask64 bytes_mask = blocks == 2 ? ~__mmask64(0) : ((__mmask64(1) << 32) - 1);
    // q + 128 as an unsigned byte (a missing block's bytes are zero: the activation there is zero too)
    const __m512i c = _mm512_xor_si512(_mm512_maskz_loadu_epi8(bytes_mask, codes + row * K + p * 64), flip);
    const __m512i t = _mm512_sub_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), c, ac), off);
    const __m512 dw = _mm512_permutexvar_ps(
        spread, _mm512_castps128_ps512(_mm_maskz_loadu_ps(__mmask8((1 << blocks) - 1), d + row * nb + p * 2)));
    acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(t), _mm512_mul_ps(dw, e), acc);
  };
  for (; o + 4 <= row_end; o += 4) {
    __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
    for (int64_t p = 0; p < pairs; ++p) {
      const __m512i ac = _mm512_loadu_si512(a.codes.data() + p * 64);
      const __m512i off = _mm512_loadu_si512(a.offsets.data() + p * 16);
      const __m512 e = _mm512_loadu_ps(a.scales.data() + p * 16);
      for (int r = 0; r < 4; ++r) {
        // the head is read once per token from memory: ask for rows well ahead of use
        _mm_prefetch(reinterpret_cast<const char*>(codes + (o + r + kPrefetchRows) * K + p * 64), _MM_HINT_T0);
        step(o + r, p, ac, off, e, acc[r]);
      }
      _mm_prefetch(reinterpret_cast<const char*>(d + (o + kPrefetchRows) * nb + p * 8), _MM_HINT_T0);
    }
    for (int r = 0; r < 4; ++r) y[o + r] = _mm512_reduce_add_ps(acc[r]);
  }
  for (; o < row_end; ++o) {
    __m512 acc = _mm512_setzero_ps();
    for (int64_t p = 0; p < pairs; ++p) {
      step(o, p, _mm512_loadu_si512(a.codes.data() + p * 64), _mm512_loadu_si512(a.offsets.data() + p * 16),
           _mm512_loadu_ps(a.scales.data() + p * 16), acc);
    }
    y[o] = _mm512_reduce_add_ps(acc);
  }
}
#endif

}  // namespace

bool has_vnni() {
#if defined(KVMEMORY_VNNI)
  return true;
#else
  return false;
#endif
}

// Output rows [row_begin, row_end) of a block weight as dense fp32 [rows, K]: the values
// FusedBlocks.dequantize() gives (w = d * q + m for 4-bit codes and for byte codes with mins,
// w = d * q for byte codes without, one scale per K / d.size(1) values), bit for bit: the product and the sum are rounded separately
// (no contraction into an FMA). The engine's long inputs run on such copies, made per call, when
// the model's dense weights were released.
#pragma GCC push_options
#pragma GCC optimize("O3", "fp-contract=off")
// ``out``: a contiguous fp32 buffer of at least rows * K values to write into (reused across
// calls: a fresh allocation of a large weight costs more in page faults than the dequantization),
// or an empty tensor for a new one.
torch::Tensor dequantize_rows(torch::Tensor codes, torch::Tensor d, torch::Tensor m, int64_t row_begin, int64_t row_end,
                              torch::Tensor out) {
  if (codes.scalar_type() == torch::kHalf) {  // an F16 linear: its values, converted exactly
    TORCH_CHECK(codes.dim() == 2 && 0 <= row_begin && row_begin <= row_end && row_end <= codes.size(0), "rows out of range");
    const int64_t K = codes.size(1);
    auto rows = codes.narrow(0, row_begin, row_end - row_begin);
    if (out.numel() == 0) return rows.to(torch::kFloat32);
    TORCH_CHECK(out.scalar_type() == torch::kFloat32 && out.is_contiguous() && out.numel() >= (row_end - row_begin) * K,
                "out must be a contiguous fp32 buffer of at least rows * in values");
    return out.view(-1).narrow(0, 0, (row_end - row_begin) * K).view({row_end - row_begin, K}).copy_(rows);
  }
  TORCH_CHECK(d.dim() == 2 && d.scalar_type() == torch::kFloat32 && d.is_contiguous() && codes.is_contiguous(),
              "scales must be contiguous fp32 [out, blocks], codes contiguous");
  TORCH_CHECK(0 <= row_begin && row_begin <= row_end && row_end <= d.size(0), "rows out of range");
  const bool four_bit = codes.scalar_type() == torch::kUInt8, byte_mins = !four_bit && m.numel() > 0;
  const int64_t nb = d.size(1), K = four_bit ? nb * kBlock : codes.size(1), block = K / nb;
  if (out.numel() == 0) {
    out = torch::empty({row_end - row_begin, K}, d.options());
  } else {
    TORCH_CHECK(out.scalar_type() == torch::kFloat32 && out.is_contiguous() && out.numel() >= (row_end - row_begin) * K,
                "out must be a contiguous fp32 buffer of at least rows * in values");
    out = out.view(-1).narrow(0, 0, (row_end - row_begin) * K).view({row_end - row_begin, K});
  }
  float* op = out.data_ptr<float>();
  const float* dp = d.data_ptr<float>();
  at::parallel_for(row_begin, row_end, kRowsPerTask, [&](int64_t begin, int64_t end) {
    for (int64_t o = begin; o < end; ++o) {
      float* w = op + (o - row_begin) * K;
      if (four_bit) {
        const uint8_t* q = codes.data_ptr<uint8_t>() + o * (K / 2);
        const float* mp = m.data_ptr<float>() + o * nb;
        for (int64_t b = 0; b < nb; ++b) {
#if defined(KVMEMORY_AVX512)
          const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + b * 16)), low4 = _mm_set1_epi8(0xF);
          const __m512 scale = _mm512_set1_ps(dp[o * nb + b]), min = _mm512_set1_ps(mp[b]);
          const __m512 low = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(bytes, low4)));
          const __m512 high = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(bytes, 4), low4)));
          _mm512_storeu_ps(w + b * kBlock, _mm512_add_ps(_mm512_mul_ps(low, scale), min));
          _mm512_storeu_ps(w + b * kBlock + 16, _mm512_add_ps(_mm512_mul_ps(high, scale), min));
          continue;
#endif
          for (int64_t j = 0; j < 16; ++j) {
            const float scale = dp[o * nb + b], low = float(q[b * 16 + j] & 0xF), high = float(q[b * 16 + j] >> 4);
            w[b * kBlock + j] = low * scale + mp[b];
            w[b * kBlock + 16 + j] = high * scale + mp[b];
          }
        }
      } else {
        const int8_t* q = codes.data_ptr<int8_t>() + o * K;
        for (int64_t b = 0; b < nb; ++b) {
          const float scale = dp[o * nb + b];
          int64_t j = b * block;
          const float min = byte_mins ? m.data_ptr<float>()[o * nb + b] : 0.f;
#if defined(KVMEMORY_AVX512)
          for (; j + 16 <= (b + 1) * block; j += 16) {
            const __m512 product = _mm512_mul_ps(
                _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + j)))),
                _mm512_set1_ps(scale));
            _mm512_storeu_ps(w + j, byte_mins ? _mm512_add_ps(product, _mm512_set1_ps(min)) : product);
          }
#endif
          // no "+ 0" without a min: it would turn a -0 weight into +0
          for (; j < (b + 1) * block; ++j) w[j] = byte_mins ? float(q[j]) * scale + min : float(q[j]) * scale;
        }
      }
    }
  });
  return out;
}
#pragma GCC pop_options

// The SIMD paths this build compiled ("avx512", "avx2" or "portable"): what its flags enabled.
std::string isa() {
#if defined(KVMEMORY_AVX512)
  return "avx512";
#elif defined(KVMEMORY_AVX2)
  return "avx2";
#else
  return "portable";
#endif
}

// x [M, K] fp32, codes uint8 [N, K/32*16], d / m fp32 [N, K/32] -> y [M, N] fp32, with x quantized
// to int8 per 32-value block (see above). Rows of x are taken up to kMaxM at a time.
torch::Tensor q4_1_linear_i8(torch::Tensor x, torch::Tensor codes, torch::Tensor d, torch::Tensor m) {
  check_inputs(x, codes, d, 16);
  TORCH_CHECK(codes.scalar_type() == torch::kUInt8, "Q4_1 codes must be uint8");
  TORCH_CHECK(m.sizes() == d.sizes() && m.is_contiguous() && m.scalar_type() == torch::kFloat32, "mins must match scales");
#if defined(KVMEMORY_VNNI)
  const int64_t M = x.size(0), K = x.size(1), N = codes.size(0);
  auto y = torch::empty({M, N}, x.options());
  std::vector<Q4Activation> acts(M);
  for (int64_t i = 0; i < M; ++i) quantize_for_q4(x.data_ptr<float>() + i * K, K, acts[i]);
  const uint8_t* qp = codes.data_ptr<uint8_t>();
  const float *dp = d.data_ptr<float>(), *mp = m.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, N, kRowsPerTask, [&](int64_t begin, int64_t end) {
    if (M == 1) {
      q4_rows_i8_single(acts[0], K, qp, dp, mp, yp, begin, end);
      return;
    }
    for (int64_t m0 = 0; m0 < M; m0 += kMaxM) {
      const Q4Activation* a = acts.data() + m0;
      float* ym = yp + m0 * N;
      with_count<kMaxM>(M - m0, [&](auto rows) {
        q4_rows_i8<decltype(rows)::value>(a, K, qp, dp, mp, ym, N, begin, end);
      });
    }
  });
  return y;
#else
  TORCH_CHECK(false, "int8 activations need AVX-512 VNNI (this build has none)");
#endif
}

// x [M, K] fp32, w fp16 [N, K] (an F16 linear) -> y [M, N] fp32, each value f16_row_dot's
torch::Tensor f16_linear(torch::Tensor x, torch::Tensor w) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32 && x.is_contiguous(), "x must be a contiguous fp32 [M, K] tensor");
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == torch::kHalf && w.is_contiguous() && w.size(1) == x.size(1),
              "an F16 weight must be a contiguous fp16 [N, K] tensor");
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  auto y = torch::empty({M, N}, x.options());
  const float* xp = x.data_ptr<float>();
  const at::Half* wp = w.data_ptr<at::Half>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, N, kRowsPerTask, [&](int64_t begin, int64_t end) {
    for (int64_t o = begin; o < end; ++o)
      for (int64_t i = 0; i < M; ++i) yp[i * N + o] = f16_row_dot(wp + o * K, xp + i * K, K);
  });
  return y;
}

// x [M, K] fp32, codes int8 [N, K], d fp32 [N, K/32] -> y [M, N] fp32 with x quantized to int8.
// Rows of x are taken one at a time (one pass over the codes each): the engine calls it for the
// last row only (the head).
torch::Tensor q8_0_linear_i8(torch::Tensor x, torch::Tensor codes, torch::Tensor d, torch::Tensor m) {
  check_inputs(x, codes, d, kBlock);
  TORCH_CHECK(codes.scalar_type() == torch::kInt8, "Q8_0 codes must be int8");
  check_byte_mins(m, d);
#if defined(KVMEMORY_VNNI)
  const int64_t M = x.size(0), K = x.size(1), N = codes.size(0), nb = K / kBlock;
  auto y = torch::empty({M, N}, x.options());
  auto xs = m.numel() > 0 ? block_sums(x) : torch::Tensor();
  const int8_t* qp = codes.data_ptr<int8_t>();
  const float* dp = d.data_ptr<float>();
  for (int64_t i = 0; i < M; ++i) {
    Q8Activation a;
    quantize_for_q8(x.data_ptr<float>() + i * K, K, a);
    float* yp = y.data_ptr<float>() + i * N;
    at::parallel_for(0, N, kRowsPerTask * 4, [&](int64_t begin, int64_t end) {
      q8_rows_i8_single(a, K, qp, dp, yp, begin, end);
      if (m.numel() > 0) add_min_terms(m.data_ptr<float>(), nb, xs.data_ptr<float>() + i * nb, yp, begin, end);
    });
  }
  return y;
#else
  TORCH_CHECK(false, "int8 activations need AVX-512 VNNI (this build has none)");
#endif
}

// x [M, K] fp32, codes uint8 [N, K/32*16], d / m fp32 [N, K/32] -> y [M, N] fp32
torch::Tensor q4_1_linear(torch::Tensor x, torch::Tensor codes, torch::Tensor d, torch::Tensor m) {
  check_inputs(x, codes, d, 16);
  TORCH_CHECK(codes.scalar_type() == torch::kUInt8, "Q4_1 codes must be uint8");
  TORCH_CHECK(m.sizes() == d.sizes() && m.is_contiguous() && m.scalar_type() == torch::kFloat32, "mins must match scales");
  const int64_t M = x.size(0), K = x.size(1), N = codes.size(0);
  auto y = torch::empty({M, N}, x.options());
  auto xs = block_sums(x);
  const float* xp = x.data_ptr<float>();
  const uint8_t* qp = codes.data_ptr<uint8_t>();
  const float *dp = d.data_ptr<float>(), *mp = m.data_ptr<float>(), *sp = xs.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, N, kRowsPerTask, [&](int64_t begin, int64_t end) {
    if (M == 1) {
      q4_rows_single(xp, K, qp, dp, mp, sp, yp, begin, end);
    } else {
      q4_rows(xp, M, K, qp, dp, mp, sp, yp, N, begin, end);
    }
  });
  return y;
}

// x [M, K] fp32, codes int8 [N, K], d fp32 [N, K/32] (Q8_0, Q5_0) or [N, K/16] (Q6_K), m fp32
// [N, K/32] (Q5_K) or empty -> y [M, N] fp32
torch::Tensor q8_0_linear(torch::Tensor x, torch::Tensor codes, torch::Tensor d, torch::Tensor m) {
  const bool halves = d.dim() == 2 && x.dim() == 2 && d.size(1) * kHalf == x.size(1);
  if (halves) {  // check_inputs on a [N, K/32] view of the shapes
    TORCH_CHECK(x.scalar_type() == torch::kFloat32 && x.is_contiguous(), "x must be a contiguous fp32 [M, K] tensor");
    TORCH_CHECK(codes.dim() == 2 && codes.is_contiguous() && codes.size(1) == x.size(1), "codes must be contiguous [N, K]");
    TORCH_CHECK(d.scalar_type() == torch::kFloat32 && d.is_contiguous() && d.size(0) == codes.size(0),
                "scales must be contiguous fp32 [N, K/16]");
  } else {
    check_inputs(x, codes, d, kBlock);
  }
  TORCH_CHECK(codes.scalar_type() == torch::kInt8, "Q8_0 codes must be int8");
  check_byte_mins(m, d);
  const int64_t M = x.size(0), K = x.size(1), N = codes.size(0), nb = K / kBlock;
  auto y = torch::empty({M, N}, x.options());
  auto xs = m.numel() > 0 ? block_sums(x) : torch::Tensor();
  const float* xp = x.data_ptr<float>();
  const int8_t* qp = codes.data_ptr<int8_t>();
  const float* dp = d.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, N, kRowsPerTask * 4, [&](int64_t begin, int64_t end) {
    if (halves) {
      if (M == 1) q8_16_rows_single(xp, K, qp, dp, yp, begin, end);
      else q8_16_rows(xp, M, K, qp, dp, yp, N, begin, end);
    } else if (M == 1) {
      q8_rows_single(xp, K, qp, dp, yp, begin, end);
    } else {
      q8_rows(xp, M, K, qp, dp, yp, N, begin, end);
    }
    if (m.numel() > 0)
      for (int64_t i = 0; i < M; ++i) add_min_terms(m.data_ptr<float>(), nb, xs.data_ptr<float>() + i * nb, yp + i * N, begin, end);
  });
  return y;
}

// ---------------------------------------------------------------------------------------------
// One decoded token through a whole Llama decoder in a single call (no per-op dispatch): the
// same computation as transformers' LlamaForCausalLM for one new row, on the blocks above.

namespace {

// One linear's weight in one of the kernels' two block forms: 4-bit codes with a scale and a min
// per 32 weights (uint8 codes: Q4_1, Q4_K, Q4_0 read exactly) or signed-byte codes with a scale
// per 32 or 16 weights (int8 codes: Q8_0, Q5_0, Q6_K with `mins` empty; Q5_K with a min per 32),
// or fp16 values without blocks (an F16 linear: `scales` and `mins` empty; fp32 activations only).
struct BlockWeight {
  torch::Tensor codes, scales, mins;
  bool q4() const { return codes.scalar_type() == torch::kUInt8; }
  bool f16() const { return codes.scalar_type() == torch::kHalf; }
  bool halves() const { return !q4() && !f16() && scales.size(1) * kHalf == codes.size(1); }
  bool byte_mins() const { return !q4() && !f16() && mins.defined() && mins.numel() > 0; }
  int64_t out() const { return codes.size(0); }
  // the byte form's min terms for output rows [b, e) of one activation row (block sums xs)
  void add_mins(int64_t K, const float* xs, float* y, int64_t b, int64_t e) const {
    if (byte_mins()) add_min_terms(mins.data_ptr<float>(), K / kBlock, xs, y, b, e);
  }
  // one row x [K] -> y [out]; xs: x's 32-value block sums (the Q4 form's factored min term).
  // int8: x is quantized first (see q4_1_linear_i8) into the scratch of its form
  void apply(const float* x, int64_t K, float* y, const float* xs, bool int8, Q4Activation& q4s, Q8Activation& q8s) const {
    if (f16()) {
      const at::Half* wp = codes.data_ptr<at::Half>();
      at::parallel_for(0, out(), kRowsPerTask, [&](int64_t b, int64_t e) {
        for (int64_t o = b; o < e; ++o) y[o] = f16_row_dot(wp + o * K, x, K);
      });
      return;
    }
    const float* dp = scales.data_ptr<float>();
    if (q4()) {
      const uint8_t* qp = codes.data_ptr<uint8_t>();
      const float* mp = mins.data_ptr<float>();
#if defined(KVMEMORY_VNNI)
      if (int8) {
        quantize_for_q4(x, K, q4s);
        at::parallel_for(0, out(), kRowsPerTask, [&](int64_t b, int64_t e) { q4_rows_i8_single(q4s, K, qp, dp, mp, y, b, e); });
        return;
      }
#endif
      at::parallel_for(0, out(), kRowsPerTask, [&](int64_t b, int64_t e) { q4_rows_single(x, K, qp, dp, mp, xs, y, b, e); });
      return;
    }
    const int8_t* qp = codes.data_ptr<int8_t>();
    if (halves()) {
      at::parallel_for(0, out(), kRowsPerTask, [&](int64_t b, int64_t e) { q8_16_rows_single(x, K, qp, dp, y, b, e); });
      return;
    }
#if defined(KVMEMORY_VNNI)
    if (int8) {
      quantize_for_q8(x, K, q8s);
      at::parallel_for(0, out(), kRowsPerTask, [&](int64_t b, int64_t e) {
        q8_rows_i8_single(q8s, K, qp, dp, y, b, e);
        add_mins(K, xs, y, b, e);
      });
      return;
    }
#endif
    at::parallel_for(0, out(), kRowsPerTask, [&](int64_t b, int64_t e) {
      q8_rows_single(x, K, qp, dp, y, b, e);
      add_mins(K, xs, y, b, e);
    });
  }
  // R rows of different threads' decoded tokens: x row i at x + i * K (xs: its block sums at
  // xs + i * K / 32) -> y row i at y + i * ldy, each row bit for bit what apply() gives it alone
  // (same kernels' arithmetic, same split of the output rows over the threads), every block read
  // once per kEachRows rows. fp32 activations only.
  void apply_each(const float* x, int64_t R, int64_t K, float* y, int64_t ldy, const float* xs) const {
    if (f16()) {
      const at::Half* wp = codes.data_ptr<at::Half>();
      at::parallel_for(0, out(), kRowsPerTask, [&](int64_t b, int64_t e) {
        for (int64_t o = b; o < e; ++o)
          for (int64_t i = 0; i < R; ++i) y[i * ldy + o] = f16_row_dot(wp + o * K, x + i * K, K);
      });
      return;
    }
    const float* dp = scales.data_ptr<float>();
    at::parallel_for(0, out(), kRowsPerTask, [&](int64_t b, int64_t e) {
      for (int64_t i0 = 0; i0 < R; i0 += kEachRows) {
        const float* xi = x + i0 * K;
        float* yi = y + i0 * ldy;
        with_count<kEachRows>(std::min(kEachRows, R - i0), [&](auto rows) {
          constexpr int C = decltype(rows)::value;
          if (q4()) {
            q4_rows_each<C>(xi, K, codes.data_ptr<uint8_t>(), dp, mins.data_ptr<float>(), xs + i0 * (K / kBlock), yi,
                            ldy, b, e);
          } else if (halves()) {
            q8_16_rows_each<C>(xi, K, codes.data_ptr<int8_t>(), dp, yi, ldy, b, e);
          } else {
            q8_rows_each<C>(xi, K, codes.data_ptr<int8_t>(), dp, yi, ldy, b, e);
            for (int64_t i = 0; i < C; ++i) add_mins(K, xs + (i0 + i) * (K / kBlock), yi + i * ldy, b, e);
          }
        });
      }
    });
  }
  // x [n, K] -> [n, out] (every row through one pass over the blocks)
  torch::Tensor apply_rows(const torch::Tensor& x, bool int8) const {
    if (f16()) return f16_linear(x, codes);
    if (q4()) return int8 ? q4_1_linear_i8(x, codes, scales, mins) : q4_1_linear(x, codes, scales, mins);
    const auto byte_min = byte_mins() ? mins : torch::empty({0}, scales.options());
    return int8 && !halves() ? q8_0_linear_i8(x, codes, scales, byte_min) : q8_0_linear(x, codes, scales, byte_min);
  }
};

// A fused linear (q/k/v, gate/up: the parts' output rows one after another, each part in its own
// block form, as a file may quantize q, k and v differently) with an optional bias (Qwen2's q/k/v).
struct FusedWeight {
  std::vector<BlockWeight> parts;
  torch::Tensor bias;  // [out] or empty

  // tensors: (codes, scales, mins) per part, mins empty for the byte form; one more: the bias
  explicit FusedWeight(const std::vector<torch::Tensor>& tensors) {
    TORCH_CHECK(tensors.size() >= 3 && tensors.size() % 3 <= 1, "a linear comes as (codes, scales, mins) triples and an optional bias");
    for (size_t i = 0; i + 2 < tensors.size(); i += 3) parts.push_back({tensors[i], tensors[i + 1], tensors[i + 2]});
    if (tensors.size() % 3 == 1) bias = tensors.back();
    TORCH_CHECK(!has_bias() || bias.numel() == out(), "the bias must have one value per output row");
  }
  bool has_bias() const { return bias.defined() && bias.numel() > 0; }
  bool has_halves() const {
    return std::any_of(parts.begin(), parts.end(), [](const BlockWeight& w) { return w.halves(); });
  }
  int64_t out() const {
    int64_t total = 0;
    for (const auto& w : parts) total += w.out();
    return total;
  }
  void apply(const float* x, int64_t K, float* y, const float* xs, bool int8, Q4Activation& q4s, Q8Activation& q8s) const {
    int64_t offset = 0;
    for (const auto& w : parts) {
      w.apply(x, K, y + offset, xs, int8, q4s, q8s);
      offset += w.out();
    }
    if (has_bias()) {
      const float* bp = bias.data_ptr<float>();
      for (int64_t i = 0; i < offset; ++i) y[i] += bp[i];
    }
  }
  // apply() for R rows at once (BlockWeight::apply_each): row i of x at x + i * K -> y + i * ldy
  void apply_each(const float* x, int64_t R, int64_t K, float* y, int64_t ldy, const float* xs) const {
    int64_t offset = 0;
    for (const auto& w : parts) {
      w.apply_each(x, R, K, y + offset, ldy, xs);
      offset += w.out();
    }
    if (has_bias()) {
      const float* bp = bias.data_ptr<float>();
      for (int64_t r = 0; r < R; ++r)
        for (int64_t i = 0; i < offset; ++i) y[r * ldy + i] += bp[i];
    }
  }
  torch::Tensor apply_rows(const torch::Tensor& x, bool int8) const {
    torch::Tensor y;
    if (parts.size() == 1) {
      y = parts[0].apply_rows(x, int8);
    } else {
      std::vector<torch::Tensor> outs;
      for (const auto& w : parts) outs.push_back(w.apply_rows(x, int8));
      y = torch::cat(outs, 1);
    }
    if (has_bias()) y.add_(bias);
    return y;
  }
};

void sums_of_blocks(const float* x, int64_t K, float* out) {
  for (int64_t b = 0; b < K / kBlock; ++b) {
    float total = 0.f;
    for (int64_t j = 0; j < kBlock; ++j) total += x[b * kBlock + j];
    out[b] = total;
  }
}

// transformers' LlamaRMSNorm: x * rsqrt(mean(x^2) + eps) * weight, in fp32
void rms_norm(const float* x, const float* weight, int64_t n, double eps, float* out) {
  float total = 0.f;
  for (int64_t i = 0; i < n; ++i) total += x[i] * x[i];
  const float inv = 1.0f / std::sqrt(total / float(n) + float(eps));
  for (int64_t i = 0; i < n; ++i) out[i] = weight[i] * (x[i] * inv);
}

#if defined(KVMEMORY_AVX512)
// exp of 16 floats (Cephes' expf polynomial, range-reduced by ln 2 and scaled by 2^n: within 2 ulp
// of std::exp over the range softmax and SiLU use)
inline __m512 exp16(__m512 x) {
  x = _mm512_max_ps(_mm512_min_ps(x, _mm512_set1_ps(88.7f)), _mm512_set1_ps(-103.9f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  const __m512 y = _mm512_add_ps(_mm512_fmadd_ps(_mm512_mul_ps(p, r), r, r), _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(y, n);
}
#elif defined(KVMEMORY_AVX2)
// exp16 above for 8 floats: the same clamp, reduction and polynomial (bit-identical results).
// AVX2 has no scalef: 2^n is applied as 2^(n/2) * 2^(n - n/2), each factor a normal float built
// from its exponent bits (n lies in [-150, 128]); the first product is exact, so the result is
// rounded once, as scalef rounds it (denormal results included).
inline __m256 exp8(__m256 x) {
  x = _mm256_max_ps(_mm256_min_ps(x, _mm256_set1_ps(88.7f)), _mm256_set1_ps(-103.9f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  const __m256 y = _mm256_add_ps(_mm256_fmadd_ps(_mm256_mul_ps(p, r), r, r), _mm256_set1_ps(1.f));
  const __m256i k = _mm256_cvtps_epi32(n);  // exact: n is an integer
  const __m256i half = _mm256_srai_epi32(k, 1);
  const __m256i bias = _mm256_set1_epi32(127);
  const __m256 s1 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(half, bias), 23));
  const __m256 s2 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_sub_epi32(k, half), bias), 23));
  return _mm256_mul_ps(_mm256_mul_ps(y, s1), s2);
}

// lanes [0, count) set, count in [0, 8]: the mask of a partial vector's loads and stores
inline __m256i first_lanes(int64_t count) {
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(int(count)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}
#endif

float max_of(const float* x, int64_t n) {
  float top = -INFINITY;
  int64_t i = 0;
#if defined(KVMEMORY_AVX512)
  __m512 acc = _mm512_set1_ps(-INFINITY);
  for (; i + 16 <= n; i += 16) acc = _mm512_max_ps(acc, _mm512_loadu_ps(x + i));
  top = _mm512_reduce_max_ps(acc);
#elif defined(KVMEMORY_AVX2)
  __m256 acc = _mm256_set1_ps(-INFINITY);
  for (; i + 8 <= n; i += 8) acc = _mm256_max_ps(acc, _mm256_loadu_ps(x + i));
  __m128 h = _mm_max_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
  h = _mm_max_ps(h, _mm_movehl_ps(h, h));
  top = _mm_cvtss_f32(_mm_max_ss(h, _mm_movehdup_ps(h)));
#endif
  for (; i < n; ++i) top = std::max(top, x[i]);
  return top;
}

// x[i] = exp(x[i] - top) for i < n; returns their sum
float exp_shifted_sum(float* x, int64_t n, float top) {
  int64_t i = 0;
  float total = 0.f;
#if defined(KVMEMORY_AVX512)
  const __m512 shift = _mm512_set1_ps(top);
  __m512 acc = _mm512_setzero_ps();
  for (; i < n; i += 16) {
    const __mmask16 mask = n - i >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (n - i)) - 1);
    const __m512 e = exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(mask, x + i), shift));
    _mm512_mask_storeu_ps(x + i, mask, e);
    acc = _mm512_add_ps(acc, _mm512_maskz_mov_ps(mask, e));
  }
  total = _mm512_reduce_add_ps(acc);
#elif defined(KVMEMORY_AVX2)
  const __m256 shift = _mm256_set1_ps(top);
  __m256 acc = _mm256_setzero_ps();
  for (; i + 8 <= n; i += 8) {  // plain loads and stores: a masked store costs many cycles on AMD
    const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(x + i), shift));
    _mm256_storeu_ps(x + i, e);
    acc = _mm256_add_ps(acc, e);
  }
  if (i < n) {  // the last vector partial (masked): every value through the same exp8
    const __m256i mask = first_lanes(n - i);
    const __m256 e = exp8(_mm256_sub_ps(_mm256_maskload_ps(x + i, mask), shift));
    _mm256_maskstore_ps(x + i, mask, e);
    acc = _mm256_add_ps(acc, _mm256_and_ps(e, _mm256_castsi256_ps(mask)));
    i = n;
  }
  total = hsum(acc);
#endif
  for (; i < n; ++i) {
    x[i] = std::exp(x[i] - top);
    total += x[i];
  }
  return total;
}

// out[D] = sum_r p[r] * v[r * D : (r + 1) * D]
void weighted_rows(const float* p, const float* v, int64_t n, int64_t D, float* out) {
#if defined(KVMEMORY_AVX512)
  if (D == 64) {
    __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    for (int64_t r = 0; r < n; ++r) {
      const __m512 pr = _mm512_set1_ps(p[r]);
      const float* vr = v + r * 64;
      a0 = _mm512_fmadd_ps(pr, _mm512_loadu_ps(vr), a0);
      a1 = _mm512_fmadd_ps(pr, _mm512_loadu_ps(vr + 16), a1);
      a2 = _mm512_fmadd_ps(pr, _mm512_loadu_ps(vr + 32), a2);
      a3 = _mm512_fmadd_ps(pr, _mm512_loadu_ps(vr + 48), a3);
    }
    _mm512_storeu_ps(out, a0);
    _mm512_storeu_ps(out + 16, a1);
    _mm512_storeu_ps(out + 32, a2);
    _mm512_storeu_ps(out + 48, a3);
    return;
  }
#elif defined(KVMEMORY_AVX2)
  if (D == 64) {
    __m256 a[8];
    for (int j = 0; j < 8; ++j) a[j] = _mm256_setzero_ps();
    for (int64_t r = 0; r < n; ++r) {
      const __m256 pr = _mm256_set1_ps(p[r]);
      for (int j = 0; j < 8; ++j) a[j] = _mm256_fmadd_ps(pr, _mm256_loadu_ps(v + r * 64 + j * 8), a[j]);
    }
    for (int j = 0; j < 8; ++j) _mm256_storeu_ps(out + j * 8, a[j]);
    return;
  }
#endif
  std::fill(out, out + D, 0.f);
  for (int64_t r = 0; r < n; ++r) {
    for (int64_t j = 0; j < D; ++j) out[j] += p[r] * v[r * D + j];
  }
}

#if defined(KVMEMORY_AVX512)
// The 16 dot products q . k[j] (q: 4 vectors of a 64-wide head; k[j] 64 floats apart) as one
// vector: four FMAs per product, then a transposing reduction of the 16 partial vectors (45
// shuffles and adds in all instead of a horizontal sum per product).
inline __m512 dots16(const __m512 q[4], const float* k) {
  __m512 a[16];
  for (int j = 0; j < 16; ++j) {
    const float* kj = k + j * 64;
    const __m512 s = _mm512_fmadd_ps(q[1], _mm512_loadu_ps(kj + 16), _mm512_mul_ps(q[0], _mm512_loadu_ps(kj)));
    a[j] = _mm512_fmadd_ps(q[3], _mm512_loadu_ps(kj + 48), _mm512_fmadd_ps(q[2], _mm512_loadu_ps(kj + 32), s));
  }
  // per 128-bit lane: pairs, then quadruples of products summed; then the four lanes
  __m512 b[8], c[4];
  for (int j = 0; j < 8; ++j)
    b[j] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * j], a[2 * j + 1]), _mm512_unpackhi_ps(a[2 * j], a[2 * j + 1]));
  for (int j = 0; j < 4; ++j) {
    const __m512d x = _mm512_castps_pd(b[2 * j]), y = _mm512_castps_pd(b[2 * j + 1]);
    c[j] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
  }
  const __m512 e0 = _mm512_add_ps(_mm512_shuffle_f32x4(c[0], c[1], 0x88), _mm512_shuffle_f32x4(c[0], c[1], 0xDD));
  const __m512 e1 = _mm512_add_ps(_mm512_shuffle_f32x4(c[2], c[3], 0x88), _mm512_shuffle_f32x4(c[2], c[3], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(e0, e1, 0x88), _mm512_shuffle_f32x4(e0, e1, 0xDD));
}

// The G query heads of one key/value group against n key rows (D = 64 or 128): each key row is
// loaded once for all G heads. qs: the G heads' scaled queries, [G, D]. S[h * n + r] = q_h . k_r.
template <int G, int D>
void group_scores(const float* qs, const float* k, int64_t n, float* S) {
  constexpr int V = D / 16;
  __m512 q[G][V];
  for (int h = 0; h < G; ++h)
    for (int j = 0; j < V; ++j) q[h][j] = _mm512_loadu_ps(qs + h * D + j * 16);
  for (int64_t r = 0; r < n; ++r) {
    const float* kr = k + r * D;
    __m512 kv[V];
    for (int j = 0; j < V; ++j) kv[j] = _mm512_loadu_ps(kr + j * 16);
    for (int h = 0; h < G; ++h) {
      __m512 s = _mm512_mul_ps(q[h][0], kv[0]);
      for (int j = 1; j < V; ++j) s = _mm512_fmadd_ps(q[h][j], kv[j], s);
      S[h * n + r] = hsum(s);
    }
  }
}

// out[h][D] = sum_r P[h * n + r] * v[r] for the G heads of one group: each value row is loaded
// once for all G heads (weighted_rows per head would read it G times).
template <int G, int D>
void group_weighted_rows(const float* P, const float* v, int64_t n, float* out) {
  constexpr int V = D / 16;
  __m512 acc[G][V];
  for (int h = 0; h < G; ++h)
    for (int j = 0; j < V; ++j) acc[h][j] = _mm512_setzero_ps();
  for (int64_t r = 0; r < n; ++r) {
    const float* vr = v + r * D;
    __m512 vv[V];
    for (int j = 0; j < V; ++j) vv[j] = _mm512_loadu_ps(vr + j * 16);
    for (int h = 0; h < G; ++h) {
      const __m512 p = _mm512_set1_ps(P[h * n + r]);
      for (int j = 0; j < V; ++j) acc[h][j] = _mm512_fmadd_ps(p, vv[j], acc[h][j]);
    }
  }
  for (int h = 0; h < G; ++h)
    for (int j = 0; j < V; ++j) _mm512_storeu_ps(out + h * D + j * 16, acc[h][j]);
}
#elif defined(KVMEMORY_AVX2)
// The 8 dot products q . k[j] (q: 64 floats; k[j] 64 floats apart) as one vector: 8 independent
// FMA chains (q loaded once per 8 columns for all rows), then one transposing reduction (6
// horizontal adds, 2 lane permutes, 1 add) instead of a horizontal sum per product.
inline __m256 dots8(const float* q, const float* k) {
  __m256 a[8];
  const __m256 q0 = _mm256_loadu_ps(q);
  for (int j = 0; j < 8; ++j) a[j] = _mm256_mul_ps(q0, _mm256_loadu_ps(k + j * 64));
  for (int c = 1; c < 8; ++c) {
    const __m256 qc = _mm256_loadu_ps(q + c * 8);
    for (int j = 0; j < 8; ++j) a[j] = _mm256_fmadd_ps(qc, _mm256_loadu_ps(k + j * 64 + c * 8), a[j]);
  }
  const __m256 t0 = _mm256_hadd_ps(a[0], a[1]), t1 = _mm256_hadd_ps(a[2], a[3]);
  const __m256 t2 = _mm256_hadd_ps(a[4], a[5]), t3 = _mm256_hadd_ps(a[6], a[7]);
  const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);  // per 128-bit half: rows 0-3, 4-7
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

// out[j] = the sum of a[j]'s lanes, j < R (R = 2, 4 or 8): one transposing reduction
template <int R>
inline void store_sums(const __m256 (&a)[R], float* out) {
  if constexpr (R == 8) {
    const __m256 u0 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
    const __m256 u1 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
    _mm256_storeu_ps(out, _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31)));
  } else if constexpr (R == 4) {
    const __m256 u = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
    _mm_storeu_ps(out, _mm_add_ps(_mm256_castps256_ps128(u), _mm256_extractf128_ps(u, 1)));
  } else {
    static_assert(R == 2, "2, 4 or 8 sums");
    const __m256 t = _mm256_hadd_ps(a[0], a[1]);
    const __m128 s = _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1));
    _mm_storel_pi(reinterpret_cast<__m64*>(out), _mm_hadd_ps(s, s));
  }
}

// group_scores for AVX2 (qs: the G heads' scaled queries, [G, D]; S[h * n + r] = q_h . k_r):
// R key rows at a time for all G heads. Per 8 columns the G query vectors and each row's key
// vector are loaded once (G + R loads for G * R FMAs) into G * R accumulators, which with the G
// query vectors fill the 16 registers at most.
template <int G, int D>
void group_scores(const float* qs, const float* k, int64_t n, float* S) {
  constexpr int R = G == 1 ? 8 : (G <= 3 ? 4 : 2);
  int64_t r = 0;
  for (; r + R <= n; r += R) {
    const float* kr = k + r * D;
    __m256 acc[G][R];
    for (int h = 0; h < G; ++h)
      for (int j = 0; j < R; ++j) acc[h][j] = _mm256_setzero_ps();
    for (int c = 0; c < D / 8; ++c) {
      __m256 qc[G];
      for (int h = 0; h < G; ++h) qc[h] = _mm256_loadu_ps(qs + h * D + c * 8);
      for (int j = 0; j < R; ++j) {
        const __m256 kj = _mm256_loadu_ps(kr + j * D + c * 8);
        for (int h = 0; h < G; ++h) acc[h][j] = _mm256_fmadd_ps(qc[h], kj, acc[h][j]);
      }
    }
    for (int h = 0; h < G; ++h) store_sums<R>(acc[h], S + h * n + r);
  }
  for (; r < n; ++r)
    for (int h = 0; h < G; ++h) S[h * n + r] = dot(qs + h * D, k + r * D, D);
}

// group_weighted_rows for AVX2: G heads * D outputs need up to 64 accumulators, more than the 16
// registers, so the columns are done W vectors (8W floats) at a time, 12 accumulators at most,
// over blocks of 32 value rows (8-16 KB, still in L1 for the next columns; in a micro-benchmark
// of this pass over 2 K rows on Zen 4, 64-row and 8-row blocks were ~20 % slower). Each output
// still sums its rows in order.
template <int G, int D>
void group_weighted_rows(const float* P, const float* v, int64_t n, float* out) {
  constexpr int W = G * 8 <= 12 ? 8 : (G * 4 <= 12 ? 4 : 2);
  constexpr int64_t kRowBlock = 32;
  std::fill(out, out + G * D, 0.f);
  for (int64_t r0 = 0; r0 < n; r0 += kRowBlock) {
    const int64_t r1 = std::min(n, r0 + kRowBlock);
    for (int j0 = 0; j0 < D / 8; j0 += W) {
      __m256 acc[G][W];
      for (int h = 0; h < G; ++h)
        for (int j = 0; j < W; ++j) acc[h][j] = _mm256_loadu_ps(out + h * D + (j0 + j) * 8);
      for (int64_t r = r0; r < r1; ++r) {
        const float* vr = v + r * D + j0 * 8;
        for (int h = 0; h < G; ++h) {
          const __m256 p = _mm256_set1_ps(P[h * n + r]);
          for (int j = 0; j < W; ++j) acc[h][j] = _mm256_fmadd_ps(p, _mm256_loadu_ps(vr + j * 8), acc[h][j]);
        }
      }
      for (int h = 0; h < G; ++h)
        for (int j = 0; j < W; ++j) _mm256_storeu_ps(out + h * D + (j0 + j) * 8, acc[h][j]);
    }
  }
}
#endif

// SiLU(gate) * up for n values
void silu_mul(const float* gate, const float* up, int64_t n, float* out) {
  int64_t i = 0;
#if defined(KVMEMORY_AVX512)
  for (; i + 16 <= n; i += 16) {
    const __m512 g = _mm512_loadu_ps(gate + i);
    const __m512 e = exp16(_mm512_sub_ps(_mm512_setzero_ps(), g));
    _mm512_storeu_ps(out + i, _mm512_mul_ps(_mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.f), e)), _mm512_loadu_ps(up + i)));
  }
#elif defined(KVMEMORY_AVX2)
  for (; i + 8 <= n; i += 8) {
    const __m256 g = _mm256_loadu_ps(gate + i);
    const __m256 e = exp8(_mm256_sub_ps(_mm256_setzero_ps(), g));
    _mm256_storeu_ps(out + i, _mm256_mul_ps(_mm256_div_ps(g, _mm256_add_ps(_mm256_set1_ps(1.f), e)), _mm256_loadu_ps(up + i)));
  }
#endif
  for (; i < n; ++i) out[i] = gate[i] / (1.0f + std::exp(-gate[i])) * up[i];
}

// rotary embedding of one head (rotate_half convention): cos / sin hold head_dim values
void rotate(float* v, const float* cos, const float* sin, int64_t dim) {
  const int64_t half = dim / 2;
  for (int64_t j = 0; j < half; ++j) {
    const float a = v[j], b = v[j + half];
    v[j] = a * cos[j] - b * sin[j];
    v[j + half] = b * cos[j + half] + a * sin[j + half];
  }
}

// query heads that LlamaDecoder::attend_rows_by_group takes in one pass over a group's key and
// value rows at head_dim 64 (half as many at 128): their queries and accumulators fill the
// registers. A larger group (Qwen2.5: 6-7 heads per key/value head) is done in passes of at most
// this many heads, each over rows still in cache.
constexpr int kMaxGroup = 4;

}  // namespace

class LlamaDecoder {
 public:
  // linears: per layer its qkv, o, gate_up and down (4 * layers entries), each as FusedWeight
  // takes them; head: the output head the same way
  LlamaDecoder(std::vector<std::vector<torch::Tensor>> linears, std::vector<torch::Tensor> input_norms,
               std::vector<torch::Tensor> post_norms, torch::Tensor final_norm, std::vector<torch::Tensor> head,
               int64_t heads, int64_t kv_heads, int64_t head_dim, double eps, double scale, bool int8_activations)
      : input_norms_(input_norms), post_norms_(post_norms), final_norm_(final_norm), head_(head), heads_(heads),
        kv_heads_(kv_heads), head_dim_(head_dim), eps_(eps), scale_(scale), int8_(int8_activations) {
    TORCH_CHECK(!int8_ || has_vnni(), "int8 activations need AVX-512 VNNI (this build has none)");
    TORCH_CHECK(linears.size() % 4 == 0 && linears.size() / 4 == input_norms.size(), "4 linears per layer");
    for (size_t i = 0; i < linears.size(); i += 4) {
      qkv_.emplace_back(linears[i]);
      o_.emplace_back(linears[i + 1]);
      gate_up_.emplace_back(linears[i + 2]);
      down_.emplace_back(linears[i + 3]);
    }
    for (const auto* group : {&qkv_, &o_, &gate_up_, &down_}) {
      for (const auto& w : *group) TORCH_CHECK(!int8_ || !w.has_halves(), "int8 activations: no kernel for 16-value blocks (Q6_K)");
    }
    TORCH_CHECK(!int8_ || !head_.has_halves(), "int8 activations: no kernel for 16-value blocks (Q6_K)");
  }

  // hidden: [H] embedding of the token at row `pos`; keys / values: [layers, 1, kv_heads, capacity,
  // head_dim] (rows [0, pos) cached; row pos is written here); cos / sin: [head_dim]. Returns logits [V].
  torch::Tensor step(torch::Tensor hidden, torch::Tensor keys, torch::Tensor values, torch::Tensor cos,
                     torch::Tensor sin, int64_t pos) {
    const int64_t H = hidden.size(0), layers = qkv_.size(), D = head_dim_;
    const int64_t q_width = heads_ * D, kv_width = kv_heads_ * D;
    const int64_t inter = gate_up_[0].out() / 2;
    TORCH_CHECK(keys.is_contiguous() && values.is_contiguous() && keys.size(0) == layers && pos < keys.size(3),
                "keys / values must be contiguous [layers, 1, kv_heads, capacity > pos, head_dim]");
    const int64_t capacity = keys.size(3);
    auto h = hidden.contiguous().clone();
    float* hp = h.data_ptr<float>();
    // sums: the block sums of any linear's input (hidden, attention output or MLP activation)
    std::vector<float> x(std::max(H, inter)), qkv(q_width + 2 * kv_width), attn(q_width), out(std::max(H, 2 * inter)),
        sums(std::max({H, inter, q_width}) / kBlock + 1), act(inter);
    Q4Activation scratch;
    Q8Activation scratch8;
    const float *cp = cos.data_ptr<float>(), *sp = sin.data_ptr<float>();
    for (int64_t l = 0; l < layers; ++l) {
      rms_norm(hp, input_norms_[l].data_ptr<float>(), H, eps_, x.data());
      sums_of_blocks(x.data(), H, sums.data());
      qkv_[l].apply(x.data(), H, qkv.data(), sums.data(), int8_, scratch, scratch8);
      float* kl = keys.data_ptr<float>() + l * kv_heads_ * capacity * D;
      float* vl = values.data_ptr<float>() + l * kv_heads_ * capacity * D;
      rotate_and_store(qkv.data(), cp, sp, kl, vl, capacity, pos);
      attend(qkv.data(), kl, vl, capacity, pos + 1, attn.data());
      sums_of_blocks(attn.data(), q_width, sums.data());
      o_[l].apply(attn.data(), q_width, out.data(), sums.data(), int8_, scratch, scratch8);
      for (int64_t i = 0; i < H; ++i) hp[i] += out[i];
      rms_norm(hp, post_norms_[l].data_ptr<float>(), H, eps_, x.data());
      sums_of_blocks(x.data(), H, sums.data());
      gate_up_[l].apply(x.data(), H, out.data(), sums.data(), int8_, scratch, scratch8);
      silu_mul(out.data(), out.data() + inter, inter, act.data());
      sums_of_blocks(act.data(), inter, sums.data());
      down_[l].apply(act.data(), inter, out.data(), sums.data(), int8_, scratch, scratch8);
      for (int64_t i = 0; i < H; ++i) hp[i] += out[i];
    }
    rms_norm(hp, final_norm_.data_ptr<float>(), H, eps_, x.data());
    auto logits = torch::empty({head_.out()}, hidden.options());
    sums_of_blocks(x.data(), H, sums.data());
    head_.apply(x.data(), H, logits.data_ptr<float>(), sums.data(), int8_, scratch, scratch8);
    return logits;
  }

  // The pending rows of G threads at once (batched decoding): group g is counts[g] consecutive
  // rows of hidden (its decoded token, with its draft tokens to verify or a short append), at
  // strictly increasing positions of its own cache (keys[g] / values[g], each as in step()).
  // Every linear reads its blocks once per kEachRows rows with each row's one-row arithmetic
  // (apply_each), and a group's rows attend to their cache in one attend_rows call, so a group's
  // rows are bit for bit what this call gives them alone (at the same thread count); a group of
  // one row is step()'s row. hidden [R, H], cos / sin [R, head_dim], positions [R], counts [G].
  // Returns logits [R, V] (every_row) or [G, V] for each group's last row.
  torch::Tensor batch_rows(torch::Tensor hidden, std::vector<torch::Tensor> keys, std::vector<torch::Tensor> values,
                           torch::Tensor cos, torch::Tensor sin, torch::Tensor positions, std::vector<int64_t> counts,
                           bool every_row) {
    TORCH_CHECK(!int8_, "batched decoding runs the exact fp32 engine only");
    const int64_t R = hidden.size(0), H = hidden.size(1), G = counts.size(), layers = qkv_.size(), D = head_dim_;
    const int64_t q_width = heads_ * D, kv_width = kv_heads_ * D, qkv_width = q_width + 2 * kv_width;
    const int64_t inter = gate_up_[0].out() / 2, wide = std::max(H, 2 * inter);
    TORCH_CHECK(int64_t(keys.size()) == G && int64_t(values.size()) == G && positions.size(0) == R &&
                positions.scalar_type() == torch::kInt64 && positions.is_contiguous(), "one cache per group, one position per row");
    TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.size(0) == R && cos.size(1) == D,
                "cos / sin must be contiguous [R, head_dim]");
    const int64_t* pos = positions.data_ptr<int64_t>();
    std::vector<int64_t> first(G + 1, 0);  // group g: rows [first[g], first[g + 1])
    for (int64_t g = 0; g < G; ++g) {
      TORCH_CHECK(counts[g] > 0, "every group has at least one row");
      first[g + 1] = first[g] + counts[g];
      for (int64_t i = first[g]; i < first[g + 1]; ++i)
        TORCH_CHECK(pos[i] >= 0 && (i == first[g] || pos[i] > pos[i - 1]), "a group's positions must increase strictly from >= 0");
      TORCH_CHECK(keys[g].is_contiguous() && values[g].is_contiguous() && keys[g].size(0) == layers &&
                      pos[first[g + 1] - 1] < keys[g].size(3),
                  "keys / values must be contiguous [layers, 1, kv_heads, capacity > last position, head_dim]");
    }
    TORCH_CHECK(first[G] == R, "the groups' rows must add up to hidden's rows");
    auto h = hidden.contiguous().clone();
    float* hp = h.data_ptr<float>();
    std::vector<float> x(R * std::max(H, inter)), qkv(R * qkv_width), attn(R * q_width), out(R * wide),
        sums(R * (std::max({H, inter, q_width}) / kBlock + 1)), act(R * inter);
    const float *cp = cos.data_ptr<float>(), *sp = sin.data_ptr<float>();
    // the block sums of n rows of width K, packed [n, K/32] as apply_each reads them
    auto block_sums_of = [&](const float* rows, int64_t n, int64_t K) {
      for (int64_t i = 0; i < n; ++i) sums_of_blocks(rows + i * K, K, sums.data() + i * (K / kBlock));
    };
    for (int64_t l = 0; l < layers; ++l) {
      norm_rows(hp, input_norms_[l], R, H, x.data());
      block_sums_of(x.data(), R, H);
      qkv_[l].apply_each(x.data(), R, H, qkv.data(), qkv_width, sums.data());
      for (int64_t g = 0; g < G; ++g) {
        const int64_t capacity = keys[g].size(3);
        float* kl = keys[g].data_ptr<float>() + l * kv_heads_ * capacity * D;
        float* vl = values[g].data_ptr<float>() + l * kv_heads_ * capacity * D;
        for (int64_t i = first[g]; i < first[g + 1]; ++i)
          rotate_and_store(qkv.data() + i * qkv_width, cp + i * D, sp + i * D, kl, vl, capacity, pos[i]);
        attend_rows(qkv.data() + first[g] * qkv_width, qkv_width, kl, vl, capacity, pos + first[g], counts[g],
                    attn.data() + first[g] * q_width);
      }
      block_sums_of(attn.data(), R, q_width);
      o_[l].apply_each(attn.data(), R, q_width, out.data(), H, sums.data());
      for (int64_t i = 0; i < R * H; ++i) hp[i] += out[i];
      norm_rows(hp, post_norms_[l], R, H, x.data());
      block_sums_of(x.data(), R, H);
      gate_up_[l].apply_each(x.data(), R, H, out.data(), 2 * inter, sums.data());
      for (int64_t i = 0; i < R; ++i) silu_mul(out.data() + i * 2 * inter, out.data() + i * 2 * inter + inter, inter, act.data() + i * inter);
      block_sums_of(act.data(), R, inter);
      down_[l].apply_each(act.data(), R, inter, out.data(), H, sums.data());
      for (int64_t i = 0; i < R * H; ++i) hp[i] += out[i];
    }
    // the rows that get logits: every row, or each group's last
    std::vector<int64_t> heads_of;
    for (int64_t g = 0; g < G; ++g)
      for (int64_t i = every_row ? first[g] : first[g + 1] - 1; i < first[g + 1]; ++i) heads_of.push_back(i);
    const int64_t n = heads_of.size();
    for (int64_t j = 0; j < n; ++j) rms_norm(hp + heads_of[j] * H, final_norm_.data_ptr<float>(), H, eps_, x.data() + j * H);
    block_sums_of(x.data(), n, H);
    auto logits = torch::empty({n, head_.out()}, hidden.options());
    head_.apply_each(x.data(), n, H, logits.data_ptr<float>(), head_.out(), sums.data());
    return logits;
  }

  // n rows (n small) through every layer, row i at position pos[i] (strictly increasing): a short
  // append or a draft to verify (positions [start, start + n)), or the packed refresh's selected
  // rows scattered over the cache (paper §3.3: every layer writes the rows' fresh K/V first, then
  // row i attends cached rows [0, pos[i]], fresh ones included). hidden [n, H] embeddings, cos /
  // sin [n, head_dim] at the positions. Each linear reads its blocks once for all n rows. Returns
  // logits [n, V] (every_row) or [1, V] for the last row.
  torch::Tensor rows(torch::Tensor hidden, torch::Tensor keys, torch::Tensor values, torch::Tensor cos,
                     torch::Tensor sin, torch::Tensor positions, bool every_row) {
    const int64_t n = hidden.size(0), H = hidden.size(1), layers = qkv_.size(), D = head_dim_;
    const int64_t q_width = heads_ * D, kv_width = kv_heads_ * D;
    const int64_t inter = gate_up_[0].out() / 2;
    TORCH_CHECK(positions.scalar_type() == torch::kInt64 && positions.is_contiguous() && positions.size(0) == n,
                "positions must be a contiguous int64 [n] tensor");
    const int64_t* pos = positions.data_ptr<int64_t>();
    for (int64_t i = 0; i < n; ++i) TORCH_CHECK(pos[i] >= 0 && (i == 0 || pos[i] > pos[i - 1]), "positions must increase strictly from >= 0");
    TORCH_CHECK(keys.is_contiguous() && values.is_contiguous() && keys.size(0) == layers && pos[n - 1] < keys.size(3),
                "keys / values must be contiguous [layers, 1, kv_heads, capacity > last position, head_dim]");
    TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.size(0) == n && cos.size(1) == D,
                "cos / sin must be contiguous [n, head_dim]");
    // a few exact rows (a draft to verify, a short append): the batched rows' arithmetic, so a
    // thread's draft computes the same alone as in a batch with other threads' rows
    if (!int8_ && n <= kEachRows) return batch_rows(hidden, {keys}, {values}, cos, sin, positions, {n}, every_row);
    const int64_t capacity = keys.size(3);
    auto h = hidden.contiguous().clone();
    float* hp = h.data_ptr<float>();
    auto x = torch::empty({n, H}, h.options());
    auto attn = torch::empty({n, q_width}, h.options());
    auto act = torch::empty({n, inter}, h.options());
    const float *cp = cos.data_ptr<float>(), *sp = sin.data_ptr<float>();
    for (int64_t l = 0; l < layers; ++l) {
      norm_rows(hp, input_norms_[l], n, H, x.data_ptr<float>());
      auto qkv = qkv_[l].apply_rows(x, int8_);
      float* kl = keys.data_ptr<float>() + l * kv_heads_ * capacity * D;
      float* vl = values.data_ptr<float>() + l * kv_heads_ * capacity * D;
      for (int64_t i = 0; i < n; ++i)
        rotate_and_store(qkv.data_ptr<float>() + i * (q_width + 2 * kv_width), cp + i * D, sp + i * D, kl, vl, capacity, pos[i]);
      attend_rows(qkv.data_ptr<float>(), q_width + 2 * kv_width, kl, vl, capacity, pos, n, attn.data_ptr<float>());
      add_rows(hp, o_[l].apply_rows(attn, int8_), n * H);
      norm_rows(hp, post_norms_[l], n, H, x.data_ptr<float>());
      auto gate_up = gate_up_[l].apply_rows(x, int8_);
      for (int64_t i = 0; i < n; ++i) {
        const float* gu = gate_up.data_ptr<float>() + i * 2 * inter;
        silu_mul(gu, gu + inter, inter, act.data_ptr<float>() + i * inter);
      }
      add_rows(hp, down_[l].apply_rows(act, int8_), n * H);
    }
    const int64_t first = every_row ? 0 : n - 1;
    auto last = torch::empty({n - first, H}, h.options());
    norm_rows(hp + first * H, final_norm_, n - first, H, last.data_ptr<float>());
    return head_.apply_rows(last, int8_);
  }

 private:
  // one row's fused q / k / v output (qkv: q, then k, then v): rotates q and k at the row's
  // position (cos / sin [head_dim]) and writes k and v into row pos of a layer's cache (kl / vl:
  // [kv_heads, capacity, head_dim])
  void rotate_and_store(float* qkv, const float* cos, const float* sin, float* kl, float* vl, int64_t capacity,
                        int64_t pos) const {
    const int64_t D = head_dim_;
    float* k = qkv + heads_ * D;
    float* v = k + kv_heads_ * D;
    for (int64_t hd = 0; hd < heads_; ++hd) rotate(qkv + hd * D, cos, sin, D);
    for (int64_t g = 0; g < kv_heads_; ++g) {
      rotate(k + g * D, cos, sin, D);
      std::copy(k + g * D, k + (g + 1) * D, kl + (g * capacity + pos) * D);
      std::copy(v + g * D, v + (g + 1) * D, vl + (g * capacity + pos) * D);
    }
  }

  void norm_rows(const float* x, const torch::Tensor& weight, int64_t n, int64_t H, float* out) const {
    for (int64_t i = 0; i < n; ++i) rms_norm(x + i * H, weight.data_ptr<float>(), H, eps_, out + i * H);
  }

  static void add_rows(float* h, const torch::Tensor& delta, int64_t count) {
    const float* dp = delta.data_ptr<float>();
    for (int64_t i = 0; i < count; ++i) h[i] += dp[i];
  }

  // attend() for n query rows (row i of q at q + i * q_stride) over cached rows [0, pos[i]] each.
  void attend_rows(const float* q, int64_t q_stride, const float* keys, const float* values, int64_t capacity,
                   const int64_t* pos, int64_t n, float* out) {
#if defined(KVMEMORY_SIMD)
    if (head_dim_ == 64 || head_dim_ == 128) {
      attend_rows_by_group(q, q_stride, keys, values, capacity, pos, n, out);
      return;
    }
#endif
    const int64_t D = head_dim_, group = heads_ / kv_heads_, H = heads_, rows = pos[n - 1] + 1;
    const int64_t chunks = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), rows / 256));
    std::vector<float> part_out(chunks * n * H * D), part_top(chunks * n * H), part_total(chunks * n * H);
    at::parallel_for(0, chunks, 1, [&](int64_t begin, int64_t end) {
      std::vector<float> scores;
      for (int64_t c = begin; c < end; ++c) {
        const int64_t r0 = rows * c / chunks, width = rows * (c + 1) / chunks - r0;
        scores.assign(n * H * width, 0.f);
        for (int64_t g = 0; g < kv_heads_; ++g) {
          const float* kg = keys + (g * capacity + r0) * D;
          int64_t r = 0;
#if defined(KVMEMORY_AVX512)
          if (D == 64) {  // 16 cached rows at a time, one transposing reduction per query head
            for (; r + 16 <= width; r += 16) {
              for (int64_t i = std::lower_bound(pos, pos + n, r0 + r) - pos; i < n; ++i) {
                for (int64_t hh = g * group; hh < (g + 1) * group; ++hh) {
                  const float* qh = q + i * q_stride + hh * D;
                  const __m512 scale = _mm512_set1_ps(float(scale_));
                  const __m512 qv[4] = {_mm512_mul_ps(_mm512_loadu_ps(qh), scale), _mm512_mul_ps(_mm512_loadu_ps(qh + 16), scale),
                                        _mm512_mul_ps(_mm512_loadu_ps(qh + 32), scale), _mm512_mul_ps(_mm512_loadu_ps(qh + 48), scale)};
                  _mm512_storeu_ps(scores.data() + (i * H + hh) * width + r, dots16(qv, kg + r * D));
                }
              }
            }
          }
#elif defined(KVMEMORY_AVX2)
          if (D == 64) {  // 8 cached rows at a time (dots8), the same scaled query as above
            for (; r + 8 <= width; r += 8) {
              for (int64_t i = std::lower_bound(pos, pos + n, r0 + r) - pos; i < n; ++i) {
                for (int64_t hh = g * group; hh < (g + 1) * group; ++hh) {
                  float qs[64];
                  for (int64_t j = 0; j < 64; ++j) qs[j] = q[i * q_stride + hh * D + j] * float(scale_);
                  _mm256_storeu_ps(scores.data() + (i * H + hh) * width + r, dots8(qs, kg + r * D));
                }
              }
            }
          }
#endif
          for (; r < width; ++r) {
            // the query rows that see row r: positions increase, so they are the last ones
            for (int64_t i = std::lower_bound(pos, pos + n, r0 + r) - pos; i < n; ++i) {
              for (int64_t hh = g * group; hh < (g + 1) * group; ++hh) {
                scores[(i * H + hh) * width + r] = dot(q + i * q_stride + hh * D, kg + r * D, D) * float(scale_);
              }
            }
          }
        }
        for (int64_t i = 0; i < n; ++i) {
          const int64_t seen = std::min(width, std::max<int64_t>(0, pos[i] + 1 - r0));
          for (int64_t hh = 0; hh < H; ++hh) {
            float* sh = scores.data() + (i * H + hh) * width;
            const int64_t slot = (c * n + i) * H + hh;
            const float top = max_of(sh, seen);
            part_top[slot] = top;
            part_total[slot] = seen ? exp_shifted_sum(sh, seen, top) : 0.f;
            weighted_rows(sh, values + ((hh / group) * capacity + r0) * D, seen, D, part_out.data() + slot * D);
          }
        }
      }
    });
    combine_chunks(part_out.data(), part_top.data(), part_total.data(), chunks, n * H, out);
  }

  // out[s] = the softmax-weighted sum over chunks of part_out[c, s] (s < slots query heads, each
  // chunk's output unnormalized with its own maximum score part_top and sum part_total): exactly
  // one softmax over all the chunks' rows, rescaled by exp(max_c - max).
  void combine_chunks(const float* part_out, const float* part_top, const float* part_total, int64_t chunks,
                      int64_t slots, float* out) const {
    const int64_t D = head_dim_;
    for (int64_t s = 0; s < slots; ++s) {
      float top = -INFINITY, total = 0.f;
      for (int64_t c = 0; c < chunks; ++c) top = std::max(top, part_top[c * slots + s]);
      float* oh = out + s * D;
      std::fill(oh, oh + D, 0.f);
      for (int64_t c = 0; c < chunks; ++c) {
        const int64_t slot = c * slots + s;
        if (part_total[slot] == 0.f) continue;  // a chunk past this query row's causal end
        const float w = chunks == 1 ? 1.f : std::exp(part_top[slot] - top);
        total += w * part_total[slot];
        const float* po = part_out + slot * D;
        for (int64_t j = 0; j < D; ++j) oh[j] += w * po[j];
      }
      const float inv = 1.f / total;
      for (int64_t j = 0; j < D; ++j) oh[j] *= inv;
    }
  }

#if defined(KVMEMORY_SIMD)
  // attend_rows at head_dim 64 or 128: per query row, one pass over its visible key and value
  // rows for up to kMaxGroup heads of a group (group_scores / group_weighted_rows). Interleaved
  // A/B at 2 K and 8 K cached rows, SmolLM2, 2 threads, whole 30-layer calls: faster than one pass
  // per head (3 rows 15 vs 20 ms at 2 K; 43 rows 334 vs 413 ms at 8 K) and than the query heads in
  // vector lanes with one pass for all rows (5-32 rows 2-14 % faster, packed refreshes of 14 and
  // 32 rows too): the passes are bound by multiply-adds, not by reading the rows.
  void attend_rows_by_group(const float* q, int64_t q_stride, const float* keys, const float* values,
                            int64_t capacity, const int64_t* pos, int64_t n, float* out) {
    const int64_t H = heads_, rows = pos[n - 1] + 1;
    const int64_t chunks = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), rows / 256));
    std::vector<float> part_out(chunks * n * H * head_dim_, 0.f), part_top(chunks * n * H, -INFINITY),
        part_total(chunks * n * H, 0.f);
    const int64_t group = heads_ / kv_heads_, pass = head_dim_ == 64 ? kMaxGroup : kMaxGroup / 2;
    at::parallel_for(0, chunks, 1, [&](int64_t begin, int64_t end) {
      std::vector<float> scores;
      for (int64_t c = begin; c < end; ++c) {
        const int64_t r0 = rows * c / chunks, width = rows * (c + 1) / chunks - r0;
        scores.resize(kMaxGroup * width);
        for (int64_t i = 0; i < n; ++i) {
          const int64_t seen = std::min(width, pos[i] + 1 - r0);
          if (seen <= 0) continue;  // this chunk lies past the row's causal end
          for (int64_t g = 0; g < kv_heads_; ++g) {
            for (int64_t h0 = 0; h0 < group; h0 += pass) {
              const int64_t head = g * group + h0, slot = (c * n + i) * H + head;
              const float* kg = keys + (g * capacity + r0) * head_dim_;
              const float* vg = values + (g * capacity + r0) * head_dim_;
              with_count<kMaxGroup>(std::min(pass, group - h0), [&](auto count) {
                constexpr int G = decltype(count)::value;
                if (head_dim_ == 64) {
                  attend_heads<G, 64>(q + i * q_stride + head * 64, kg, vg, seen, scores.data(), part_top.data() + slot,
                                      part_total.data() + slot, part_out.data() + slot * 64);
                } else {
                  attend_heads<G, 128>(q + i * q_stride + head * 128, kg, vg, seen, scores.data(), part_top.data() + slot,
                                       part_total.data() + slot, part_out.data() + slot * 128);
                }
              });
            }
          }
        }
      }
    });
    combine_chunks(part_out.data(), part_top.data(), part_total.data(), chunks, n * H, out);
  }

  // G consecutive query heads (q: [G, D]) of one group over `seen` key / value rows: each head's
  // maximum score, sum of exponentials and unnormalized output (scores: G * seen scratch).
  template <int G, int D>
  void attend_heads(const float* q, const float* k, const float* v, int64_t seen, float* scores, float* top,
                    float* total, float* out) const {
    float qg[G * D];  // the heads' queries, scaled
    for (int64_t j = 0; j < G * D; ++j) qg[j] = q[j] * float(scale_);
    group_scores<G, D>(qg, k, seen, scores);
    for (int h = 0; h < G; ++h) {
      top[h] = max_of(scores + h * seen, seen);
      total[h] = exp_shifted_sum(scores + h * seen, seen, top[h]);
    }
    group_weighted_rows<G, D>(scores, v, seen, out);
  }

#endif

  // softmax(q k^T * scale) v for every query head over rows [0, rows) of its key/value group: the
  // one-row case of attend_rows. The rows are split into chunks, one per thread (each reads its
  // rows once, for every head of a group): each chunk keeps its own maximum score, sum of
  // exponentials and unnormalized output per head, and the chunks are combined exactly as in a
  // single softmax (rescaled by exp(max_c - max)).
  void attend(const float* q, const float* keys, const float* values, int64_t capacity, int64_t rows, float* out) {
    const int64_t last = rows - 1;
    attend_rows(q, heads_ * head_dim_, keys, values, capacity, &last, 1, out);
  }

  std::vector<FusedWeight> qkv_, o_, gate_up_, down_;
  std::vector<torch::Tensor> input_norms_, post_norms_;
  torch::Tensor final_norm_;
  FusedWeight head_;
  int64_t heads_, kv_heads_, head_dim_;
  double eps_, scale_;
  bool int8_;
};

PYBIND11_MODULE(TORCH_EXTENSION_NAME, module) {
  // no Python object is touched inside: other Python threads run while a kernel computes
  module.def("q4_1_linear", &q4_1_linear, "x @ dequant(Q4_1 blocks).T in fp32",
             pybind11::call_guard<pybind11::gil_scoped_release>());
  module.def("q8_0_linear", &q8_0_linear, "x @ dequant(Q8_0 blocks).T in fp32",
             pybind11::call_guard<pybind11::gil_scoped_release>());
  module.def("q4_1_linear_i8", &q4_1_linear_i8, "x @ dequant(Q4_1 blocks).T with x quantized to int8 blocks (VNNI)",
             pybind11::call_guard<pybind11::gil_scoped_release>());
  module.def("f16_linear", &f16_linear, "x @ W.T for fp16 weights W, in fp32",
             pybind11::call_guard<pybind11::gil_scoped_release>());
  module.def("q8_0_linear_i8", &q8_0_linear_i8, "x @ dequant(Q8_0 blocks).T with x quantized to int8 blocks (VNNI)",
             pybind11::call_guard<pybind11::gil_scoped_release>());
  module.def("dequantize_rows", &dequantize_rows, "output rows of a block weight as dense fp32 [rows, in]",
             pybind11::call_guard<pybind11::gil_scoped_release>());
  module.def("has_vnni", &has_vnni, "whether this build has the int8-activation (VNNI) kernels");
  module.def("isa", &isa, "the SIMD paths this build compiled: avx512, avx2 or portable");
  // module_local: each ISA's build is its own module with its own LlamaDecoder type (several load
  // into one process); a global registration would clash on the shared C++ type name
  pybind11::class_<LlamaDecoder>(module, "LlamaDecoder", pybind11::module_local())
      .def(pybind11::init<std::vector<std::vector<torch::Tensor>>, std::vector<torch::Tensor>, std::vector<torch::Tensor>,
                          torch::Tensor, std::vector<torch::Tensor>, int64_t, int64_t, int64_t, double, double, bool>())
      .def("step", &LlamaDecoder::step, "one decoded token through every layer; returns logits",
           pybind11::call_guard<pybind11::gil_scoped_release>())
      .def("batch_rows", &LlamaDecoder::batch_rows, "the pending rows of several caches in one call; returns logits",
           pybind11::call_guard<pybind11::gil_scoped_release>())
      .def("rows", &LlamaDecoder::rows, "a few new rows through every layer; returns logits [n or 1, V]",
           pybind11::call_guard<pybind11::gil_scoped_release>());
}
