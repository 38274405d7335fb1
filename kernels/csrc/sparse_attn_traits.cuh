// Tile shapes, MMA atoms, shared-memory layouts and register-layout views of the CUTLASS/CuTe
// attention stage (sparse_attn_fwd.cu, sparse_attn_ws.cuh). Host-usable: layout_check.cu
// evaluates the same types on a CPU to check every index mapping the kernel relies on.
#pragma once

#include <cute/tensor.hpp>
#include <cute/atom/mma_atom.hpp>
#include <cute/arch/mma_sm90.hpp>
#include <cutlass/numeric_types.h>

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
template <class Element_, int kHeadDim_, int kBlockN_, int kStages_, bool kPingpong_ = false,
          bool kPersistent_ = false>
struct WsTraits {
  using Element = Element_;
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kBlockM = 128;
  static constexpr int kBlockN = kBlockN_;
  static constexpr int kTileN = 64;  // keys per CSR tile
  static constexpr int kTilesPerStage = kBlockN / kTileN;
  static constexpr int kStages = kStages_;
  static constexpr bool kPingpong = kPingpong_;
  static constexpr bool kPersistent = kPersistent_;
  static constexpr int kProducerThreads = 128;
  static constexpr int kConsumerThreads = 256;
  static constexpr int kThreads = kProducerThreads + kConsumerThreads;
  static constexpr int kMmaThreads = kConsumerThreads;
  // CSR entries whose tile and page the producer looks up together (one thread each), so the
  // dependent index -> page-table -> K/V loads cost one round trip per kTableTiles entries
  static constexpr int kTableTiles = 64;
  static_assert(kTableTiles % kTilesPerStage == 0 && kTableTiles <= kProducerThreads);
  static constexpr int kProducerRegs = 40;   // setmaxnreg: 128 x 40 + 256 x 232 <= 64K
  static constexpr int kConsumerRegs = 232;
  static constexpr int kChunk = 16 / sizeof(Element);
  static constexpr int kChunksPerRow = kHeadDim / kChunk;
  static_assert(kHeadDim == 64 || kHeadDim == 128, "head_dim 64 or 128");
  static_assert(kBlockN == 64 || kBlockN == 128, "64 or 128 keys per stage");

  using TileS = Shape<Int<kBlockM>, Int<kBlockN>, Int<kHeadDim>>;
  using TileO = Shape<Int<kBlockM>, Int<kHeadDim>, Int<kBlockN>>;
  using WarpGroups = Layout<Shape<_2, _1, _1>>;
  using TiledMmaS = decltype(make_tiled_mma(
      gmma::ss_op_selector<Element, Element, float, TileS>(), WarpGroups{}));
  using TiledMmaO = decltype(make_tiled_mma(
      gmma::rs_op_selector<Element, Element, float, TileO, gmma::Major::K, gmma::Major::MN>(),
      WarpGroups{}));

  using SmemAtom = gmma::Layout_K_SW128_Atom<Element>;
  using SmemLayoutQ =
      decltype(tile_to_shape(SmemAtom{}, Shape<Int<kBlockM>, Int<kHeadDim>>{}));
  using SmemLayoutKV =
      decltype(tile_to_shape(SmemAtom{}, Shape<Int<kBlockN>, Int<kHeadDim>, Int<kStages>>{}));
  using SmemLayoutVt = decltype(composition(
      SmemLayoutKV{},
      make_layout(Shape<Int<kHeadDim>, Int<kBlockN>, Int<kStages>>{},
                  Stride<Int<kBlockN>, _1, Int<kBlockN * kHeadDim>>{})));
  // S accumulator ((2, 2, N/8), 1, 1) -> A operand ((2, 2, 2), 1, N/16): a k-block of 16 keys
  // is two consecutive column groups of 8. Logical index of S element (c, r, g) is c + 2 r + 4 g;
// A element ((a0, a1, a2), 0, kb) holds S element (a0, a1, a2 + 2 kb).
  using LayoutPA = Layout<Shape<Shape<_2, _2, _2>, _1, Int<kBlockN / 16>>,
                          Stride<Stride<_1, _2, _4>, _0, _8>>;
};

template <class T>
struct WsSharedStorage {
  using Element = typename T::Element;
  cute::array_aligned<Element, cosize_v<typename T::SmemLayoutQ>, 1024> q;
  cute::array_aligned<Element, cosize_v<typename T::SmemLayoutKV>, 1024> k;
  cute::array_aligned<Element, cosize_v<typename T::SmemLayoutKV>, 1024> v;
  uint64_t full[T::kStages];   // producer -> consumers: the stage's copies landed
  uint64_t empty[T::kStages];  // consumers -> producer: both warpgroups are done with it
  uint64_t q_full;   // producer -> consumers: Q of the unit landed
  uint64_t q_empty;  // consumers -> producer: both warpgroups' last S GEMM of the unit is done
  // the producer's next T::kTableTiles CSR entries from the top: tile index and first page
  int32_t tab_tile[T::kTableTiles];
  int32_t tab_page[T::kTableTiles];
};

}  // namespace fp
