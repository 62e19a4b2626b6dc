// libFuzzer harness: shared-memory frame validation and payload decoding
// (step plans, step results, attention requests, error frames) on arbitrary
// bytes, in the order a ring reader applies them: the header is checked
// against the slot's size before any decoder reads the payload.
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <vector>

#include "shm/frame.h"
#include "shm/messages.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < sizeof(ellm::shm::FrameHeader)) return 0;
  ellm::shm::FrameHeader header;
  std::memcpy(&header, data, sizeof(header));
  // The payload in its own allocation, so a read past it is caught.
  std::vector<uint8_t> payload(data + sizeof(header), data + size);
  if (!ellm::shm::ValidateFrameHeader(header, payload.size()).ok()) return 0;
  const uint8_t* p = payload.data();
  (void)ellm::shm::DecodeStepPlan(header, p, 2048, 512);
  (void)ellm::shm::DecodeStepResult(header, p);
  std::vector<ellm::shm::SeqSlice> slices;
  (void)ellm::shm::DecodeAttnRequest(header, p, ellm::shm::AttnShape{4, 2, 8}, 2048, &slices);
  (void)ellm::shm::DecodeError(header, p);
  return 0;
}
