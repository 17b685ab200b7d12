// Linears over GGUF Q4_1 / Q8_0 weight blocks, computed in fp32 (CPU).
//
// A Q4_1 block holds 32 weights of one output row as w_j = d * q_j + m (q_j a 4-bit code; bytes
// 0..15 hold codes 0..15 in their low nibbles and codes 16..31 in their high nibbles, as in GGUF).
// A Q8_0 block holds w_j = d * q_j (q_j a signed byte). d and m arrive as fp32 (converted once
// from the file's fp16). The products use the factored form
//     y = sum_blocks d * (q . x_block) + m * sum(x_block)
// which equals x . dequantize(W) up to fp32 rounding (a different summation order than a dense
// GEMV, like any other kernel). Reading the codes instead of dense fp32 weights moves 1/5 of the
// bytes per token, which is what bounds decoding speed on a CPU.
//
// Rows of the output are split over torch's intra-op threads (at::parallel_for).

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <cmath>
#include <cstdint>
#include <vector>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kBlock = 32;
constexpr int64_t kRowsPerTask = 16;
constexpr int64_t kMaxM = 8;  // activation rows handled together (one pass over the codes)

void check_inputs(const torch::Tensor& x, const torch::Tensor& codes, const torch::Tensor& d, int64_t code_bytes) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32 && x.is_contiguous(),
              "x must be a contiguous fp32 [M, K] tensor");
  TORCH_CHECK(x.size(1) % kBlock == 0, "K must be a multiple of 32");
  TORCH_CHECK(codes.dim() == 2 && codes.is_contiguous() && codes.size(1) == x.size(1) / kBlock * code_bytes,
              "codes must be contiguous [N, K/32*", code_bytes, "]");
  TORCH_CHECK(d.scalar_type() == torch::kFloat32 && d.is_contiguous() && d.size(0) == codes.size(0) &&
              d.size(1) == x.size(1) / kBlock, "scales must be contiguous fp32 [N, K/32]");
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

#if defined(__AVX512F__)
inline float hsum(__m512 v) { return _mm512_reduce_add_ps(v); }
#endif

// One activation row (decode): four output rows at a time share the activation loads and keep
// four independent accumulation chains in flight.
void q4_rows_single(const float* x, int64_t K, const uint8_t* codes, const float* d, const float* m,
                    const float* xs, float* y, int64_t row_begin, int64_t row_end) {
  const int64_t nb = K / kBlock;
  int64_t o = row_begin;
#if defined(__AVX512F__)
  const __m512i low4 = _mm512_set1_epi32(0xF);
  for (; o + 4 <= row_end; o += 4) {
    __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
    for (int64_t b = 0; b < nb; ++b) {
      const __m512 x0 = _mm512_loadu_ps(x + b * kBlock);
      const __m512 x1 = _mm512_loadu_ps(x + b * kBlock + 16);
      for (int r = 0; r < 4; ++r) {
        const int64_t row = o + r;
        const __m512i bytes = _mm512_cvtepu8_epi32(
            _mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + (row * nb + b) * 16)));
        __m512 t = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_and_si512(bytes, low4)), x0);
        t = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32(bytes, 4)), x1, t);
        acc[r] = _mm512_fmadd_ps(_mm512_set1_ps(d[row * nb + b]), t, acc[r]);
      }
    }
    for (int r = 0; r < 4; ++r) {
      const float* mr = m + (o + r) * nb;
      float mins = 0.f;
      for (int64_t b = 0; b < nb; ++b) mins += mr[b] * xs[b];
      y[o + r] = hsum(acc[r]) + mins;
    }
  }
#endif
  for (; o < row_end; ++o) {
    const uint8_t* q = codes + o * nb * 16;
    float total = 0.f;
    for (int64_t b = 0; b < nb; ++b) {
      float dot = 0.f;
      for (int64_t j = 0; j < 16; ++j) {
        dot += float(q[b * 16 + j] & 0xF) * x[b * kBlock + j] + float(q[b * 16 + j] >> 4) * x[b * kBlock + 16 + j];
      }
      total += d[o * nb + b] * dot + m[o * nb + b] * xs[b];
    }
    y[o] = total;
  }
}

void q4_rows(const float* x, int64_t M, int64_t K, const uint8_t* codes, const float* d, const float* m,
             const float* xs, float* y, int64_t N, int64_t row_begin, int64_t row_end) {
  const int64_t nb = K / kBlock;
  for (int64_t o = row_begin; o < row_end; ++o) {
    const uint8_t* q = codes + o * nb * 16;
    const float* dr = d + o * nb;
    const float* mr = m + o * nb;
    for (int64_t m0 = 0; m0 < M; m0 += kMaxM) {
      const int64_t mc = std::min(kMaxM, M - m0);
#if defined(__AVX512F__)
      __m512 acc[kMaxM];
      for (int64_t i = 0; i < mc; ++i) acc[i] = _mm512_setzero_ps();
      const __m512i low4 = _mm512_set1_epi32(0xF);
      for (int64_t b = 0; b < nb; ++b) {
        const __m512i bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + b * 16)));
        const __m512 lo = _mm512_cvtepi32_ps(_mm512_and_si512(bytes, low4));
        const __m512 hi = _mm512_cvtepi32_ps(_mm512_srli_epi32(bytes, 4));
        const __m512 scale = _mm512_set1_ps(dr[b]);
        for (int64_t i = 0; i < mc; ++i) {
          const float* xb = x + (m0 + i) * K + b * kBlock;
          __m512 t = _mm512_mul_ps(lo, _mm512_loadu_ps(xb));
          t = _mm512_fmadd_ps(hi, _mm512_loadu_ps(xb + 16), t);
          acc[i] = _mm512_fmadd_ps(scale, t, acc[i]);
        }
      }
      for (int64_t i = 0; i < mc; ++i) {
        const float* xsr = xs + (m0 + i) * nb;
        float mins = 0.f;
        for (int64_t b = 0; b < nb; ++b) mins += mr[b] * xsr[b];
        y[(m0 + i) * N + o] = hsum(acc[i]) + mins;
      }
#else
      for (int64_t i = 0; i < mc; ++i) {
        const float* xr = x + (m0 + i) * K;
        const float* xsr = xs + (m0 + i) * nb;
        float total = 0.f;
        for (int64_t b = 0; b < nb; ++b) {
          float dot = 0.f;
          for (int64_t j = 0; j < 16; ++j) {
            dot += float(q[b * 16 + j] & 0xF) * xr[b * kBlock + j] + float(q[b * 16 + j] >> 4) * xr[b * kBlock + 16 + j];
          }
          total += dr[b] * dot + mr[b] * xsr[b];
        }
        y[(m0 + i) * N + o] = total;
      }
#endif
    }
  }
}

void q8_rows_single(const float* x, int64_t K, const int8_t* codes, const float* d, float* y,
                    int64_t row_begin, int64_t row_end) {
  const int64_t nb = K / kBlock;
  int64_t o = row_begin;
#if defined(__AVX512F__)
  for (; o + 4 <= row_end; o += 4) {
    __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
    for (int64_t b = 0; b < nb; ++b) {
      const __m512 x0 = _mm512_loadu_ps(x + b * kBlock);
      const __m512 x1 = _mm512_loadu_ps(x + b * kBlock + 16);
      for (int r = 0; r < 4; ++r) {
        const int8_t* q = codes + (o + r) * K + b * kBlock;
        const __m512 a = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q))));
        const __m512 c = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + 16))));
        __m512 t = _mm512_mul_ps(a, x0);
        t = _mm512_fmadd_ps(c, x1, t);
        acc[r] = _mm512_fmadd_ps(_mm512_set1_ps(d[(o + r) * nb + b]), t, acc[r]);
      }
    }
    for (int r = 0; r < 4; ++r) y[o + r] = hsum(acc[r]);
  }
#endif
  for (; o < row_end; ++o) {
    float total = 0.f;
    for (int64_t b = 0; b < nb; ++b) {
      float dot = 0.f;
      for (int64_t j = 0; j < kBlock; ++j) dot += float(codes[o * K + b * kBlock + j]) * x[b * kBlock + j];
      total += d[o * nb + b] * dot;
    }
    y[o] = total;
  }
}

void q8_rows(const float* x, int64_t M, int64_t K, const int8_t* codes, const float* d, float* y, int64_t N,
             int64_t row_begin, int64_t row_end) {
  const int64_t nb = K / kBlock;
  for (int64_t o = row_begin; o < row_end; ++o) {
    const int8_t* q = codes + o * K;
    const float* dr = d + o * nb;
    for (int64_t m0 = 0; m0 < M; m0 += kMaxM) {
      const int64_t mc = std::min(kMaxM, M - m0);
#if defined(__AVX512F__)
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
#else
      for (int64_t i = 0; i < mc; ++i) {
        const float* xr = x + (m0 + i) * K;
        float total = 0.f;
        for (int64_t b = 0; b < nb; ++b) {
          float dot = 0.f;
          for (int64_t j = 0; j < kBlock; ++j) dot += float(q[b * kBlock + j]) * xr[b * kBlock + j];
          total += dr[b] * dot;
        }
        y[(m0 + i) * N + o] = total;
      }
#endif
    }
  }
}

}  // namespace

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

// x [M, K] fp32, codes int8 [N, K], d fp32 [N, K/32] -> y [M, N] fp32
torch::Tensor q8_0_linear(torch::Tensor x, torch::Tensor codes, torch::Tensor d) {
  check_inputs(x, codes, d, kBlock);
  TORCH_CHECK(codes.scalar_type() == torch::kInt8, "Q8_0 codes must be int8");
  const int64_t M = x.size(0), K = x.size(1), N = codes.size(0);
  auto y = torch::empty({M, N}, x.options());
  const float* xp = x.data_ptr<float>();
  const int8_t* qp = codes.data_ptr<int8_t>();
  const float* dp = d.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, N, kRowsPerTask * 4, [&](int64_t begin, int64_t end) {
    if (M == 1) {
      q8_rows_single(xp, K, qp, dp, yp, begin, end);
    } else {
      q8_rows(xp, M, K, qp, dp, yp, N, begin, end);
    }
  });
  return y;
}

// ---------------------------------------------------------------------------------------------
// One decoded token through a whole Llama decoder in a single call (no per-op dispatch): the
// same computation as transformers' LlamaForCausalLM for one new row, on the blocks above.

namespace {

struct Q4Weight {
  torch::Tensor codes, scales, mins;
  int64_t out() const { return codes.size(0); }
  void apply(const float* x, int64_t K, float* y, const float* xs) const {
    const uint8_t* qp = codes.data_ptr<uint8_t>();
    const float *dp = scales.data_ptr<float>(), *mp = mins.data_ptr<float>();
    at::parallel_for(0, out(), kRowsPerTask, [&](int64_t begin, int64_t end) {
      q4_rows_single(x, K, qp, dp, mp, xs, y, begin, end);
    });
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

float dot(const float* a, const float* b, int64_t n) {
  int64_t j = 0;
  float total = 0.f;
#if defined(__AVX512F__)
  __m512 acc = _mm512_setzero_ps();
  for (; j + 16 <= n; j += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(a + j), _mm512_loadu_ps(b + j), acc);
  total = hsum(acc);
#endif
  for (; j < n; ++j) total += a[j] * b[j];
  return total;
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

}  // namespace

class LlamaDecoder {
 public:
  LlamaDecoder(std::vector<torch::Tensor> qkv, std::vector<torch::Tensor> o, std::vector<torch::Tensor> gate_up,
               std::vector<torch::Tensor> down, std::vector<torch::Tensor> input_norms,
               std::vector<torch::Tensor> post_norms, torch::Tensor final_norm, torch::Tensor head_codes,
               torch::Tensor head_scales, int64_t heads, int64_t kv_heads, int64_t head_dim, double eps, double scale)
      : input_norms_(input_norms), post_norms_(post_norms), final_norm_(final_norm), head_codes_(head_codes),
        head_scales_(head_scales), heads_(heads), kv_heads_(kv_heads), head_dim_(head_dim), eps_(eps), scale_(scale) {
    TORCH_CHECK(qkv.size() % 3 == 0 && o.size() == qkv.size() && gate_up.size() == qkv.size() && down.size() == qkv.size(), "weights come as (codes, scales, mins) triples");
    for (size_t i = 0; i < qkv.size(); i += 3) {
      qkv_.push_back({qkv[i], qkv[i + 1], qkv[i + 2]});
      o_.push_back({o[i], o[i + 1], o[i + 2]});
      gate_up_.push_back({gate_up[i], gate_up[i + 1], gate_up[i + 2]});
      down_.push_back({down[i], down[i + 1], down[i + 2]});
    }
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
    std::vector<float> x(std::max(H, inter)), qkv(q_width + 2 * kv_width), attn(q_width), out(std::max(H, 2 * inter)),
        sums(std::max(H, inter) / kBlock + 1), act(inter);
    const float *cp = cos.data_ptr<float>(), *sp = sin.data_ptr<float>();
    for (int64_t l = 0; l < layers; ++l) {
      rms_norm(hp, input_norms_[l].data_ptr<float>(), H, eps_, x.data());
      sums_of_blocks(x.data(), H, sums.data());
      qkv_[l].apply(x.data(), H, qkv.data(), sums.data());
      float* q = qkv.data();
      float* k = q + q_width;
      float* v = k + kv_width;
      for (int64_t hd = 0; hd < heads_; ++hd) rotate(q + hd * D, cp, sp, D);
      for (int64_t g = 0; g < kv_heads_; ++g) rotate(k + g * D, cp, sp, D);
      float* kl = keys.data_ptr<float>() + l * kv_heads_ * capacity * D;
      float* vl = values.data_ptr<float>() + l * kv_heads_ * capacity * D;
      for (int64_t g = 0; g < kv_heads_; ++g) {
        std::copy(k + g * D, k + (g + 1) * D, kl + (g * capacity + pos) * D);
        std::copy(v + g * D, v + (g + 1) * D, vl + (g * capacity + pos) * D);
      }
      attend(q, kl, vl, capacity, pos + 1, attn.data());
      sums_of_blocks(attn.data(), q_width, sums.data());
      o_[l].apply(attn.data(), q_width, out.data(), sums.data());
      for (int64_t i = 0; i < H; ++i) hp[i] += out[i];
      rms_norm(hp, post_norms_[l].data_ptr<float>(), H, eps_, x.data());
      sums_of_blocks(x.data(), H, sums.data());
      gate_up_[l].apply(x.data(), H, out.data(), sums.data());
      for (int64_t i = 0; i < inter; ++i) {
        const float g = out[i];
        act[i] = g / (1.0f + std::exp(-g)) * out[inter + i];
      }
      sums_of_blocks(act.data(), inter, sums.data());
      down_[l].apply(act.data(), inter, out.data(), sums.data());
      for (int64_t i = 0; i < H; ++i) hp[i] += out[i];
    }
    rms_norm(hp, final_norm_.data_ptr<float>(), H, eps_, x.data());
    auto logits = torch::empty({head_codes_.size(0)}, hidden.options());
    const int8_t* hq = head_codes_.data_ptr<int8_t>();
    const float* hs = head_scales_.data_ptr<float>();
    float* lp = logits.data_ptr<float>();
    const float* xp = x.data();
    at::parallel_for(0, head_codes_.size(0), kRowsPerTask * 4, [&](int64_t begin, int64_t end) {
      q8_rows_single(xp, H, hq, hs, lp, begin, end);
    });
    return logits;
  }

 private:
  // softmax(q k^T * scale) v for every query head over rows [0, rows) of its key/value group.
  // The query heads of one group are handled together so that each cached row is read once.
  void attend(const float* q, const float* keys, const float* values, int64_t capacity, int64_t rows, float* out) {
    const int64_t D = head_dim_, group = heads_ / kv_heads_;
    at::parallel_for(0, kv_heads_, 1, [&](int64_t begin, int64_t end) {
      std::vector<float> scores(group * rows), tops(group), totals(group);
      for (int64_t g = begin; g < end; ++g) {
        const float* kg = keys + g * capacity * D;
        const float* vg = values + g * capacity * D;
        const float* qg = q + g * group * D;
        std::fill(tops.begin(), tops.end(), -INFINITY);
        for (int64_t r = 0; r < rows; ++r) {
          for (int64_t h = 0; h < group; ++h) {
            const float score = dot(qg + h * D, kg + r * D, D) * float(scale_);
            scores[h * rows + r] = score;
            tops[h] = std::max(tops[h], score);
          }
        }
        for (int64_t h = 0; h < group; ++h) {
          float total = 0.f;
          float* sh = scores.data() + h * rows;
          for (int64_t r = 0; r < rows; ++r) {
            sh[r] = std::exp(sh[r] - tops[h]);
            total += sh[r];
          }
          totals[h] = total;
          std::fill(out + (g * group + h) * D, out + (g * group + h + 1) * D, 0.f);
        }
        for (int64_t r = 0; r < rows; ++r) {
          const float* vr = vg + r * D;
          for (int64_t h = 0; h < group; ++h) {
            const float p = scores[h * rows + r] / totals[h];
            float* oh = out + (g * group + h) * D;
            for (int64_t j = 0; j < D; ++j) oh[j] += p * vr[j];
          }
        }
      }
    });
  }

  std::vector<Q4Weight> qkv_, o_, gate_up_, down_;
  std::vector<torch::Tensor> input_norms_, post_norms_;
  torch::Tensor final_norm_, head_codes_, head_scales_;
  int64_t heads_, kv_heads_, head_dim_;
  double eps_, scale_;
};

PYBIND11_MODULE(TORCH_EXTENSION_NAME, module) {
  // no Python object is touched inside: other Python threads run while a kernel computes
  module.def("q4_1_linear", &q4_1_linear, "x @ dequant(Q4_1 blocks).T in fp32",
             pybind11::call_guard<pybind11::gil_scoped_release>());
  module.def("q8_0_linear", &q8_0_linear, "x @ dequant(Q8_0 blocks).T in fp32",
             pybind11::call_guard<pybind11::gil_scoped_release>());
  pybind11::class_<LlamaDecoder>(module, "LlamaDecoder")
      .def(pybind11::init<std::vector<torch::Tensor>, std::vector<torch::Tensor>, std::vector<torch::Tensor>,
                          std::vector<torch::Tensor>, std::vector<torch::Tensor>, std::vector<torch::Tensor>,
                          torch::Tensor, torch::Tensor, torch::Tensor, int64_t, int64_t, int64_t, double, double>())
      .def("step", &LlamaDecoder::step, "one decoded token through every layer; returns logits",
           pybind11::call_guard<pybind11::gil_scoped_release>());
}
