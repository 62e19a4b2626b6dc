// Small helpers shared by the tests.
#pragma once

#include <string>

namespace ellm::testing {

// The shared models folder (../shared/models next to the repository).
std::string ModelsDir();
// A fresh private folder under /tmp for one test; removed by the caller.
std::string MakeTempDir(const std::string& tag);
// Whether the kernel's /proc/cpuinfo lists `flag` (e.g. "avx512_vnni"): the
// tests' own view of the CPU, independent of core/cpu_features.
bool CpuinfoHas(const std::string& flag);

}  // namespace ellm::testing
