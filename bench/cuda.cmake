# The GPU benchmark of the CUDA MLP backend. include()d from
# bench/CMakeLists.txt; a target only in builds with the CUDA toolkit.
if(ELLM_HAVE_CUDA AND TARGET ellm_mlp_cuda)
  add_executable(ellm-mlp-bench ${CMAKE_CURRENT_LIST_DIR}/mlp_gpu_bench.cc)
  target_link_libraries(ellm-mlp-bench PRIVATE ellm_mlp_cuda)
endif()
