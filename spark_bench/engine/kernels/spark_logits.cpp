// Decode-step attention logits q·k̃ over compact key stores (SparK fixed-T, ThinK), without rebuilding S×D keys.
//
// The stores of a whole decode batch are described by one *segment table* (see storage/segments.py): a segment is
// a run of tokens of one query head's store with one layout, and all segments' data live in flat arrays. Per token
// t of a segment (kept-channel mask m_t with T set bits, kept values in channel order):
//   q·k̃_t = Σ_{c∈K_t} q_c k_tc + R_t,  where the recovery term R_t is
//   mode 0, constant fill f:            f · (Σ_c a_c − Σ_{c∈K_t} a_c)                 a = q
//   mode 1, paper degenerate μ_t/q̄_c:   μ_t · (Σ_c a_c − Σ_{c∈K_t} a_c),              a_c = q_c / q̄_c (0 where q̄_c = 0)
//   mode 2, official sign·sqrt(μ_t/‖q_c‖): sqrt(μ_t) · Σ_{c∈P_t} s_tc a_c,          a_c = q_c / sqrt(‖q_c‖)
//            = sqrt(μ_t) · (2 Σ_{c∈P_t, s=+} a_c − Σ_c a_c + Σ_{c∈K_t} a_c)
//   mode 3, dense (every channel kept, no mask: ThinK's recent tokens)
// A segment whose tokens keep different numbers of channels (T = −1: ties kept by Mustafar's threshold, SparK-p/-g)
// finds token t's kept entries from a table of where each 16-token granule's entries start (int32, relative to the
// segment's first entry) plus the kept counts (mask popcounts) of the granule's tokens before t.
// a = q · aux_scale (per query head, per channel) is formed here. Modes 0 and 1 fold into a per-token correction
// over the T kept channels only. Mode 2 needs the signs of the pruned entries (flat bits, in pruned order): they are
// deposited onto the pruned channel positions (pdep) and the positive ones summed 8 channels at a time through
// per-byte lookup tables of a. A segment's mask row may be shared by all its tokens (mask stride 0: ThinK's one
// channel set per head). G (query rows per kv-head) is a template parameter so the per-channel work vectorises.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <cstring>
#include <tuple>
#include <vector>
#ifdef __BMI2__
#include <immintrin.h>
#endif

// segment table columns (storage/segments.py PART_COLUMNS): each array is read from one of several parts (the rows'
// own tensors, no copy), at an offset inside that part
enum { QH = 0, OUT_OFF, N_TOK, T_KEPT, KEPT_PART, KEPT_OFF, MASK_PART, MASK_OFF, MASK_STRIDE, MU_PART, MU_OFF,
       SIGN_PART, SIGN_OFF, MODE, START_PART, START_OFF, N_COLS };
constexpr int64_t GRANULE = 16;  // tokens per entry of a ragged segment's start table (storage/segments.py)

template <typename T>
static std::vector<const T*> pointers(const std::vector<torch::Tensor>& parts) {
  std::vector<const T*> out;
  for (const auto& p : parts) {
    TORCH_CHECK(p.device().is_cpu() && (p.numel() == 0 || p.stride(-1) == 1), "segment parts must be CPU tensors "
                "whose rows are contiguous (the table's offsets account for their strides)");
    out.push_back(p.numel() ? p.data_ptr<T>() : nullptr);
  }
  return out;
}

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

// q·k over D contiguous channels, vectorised (the compiler may reorder the float32 sum: -fopenmp-simd)
template <typename scalar_t>
static inline float dot(const float* q, const scalar_t* k, int64_t D) {
  float s = 0.f;
#pragma omp simd reduction(+ : s)
  for (int64_t c = 0; c < D; ++c) s += q[c] * static_cast<float>(k[c]);
  return s;
}

template <typename scalar_t, int G>
static void run(const float* q,          // (QH, G, D) queries
                const float* aux_scale,  // (QH, D)
                const int64_t* table, int64_t nseg, const float* fills,
                const std::vector<const scalar_t*>& kept, const std::vector<const uint8_t*>& mask,
                const std::vector<const scalar_t*>& mu, const std::vector<const uint8_t*>& signs,
                const std::vector<int64_t>& sign_bits, const std::vector<const int32_t*>& starts,
                int64_t heads, int64_t D, int64_t Smax,
                const scalar_t* tail, int64_t tail_cap, int64_t tail_len, int64_t q_len, int64_t g0,
                float* out) {            // (QH, G, W), −inf-initialised; W = Smax + tail_len
  const int64_t nbytes = D / 8, words = (D + 63) / 64, W = Smax + tail_len;
  // per query head: q and a = q·aux_scale transposed to (D, G), and Σ_c a_c
  std::vector<float> qT(heads * D * G), aT(heads * D * G), totals(heads * G, 0.f);
  for (int64_t h = 0; h < heads; ++h)
    for (int64_t c = 0; c < D; ++c)
      for (int g = 0; g < G; ++g) {
        const float v = q[(h * G + g) * D + c];
        const float a = v * aux_scale[h * D + c];
        qT[(h * D + c) * G + g] = v;
        aT[(h * D + c) * G + g] = a;
        totals[h * G + g] += a;
      }
  // mode 2 lookup tables for the query heads that need them: table[h][j][b][g] = Σ_{i ∈ bits(b)} a[8j + i][g]
  std::vector<int64_t> table_of(heads, -1);
  int64_t n_tables = 0;
  for (int64_t s = 0; s < nseg; ++s)
    if (table[s * N_COLS + MODE] == 2 && table_of[table[s * N_COLS + QH]] < 0)
      table_of[table[s * N_COLS + QH]] = n_tables++;
  std::vector<float> tables(n_tables * nbytes * 256 * G, 0.f);
  for (int64_t h = 0; h < heads; ++h) {
    if (table_of[h] < 0) continue;
    for (int64_t j = 0; j < nbytes; ++j) {
      float* tab = tables.data() + ((table_of[h] * nbytes + j) * 256) * G;
      for (int b = 1; b < 256; ++b) {
        const float* vc = aT.data() + (h * D + 8 * j + __builtin_ctz(b)) * G;
        for (int g = 0; g < G; ++g) tab[b * G + g] = tab[(b & (b - 1)) * G + g] + vc[g];
      }
    }
  }
  std::vector<int64_t> start(nseg + 1, 0);  // first flat token of each segment
  for (int64_t s = 0; s < nseg; ++s) start[s + 1] = start[s] + table[s * N_COLS + N_TOK];
  at::parallel_for(0, start[nseg], 256, [&](int64_t begin, int64_t end) {
    float acc[G], rec[G], pos_sum[G];
    int64_t s = std::upper_bound(start.begin(), start.end(), begin) - start.begin() - 1;
    int64_t next_seg = -1, next_t = -1, next_at = 0;  // a ragged segment's token after the last one: its entries' start
    for (int64_t flat = begin; flat < end; ++flat) {
      while (flat >= start[s + 1]) ++s;
      const int64_t* seg = table + s * N_COLS;
      const int64_t h = seg[QH], t = flat - start[s], T = seg[T_KEPT], mode = seg[MODE];
      const float* qh = qT.data() + h * D * G;
      const float* ah = aT.data() + h * D * G;
      for (int g = 0; g < G; ++g) acc[g] = rec[g] = pos_sum[g] = 0.f;
      int64_t at = t * T;  // the token's first kept entry (fixed T), else from the granule's start and counts
      if (T < 0) {
        if (s == next_seg && t == next_t) {
          at = next_at;
        } else {
          const uint8_t* m0 = mask[seg[MASK_PART]] + seg[MASK_OFF] * nbytes;
          at = starts[seg[START_PART]][seg[START_OFF] + t / GRANULE];
          for (int64_t u = t - t % GRANULE; u < t; ++u)
            for (int64_t w = 0; w < words; ++w)
              at += __builtin_popcountll(load_word(m0 + u * nbytes + 8 * w, (int)std::min<int64_t>(8, nbytes - 8 * w)));
        }
      }
      const scalar_t* k = kept[seg[KEPT_PART]] + seg[KEPT_OFF] + at;
      if (mode == 3) {
        for (int g = 0; g < G; ++g) acc[g] = dot(q + (h * G + g) * D, k, D);
      } else {
        const uint8_t* m = mask[seg[MASK_PART]] + (seg[MASK_OFF] + t * seg[MASK_STRIDE]) * nbytes;
        int64_t p = 0, sign_pos = seg[SIGN_OFF] + t * D - at;  // the pruned entries of the tokens before
        for (int64_t w = 0; w < words; ++w) {
          const int wbytes = (int)std::min<int64_t>(8, nbytes - 8 * w);
          const uint64_t valid = wbytes == 8 ? ~0ULL : ((1ULL << (8 * wbytes)) - 1);
          const uint64_t km = load_word(m + 8 * w, wbytes);
          for (uint64_t bits = km; bits; bits &= bits - 1) {  // kept channels, ascending: q·k and Σ_kept a
            const int64_t c = 64 * w + __builtin_ctzll(bits);
            const float kv = static_cast<float>(k[p++]);
            const float* qc = qh + c * G;
            const float* ac = ah + c * G;
            for (int g = 0; g < G; ++g) {
              acc[g] += qc[g] * kv;
              rec[g] += ac[g];
            }
          }
          if (mode == 2) {  // positive pruned entries, 8 channels per table lookup
            const uint64_t pm = ~km & valid;
            const int n = __builtin_popcountll(pm);
            const uint64_t pos = deposit(read_bits(signs[seg[SIGN_PART]], sign_bits[seg[SIGN_PART]], sign_pos, n), pm);
            sign_pos += n;
            const float* tb = tables.data() + (table_of[h] * nbytes + 8 * w) * 256 * G;
            for (int j = 0; j < wbytes; ++j) {
              const float* tp = tb + (j * 256 + ((pos >> (8 * j)) & 0xFF)) * G;
              for (int g = 0; g < G; ++g) pos_sum[g] += tp[g];
            }
          }
        }
        if (T < 0) next_seg = s, next_t = t + 1, next_at = at + p;
      }
      float* o = out + h * G * W + seg[OUT_OFF] + t;
      const float* tot = totals.data() + h * G;
      if (mode == 3) {
        for (int g = 0; g < G; ++g) o[g * W] = acc[g];
      } else if (mode == 2) {  // Σ_pruned s·a = 2 Σ_{pruned,+} a − (Σ_all a − Σ_kept a)
        const float sq = std::sqrt(std::max(static_cast<float>(mu[seg[MU_PART]][seg[MU_OFF] + t]), 0.f));
        for (int g = 0; g < G; ++g) o[g * W] = acc[g] + sq * (2.f * pos_sum[g] - tot[g] + rec[g]);
      } else {
        const float scale = mode == 1 ? static_cast<float>(mu[seg[MU_PART]][seg[MU_OFF] + t]) : fills[s];
        for (int g = 0; g < G; ++g) o[g * W] = acc[g] + scale * (tot[g] - rec[g]);
      }
    }
  });
  if (tail_len == 0) return;
  // the decoded tail: query head h reads tail row h (dense, tail_cap slots, the first tail_len filled) into
  // positions Smax + t; query row r = g0 + g is query position r % q_len of the step, which sees tail tokens
  // t ≤ tail_len − q_len + r % q_len (causal among the step's own tokens), the rest stay −inf
  at::parallel_for(0, heads * tail_len, 256, [&](int64_t begin, int64_t end) {
    for (int64_t flat = begin; flat < end; ++flat) {
      const int64_t h = flat / tail_len, t = flat % tail_len;
      const scalar_t* k = tail + (h * tail_cap + t) * D;
      float* o = out + h * G * W + Smax + t;
      for (int g = 0; g < G; ++g)
        if (t <= tail_len - q_len + (g0 + g) % q_len) o[g * W] = dot(q + (h * G + g) * D, k, D);
    }
  });
}

torch::Tensor spark_segments(torch::Tensor q, torch::Tensor aux_scale, torch::Tensor table, torch::Tensor fills,
                             std::vector<torch::Tensor> kept, std::vector<torch::Tensor> mask,
                             std::vector<torch::Tensor> mu, std::vector<torch::Tensor> signs,
                             std::vector<torch::Tensor> starts, int64_t Smax,
                             torch::Tensor tail, int64_t tail_len, int64_t q_len, int64_t g0) {
  TORCH_CHECK(q.is_contiguous() && aux_scale.is_contiguous() && table.is_contiguous() && fills.is_contiguous());
  TORCH_CHECK(!kept.empty(), "segment stack without kept parts");
  TORCH_CHECK(q.scalar_type() == at::kFloat && aux_scale.scalar_type() == at::kFloat, "queries must be float32");
  TORCH_CHECK(table.size(1) == N_COLS, "segment table needs ", (int)N_COLS, " columns");
  const int64_t heads = q.size(0), G = q.size(1), D = q.size(2);
  TORCH_CHECK(D % 8 == 0, "head_dim must be a multiple of 8");
  TORCH_CHECK(G >= 1 && G <= 8, "query rows per kv-head must be 1..8, got ", G);
  const auto dtype = kept[0].scalar_type();
  for (const auto& p : kept) TORCH_CHECK(p.scalar_type() == dtype, "kept parts must share one dtype");
  for (const auto& p : mu) TORCH_CHECK(!p.numel() || p.scalar_type() == dtype, "mu must have the kept entries' dtype");
  std::vector<int64_t> sign_bits;
  for (const auto& p : signs) sign_bits.push_back(8 * p.numel());
  TORCH_CHECK(!tail_len || (tail.is_contiguous() && tail.scalar_type() == dtype && tail.size(0) == heads
                            && tail.size(2) == D), "tail keys must be (QH, capacity, D) in the kept entries' dtype");
  TORCH_CHECK(q_len >= 1, "q_len must be ≥ 1");
  const int64_t tail_cap = tail_len ? tail.size(1) : 0;
  auto out = torch::full({heads, G, Smax + tail_len}, -INFINITY, q.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, dtype, "spark_segments", [&] {
    const auto kept_p = pointers<scalar_t>(kept), mu_p = pointers<scalar_t>(mu);
    const auto mask_p = pointers<uint8_t>(mask), signs_p = pointers<uint8_t>(signs);
    const auto starts_p = pointers<int32_t>(starts);
    auto args = std::make_tuple(q.data_ptr<float>(), aux_scale.data_ptr<float>(), table.data_ptr<int64_t>(),
                                table.size(0), fills.data_ptr<float>(), std::cref(kept_p), std::cref(mask_p),
                                std::cref(mu_p), std::cref(signs_p), std::cref(sign_bits), std::cref(starts_p), heads,
                                D, Smax,
                                tail_len ? tail.data_ptr<scalar_t>() : (scalar_t*)nullptr, tail_cap, tail_len,
                                q_len, g0, out.data_ptr<float>());
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

// Weights · values over value segments: out[qh][g][c] = Σ_t w[qh][g][w_off + t] · v[val_off + t·D + c].
// A value segment is a run of one query head's tokens: dense rows (a row's kv-head reads its own, or a shared, value
// tensor), or value-sparse (MASK_PART ≥ 0: Mustafar's values, value_ratio > 0): per token a D-bit mask and its kept
// entries flat in channel order, pruned entries 0, walked in token order from the head's first entry. A head may have
// two segments (Mustafar's sparse tokens, then its dense window at w_off = their count): each segment's sum is
// computed on its own, then a head's segments and its decoded tail are added in table order. float32 accumulation in
// token order. Dense segments sharing a value tensor are adjacent in the table and computed in one pass over it.
enum { PV_QH = 0, PV_W_OFF, PV_N_TOK, PV_VAL_PART, PV_VAL_OFF, PV_MASK_PART, PV_MASK_OFF, PV_COLS };

template <typename scalar_t>
static void run_pv(const float* w, const int64_t* table, int64_t nseg, const std::vector<const scalar_t*>& values,
                   const std::vector<const uint8_t*>& masks, int64_t heads, int64_t G,
                   int64_t W, int64_t D, const scalar_t* tail, int64_t tail_cap, int64_t tail_start,
                   int64_t tail_len, float* out) {
  // runs of consecutive dense segments reading the same value tensor (the caller orders the table so): the tensor is
  // read once per run, each of its tokens weighted into every segment of the run (as a GEMM would); a value-sparse
  // segment is a run of its own
  const int64_t nbytes = D / 8, words = (D + 63) / 64;
  auto sparse = [&](int64_t s) { return table[s * PV_COLS + PV_MASK_PART] >= 0; };
  std::vector<int64_t> runs{0};
  for (int64_t s = 1; s < nseg; ++s)
    if (sparse(s) || sparse(s - 1)
        || table[s * PV_COLS + PV_VAL_OFF] != table[(s - 1) * PV_COLS + PV_VAL_OFF]
        || table[s * PV_COLS + PV_VAL_PART] != table[(s - 1) * PV_COLS + PV_VAL_PART]
        || table[s * PV_COLS + PV_N_TOK] != table[(s - 1) * PV_COLS + PV_N_TOK]) runs.push_back(s);
  runs.push_back(nseg);
  std::vector<float> sums(nseg * G * D, 0.f);  // each segment's Σ_t w · v
  at::parallel_for(0, (int64_t)runs.size() - 1, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> vt(D);
    for (int64_t r = begin; r < end; ++r) {
      const int64_t first = runs[r], count = runs[r + 1] - first;
      const int64_t* seg0 = table + first * PV_COLS;
      const scalar_t* v = values[seg0[PV_VAL_PART]] + seg0[PV_VAL_OFF];
      if (seg0[PV_MASK_PART] >= 0) {  // value-sparse: token t's kept entries start where t − 1's ended
        const uint8_t* m = masks[seg0[PV_MASK_PART]] + seg0[PV_MASK_OFF];
        const float* wh = w + seg0[PV_QH] * G * W + seg0[PV_W_OFF];
        float* a = sums.data() + first * G * D;
        int64_t at = 0;
        for (int64_t t = 0; t < seg0[PV_N_TOK]; ++t) {
          for (int64_t k = 0; k < words; ++k) {
            const uint64_t bits0 = load_word(m + t * nbytes + 8 * k, (int)std::min<int64_t>(8, nbytes - 8 * k));
            for (uint64_t bits = bits0; bits; bits &= bits - 1) {
              const int64_t c = 64 * k + __builtin_ctzll(bits);
              const float x = static_cast<float>(v[at++]);
              for (int64_t g = 0; g < G; ++g) a[g * D + c] += wh[g * W + t] * x;
            }
          }
        }
        continue;
      }
      for (int64_t t = 0; t < seg0[PV_N_TOK]; ++t) {
        for (int64_t c = 0; c < D; ++c) vt[c] = static_cast<float>(v[t * D + c]);
        for (int64_t i = 0; i < count; ++i) {
          const int64_t* seg = table + (first + i) * PV_COLS;
          const float* wh = w + seg[PV_QH] * G * W + seg[PV_W_OFF] + t;
          for (int64_t g = 0; g < G; ++g) {
            const float wt = wh[g * W];
            if (wt == 0.f) continue;
            float* a = sums.data() + ((first + i) * G + g) * D;
#pragma omp simd
            for (int64_t c = 0; c < D; ++c) a[c] += wt * vt[c];
          }
        }
      }
    }
  });
  std::vector<std::vector<int64_t>> of_head(heads);  // each head's segments, in table order
  for (int64_t s = 0; s < nseg; ++s) of_head[table[s * PV_COLS + PV_QH]].push_back(s);
  at::parallel_for(0, heads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t h = begin; h < end; ++h) {
      float* o = out + h * G * D;
      for (const int64_t s : of_head[h])
        for (int64_t k = 0; k < G * D; ++k) o[k] += sums[s * G * D + k];
      if (of_head[h].empty()) continue;
      const float* wtail = w + h * G * W + tail_start;  // the head's own decoded tail: weights at tail_start + t
      for (int64_t t = 0; t < tail_len; ++t) {
        const scalar_t* tv = tail + (h * tail_cap + t) * D;
        for (int64_t g = 0; g < G; ++g) {
          const float wt = wtail[g * W + t];
          if (wt == 0.f) continue;
          float* a = o + g * D;
#pragma omp simd
          for (int64_t c = 0; c < D; ++c) a[c] += wt * static_cast<float>(tv[c]);
        }
      }
    }
  });
}

torch::Tensor pv_segments(torch::Tensor w, torch::Tensor table, std::vector<torch::Tensor> values,
                          std::vector<torch::Tensor> masks, int64_t D, torch::Tensor tail, int64_t tail_start,
                          int64_t tail_len) {
  TORCH_CHECK(w.is_contiguous() && table.is_contiguous() && !values.empty());
  TORCH_CHECK(w.scalar_type() == at::kFloat, "weights must be float32");
  TORCH_CHECK(table.size(1) == PV_COLS, "value segment table needs ", (int)PV_COLS, " columns");
  const int64_t heads = w.size(0), G = w.size(1), W = w.size(2);
  TORCH_CHECK(!tail_len || (tail.is_contiguous() && tail.scalar_type() == values[0].scalar_type()
                            && tail.size(0) == heads && tail_start + tail_len <= W), "tail values must be (QH, cap, D)");
  auto out = torch::zeros({heads, G, D}, w.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, values[0].scalar_type(), "pv_segments", [&] {
    run_pv<scalar_t>(w.data_ptr<float>(), table.data_ptr<int64_t>(), table.size(0), pointers<scalar_t>(values),
                     pointers<uint8_t>(masks), heads, G, W, D, tail_len ? tail.data_ptr<scalar_t>() : (scalar_t*)nullptr,
                     tail_len ? tail.size(1) : 0, tail_start, tail_len, out.data_ptr<float>());
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("spark_segments", &spark_segments);
                                  m.def("pv_segments", &pv_segments); }
