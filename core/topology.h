// NUMA topology: which physical cores belong to which node. Discovered from
// /sys, or given as a spec ("0:0-7;1:8-15" = node 0 has cpus 0..7, node 1
// has 8..15) so tests and odd machines can inject it.
#pragma once

#include <string>
#include "absl/strings/string_view.h"
#include <vector>

#include "core/status.h"

namespace ellm {

struct NumaNode {
  int id = 0;
  std::vector<int> cpus;  // one logical cpu per physical core (SMT siblings left out)
};

struct Topology {
  std::vector<NumaNode> nodes;
  int TotalCores() const;
  std::string DebugString() const;  // "0:0-7;1:8-15"
};

// Reads /sys/devices/system/node and each cpu's thread_siblings_list; a
// machine without NUMA information is one node holding every core.
absl::StatusOr<Topology> DiscoverTopology();
absl::StatusOr<Topology> ParseTopologySpec(absl::string_view spec);
// "0-3,8,10-11" -> {0,1,2,3,8,10,11}.
absl::StatusOr<std::vector<int>> ParseCpuList(absl::string_view list);
std::string FormatCpuList(const std::vector<int>& cpus);

// The CPU's model name (/proc/cpuinfo), spaces as they are; "unknown" when
// it cannot be read. Every benchmark line carries it: a figure without its
// CPU means nothing.
std::string CpuModelName();

}  // namespace ellm
