// fragless-oracles: runs the PyTorch devlog fragmentation cases through the three policies on the sim
// driver and prints what each reserves. The numbers for classic and expandable are PyTorch's own.
#include <cstdio>
#include <string>
#include <vector>

#include "fragless/engine.h"
#include "fragless/sim_driver.h"

using namespace fragless;

namespace {

constexpr std::size_t MiB = 1u << 20;

struct Case {
  const char* name;
  std::vector<std::size_t> first, second;  // first round; freed; second round
  double pytorch_native, pytorch_expandable;  // MiB reserved at the end (PyTorch devlog)
};

double run(const Case& c, PolicyKind p, std::uint64_t* driver_calls) {
  Options o;
  o.policy = p;
  o.driver = DriverKind::sim;
  DeviceEngine e(o, make_sim_driver(SimDriverOptions{}));
  std::vector<void*> ptrs;
  for (auto s : c.first) ptrs.push_back(e.allocate(s, 0, nullptr));
  if (!c.second.empty()) {
    for (void* ptr : ptrs) e.free(ptr);
    for (auto s : c.second) e.allocate(s, 0, nullptr);
  }
  *driver_calls = 0;
  for (auto n : e.driver_counters().calls) *driver_calls += n;
  return static_cast<double>(e.stats().reserved_bytes.all().current) / MiB;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc > 1) {
    const std::string a = argv[1];
    const bool help = a == "-h" || a == "--help";
    std::fprintf(help ? stdout : stderr,
                 "%susage: fragless-oracles\n"
                 "  runs PyTorch's published fragmentation cases (its caching allocator devlog) through the classic,\n"
                 "  expandable and fragless policies on the sim driver and prints the memory each reserves beside\n"
                 "  PyTorch's own figures; exits 1 if classic or expandable departs from PyTorch's numbers or fragless\n"
                 "  reserves more than expandable\n",
                 help ? "" : ("fragless-oracles: unknown argument " + a + "\n").c_str());
    return help ? 0 : 2;
  }
  const Case cases[] = {
      {"8 x 16 MiB, free all, 4 x 32 MiB", std::vector<std::size_t>(8, 16 * MiB), std::vector<std::size_t>(4, 32 * MiB),
       256, 140},
      {"4 x 32 MiB, free all, 8 x 16 MiB", std::vector<std::size_t>(4, 32 * MiB), std::vector<std::size_t>(8, 16 * MiB),
       128, 140},
      {"2 MiB, then 0.5 MiB", {2 * MiB, MiB / 2}, {}, 22, 22},
      {"2 MiB, then 2 MiB", {2 * MiB, 2 * MiB}, {}, 20, 20},
  };
  std::printf("Reserved memory (MiB) after each case, sim driver; PyTorch's figures from its devlog.\n\n");
  std::printf("%-36s %10s %10s %10s %10s %10s\n", "case", "classic", "pytorch", "expandable", "pytorch-es",
              "fragless");
  bool faithful = true;
  for (const Case& c : cases) {
    std::uint64_t calls[3];
    const double cl = run(c, PolicyKind::classic, &calls[0]);
    const double ex = run(c, PolicyKind::expandable, &calls[1]);
    const double fr = run(c, PolicyKind::fragless, &calls[2]);
    std::printf("%-36s %10.0f %10.0f %10.0f %10.0f %10.0f\n", c.name, cl, c.pytorch_native, ex,
                c.pytorch_expandable, fr);
    faithful &= cl == c.pytorch_native && ex == c.pytorch_expandable && fr <= ex;
  }
  std::printf("\n%s\n", faithful ? "classic and expandable match PyTorch; fragless reserves no more than expandable."
                                 : "MISMATCH against PyTorch's figures");
  return faithful ? 0 : 1;
}
