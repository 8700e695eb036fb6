// Decode-step attention logits q·k̃ over a compact SparK key store, without rebuilding the S×D key matrix.
//
// Per token t (kept-channel mask m_t with T set bits, kept values in channel order):
//   q·k̃_t = Σ_{c∈K_t} q_c k_tc + R_t,  where the recovery term R_t is
//   mode 0, constant fill f:            f · (Σ_c q_c − Σ_{c∈K_t} q_c)
//   mode 1, paper degenerate μ_t/q̄_c:   μ_t · (Σ_c u_c − Σ_{c∈K_t} u_c),   u_c = q_c / q̄_c (0 where q̄_c = 0)
//   mode 2, official sign·sqrt(μ_t/‖q_c‖): sqrt(μ_t) · Σ_{c∈P_t} s_tc v_c,  v_c = q_c / sqrt(‖q_c‖)
//            = sqrt(μ_t) · (2 Σ_{c∈P_t, s=+} v_c − Σ_c v_c + Σ_{c∈K_t} v_c)
// Modes 0 and 1 fold into a per-token correction over the T kept channels only. Mode 2 needs the signs of the
// pruned entries (stored flat, in pruned order): they are deposited onto the pruned channel positions (pdep) and
// the positive ones summed 8 channels at a time through per-byte lookup tables of v.
// G (query heads per kv-head) is a template parameter so the per-channel work over G vectorises.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <cstring>
#include <tuple>
#include <vector>
#ifdef __BMI2__
#include <immintrin.h>
#endif

static inline uint64_t load_word(const uint8_t* p, int nbytes) {
  uint64_t w = 0;
  std::memcpy(&w, p, nbytes);  // little-endian: bit i of the word = channel i of the block
  return w;
}

static inline uint64_t read_bits(const uint8_t* bits, int64_t nbits_total, int64_t pos, int n) {
  // n ≤ 64 bits starting at bit `pos` of a little-endian packed bit stream
  if (n == 0) return 0;
  int64_t byte = pos >> 3;
  int shift = pos & 7;
  int64_t nbytes_total = (nbits_total + 7) >> 3;
  uint8_t buf[16] = {0};
  int64_t take = std::min<int64_t>(16, nbytes_total - byte);
  std::memcpy(buf, bits + byte, take);
  unsigned __int128 v = 0;
  std::memcpy(&v, buf, 16);
  v >>= shift;
  uint64_t out = (uint64_t)v;
  return n == 64 ? out : (out & ((1ULL << n) - 1));
}

static inline uint64_t deposit(uint64_t src, uint64_t mask) {
#ifdef __BMI2__
  return _pdep_u64(src, mask);
#else
  uint64_t out = 0;
  for (uint64_t bb = 1; mask; bb += bb) {
    if (src & bb) out |= mask & -mask;
    mask &= mask - 1;
  }
  return out;
#endif
}

template <typename scalar_t, int G>
static void run(const float* qT,        // (R_heads, D, G)   query channels, G contiguous
                const float* aux,       // (R_heads, D, G)   u (mode 1) or v (mode 2) per query, G contiguous
                const float* totals,    // (R_heads, G)      Σ_c q_c (mode 0), Σ_c u_c (mode 1), Σ_c v_c (mode 2)
                const uint8_t* mask,    // (R_heads, S, D/8)
                const scalar_t* kept,   // (R_heads * S * T)
                const scalar_t* mu,     // (R_heads, S)
                const uint8_t* signs, int64_t n_signs,
                float fill, int mode, int64_t heads, int64_t S, int64_t D, int64_t T,
                float* out) {          // (R_heads, G, S)
  const int64_t nbytes = D / 8, words = (D + 63) / 64, P = D - T;
  // mode 2 lookup tables: table[h][j][b][g] = Σ_{i ∈ bits(b)} v[8j + i][g]
  std::vector<float> tables;
  if (mode == 2) {
    tables.assign(heads * nbytes * 256 * G, 0.f);
    for (int64_t h = 0; h < heads; ++h)
      for (int64_t j = 0; j < nbytes; ++j) {
        float* tab = tables.data() + ((h * nbytes + j) * 256) * G;
        for (int b = 1; b < 256; ++b) {
          const float* vc = aux + (h * D + 8 * j + __builtin_ctz(b)) * G;
          for (int g = 0; g < G; ++g) tab[b * G + g] = tab[(b & (b - 1)) * G + g] + vc[g];
        }
      }
  }
  at::parallel_for(0, heads * S, 256, [&](int64_t begin, int64_t end) {
    float acc[G], rec[G], pos_sum[G];
    for (int64_t row = begin; row < end; ++row) {
      const int64_t h = row / S, t = row % S;
      const float* q = qT + h * D * G;
      const float* a = (mode == 0 ? qT : aux) + h * D * G;
      const uint8_t* m = mask + row * nbytes;
      const scalar_t* k = kept + row * T;
      for (int g = 0; g < G; ++g) acc[g] = rec[g] = pos_sum[g] = 0.f;
      int64_t p = 0, sign_pos = row * P;
      for (int64_t w = 0; w < words; ++w) {
        const int wbytes = (int)std::min<int64_t>(8, nbytes - 8 * w);
        const uint64_t valid = wbytes == 8 ? ~0ULL : ((1ULL << (8 * wbytes)) - 1);
        const uint64_t km = load_word(m + 8 * w, wbytes);
        for (uint64_t bits = km; bits; bits &= bits - 1) {  // kept channels, ascending: q·k and Σ_kept aux
          const int64_t c = 64 * w + __builtin_ctzll(bits);
          const float kv = static_cast<float>(k[p++]);
          const float* qc = q + c * G;
          const float* ac = a + c * G;
          for (int g = 0; g < G; ++g) {
            acc[g] += qc[g] * kv;
            rec[g] += ac[g];
          }
        }
        if (mode == 2) {  // positive pruned entries, 8 channels per table lookup
          const uint64_t pm = ~km & valid;
          const int n = __builtin_popcountll(pm);
          const uint64_t pos = deposit(read_bits(signs, n_signs, sign_pos, n), pm);
          sign_pos += n;
          for (int j = 0; j < wbytes; ++j) {
            const float* tp = tables.data() + ((h * nbytes + 8 * w + j) * 256 + ((pos >> (8 * j)) & 0xFF)) * G;
            for (int g = 0; g < G; ++g) pos_sum[g] += tp[g];
          }
        }
      }
      float* o = out + h * G * S + t;
      const float* tot = totals + h * G;
      if (mode == 2) {  // Σ_pruned s·v = 2 Σ_{pruned,+} v − (Σ_all v − Σ_kept v)
        const float sq = std::sqrt(std::max(static_cast<float>(mu[row]), 0.f));
        for (int g = 0; g < G; ++g) o[g * S] = acc[g] + sq * (2.f * pos_sum[g] - tot[g] + rec[g]);
      } else {
        const float scale = mode == 1 ? static_cast<float>(mu[row]) : fill;
        for (int g = 0; g < G; ++g) o[g * S] = acc[g] + scale * (tot[g] - rec[g]);
      }
    }
  });
}

torch::Tensor spark_logits(torch::Tensor qT, torch::Tensor aux, torch::Tensor totals, torch::Tensor mask,
                           torch::Tensor kept, torch::Tensor mu, torch::Tensor signs, int64_t n_signs,
                           double fill, int64_t mode, int64_t S, int64_t D, int64_t T) {
  TORCH_CHECK(qT.is_contiguous() && aux.is_contiguous() && mask.is_contiguous() && kept.is_contiguous());
  TORCH_CHECK(D % 8 == 0, "head_dim must be a multiple of 8");
  const int64_t heads = qT.size(0), G = qT.size(2);
  TORCH_CHECK(G >= 1 && G <= 8, "query heads per kv-head must be 1..8, got ", G);
  auto out = torch::empty({heads, G, S}, qT.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, kept.scalar_type(), "spark_logits", [&] {
    auto args = std::make_tuple(qT.data_ptr<float>(), aux.data_ptr<float>(), totals.data_ptr<float>(),
                                mask.data_ptr<uint8_t>(), kept.data_ptr<scalar_t>(),
                                mu.numel() ? mu.data_ptr<scalar_t>() : (scalar_t*)nullptr,
                                signs.numel() ? signs.data_ptr<uint8_t>() : (uint8_t*)nullptr, n_signs, (float)fill,
                                (int)mode, heads, S, D, T, out.data_ptr<float>());
    switch (G) {
      case 1: std::apply(run<scalar_t, 1>, args); break;
      case 2: std::apply(run<scalar_t, 2>, args); break;
      case 3: std::apply(run<scalar_t, 3>, args); break;
      case 4: std::apply(run<scalar_t, 4>, args); break;
      case 5: std::apply(run<scalar_t, 5>, args); break;
      case 6: std::apply(run<scalar_t, 6>, args); break;
      case 7: std::apply(run<scalar_t, 7>, args); break;
      default: std::apply(run<scalar_t, 8>, args); break;
    }
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("spark_logits", &spark_logits); }
