#include "tests/tests_util.h"

#include <stdlib.h>

#include <fstream>
#include <sstream>

namespace ellm::testing {

std::string ModelsDir() { return ELLM_MODELS_DIR; }

std::string MakeTempDir(const std::string& tag) {
  std::string pattern = "/tmp/ellm-test-" + tag + "-XXXXXX";
  char* dir = mkdtemp(pattern.data());
  return dir == nullptr ? std::string() : std::string(dir);
}

bool CpuinfoHas(const std::string& flag) {
  std::ifstream in("/proc/cpuinfo");
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind("flags", 0) != 0) continue;
    std::istringstream words(line.substr(line.find(':') + 1));
    std::string w;
    while (words >> w) {
      if (w == flag) return true;
    }
    return false;
  }
  return false;
}

}  // namespace ellm::testing
