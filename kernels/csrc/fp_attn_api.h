// Plain C ABI of the CUTLASS/CuTe attention stage (loaded from Python with ctypes, so the
// library never links against torch: a build made on a CPU machine runs under any torch).
//
// Every pointer is a device pointer; strides are in elements. The Python mirror of
// FpAttnParams is kernels/cutlass_build.py:FpAttnParams (checked by fp_params_size()).
#ifndef FP_ATTN_API_H
#define FP_ATTN_API_H

#include <stddef.h>
#include <stdint.h>

#define FP_ABI_VERSION 8

// E4M3: q, k, v float8_e4m3fn with float32 descales (kernels/fp8.py); head_dim 128, V stored
// token-major ([num_pages, Hkv, d, page_size]: sv_s == 1) with page_size % 16 == 0; bf16 output.
enum FpDtype { FP_DTYPE_BF16 = 0, FP_DTYPE_FP16 = 1, FP_DTYPE_E4M3 = 2 };

// Attention kernel: warp-specialized with 128 or 64 keys per softmax step; with 128, also with
// the consumer warpgroups in pingpong order, persistent (one CTA per SM) with pingpong, and
// persistent without pingpong (docs/PERF_NOTES.md "CUTLASS").
enum FpKernel {
  FP_KERNEL_WS128 = 0,
  FP_KERNEL_WS64 = 1,
  FP_KERNEL_WS128_PINGPONG = 2,
  FP_KERNEL_WS128_PERSISTENT = 3,
  FP_KERNEL_WS128_PERSISTENT_NOPINGPONG = 4,
};

enum FpStatus {
  FP_OK = 0,
  FP_ERR_ARGUMENT = 1,     // unsupported dtype / head_dim, bad shape or alignment
  FP_ERR_CUDA = 2,         // a CUDA runtime call failed (message in fp_last_error())
};

typedef struct FpAttnParams {
  // tensors
  const void* q;             // [total_q, Hq, d], q dtype
  const void* k;             // [num_pages, page_size, Hkv, d]
  const void* v;             // [num_pages, page_size, Hkv, d] (strides sv_*; e4m3: token-major)
  const void* kbar;          // block means (correction only). 16-bit: [2 * total_blocks, Hkv, d]
                             // in q dtype, rows J the fp32 means rounded (hi), rows total_blocks + J
                             // the remainders (lo); e4m3: [total_blocks, Hkv, d] re-quantized
  const void* vbar;          // the same (strides svb_*; e4m3: block-major [Hkv, d, blocks])
  void* out;                 // [total_q, Hq, d] contiguous, q dtype (bf16 for e4m3)
  float* lse;                // [total_q, Hq] contiguous, natural log
  float* o_part;             // [num_splits, total_q * Hq, d] (num_splits > 1)
  float* lse_part;           // [num_splits, total_q * Hq], base-2 log (num_splits > 1)
  const int32_t* seg_offsets;  // [num_segments + 1] (sparse)
  const int32_t* kv_tiles;     // CSR tile list (sparse)
  const int32_t* order;        // [num_segments] segments by decreasing work
  const int32_t* corr_bits;    // [num_segments, words_per_seg] selected-block bitmask
  const int32_t* cu_seqlens_q; // [B + 1]
  const int32_t* seqlens_kv;   // [B]
  const int32_t* cu_qtiles;    // [B + 1]
  const int32_t* cu_blocks;    // [B + 1]
  const int32_t* cu_blocks_v;  // e4m3 correction: [B + 1] first column of each sequence's V means
                               // in vbar (multiples of 64: whole 64-byte TMA boxes per sequence)
  const int32_t* tile_seq;     // [total_tiles]
  const int32_t* page_table;   // [B, max_pages]
  const float* q_descale;      // e4m3: [B, Hkv] views (strides sqd_*, ...; 0 to broadcast)
  const float* k_descale;
  const float* v_descale;
  // strides (elements)
  int64_t sq_t, sq_h;
  int64_t sk_p, sk_s, sk_h;
  int64_t sv_p, sv_s, sv_h, sv_d;
  int64_t skb_t, skb_h;
  int64_t svb_t, svb_h, svb_d;
  int64_t s_pt;
  int64_t sqd_b, sqd_h, skd_b, skd_h, svd_b, svd_h;
  // sizes and options
  int32_t total_q;
  int32_t total_tiles;
  int32_t num_segments;
  int32_t num_splits;
  int32_t words_per_seg;
  int32_t group_size;       // Hq / Hkv
  int32_t num_qo_heads;
  int32_t head_dim;         // 64 or 128
  int32_t page_size;
  int32_t num_pages;        // K/V pool pages (the TMA descriptors' outer extent)
  int32_t total_blocks;     // rows of kbar/vbar (correction only)
  int32_t block_size;       // logical block Bs (multiple of 64)
  int32_t dtype;            // FpDtype
  int32_t correction;       // mean correction on (sparse only)
  int32_t dense;            // every visible tile, no index
  int32_t device;           // CUDA device ordinal of every tensor
  float qk_scale_log2;      // softmax scale * log2(e)
  int32_t kernel_variant;   // FpKernel
  int32_t max_ctas;         // persistent variants: at most this many CTAs (0: one per SM)
} FpAttnParams;

#ifdef __cplusplus
extern "C" {
#endif

int fp_abi_version(void);
size_t fp_params_size(void);
// Attention stage (and the split combine when num_splits > 1) on `stream` (a cudaStream_t).
int fp_sparse_attn_fwd(const FpAttnParams* params, void* stream);
// Registers, spill bytes, static + dynamic shared memory of the attention kernel of a variant
// (needs a GPU): out[0..3] = regs, local bytes, shared bytes, max threads.
int fp_kernel_attributes(int variant, int dtype, int head_dim, int* out4);
// Message of the last error of this thread ("" when none).
const char* fp_last_error(void);

#ifdef __cplusplus
}
#endif

#endif  // FP_ATTN_API_H
