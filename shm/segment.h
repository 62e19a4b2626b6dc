// Named POSIX shared-memory segments (Boost.Interprocess) with an RAII owner.
#pragma once

#include <cstddef>
#include <memory>
#include <string>

#include "core/status.h"

namespace ellm::shm {

class SharedSegment {
 public:
  // Creates a new segment of `bytes` bytes, zero-filled, readable and writable
  // by the owner only (0600). AlreadyExists when the name is taken. The
  // returned object owns the name: its destructor unmaps and removes it.
  static absl::StatusOr<std::unique_ptr<SharedSegment>> Create(const std::string& name,
                                                               size_t bytes);
  // Maps an existing segment (not owned: the destructor only unmaps).
  // NotFound when it does not exist.
  static absl::StatusOr<std::unique_ptr<SharedSegment>> Open(const std::string& name);
  // Removes a segment by name; true when one was removed.
  static bool Remove(const std::string& name);

  ~SharedSegment();
  SharedSegment(const SharedSegment&) = delete;
  SharedSegment& operator=(const SharedSegment&) = delete;

  void* data() const { return data_; }
  size_t size() const { return size_; }
  const std::string& name() const { return name_; }
  bool owner() const { return owner_; }

 private:
  struct Impl;
  SharedSegment() = default;
  std::unique_ptr<Impl> impl_;
  void* data_ = nullptr;
  size_t size_ = 0;
  std::string name_;
  bool owner_ = false;
};

}  // namespace ellm::shm
