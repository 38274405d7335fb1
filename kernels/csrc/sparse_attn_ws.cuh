// v1 of the attention stage: warp-specialized (FA3's execution model on the CSR index).
// Included by sparse_attn_fwd.cu (inside namespace fp, after its PTX helpers).
//
// CTA = 3 warpgroups. Warpgroup 0 (producer, setmaxnreg down) loads Q once, then walks the
// same item sequence as the consumers (CSR positions from the top, then the correction
// chunks) into a kStages ring. By TMA (`mbarrier.expect_tx` on full[s] by each issuing
// thread first): correction chunks, and whole 64-key tiles, one box per tile at page sizes
// that are multiples of 64 (thread 0) or one per page at 8, 16, 32 (lane 0 of up to 4 warps;
// the page ids come with the tile ids in the lookup table; e4m3 V^T by cp.async there). By
// every producer thread's zero-filling 16-byte cp.async: partial tiles and all tiles at other
// page sizes (1, 2, 4, 24, 48, ...), each row's page read once per tile and shuffled to the
// lanes that copy the row (RowPages). `cp.async.mbarrier.arrive.noinc` on full[s] by all 128
// completes the stage when both kinds of copies have landed. Warpgroups 1 and 2 (consumers, setmaxnreg up) own rows 0-63 / 64-127 of the
// 128-row PackGQA tile. Each consumer overlaps the softmax of item k with the tensor cores:
//   issue S_k = Q K_k^T; issue O += P_{k-1} V_{k-1}; wait S_k; softmax(S_k) while PV runs;
//   wait PV; release stage k-1 (one arrive per warpgroup on empty[s]); O *= alpha_k; P_k = S_k.
// Neither side needs the other's metadata: both compute an item's tiles from the index.
// FP8 (T::kFp8): V^T stages from a token-major pool (TMA boxes of 64 keys x d under the 64-byte
// swizzle, or 16-key cp.async chunks with byte-exact zero fill), descales folded into the
// unit's logit scale and the epilogue, P quantized as round_e4m3(256 p) (kernels/fp8.py) and
// moved into the fp8 A layout by P8Shuffle; bf16 output.

// 2^x in one MUFU op: exp2f without fast-math adds denormal handling (compare, scale, fixup)
// around it, which also costs registers in the softmax
__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// one TMA box (completes on `mbar` with its byte count) and the expected-bytes update that
// precedes it on the stage's full barrier
__device__ __forceinline__ void tma_load_4d(void* smem, const CUtensorMap* map, uint64_t* mbar,
                                            int c0, int c1, int c2, int c3) {
  asm volatile(
      "cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%3, %4, %5, %6}], [%2];" ::"r"(smem_u32(smem)),
      "l"(map), "r"(smem_u32(mbar)), "r"(c0), "r"(c1), "r"(c2), "r"(c3)
      : "memory");
}
__device__ __forceinline__ void tma_load_3d(void* smem, const CUtensorMap* map, uint64_t* mbar,
                                            int c0, int c1, int c2) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%3, %4, %5}], [%2];" ::"r"(smem_u32(smem)),
      "l"(map), "r"(smem_u32(mbar)), "r"(c0), "r"(c1), "r"(c2)
      : "memory");
}
// two fp32 -> two e4m3 (saturating; lo in the low byte)
__device__ __forceinline__ uint32_t cvt_e4m3x2(float lo, float hi) {
  uint16_t r;
  asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(r) : "f"(hi), "f"(lo));
  return r;
}

__device__ __forceinline__ void mbarrier_expect_tx(uint64_t* mbar, uint32_t bytes) {
  asm volatile("mbarrier.expect_tx.shared::cta.b64 [%0], %1;" ::"r"(smem_u32(mbar)), "r"(bytes) : "memory");
}

// One unit of work: a segment (KV head x 128-row PackGQA tile, in the host's decreasing-work
// order) and one of its KV splits. The producer and the consumers build the same unit from its
// number, so they walk the same items (CSR entries from the top, then correction chunks)
// without exchanging anything but the stages themselves.
template <class T>
struct WsWork {
  int seg, u, h, b, q0, lkv, prefix, r0, rows_valid, lo;
  int seg_lo, i_hi, i_lo, i_mid, n_main, n_blocks_full, n_items;

  __device__ __forceinline__ WsWork(const FpAttnParams& p, int w) {
    constexpr int kBlockM = T::kBlockM, kBlockN = T::kBlockN, kTileN = T::kTileN;
    const int num_splits = p.num_splits;
    const int rank = w / num_splits;
    u = w % num_splits;
    seg = p.order[rank];
    h = seg / p.total_tiles;
    const int t = seg % p.total_tiles;
    b = p.tile_seq[t];
    const int tile = t - p.cu_qtiles[b];
    q0 = p.cu_seqlens_q[b];
    const int lq = p.cu_seqlens_q[b + 1] - q0;
    lkv = p.seqlens_kv[b];
    prefix = lkv - lq;
    const int g = p.group_size;
    r0 = tile * kBlockM;
    rows_valid = min(kBlockM, g * lq - r0);
    lo = r0 / g + prefix;
    const int hi = (r0 + rows_valid - 1) / g + prefix;
    const int first_masked = (lo + 1) / kTileN;  // CSR tiles >= this cross the diagonal

    int n_list, n_diag;
    seg_lo = 0;
    if (p.dense) {
      n_list = hi / kTileN + 1;
      n_diag = n_list - first_masked;
    } else {
      seg_lo = p.seg_offsets[seg];
      n_list = p.seg_offsets[seg + 1] - seg_lo;
      n_diag = 0;
      while (n_diag < n_list && p.kv_tiles[seg_lo + n_list - 1 - n_diag] >= first_masked) ++n_diag;
    }
    const int per_split = (n_list + num_splits - 1) / num_splits;
    i_hi = max(n_list - u * per_split, 0);
    i_lo = max(n_list - (u + 1) * per_split, 0);
    i_mid = n_list - n_diag;
    n_main = (i_hi - i_lo + T::kTilesPerStage - 1) / T::kTilesPerStage;  // items over the list

    n_blocks_full = 0;
    int n_corr = 0;
    if (p.correction && !p.dense && u == num_splits - 1) {
      n_blocks_full = (lo + 1 < lkv) ? (lo + 1) / p.block_size
                                     : (lkv + p.block_size - 1) / p.block_size;
      n_corr = (n_blocks_full + T::kCorrBlocks - 1) / T::kCorrBlocks;
    }
    n_items = n_main + n_corr;
  }

  // the CSR tile of the split's e-th entry from the top, or -1 past the split's range
  __device__ __forceinline__ int entry_tile(const FpAttnParams& p, int e) const {
    const int pos = i_hi - 1 - e;
    if (pos < i_lo) return -1;
    return p.dense ? pos : __ldg(p.kv_tiles + seg_lo + pos);
  }
  // the CSR tile of half `hf` of list item k
  __device__ __forceinline__ int item_tile(const FpAttnParams& p, int k, int hf) const {
    return entry_tile(p, k * T::kTilesPerStage + hf);
  }
};

template <class T>
__global__ void __launch_bounds__(T::kThreads, 1) sparse_attn_fwd_ws_kernel(const FpAttnParams p,
                                                                            const __grid_constant__ FpTmaMaps tma) {
  using Element = typename T::Element;
  using OutElement = typename T::OutElement;
  constexpr int kBlockM = T::kBlockM, kBlockN = T::kBlockN, kHeadDim = T::kHeadDim;
  constexpr int kTileN = T::kTileN, kTilesPerStage = T::kTilesPerStage, kStages = T::kStages;
  constexpr bool kFp8 = T::kFp8;
  constexpr int kBoxCols = T::kBoxCols;
  constexpr int kChunk = T::kChunk, kChunksPerRow = T::kChunksPerRow;
  constexpr int kProducerThreads = T::kProducerThreads;

  extern __shared__ char smem_raw[];
  const uint32_t pad = (1024u - (smem_u32(smem_raw) & 1023u)) & 1023u;
  WsSharedStorage<T>& ss = *reinterpret_cast<WsSharedStorage<T>*>(smem_raw + pad);

  const int tid = threadIdx.x;
  const int g = p.group_size;
  // units blockIdx.x, + gridDim.x, ...: one per CTA when not persistent (grid = all units)
  const int num_work = p.num_segments * p.num_splits;

  Tensor sQ = make_tensor(make_smem_ptr(ss.q.data()), typename T::SmemLayoutQ{});
  Tensor sK = make_tensor(make_smem_ptr(ss.k.data()), typename T::SmemLayoutKV{});
  Tensor sV = make_tensor(make_smem_ptr(ss.v.data()), typename T::SmemLayoutKV{});
  Tensor sVt = make_tensor(make_smem_ptr(ss.v.data()), typename T::SmemLayoutVt{});

  if (tid == 0) {
    for (int s = 0; s < kStages; ++s) {
      cutlass::arch::ClusterBarrier::init(&ss.full[s], kProducerThreads);
      cutlass::arch::ClusterBarrier::init(&ss.empty[s], 2);
    }
    cutlass::arch::ClusterBarrier::init(&ss.q_full, kProducerThreads);
    cutlass::arch::ClusterBarrier::init(&ss.q_empty, 2);
  }
  cutlass::arch::fence_barrier_init();
  __syncthreads();

  if (tid < kProducerThreads) {
    // ------------------------------------------------------------------ producer warpgroup
    cutlass::arch::warpgroup_reg_dealloc<T::kProducerRegs>();
    const int ptid = tid;
    const Element* q_ptr = static_cast<const Element*>(p.q);
    const Element* k_ptr = static_cast<const Element*>(p.k);
    const Element* v_ptr = static_cast<const Element*>(p.v);
    const int page_size = p.page_size;
    const bool tile_in_one_page = (page_size % kTileN) == 0;
    static_assert(kBlockM * kChunksPerRow % kProducerThreads == 0);
    static_assert(kTileN * kChunksPerRow % kProducerThreads == 0);
    constexpr int kProducerBarrier = 1;  // named barrier of the producer warpgroup (0: __syncthreads)
    constexpr int kRowsPerPass = kProducerThreads / kChunksPerRow;
    constexpr int kTable = T::kTableTiles;
    using RowPages = fp::RowPages<T>;
    static_assert(RowPages::kPasses == kTileN / kRowsPerPass);
    const int lane = ptid % 32, warp = ptid / 32;
    // TMA boxes of a whole tile: one (a page of 64 keys or more) or one per page (8 to 32
    // keys); the lookup table then holds pages_per_tile page ids an entry, fewer entries
    const int pages_per_tile = tma.enabled ? kTileN / tma.box_rows : 1;
    const int ppt_log2 = __ffs(pages_per_tile) - 1;
    const int table_entries = min(kTable, T::kTablePages >> ppt_log2);
    // e4m3 at pages under 64 keys: K by TMA, V^T by cp.async (see the host's map choice)
    const bool vt_by_cp_async = kFp8 && pages_per_tile > 1;
    // up to 4 warps (lane 0 each) issue a stage's page boxes side by side
    const int issuers = min(pages_per_tile, kProducerThreads / 32);

    int it = 0;  // items over every unit of this CTA: the ring's position and phase
    int n_unit = 0;
    for (int w = blockIdx.x; w < num_work; w += gridDim.x, ++n_unit) {
      const WsWork<T> wk(p, w);
      const int h = wk.h, r0 = wk.r0, lkv = wk.lkv;
      const Element* k_head = k_ptr + h * p.sk_h;
      const Element* v_head = v_ptr + h * p.sv_h;
      const int32_t* pt_row = p.page_table + wk.b * p.s_pt;

      // Q of this unit once the consumers' last S GEMM of the previous one has read sQ
      cutlass::arch::ClusterBarrier::wait(&ss.q_empty, (n_unit & 1) ^ 1);
      // partial unrolling: fully unrolled gathers hoist 64-bit addresses past the producer's
      // 40 registers and spill
#pragma unroll 2
      for (int i = 0; i < kBlockM * kChunksPerRow / kProducerThreads; ++i) {
        const int c = ptid + i * kProducerThreads;
        const int r = c / kChunksPerRow, col = (c % kChunksPerRow) * kChunk;
        const int pr = r0 + r;
        const bool ok = r < wk.rows_valid;
        const Element* src = ok ? q_ptr + int64_t(wk.q0 + pr / g) * p.sq_t +
                                      int64_t(h * g + pr % g) * p.sq_h + col
                                : q_ptr;
        cp_async_16(&sQ(r, col), src, ok);
      }
      cutlass::arch::cpasync_barrier_arrive_noinc(&ss.q_full);

      const int64_t blk0 = p.correction ? p.cu_blocks[wk.b] : 0;
      // fp8: the sequence's V means start at a 64-aligned column of the block-major vbar
      const int64_t vblk0 = kFp8 && p.correction ? p.cu_blocks_v[wk.b] : blk0;
      const int last_blk = max(wk.n_blocks_full - 1, 0);
      const Element* kb_head = static_cast<const Element*>(p.kbar) + h * p.skb_h;
      const Element* vb_head = static_cast<const Element*>(p.vbar) + h * p.svb_h;
      const int n_main = wk.n_main;

      for (int k = 0; k < wk.n_items; ++k, ++it) {
        const int st = it % kStages;
        const int e0 = k * kTilesPerStage;  // first list entry (from the top) of item k
        if (k < n_main && (e0 & (table_entries - 1)) == 0) {
          // refill the lookup table for entries e0 .. e0 + table_entries - 1: independent index
          // and page-table reads in flight at once instead of two dependent ones per tile.
          // Pages of whole tiles only (a partial tile's last pages may lie past the sequence's)
          cutlass::arch::NamedBarrier::sync(kProducerThreads, kProducerBarrier);  // last table read
          if (ptid < (table_entries << ppt_log2)) {
            const int e = ptid >> ppt_log2, i = ptid & (pages_per_tile - 1);
            const int n = wk.entry_tile(p, e0 + e);
            if (i == 0) ss.tab_tile[e] = n;
            int page = 0;
            if (n >= 0 && (tile_in_one_page || (pages_per_tile > 1 && (n + 1) * kTileN <= lkv)))
              page = pt_row[(n * kTileN + i * tma.box_rows) / page_size];
            ss.tab_page[ptid] = page;
          }
          cutlass::arch::NamedBarrier::sync(kProducerThreads, kProducerBarrier);
        }
        cutlass::arch::ClusterBarrier::wait(&ss.empty[st], ((it / kStages) & 1) ^ 1);
        if (k < n_main) {
          // whole tiles go by TMA (2 x d/64 boxes per tile or per page); a partial or missing
          // tile by everyone's cp.async with zero-fill (its keys past Lkv must not carry stale
          // pool bytes, NaN included, into P V)
          int by_tma = 0;
          if (tma.enabled) {
            CUTE_UNROLL
            for (int hf = 0; hf < kTilesPerStage; ++hf) {
              const int n = ss.tab_tile[(e0 + hf) & (table_entries - 1)];
              if (n >= 0 && (n + 1) * kTileN <= lkv) by_tma |= 1 << hf;
            }
          }
          if (by_tma && lane == 0 && warp < issuers) {
            // box q (page q % pages_per_tile of tile q / pages_per_tile) from warp q % issuers;
            // each issuer expects its own boxes' bytes before issuing them (and before its arrive
            // below), so full[st] cannot complete without them
            const int rows = kTileN >> ppt_log2;
            const int n_boxes = kTilesPerStage << ppt_log2;
            constexpr int kPerRow = kHeadDim * int(sizeof(Element));  // bytes of one key's K (V)
            const uint32_t box_bytes = rows * kPerRow * (vt_by_cp_async ? 1 : 2);  // K and V
            uint32_t bytes = 0;
#pragma unroll 1
            for (int q = warp; q < n_boxes; q += issuers)
              if (by_tma >> (q >> ppt_log2) & 1) bytes += box_bytes;
            if (bytes) mbarrier_expect_tx(&ss.full[st], bytes);
#pragma unroll 1
            for (int q = warp; q < n_boxes; q += issuers) {
              const int hf = q >> ppt_log2, i = q & (pages_per_tile - 1);
              if (!(by_tma >> hf & 1)) continue;
              const int e = (e0 + hf) & (table_entries - 1);
              const int n = ss.tab_tile[e];
              const int page = ss.tab_page[(e << ppt_log2) + i];
              const int slot0 = (n * kTileN + i * rows) % page_size;
              // stage row: a multiple of 8, where the 128-byte swizzle pattern starts over
              const int row = hf * kTileN + i * rows;
              CUTE_UNROLL
              for (int cb = 0; cb < kHeadDim / kBoxCols; ++cb) {
                tma_load_4d(&sK(row, cb * kBoxCols, st), &tma.k, &ss.full[st], cb * kBoxCols, h, slot0, page);
                if constexpr (!kFp8)
                  tma_load_4d(&sV(row, cb * kBoxCols, st), &tma.v, &ss.full[st], cb * kBoxCols, h, slot0, page);
              }
              // fp8: the tile's V^T, keys x all d rows of the token-major pool, in one box
              if constexpr (kFp8) {
                if (!vt_by_cp_async) tma_load_4d(&sVt(0, hf * kTileN, st), &tma.v, &ss.full[st], slot0, 0, h, page);
              }
            }
          }
#pragma unroll 1
          for (int hf = 0; hf < kTilesPerStage; ++hf) {
            const bool tile_by_tma = by_tma >> hf & 1;
            if (tile_by_tma && !vt_by_cp_async) continue;
            const int e = (e0 + hf) & (table_entries - 1);
            const int n = ss.tab_tile[e];  // uniform over the CTA
            const int j0 = n * kTileN;
            const int64_t page0 = ss.tab_page[e << ppt_log2];  // pages of 64 keys or more
            if (!tile_by_tma) {
              // pages under 64 keys: the page and slot of this warp's 16 rows, one lookup per
              // row (RowPages), handed to the row's copying lanes by shuffles: no page-table
              // read in the chunk loop
              int row_page = 0, row_slot = 0;
              if (!tile_in_one_page) {
                const int j = j0 + RowPages::fetch_row(ptid);
                if (n >= 0 && j < lkv) {
                  row_page = pt_row[j / page_size];
                  row_slot = j % page_size;
                }
              }
#pragma unroll 2
              for (int i = 0; i < kTileN / kRowsPerPass; ++i) {
                const int c = ptid + i * kProducerThreads;
                // r = RowPages::row(ptid, i); the column recomputed a pass (the same every pass,
                // but held across the loop it made the producer spill in the persistent d=128 kernels)
                const int r = c / kChunksPerRow, col = (c % kChunksPerRow) * kChunk;
                const int j = j0 + r;
                const bool ok = n >= 0 && j < lkv;
                int64_t page, slot;
                if (tile_in_one_page) {
                  page = page0;
                  slot = j0 % page_size + r;
                } else {
                  const int src = RowPages::src_lane(ptid, i);
                  page = __shfl_sync(0xffffffffu, row_page, src);
                  slot = __shfl_sync(0xffffffffu, row_slot, src);
                }
                const Element* ks = ok ? k_head + page * p.sk_p + slot * p.sk_s + col : k_ptr;
                cp_async_16(&sK(hf * kTileN + r, col, st), ks, ok);
                if constexpr (!kFp8) {
                  const Element* vs = ok ? v_head + page * p.sv_p + slot * p.sv_s + col : v_ptr;
                  cp_async_16(&sV(hf * kTileN + r, col, st), vs, ok);
                }
              }
            }
            if constexpr (kFp8) {
              // V^T: 16 keys of one d row per chunk (token-major pages hold whole chunks: the
              // host asks page_size % 16 == 0); keys past Lkv zero-filled byte by byte. A thread's
              // chunks share their keys (c % kKeyChunks = ptid % kKeyChunks): one page lookup
              constexpr int kKeyChunks = kTileN / 16;
              static_assert(kHeadDim * kKeyChunks % kProducerThreads == 0 && kProducerThreads % kKeyChunks == 0);
              const int c16 = ptid % kKeyChunks;
              const int j = j0 + 16 * c16;
              const int bytes = n >= 0 ? max(0, min(16, lkv - j)) : 0;
              int64_t page = page0;
              if (!tile_in_one_page) page = bytes > 0 ? pt_row[j / page_size] : 0;
              const Element* vs0 = v_head + page * p.sv_p + j % page_size;
#pragma unroll 2
              for (int i = 0; i < kHeadDim * kKeyChunks / kProducerThreads; ++i) {
                const int dd = (ptid + i * kProducerThreads) / kKeyChunks;
                const Element* vs = bytes > 0 ? vs0 + int64_t(dd) * p.sv_d : v_ptr;
                cp_async_16_bytes(&sVt(dd, hf * kTileN + 16 * c16, st), vs, bytes);
              }
            }
          }
        } else if (tma.means) {
          // a chunk of kCorrBlocks block means (rows past the last block read as zeros or as
          // other blocks' means; -inf bias). 16-bit: boxes of the hi rows into stage rows
          // [0, kCorrBlocks) and of the lo rows (total_blocks further) into the rest
          if (ptid == 0) {
            constexpr uint32_t kChunkBytes = 2 * kBlockN * kHeadDim * sizeof(Element);
            mbarrier_expect_tx(&ss.full[st], kChunkBytes);
            const int row0 = int(blk0) + (k - n_main) * T::kCorrBlocks;
            CUTE_UNROLL
            for (int cb = 0; cb < kHeadDim / kBoxCols; ++cb) {
              if constexpr (kFp8) {
                tma_load_3d(&sK(0, cb * kBoxCols, st), &tma.kbar, &ss.full[st], cb * kBoxCols, h, row0);
              } else {
                CUTE_UNROLL
                for (int part = 0; part < 2; ++part) {
                  const int row = row0 + part * p.total_blocks;
                  tma_load_3d(&sK(part * T::kCorrBlocks, cb * kBoxCols, st), &tma.kbar, &ss.full[st],
                              cb * kBoxCols, h, row);
                  tma_load_3d(&sV(part * T::kCorrBlocks, cb * kBoxCols, st), &tma.vbar, &ss.full[st],
                              cb * kBoxCols, h, row);
                }
              }
            }
            // fp8: V^T means from the block-major [Hkv, d, columns] vbar, 64 means x d per box.
            // A box's first column must be 16-byte aligned (a box at column 11 faults with an
            // illegal instruction on the H200): each sequence's means start at a multiple of 64
            if constexpr (kFp8) {
              const int col0 = int(vblk0) + (k - n_main) * kBlockN;
              CUTE_UNROLL
              for (int hb = 0; hb < kBlockN / 64; ++hb)
                tma_load_3d(&sVt(0, hb * 64, st), &tma.vbar, &ss.full[st], col0 + hb * 64, 0, h);
            }
          }
        } else if constexpr (!kFp8) {  // fp8: the host always makes the means' TMA maps
          const int chunk = k - n_main;
#pragma unroll 2
          for (int i = 0; i < kBlockN / kRowsPerPass; ++i) {
            const int c = ptid + i * kProducerThreads;
            const int r = c / kChunksPerRow, col = (c % kChunksPerRow) * kChunk;
            // clamped rows stay in bounds; the consumers give their columns a -inf bias.
            // Stage rows [0, kCorrBlocks): the hi parts; the rest: the lo parts
            const int part = r / T::kCorrBlocks, rb = r % T::kCorrBlocks;
            const int64_t row = blk0 + min(chunk * T::kCorrBlocks + rb, last_blk) + int64_t(part) * p.total_blocks;
            cp_async_16(&sK(r, col, st), kb_head + row * p.skb_t + col, true);
            cp_async_16(&sV(r, col, st), vb_head + row * p.svb_t + col, true);
          }
        }
        cutlass::arch::cpasync_barrier_arrive_noinc(&ss.full[st]);
      }
      if constexpr (!T::kPersistent) break;  // one unit: nothing carried to a next one
    }
    cp_async_wait<0>();
    return;
  }

  // ------------------------------------------------------------------ consumer warpgroups
  cutlass::arch::warpgroup_reg_alloc<T::kConsumerRegs>();
  const int ctid = tid - kProducerThreads;
  const int wg = ctid / 128;  // rows 64 wg .. 64 wg + 63 of the tile
  typename T::TiledMmaS mma_s;
  typename T::TiledMmaO mma_o;
  auto thr_s = mma_s.get_thread_slice(ctid);
  auto thr_o = mma_o.get_thread_slice(ctid);
  Tensor tSrQ = thr_s.partition_fragment_A(sQ);
  Tensor tSrK = thr_s.partition_fragment_B(sK);
  Tensor tOrV = thr_o.partition_fragment_B(sVt);
  Tensor tSrS = partition_fragment_C(mma_s, Shape<Int<kBlockM>, Int<kBlockN>>{});
  Tensor tOrO = partition_fragment_C(mma_o, Shape<Int<kBlockM>, Int<kHeadDim>>{});
  Tensor cS = thr_s.partition_C(make_identity_tensor(Shape<Int<kBlockM>, Int<kBlockN>>{}));
  Tensor cO = thr_o.partition_C(make_identity_tensor(Shape<Int<kBlockM>, Int<kHeadDim>>{}));
  Tensor S = make_tensor(tSrS.data(), acc_rowcol(tSrS.layout()));
  Tensor O = make_tensor(tOrO.data(), acc_rowcol(tOrO.layout()));
  Tensor cSrc = make_tensor(cS.data(), acc_rowcol(cS.layout()));
  Tensor cOrc = make_tensor(cO.data(), acc_rowcol(cO.layout()));
  constexpr int kRows = 2;
  static_assert(size<0>(decltype(S.layout()){}) == kRows, "two rows per thread");
  // P as the A operand: 16-bit values, or fp8 packed four to a 32-bit word
  using PStore = std::conditional_t<kFp8, uint32_t, Element>;
  constexpr int kPSlots = size(decltype(tSrS.layout()){}) / (kFp8 ? 4 : 1);
  Tensor rP = make_tensor<PStore>(Shape<Int<kPSlots>>{});
  Tensor tOrP = make_tensor(reinterpret_cast<Element*>(rP.data()), typename T::LayoutPA{});
  // fp8: probabilities are quantized as round_e4m3(256 p): exponents carry + log2(256), the row
  // sums with them, and the epilogue takes it back out of lse (it cancels in O)
  constexpr float kLog2POffset = kFp8 ? 8.f : 0.f;
  const int lane = ctid % 32;

  // log2 |B_J|: every block is full but possibly the sequence's last one
  const float log2_block = log2f(float(p.block_size));
  const bool is_signaller = (ctid % 128) == 0;

  // Pingpong (FA3): the two warpgroups take turns at issuing their GEMMs, so one's softmax
  // runs while the other's GEMMs hold the tensor cores. Each turn is a named-barrier sync on
  // the warpgroup's own barrier and an arrive on the other's (ids 2 and 3; 1 is the
  // producer's); warpgroup 1 opens the first turn for warpgroup 0. Both warpgroups take the
  // same number of turns per unit (the same items), so the alternation never stalls; the
  // last arrive of the CTA is left unmatched, which ends with the CTA.
  constexpr int kTurnBarrier = 2;
  auto turn_begin = [&]() {
    if constexpr (T::kPingpong) cutlass::arch::NamedBarrier::sync(T::kConsumerThreads, kTurnBarrier + wg);
  };
  auto turn_end = [&]() {
    if constexpr (T::kPingpong) cutlass::arch::NamedBarrier::arrive(T::kConsumerThreads, kTurnBarrier + (wg ^ 1));
  };
  if constexpr (T::kPingpong) {
    if (wg == 1) cutlass::arch::NamedBarrier::arrive(T::kConsumerThreads, kTurnBarrier);
  }

  auto issue_s = [&](int st) {
    warpgroup_fence_operand(tSrS);
    warpgroup_arrive();
    mma_s.accumulate_ = gmma::ScaleOut::Zero;
    CUTE_UNROLL
    for (int kb = 0; kb < size<2>(tSrQ); ++kb) {
      cute::gemm(mma_s, tSrQ(_, _, kb), tSrK(_, _, kb, st), tSrS);
      mma_s.accumulate_ = gmma::ScaleOut::One;
    }
    warpgroup_commit_batch();
  };
  auto issue_pv = [&](int st) {
    warpgroup_fence_operand(rP);
    warpgroup_fence_operand(tOrO);
    warpgroup_arrive();
    CUTE_UNROLL
    for (int kb = 0; kb < size<2>(tOrP); ++kb) cute::gemm(mma_o, tOrP(_, _, kb), tOrV(_, _, kb, st), tOrO);
    warpgroup_commit_batch();
  };
  auto rescale_o = [&](const float (&alpha)[kRows]) {
    CUTE_UNROLL
    for (int i = 0; i < kRows; ++i) {
      CUTE_UNROLL
      for (int j = 0; j < size<1>(O); ++j) O(i, j) *= alpha[i];
    }
  };
  auto convert_p = [&]() {
    if constexpr (kFp8) {
      // per 32-key k-block and row half: 4 groups of 2 keys -> 2 A words (P8Shuffle)
      CUTE_UNROLL
      for (int kb = 0; kb < kBlockN / 32; ++kb) {
        CUTE_UNROLL
        for (int r = 0; r < 2; ++r) {
          uint32_t pr[4];
          CUTE_UNROLL
          for (int gq = 0; gq < 4; ++gq) {
            const int e = 2 * r + 4 * (4 * kb + gq);  // S element (c = 0, r, group 4 kb + gq)
            pr[gq] = cvt_e4m3x2(tSrS(e), tSrS(e + 1));
          }
          const uint32_t y0 = pr[0] | (pr[2] << 16), y1 = pr[1] | (pr[3] << 16);
          const uint32_t ra = __shfl_sync(0xffffffffu, P8Shuffle::send_a(lane, y0, y1), P8Shuffle::lane_a(lane));
          const uint32_t rb = __shfl_sync(0xffffffffu, P8Shuffle::send_b(lane, y0, y1), P8Shuffle::lane_b(lane));
          P8Shuffle::recv(lane, ra, rb, rP(4 * kb + r), rP(4 * kb + 2 + r));
        }
      }
    } else {
      CUTE_UNROLL
      for (int e = 0; e < size(rP); ++e) rP(e) = Element(tSrS(e));
    }
  };

  int it = 0;  // the ring's position over every unit, as the producer's
  int n_unit = 0;
  for (int w = blockIdx.x; w < num_work; w += gridDim.x, ++n_unit) {
    const WsWork<T> wk(p, w);
    const int r0 = wk.r0, n_main = wk.n_main, n_items = wk.n_items, i_hi = wk.i_hi, i_lo = wk.i_lo;
    const int i_mid = wk.i_mid, lkv = wk.lkv, n_blocks_full = wk.n_blocks_full;
    // logit scale (base 2) and the output's factor: fp8 folds the unit's descales in
    float qk_scale = p.qk_scale_log2, out_scale = 1.f;
    if constexpr (kFp8) {
      qk_scale *= __ldg(p.q_descale + wk.b * p.sqd_b + wk.h * p.sqd_h) *
                  __ldg(p.k_descale + wk.b * p.skd_b + wk.h * p.skd_h);
      out_scale = __ldg(p.v_descale + wk.b * p.svd_b + wk.h * p.svd_h);
    }

    float row_max[kRows], row_sum[kRows];
    int key_limit[kRows];
    CUTE_UNROLL
    for (int i = 0; i < kRows; ++i) {
      row_max[i] = neg_inf();
      row_sum[i] = 0.f;  // this thread's partial (its quad's columns), reduced in the epilogue
      key_limit[i] = (r0 + int(get<0>(cSrc(i, 0)))) / g + wk.prefix;
    }
    const int last_J = n_blocks_full - 1;
    const float log2_last =
        log2f(float(max(min(n_blocks_full * p.block_size, lkv) - last_J * p.block_size, 1)));
    clear(tOrO);

    auto wait_full = [&](int k) {
      cutlass::arch::ClusterBarrier::wait(&ss.full[(it + k) % kStages], ((it + k) / kStages) & 1);
      // cp.async writes through the generic proxy and wgmma reads through the async one: a stage
      // that may hold cp.async data needs the proxy fence (a MEMBAR + FENCE.VIEW.ASYNC in SASS).
      // TMA writes through the async proxy, and the producer used TMA alone for correction
      // chunks (tma.means) and for items without a diagonal or missing tile (those tiles are
      // fully visible, hence whole: (n + 1) * 64 <= lo + 1 <= Lkv), but for e4m3 V^T at pages
      // under 64 keys (cp.async).
      const bool tma_only = k >= n_main ? bool(tma.means)
                                        : tma.enabled && !(kFp8 && tma.box_rows < kTileN) &&
                                              i_hi - 1 - k * kTilesPerStage < i_mid &&
                                              i_hi - 1 - k * kTilesPerStage - (kTilesPerStage - 1) >= i_lo;
      if (!tma_only) fence_proxy_async();
    };
    auto stage = [&](int k) { return (it + k) % kStages; };
    auto release = [&](int k) {
      if (is_signaller) cutlass::arch::ClusterBarrier::arrive(&ss.empty[(it + k) % kStages]);
    };
    // after the unit's last S GEMM: the producer may load the next unit's Q
    auto release_q = [&]() {
      if (is_signaller) cutlass::arch::ClusterBarrier::arrive(&ss.q_empty);
    };

    // online softmax of item k on the S accumulator: scores -> exp2(s - m); returns alpha
    auto softmax = [&](int k, float (&alpha)[kRows]) {
      const bool corr = k >= n_main;
      // the stage's two CSR tiles as scalars (an array indexed by a column would live in local memory)
      int tile_lo = -1, tile_hi = -1;
      bool masked = false;
      if (!corr) {
        const int pos_top = i_hi - 1 - k * kTilesPerStage;
        masked = pos_top >= i_mid || pos_top - (kTilesPerStage - 1) < i_lo;  // diagonal or half empty
        if (masked) {  // a few items per segment: read the index directly
          tile_lo = wk.item_tile(p, k, 0);
          tile_hi = kTilesPerStage > 1 ? wk.item_tile(p, k, 1) : tile_lo;
        }
      }
      const int chunk = k - n_main;
      // one branch per item, not per column (the compiler does not unswitch the column loop)
      // 16-bit correction: slot j + kHalf holds column col(j) + kCorrBlocks (layout_check.cu),
      // the lo part of the same block's score
      constexpr int kHalf = kFp8 ? 0 : int(size<1>(decltype(S.layout()){})) / 2;
      if (corr) {
        CUTE_UNROLL
        for (int j = 0; j < (kFp8 ? int(size<1>(S)) : kHalf); ++j) {
          const int J = chunk * T::kCorrBlocks + get<1>(cSrc(0, j));  // a column's coordinate is row-independent
          // one L1-resident word per column: hoisting the chunk's words into registers spills
          const uint32_t word =
              J < n_blocks_full ? __ldg(p.corr_bits + int64_t(wk.seg) * p.words_per_seg + (J >> 5)) : 0u;
          float bias = neg_inf();
          if (J < n_blocks_full && ((word >> (J & 31)) & 1) == 0) bias = J == last_J ? log2_last : log2_block;
          CUTE_UNROLL
          for (int i = 0; i < kRows; ++i) {
            if constexpr (!kFp8) S(i, j) += S(i, j + kHalf);  // q . (hi + lo)
            S(i, j) = fmaf(S(i, j), qk_scale, bias);  // base-2 logits
            if constexpr (!kFp8) S(i, j + kHalf) = S(i, j);  // P duplicated: P V = p (hi + lo)
          }
        }
      } else if (masked) {
        // column slot j lies in the step's tile j / kColsPerTile (checked by layout_check.cu):
        // choosing the tile by j keeps the per-column keys thread base + constant, where
        // `col % 64` made ptxas keep 32 column residues live (and spill some)
        constexpr int kColsPerTile = size<1>(decltype(S.layout()){}) / kTilesPerStage;
        CUTE_UNROLL
        for (int j = 0; j < size<1>(S); ++j) {
          const int hf = j / kColsPerTile;
          const int n = hf == 0 ? tile_lo : tile_hi;
          const int key = n * kTileN + get<1>(cSrc(0, j)) - hf * kTileN;
          CUTE_UNROLL
          for (int i = 0; i < kRows; ++i)
            if (n < 0 || key > key_limit[i] || key >= lkv) S(i, j) = neg_inf();
        }
      }
      float mx[kRows];
      CUTE_UNROLL
      for (int i = 0; i < kRows; ++i) {
        mx[i] = neg_inf();
        CUTE_UNROLL
        for (int j = 0; j < size<1>(S); ++j) mx[i] = fmaxf(mx[i], S(i, j));
      }
      // raw scores stay unscaled (max commutes with the positive scale): one FFMA per exp2
      const float sc = corr ? 1.f : qk_scale;
      CUTE_UNROLL
      for (int i = 0; i < kRows; ++i) {
        const float m_new = fmaxf(row_max[i], quad_max(mx[i]) * sc);
        const float m_use = m_new == neg_inf() ? 0.f : m_new;
        alpha[i] = fast_exp2(row_max[i] - m_use);
        row_max[i] = m_new;
        const float shift = kLog2POffset - m_use;
        float sum = 0.f;
        if (!kFp8 && corr) {  // each block once in the row sum; its duplicate gets the same p
          CUTE_UNROLL
          for (int j = 0; j < kHalf; ++j) {
            const float e = fast_exp2(fmaf(S(i, j), sc, shift));
            S(i, j) = e;
            S(i, j + kHalf) = e;
            sum += e;
          }
        } else {
          CUTE_UNROLL
          for (int j = 0; j < size<1>(S); ++j) {
            const float e = fast_exp2(fmaf(S(i, j), sc, shift));
            S(i, j) = e;
            sum += e;
          }
        }
        row_sum[i] = row_sum[i] * alpha[i] + sum;
      }
    };

    cutlass::arch::ClusterBarrier::wait(&ss.q_full, n_unit & 1);
    fence_proxy_async();
    if (n_items > 0) {
      float alpha[kRows];
      wait_full(0);
      turn_begin();
      issue_s(stage(0));
      turn_end();
      warpgroup_wait<0>();
      warpgroup_fence_operand(tSrS);
      if (n_items == 1) release_q();
      softmax(0, alpha);
      convert_p();
      for (int k = 1; k < n_items; ++k) {
        wait_full(k);
        turn_begin();
        issue_s(stage(k));
        // O *= alpha_{k-1} while S_k runs on the tensor cores (FA3's order): O is free since
        // P_{k-2} V_{k-2} completed, and P_{k-1} V_{k-1} below accumulates onto the rescaled O
        if (k > 1) rescale_o(alpha);
        issue_pv(stage(k - 1));
        turn_end();
        warpgroup_wait<1>();  // S_k landed; P_{k-1} V_{k-1} may still run
        warpgroup_fence_operand(tSrS);
        if (k == n_items - 1) release_q();
        softmax(k, alpha);
        // the softmax must run while P_{k-1} V_{k-1} does. ptxas schedules the wait to the top of
        // the basic block that holds the max/exp2 code, serialising them after the PV GEMM; a
        // branch on the row sums (never taken: they are sums of exponentials) ends the block there.
        // (__trap() there would make ptxas keep a stack and spill; an empty nanosleep does not.)
        warpgroup_fence_operand(tSrS);
        if (row_sum[0] < 0.f || row_sum[1] < 0.f) asm volatile("nanosleep.u32 1;");
        warpgroup_wait<0>();
        warpgroup_fence_operand(tOrO);
        release(k - 1);
        convert_p();
      }
      turn_begin();
      if (n_items > 1) rescale_o(alpha);
      issue_pv(stage(n_items - 1));
      turn_end();
      warpgroup_wait<0>();
      warpgroup_fence_operand(tOrO);
      release(n_items - 1);
    } else {
      release_q();
    }
    it += n_items;

    // ---- epilogue: normalise, write out + lse (or the split partials) -----------------------
    const int num_qo_heads = p.num_qo_heads;
    CUTE_UNROLL
    for (int i = 0; i < kRows; ++i) {
      const float l = quad_sum(row_sum[i]);
      const int r = get<0>(cOrc(i, 0));
      if (r >= wk.rows_valid) continue;
      const int pr = r0 + r;
      const int64_t out_row = int64_t(wk.q0 + pr / g) * num_qo_heads + wk.h * g + pr % g;
      const bool has = l > 0.f;
      const float inv = has ? out_scale / l : 0.f;
      const float lse2 = has ? row_max[i] + log2f(l) - kLog2POffset : neg_inf();
      // column slots 2m and 2m + 1 are adjacent columns (layout_check.cu): one 4-byte (or
      // 8-byte, fp32 partials) store per pair
      if (p.num_splits == 1) {
        OutElement* out = static_cast<OutElement*>(p.out) + out_row * kHeadDim;
        CUTE_UNROLL
        for (int j = 0; j < size<1>(O); j += 2) {
          cutlass::AlignedArray<OutElement, 2> pair;
          pair[0] = OutElement(O(i, j) * inv);
          pair[1] = OutElement(O(i, j + 1) * inv);
          *reinterpret_cast<cutlass::AlignedArray<OutElement, 2>*>(out + get<1>(cOrc(i, j))) = pair;
        }
        if ((ctid & 3) == 0) p.lse[out_row] = lse2 * 0.6931471805599453f;
      } else {
        const int64_t prow = int64_t(wk.u) * p.total_q * num_qo_heads + out_row;
        float* out = p.o_part + prow * kHeadDim;
        CUTE_UNROLL
        for (int j = 0; j < size<1>(O); j += 2)
          *reinterpret_cast<float2*>(out + get<1>(cOrc(i, j))) = make_float2(O(i, j) * inv, O(i, j + 1) * inv);
        if ((ctid & 3) == 0) p.lse_part[prow] = lse2;
      }
    }
    if constexpr (!T::kPersistent) break;
  }
}
