// A block shared with another process (DeviceEngine::share, open_shared, close_shared; docs/PYTORCH.md,
// "Sharing across processes").
//
// What travels is a description (bytes) and file descriptors: a lease first, then one per physical handle
// under the block, in address order (driver.h, R18). The receiving process passes both to open_shared. The
// descriptors go as descriptors do (SCM_RIGHTS, multiprocessing's fd passing), never as numbers.
#pragma once
#include <string>
#include <vector>

namespace fragless {

class SharedBlock {
 public:
  SharedBlock() = default;
  ~SharedBlock() { close_fds(); }
  SharedBlock(SharedBlock&& o) noexcept : description(std::move(o.description)), fds(std::move(o.fds)) { o.fds.clear(); }
  SharedBlock& operator=(SharedBlock&& o) noexcept;
  SharedBlock(const SharedBlock&) = delete;
  SharedBlock& operator=(const SharedBlock&) = delete;

  // Closes this copy of the descriptors. A lease stays open wherever a copy of it is (in a message on its
  // way, in a process that opened the block): the exporter's block is held until every copy is closed.
  void close_fds();

  std::string description;
  std::vector<int> fds;  // owned
};

}  // namespace fragless
