#include "tests/tests_util.h"

#include <stdlib.h>

namespace ellm::testing {

std::string ModelsDir() { return ELLM_MODELS_DIR; }

std::string MakeTempDir(const std::string& tag) {
  std::string pattern = "/tmp/ellm-test-" + tag + "-XXXXXX";
  char* dir = mkdtemp(pattern.data());
  return dir == nullptr ? std::string() : std::string(dir);
}

}  // namespace ellm::testing
