// Built-in workloads: the allocation sequence of decoder-only transformer training and inference steps
// over batches of variable-length sequences, so the replay runs with no input file at all.
#pragma once
#include <new>
#include <string>
#include <vector>

#include "trace_model.h"

namespace fragless::replay {

// spec: "workload:NAME[:key=value,...]", NAME = transformer-train | transformer-infer (or ckpt-accum, or a
// zoo pattern, zoo.h). Keys, their defaults and accepted values: transformer_help(). Returns false with
// *error on a bad spec, naming the key and what it accepts.
// `lengths`, when given and the spec names no seqlen, replaces the fitted distribution: sequence lengths
// are drawn from it uniformly (a user's own data, see read_seqlen_file).
// A workload larger than kMaxWorkloadEvents events (about 64 bytes each, twice that while the vector grows),
// or one the host has no memory for, is an error naming the spec, not a crash (*too_large set, if given).
bool make_workload(const std::string& spec, formats::Trace* out, std::string* error,
                   const std::vector<int>* lengths = nullptr, bool* too_large = nullptr);

inline constexpr std::size_t kMaxWorkloadEvents = 20'000'000;
// Draws a generator may make, 20 per event it may make: a spec whose draws (random's ops x steps, a transformer's
// batch x steps) pass it is refused before generating, since most of them would make no event and the spec
// would run for hours inside kMaxWorkloadEvents (about 20 s of drawing at this bound).
inline constexpr double kMaxWorkloadDraws = 20.0 * kMaxWorkloadEvents;
// Thrown by the generators' emitters past kMaxWorkloadEvents; make_workload turns it into its error.
struct TooManyEvents {};
// Called by an emitter before it adds an event to t (its window or its seed).
inline void check_room(const formats::Trace& t) {
  if (t.events.size() + t.seed.size() >= kMaxWorkloadEvents) throw TooManyEvents{};
}
// Note [Workload addresses]
// A generated tensor's address is the next page-aligned one after every tensor before it, never reused, as
// if the run's memory were one address space that only grows: tensors live at once never overlap, as in a
// trace an allocator wrote, so a workload converted to a snapshot is one PyTorch's viewer draws and the
// snapshot reader takes (it refuses memory given twice). The replay itself only pairs frees with their
// allocations by address. (Until 2026-12-07 addresses were serials times 4 KiB, and large tensors overlapped.)
inline constexpr std::uint64_t kMaxWorkloadAddress = std::uint64_t{1} << 62;
// Thrown past kMaxWorkloadAddress (a run whose tensors add up to 4 EiB); make_workload names it.
struct AddressesExhausted {};
inline std::uint64_t take_address(std::uint64_t* next, std::uint64_t bytes) {
  if (bytes >= kMaxWorkloadAddress) throw AddressesExhausted{};
  const std::uint64_t span = (std::max<std::uint64_t>(bytes, 1) + 4095) / 4096 * 4096;
  if (*next > kMaxWorkloadAddress - span) throw AddressesExhausted{};
  const std::uint64_t at = *next;
  *next += span;
  return at;
}
// The error for a spec whose generation stopped: too many events, no host memory left or (addresses) tensors
// adding up to more than kMaxWorkloadAddress bytes.
std::string workload_too_large(const std::string& spec, bool out_of_memory, bool addresses = false);
// Whether a workload's options (key=value,...) have an empty item: a ',' at either end or two together (a
// ',' too many). Every workload refuses them rather than skipping the item.
bool has_empty_item(const std::string& options);
// A workload key's integer, written as decimal digits with an optional '-' and nothing else (no spaces, sign
// '+', base prefix, fraction or exponent: '1.5', '0x10' and ' 5' are not integers here); false otherwise or
// past 18 digits.
bool integer_text(const std::string& v, long long* n);
// Runs a generator that fills *out; a stop (TooManyEvents, AddressesExhausted, std::bad_alloc) empties *out and is false with
// *error naming spec and *too_large set (if given).
template <class Run>
bool generate_bounded(const std::string& spec, formats::Trace* out, std::string* error, bool* too_large, Run&& run) {
  bool oom = false, addresses = false;
  try {
    run();
    return true;
  } catch (const TooManyEvents&) {
  } catch (const AddressesExhausted&) {
    addresses = true;
  } catch (const std::bad_alloc&) {
    oom = true;
  }
  *out = formats::Trace{};
  *error = workload_too_large(spec, oom, addresses);
  if (too_large) *too_large = true;
  return false;
}

// The transformer workloads' keys for --help: each with its default and the values it accepts.
std::string transformer_help();

// For a search over one key of a workload (fragless-replay --max-of): the integer range the key accepts.
// False with *error when the spec is not a workload, or the key is unknown or not numeric (seqlen, dtype,
// padding), naming the numeric keys, or the spec sets the key itself. *capped (when given) is set when *hi is
// where the search stops rather than the largest value the workload accepts: a transformer workload's seed,
// which takes [0, 2^64) and is searched up to 1e15.
bool workload_key_range(const std::string& spec, const std::string& key, long long* lo, long long* hi,
                        std::string* error, bool* capped = nullptr);
// Whether the input draws its sequence lengths from --seqlen-file: a transformer workload (transformer-train,
// transformer-infer, ckpt-accum) whose spec does not set seqlen.
bool draws_seqlen_file(const std::string& input);
// For an input that draws from --seqlen-file (at `path`): a note saying how many of its lengths are longer
// than the input's max_seq and so are cut to it; empty when none is (or the input does not draw from it).
std::string seqlen_file_note(const std::string& input, const std::vector<int>& lengths, const std::string& path);
// The spec with key=value added (workload_key_range has checked that the spec does not set key itself).
std::string workload_with(const std::string& spec, const std::string& key, long long value);

// Sequence lengths from a CSV with a header: the column seqlen, length, tokens, total_tokens or
// num_total_tokens; else the sum of a prompt/output pair (ContextTokens + GeneratedTokens,
// num_prefill_tokens + num_decode_tokens, input_length + output_length). A header with none of them, a
// length outside [1, 10^7] or a cell that is not an integer is an error naming the file and the line.
// *note (when given) is set when the header offers more than one such column, naming the one read.
bool read_seqlen_file(const std::string& path, std::vector<int>* out, std::string* error, std::string* note = nullptr);

}  // namespace fragless::replay
