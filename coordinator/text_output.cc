#include "coordinator/text_output.h"

#include <algorithm>

namespace ellm::coord {
namespace {
const std::vector<std::string> kNoStops;
}  // namespace

TextOutput::TextOutput(const Tokenizer& tokenizer, std::vector<std::string> stop, int32_t prev, bool include_stop)
    : decoder_(tokenizer, prev), stop_(std::move(stop)), include_stop_(include_stop) {
  stop_.erase(std::remove(stop_.begin(), stop_.end(), std::string()), stop_.end());
}

std::string TextOutput::Push(int32_t token, bool look, bool* stopped) {
  *stopped = false;
  const size_t before = text_.size();
  text_ += decoder_.Push(token);
  // A stop string that completed: in the unsent text, ending in the new.
  // (Looking each time, one that ends earlier was found then.)
  size_t first = std::string::npos, last = 0;  // the earliest one's start and end
  for (const std::string& s : look ? stop_ : kNoStops) {
    for (size_t at = text_.find(s, emitted_); at != std::string::npos; at = text_.find(s, at + 1)) {
      if (at + s.size() > before) {
        if (at < first || (at == first && at + s.size() > last)) {
          first = at;
          last = at + s.size();
        }
        break;
      }
    }
  }
  if (first != std::string::npos) {
    *stopped = true;
    std::string out = text_.substr(emitted_, (include_stop_ ? last : first) - emitted_);
    emitted_ = text_.size();
    return out;
  }
  // Hold back the longest tail that is a proper prefix of a stop string.
  size_t hold = 0;
  for (const std::string& s : stop_) {
    for (size_t n = std::min(s.size() - 1, text_.size() - emitted_); n > hold; --n) {
      if (text_.compare(text_.size() - n, n, s, 0, n) == 0) {
        hold = n;
        break;
      }
    }
  }
  const size_t end = text_.size() - hold;
  std::string out = text_.substr(emitted_, end - emitted_);
  emitted_ = end;
  return out;
}

std::string TextOutput::Flush() {
  text_ += decoder_.Finish();
  std::string out = text_.substr(emitted_);
  emitted_ = text_.size();
  return out;
}

}  // namespace ellm::coord
