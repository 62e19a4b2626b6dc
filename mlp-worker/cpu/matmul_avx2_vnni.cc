// The "avx2-vnni" matrix kernel set: matmul_avx2.cc compiled with AVX-VNNI
// (VEX VPDPBUSD / VPDPWSSD) for the int8 products.
#define ELLM_AVX2_VNNI 1
#include "mlp-worker/cpu/matmul_avx2.cc"  // NOLINT(build/include)
