// Host-side check of every index mapping sparse_attn_fwd.cu relies on, evaluated with the same
// CuTe types on a CPU (no GPU needed): tests/test_cutlass_build.py compiles and runs it.
//  1. the (rows, cols) view of the S and O accumulators groups each thread's values by row,
//     each row is shared by the 4 lanes of a quad (lanes 4k..4k+3) whose columns partition it;
//  2. LayoutPA maps each A-operand register of the P V wgmma to the S accumulator value holding
//     the same (row, key) coordinate (fp8: after P8Shuffle, emulated lane by lane);
//  3. the swizzled shared-memory layouts are bijections whose 16-byte chunks are contiguous
//     (one cp.async each), the V^T view addresses the same element as V (16-bit), and every
//     TMA box lands as the hardware's swizzle pattern says (fp8 V^T: 64-byte swizzle), a
//     page box of 8, 16 or 32 rows included;
//     16-bit correction chunks pair S slot j with slot j + half (the lo part of its block);
//  4. the warpgroup of a thread owns rows [64 w, 64 w + 64);
//  5. the producer's page-id shuffles (RowPages) hand each cp.async row its own page.
#include <cstdio>
#include <set>
#include <vector>

#include "sparse_attn_traits.cuh"

using namespace cute;

static int failures = 0;
#define CHECK(cond, ...)                     \
  do {                                       \
    if (!(cond)) {                           \
      if (failures < 20) {                   \
        std::printf("FAIL %s:%d: ", __FILE__, __LINE__); \
        std::printf(__VA_ARGS__);            \
        std::printf("\n");                   \
      }                                      \
      ++failures;                            \
    }                                        \
  } while (0)

template <class T>
size_t storage_bytes() { return sizeof(fp::WsSharedStorage<T>); }

// fp8: run the kernel's convert_p (P8Shuffle) on every warp with each byte holding its key,
// then check each A-operand byte against the (row, key) partition_A says it must hold
template <class T, class MmaS, class MmaO>
void check_p8_shuffle(const char* name, MmaS& mma_s, MmaO& mma_o) {
  constexpr int M = T::kBlockM, N = T::kBlockN;
  for (int w = 0; w < T::kMmaThreads / 32; ++w) {
    uint32_t y0[32], y1[32], words[32][N / 8];
    int rows[32][2];
    for (int kb = 0; kb < N / 32; ++kb)
      for (int r = 0; r < 2; ++r) {
        for (int lane = 0; lane < 32; ++lane) {
          auto thr_s = mma_s.get_thread_slice(32 * w + lane);
          Tensor cS = thr_s.partition_C(make_identity_tensor(Shape<Int<M>, Int<N>>{}));
          uint32_t pr[4];
          for (int gq = 0; gq < 4; ++gq) {
            const int e = 2 * r + 4 * (4 * kb + gq);  // as convert_p
            pr[gq] = uint32_t(get<1>(cS(e))) | (uint32_t(get<1>(cS(e + 1))) << 8);
            CHECK(get<0>(cS(e)) == get<0>(cS(e + 1)), "%s: S pair in two rows", name);
          }
          rows[lane][r] = get<0>(cS(2 * r));
          y0[lane] = pr[0] | (pr[2] << 16);
          y1[lane] = pr[1] | (pr[3] << 16);
        }
        for (int lane = 0; lane < 32; ++lane) {
          const int sa = fp::P8Shuffle::lane_a(lane), sb = fp::P8Shuffle::lane_b(lane);
          const uint32_t ra = fp::P8Shuffle::send_a(sa, y0[sa], y1[sa]);
          const uint32_t rb = fp::P8Shuffle::send_b(sb, y0[sb], y1[sb]);
          fp::P8Shuffle::recv(lane, ra, rb, words[lane][4 * kb + r], words[lane][4 * kb + 2 + r]);
        }
      }
    for (int lane = 0; lane < 32; ++lane) {
      auto thr_o = mma_o.get_thread_slice(32 * w + lane);
      Tensor cA = thr_o.partition_A(make_identity_tensor(Shape<Int<M>, Int<N>>{}));
      typename T::LayoutPA la;
      for (int e = 0; e < size(cA); ++e) {
        const int idx = la(idx2crd(e, shape(cA)));  // byte of the register array
        const int key = (words[lane][idx / 4] >> (8 * (idx % 4))) & 0xff;
        const int row = rows[lane][(idx / 4) & 1];
        CHECK(get<0>(cA(e)) == row && get<1>(cA(e)) == key,
              "%s: t=%d A elem %d must hold (%d,%d), the shuffles put (%d,%d) there", name,
              32 * w + lane, e, int(get<0>(cA(e))), int(get<1>(cA(e))), row, key);
      }
    }
  }
}

template <class T>
void check_variant(const char* name) {
  using Element = typename T::Element;
  constexpr int M = T::kBlockM, N = T::kBlockN, D = T::kHeadDim;
  typename T::TiledMmaS mma_s;
  typename T::TiledMmaO mma_o;
  CHECK(size(mma_s) == T::kMmaThreads, "%s: TiledMmaS threads %d", name, int(size(mma_s)));
  CHECK(size(mma_o) == T::kMmaThreads, "%s: TiledMmaO threads %d", name, int(size(mma_o)));

  // row of (thread, row slot) and the columns each thread holds in it
  std::vector<std::vector<int>> rows_s(T::kMmaThreads), rows_o(T::kMmaThreads);
  std::vector<std::vector<std::set<int>>> cols_s(T::kMmaThreads), cols_o(T::kMmaThreads);
  for (int t = 0; t < T::kMmaThreads; ++t) {
    auto thr_s = mma_s.get_thread_slice(t);
    auto thr_o = mma_o.get_thread_slice(t);
    Tensor cS = thr_s.partition_C(make_identity_tensor(Shape<Int<M>, Int<N>>{}));
    Tensor cO = thr_o.partition_C(make_identity_tensor(Shape<Int<M>, Int<D>>{}));
    Tensor fS = partition_fragment_C(mma_s, Shape<Int<M>, Int<N>>{});
    CHECK(size(cS) == size(fS) && size(cS) == N / 2, "%s: S fragment size %d", name, int(size(cS)));
    CHECK((size<1>(cS) == 1 && size<2>(cS) == 1 && size<0, 0>(cS) == 2 && size<0, 1>(cS) == 2 &&
           size<0, 2>(cS) == N / 8),
          "%s: S accumulator shape", name);
    Tensor rcS = make_tensor(cS.data(), fp::acc_rowcol(cS.layout()));
    Tensor rcO = make_tensor(cO.data(), fp::acc_rowcol(cO.layout()));
    CHECK(size<0>(rcS) == 2 && size<0>(rcO) == 2, "%s: two rows per thread", name);
    for (int i = 0; i < size<0>(rcS); ++i) {
      int row = get<0>(rcS(i, 0));
      rows_s[t].push_back(row);
      cols_s[t].emplace_back();
      for (int j = 0; j < size<1>(rcS); ++j) {
        CHECK(get<0>(rcS(i, j)) == row, "%s: S row view mixes rows (t=%d)", name, t);
        // the kernel's masks take a column's CSR tile from j alone
        const int per_tile = int(size<1>(rcS)) / T::kTilesPerStage;
        CHECK(get<1>(rcS(i, j)) / T::kTileN == j / per_tile,
              "%s: t=%d S column slot %d holds key %d, outside tile %d of the step", name, t, j,
              int(get<1>(rcS(i, j))), j / per_tile);
        cols_s[t].back().insert(get<1>(rcS(i, j)));
        // 16-bit correction chunks: slot j + half holds the lo part of slot j's block
        if constexpr (!T::kFp8) {
          const int half = int(size<1>(rcS)) / 2;
          if (j < half)
            CHECK(get<1>(rcS(i, j + half)) == get<1>(rcS(i, j)) + T::kCorrBlocks && get<0>(rcS(i, j + half)) == row,
                  "%s: t=%d S slot %d (col %d) is not paired with slot %d (col %d)", name, t, j,
                  int(get<1>(rcS(i, j))), j + half, int(get<1>(rcS(i, j + half))));
        }
      }
      CHECK(row / 64 == t / 128, "%s: thread %d holds S row %d outside its warpgroup", name, t, row);
    }
    for (int i = 0; i < size<0>(rcO); ++i) {
      int row = get<0>(rcO(i, 0));
      rows_o[t].push_back(row);
      cols_o[t].emplace_back();
      for (int j = 0; j < size<1>(rcO); ++j) {
        CHECK(get<0>(rcO(i, j)) == row, "%s: O row view mixes rows (t=%d)", name, t);
        // the epilogue stores slots 2m and 2m + 1 as one pair of adjacent, even-aligned columns
        if (j % 2 == 1)
          CHECK(get<1>(rcO(i, j)) == get<1>(rcO(i, j - 1)) + 1 && get<1>(rcO(i, j - 1)) % 2 == 0,
                "%s: t=%d O slots %d,%d hold columns %d,%d", name, t, j - 1, j,
                int(get<1>(rcO(i, j - 1))), int(get<1>(rcO(i, j))));
        cols_o[t].back().insert(get<1>(rcO(i, j)));
      }
      CHECK(row == rows_s[t][i], "%s: thread %d row slot %d: S row %d, O row %d", name, t, i,
            rows_s[t][i], row);
    }
    // P (S accumulator, logical order) as the A operand of the P V product
    Tensor cA = thr_o.partition_A(make_identity_tensor(Shape<Int<M>, Int<N>>{}));
    typename T::LayoutPA la;
    CHECK(size(cA) == size(la), "%s: A fragment size %d vs %d", name, int(size(cA)), int(size(la)));
    CHECK(rank(cA) == 3 && size<2>(cA) == N / (T::kFp8 ? 32 : 16), "%s: A fragment k-blocks", name);
    if constexpr (!T::kFp8) {
      for (int e = 0; e < size(cA); ++e) {
        auto coord = cA(e);                  // (row, key) of the A register
        int idx = la(idx2crd(e, shape(cA)));
        auto want = cS(idx);
        CHECK(get<0>(coord) == get<0>(want) && get<1>(coord) == get<1>(want),
              "%s: t=%d A elem %d holds (%d,%d), LayoutPA points at S (%d,%d)", name, t, e,
              int(get<0>(coord)), int(get<1>(coord)), int(get<0>(want)), int(get<1>(want)));
      }
    }
  }
  if constexpr (T::kFp8) check_p8_shuffle<T>(name, mma_s, mma_o);
  // quads share rows; their columns partition the tile
  for (int t = 0; t < T::kMmaThreads; t += 4) {
    for (int i = 0; i < 2; ++i) {
      std::set<int> all_s, all_o;
      int n_s = 0, n_o = 0;
      for (int q = 0; q < 4; ++q) {
        CHECK(rows_s[t + q][i] == rows_s[t][i], "%s: quad %d does not share S row slot %d", name, t, i);
        all_s.insert(cols_s[t + q][i].begin(), cols_s[t + q][i].end());
        all_o.insert(cols_o[t + q][i].begin(), cols_o[t + q][i].end());
        n_s += cols_s[t + q][i].size();
        n_o += cols_o[t + q][i].size();
      }
      CHECK(int(all_s.size()) == N && n_s == N, "%s: quad %d S row covers %d cols", name, t, int(all_s.size()));
      CHECK(int(all_o.size()) == D && n_o == D, "%s: quad %d O row covers %d cols", name, t, int(all_o.size()));
    }
  }
  // every row of the tile is held by exactly one quad
  std::vector<int> row_owner(M, 0);
  for (int t = 0; t < T::kMmaThreads; t += 4)
    for (int i = 0; i < 2; ++i) row_owner[rows_s[t][i]]++;
  for (int r = 0; r < M; ++r) CHECK(row_owner[r] == 1, "%s: row %d held by %d quads", name, r, row_owner[r]);

  // shared-memory layouts: bijective, chunk-contiguous; V^T view == V
  alignas(1024) static Element buf[T::kBlockN * T::kHeadDim * T::kStages > M * D ? T::kBlockN * T::kHeadDim * T::kStages : M * D];
  Tensor sQ = make_tensor(make_smem_ptr(buf), typename T::SmemLayoutQ{});
  Tensor sK = make_tensor(make_smem_ptr(buf), typename T::SmemLayoutKV{});
  Tensor sVt = make_tensor(make_smem_ptr(buf), typename T::SmemLayoutVt{});
  {
    std::vector<int> seen(M * D, 0);
    for (int r = 0; r < M; ++r)
      for (int c = 0; c < D; ++c) {
        long off = &sQ(r, c) - buf;
        CHECK(off >= 0 && off < M * D, "%s: sQ offset %ld", name, off);
        if (off >= 0 && off < M * D) seen[off]++;
        if (c % T::kChunk) CHECK(&sQ(r, c) == &sQ(r, c - c % T::kChunk) + c % T::kChunk, "%s: sQ chunk", name);
        else CHECK(off % T::kChunk == 0, "%s: sQ chunk alignment", name);
      }
    for (int i = 0; i < M * D; ++i) CHECK(seen[i] == 1, "%s: sQ not a bijection at %d", name, i);
  }
  {
    const int n = T::kBlockN * D * T::kStages;
    std::vector<int> seen(n, 0);
    for (int s = 0; s < T::kStages; ++s)
      for (int r = 0; r < T::kBlockN; ++r)
        for (int c = 0; c < D; ++c) {
          long off = &sK(r, c, s) - buf;
          CHECK(off >= 0 && off < n, "%s: sK offset %ld", name, off);
          if (off >= 0 && off < n) seen[off]++;
          CHECK(off / (T::kBlockN * D) == s, "%s: stage %d spills into another stage", name, s);
          if (c % T::kChunk) CHECK(&sK(r, c, s) == &sK(r, c - c % T::kChunk, s) + c % T::kChunk, "%s: sK chunk", name);
          else CHECK(off % T::kChunk == 0, "%s: sK chunk alignment", name);
          if constexpr (!T::kFp8)
            CHECK(&sVt(c, r, s) == &sK(r, c, s), "%s: V^T view (%d,%d,%d)", name, c, r, s);
        }
    for (int i = 0; i < n; ++i) CHECK(seen[i] == 1, "%s: sKV not a bijection at %d", name, i);
  }
  constexpr int es = sizeof(Element), W = T::kBoxCols;  // bytes per element, box columns
  // v1 fills whole 64-key tiles with TMA boxes of 64 rows x one 128-byte row under the 128B
  // swizzle: each box must be a contiguous 8 KB block at &sK(64 hf, W cb, s) whose bytes follow
  // the hardware pattern (16-byte chunk index XOR row % 8)
  {
    for (int s = 0; s < T::kStages; ++s)
      for (int hf = 0; hf < T::kBlockN / 64; ++hf)
        for (int cb = 0; cb < D / W; ++cb) {
          const char* base = reinterpret_cast<const char*>(&sK(hf * 64, cb * W, s));
          CHECK((base - reinterpret_cast<const char*>(buf)) % 1024 == 0, "%s: TMA box not 1024-aligned", name);
          for (int r = 0; r < 64; ++r)
            for (int c = 0; c < W; ++c) {
              const long got = reinterpret_cast<const char*>(&sK(hf * 64 + r, cb * W + c, s)) - base;
              const long want = r * 128 + (((c * es / 16) ^ (r % 8)) * 16) + (c * es) % 16;
              CHECK(got == want, "%s: TMA box (s%d,h%d,c%d) element (%d,%d) at %ld, swizzle says %ld", name,
                    s, hf, cb, r, c, got, want);
            }
          // pages of 8, 16, 32 keys: one box each at stage row 64 hf + i rows, which must start
          // 1024-aligned (the swizzle pattern's period) and continue the tile box's bytes
          for (int rows = 8; rows < 64; rows *= 2)
            for (int i = 0; i < 64 / rows; ++i) {
              const char* page_base = reinterpret_cast<const char*>(&sK(hf * 64 + i * rows, cb * W, s));
              CHECK((page_base - reinterpret_cast<const char*>(buf)) % 1024 == 0 && page_base == base + i * rows * 128,
                    "%s: page box (s%d,h%d,c%d) of %d rows at row %d not 1024-aligned in the tile box", name, s,
                    hf, cb, rows, i * rows);
            }
        }
  }
  // correction chunks: one TMA box of kBlockN rows x one 128-byte row per column block (16-bit:
  // two boxes of kCorrBlocks rows, hi then lo; each must start 1024-aligned)
  {
    for (int s = 0; s < T::kStages; ++s)
      for (int cb = 0; cb < D / W; ++cb) {
        const char* base = reinterpret_cast<const char*>(&sK(0, cb * W, s));
        const char* lo_base = reinterpret_cast<const char*>(&sK(T::kCorrBlocks % T::kBlockN, cb * W, s));
        CHECK((lo_base - reinterpret_cast<const char*>(buf)) % 1024 == 0 && (base - reinterpret_cast<const char*>(buf)) % 1024 == 0,
              "%s: means box not 1024-aligned", name);
        for (int r = 0; r < T::kBlockN; ++r)
          for (int c = 0; c < W; ++c) {
            const long got = reinterpret_cast<const char*>(&sK(r, cb * W + c, s)) - base;
            const long want = r * 128 + (((c * es / 16) ^ (r % 8)) * 16) + (c * es) % 16;
            CHECK(got == want, "%s: means box (s%d,c%d) element (%d,%d) at %ld, swizzle says %ld", name, s,
                  cb, r, c, got, want);
          }
      }
  }
  // fp8 V^T stages (own buffer): a bijection whose 16-key chunks are contiguous; the 64 keys x d
  // of tile hf (and of means box hf) one TMA box under the 64B swizzle: 64-byte rows, 16-byte
  // chunk index XOR (row / 2) % 4, 512-byte aligned
  if constexpr (T::kFp8) {
    const int n = T::kBlockN * D * T::kStages;
    std::vector<int> seen(n, 0);
    for (int s = 0; s < T::kStages; ++s)
      for (int hf = 0; hf < T::kBlockN / 64; ++hf) {
        const char* base = reinterpret_cast<const char*>(&sVt(0, hf * 64, s));
        CHECK((base - reinterpret_cast<const char*>(buf)) % 512 == 0, "%s: V^T box not 512-aligned", name);
        for (int dd = 0; dd < D; ++dd)
          for (int key = 0; key < 64; ++key) {
            const long off = &sVt(dd, hf * 64 + key, s) - buf;
            CHECK(off >= 0 && off < n, "%s: sVt offset %ld", name, off);
            if (off >= 0 && off < n) seen[off]++;
            if (key % 16) CHECK(&sVt(dd, hf * 64 + key, s) == &sVt(dd, hf * 64 + key - key % 16, s) + key % 16,
                                "%s: sVt chunk", name);
            const long got = reinterpret_cast<const char*>(&sVt(dd, hf * 64 + key, s)) - base;
            const long want = dd * 64 + (((key / 16) ^ ((dd / 2) % 4)) * 16) + key % 16;
            CHECK(got == want, "%s: V^T box (s%d,h%d) element (%d,%d) at %ld, swizzle says %ld", name, s, hf,
                  dd, key, got, want);
          }
      }
    for (int i = 0; i < n; ++i) CHECK(seen[i] == 1, "%s: sVt not a bijection at %d", name, i);
  }
  // the producer's row-page shuffles (pages under 64 keys): the lane a thread reads in pass i
  // fetched that pass's row, and the passes copy every chunk of the tile once
  {
    using RP = fp::RowPages<T>;
    std::vector<int> copied(64 * T::kChunksPerRow, 0);
    for (int t = 0; t < T::kProducerThreads; ++t)
      for (int i = 0; i < RP::kPasses; ++i) {
        const int r = RP::row(t, i), src = RP::src_lane(t, i);
        CHECK(src >= 0 && src < 32 && RP::fetch_row((t & ~31) | src) == r,
              "%s: thread %d pass %d copies row %d but reads lane %d's page", name, t, i, r, src);
        if (r >= 0 && r < 64) copied[r * T::kChunksPerRow + t % T::kChunksPerRow]++;
      }
    for (int c = 0; c < 64 * T::kChunksPerRow; ++c) CHECK(copied[c] == 1, "%s: tile chunk %d copied %d times", name, c, copied[c]);
  }
  const size_t smem = storage_bytes<T>();
  CHECK(smem + 1024 <= 227 * 1024, "%s: %zu bytes of shared memory (+1024 pad) > 227 KB", name, smem);
  std::printf("%s: smem %zu bytes (+1024 alignment pad)\n", name, smem);
}

int main() {
  // the consumer warpgroups' MMAs, as instantiated by sparse_attn_fwd.cu
  check_variant<fp::WsTraits<cutlass::bfloat16_t, 128, 128, 3>>("ws128 bf16 d128");
  check_variant<fp::WsTraits<cutlass::bfloat16_t, 64, 128, 4>>("ws128 bf16 d64");
  check_variant<fp::WsTraits<cutlass::bfloat16_t, 128, 64, 5>>("ws64 bf16 d128");
  check_variant<fp::WsTraits<cutlass::half_t, 64, 64, 8>>("ws64 fp16 d64");
  check_variant<fp::WsTraits<cutlass::float_e4m3_t, 128, 128, 5>>("ws128 e4m3 d128");
  check_variant<fp::WsTraits<cutlass::float_e4m3_t, 128, 64, 8>>("ws64 e4m3 d128");
  if (failures) {
    std::printf("%d failures\n", failures);
    return 1;
  }
  std::printf("layout checks passed\n");
  return 0;
}
