// FlashPrefill V2 attention stage on Hopper (sm_90a) with CUTLASS/CuTe: block-sparse attention
// over the CSR index with mean correction, exactly the function of kernels/triton_attention.py
// and kernels/reference.py (SPEC.md "Attention stage with mean correction").
//
// Supports
// - bf16 / fp16, head_dim 64 and 128, fp32 accumulation; softmax in base 2.
// - PackGQA: one CTA per (sequence, KV head, 128-row query tile[, split]), rows r = p*g + t.
// - Paged K/V, any page_size: one page-table lookup per 64-key tile when page_size % 64 == 0,
//   one per key row otherwise; rows past Lkv are zero-filled (cp.async src-size 0).
// - The CSR list walked backwards (diagonal tiles first, masked; fully visible tiles unmasked),
//   then the mean-correction chunks (64 block means each, logit bias log2|B_J| or -inf from the
//   selected-block bitmask) in the same online softmax and the same smem pipeline.
// - Split-KV by tile count (eq. 18) with an exact LSE combine (combine_splits_kernel); CTAs
//   ordered by the caller's decreasing-work order. dense=1: every visible tile, no index.
// Structure (v0): 256 threads = 2 warpgroups, each owning 64 of the 128 rows. Every thread
// issues cp.async for a kStages-deep K/V ring (gathered through the page table), then both
// warpgroups run S = Q K^T (wgmma SS, Q resident in smem), the online softmax in registers and
// O += P V (wgmma RS, P converted in registers). One __syncthreads per tile.
// Does not (yet): warp specialization / setmaxnreg, a persistent scheduler, TMA, softmax-GEMM
// overlap across tiles, two CSR entries per step, FP8 (docs/PERF_NOTES.md "CUTLASS").
#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_runtime.h>

#include <cstdarg>
#include <cstdio>
#include <cstring>

#include <cutlass/arch/barrier.h>
#include <cutlass/arch/reg_reconfig.h>

#include "fp_attn_api.h"
#include "sparse_attn_traits.cuh"

namespace fp {

// TMA descriptors of the K and V pools (ws kernels; enabled when a page holds whole 64-key
// tiles). Passed as a __grid_constant__ kernel parameter: TMA reads descriptors in param space.
struct FpTmaMaps {
  CUtensorMap k;
  CUtensorMap v;
  CUtensorMap kbar;  // correction means: one box = one chunk of block means of one head
  CUtensorMap vbar;
  int enabled;
  int means;
};

__device__ __forceinline__ float neg_inf() { return __int_as_float(0xff800000); }

__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// 16-byte cp.async; src_bytes = 0 writes zeros and reads nothing
__device__ __forceinline__ void cp_async_16(void* smem, const void* gmem, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_u32(smem)),
               "l"(gmem), "r"(valid ? 16 : 0));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}
// cp.async writes through the generic proxy; wgmma reads shared memory through the async proxy
__device__ __forceinline__ void fence_proxy_async() {
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}

__device__ __forceinline__ float quad_max(float x) {
  x = fmaxf(x, __shfl_xor_sync(0xffffffff, x, 1));
  return fmaxf(x, __shfl_xor_sync(0xffffffff, x, 2));
}
__device__ __forceinline__ float quad_sum(float x) {
  x += __shfl_xor_sync(0xffffffff, x, 1);
  return x + __shfl_xor_sync(0xffffffff, x, 2);
}

// One warpgroup-wide GEMM C (+)= A B over every k-block, waited to completion.
template <bool kZeroInit, class TiledMma, class TA, class TB, class TC>
__device__ __forceinline__ void wg_gemm(TiledMma& mma, TA const& a, TB const& b, TC& c) {
  warpgroup_fence_operand(c);
  warpgroup_arrive();
  if constexpr (kZeroInit) mma.accumulate_ = gmma::ScaleOut::Zero;
  CUTE_UNROLL
  for (int kb = 0; kb < size<2>(a); ++kb) {
    cute::gemm(mma, a(_, _, kb), b(_, _, kb), c);
    mma.accumulate_ = gmma::ScaleOut::One;
  }
  warpgroup_commit_batch();
  warpgroup_wait<0>();
  warpgroup_fence_operand(c);
}

template <class T>
__global__ void __launch_bounds__(T::kThreads, 1) sparse_attn_fwd_kernel(const FpAttnParams p,
                                                                         const __grid_constant__ FpTmaMaps) {
  using Element = typename T::Element;
  constexpr int kBlockM = T::kBlockM, kBlockN = T::kBlockN, kHeadDim = T::kHeadDim;
  constexpr int kStages = T::kStages, kThreads = T::kThreads;
  constexpr int kChunk = T::kChunk, kChunksPerRow = T::kChunksPerRow;

  // SW128 layouts need a 1024-byte aligned base
  extern __shared__ char smem_raw[];
  const uint32_t pad = (1024u - (smem_u32(smem_raw) & 1023u)) & 1023u;
  SharedStorage<T>& ss = *reinterpret_cast<SharedStorage<T>*>(smem_raw + pad);

  const int tid = threadIdx.x;
  const int num_splits = p.num_splits;
  const int rank = blockIdx.x / num_splits;
  const int u = blockIdx.x % num_splits;
  const int seg = p.order[rank];
  const int h = seg / p.total_tiles;
  const int t = seg % p.total_tiles;
  const int b = p.tile_seq[t];
  const int tile = t - p.cu_qtiles[b];
  const int q0 = p.cu_seqlens_q[b];
  const int lq = p.cu_seqlens_q[b + 1] - q0;
  const int lkv = p.seqlens_kv[b];
  const int prefix = lkv - lq;
  const int g = p.group_size;

  // PackGQA rows r0 .. r0 + rows_valid - 1 of this tile: r = pos * g + head offset
  const int r0 = tile * kBlockM;
  const int rows_valid = min(kBlockM, g * lq - r0);
  const int lo = r0 / g + prefix;                       // pmin + P
  const int hi = (r0 + rows_valid - 1) / g + prefix;    // pmax + P
  const int first_masked = (lo + 1) / kBlockN;          // tiles >= this cross the diagonal

  // the segment's ascending tile list; dense: every tile up to the horizon
  int seg_lo = 0, n_list, n_diag;
  if (p.dense) {
    n_list = hi / kBlockN + 1;
    n_diag = n_list - first_masked;
  } else {
    seg_lo = p.seg_offsets[seg];
    n_list = p.seg_offsets[seg + 1] - seg_lo;
    n_diag = 0;  // the masked tiles are a short suffix of the list
    while (n_diag < n_list && p.kv_tiles[seg_lo + n_list - 1 - n_diag] >= first_masked) ++n_diag;
  }
  // split u owns list positions [i_lo, i_hi), counted from the top (eq. 18)
  const int per_split = (n_list + num_splits - 1) / num_splits;
  const int i_hi = max(n_list - u * per_split, 0);
  const int i_lo = max(n_list - (u + 1) * per_split, 0);
  const int i_mid = n_list - n_diag;
  const int n_masked = max(i_hi - max(i_lo, i_mid), 0);
  const int n_main = i_hi - i_lo;  // item k < n_main is list position i_hi - 1 - k

  // mean correction: fully visible blocks without a selected tile, owned by the last split
  int n_blocks_full = 0, n_corr = 0;
  if (p.correction && !p.dense && u == num_splits - 1) {
    n_blocks_full = (lo + 1 < lkv) ? (lo + 1) / p.block_size
                                   : (lkv + p.block_size - 1) / p.block_size;
    n_corr = (n_blocks_full + kBlockN - 1) / kBlockN;
  }
  const int n_items = n_main + n_corr;

  const Element* q_ptr = static_cast<const Element*>(p.q);
  const Element* k_ptr = static_cast<const Element*>(p.k);
  const Element* v_ptr = static_cast<const Element*>(p.v);
  const Element* k_head = k_ptr + h * p.sk_h;
  const Element* v_head = v_ptr + h * p.sv_h;
  const int32_t* pt_row = p.page_table + b * p.s_pt;
  const int page_size = p.page_size;
  const bool tile_in_one_page = (page_size % kBlockN) == 0;

  Tensor sQ = make_tensor(make_smem_ptr(ss.q.data()), typename T::SmemLayoutQ{});
  Tensor sK = make_tensor(make_smem_ptr(ss.k.data()), typename T::SmemLayoutKV{});
  Tensor sV = make_tensor(make_smem_ptr(ss.v.data()), typename T::SmemLayoutKV{});
  Tensor sVt = make_tensor(make_smem_ptr(ss.v.data()), typename T::SmemLayoutVt{});

  // ---- loaders (every thread; chunk c = tid + i * kThreads: row c / kChunksPerRow) ----------
  static_assert(kBlockN * kChunksPerRow % kThreads == 0);
  auto load_q = [&]() {
    static_assert(kBlockM * kChunksPerRow % kThreads == 0);
    CUTE_UNROLL
    for (int i = 0; i < kBlockM * kChunksPerRow / kThreads; ++i) {
      const int c = tid + i * kThreads;
      const int r = c / kChunksPerRow, col = (c % kChunksPerRow) * kChunk;
      const int pr = r0 + r;
      const bool ok = r < rows_valid;
      const Element* src = ok ? q_ptr + int64_t(q0 + pr / g) * p.sq_t +
                                    int64_t(h * g + pr % g) * p.sq_h + col
                              : q_ptr;
      cp_async_16(&sQ(r, col), src, ok);
    }
  };
  auto load_tile = [&](int n, int st) {
    const int j0 = n * kBlockN;
    int64_t page0 = 0;
    if (tile_in_one_page) page0 = pt_row[j0 / page_size];
    CUTE_UNROLL
    for (int i = 0; i < kBlockN * kChunksPerRow / kThreads; ++i) {
      const int c = tid + i * kThreads;
      const int r = c / kChunksPerRow, col = (c % kChunksPerRow) * kChunk;
      const int j = j0 + r;
      const bool ok = j < lkv;
      int64_t page, slot;
      if (tile_in_one_page) {
        page = page0;
        slot = j0 % page_size + r;
      } else {
        page = ok ? pt_row[j / page_size] : 0;
        slot = j % page_size;
      }
      const Element* ks = ok ? k_head + page * p.sk_p + slot * p.sk_s + col : k_ptr;
      const Element* vs = ok ? v_head + page * p.sv_p + slot * p.sv_s + col : v_ptr;
      cp_async_16(&sK(r, col, st), ks, ok);
      cp_async_16(&sV(r, col, st), vs, ok);
    }
    if (tid == 0) ss.tile[st] = n;
  };
  const int64_t blk0 = p.correction ? p.cu_blocks[b] : 0;
  const int last_blk = max(n_blocks_full - 1, 0);
  auto load_means = [&](int chunk, int st) {
    const Element* kb = static_cast<const Element*>(p.kbar) + h * p.skb_h;
    const Element* vb = static_cast<const Element*>(p.vbar) + h * p.svb_h;
    CUTE_UNROLL
    for (int i = 0; i < kBlockN * kChunksPerRow / kThreads; ++i) {
      const int c = tid + i * kThreads;
      const int r = c / kChunksPerRow, col = (c % kChunksPerRow) * kChunk;
      // clamped rows stay in bounds; their columns get a -inf bias
      const int64_t row = blk0 + min(chunk * kBlockN + r, last_blk);
      cp_async_16(&sK(r, col, st), kb + row * p.skb_t + col, true);
      cp_async_16(&sV(r, col, st), vb + row * p.svb_t + col, true);
    }
    if (tid < kBlockN) {
      const int J = chunk * kBlockN + tid;
      const int32_t word = p.corr_bits[int64_t(seg) * p.words_per_seg + (J >> 5)];
      const bool todo = J < n_blocks_full && ((word >> (J & 31)) & 1) == 0;
      const int size = min((J + 1) * p.block_size, lkv) - J * p.block_size;
      ss.bias[st][tid] = todo ? log2f(float(max(size, 1))) : neg_inf();
    }
  };
  auto load_item = [&](int k, int st) {
    if (k < n_main) {
      const int pos = i_hi - 1 - k;
      load_tile(p.dense ? pos : p.kv_tiles[seg_lo + pos], st);
    } else {
      load_means(k - n_main, st);
    }
  };

  // ---- MMA partitions ------------------------------------------------------------------------
  typename T::TiledMmaS mma_s;
  typename T::TiledMmaO mma_o;
  auto thr_s = mma_s.get_thread_slice(tid);
  auto thr_o = mma_o.get_thread_slice(tid);
  Tensor tSrQ = thr_s.partition_fragment_A(sQ);   // descriptors
  Tensor tSrK = thr_s.partition_fragment_B(sK);   // (MMA, N, K, stage)
  Tensor tOrV = thr_o.partition_fragment_B(sVt);  // (MMA, d, keys, stage)
  Tensor tSrS = partition_fragment_C(mma_s, Shape<Int<kBlockM>, Int<kBlockN>>{});
  Tensor tOrO = partition_fragment_C(mma_o, Shape<Int<kBlockM>, Int<kHeadDim>>{});
  Tensor cS = thr_s.partition_C(make_identity_tensor(Shape<Int<kBlockM>, Int<kBlockN>>{}));
  Tensor cO = thr_o.partition_C(make_identity_tensor(Shape<Int<kBlockM>, Int<kHeadDim>>{}));
  Tensor S = make_tensor(tSrS.data(), acc_rowcol(tSrS.layout()));  // (2 rows, 16 cols)
  Tensor O = make_tensor(tOrO.data(), acc_rowcol(tOrO.layout()));  // (2 rows, d/4 cols)
  Tensor cSrc = make_tensor(cS.data(), acc_rowcol(cS.layout()));
  Tensor cOrc = make_tensor(cO.data(), acc_rowcol(cO.layout()));
  static_assert(size<0>(decltype(S.layout()){}) == 2, "two rows per thread");
  constexpr int kRows = 2;
  clear(tOrO);

  float row_max[kRows], row_sum[kRows];
  int key_limit[kRows];  // last key each row sees (pos + P)
  CUTE_UNROLL
  for (int i = 0; i < kRows; ++i) {
    row_max[i] = neg_inf();
    row_sum[i] = 0.f;  // this thread's partial sum (its quad's columns); reduced at the end
    key_limit[i] = (r0 + int(get<0>(cSrc(i, 0)))) / g + prefix;
  }
  const float qk_scale = p.qk_scale_log2;

  auto compute_item = [&](int k, int st) {
    wg_gemm<true>(mma_s, tSrQ, tSrK(_, _, _, st), tSrS);
    const bool masked = k < n_masked;
    const bool corr = k >= n_main;
    const int key0 = ss.tile[st] * kBlockN;
    CUTE_UNROLL
    for (int i = 0; i < kRows; ++i) {
      float mx = neg_inf();
      CUTE_UNROLL
      for (int j = 0; j < size<1>(S); ++j) {
        float s = S(i, j) * qk_scale;
        const int col = get<1>(cSrc(i, j));
        if (masked) {
          const int key = key0 + col;
          if (key > key_limit[i] || key >= lkv) s = neg_inf();
        }
        if (corr) s += ss.bias[st][col];
        S(i, j) = s;
        mx = fmaxf(mx, s);
      }
      mx = quad_max(mx);
      const float m_new = fmaxf(row_max[i], mx);
      // rows that have seen nothing yet keep m = -inf: shift by 0 instead of NaN
      const float m_use = m_new == neg_inf() ? 0.f : m_new;
      const float alpha = exp2f(row_max[i] - m_use);
      row_max[i] = m_new;
      float sum = 0.f;
      CUTE_UNROLL
      for (int j = 0; j < size<1>(S); ++j) {
        const float e = exp2f(S(i, j) - m_use);
        S(i, j) = e;
        sum += e;
      }
      row_sum[i] = row_sum[i] * alpha + sum;
      CUTE_UNROLL
      for (int j = 0; j < size<1>(O); ++j) O(i, j) *= alpha;
    }
    // P in the input dtype as the register A operand of O += P V
    Tensor rP = make_tensor<Element>(Shape<Int<size(decltype(tSrS.layout()){})>>{});
    CUTE_UNROLL
    for (int e = 0; e < size(rP); ++e) rP(e) = Element(tSrS(e));
    Tensor tOrP = make_tensor(rP.data(), typename T::LayoutPA{});
    warpgroup_fence_operand(rP);
    wg_gemm<false>(mma_o, tOrP, tOrV(_, _, _, st), tOrO);
  };

  // ---- pipeline: kStages - 1 items in flight ahead of the one computed ----------------------
  load_q();
  CUTE_UNROLL
  for (int s = 0; s < kStages - 1; ++s) {
    if (s < n_items) load_item(s, s);
    cp_async_commit();  // empty groups keep the group count uniform
  }
  for (int k = 0; k < n_items; ++k) {
    cp_async_wait<kStages - 2>();  // this thread's copies of item k (and Q) have landed
    fence_proxy_async();
    __syncthreads();  // everyone's copies landed; everyone finished item k - 1
    const int kn = k + kStages - 1;
    if (kn < n_items) load_item(kn, kn % kStages);  // the buffer item k - 1 used
    cp_async_commit();
    compute_item(k, k % kStages);
  }
  cp_async_wait<0>();

  // ---- epilogue: normalise, write out + lse (or the split partials) -------------------------
  const int num_qo_heads = p.num_qo_heads;
  CUTE_UNROLL
  for (int i = 0; i < kRows; ++i) {
    const float l = quad_sum(row_sum[i]);
    const int r = get<0>(cOrc(i, 0));
    if (r >= rows_valid) continue;
    const int pr = r0 + r;
    const int64_t out_row = int64_t(q0 + pr / g) * num_qo_heads + h * g + pr % g;
    const bool has = l > 0.f;
    const float inv = has ? 1.f / l : 0.f;
    const float lse2 = has ? row_max[i] + log2f(l) : neg_inf();
    if (num_splits == 1) {
      Element* out = static_cast<Element*>(p.out) + out_row * kHeadDim;
      CUTE_UNROLL
      for (int j = 0; j < size<1>(O); ++j) out[get<1>(cOrc(i, j))] = Element(O(i, j) * inv);
      if ((tid & 3) == 0) p.lse[out_row] = lse2 * 0.6931471805599453f;
    } else {
      const int64_t prow = int64_t(u) * p.total_q * num_qo_heads + out_row;
      float* out = p.o_part + prow * kHeadDim;
      CUTE_UNROLL
      for (int j = 0; j < size<1>(O); ++j) out[get<1>(cOrc(i, j))] = O(i, j) * inv;
      if ((tid & 3) == 0) p.lse_part[prow] = lse2;
    }
  }
}

#include "sparse_attn_ws.cuh"

// Exact merge of the split partials (base-2 LSE): one warp per (token, head) row.
template <class Element, int kHeadDim>
__global__ void __launch_bounds__(256) combine_splits_kernel(const float* o_part,
                                                             const float* lse_part,
                                                             Element* out, float* lse,
                                                             int64_t n_rows, int num_splits) {
  const int64_t row = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) / 32;
  const int lane = threadIdx.x % 32;
  if (row >= n_rows) return;
  float m = neg_inf();
  for (int u = 0; u < num_splits; ++u) m = fmaxf(m, lse_part[u * n_rows + row]);
  const float m_use = m == neg_inf() ? 0.f : m;
  constexpr int kPer = kHeadDim / 32;
  float acc[kPer];
  CUTE_UNROLL
  for (int e = 0; e < kPer; ++e) acc[e] = 0.f;
  float den = 0.f;
  for (int u = 0; u < num_splits; ++u) {
    const int64_t prow = u * n_rows + row;
    const float w = exp2f(lse_part[prow] - m_use);
    den += w;
    CUTE_UNROLL
    for (int e = 0; e < kPer; ++e) acc[e] += w * o_part[prow * kHeadDim + lane + 32 * e];
  }
  CUTE_UNROLL
  for (int e = 0; e < kPer; ++e) out[row * kHeadDim + lane + 32 * e] = Element(acc[e] / den);
  if (lane == 0) lse[row] = (m_use + log2f(den)) * 0.6931471805599453f;
}

}  // namespace fp

// ------------------------------------------------------------------------------------------
// C ABI
// ------------------------------------------------------------------------------------------

namespace {

thread_local char g_error[512] = "";

int fail(int code, const char* fmt, ...) {
  va_list args;
  va_start(args, fmt);
  std::vsnprintf(g_error, sizeof(g_error), fmt, args);
  va_end(args);
  return code;
}

int cuda_fail(cudaError_t err, const char* where) {
  std::snprintf(g_error, sizeof(g_error), "%s: %s (%s)", where, cudaGetErrorString(err),
                cudaGetErrorName(err));
  return FP_ERR_CUDA;
}

// The attention kernel of a (variant, dtype, head_dim) and its dynamic shared memory.
template <class Element, int kHeadDim>
struct Variants {
  using V0 = fp::AttnTraits<Element, kHeadDim>;
  using Ws128 = fp::WsTraits<Element, kHeadDim, 128, kHeadDim == 128 ? 3 : 4>;
  using Ws64 = fp::WsTraits<Element, kHeadDim, 64, kHeadDim == 128 ? 5 : 8>;

  template <class F>
  static int with(int variant, F&& f) {
    switch (variant) {
      case FP_KERNEL_WS128:
        return f(fp::sparse_attn_fwd_ws_kernel<Ws128>, sizeof(fp::WsSharedStorage<Ws128>) + 1024,
                 Ws128::kThreads);
      case FP_KERNEL_WS64:
        return f(fp::sparse_attn_fwd_ws_kernel<Ws64>, sizeof(fp::WsSharedStorage<Ws64>) + 1024,
                 Ws64::kThreads);
      case FP_KERNEL_V0:
        return f(fp::sparse_attn_fwd_kernel<V0>, sizeof(fp::SharedStorage<V0>) + 1024, V0::kThreads);
      default:
        return fail(FP_ERR_ARGUMENT, "unknown kernel variant %d", variant);
    }
  }
};

PFN_cuTensorMapEncodeTiled_v12000 tensor_map_encoder() {
  static PFN_cuTensorMapEncodeTiled_v12000 fn = [] {
    void* ptr = nullptr;
    cudaDriverEntryPointQueryResult found;
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &ptr, 12000, cudaEnableDefault,
                                         &found) != cudaSuccess ||
        found != cudaDriverEntryPointSuccess)
      ptr = nullptr;
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(ptr);
  }();
  return fn;
}

// One tensor map, 64 elements (128 bytes: the 128B swizzle's row) wide, bf16/fp16.
int encode_map(CUtensorMap* map, const void* base, int rank, const cuuint64_t* dims,
               const cuuint64_t* strides_bytes, const cuuint32_t* box, int dtype, const char* what) {
  const auto encode = tensor_map_encoder();
  if (encode == nullptr) return fail(FP_ERR_CUDA, "cuTensorMapEncodeTiled is not available from the driver");
  const cuuint32_t unit[4] = {1, 1, 1, 1};
  const CUresult r = encode(map, dtype == FP_DTYPE_BF16 ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 : CU_TENSOR_MAP_DATA_TYPE_FLOAT16,
                            cuuint32_t(rank), const_cast<void*>(base), dims, strides_bytes, box, unit,
                            CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                            CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (r != CUDA_SUCCESS) return fail(FP_ERR_CUDA, "cuTensorMapEncodeTiled(%s) failed: CUresult %d", what, int(r));
  return FP_OK;
}

// A [num_pages, page_size, Hkv, d] pool as a 4-D map (d, head, slot, page); box = one 64-key tile of one head.
int encode_pool_map(CUtensorMap* map, const void* base, int64_t s_page, int64_t s_slot,
                    int64_t s_head, const FpAttnParams& p, const char* what) {
  constexpr int64_t es = 2;  // bf16 and fp16
  const cuuint64_t dims[4] = {cuuint64_t(p.head_dim), cuuint64_t(p.num_qo_heads / p.group_size),
                              cuuint64_t(p.page_size), cuuint64_t(p.num_pages)};
  const cuuint64_t strides[3] = {cuuint64_t(s_head * es), cuuint64_t(s_slot * es), cuuint64_t(s_page * es)};
  const cuuint32_t box[4] = {64, 1, 64, 1};
  return encode_map(map, base, 4, dims, strides, box, p.dtype, what);
}

// [total_blocks, Hkv, d] block means as a 3-D map (d, head, block); box = `rows` means of one head
// (rows past total_blocks read as zeros; the kernel gives them a -inf bias).
int encode_means_map(CUtensorMap* map, const void* base, int64_t s_blk, int64_t s_head, int rows,
                     const FpAttnParams& p, const char* what) {
  constexpr int64_t es = 2;
  const cuuint64_t dims[3] = {cuuint64_t(p.head_dim), cuuint64_t(p.num_qo_heads / p.group_size),
                              cuuint64_t(p.total_blocks)};
  const cuuint64_t strides[2] = {cuuint64_t(s_head * es), cuuint64_t(s_blk * es)};
  const cuuint32_t box[3] = {64, 1, cuuint32_t(rows)};
  return encode_map(map, base, 3, dims, strides, box, p.dtype, what);
}

template <class Element, int kHeadDim>
int launch(const FpAttnParams& p, cudaStream_t stream) {
  const long grid = long(p.num_segments) * p.num_splits;
  if (grid == 0) return FP_OK;
  fp::FpTmaMaps maps;
  std::memset(&maps, 0, sizeof(maps));
  // TMA for whole tiles: a page must hold whole 64-key tiles (the gathers go through cp.async otherwise)
  if (p.kernel_variant != FP_KERNEL_V0 && p.page_size % 64 == 0 && p.num_pages > 0) {
    int st = encode_pool_map(&maps.k, p.k, p.sk_p, p.sk_s, p.sk_h, p, "k");
    if (st == FP_OK) st = encode_pool_map(&maps.v, p.v, p.sv_p, p.sv_s, p.sv_h, p, "v");
    if (st != FP_OK) return st;
    maps.enabled = 1;
  }
  if (p.kernel_variant != FP_KERNEL_V0 && p.correction && !p.dense && p.total_blocks > 0) {
    const int rows = p.kernel_variant == FP_KERNEL_WS128 ? 128 : 64;  // the variant's kBlockN
    int st = encode_means_map(&maps.kbar, p.kbar, p.skb_t, p.skb_h, rows, p, "kbar");
    if (st == FP_OK) st = encode_means_map(&maps.vbar, p.vbar, p.svb_t, p.svb_h, rows, p, "vbar");
    if (st != FP_OK) return st;
    maps.means = 1;
  }
  int status = Variants<Element, kHeadDim>::with(
      p.kernel_variant, [&](auto kernel, size_t smem, int threads) -> int {
        cudaError_t err =
            cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem));
        if (err != cudaSuccess) return cuda_fail(err, "cudaFuncSetAttribute");
        kernel<<<dim3(unsigned(grid)), dim3(threads), smem, stream>>>(p, maps);
        err = cudaGetLastError();
        if (err != cudaSuccess) return cuda_fail(err, "sparse_attn_fwd launch");
        return FP_OK;
      });
  if (status != FP_OK) return status;
  if (p.num_splits > 1) {
    const int64_t n_rows = int64_t(p.total_q) * p.num_qo_heads;
    const int64_t blocks = (n_rows + 7) / 8;
    fp::combine_splits_kernel<Element, kHeadDim><<<dim3(unsigned(blocks)), dim3(256), 0, stream>>>(
        p.o_part, p.lse_part, static_cast<Element*>(p.out), p.lse, n_rows, p.num_splits);
    cudaError_t err = cudaGetLastError();
    if (err != cudaSuccess) return cuda_fail(err, "combine_splits launch");
  }
  return FP_OK;
}

template <class Element, int kHeadDim>
int attributes(int variant, int* out4) {
  return Variants<Element, kHeadDim>::with(variant, [&](auto kernel, size_t smem, int) -> int {
    cudaFuncAttributes a;
    cudaError_t err = cudaFuncGetAttributes(&a, kernel);
    if (err != cudaSuccess) return cuda_fail(err, "cudaFuncGetAttributes");
    out4[0] = a.numRegs;
    out4[1] = int(a.localSizeBytes);
    out4[2] = int(a.sharedSizeBytes + smem);
    out4[3] = a.maxThreadsPerBlock;
    return FP_OK;
  });
}

struct LaunchFn {
  const FpAttnParams& p;
  cudaStream_t stream;
  template <class E, int D>
  int operator()() { return launch<E, D>(p, stream); }
};

struct AttrFn {
  int variant;
  int* out4;
  template <class E, int D>
  int operator()() { return attributes<E, D>(variant, out4); }
};

// dispatch on (dtype, head_dim) to a compiled instantiation
template <class F>
int dispatch(int dtype, int head_dim, F&& f) {
  if (dtype == FP_DTYPE_BF16 && head_dim == 128) return f.template operator()<cutlass::bfloat16_t, 128>();
  if (dtype == FP_DTYPE_BF16 && head_dim == 64) return f.template operator()<cutlass::bfloat16_t, 64>();
  if (dtype == FP_DTYPE_FP16 && head_dim == 128) return f.template operator()<cutlass::half_t, 128>();
  if (dtype == FP_DTYPE_FP16 && head_dim == 64) return f.template operator()<cutlass::half_t, 64>();
  return fail(FP_ERR_ARGUMENT, "unsupported dtype %d / head_dim %d (bf16/fp16, 64/128)", dtype,
              head_dim);
}

}  // namespace

extern "C" {

int fp_abi_version(void) { return FP_ABI_VERSION; }

size_t fp_params_size(void) { return sizeof(FpAttnParams); }

const char* fp_last_error(void) { return g_error; }

int fp_sparse_attn_fwd(const FpAttnParams* params, void* stream) {
  g_error[0] = '\0';
  if (params == nullptr) return fail(FP_ERR_ARGUMENT, "params is NULL");
  const FpAttnParams& p = *params;
  if (p.num_splits < 1) return fail(FP_ERR_ARGUMENT, "num_splits must be >= 1, got %d", p.num_splits);
  if (p.group_size < 1 || p.num_qo_heads % p.group_size)
    return fail(FP_ERR_ARGUMENT, "group_size %d does not divide num_qo_heads %d", p.group_size,
                p.num_qo_heads);
  if (p.page_size < 1) return fail(FP_ERR_ARGUMENT, "page_size must be >= 1, got %d", p.page_size);
  if (p.num_pages < 0) return fail(FP_ERR_ARGUMENT, "num_pages must be >= 0, got %d", p.num_pages);
  if (p.total_blocks < 0) return fail(FP_ERR_ARGUMENT, "total_blocks must be >= 0, got %d", p.total_blocks);
  if (p.block_size < 64 || p.block_size % 64)
    return fail(FP_ERR_ARGUMENT, "block_size must be a positive multiple of 64, got %d", p.block_size);
  const long strides[] = {p.sq_t, p.sq_h, p.sk_p, p.sk_s, p.sk_h, p.sv_p, p.sv_s, p.sv_h};
  for (long s : strides)
    if (s % 8) return fail(FP_ERR_ARGUMENT, "q/k/v strides must be multiples of 8 elements, got %ld", s);
  const void* ptrs[] = {p.q, p.k, p.v};
  for (const void* ptr : ptrs)
    if (reinterpret_cast<uintptr_t>(ptr) % 16) return fail(FP_ERR_ARGUMENT, "q/k/v must be 16-byte aligned");
  if (p.correction && !p.dense) {
    if (p.kbar == nullptr || p.vbar == nullptr || p.corr_bits == nullptr)
      return fail(FP_ERR_ARGUMENT, "mean correction needs kbar, vbar and corr_bits");
    if (p.skb_t % 8 || p.skb_h % 8 || p.svb_t % 8 || p.svb_h % 8 ||
        reinterpret_cast<uintptr_t>(p.kbar) % 16 || reinterpret_cast<uintptr_t>(p.vbar) % 16)
      return fail(FP_ERR_ARGUMENT, "kbar/vbar must be 16-byte aligned rows");
  }
  if (!((p.dtype == FP_DTYPE_BF16 || p.dtype == FP_DTYPE_FP16) &&
        (p.head_dim == 64 || p.head_dim == 128)))
    return fail(FP_ERR_ARGUMENT, "unsupported dtype %d / head_dim %d (bf16/fp16, 64/128)", p.dtype,
                p.head_dim);
  // launch on the tensors' device and leave the caller's current device as it was (with a
  // shared CUDA runtime it is torch's)
  int previous = 0;
  cudaError_t err = cudaGetDevice(&previous);
  if (err != cudaSuccess) return cuda_fail(err, "cudaGetDevice");
  if (previous != p.device && (err = cudaSetDevice(p.device)) != cudaSuccess)
    return cuda_fail(err, "cudaSetDevice");
  LaunchFn f{p, static_cast<cudaStream_t>(stream)};
  const int status = dispatch(p.dtype, p.head_dim, f);
  if (previous != p.device) cudaSetDevice(previous);
  return status;
}

int fp_kernel_attributes(int variant, int dtype, int head_dim, int* out4) {
  g_error[0] = '\0';
  if (out4 == nullptr) return fail(FP_ERR_ARGUMENT, "out4 is NULL");
  AttrFn f{variant, out4};
  return dispatch(dtype, head_dim, f);
}

}  // extern "C"
