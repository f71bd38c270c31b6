// Configuration: one options table (key, type, default, meaning), one parser for the FRAGLESS_CONF string
// in PYTORCH_CUDA_ALLOC_CONF grammar, and the plain struct it produces. Parsing happens at the edge;
// the engine only sees `Options`.
//
// Grammar (PyTorch's ConfigTokenizer): `key:value[,key:value]...`; a value is a token or a list
// `[k:v,k:v,...,>:v]`; whitespace is ignored; booleans are exactly `True` or `False`.
#pragma once
#include <array>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace fragless {

enum class PolicyKind { classic, expandable, fragless };
enum class DriverKind { cuda, host, sim };
// How the fragless policy shapes new physical handles (Note [Whole handles], policy/fragless/policy.cpp).
enum class HandleShape { pages, ends, whole, cells };
// Who does the driver work no caller waits for (allocator/src/state/background.h): a worker thread per device,
// nobody, or whoever calls DeviceEngine::run_background (the replay, on the trace's clock; tests).
enum class BackgroundMode { thread, off, manual };

const char* policy_name(PolicyKind p);
const char* driver_kind_name(DriverKind d);
// The policy or driver a name (as policy_name or driver_kind_name write it) selects; nullopt for any other
// text. The one parser of these names: FRAGLESS_CONF, the replay's and the tools' options all use it.
std::optional<PolicyKind> policy_from_name(std::string_view name);
std::optional<DriverKind> driver_kind_from_name(std::string_view name);

inline constexpr int kRoundUpPowerOfTwoIntervals = 16;

struct Options {
  PolicyKind policy = PolicyKind::fragless;
  bool expandable_segments = false;                      // PyTorch's key, as given (policy follows it)
  DriverKind driver = DriverKind::cuda;
  std::size_t max_split_size = SIZE_MAX;                 // bytes; SIZE_MAX = unlimited
  std::size_t max_non_split_rounding_size = 20u << 20;   // bytes
  std::array<std::size_t, kRoundUpPowerOfTwoIntervals> roundup_power2_divisions{};  // 0 = off
  double garbage_collection_threshold = 0.0;             // 0 = off
  double per_process_memory_fraction = 1.0;
  std::size_t page_size = 2u << 20;                      // host and sim granularity, bytes
  std::size_t capacity = 0;                              // host/sim physical budget, bytes; 0 = driver default
  bool peer_access = true;                               // cuda: grant peers that can access this device
  bool shareable_handles = false;                        // physical memory exportable (cuda: POSIX fds)
  bool fabric_handles = false;                           // cuda: ...as fabric handles instead (R26)
  std::string trace;                                     // trace path pattern (%p %d %r); empty = off
  // fragless policy (docs/ARCHITECTURE.md, "Policies").
  HandleShape handle_shape = HandleShape::cells;        // shape of new physical handles
  std::size_t handle_max = 64u << 20;                    // handles:ends and cells: largest body handle, bytes
  std::size_t chunk_size = 20u << 20;                    // cells: the largest cell; ends, whole: round up to this
  double reserve_slack = 1.0 / 128;                      // new memory past the request or peak live: this share
  bool lend_pages = true;                                // same-stream holes lend pages without a sync
  bool lend_across_streams = true;                       // ...and other streams' holes, by a stream wait
  bool small_in_remnants = true;                         // small requests may use sub-MiB large-pool remnants
  bool growth_reserve = true;                            // the worker creates pages ahead of gap growths
  BackgroundMode background = BackgroundMode::thread;   // background: True (thread) or False (off)
  std::string settings;                                  // the string this was parsed from
};

// One row of the options table: the only place a key is written (Note [One options table], config.cpp).
struct OptionInfo {
  std::string_view key;
  std::string_view type;
  std::string_view default_value;
  std::string_view meaning;
  // Parses a value of this key into the options: "" when it was right, else the forms it may take. Null for
  // the one key whose value is a list (roundup_power2_divisions), which the grammar parses.
  std::string (*parse)(std::string_view value, Options& o) = nullptr;
  // For a key that configures one policy or driver only: nullptr when it does something under `o`, else
  // what it configures (an allocator refuses it then: Note [Keys that do nothing]). Null: every policy.
  const char* (*applies)(const Options& o) = nullptr;
};
std::span<const OptionInfo> option_table();

struct ConfigResult {
  bool ok = false;
  Options options;
  std::string error;               // names the key, the value and the accepted forms, as written
  std::vector<std::string> keys;   // the keys the text gave, in order (a tool may refuse some)
};

// Parses `text` over `base` (keys not mentioned keep base's values).
ConfigResult parse_config(std::string_view text, const Options& base = Options{});

// A parse error names FRAGLESS_CONF, where the text usually comes from; for a text given elsewhere (a command
// line option) the same error naming `source` instead.
std::string config_error_from(const std::string& error, std::string_view source);

// parse_config for an allocator (FRAGLESS_CONF, fragless_check_config, fragless-config): a key the text gives
// that does nothing under the policy and driver it selects is refused, as are a policy and
// expandable_segments that disagree and a host or sim capacity that is not a whole number of pages (Note
// [Keys that do nothing]). A replay, which runs one text under every policy, uses parse_config.
ConfigResult parse_allocator_config(std::string_view text);

// Whether two parsed configurations set every key to the same value (the text they came from, and
// expandable_segments, which only selects the policy, aside).
bool same_settings(const Options& a, const Options& b);

// Reads FRAGLESS_CONF (empty when unset), as parse_allocator_config.
ConfigResult config_from_environment();

}  // namespace fragless
