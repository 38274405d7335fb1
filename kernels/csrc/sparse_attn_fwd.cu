// FlashPrefill V2 attention stage on Hopper (sm_90a) with CUTLASS/CuTe: block-sparse attention
// over the CSR index with mean correction, exactly the function of kernels/triton_attention.py
// and kernels/reference.py (SPEC.md "Attention stage with mean correction").
//
// Supports
// - bf16 / fp16, head_dim 64 and 128, fp32 accumulation; softmax in base 2.
// - FP8 e4m3 at head_dim 128 (SPEC.md's eq. 15, kernels/fp8.py): per-(sequence, KV head)
//   descales, V from a token-major pool (page_size % 16 == 0), P as round_e4m3(256 p), bf16 out.
// - PackGQA: one work unit per (sequence, KV head, 128-row query tile[, split]), rows r = p*g + t.
// - Paged K/V, any page_size. Whole 64-key tiles by TMA: one box per tile when page_size % 64
//   == 0 (one page-table lookup per tile), one box per page at page_size 8, 16 or 32 (e4m3: 16,
//   32; its V^T by cp.async there). Everything else by 16-byte cp.async with each row's page
//   looked up once per tile: page sizes 1, 2, 4 and those that neither divide nor are
//   multiples of 64 (24, 48, ...), and the sequence's partial last tile (rows past Lkv
//   zero-filled) at every page size.
// - The CSR list walked backwards (diagonal tiles first, masked; fully visible tiles unmasked),
//   then the mean-correction chunks (logit bias log2|B_J| or -inf from the selected-block
//   bitmask) in the same online softmax and the same smem pipeline. The term uses the fp32
//   means: 16-bit inputs pass each as hi + lo (2 * total_blocks rows of kbar/vbar), a chunk
//   stages the hi and lo rows of kBlockN / 2 blocks and adds the two halves of S; e4m3 takes
//   kBlockN re-quantized means per chunk.
// - Split-KV by tile count (eq. 18) with an exact LSE combine (combine_splits_kernel); CTAs
//   ordered by the caller's decreasing-work order. dense=1: every visible tile, no index.
// Structure (v1, kernels/csrc/sparse_attn_ws.cuh): warp-specialized, 384 threads. A producer
// warpgroup fills a shared-memory ring (TMA boxes for whole 64-key tiles, a box per tile or per
// page, and for the correction chunks, zero-filling cp.async through the page table otherwise); two consumer
// warpgroups (64 of the 128 rows each) run S = Q K^T and O += P V on wgmma with the softmax of
// one step under the GEMMs of the next. 128 keys (two CSR entries) per step, or 64 (ws64);
// ws128_pingpong: the consumer warpgroups also take turns at the tensor cores (FA3's
// pingpong); ws128_persistent: pingpong, and one CTA per SM walking the work units in the
// decreasing-work order with a stride of the grid (no scheduler state: producer and consumers
// compute the same sequence); ws128_persistent_nopingpong: persistent alone.
// Does not (yet): TMA for Q, fp8 with row-major V or head_dim 64 (docs/PERF_NOTES.md "CUTLASS"). The first version (v0, synchronous, 2 warpgroups) is in
// git history and PERF_NOTES.
#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdarg>
#include <cstdio>
#include <cstring>

#include <cutlass/arch/barrier.h>
#include <cutlass/arch/reg_reconfig.h>

#include "fp_attn_api.h"
#include "sparse_attn_traits.cuh"

namespace fp {

// TMA descriptors of the K and V pools (ws kernels; enabled when a page holds whole 64-key
// tiles, or a tile whole pages of 8, 16 or 32 keys). Passed as a __grid_constant__ kernel
// parameter: TMA reads descriptors in param space.
struct FpTmaMaps {
  CUtensorMap k;
  CUtensorMap v;  // unused for e4m3 at box_rows < 64 (V^T by cp.async)
  CUtensorMap kbar;  // correction means: one box = one chunk of block means of one head
  CUtensorMap vbar;
  int enabled;
  int box_rows;  // keys per K/V box: 64 (a tile inside a page) or page_size (8, 16, 32)
  int means;  // correction chunks by TMA (K and V block means)
};

__device__ __forceinline__ float neg_inf() { return __int_as_float(0xff800000); }

__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// 16-byte cp.async of which the first src_bytes (0..16) are read and the rest zero-filled
// (src_bytes = 0 reads nothing)
__device__ __forceinline__ void cp_async_16_bytes(void* smem, const void* gmem, int src_bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_u32(smem)),
               "l"(gmem), "r"(src_bytes));
}
__device__ __forceinline__ void cp_async_16(void* smem, const void* gmem, bool valid) {
  cp_async_16_bytes(smem, gmem, valid ? 16 : 0);
}
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

#include "sparse_attn_ws.cuh"

// Exact merge of the split partials (base-2 LSE): one warp per (token, head) row.
template <class Element, int kHeadDim>  // Element: the output's (bf16 for e4m3 inputs)
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
  // as many stages as fit beside Q (fp8 stages are half the bytes)
  static constexpr bool kFp8 = sizeof(Element) == 1;
  static constexpr int kStages128 = kFp8 ? 5 : kHeadDim == 128 ? 3 : 4;
  using Ws128 = fp::WsTraits<Element, kHeadDim, 128, kStages128>;
  using Ws64 = fp::WsTraits<Element, kHeadDim, 64, kFp8 ? 8 : kHeadDim == 128 ? 5 : 8>;
  using Ws128Pingpong = fp::WsTraits<Element, kHeadDim, 128, kStages128, true, false>;
  using Ws128Persistent = fp::WsTraits<Element, kHeadDim, 128, kStages128, true, true>;
  using Ws128PersistentNoPingpong = fp::WsTraits<Element, kHeadDim, 128, kStages128, false, true>;

  // f(kernel, dynamic shared memory, threads, persistent)
  template <class F>
  static int with(int variant, F&& f) {
    switch (variant) {
      case FP_KERNEL_WS128: return call<Ws128>(f);
      case FP_KERNEL_WS64: return call<Ws64>(f);
      case FP_KERNEL_WS128_PINGPONG: return call<Ws128Pingpong>(f);
      case FP_KERNEL_WS128_PERSISTENT: return call<Ws128Persistent>(f);
      case FP_KERNEL_WS128_PERSISTENT_NOPINGPONG: return call<Ws128PersistentNoPingpong>(f);
      default:
        return fail(FP_ERR_ARGUMENT, "unknown kernel variant %d", variant);
    }
  }
  template <class T, class F>
  static int call(F& f) {
    return f(fp::sparse_attn_fwd_ws_kernel<T>, sizeof(fp::WsSharedStorage<T>) + 1024, T::kThreads,
             T::kPersistent);
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

int64_t element_bytes(int dtype) { return dtype == FP_DTYPE_E4M3 ? 1 : 2; }

// One tensor map: K-major boxes one 128-byte swizzle row wide (64 bf16/fp16, 128 e4m3), or the
// fp8 V^T boxes of 64 keys (64 bytes) under the 64-byte swizzle.
int encode_map(CUtensorMap* map, const void* base, int rank, const cuuint64_t* dims,
               const cuuint64_t* strides_bytes, const cuuint32_t* box, int dtype,
               CUtensorMapSwizzle swizzle, const char* what) {
  const auto encode = tensor_map_encoder();
  if (encode == nullptr) return fail(FP_ERR_CUDA, "cuTensorMapEncodeTiled is not available from the driver");
  const cuuint32_t unit[4] = {1, 1, 1, 1};
  const CUtensorMapDataType type = dtype == FP_DTYPE_BF16   ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16
                                   : dtype == FP_DTYPE_FP16 ? CU_TENSOR_MAP_DATA_TYPE_FLOAT16
                                                            : CU_TENSOR_MAP_DATA_TYPE_UINT8;
  const CUresult r = encode(map, type, cuuint32_t(rank), const_cast<void*>(base), dims, strides_bytes,
                            box, unit, CU_TENSOR_MAP_INTERLEAVE_NONE, swizzle,
                            CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (r != CUDA_SUCCESS) return fail(FP_ERR_CUDA, "cuTensorMapEncodeTiled(%s) failed: CUresult %d", what, int(r));
  return FP_OK;
}

// A [num_pages, page_size, Hkv, d] pool as a 4-D map (d, head, slot, page); box = `box_rows`
// keys (a 64-key tile, or one whole page of 8 to 32 keys) of one head, one swizzle row of d wide.
int encode_pool_map(CUtensorMap* map, const void* base, int64_t s_page, int64_t s_slot,
                    int64_t s_head, int box_rows, const FpAttnParams& p, const char* what) {
  const int64_t es = element_bytes(p.dtype);
  const cuuint64_t dims[4] = {cuuint64_t(p.head_dim), cuuint64_t(p.num_qo_heads / p.group_size),
                              cuuint64_t(p.page_size), cuuint64_t(p.num_pages)};
  const cuuint64_t strides[3] = {cuuint64_t(s_head * es), cuuint64_t(s_slot * es), cuuint64_t(s_page * es)};
  const cuuint32_t box[4] = {cuuint32_t(128 / es), 1, cuuint32_t(box_rows), 1};
  return encode_map(map, base, 4, dims, strides, box, p.dtype, CU_TENSOR_MAP_SWIZZLE_128B, what);
}

// e4m3 V stored token-major ([num_pages, Hkv, d, page_size]) as a 4-D map (slot, d, head,
// page); box = the 64 keys x d of one tile of one head: the tile's V^T stage block.
int encode_pool_vt_map(CUtensorMap* map, const FpAttnParams& p) {
  const cuuint64_t dims[4] = {cuuint64_t(p.page_size), cuuint64_t(p.head_dim),
                              cuuint64_t(p.num_qo_heads / p.group_size), cuuint64_t(p.num_pages)};
  const cuuint64_t strides[3] = {cuuint64_t(p.sv_d), cuuint64_t(p.sv_h), cuuint64_t(p.sv_p)};
  const cuuint32_t box[4] = {64, cuuint32_t(p.head_dim), 1, 1};
  return encode_map(map, p.v, 4, dims, strides, box, p.dtype, CU_TENSOR_MAP_SWIZZLE_64B, "v (token-major)");
}

// [n_rows, Hkv, d] block means as a 3-D map (d, head, row); box = `rows` means of one head
// (rows past n_rows read as zeros; the kernel gives them a -inf bias). 16-bit: n_rows =
// 2 * total_blocks, the hi parts then the lo parts (split_means); e4m3: total_blocks.
int encode_means_map(CUtensorMap* map, const void* base, int64_t s_blk, int64_t s_head, int rows,
                     int64_t n_rows, const FpAttnParams& p, const char* what) {
  const int64_t es = element_bytes(p.dtype);
  const cuuint64_t dims[3] = {cuuint64_t(p.head_dim), cuuint64_t(p.num_qo_heads / p.group_size),
                              cuuint64_t(n_rows)};
  const cuuint64_t strides[2] = {cuuint64_t(s_head * es), cuuint64_t(s_blk * es)};
  const cuuint32_t box[3] = {cuuint32_t(128 / es), 1, cuuint32_t(rows)};
  return encode_map(map, base, 3, dims, strides, box, p.dtype, CU_TENSOR_MAP_SWIZZLE_128B, what);
}

// e4m3 V means stored block-major ([Hkv, d, columns], svb_t == 1, row pitch svb_d >= the
// columns used; each sequence's means start at a multiple of 64 columns, cu_blocks_v) as a 3-D
// map (column, d, head); box = 64 means x d of one head.
int encode_means_vt_map(CUtensorMap* map, const FpAttnParams& p) {
  const cuuint64_t dims[3] = {cuuint64_t(p.svb_d), cuuint64_t(p.head_dim),
                              cuuint64_t(p.num_qo_heads / p.group_size)};
  const cuuint64_t strides[2] = {cuuint64_t(p.svb_d), cuuint64_t(p.svb_h)};
  const cuuint32_t box[3] = {64, cuuint32_t(p.head_dim), 1};
  return encode_map(map, p.vbar, 3, dims, strides, box, p.dtype, CU_TENSOR_MAP_SWIZZLE_64B, "vbar (block-major)");
}

template <class Element, int kHeadDim>
int launch(const FpAttnParams& p, cudaStream_t stream) {
  const long grid = long(p.num_segments) * p.num_splits;
  if (grid == 0) return FP_OK;
  fp::FpTmaMaps maps;
  std::memset(&maps, 0, sizeof(maps));
  // TMA for whole tiles: one box per tile when a page holds whole 64-key tiles; one box per page
  // when whole pages of 8, 16 or 32 keys make up a tile. A page's box then lands at a stage row
  // that is a multiple of 8 (1024 bytes: the 128-byte swizzle pattern's period, the alignment its
  // boxes need); pages of 1, 2 or 4 keys would start a box inside a period, and other sizes do
  // not tile a tile: those gather through cp.async. e4m3 V^T boxes span keys: a page of 16 or 32
  // keys would start inside a 64-byte swizzle row, so V^T takes cp.async below 64 keys a page.
  const bool fp8 = p.dtype == FP_DTYPE_E4M3;
  const int box_rows = p.page_size % 64 == 0                            ? 64
                       : (64 % p.page_size == 0 && p.page_size % 8 == 0) ? p.page_size
                                                                          : 0;
  if (box_rows > 0 && p.num_pages > 0) {
    int st = encode_pool_map(&maps.k, p.k, p.sk_p, p.sk_s, p.sk_h, box_rows, p, "k");
    if (st == FP_OK && !fp8)
      st = encode_pool_map(&maps.v, p.v, p.sv_p, p.sv_s, p.sv_h, box_rows, p, "v");
    if (st == FP_OK && fp8 && box_rows == 64) st = encode_pool_vt_map(&maps.v, p);
    if (st != FP_OK) return st;
    maps.enabled = 1;
    maps.box_rows = box_rows;
  }
  // (fp8 kernels load correction chunks by TMA only)
  if (p.correction && !p.dense && p.total_blocks > 0) {
    // the variant's kCorrBlocks: kBlockN (e4m3) or kBlockN / 2 (16-bit hi + lo)
    const int rows = (p.kernel_variant == FP_KERNEL_WS64 ? 64 : 128) / (fp8 ? 1 : 2);
    const int64_t n_rows = fp8 ? int64_t(p.total_blocks) : 2 * int64_t(p.total_blocks);
    int st = encode_means_map(&maps.kbar, p.kbar, p.skb_t, p.skb_h, rows, n_rows, p, "kbar");
    if (st == FP_OK)
      st = fp8 ? encode_means_vt_map(&maps.vbar, p)
               : encode_means_map(&maps.vbar, p.vbar, p.svb_t, p.svb_h, rows, n_rows, p, "vbar");
    if (st != FP_OK) return st;
    maps.means = 1;
  }
  int status = Variants<Element, kHeadDim>::with(
      p.kernel_variant, [&](auto kernel, size_t smem, int threads, bool persistent) -> int {
        cudaError_t err =
            cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem));
        if (err != cudaSuccess) return cuda_fail(err, "cudaFuncSetAttribute");
        long ctas = grid;
        if (persistent) {  // one CTA per SM (its shared memory and registers allow no second)
          int sms = 0;
          err = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, p.device);
          if (err != cudaSuccess) return cuda_fail(err, "cudaDeviceGetAttribute");
          ctas = std::min(grid, long(p.max_ctas > 0 ? std::min(p.max_ctas, sms) : sms));
        }
        kernel<<<dim3(unsigned(ctas)), dim3(threads), smem, stream>>>(p, maps);
        err = cudaGetLastError();
        if (err != cudaSuccess) return cuda_fail(err, "sparse_attn_fwd launch");
        return FP_OK;
      });
  if (status != FP_OK) return status;
  if (p.num_splits > 1) {
    const int64_t n_rows = int64_t(p.total_q) * p.num_qo_heads;
    const int64_t blocks = (n_rows + 7) / 8;
    using Out = typename Variants<Element, kHeadDim>::Ws128::OutElement;
    fp::combine_splits_kernel<Out, kHeadDim><<<dim3(unsigned(blocks)), dim3(256), 0, stream>>>(
        p.o_part, p.lse_part, static_cast<Out*>(p.out), p.lse, n_rows, p.num_splits);
    cudaError_t err = cudaGetLastError();
    if (err != cudaSuccess) return cuda_fail(err, "combine_splits launch");
  }
  return FP_OK;
}

template <class Element, int kHeadDim>
int attributes(int variant, int* out4) {
  return Variants<Element, kHeadDim>::with(variant, [&](auto kernel, size_t smem, int, bool) -> int {
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
  if (dtype == FP_DTYPE_E4M3 && head_dim == 128) return f.template operator()<cutlass::float_e4m3_t, 128>();
  return fail(FP_ERR_ARGUMENT, "unsupported dtype %d / head_dim %d (bf16/fp16: 64/128, e4m3: 128)",
              dtype, head_dim);
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
  if (p.max_ctas < 0) return fail(FP_ERR_ARGUMENT, "max_ctas must be >= 0, got %d", p.max_ctas);
  if (p.num_pages < 0) return fail(FP_ERR_ARGUMENT, "num_pages must be >= 0, got %d", p.num_pages);
  if (p.total_blocks < 0) return fail(FP_ERR_ARGUMENT, "total_blocks must be >= 0, got %d", p.total_blocks);
  if (p.block_size < 64 || p.block_size % 64)
    return fail(FP_ERR_ARGUMENT, "block_size must be a positive multiple of 64, got %d", p.block_size);
  if (!(((p.dtype == FP_DTYPE_BF16 || p.dtype == FP_DTYPE_FP16) && (p.head_dim == 64 || p.head_dim == 128)) ||
        (p.dtype == FP_DTYPE_E4M3 && p.head_dim == 128)))
    return fail(FP_ERR_ARGUMENT, "unsupported dtype %d / head_dim %d (bf16/fp16: 64/128, e4m3: 128)",
                p.dtype, p.head_dim);
  const bool fp8 = p.dtype == FP_DTYPE_E4M3;
  const long align = 16 / element_bytes(p.dtype);  // elements per 16 bytes
  if (fp8) {
    if (p.sv_s != 1 || p.page_size % 16)
      return fail(FP_ERR_ARGUMENT, "e4m3 needs V token-major (slot stride 1, got %ld) and page_size %% 16 == 0 (got %d)",
                  long(p.sv_s), p.page_size);
    if (p.q_descale == nullptr || p.k_descale == nullptr || p.v_descale == nullptr)
      return fail(FP_ERR_ARGUMENT, "e4m3 needs q/k/v descales");
  } else if (p.sv_d != 1) {
    return fail(FP_ERR_ARGUMENT, "bf16/fp16 V needs a contiguous last dimension (sv_d 1, got %ld)", long(p.sv_d));
  }
  // the contiguous dimension of each tensor (d; the slot for fp8 V) is not in this list
  const long strides[] = {p.sq_t, p.sq_h, p.sk_p, p.sk_s, p.sk_h, p.sv_p, p.sv_h, fp8 ? p.sv_d : p.sv_s};
  for (long s : strides)
    if (s % align) return fail(FP_ERR_ARGUMENT, "q/k/v strides must be multiples of 16 bytes (%ld elements), got %ld", align, s);
  const void* ptrs[] = {p.q, p.k, p.v};
  for (const void* ptr : ptrs)
    if (reinterpret_cast<uintptr_t>(ptr) % 16) return fail(FP_ERR_ARGUMENT, "q/k/v must be 16-byte aligned");
  if (p.correction && !p.dense) {
    if (p.kbar == nullptr || p.vbar == nullptr || p.corr_bits == nullptr)
      return fail(FP_ERR_ARGUMENT, "mean correction needs kbar, vbar and corr_bits");
    const bool vbar_ok = fp8 ? p.svb_t == 1 && p.svb_d % 64 == 0 && p.svb_h % align == 0 && p.cu_blocks_v != nullptr
                             : p.svb_t % align == 0 && p.svb_h % align == 0 && p.svb_d == 1;
    if (p.skb_t % align || p.skb_h % align || !vbar_ok ||
        reinterpret_cast<uintptr_t>(p.kbar) % 16 || reinterpret_cast<uintptr_t>(p.vbar) % 16)
      return fail(FP_ERR_ARGUMENT, "kbar/vbar must be 16-byte aligned rows (e4m3 vbar: block-major, "
                                   "a pitch of whole 64-column boxes, cu_blocks_v)");
  }
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
