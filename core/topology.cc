#include "core/topology.h"

#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <set>
#include <sstream>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"

namespace ellm {

int Topology::TotalCores() const {
  int n = 0;
  for (const NumaNode& node : nodes) n += static_cast<int>(node.cpus.size());
  return n;
}

std::string Topology::DebugString() const {
  std::vector<std::string> parts;
  for (const NumaNode& node : nodes) {
    parts.push_back(absl::StrCat(node.id, ":", FormatCpuList(node.cpus)));
  }
  return absl::StrJoin(parts, ";");
}

absl::StatusOr<std::vector<int>> ParseCpuList(absl::string_view list) {
  std::vector<int> cpus;
  list = absl::StripAsciiWhitespace(list);
  if (list.empty()) return cpus;
  for (absl::string_view part : absl::StrSplit(list, ',')) {
    std::vector<absl::string_view> range = absl::StrSplit(part, '-');
    int lo = 0, hi = 0;
    if (range.size() == 1 && absl::SimpleAtoi(range[0], &lo)) {
      hi = lo;
    } else if (range.size() != 2 || !absl::SimpleAtoi(range[0], &lo) ||
               !absl::SimpleAtoi(range[1], &hi) || hi < lo || lo < 0) {
      return absl::InvalidArgumentError(absl::StrCat("bad cpu list '", list, "'"));
    }
    for (int c = lo; c <= hi; ++c) cpus.push_back(c);
  }
  return cpus;
}

std::string FormatCpuList(const std::vector<int>& cpus) {
  std::vector<std::string> parts;
  for (size_t i = 0; i < cpus.size();) {
    size_t j = i;
    while (j + 1 < cpus.size() && cpus[j + 1] == cpus[j] + 1) ++j;
    parts.push_back(j == i ? absl::StrCat(cpus[i]) : absl::StrCat(cpus[i], "-", cpus[j]));
    i = j + 1;
  }
  return absl::StrJoin(parts, ",");
}

absl::StatusOr<Topology> ParseTopologySpec(absl::string_view spec) {
  Topology topo;
  for (absl::string_view node_spec : absl::StrSplit(spec, ';', absl::SkipEmpty())) {
    std::vector<absl::string_view> kv = absl::StrSplit(node_spec, absl::MaxSplits(':', 1));
    NumaNode node;
    if (kv.size() != 2 || !absl::SimpleAtoi(kv[0], &node.id) || node.id < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("bad topology spec '", spec, "' (expected e.g. 0:0-7;1:8-15)"));
    }
    ASSIGN_OR_RETURN(node.cpus, ParseCpuList(kv[1]));
    if (node.cpus.empty()) {
      return absl::InvalidArgumentError(absl::StrCat("node ", node.id, " has no cpus in '", spec, "'"));
    }
    topo.nodes.push_back(std::move(node));
  }
  if (topo.nodes.empty()) return absl::InvalidArgumentError("empty topology spec");
  return topo;
}

namespace {

std::string ReadSmallFile(const std::string& path) {
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// Keeps the first logical cpu of each physical core.
std::vector<int> PhysicalCores(const std::vector<int>& cpus) {
  std::set<int> seen_siblings;
  std::vector<int> out;
  for (int cpu : cpus) {
    if (seen_siblings.count(cpu)) continue;
    auto siblings = ParseCpuList(ReadSmallFile(
        absl::StrCat("/sys/devices/system/cpu/cpu", cpu, "/topology/thread_siblings_list")));
    if (siblings.ok()) {
      for (int s : *siblings) seen_siblings.insert(s);
    }
    seen_siblings.insert(cpu);
    out.push_back(cpu);
  }
  return out;
}

}  // namespace

absl::StatusOr<Topology> DiscoverTopology() {
  Topology topo;
  // Only the cpus this process may run on count.
  cpu_set_t allowed;
  CPU_ZERO(&allowed);
  const bool have_affinity = sched_getaffinity(0, sizeof(allowed), &allowed) == 0;
  auto usable = [&](const std::vector<int>& cpus) {
    std::vector<int> out;
    for (int c : cpus) {
      if (!have_affinity || CPU_ISSET(c, &allowed)) out.push_back(c);
    }
    return out;
  };
  std::error_code ec;
  const std::filesystem::path root("/sys/devices/system/node");
  if (std::filesystem::exists(root, ec)) {
    for (const auto& entry : std::filesystem::directory_iterator(root, ec)) {
      const std::string name = entry.path().filename().string();
      int id = 0;
      if (name.rfind("node", 0) != 0 || !absl::SimpleAtoi(name.substr(4), &id)) continue;
      auto cpus = ParseCpuList(ReadSmallFile(entry.path().string() + "/cpulist"));
      if (!cpus.ok()) continue;
      NumaNode node{id, PhysicalCores(usable(*cpus))};
      if (!node.cpus.empty()) topo.nodes.push_back(std::move(node));
    }
  }
  if (topo.nodes.empty()) {
    std::vector<int> all;
    const long n = sysconf(_SC_NPROCESSORS_ONLN);
    for (int c = 0; c < n; ++c) all.push_back(c);
    topo.nodes.push_back(NumaNode{0, PhysicalCores(usable(all))});
  }
  std::sort(topo.nodes.begin(), topo.nodes.end(),
            [](const NumaNode& a, const NumaNode& b) { return a.id < b.id; });
  return topo;
}

std::string CpuModelName() {
  // The first processor's "model name", "cpu family" and "model" lines. A VM
  // may report a bare name ("AMD EPYC"); family and model still tell the
  // generation apart (AMD family 25: Zen 3/4, 26: Zen 5).
  std::ifstream in("/proc/cpuinfo");
  std::string line, name, family, model;
  auto value = [&line] {
    const size_t colon = line.find(':');
    if (colon == std::string::npos) return std::string();
    const size_t first = line.find_first_not_of(" \t", colon + 1);
    return first == std::string::npos ? std::string() : line.substr(first);
  };
  while (std::getline(in, line) && !line.empty()) {
    if (line.rfind("model name", 0) == 0) {
      name = value();
    } else if (line.rfind("cpu family", 0) == 0) {
      family = value();
    } else if (line.rfind("model", 0) == 0 && line.find_first_not_of(" \t", 5) == line.find(':')) {
      model = value();
    }
  }
  if (name.empty()) name = "unknown";
  if (!family.empty() && !model.empty()) name += " (family " + family + ", model " + model + ")";
  return name;
}

}  // namespace ellm
