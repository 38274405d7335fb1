// Tile shapes, MMA atoms, shared-memory layouts and register-layout views of the CUTLASS/CuTe
// attention stage (sparse_attn_fwd.cu, sparse_attn_ws.cuh). Host-usable: layout_check.cu
// evaluates the same types on a CPU to check every index mapping the kernel relies on.
#pragma once

#include <cute/tensor.hpp>
#include <cute/atom/mma_atom.hpp>
#include <cute/arch/mma_sm90.hpp>
#include <cutlass/numeric_types.h>

#include <type_traits>

namespace fp {

using namespace cute;
namespace gmma = cute::SM90::GMMA;

// ((2 cols, 2 rows, N/8 col groups), MMA_M, MMA_N) accumulator -> (rows, cols) view
template <class L>
CUTE_HOST_DEVICE constexpr auto acc_rowcol(L const& l) {
  return make_layout(make_layout(get<0, 1>(l), get<1>(l)),
                     make_layout(get<0, 0>(l), get<0, 2>(l), get<2>(l)));
}

}  // namespace fp

namespace fp {

// v1: warp-specialized. One producer warpgroup (cp.async gathers through the page table into
// a kStages ring, mbarrier full/empty handshakes) and two consumer warpgroups (64 of the 128
// rows each). A stage holds kBlockN keys = kBlockN / 64 CSR tiles (64 keys each), so one
// softmax step covers two list entries at kBlockN = 128. kPingpong: the consumer warpgroups
// take turns at the tensor cores (FA3's pingpong); kPersistent: one CTA per SM walks units
// blockIdx.x, + gridDim.x, ... of the decreasing-work order (the producer loads the next
// unit's stages during the current unit's last steps and epilogue).
//
// FP8 (Element = float_e4m3_t, head_dim 128): Hopper's fp8 wgmma takes both operands K-major,
// so V comes from a token-major pool ([num_pages, Hkv, d, page_size]) into a [d, keys] stage
// (64-byte swizzle: one 64-key tile = one 8 KB block), and P is moved from the S accumulator's
// layout into the fp8 A-operand layout by quad shuffles (P8Shuffle). The output is bf16.
template <class Element_, int kHeadDim_, int kBlockN_, int kStages_, bool kPingpong_ = false,
          bool kPersistent_ = false>
struct WsTraits {
  using Element = Element_;
  static constexpr bool kFp8 = sizeof(Element_) == 1;
  using OutElement = std::conditional_t<kFp8, cutlass::bfloat16_t, Element_>;
  // TMA box width of the K-major tiles (Q, K, block means): one 128-byte swizzle row
  static constexpr int kBoxCols = 128 / int(sizeof(Element_));
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kBlockM = 128;
  static constexpr int kBlockN = kBlockN_;
  static constexpr int kTileN = 64;  // keys per CSR tile
  static constexpr int kTilesPerStage = kBlockN / kTileN;
  // block means per correction chunk. 16-bit: the fp32 means arrive as hi + lo operands
  // (kernels/index.py split_means), a stage holds kBlockN / 2 blocks' hi rows then their lo
  // rows, and the consumers add the two halves of S (the correction term uses the fp32 means,
  // docs/SEMANTICS.md choice 4). fp8: e4m3 means, kBlockN per chunk.
  static constexpr int kCorrBlocks = kFp8 ? kBlockN : kBlockN / 2;
  static constexpr int kStages = kStages_;
  static constexpr bool kPingpong = kPingpong_;
  static constexpr bool kPersistent = kPersistent_;
  static constexpr int kProducerThreads = 128;
  static constexpr int kConsumerThreads = 256;
  static constexpr int kThreads = kProducerThreads + kConsumerThreads;
  static constexpr int kMmaThreads = kConsumerThreads;
  // CSR entries whose tile and page the producer looks up together (one thread each), so the
  // dependent index -> page-table -> K/V loads cost one round trip per kTableTiles entries.
  // Pages of 8, 16 or 32 keys (one TMA box each) need 64 / page_size page ids per tile: a
  // refill then covers kTablePages / (64 / page_size) entries (one thread per page id)
  static constexpr int kTableTiles = 64;
  static constexpr int kTablePages = 128;
  static_assert(kTableTiles % kTilesPerStage == 0 && kTableTiles <= kProducerThreads);
  static_assert(kTablePages <= kProducerThreads && kTablePages / 8 >= kTilesPerStage);
  static constexpr int kProducerRegs = 40;   // setmaxnreg: 128 x 40 + 256 x 232 <= 64K
  static constexpr int kConsumerRegs = 232;
  static constexpr int kChunk = 16 / sizeof(Element);
  static constexpr int kChunksPerRow = kHeadDim / kChunk;
  static_assert(kHeadDim == 64 || kHeadDim == 128, "head_dim 64 or 128");
  static_assert(!kFp8 || kHeadDim == 128, "fp8: head_dim 128 (a K row is one 128-byte swizzle row)");
  static_assert(kHeadDim % kBoxCols == 0);
  static_assert(kBlockN == 64 || kBlockN == 128, "64 or 128 keys per stage");

  using TileS = Shape<Int<kBlockM>, Int<kBlockN>, Int<kHeadDim>>;
  using TileO = Shape<Int<kBlockM>, Int<kHeadDim>, Int<kBlockN>>;
  using WarpGroups = Layout<Shape<_2, _1, _1>>;
  using TiledMmaS = decltype(make_tiled_mma(
      gmma::ss_op_selector<Element, Element, float, TileS>(), WarpGroups{}));
  static constexpr gmma::Major kMajorV = kFp8 ? gmma::Major::K : gmma::Major::MN;
  using TiledMmaO = decltype(make_tiled_mma(
      gmma::rs_op_selector<Element, Element, float, TileO, gmma::Major::K, kMajorV>(),
      WarpGroups{}));

  using SmemAtom = gmma::Layout_K_SW128_Atom<Element>;
  using SmemLayoutQ =
      decltype(tile_to_shape(SmemAtom{}, Shape<Int<kBlockM>, Int<kHeadDim>>{}));
  using SmemLayoutKV =
      decltype(tile_to_shape(SmemAtom{}, Shape<Int<kBlockN>, Int<kHeadDim>, Int<kStages>>{}));
  // V^T as the B operand of P V: bf16/fp16, a transposed view of the row-major V stage; fp8,
  // its own K-major [d, keys] stage (64-byte swizzle atoms of 8 d-rows x 64 keys, d first, so
  // keys 64 hf .. 64 hf + 63 of all d rows are one contiguous 8 KB block: one TMA box)
  using SmemLayoutVtView = decltype(composition(
      SmemLayoutKV{},
      make_layout(Shape<Int<kHeadDim>, Int<kBlockN>, Int<kStages>>{},
                  Stride<Int<kBlockN>, _1, Int<kBlockN * kHeadDim>>{})));
  using SmemLayoutVtFp8 = decltype(tile_to_shape(gmma::Layout_K_SW64_Atom<Element>{},
                                                 Shape<Int<kHeadDim>, Int<kBlockN>, Int<kStages>>{}));
  using SmemLayoutVt = std::conditional_t<kFp8, SmemLayoutVtFp8, SmemLayoutVtView>;
  // 16-bit: S accumulator ((2, 2, N/8), 1, 1) -> A operand ((2, 2, 2), 1, N/16): a k-block of
  // 16 keys is two consecutive column groups of 8. Logical index of S element (c, r, g) is
  // c + 2 r + 4 g; A element ((a0, a1, a2), 0, kb) holds S element (a0, a1, a2 + 2 kb).
  // fp8: A operand ((4, 2, 2), 1, N/32) over a register array filled by P8Shuffle: element
  // ((i, r, h), 0, kb) at byte i + 4 r + 8 h + 16 kb holds (row half r, key 32 kb + 16 h + 4 t + i)
  // for lane t of its quad.
  using LayoutPA16 = Layout<Shape<Shape<_2, _2, _2>, _1, Int<kBlockN / 16>>,
                            Stride<Stride<_1, _2, _4>, _0, _8>>;
  using LayoutPA8 = Layout<Shape<Shape<_4, _2, _2>, _1, Int<kBlockN / 32>>,
                           Stride<Stride<_1, _4, _8>, _0, _16>>;
  using LayoutPA = std::conditional_t<kFp8, LayoutPA8, LayoutPA16>;
};

CUTE_HOST_DEVICE uint32_t byte_perm(uint32_t x, uint32_t y, uint32_t sel) {
#if defined(__CUDA_ARCH__)
  return __byte_perm(x, y, sel);
#else
  const uint64_t xy = (uint64_t(y) << 32) | x;
  uint32_t r = 0;
  for (int i = 0; i < 4; ++i) r |= uint32_t((xy >> (8 * ((sel >> (4 * i)) & 7))) & 0xff) << (8 * i);
  return r;
#endif
}

// P from the S accumulator's layout to the fp8 A-operand layout of the P V wgmma, per 32-key
// k-block and row half. Lane t of a quad holds keys 8 g + 2 t + {0, 1} of the block's 8-key
// groups g = 0..3 (C layout) and must feed keys 4 t + {0..3} and 16 + 4 t + {0..3} (A layout):
// those come from lanes 2 (t & 1) (its groups t >> 1 and 2 + (t >> 1), keys j = 0, 1) and
// 2 (t & 1) + 1 (the same groups). Each lane packs y0 = {g0, g2} and y1 = {g1, g3} (two bytes per
// group, key j in byte j) and takes part in two shuffles in which every source sends the word
// its readers need (readers of lane s want y[s & 1] in shuffle a, y[(s & 1) ^ 1] in b); two
// byte permutes assemble the A words. 2 shuffles per 32 keys and row. layout_check.cu emulates
// the warp on the CPU.
struct P8Shuffle {
  CUTE_HOST_DEVICE static int lane_a(int lane) {
    const int t = lane & 3;
    return (lane & ~3) | (2 * (t & 1) + (t >> 1));
  }
  CUTE_HOST_DEVICE static int lane_b(int lane) {
    const int t = lane & 3;
    return (lane & ~3) | (2 * (t & 1) + 1 - (t >> 1));
  }
  CUTE_HOST_DEVICE static uint32_t send_a(int lane, uint32_t y0, uint32_t y1) { return (lane & 1) ? y1 : y0; }
  CUTE_HOST_DEVICE static uint32_t send_b(int lane, uint32_t y0, uint32_t y1) { return (lane & 1) ? y0 : y1; }
  // ra, rb: the words received in shuffles a and b -> A words of keys 4t.. (w0) and 16 + 4t.. (w1)
  CUTE_HOST_DEVICE static void recv(int lane, uint32_t ra, uint32_t rb, uint32_t& w0, uint32_t& w1) {
    const bool odd_first = (lane >> 1) & 1;  // t >> 1: shuffle a read the odd source
    const uint32_t e = odd_first ? rb : ra, o = odd_first ? ra : rb;
    w0 = byte_perm(e, o, 0x5410);
    w1 = byte_perm(e, o, 0x7632);
  }
};

// Pages under 64 keys, a tile by cp.async: pass i of producer thread t copies 16-byte chunk
// t % kChunksPerRow of tile row row(t, i). Over the passes a warp copies 16 rows; lane l (and
// l + 16) looks up the page of row fetch_row(t) once a tile, and in pass i thread t takes its
// row's page from lane src_lane(t, i) of its warp by shuffle. layout_check.cu checks that the
// lane it reads fetched its row.
template <class T>
struct RowPages {
  static constexpr int kRowsPerPass = T::kProducerThreads / T::kChunksPerRow;
  static constexpr int kRowsPerWarp = 32 / T::kChunksPerRow;
  static constexpr int kPasses = T::kTileN / kRowsPerPass;
  static_assert(32 % T::kChunksPerRow == 0 && kRowsPerWarp * kPasses == 16);
  CUTE_HOST_DEVICE static int row(int t, int i) { return (t + i * T::kProducerThreads) / T::kChunksPerRow; }
  CUTE_HOST_DEVICE static int fetch_row(int t) {
    const int l = t % 16;
    return (l / kRowsPerWarp) * kRowsPerPass + (t / 32) * kRowsPerWarp + l % kRowsPerWarp;
  }
  CUTE_HOST_DEVICE static int src_lane(int t, int i) { return i * kRowsPerWarp + (t % 32) / T::kChunksPerRow; }
};

template <class T>
struct WsSharedStorage {
  using Element = typename T::Element;
  cute::array_aligned<Element, cosize_v<typename T::SmemLayoutQ>, 1024> q;
  cute::array_aligned<Element, cosize_v<typename T::SmemLayoutKV>, 1024> k;
  cute::array_aligned<Element, cosize_v<typename T::SmemLayoutKV>, 1024> v;  // V or V^T (fp8)
  uint64_t full[T::kStages];   // producer -> consumers: the stage's copies landed
  uint64_t empty[T::kStages];  // consumers -> producer: both warpgroups are done with it
  uint64_t q_full;   // producer -> consumers: Q of the unit landed
  uint64_t q_empty;  // consumers -> producer: both warpgroups' last S GEMM of the unit is done
  // the producer's next CSR entries from the top: tile index, and the tile's page (pages of 64
  // keys or more) or its 64 / page_size pages (8 to 32 keys, TMA per page) at 64 / page_size
  // consecutive slots
  int32_t tab_tile[T::kTableTiles];
  int32_t tab_page[T::kTablePages];
};

}  // namespace fp
