#include "shm/segment.h"

#include <fcntl.h>

#include <cerrno>
#include <exception>
#include <string_view>
#include <utility>

#include "absl/strings/str_cat.h"
#include "boost/interprocess/exceptions.hpp"
#include "boost/interprocess/mapped_region.hpp"
#include "boost/interprocess/shared_memory_object.hpp"

namespace ellm::shm {

namespace bip = boost::interprocess;

struct SharedSegment::Impl {
  bip::shared_memory_object object;
  bip::mapped_region region;
};

namespace {

absl::StatusCode CodeFor(bip::error_code_t code) {
  switch (code) {
    case bip::already_exists_error:
      return absl::StatusCode::kAlreadyExists;
    case bip::not_found_error:
    case bip::not_such_file_or_directory:
      return absl::StatusCode::kNotFound;
    case bip::security_error:
    case bip::read_only_error:
      return absl::StatusCode::kPermissionDenied;
    case bip::out_of_space_error:
    case bip::out_of_memory_error:
    case bip::out_of_resource_error:
      return absl::StatusCode::kResourceExhausted;
    case bip::invalid_argument:
    case bip::path_error:
    case bip::size_error:
    case bip::mode_error:
      return absl::StatusCode::kInvalidArgument;
    case bip::busy_error:
      return absl::StatusCode::kUnavailable;
    default:
      return absl::StatusCode::kInternal;
  }
}

absl::Status FromException(const bip::interprocess_exception& e, const char* what,
                           const std::string& name) {
  return absl::Status(CodeFor(e.get_error_code()),
                      absl::StrCat(what, " shared memory segment '", name, "': ", e.what()));
}

// POSIX names are "/name" with no further slash; Boost adds the leading one.
absl::Status CheckName(const std::string& name) {
  std::string_view rest = name;
  if (!rest.empty() && rest.front() == '/') rest.remove_prefix(1);
  if (rest.empty() || rest.find('/') != std::string_view::npos || rest.size() > 250) {
    return absl::InvalidArgumentError(
        absl::StrCat("bad shared memory segment name '", name,
                     "' (want a non-empty name without '/' after the first character)"));
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::unique_ptr<SharedSegment>> SharedSegment::Create(const std::string& name,
                                                                     size_t bytes) {
  RETURN_IF_ERROR(CheckName(name));
  if (bytes == 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("shared memory segment '", name, "' needs a size > 0"));
  }
  auto impl = std::make_unique<Impl>();
  try {
    bip::permissions owner_only;
    owner_only.set_permissions(0600);
    impl->object = bip::shared_memory_object(bip::create_only, name.c_str(), bip::read_write,
                                             owner_only);
  } catch (const bip::interprocess_exception& e) {
    return FromException(e, "cannot create", name);
  } catch (const std::exception& e) {
    return absl::InternalError(
        absl::StrCat("cannot create shared memory segment '", name, "': ", e.what()));
  }
  // From here on the name is ours: remove it again on any failure.
  absl::Status status;
  try {
    impl->object.truncate(static_cast<bip::offset_t>(bytes));
    // Reserve the pages now, so that a full /dev/shm is an error here rather
    // than a SIGBUS on first touch. ftruncate already gives zeros.
    int fd = impl->object.get_mapping_handle().handle;
    int rc = posix_fallocate(fd, 0, static_cast<off_t>(bytes));
    if (rc == ENOSPC || rc == EFBIG) {
      status = absl::ResourceExhaustedError(absl::StrCat(
          "cannot reserve ", bytes, " bytes for shared memory segment '", name, "' (/dev/shm full)"));
    }
    if (status.ok()) impl->region = bip::mapped_region(impl->object, bip::read_write);
  } catch (const bip::interprocess_exception& e) {
    status = FromException(e, "cannot size or map", name);
  } catch (const std::exception& e) {
    status = absl::InternalError(
        absl::StrCat("cannot size or map shared memory segment '", name, "': ", e.what()));
  }
  if (!status.ok()) {
    impl.reset();
    Remove(name);
    return status;
  }
  std::unique_ptr<SharedSegment> segment(new SharedSegment());
  segment->data_ = impl->region.get_address();
  segment->size_ = impl->region.get_size();
  segment->impl_ = std::move(impl);
  segment->name_ = name;
  segment->owner_ = true;
  return segment;
}

absl::StatusOr<std::unique_ptr<SharedSegment>> SharedSegment::Open(const std::string& name) {
  RETURN_IF_ERROR(CheckName(name));
  auto impl = std::make_unique<Impl>();
  try {
    impl->object = bip::shared_memory_object(bip::open_only, name.c_str(), bip::read_write);
    bip::offset_t size = 0;
    if (!impl->object.get_size(size)) {
      return absl::InternalError(
          absl::StrCat("cannot read the size of shared memory segment '", name, "'"));
    }
    if (size <= 0) {
      // The creator has made the name but not sized it yet.
      return absl::UnavailableError(
          absl::StrCat("shared memory segment '", name, "' is still empty"));
    }
    impl->region = bip::mapped_region(impl->object, bip::read_write);
  } catch (const bip::interprocess_exception& e) {
    return FromException(e, "cannot open", name);
  } catch (const std::exception& e) {
    return absl::InternalError(
        absl::StrCat("cannot open shared memory segment '", name, "': ", e.what()));
  }
  std::unique_ptr<SharedSegment> segment(new SharedSegment());
  segment->data_ = impl->region.get_address();
  segment->size_ = impl->region.get_size();
  segment->impl_ = std::move(impl);
  segment->name_ = name;
  segment->owner_ = false;
  return segment;
}

bool SharedSegment::Remove(const std::string& name) {
  try {
    return bip::shared_memory_object::remove(name.c_str());
  } catch (const std::exception&) {
    return false;
  }
}

SharedSegment::~SharedSegment() {
  impl_.reset();  // unmaps and closes
  if (owner_) Remove(name_);
}

}  // namespace ellm::shm
