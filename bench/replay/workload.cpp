#include "workload.h"

#include "compute_model.h"
#include "zoo.h"

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <new>
#include <map>
#include <random>
#include <sstream>
#include <string_view>
#include <vector>

namespace fragless::replay {

bool integer_text(const std::string& v, long long* n) {
  const std::size_t digits = v.size() - (!v.empty() && v[0] == '-');
  if (digits == 0 || digits > 18 || v.find_first_not_of("0123456789", v.size() - digits) != std::string::npos)
    return false;
  *n = std::stoll(v);
  return true;
}

namespace {

// Log-normal fits (of total tokens per request) to public traces; produced by tools/fit_sequence_lengths.py.
struct SeqFit { const char* name; double mu, sigma; int lo, hi; };
constexpr SeqFit kFits[] = {
    {"sharegpt", 7.5458, 0.9995, 11, 8149},     // microsoft/sarathi-serve ShareGPT (llama2 tokenizer)
    {"azure-conv", 6.9092, 0.8145, 64, 14089},  // Azure LLM inference trace 2023, conversation
    {"azure-code", 7.0581, 1.2687, 12, 7841},   // Azure LLM inference trace 2023, code
    {"arxiv", 7.9087, 0.3694, 39, 4096},        // microsoft/vidur arXiv summarization
};

struct Config {
  std::string name;
  int layers = 24, d_model = 1024, heads = 16, d_ff = 4096, vocab = 10000, batch = 4, steps = 6, max_seq = 2048;
  int dtype = 4, ckpt = 0, dropout = 0, accum = 1, tf32 = 0;
  bool pad_to_longest = false;  // padding=longest: every sequence padded to the batch's longest
  std::uint64_t seed = 1;
  std::string seqlen = "sharegpt";
  bool seqlen_given = false;
  const std::vector<int>* lengths = nullptr;
};

// Emits the allocation events, stamped with the compute model's clock (compute_model.h).
class Emitter {
 public:
  Emitter(formats::Trace* t, int bytes_per_element, bool tf32) : t_(t), width_(bytes_per_element), clock_(tf32) {}
  std::uint64_t alloc(std::uint64_t bytes, bool seed = false) {
    const std::uint64_t addr = take_address(&next_, bytes);  // Note [Workload addresses]
    formats::Event e;
    e.op = formats::Op::alloc;
    e.address = addr;
    e.size = std::max<std::uint64_t>(bytes, 1);
    check_room(*t_);
    (seed ? t_->seed : t_->events).push_back(e);
    if (!seed) clock_.stamp(t_->model_time_us);
    return addr;
  }
  // The kernel that produces a tensor of `bytes` with `flops` of arithmetic, then the tensor.
  std::uint64_t produce(std::uint64_t bytes, double flops) {
    kernel(flops, 2.0 * static_cast<double>(bytes));
    return alloc(bytes);
  }
  void kernel(double flops, double bytes) { clock_.kernel(flops, bytes, width_); }
  void free(std::uint64_t addr, std::uint64_t bytes) {
    formats::Event e;
    e.op = formats::Op::free;
    e.address = addr;
    e.size = std::max<std::uint64_t>(bytes, 1);
    check_room(*t_);
    t_->events.push_back(e);
    clock_.stamp(t_->model_time_us);
  }

 private:
  formats::Trace* t_;
  int width_;
  ModelClock clock_;
  std::uint64_t next_ = 4096;
};

struct Tensor { std::uint64_t addr, bytes; };

// The integer keys of the transformer workloads, with the values each accepts: what parse() reads and
// checks, what --help lists, and what a search over one key (workload_key_range) may vary.
constexpr long kMaxIntValue = 1000000;
struct IntKey { const char* name; int Config::*field; int least; long most; };
constexpr IntKey kIntKeys[] = {{"layers", &Config::layers, 1, kMaxIntValue}, {"d_model", &Config::d_model, 1, kMaxIntValue},
                               {"heads", &Config::heads, 1, kMaxIntValue},   {"d_ff", &Config::d_ff, 0, kMaxIntValue},
                               {"vocab", &Config::vocab, 0, kMaxIntValue},   {"batch", &Config::batch, 1, kMaxIntValue},
                               {"steps", &Config::steps, 1, kMaxIntValue},   {"max_seq", &Config::max_seq, 1, kMaxIntValue},
                               {"ckpt", &Config::ckpt, 0, 1},                {"dropout", &Config::dropout, 0, 1},
                               {"accum", &Config::accum, 1, kMaxIntValue},   {"tf32", &Config::tf32, 0, 1}};
// The other keys, with their default and what they accept (--help and the errors).
struct TextKey { const char* name; const char* def; const char* accepted; };
constexpr TextKey kTextKeys[] = {{"seqlen", "sharegpt", "sharegpt, azure-conv, azure-code, arxiv or fixed:N"},
                                 {"dtype", "fp32", "fp32 or bf16"},
                                 {"padding", "none", "none or longest"},
                                 {"seed", "1", "an integer in [0, 2^64)"}};

std::string int_range(const IntKey& k) {
  return "an integer in [" + std::to_string(k.least) + ", " + std::to_string(k.most) + "]";
}

const char* accepted(const char* name) {
  for (const auto& k : kTextKeys)
    if (std::string_view(name) == k.name) return k.accepted;
  return "";
}

const IntKey* int_key(const std::string& name) {
  for (const auto& k : kIntKeys)
    if (name == k.name) return &k;
  return nullptr;
}

std::string transformer_keys() {
  std::string names;
  for (const auto& k : kIntKeys) names += std::string(names.empty() ? "" : ", ") + k.name;
  for (const auto& k : kTextKeys) names += std::string(", ") + k.name;
  return names;
}

// Applies `options` (key=value,...) over *c. A key given twice in one spec is an error naming it: a later
// value silently replacing an earlier one hides a typo.
bool apply_options(const std::string& options, Config* c, std::string* error) {
  if (has_empty_item(options)) {
    *error = "workload options '" + options + "': an empty item (a ',' too many)";
    return false;
  }
  std::stringstream kv(options);
  std::string item;
  std::vector<std::string> given;
  while (std::getline(kv, item, ',')) {
    const auto eq = item.find('=');
    if (eq == std::string::npos) {
      *error = "workload option '" + item + "' is not key=value";
      return false;
    }
    const std::string k = item.substr(0, eq), v = item.substr(eq + 1);
    if (std::find(given.begin(), given.end(), k) != given.end()) {
      *error = "workload option " + k + " is given twice in '" + options + "': give each key once";
      return false;
    }
    given.push_back(k);
    if (const IntKey* ik = int_key(k)) {
      long long n = 0;
      if (!integer_text(v, &n) || n < ik->least || n > ik->most) {
        *error = "workload option " + k + ": bad value '" + v + "': expected " + int_range(*ik);
        return false;
      }
      c->*ik->field = static_cast<int>(n);
    } else if (k == "seqlen") {
      c->seqlen = v;
      c->seqlen_given = true;
    } else if (k == "padding") {
      if (v != "longest" && v != "none") {
        *error = "workload option padding: bad value '" + v + "': expected " + accepted("padding");
        return false;
      }
      c->pad_to_longest = v == "longest";
    } else if (k == "seed") {
      char* end = nullptr;
      errno = 0;
      c->seed = std::strtoull(v.c_str(), &end, 10);
      if (v.empty() || *end || errno || v.find_first_not_of("0123456789") != std::string::npos) {
        *error = "workload option seed: bad value '" + v + "': expected " + accepted("seed");
        return false;
      }
    } else if (k == "dtype") {
      if (v != "fp32" && v != "bf16") {
        *error = "workload option dtype: bad value '" + v + "': expected " + accepted("dtype");
        return false;
      }
      c->dtype = v == "fp32" ? 4 : 2;
    } else {
      *error = "unknown workload option '" + k + "' (keys: " + transformer_keys() + ")";
      return false;
    }
  }
  return true;
}

bool known_name(const std::string& name, std::string* error) {
  if (name == "transformer-train" || name == "transformer-infer" || name == "ckpt-accum" || is_zoo_workload(name))
    return true;
  std::string names = "transformer-train, transformer-infer, ckpt-accum";
  for (const auto& n : zoo_names()) names += ", " + n;
  *error = "unknown workload '" + name + "' (expected one of " + names + ")";
  return false;
}

// ckpt-accum: transformer training with activation checkpointing and gradient accumulation over
// variable-length micro-batches (the optimizer steps every 4 micro-batches); any transformer key applies,
// and a key the spec gives replaces the default below.
constexpr const char* kCkptAccum = "ckpt=1,accum=4,steps=12,layers=12,d_model=2048,heads=16,d_ff=8192,batch=4";

// A transformer workload's spec (transformer-train, transformer-infer or ckpt-accum) into *c.
bool parse(const std::string& spec, Config* c, std::string* error) {
  const std::string rest = spec.substr(std::string("workload:").size());
  const auto colon = rest.find(':');
  const std::string name = rest.substr(0, colon);
  if (!known_name(name, error)) return false;
  c->name = name == "ckpt-accum" ? "transformer-train" : name;
  if (name == "ckpt-accum" && !apply_options(kCkptAccum, c, error)) return false;
  return colon == std::string::npos || apply_options(rest.substr(colon + 1), c, error);
}

class SeqLen {
 public:
  SeqLen(const Config& c, std::string* error) : rng_(c.seed), max_(c.max_seq) {
    if (c.lengths && !c.seqlen_given) {
      lengths_ = c.lengths;
      if (lengths_->empty()) *error = "the sequence-length file has no lengths";
      return;
    }
    if (c.seqlen.rfind("fixed:", 0) == 0) {
      long long n = 0;
      if (!integer_text(c.seqlen.substr(6), &n) || n < 1 || n > kMaxIntValue)
        *error = "workload option seqlen: bad value '" + c.seqlen + "': fixed:N needs an integer N in [1, " +
                 std::to_string(kMaxIntValue) + "]";
      else if (n > c.max_seq)  // no sequence is longer than max_seq: a length past it would be cut, unseen
        *error = "workload option seqlen: fixed:" + std::to_string(n) + " is longer than max_seq=" +
                 std::to_string(c.max_seq) + " (the longest sequence the model takes): raise max_seq or lower N";
      fixed_ = static_cast<int>(n);
      return;
    }
    for (const auto& f : kFits)
      if (c.seqlen == f.name) fit_ = &f;
    if (!fit_) *error = "workload option seqlen: bad value '" + c.seqlen + "': expected " + accepted("seqlen");
  }
  int draw() {
    if (fixed_) return std::min(fixed_, max_);
    if (lengths_) return std::clamp((*lengths_)[rng_() % lengths_->size()], 1, max_);
    std::lognormal_distribution<double> d(fit_->mu, fit_->sigma);
    const int v = static_cast<int>(std::lround(d(rng_)));
    return std::clamp(std::clamp(v, fit_->lo, fit_->hi), 1, max_);
  }

 private:
  std::mt19937_64 rng_;
  int max_;
  int fixed_ = 0;
  const SeqFit* fit_ = nullptr;
  const std::vector<int>* lengths_ = nullptr;
};

// One step's batch: tokens (activations scale with them) and attention elements per head (scores scale
// with them). padding=longest pads every sequence to the longest (B·S_max, B·S_max²); padding=none packs
// them without cross-sequence attention, as variable-length kernels do (Σs, Σs²).
struct Batch { std::uint64_t tokens = 0, attention = 0; };
Batch draw_batch(const Config& c, SeqLen& lens) {
  Batch bt;
  std::uint64_t longest = 0;
  for (int b = 0; b < c.batch; ++b) {
    const auto s = static_cast<std::uint64_t>(lens.draw());
    longest = std::max(longest, s);
    bt.tokens += s;
    bt.attention += s * s;
  }
  if (c.pad_to_longest) {
    bt.tokens = static_cast<std::uint64_t>(c.batch) * longest;
    bt.attention = static_cast<std::uint64_t>(c.batch) * longest * longest;
  }
  return bt;
}

void train(const Config& c, SeqLen& lens, Emitter& em) {
  const std::uint64_t d = static_cast<std::uint64_t>(c.d_model), ff = static_cast<std::uint64_t>(c.d_ff);
  const std::uint64_t w = static_cast<std::uint64_t>(c.dtype);
  // Parameters (fp32 master weights), live before the first step.
  std::vector<std::uint64_t> params = {static_cast<std::uint64_t>(c.vocab) * d * 4};
  for (int l = 0; l < c.layers; ++l)
    for (std::uint64_t n : {d * 4, d * d * 4, d * d * 4, d * d * 4, d * d * 4, d * 4, d * ff * 4, ff * d * 4})
      params.push_back(n);
  params.push_back(d * 4);
  params.push_back(static_cast<std::uint64_t>(c.vocab) * d * 4);
  for (auto n : params) em.alloc(n, true);
  std::vector<Tensor> grads, adam;
  for (int step = 0; step < c.steps; ++step) {
    const Batch bt = draw_batch(c, lens);
    const std::uint64_t BS = bt.tokens, BSS = bt.attention;
    const std::uint64_t H = static_cast<std::uint64_t>(c.heads), act = BS * d * w;
    // FLOPs (compute_model.h): a projection of the activations, the attention products, the MLP's two.
    const double T = static_cast<double>(BS), D = static_cast<double>(d), F = static_cast<double>(ff);
    const double proj_flops = 2 * T * D * D, attn_flops = 2 * static_cast<double>(BSS) * D, mlp_flops = 2 * T * D * F;
    const double layer_flops = 4 * proj_flops + 2 * attn_flops + 2 * mlp_flops;
    const double head_flops = 2 * T * D * static_cast<double>(c.vocab);
    const Tensor tokens{em.alloc(BS * 8), BS * 8};
    Tensor x{em.produce(act, 0), act};
    std::vector<std::vector<Tensor>> saved(static_cast<std::size_t>(c.layers));
    for (int l = 0; l < c.layers; ++l) {
      auto& keep = saved[static_cast<std::size_t>(l)];
      auto a = [&](std::uint64_t n, double flops = 0) { return Tensor{em.produce(n, flops), n}; };
      keep.push_back(x);                                      // layer input
      Tensor norm1 = a(act), q = a(act, proj_flops), k = a(act, proj_flops), v = a(act, proj_flops);
      Tensor scores = a(H * BSS * w, attn_flops), probs = a(H * BSS * w);
      em.free(scores.addr, scores.bytes);                    // softmax output is what backward needs
      std::vector<Tensor> extra;  // dropout: masks (1 byte per element) and dropped outputs, saved for backward
      if (c.dropout) {
        extra.push_back(a(H * BSS));
        extra.push_back(a(H * BSS * w));
      }
      Tensor ctx = a(act, attn_flops), proj = a(act, proj_flops);
      if (c.dropout) {
        extra.push_back(a(BS * d));
        extra.push_back(a(act));
      }
      Tensor resid = a(act), norm2 = a(act);
      Tensor h1 = a(BS * ff * w, mlp_flops), h2 = a(BS * ff * w), out = a(act, mlp_flops);
      if (c.dropout) {
        extra.push_back(a(BS * d));
        extra.push_back(a(act));
      }
      Tensor next = a(act);
      for (Tensor t : {norm1, q, k, v, probs, ctx, proj, resid, norm2, h1, h2, out}) {
        if (c.ckpt) em.free(t.addr, t.bytes); else keep.push_back(t);
      }
      for (Tensor t : extra) {
        if (c.ckpt) em.free(t.addr, t.bytes); else keep.push_back(t);
      }
      x = next;
    }
    const std::uint64_t logits_bytes = BS * static_cast<std::uint64_t>(c.vocab) * 4;
    Tensor logits{em.produce(logits_bytes, head_flops), logits_bytes};
    Tensor dlogits{em.produce(logits_bytes, 0), logits_bytes};
    em.free(logits.addr, logits.bytes);
    Tensor dx{em.produce(act, 2 * head_flops), act};
    em.free(dlogits.addr, dlogits.bytes);
    em.free(x.addr, x.bytes);
    if (grads.empty())
      for (auto n : params) grads.push_back({em.alloc(n), n});
    for (int l = c.layers - 1; l >= 0; --l) {
      auto& keep = saved[static_cast<std::size_t>(l)];
      std::vector<Tensor> recomputed;
      if (c.ckpt) {
        em.kernel(layer_flops, 0);  // the layer's forward again
        for (std::uint64_t n : {act, act, act, act, H * BSS * w, act, act, act, act, BS * ff * w,
                                BS * ff * w, act})
          recomputed.push_back({em.alloc(n), n});
      }
      em.kernel(2 * layer_flops, 0);  // the layer's backward: gradients of the inputs and of the weights
      Tensor g1{em.alloc(BS * ff * w), BS * ff * w}, g2{em.alloc(H * BSS * w), H * BSS * w};
      Tensor ndx{em.alloc(act), act};
      em.free(g2.addr, g2.bytes);
      em.free(g1.addr, g1.bytes);
      for (auto it = recomputed.rbegin(); it != recomputed.rend(); ++it) em.free(it->addr, it->bytes);
      for (auto it = keep.rbegin(); it != keep.rend(); ++it) em.free(it->addr, it->bytes);
      em.free(dx.addr, dx.bytes);
      dx = ndx;
    }
    em.free(dx.addr, dx.bytes);
    em.free(tokens.addr, tokens.bytes);
    if ((step + 1) % c.accum != 0) continue;  // gradient accumulation: the optimizer runs every accum steps
    if (adam.empty())
      for (auto n : params) {
        adam.push_back({em.alloc(n), n});
        adam.push_back({em.alloc(n), n});
      }
    for (auto n : params) {  // AdamW temporaries, one parameter at a time
      em.kernel(0, 7.0 * static_cast<double>(n));  // parameter, gradient and two moments read, three written
      Tensor t{em.alloc(n), n};
      em.free(t.addr, t.bytes);
    }
  }
  for (auto& g : grads) em.free(g.addr, g.bytes);
  for (auto& a : adam) em.free(a.addr, a.bytes);
}

void infer(const Config& c, SeqLen& lens, Emitter& em) {
  const std::uint64_t d = static_cast<std::uint64_t>(c.d_model), ff = static_cast<std::uint64_t>(c.d_ff);
  const std::uint64_t w = static_cast<std::uint64_t>(c.dtype);
  em.alloc(static_cast<std::uint64_t>(c.vocab) * d * w, true);
  for (int l = 0; l < c.layers; ++l)
    for (std::uint64_t n : {d * d * w, d * d * w, d * d * w, d * d * w, d * ff * w, ff * d * w}) em.alloc(n, true);
  for (int step = 0; step < c.steps; ++step) {
    const Batch bt = draw_batch(c, lens);
    const std::uint64_t BS = bt.tokens, BSS = bt.attention, B = static_cast<std::uint64_t>(c.batch);
    const std::uint64_t H = static_cast<std::uint64_t>(c.heads), act = BS * d * w;
    const double T = static_cast<double>(BS), D = static_cast<double>(d), F = static_cast<double>(ff);
    const double proj_flops = 2 * T * D * D, attn_flops = 2 * static_cast<double>(BSS) * D, mlp_flops = 2 * T * D * F;
    std::vector<Tensor> kv;
    Tensor x{em.produce(act, 0), act};
    for (int l = 0; l < c.layers; ++l) {
      kv.push_back({em.produce(act, proj_flops), act});  // K cache
      kv.push_back({em.produce(act, proj_flops), act});  // V cache
      Tensor q{em.produce(act, proj_flops), act}, sc{em.produce(H * BSS * w, attn_flops), H * BSS * w};
      Tensor ctx{em.produce(act, attn_flops), act};
      em.free(sc.addr, sc.bytes);
      em.free(q.addr, q.bytes);
      Tensor h{em.produce(BS * ff * w, mlp_flops), BS * ff * w};
      Tensor next{em.produce(act, mlp_flops + proj_flops), act};
      em.free(h.addr, h.bytes);
      em.free(ctx.addr, ctx.bytes);
      em.free(x.addr, x.bytes);
      x = next;
    }
    const std::uint64_t logits_bytes = B * static_cast<std::uint64_t>(c.vocab) * 4;
    Tensor logits{em.produce(logits_bytes, 2 * static_cast<double>(B) * D * static_cast<double>(c.vocab)), logits_bytes};
    em.free(logits.addr, logits.bytes);
    em.free(x.addr, x.bytes);
    for (auto& t : kv) em.free(t.addr, t.bytes);
  }
}

}  // namespace

bool has_empty_item(const std::string& options) {
  return !options.empty() &&
         (options.front() == ',' || options.back() == ',' || options.find(",,") != std::string::npos);
}

// Note [Tensor sizes a workload can name]
// A tensor's bytes are products of the keys (heads x batch x max_seq^2 x dtype bytes for the attention
// scores): every key within its range, a product can still pass 2^64 and wrap to a small size, which the
// replay would take for a small tensor (a review found a 2^64-byte attention replayed as 1 byte). So the
// largest tensor of each kind a spec can reach is computed first, in long double, and a spec with one of
// 2^62 bytes or more (what a trace records, with room for sums over it) is refused, naming it.
std::string too_large_tensor(const Config& c) {
  const long double B = c.batch, S = c.max_seq, H = c.heads, d = c.d_model, ff = c.d_ff, V = c.vocab, w = c.dtype;
  const std::pair<const char*, long double> kinds[] = {
      {"attention scores (heads x batch x max_seq^2 x dtype bytes)", H * B * S * S * w},
      {"activations (batch x max_seq x d_model x dtype bytes)", B * S * d * w},
      {"MLP activations (batch x max_seq x d_ff x dtype bytes)", B * S * ff * w},
      {"logits (batch x max_seq x vocab x 4 bytes)", B * S * V * 4},
      {"embedding (vocab x d_model x 4 bytes)", V * d * 4},
      {"MLP weights (d_model x d_ff x 4 bytes)", d * ff * 4},
  };
  for (const auto& [what, bytes] : kinds)
    if (bytes >= 0x1p62L) {
      char b[64];
      std::snprintf(b, sizeof b, "%.4Lg", bytes);
      return std::string("its ") + what + " would be " + b + " bytes, 2^62 or more (the most a trace records); "
             "give smaller keys";
    }
  return {};
}

bool make_workload(const std::string& spec, formats::Trace* out, std::string* error,
                   const std::vector<int>* lengths, bool* too_large) {
  if (spec.rfind("workload:", 0) != 0) {
    *error = "a workload spec starts with 'workload:'";
    return false;
  }
  const std::string rest = spec.substr(9);
  const auto colon = rest.find(':');
  const std::string name = rest.substr(0, colon), options = colon == std::string::npos ? "" : rest.substr(colon + 1);
  if (too_large) *too_large = false;
  if (is_zoo_workload(name)) return make_zoo_workload(name, options, out, error, too_large);
  Config c;
  if (!parse(spec, &c, error)) return false;
  c.lengths = lengths;
  SeqLen lens(c, error);
  if (!error->empty()) return false;
  if (const std::string why = too_large_tensor(c); !why.empty()) {  // Note [Tensor sizes a workload can name]
    *error = spec + ": " + why;
    if (too_large) *too_large = true;
    return false;
  }
  // Every step draws `batch` lengths and makes a few dozen events whatever the batch (kMaxWorkloadDraws).
  if (static_cast<double>(c.batch) * c.steps > kMaxWorkloadDraws) {
    *error = spec + ": batch x steps = " + std::to_string(static_cast<long long>(c.batch) * c.steps) +
             " sequence lengths to draw, more than " + std::to_string(static_cast<long long>(kMaxWorkloadDraws)) +
             "; give a smaller batch or fewer steps";
    if (too_large) *too_large = true;
    return false;
  }
  *out = formats::Trace{};
  out->source = spec;
  Emitter em(out, c.dtype, c.tf32 != 0);
  return generate_bounded(spec, out, error, too_large, [&] {
    if (c.name == "transformer-train") train(c, lens, em); else infer(c, lens, em);
  });
}

std::string workload_too_large(const std::string& spec, bool out_of_memory, bool addresses) {
  if (addresses)
    return spec + ": its tensors add up to more than 2^62 bytes (Note [Workload addresses]); give smaller keys "
                  "(steps, layers, batch, ...)";
  if (out_of_memory)
    return spec + ": the host ran out of memory while generating its events; give smaller keys (steps, layers, "
                  "batch, ...)";
  return spec + ": more than " + std::to_string(kMaxWorkloadEvents) +
         " allocation events (gigabytes of host memory to hold them); give smaller keys (steps, layers, batch, ...)";
}

std::string transformer_help() {
  const Config defaults;
  std::vector<std::string> items;
  for (const auto& k : kIntKeys)
    items.push_back(std::string(k.name) + "=" + std::to_string(defaults.*k.field) + " [" + std::to_string(k.least) +
                    ", " + std::to_string(k.most) + "]");
  for (const auto& k : kTextKeys) items.push_back(std::string(k.name) + "=" + k.def + " (" + k.accepted + ")");
  std::string out = "  transformer-train, transformer-infer: decoder-only transformer steps over variable-length batches\n"
                    "    keys (default, accepted values):";
  std::size_t col = 36;
  for (std::size_t i = 0; i < items.size(); ++i) {
    const std::string item = " " + items[i] + (i + 1 < items.size() ? "," : "");
    if (col + item.size() > 110) {
      out += "\n     ";
      col = 5;
    }
    out += item;
    col += item.size();
  }
  return out + "\n";
}

namespace {

// The text after "workload:NAME:" (empty when there is none).
std::string options_of(const std::string& spec) {
  const auto colon = spec.find(':', 9);
  return colon == std::string::npos ? std::string() : spec.substr(colon + 1);
}

// Whether the spec sets `key` itself (key=value among its options).
bool spec_sets(const std::string& spec, const std::string& key) {
  std::stringstream kv(options_of(spec));
  std::string item;
  while (std::getline(kv, item, ','))
    if (item.substr(0, item.find('=')) == key) return true;
  return false;
}

}  // namespace

bool workload_key_range(const std::string& spec, const std::string& key, long long* lo, long long* hi,
                        std::string* error, bool* capped) {
  if (capped) *capped = false;
  if (spec.rfind("workload:", 0) != 0) {
    *error = spec + ": --max-batch and --max-of search a key of a built-in workload; this input is a trace";
    return false;
  }
  const std::string rest = spec.substr(9);
  const std::string name = rest.substr(0, rest.find(':'));
  if (!known_name(name, error)) return false;
  auto settable = [&]() {
    if (!spec_sets(spec, key)) return true;
    *error = spec + ": sets " + key + ", the key the search varies: leave " + key + "= out of the spec";
    return false;
  };
  if (is_zoo_workload(name)) {
    double l = 0, h = 0;
    const std::size_t colon = rest.find(':');
    if (!zoo_key_range(name, key, &l, &h, error, colon == std::string::npos ? "" : rest.substr(colon + 1))) return false;
    *lo = static_cast<long long>(std::ceil(l));
    *hi = static_cast<long long>(std::min(std::floor(h), 1e15));
    if (*hi <= *lo) {
      *error = "workload " + name + ": key '" + key + "' takes values in [" + std::to_string(l) + ", " +
               std::to_string(h) + "]: no integer range to search";
      return false;
    }
    return settable();
  }
  if (const IntKey* ik = int_key(key)) {
    *lo = ik->least;
    *hi = ik->most;
    return settable();
  }
  if (key == "seed") {  // [0, 2^64) accepted; the search stops at 1e15, as for the zoo's seeds
    *lo = 0;
    *hi = 1000000000000000LL;
    if (capped) *capped = true;
    return settable();
  }
  std::string names;
  for (const auto& k : kIntKeys) names += std::string(k.name) + ", ";
  if (key == "seqlen" || key == "dtype" || key == "padding")
    *error = "workload " + name + ": key '" + key + "' is not numeric (numeric keys: " + names + "seed)";
  else
    *error = "workload " + name + " has no key '" + key + "' to search; --max-of KEY searches one of its numeric keys: " +
             names + "seed";
  return false;
}

std::string seqlen_file_note(const std::string& input, const std::vector<int>& lengths, const std::string& path) {
  if (!draws_seqlen_file(input)) return {};
  Config c;
  std::string error;
  if (!parse(input, &c, &error)) return {};  // the input's own error is reported when it is made
  const auto longer = std::count_if(lengths.begin(), lengths.end(), [&](int n) { return n > c.max_seq; });
  if (longer == 0) return {};
  return "note: " + input + ": " + std::to_string(longer) + " of the " + std::to_string(lengths.size()) +
         " lengths in " + path + " are longer than max_seq=" + std::to_string(c.max_seq) +
         " and are cut to it (as training truncates to its context); give a larger max_seq to keep them whole";
}

bool draws_seqlen_file(const std::string& input) {
  if (input.rfind("workload:", 0) != 0) return false;
  const std::string name = input.substr(9, input.find(':', 9) - 9);
  return (name == "transformer-train" || name == "transformer-infer" || name == "ckpt-accum") &&
         !spec_sets(input, "seqlen");
}

std::string workload_with(const std::string& spec, const std::string& key, long long value) {
  const bool has_options = spec.find(':', 9) != std::string::npos;
  const char* sep = !has_options ? ":" : spec.back() == ':' || spec.back() == ',' ? "" : ",";
  return spec + sep + key + "=" + std::to_string(value);
}

bool read_seqlen_file(const std::string& path, std::vector<int>* out, std::string* error, std::string* note) {
  std::error_code ec;
  if (std::filesystem::is_directory(path, ec)) {
    *error = path + ": is a directory (--seqlen-file takes a CSV file)";
    return false;
  }
  std::ifstream in(path);
  if (!in) {
    *error = path + ": cannot open (" + std::strerror(errno) + ")";
    return false;
  }
  auto split = [](const std::string& line) {
    std::vector<std::string> f;
    std::stringstream ss(line);
    std::string x;
    while (std::getline(ss, x, ',')) {
      while (!x.empty() && (x.back() == '\r' || x.back() == ' ')) x.pop_back();
      x.erase(0, x.find_first_not_of(' '));  // one erase (one per space was quadratic in them)
      f.push_back(x);
    }
    return f;
  };
  std::string line;
  if (!std::getline(in, line)) {
    *error = path + ": is empty (expected a CSV header naming a sequence-length column)";
    return false;
  }
  if (line.rfind("\xEF\xBB\xBF", 0) == 0) line.erase(0, 3);  // a UTF-8 byte-order mark (spreadsheets write one)
  const auto header = split(line);
  auto col = [&](const char* name) -> int {
    for (std::size_t i = 0; i < header.size(); ++i)
      if (header[i] == name) return static_cast<int>(i);
    return -1;
  };
  constexpr const char* kSingle[] = {"seqlen", "length", "tokens", "total_tokens", "num_total_tokens"};
  constexpr std::pair<const char*, const char*> kPairs[] = {
      {"ContextTokens", "GeneratedTokens"}, {"num_prefill_tokens", "num_decode_tokens"}, {"input_length", "output_length"}};
  std::vector<int> cols;
  std::vector<std::string> usable;  // every column (or pair) the header offers, in the order taken
  for (const char* n : kSingle)
    if (col(n) >= 0) {
      if (cols.empty()) cols = {col(n)};
      usable.push_back(n);
    }
  for (auto [a, b] : kPairs)
    if (col(a) >= 0 && col(b) >= 0) {
      if (cols.empty()) cols = {col(a), col(b)};
      usable.push_back(std::string(a) + " + " + b);
    }
  if (note && usable.size() > 1) {
    std::string others;
    for (std::size_t i = 1; i < usable.size(); ++i) others += (i > 1 ? ", " : "") + usable[i];
    *note = "note: " + path + " has more than one sequence-length column: lengths are read from " + usable[0] +
            " (not " + others + "; the order taken: seqlen, length, tokens, total_tokens, num_total_tokens, then the "
            "pairs)";
  }
  if (cols.empty()) {
    std::string found, single, pairs;
    for (const auto& h : header) found += std::string(found.empty() ? "" : ", ") + "'" + h + "'";
    for (const char* n : kSingle) single += std::string(single.empty() ? "" : ", ") + n;
    for (auto [a, b] : kPairs) pairs += std::string(pairs.empty() ? "" : ", ") + a + " and " + b;
    *error = path + ": no sequence-length column: the header has " + found + "; accepted: one of the columns " +
             single + ", or a prompt/output pair (" + pairs + "), whose sum is the length";
    return false;
  }
  constexpr long kMaxLength = 10'000'000;
  auto integer = [](const std::string& v, long* n) {
    char* end = nullptr;
    errno = 0;
    *n = std::strtol(v.c_str(), &end, 10);
    return !v.empty() && !*end && errno == 0;
  };
  out->clear();
  std::size_t lineno = 1;
  while (std::getline(in, line)) {
    ++lineno;
    if (line.empty() || line == "\r") continue;
    const auto row = split(line);
    long total = 0;
    for (int c : cols) {
      const auto i = static_cast<std::size_t>(c);
      if (i >= row.size()) {
        *error = path + ":" + std::to_string(lineno) + ": the row ends before column " + header[i];
        return false;
      }
      const std::string& cell = row[i];
      long n = 0;
      if (!integer(cell, &n) || n < 0 || n > kMaxLength) {
        *error = path + ":" + std::to_string(lineno) + ": '" + cell + "' in column " + header[i] +
                 " is not a sequence length (an integer in [" + (cols.size() == 1 ? "1" : "0") + ", " +
                 std::to_string(kMaxLength) + "]" + (cols.size() == 1 ? "" : ", the pair's sum at least 1") + ")";
        return false;
      }
      total += n;
    }
    if (total < 1 || total > kMaxLength) {  // a single column's 0, or a pair's sum out of range
      std::string what = header[static_cast<std::size_t>(cols[0])];
      if (cols.size() == 2) what += " + " + header[static_cast<std::size_t>(cols[1])];
      *error = path + ":" + std::to_string(lineno) + ": " + what + " = " + std::to_string(total) +
               " is not a sequence length (a length is an integer in [1, " + std::to_string(kMaxLength) + "])";
      return false;
    }
    out->push_back(static_cast<int>(total));
  }
  if (out->empty()) {
    *error = path + ": no sequence lengths (the header has no rows under it)";
    return false;
  }
  return true;
}

}  // namespace fragless::replay
