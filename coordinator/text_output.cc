#include "coordinator/text_output.h"

#include <algorithm>

namespace ellm::coord {

TextOutput::TextOutput(const Tokenizer& tokenizer, std::vector<std::string> stop, int32_t prev)
    : decoder_(tokenizer, prev), stop_(std::move(stop)) {
  stop_.erase(std::remove(stop_.begin(), stop_.end(), std::string()), stop_.end());
}

std::string TextOutput::Push(int32_t token, bool* stopped) {
  *stopped = false;
  text_ += decoder_.Push(token);
  // A stop string that completed: it can start no earlier than the longest
  // stop string before the unsent text.
  size_t longest = 0;
  for (const std::string& s : stop_) longest = std::max(longest, s.size());
  const size_t search_from = emitted_ >= longest ? emitted_ - longest + 1 : 0;
  size_t first = std::string::npos;
  for (const std::string& s : stop_) {
    const size_t at = text_.find(s, search_from);
    if (at != std::string::npos && at >= emitted_) first = std::min(first, at);
  }
  if (first != std::string::npos) {
    *stopped = true;
    std::string out = text_.substr(emitted_, first - emitted_);
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
