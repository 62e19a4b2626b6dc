// The "avx2-vnni" kernel: attention_avx2.cc compiled with AVX-VNNI (VEX
// VPDPBUSD) for the int8 products.
#define ELLM_AVX2_VNNI 1
#include "attn-worker/attention_avx2.cc"  // NOLINT(build/include)
