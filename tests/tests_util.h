// Small helpers shared by the tests.
#pragma once

#include <string>

namespace ellm::testing {

// The shared models folder (../shared/models next to the repository).
std::string ModelsDir();
// A fresh private folder under /tmp for one test; removed by the caller.
std::string MakeTempDir(const std::string& tag);

}  // namespace ellm::testing
