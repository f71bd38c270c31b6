#include <catch2/catch.hpp>
#include <fstream>
#include <map>
#include <sstream>

#include "driver/registry.h"
#include "fragless/allocator.h"
#include "fragless/config.h"

using namespace fragless;

namespace {
Options ok(const char* text) {
  auto r = parse_config(text);
  INFO(text << " -> " << r.error);
  REQUIRE(r.ok);
  return r.options;
}
std::string bad(const char* text) {
  auto r = parse_config(text);
  INFO(text);
  REQUIRE_FALSE(r.ok);
  return r.error;
}
}  // namespace

TEST_CASE("config: defaults and simple keys", "[config]") {
  Options o = ok("");
  CHECK(o.policy == PolicyKind::fragless);
  CHECK(o.max_split_size == SIZE_MAX);
  o = ok("policy:classic, max_split_size_mb:128 ,garbage_collection_threshold:0.6");
  CHECK(o.policy == PolicyKind::classic);
  CHECK(o.max_split_size == 128u << 20);
  CHECK(o.garbage_collection_threshold == Approx(0.6));
  o = ok("driver:sim,capacity_mb:2048,page_size_mb:4");
  CHECK(o.driver == DriverKind::sim);
  CHECK(o.capacity == 2048u << 20);
  CHECK(o.page_size == 4u << 20);
  CHECK(ok("per_process_memory_fraction:0.5").per_process_memory_fraction == Approx(0.5));
  CHECK(ok("max_non_split_rounding_mb:1024").max_non_split_rounding_size == 1024u << 20);
  CHECK(o.handle_shape == HandleShape::cells);
  CHECK(o.handle_max == 64u << 20);
  CHECK(o.chunk_size == 20u << 20);
  CHECK(o.reserve_slack == 1.0 / 128);
  CHECK(o.lend_pages);
  CHECK(o.small_in_remnants);
  o = ok("chunk_size_mb:64,reserve_slack:0.5,lend_pages:False,small_in_remnants:False,handles:ends,"
         "handle_max_mb:4,lend_across_streams:False");
  CHECK(o.handle_shape == HandleShape::ends);
  CHECK(o.handle_max == 4u << 20);
  CHECK_FALSE(o.lend_across_streams);
  CHECK(o.chunk_size == 64u << 20);
  CHECK(o.reserve_slack == 0.5);
  CHECK_FALSE(o.lend_pages);
  CHECK_FALSE(o.small_in_remnants);
}

TEST_CASE("config: expandable_segments selects expandable unless policy is given", "[config]") {
  CHECK(ok("expandable_segments:True").policy == PolicyKind::expandable);
  CHECK(ok("expandable_segments:False").policy == PolicyKind::fragless);
  CHECK(ok("expandable_segments:True,policy:fragless").policy == PolicyKind::fragless);
  CHECK(ok("policy:classic,expandable_segments:True").policy == PolicyKind::classic);
  CHECK(bad("expandable_segments:true").find("True or False") != std::string::npos);
}

// Note [Keys that do nothing]: an allocator's text refuses what its policy or driver would ignore; a replay's
// --conf, run under every policy, keeps them.
TEST_CASE("config: an allocator refuses keys that do nothing under its policy or driver", "[config][bad-input]") {
  auto refused = [](std::string_view text) {
    const ConfigResult r = parse_allocator_config(text);
    CHECK_FALSE(r.ok);
    return r.error;
  };
  CHECK(refused("policy:classic,handles:pages") ==
        "FRAGLESS_CONF: key 'handles' configures the fragless policy only, and this configuration selects the "
        "classic policy on the cuda driver: leave it out");
  CHECK(refused("policy:expandable,background:False").find("key 'background' configures the fragless policy only") !=
        std::string::npos);
  CHECK(refused("garbage_collection_threshold:0.5").find("key 'garbage_collection_threshold' configures the classic "
                                                         "policy only") != std::string::npos);
  CHECK(refused("capacity_mb:100").find("the host and sim drivers only") != std::string::npos);
  CHECK(refused("page_size_mb:4").find("key 'page_size_mb'") != std::string::npos);
  CHECK(refused("policy:classic,expandable_segments:True") ==
        "FRAGLESS_CONF: expandable_segments:True contradicts policy:classic (give one of the two)");
  CHECK(refused("expandable_segments:False,policy:fragless") ==
        "FRAGLESS_CONF: expandable_segments:False contradicts policy:fragless (give one of the two)");
  CHECK(refused("driver:host,capacity_mb:3") ==
        "FRAGLESS_CONF: capacity_mb:3 is not a whole number of pages of 2 MiB (page_size_mb)");
  // Address space the host could not reserve: refused here, not every allocation failing as out of memory.
  CHECK(refused("driver:host,capacity_mb:100000000") ==
        "FRAGLESS_CONF: capacity_mb:100000000 is more than the host driver can reserve address space for (9/8 of it "
        "per segment, in a process's 128 TiB): give capacity_mb:4194304 (4 TiB) at most");
  CHECK(parse_allocator_config("driver:sim,capacity_mb:100000000").ok);  // the sim driver reserves nothing
  for (const char* fine : {"policy:classic,garbage_collection_threshold:0.5,per_process_memory_fraction:0.9",
                           "handles:pages,reserve_slack:0.01", "expandable_segments:True,policy:fragless",
                           "expandable_segments:True", "driver:host,capacity_mb:4", "driver:sim,page_size_mb:4,capacity_mb:8"}) {
    INFO(fine);
    CHECK(parse_allocator_config(fine).ok);
  }
  // A replay compares policies under one text: it keeps a key that tunes one of them.
  CHECK(parse_config("policy:classic,handles:pages").ok);
}

TEST_CASE("config: same_settings compares every key's value, not the text", "[config]") {
  auto opts = [](const char* text) {
    const ConfigResult r = parse_config(text);
    INFO(text << " -> " << r.error);
    REQUIRE(r.ok);
    return r.options;
  };
  CHECK(same_settings(opts(""), opts("policy:fragless,background:True")));  // defaults given or not
  CHECK(same_settings(opts("expandable_segments:True"), opts("policy:expandable")));
  CHECK(same_settings(opts("driver:host, capacity_mb:256"), opts("capacity_mb:256,driver:host")));
  // Every key of the table, at a value other than its default, makes the settings differ: a key added to
  // the table without a place in same_settings fails here.
  const std::map<std::string_view, const char*> other = {
      {"policy", "policy:classic"}, {"expandable_segments", "expandable_segments:True"},
      {"max_split_size_mb", "max_split_size_mb:64"}, {"max_non_split_rounding_mb", "max_non_split_rounding_mb:64"},
      {"roundup_power2_divisions", "roundup_power2_divisions:4"},
      {"garbage_collection_threshold", "garbage_collection_threshold:0.5"},
      {"per_process_memory_fraction", "per_process_memory_fraction:0.5"}, {"driver", "driver:host"},
      {"page_size_mb", "page_size_mb:4"}, {"capacity_mb", "capacity_mb:64"}, {"on_oom", nullptr},
      {"peer_access", "peer_access:False"}, {"shareable_handles", "shareable_handles:True"},
      {"handles", "handles:pages"}, {"handle_max_mb", "handle_max_mb:8"}, {"chunk_size_mb", "chunk_size_mb:8"},
      {"reserve_slack", "reserve_slack:0.5"}, {"lend_pages", "lend_pages:False"},
      {"lend_across_streams", "lend_across_streams:False"}, {"small_in_remnants", "small_in_remnants:False"},
      {"growth_reserve", "growth_reserve:False"}, {"background", "background:False"}, {"trace", "trace:t.fgt"}};
  for (const auto& row : option_table()) {
    INFO(row.key);
    const auto it = other.find(row.key);
    REQUIRE(it != other.end());
    if (it->second) CHECK_FALSE(same_settings(opts(""), opts(it->second)));  // on_oom has one value only
  }
}

TEST_CASE("config: empty items are refused and any whitespace is dropped, as PyTorch's parser does", "[config][bad-input]") {
  CHECK(bad(",").find("an empty item") != std::string::npos);
  CHECK(bad(",max_split_size_mb:256").find("an empty item (a ',' with no key:value before it, at the start)") !=
        std::string::npos);
  CHECK(bad("max_split_size_mb:256,,garbage_collection_threshold:0.5").find("after another ','") != std::string::npos);
  CHECK(ok("max_split_size_mb:256,").max_split_size == std::size_t{256} << 20);  // a trailing ',' is fine
  CHECK(ok("expandable_segments:True\v").expandable_segments);
  CHECK(ok("\fpolicy:classic").policy == PolicyKind::classic);
}

TEST_CASE("config: roundup_power2_divisions lists follow PyTorch's tests", "[config]") {
  auto div = [](const Options& o, std::size_t mb) {
    std::size_t i = 0;
    while ((std::size_t{2} << i) <= mb && i < 15) ++i;
    return o.roundup_power2_divisions[i];
  };
  Options o = ok("roundup_power2_divisions:[64:8,128:2,256:4,512:2,1024:4,>:1]");
  const std::size_t sizes1[] = {32, 64, 128, 256, 512, 1024, 2048, 4096, 8192};
  const std::size_t want1[] = {8, 8, 2, 4, 2, 4, 1, 1, 1};
  for (int i = 0; i < 9; ++i) CHECK(div(o, sizes1[i]) == want1[i]);
  o = ok("roundup_power2_divisions:[128:8,256:16,512:1,2048:8,>:2]");
  const std::size_t sizes2[] = {64, 128, 256, 512, 1024, 2048, 4096};
  const std::size_t want2[] = {8, 8, 16, 1, 0, 8, 2};
  for (int i = 0; i < 7; ++i) CHECK(div(o, sizes2[i]) == want2[i]);
  // '>' before any size: it fills from interval 1 (requests under 2 MiB keep 0), and the first size named
  // after it still fills the intervals below it (PyTorch's parseRoundUpPower2Divisions).
  o = ok("roundup_power2_divisions:[>:4,256:2]");
  const std::size_t sizes3[] = {1, 2, 64, 256, 512, 4096};
  const std::size_t want3[] = {2, 2, 2, 2, 4, 4};
  for (int i = 0; i < 6; ++i) CHECK(div(o, sizes3[i]) == want3[i]);
  o = ok("roundup_power2_divisions:[>:4]");
  CHECK(div(o, 1) == 0);
  CHECK(div(o, 2) == 4);
  CHECK(div(o, 8192) == 4);
  o = ok("roundup_power2_divisions:4");
  CHECK(div(o, 64) == 4);
  CHECK(div(o, 256) == 4);
  CHECK(div(o, 2048) == 4);
}

TEST_CASE("config: every bad input names the key, the value and the accepted forms", "[config][bad-input]") {
  CHECK(bad("bogus:1").find("unknown key 'bogus'") != std::string::npos);
  CHECK(bad("bogus:1").find("accepted keys: policy") != std::string::npos);
  CHECK(bad("policy:fast").find("'fast' for key 'policy'") != std::string::npos);
  CHECK(bad("max_split_size_mb:19").find("at least 20") != std::string::npos);
  CHECK(bad("max_split_size_mb:-5").find("max_split_size_mb") != std::string::npos);
  CHECK(bad("max_split_size_mb:12abc").find("12abc") != std::string::npos);
  CHECK(bad("garbage_collection_threshold:1.0").find("(0, 1)") != std::string::npos);
  CHECK(bad("garbage_collection_threshold:nan").find("garbage_collection_threshold") != std::string::npos);
  CHECK(bad("per_process_memory_fraction:1.5").find("[0, 1]") != std::string::npos);
  CHECK(bad("roundup_power2_divisions:3").find("power of two") != std::string::npos);
  CHECK(bad("roundup_power2_divisions:[64:3]").find("'3'") != std::string::npos);
  CHECK(bad("roundup_power2_divisions:[63:2]").find("'63'") != std::string::npos);
  CHECK(bad("roundup_power2_divisions:[64:2").find("missing ']'") != std::string::npos);
  // Note [An entry the list overwrites]: an entry whose every interval later entries set again is refused,
  // naming it; one that still sets an interval stands, as in PyTorch.
  CHECK(bad("roundup_power2_divisions:[64:4,128:2,128:8]").find("'128:2'") != std::string::npos);
  CHECK(bad("roundup_power2_divisions:[64:4,128:2,128:8]").find("entries that each set some interval") != std::string::npos);
  CHECK(bad("roundup_power2_divisions:[64:4,32768:4,65536:8]").find("'32768:4'") != std::string::npos);  // one interval
  CHECK(bad("roundup_power2_divisions:[1:4,>:8,>:2]").find("'>:8'") != std::string::npos);
  Options kept = ok("roundup_power2_divisions:[64:4,64:8]");  // 64:4 still fills the intervals below 64 MB
  CHECK(kept.roundup_power2_divisions[5] == 4);
  CHECK(kept.roundup_power2_divisions[6] == 8);
  kept = ok("roundup_power2_divisions:[1:4,>:8,256:2,>:1]");  // each '>' sets intervals the other does not
  CHECK(kept.roundup_power2_divisions[1] == 8);
  CHECK(kept.roundup_power2_divisions[8] == 2);
  CHECK(kept.roundup_power2_divisions[9] == 1);
  CHECK(bad("policy").find("expected ':'") != std::string::npos);
  CHECK(bad("policy:").find("no value") != std::string::npos);
  CHECK(bad("policy:classic:expandable").find("expected ','") != std::string::npos);
  CHECK(bad("driver:gpu").find("cuda, host or sim") != std::string::npos);
  CHECK(bad("page_size_mb:3").find("power of two") != std::string::npos);
  CHECK(bad("capacity_mb:0").find("capacity_mb") != std::string::npos);
  CHECK(bad("policy:[classic]").find("single value") != std::string::npos);
  CHECK(bad("chunk_size_mb:0").find("chunk_size_mb") != std::string::npos);
  CHECK(bad("reserve_slack:-0.1").find("[0, 1]") != std::string::npos);
  CHECK(bad("handles:half").find("pages, ends, whole or cells") != std::string::npos);
  CHECK(bad("handle_max_mb:0").find("handle_max_mb") != std::string::npos);
  CHECK(bad("lend_pages:yes").find("True or False") != std::string::npos);
  // A removed value says what replaced it.
  CHECK(bad("on_oom:null").find("fragless_pool_malloc") != std::string::npos);
  CHECK(bad("on_oom:maybe").find("'maybe' for key 'on_oom'") != std::string::npos);
}

TEST_CASE("config: the README documents every key of the options table", "[config][docs]") {
  std::ifstream f(FRAGLESS_SOURCE_DIR "/README.md");
  REQUIRE(f.good());
  std::stringstream ss;
  ss << f.rdbuf();
  const std::string readme = ss.str();
  for (const auto& row : option_table()) {
    const std::string line = "| `" + std::string(row.key) + "` | " + std::string(row.type) + " | " +
                             std::string(row.default_value) + " | " + std::string(row.meaning) + " |";
    INFO("README.md lacks the row: " << line);
    CHECK(readme.find(line) != std::string::npos);
  }
}

TEST_CASE("config: an error shows what was typed, and PyTorch's own keys are named as such", "[config][bad-input]") {
  // PyTorch's tokenizer drops whitespace, so "handles ends" would be the key "handlesends".
  CHECK(bad("handles ends").find("'handles ends' is not key:value") != std::string::npos);
  CHECK(bad("handles ends").find("'handles:ends'") != std::string::npos);
  CHECK(bad("policy:fra gless").find("'fra gless'") != std::string::npos);
  CHECK(bad("bogus key:1").find("unknown key 'bogus key'") != std::string::npos);
  for (const char* k : {"backend:native", "release_lock_on_cudamalloc:True", "pinned_use_cuda_host_register:True",
                        "pinned_num_register_threads:8", "graph_capture_record_stream_reuse:True"})
    CHECK(bad(k).find("PyTorch's own allocator") != std::string::npos);
  // Whitespace around tokens is PyTorch's grammar and stays accepted.
  auto r = parse_config(" policy : classic , max_split_size_mb : 256 ");
  REQUIRE(r.ok);
  CHECK(r.options.policy == PolicyKind::classic);
  CHECK(r.keys == std::vector<std::string>{"policy", "max_split_size_mb"});
}

TEST_CASE("config: a known key with spaces inside is refused, naming it as typed", "[config][bad-input]") {
  CHECK(bad("max_split _size_mb:256").find("key 'max_split _size_mb' has spaces inside") != std::string::npos);
}

TEST_CASE("config: every row parses its own default, and every driver kind has its registry line", "[config]") {
  // Note [One options table]: a row without a parser is the one list-valued key.
  for (const auto& row : option_table()) {
    INFO(row.key);
    CHECK((row.parse != nullptr) == (row.key != "roundup_power2_divisions"));
  }
  for (DriverKind d : {DriverKind::cuda, DriverKind::host, DriverKind::sim}) {
    const auto& e = driver_entry(d);
    CHECK(e.kind == d);
    CHECK(driver_kind_from_name(driver_kind_name(d)) == d);
    CHECK((e.make != nullptr) == (e.missing == nullptr));
  }
  CHECK(driver_registry().size() == 3);
  CHECK_FALSE(driver_kind_from_name("gpu").has_value());
  CHECK(bad("driver:gpu").find("cuda, host or sim") != std::string::npos);
  // expandable_segments:True selects expandable only when the same text names no policy.
  CHECK(ok("expandable_segments:True").policy == PolicyKind::expandable);
  CHECK(ok("expandable_segments:True,policy:classic").policy == PolicyKind::classic);
  CHECK(ok("policy:classic,expandable_segments:True").policy == PolicyKind::classic);
  Options base;
  base.policy = PolicyKind::classic;
  CHECK(parse_config("expandable_segments:False", base).options.policy == PolicyKind::classic);
}

TEST_CASE("config: a driver refuses options it never takes when checked, with the message it starts with", "[config]") {
  // The host driver cannot carry CUDA's fabric handles: driver_available (fragless_check_driver, enable())
  // says so before anything is made, in the words make_driver uses at the first allocation.
  const Options o = ok("driver:host,shareable_handles:fabric");
  std::string checked, made;
  CHECK_FALSE(driver_available(o, &checked));
  CHECK(make_driver(o, 0, &made) == nullptr);
  CHECK(checked == made);
  CHECK(checked.find("shareable_handles:fabric needs the cuda driver") != std::string::npos);
  std::string none;
  CHECK(driver_available(ok("driver:host,shareable_handles:True"), &none));
  CHECK(driver_available(ok("driver:sim"), &none));
  CHECK(none.empty());
}
