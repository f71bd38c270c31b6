// The pattern zoo: parameterised allocation patterns beyond the transformer workloads (zoo.h). Every
// generator repeats its step (`steps`, at least 3 by default) with shapes that change from step to step,
// drawn from `seed`. Sizes follow the tensors the pattern would hold; nothing is copied from a trace.
#include "zoo.h"

#include "compute_model.h"
#include "workload.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <map>
#include <new>
#include <random>
#include <sstream>
#include <unordered_map>

namespace fragless::replay {

namespace {

using u64 = std::uint64_t;
constexpr u64 MiB = 1u << 20;

// Keys of one generator with their defaults and ranges; values given in the spec replace the defaults.
struct Key { const char* name; double def, lo, hi; const char* meaning; };

struct Generator {
  const char* name;
  const char* what;
  std::vector<Key> keys;
  void (*run)(const std::map<std::string, double>& k, class Emit& em);
};

// Emits the allocation events, stamped with the compute model's clock (compute_model.h); every pattern here
// computes in bf16.
class Emit {
 public:
  Emit(formats::Trace* t, u64 seed) : rng(seed), t_(t) {}
  u64 alloc(u64 bytes, u64 stream = 0, bool seed = false) {
    const u64 addr = take_address(&next_, bytes);  // Note [Workload addresses]
    formats::Event e;
    e.op = formats::Op::alloc;
    e.address = addr;
    e.size = std::max<u64>(bytes, 1);
    e.stream = stream;
    check_room(*t_);
    (seed ? t_->seed : t_->events).push_back(e);
    if (!seed) clock_.stamp(t_->model_time_us);
    live_[addr] = {e.size, stream, 0};
    return addr;
  }
  // The kernel that produces a tensor of `bytes` with `flops` of arithmetic, then the tensor (its FLOPs kept,
  // for the backward kernel that produces its gradient).
  u64 produce(u64 bytes, double flops, u64 stream = 0) {
    kernel(flops, 2.0 * static_cast<double>(bytes));
    const u64 addr = alloc(bytes, stream);
    live_[addr].flops = flops;
    return addr;
  }
  void kernel(double flops, double bytes) { clock_.kernel(flops, bytes, 2); }
  void free(u64 addr) {
    auto it = live_.find(addr);
    if (it == live_.end()) return;
    formats::Event e;
    e.op = formats::Op::free;
    e.address = addr;
    e.size = it->second.bytes;
    e.stream = it->second.stream;
    check_room(*t_);
    t_->events.push_back(e);
    clock_.stamp(t_->model_time_us);
    live_.erase(it);
  }
  // The program calls torch.cuda.empty_cache() here.
  void empty_cache() {
    formats::Event e;
    e.op = formats::Op::empty_cache;
    check_room(*t_);
    t_->events.push_back(e);
    clock_.stamp(t_->model_time_us);
  }
  u64 size_of(u64 addr) const {
    auto it = live_.find(addr);
    return it == live_.end() ? 1 : it->second.bytes;
  }
  double flops_of(u64 addr) const {
    auto it = live_.find(addr);
    return it == live_.end() ? 0 : it->second.flops;
  }
  void free_all(std::vector<u64>& v) {
    for (auto it = v.rbegin(); it != v.rend(); ++it) free(*it);
    v.clear();
  }
  // Frees each of `v` in order (free_all frees the newest first).
  void free_each(const std::vector<u64>& v) {
    for (u64 addr : v) free(addr);
  }
  // `next` takes the place of `cur`, which is freed.
  void replace(u64& cur, u64 next) {
    free(cur);
    cur = next;
  }
  double uniform(double a, double b) { return std::uniform_real_distribution<double>(a, b)(rng); }
  // A value around `x`, within ±jitter of it, at least 1.
  u64 jitter(double x, double j) { return static_cast<u64>(std::max(1.0, std::round(x * uniform(1 - j, 1 + j)))); }
  int lognormal(double mu, double sigma, int lo, int hi) {
    std::lognormal_distribution<double> d(mu, sigma);
    return std::clamp(static_cast<int>(std::lround(d(rng))), lo, hi);
  }
  std::mt19937_64 rng;

 private:
  struct Live { u64 bytes, stream; double flops; };
  formats::Trace* t_;
  ModelClock clock_;
  u64 next_ = 4096;
  std::unordered_map<u64, Live> live_;
};

int I(const std::map<std::string, double>& k, const char* n) { return static_cast<int>(k.at(n)); }
u64 U(const std::map<std::string, double>& k, const char* n) { return static_cast<u64>(I(k, n)); }
double D(const std::map<std::string, double>& k, const char* n) { return k.at(n); }

// ---- U-Net (2D training or 3D volume inference): activations halve and double by level ----
void unet(const std::map<std::string, double>& k, Emit& em) {
  const int dims = I(k, "dims"), levels = I(k, "levels"), steps = I(k, "steps");
  const u64 base = U(k, "base"), batch = U(k, "batch");
  const bool train = I(k, "train") != 0;
  const u64 quantum = u64{1} << levels;
  auto act = [&](u64 ch, u64 side) {
    u64 v = batch * ch * 2;  // bf16
    for (int d = 0; d < dims; ++d) v *= side;
    return v;
  };
  // Weights: two 3^dims convolutions per level on each side (many of them sub-page tensors).
  const u64 taps = dims == 3 ? 27 : 9;
  for (int l = 0; l <= levels; ++l) {
    const u64 c = base << l;
    for (int i = 0; i < 4; ++i) em.alloc(taps * c * c * 4, 0, true);
  }
  std::vector<u64> grads;
  for (int s = 0; s < steps; ++s) {
    // The input's side changes every step (a crop or volume of another size), in steps the levels divide.
    const u64 side = std::max<u64>(quantum, em.jitter(D(k, "res"), D(k, "jitter")) / quantum * quantum);
    std::vector<u64> kept, skips;
    // A convolution's FLOPs: two per output element, input channel and tap (act() is bf16: 2 bytes).
    auto conv = [&](u64 out_bytes, u64 c_in) { return 2.0 * static_cast<double>(out_bytes / 2 * c_in * taps); };
    u64 x = em.produce(act(1, side), 0);
    kept.push_back(x);
    for (int l = 0; l < levels; ++l) {
      const u64 c = base << l, sd = side >> l, c_in = l ? c / 2 : 1;
      const u64 a1 = em.produce(act(c, sd), conv(act(c, sd), c_in)), a2 = em.produce(act(c, sd), conv(act(c, sd), c));
      skips.push_back(a2);
      if (train) kept.push_back(a1); else em.free(a1);
      const u64 pooled = em.produce(act(c, sd / 2), 0);
      if (train) kept.push_back(pooled); else em.free(x);
      x = pooled;
    }
    for (int l = levels - 1; l >= 0; --l) {
      const u64 c = base << l, sd = side >> l;
      const u64 up = em.produce(act(c, sd), conv(act(c, sd), 2 * c)), cat = em.produce(act(2 * c, sd), 0);
      em.free(up);
      if (!train) em.free(skips[static_cast<std::size_t>(l)]);
      if (!train) em.free(x);
      const u64 d1 = em.produce(act(c, sd), conv(act(c, sd), 2 * c));
      if (!train) em.free(cat);
      const u64 d2 = em.produce(act(c, sd), conv(act(c, sd), c));
      if (train) {
        kept.push_back(cat);
        kept.push_back(d1);
      } else {
        em.free(d1);
      }
      x = d2;
      if (train) kept.push_back(x);
    }
    const u64 out = em.produce(act(2, side), conv(act(2, side), base));
    if (!train) {
      em.free(x);
      em.free(out);
      continue;
    }
    if (grads.empty())
      for (int l = 0; l <= levels; ++l)
        for (int i = 0; i < 4; ++i) grads.push_back(em.alloc(taps * (base << l) * (base << l) * 4));
    // Backward: each kept activation gets a gradient of its size, then both go.
    u64 g = em.produce(act(2, side), 0);
    em.free(out);
    for (auto it = kept.rbegin(); it != kept.rend(); ++it) {
      const u64 ng = em.produce(em.size_of(*it), 2 * em.flops_of(*it));  // gradients of input and weights
      em.free(*it);
      em.replace(g, ng);
    }
    em.free(g);
    em.free_each(skips);
  }
  em.free_each(grads);
}

// ---- Mixture of experts: per-expert token counts that change every step ----
void moe(const std::map<std::string, double>& k, Emit& em) {
  const int layers = I(k, "layers"), experts = I(k, "experts"), steps = I(k, "steps"), topk = I(k, "topk");
  const u64 d = U(k, "d_model"), ff = U(k, "d_ff");
  const bool train = I(k, "train") != 0;
  for (int l = 0; l < layers; ++l) {
    em.alloc(d * static_cast<u64>(experts) * 4, 0, true);  // router
    for (int e = 0; e < experts; ++e) {
      em.alloc(d * ff * 2, 0, true);
      em.alloc(ff * d * 2, 0, true);
    }
  }
  std::gamma_distribution<double> gamma(D(k, "skew"), 1.0);
  std::vector<u64> grads;
  for (int s = 0; s < steps; ++s) {
    const u64 tokens = em.jitter(D(k, "tokens"), 0.5);
    std::vector<std::vector<u64>> kept(static_cast<std::size_t>(layers));
    std::vector<std::vector<u64>> counts(static_cast<std::size_t>(layers));
    u64 x = em.produce(tokens * d * 2, 0);
    for (int l = 0; l < layers; ++l) {
      auto& keep = kept[static_cast<std::size_t>(l)];
      auto& cnt = counts[static_cast<std::size_t>(l)];
      // Routing: expert shares from a Dirichlet draw, so the load is uneven and different every step.
      std::vector<double> w(static_cast<std::size_t>(experts));
      double sum = 0;
      for (double& v : w) sum += (v = gamma(em.rng) + 1e-9);
      const u64 logits = em.produce(tokens * static_cast<u64>(experts) * 4,
                                    2.0 * static_cast<double>(tokens * d * static_cast<u64>(experts)));
      em.free(logits);
      std::vector<u64> outs;
      for (int e = 0; e < experts; ++e) {
        const u64 c = static_cast<u64>(std::llround(static_cast<double>(tokens * static_cast<u64>(topk)) *
                                                    w[static_cast<std::size_t>(e)] / sum));
        cnt.push_back(c);
        if (c == 0) continue;
        const double gemm = 2.0 * static_cast<double>(c * d * ff);
        const u64 in = em.produce(c * d * 2, 0), h = em.produce(c * ff * 2, gemm), out = em.produce(c * d * 2, gemm);
        if (train) {
          keep.push_back(in);
          keep.push_back(h);
        } else {
          em.free(in);
          em.free(h);
        }
        outs.push_back(out);
      }
      const u64 next = em.produce(tokens * d * 2, 0);
      em.free_each(outs);
      if (train) keep.push_back(x); else em.free(x);
      x = next;
    }
    em.free(x);
    if (!train) continue;
    if (grads.empty())
      for (int l = 0; l < layers; ++l)
        for (int e = 0; e < experts; ++e) grads.push_back(em.alloc(2 * d * ff * 2));
    u64 dx = em.produce(tokens * d * 2, 0);
    for (int l = layers - 1; l >= 0; --l) {
      for (u64 c : counts[static_cast<std::size_t>(l)]) {
        if (c == 0) continue;
        const double gemm = 2.0 * static_cast<double>(c * d * ff);
        const u64 gh = em.produce(c * ff * 2, 2 * gemm), gi = em.produce(c * d * 2, 2 * gemm);
        em.free(gh);
        em.free(gi);
      }
      const u64 ndx = em.produce(tokens * d * 2, 0);
      em.free_all(kept[static_cast<std::size_t>(l)]);
      em.replace(dx, ndx);
    }
    em.free(dx);
  }
  em.free_each(grads);
}

// ---- LLM serving with continuous batching: per-request KV caches that grow and finish at random ----
void serving(const std::map<std::string, double>& k, Emit& em) {
  const int layers = I(k, "layers"), steps = I(k, "steps"), max_batch = I(k, "max_batch"), block = I(k, "block");
  const u64 d = U(k, "d_model"), ff = U(k, "d_ff");
  const u64 kv_token = U(k, "kv_heads") * U(k, "head_dim") * 2;  // bf16, K or V
  for (int l = 0; l < layers; ++l)
    for (u64 n : {d * d * 2, d * d * 2, d * ff * 2, ff * d * 2}) em.alloc(n, 0, true);
  struct Request { int len, left; u64 cap; std::vector<u64> kv; };
  std::vector<Request> active;
  for (int s = 0; s < steps; ++s) {
    // New requests join while there is room, each with a prompt and an output length of its own.
    u64 prefill = 0;
    while (static_cast<int>(active.size()) < max_batch && em.uniform(0, 1) < D(k, "arrival")) {
      Request r;
      r.len = em.lognormal(6.2, 1.0, 8, 4096);
      r.left = em.lognormal(5.0, 0.9, 4, 2048);
      r.cap = static_cast<u64>((r.len + block - 1) / block * block);
      for (int l = 0; l < 2 * layers; ++l) r.kv.push_back(em.alloc(r.cap * kv_token));
      prefill += static_cast<u64>(r.len);
      active.push_back(std::move(r));
    }
    const u64 tokens = prefill + active.size();
    if (tokens == 0) continue;
    // One iteration's transient activations, layer by layer.
    u64 x = em.produce(tokens * d * 2, 0);
    const double T = static_cast<double>(tokens), D = static_cast<double>(d), F = static_cast<double>(ff);
    for (int l = 0; l < layers; ++l) {
      const u64 qkv = em.produce(tokens * d * 3 * 2, 2 * T * D * 3 * D), h = em.produce(tokens * ff * 2, 2 * T * D * F);
      em.free(qkv);
      const u64 next = em.produce(tokens * d * 2, 2 * T * F * D + 2 * T * D * D);
      em.free(h);
      em.replace(x, next);
    }
    em.free(x);
    // Each request's KV cache grows by a block when it is full (a new tensor, the old one freed), and a
    // request that has produced its output leaves.
    for (auto& r : active) {
      ++r.len;
      --r.left;
      if (static_cast<u64>(r.len) > r.cap) {
        r.cap += static_cast<u64>(block);
        for (u64& t : r.kv) {
          const u64 grown = em.produce(r.cap * kv_token, 0);  // a copy of the old one, and a block more
          em.replace(t, grown);
        }
      }
    }
    for (auto it = active.begin(); it != active.end();)
      if (it->left <= 0) {
        em.free_all(it->kv);
        it = active.erase(it);
      } else {
        ++it;
      }
  }
  for (auto& r : active) em.free_all(r.kv);
}

// ---- Sharded data parallel (FSDP / ZeRO-3): parameters gathered on a communication stream ----
void fsdp(const std::map<std::string, double>& k, Emit& em) {
  const int layers = I(k, "layers"), steps = I(k, "steps");
  const u64 d = U(k, "d_model"), world = U(k, "world");
  const u64 batch = U(k, "batch");
  constexpr u64 kComm = 7;  // the communication stream
  const u64 full = 12 * d * d * 2, shard = full / world;  // one layer's bf16 parameters, and a rank's share
  for (int l = 0; l < layers; ++l) {
    em.alloc(shard * 2, 0, true);  // fp32 master shard
    em.alloc(shard * 4, 0, true);  // Adam moments
  }
  std::vector<u64> grad_shards;
  for (int s = 0; s < steps; ++s) {
    u64 tokens = 0;
    for (u64 b = 0; b < batch; ++b) tokens += static_cast<u64>(em.lognormal(7.2, 0.8, 32, I(k, "max_seq")));
    const u64 act = tokens * d * 2;
    std::vector<std::vector<u64>> kept(static_cast<std::size_t>(layers));
    u64 gathered = em.alloc(full, kComm);  // layer 0, prefetched
    for (int l = 0; l < layers; ++l) {
      const u64 next = l + 1 < layers ? em.alloc(full, kComm) : 0;  // the next layer's all-gather overlaps
      auto& keep = kept[static_cast<std::size_t>(l)];
      em.kernel(2.0 * 12 * static_cast<double>(d * d * tokens), 0);  // the layer's forward
      for (int i = 0; i < 4; ++i) keep.push_back(em.alloc(act));
      keep.push_back(em.alloc(4 * act));
      em.replace(gathered, next);
    }
    if (grad_shards.empty())
      for (int l = 0; l < layers; ++l) grad_shards.push_back(em.alloc(shard * 2));
    u64 dx = em.alloc(act);
    for (int l = layers - 1; l >= 0; --l) {
      const u64 regather = em.alloc(full, kComm);
      em.kernel(2 * 2.0 * 12 * static_cast<double>(d * d * tokens), 0);  // the layer's backward
      const u64 g4 = em.alloc(4 * act), ndx = em.alloc(act);
      em.free(g4);
      const u64 grad_full = em.alloc(full);            // this layer's full gradient
      const u64 scattered = em.alloc(shard, kComm);    // reduce-scatter output
      em.free(grad_full);
      em.free(scattered);
      em.free(regather);
      em.free_all(kept[static_cast<std::size_t>(l)]);
      em.replace(dx, ndx);
    }
    em.free(dx);
  }
  em.free_each(grad_shards);
}

// ---- Pipeline parallel, 1F1B: micro-batches of varying length in flight on one stage ----
void pipeline(const std::map<std::string, double>& k, Emit& em) {
  const int stages = I(k, "stages"), rank = I(k, "rank"), micro = I(k, "micro");  // rank < stages: checked
  const int layers = I(k, "layers"), steps = I(k, "steps");
  const u64 d = U(k, "d_model"), ff = U(k, "d_ff"), batch = U(k, "batch");
  constexpr u64 kComm = 5;
  for (int l = 0; l < layers; ++l)
    for (u64 n : {4 * d * d * 2, d * ff * 2, ff * d * 2}) em.alloc(n, 0, true);
  for (int s = 0; s < steps; ++s) {
    std::vector<u64> tokens;
    for (int m = 0; m < micro; ++m) {
      u64 t = 0;
      for (u64 b = 0; b < batch; ++b) t += static_cast<u64>(em.lognormal(7.0, 0.9, 16, I(k, "max_seq")));
      tokens.push_back(t);
    }
    std::vector<std::vector<u64>> kept(static_cast<std::size_t>(micro));
    auto forward = [&](int m) {
      const u64 t = tokens[static_cast<std::size_t>(m)], act = t * d * 2;
      const u64 recv = em.alloc(act, kComm);
      auto& keep = kept[static_cast<std::size_t>(m)];
      keep.push_back(recv);
      const double layer_flops = 2.0 * static_cast<double>(t * (4 * d * d + 2 * d * ff));
      for (int l = 0; l < layers; ++l) {
        em.kernel(layer_flops, 0);
        for (int i = 0; i < 3; ++i) keep.push_back(em.alloc(act));
        keep.push_back(em.alloc(t * ff * 2));
      }
      const u64 send = em.alloc(act, kComm);
      em.free(send);
    };
    auto backward = [&](int m) {
      const u64 t = tokens[static_cast<std::size_t>(m)], act = t * d * 2;
      u64 g = em.alloc(act, kComm);
      const double layer_flops = 2.0 * static_cast<double>(t * (4 * d * d + 2 * d * ff));
      for (int l = 0; l < layers; ++l) {
        em.kernel(2 * layer_flops, 0);
        const u64 gh = em.alloc(t * ff * 2), ng = em.alloc(act);
        em.free(gh);
        em.replace(g, ng);
      }
      em.free_all(kept[static_cast<std::size_t>(m)]);
      const u64 send = em.alloc(act, kComm);
      em.free(send);
      em.free(g);
    };
    const int warmup = std::min(micro, stages - rank - 1);
    int f = 0, b = 0;
    for (; f < warmup; ++f) forward(f);
    for (; f < micro; ++f, ++b) {
      forward(f);
      backward(b);
    }
    for (; b < micro; ++b) backward(b);
  }
}

// ---- Random: sizes over six decades, random lifetimes, several streams ----
void random_pattern(const std::map<std::string, double>& k, Emit& em) {
  const int steps = I(k, "steps"), ops = I(k, "ops"), streams = I(k, "streams");
  const double lo = std::log(D(k, "min_bytes")), hi = std::log(D(k, "min_bytes") * 1e6);
  const u64 cap = static_cast<u64>(D(k, "live_gib") * 1024) * MiB;
  struct Live { u64 addr, bytes; int until; };
  std::vector<Live> keep;  // long-lived tensors survive into the next step
  // This step's other tensors by the operation that frees them (its `until`), each list in allocation order:
  // the operation `op` frees exactly the list of `op`, since every earlier one was freed at its own
  // operation, which costs each operation its own tensors only (a scan of every live tensor made long
  // lifetimes quadratic: 800,000 operations with lifetime=1000000 took 100 s to generate).
  std::unordered_map<int, std::vector<Live>> due;
  for (int s = 0; s < steps; ++s) {
    u64 live_bytes = 0;
    for (const Live& l : keep) live_bytes += l.bytes;
    for (int op = 0; op < ops; ++op) {
      if (auto it = due.find(op); it != due.end()) {
        for (const Live& l : it->second) {
          em.free(l.addr);
          live_bytes -= l.bytes;
        }
        due.erase(it);
      }
      const u64 bytes = static_cast<u64>(std::exp(em.uniform(lo, hi)));
      if (live_bytes + bytes > cap) continue;
      const u64 stream = static_cast<u64>(em.rng() % static_cast<u64>(streams));
      const int life = static_cast<int>(std::exponential_distribution<double>(1.0 / D(k, "lifetime"))(em.rng)) + 1;
      Live l{em.produce(bytes, 0, stream), bytes, op + life};
      live_bytes += bytes;
      if (em.uniform(0, 1) < 0.03) keep.push_back(l); else due[l.until].push_back(l);
    }
    // What outlives the step's operations is freed in allocation order (addresses only grow: Note [Workload
    // addresses]).
    std::vector<Live> rest;
    for (auto& [until, list] : due) rest.insert(rest.end(), list.begin(), list.end());
    due.clear();
    std::sort(rest.begin(), rest.end(), [](const Live& a, const Live& b) { return a.addr < b.addr; });
    for (const Live& l : rest) em.free(l.addr);
    // Half of the long-lived tensors end with this step.
    std::size_t kept = 0;
    for (const Live& l : keep)
      if (em.rng() % 2) em.free(l.addr); else keep[kept++] = l;
    keep.resize(kept);
  }
  for (const Live& l : keep) em.free(l.addr);
}

// ---- Reinforcement learning of an LLM (GRPO/PPO on one GPU): rollouts, scoring and training alternate ----
// As TRL's GRPO trainer runs it with Hugging Face's generate on a model loaded in bf16: each step generates
// `group` responses to each of `prompts` prompts with a KV cache that grows by one token at a time (the dynamic
// cache concatenates each layer's keys, then its values, into a new tensor one token longer; static_kv=1
// allocates them once at the prompt plus max_new), scores the completions with the policy and a reference
// model in micro-batches (bf16 logits over the completion only, log-softmax one sequence at a time), then
// trains on them: activations kept per layer, gradients made during the first backward and dropped at
// zero_grad(set_to_none=True), Adam's moments made at the first optimizer step in the parameters' dtype, and
// foreach Adam's temporary list (the square roots of the second moments). The phases' shapes differ and
// change every step; empty_cache=1 gives the cache back between phases as RL frameworks often do.
void rl(const std::map<std::string, double>& k, Emit& em) {
  const int layers = I(k, "layers"), steps = I(k, "steps"), max_new = I(k, "max_new"), micro = I(k, "micro");
  const u64 d = U(k, "d_model"), ff = U(k, "d_ff"), vocab = U(k, "vocab");
  const u64 prompts = U(k, "prompts"), seqs = prompts * U(k, "group");
  const bool reference = I(k, "ref") != 0, static_kv = I(k, "static_kv") != 0, empty = I(k, "empty_cache") != 0;
  // Parameters, bf16: per layer the attention's four d×d and the gated MLP's three d×ff matrices, two norms.
  std::vector<u64> shapes;
  shapes.push_back(vocab * d * 2);  // embedding (tied with the output projection)
  for (int l = 0; l < layers; ++l)
    for (u64 n : {d * d * 2, d * d * 2, d * d * 2, d * d * 2, d * ff * 2, d * ff * 2, ff * d * 2, d * 2, d * 2})
      shapes.push_back(n);
  for (u64 n : shapes) em.alloc(n, 0, true);
  if (reference)
    for (u64 n : shapes) em.alloc(n, 0, true);
  const double D = static_cast<double>(d), F = static_cast<double>(ff), V = static_cast<double>(vocab);
  const double layer_flops_per_token = 2.0 * (4 * D * D + 3 * D * F);
  // The rest of a layer after attention, x replaced by its output: the output projection with the gate and up
  // projections (their activations), then the down projection.
  auto mlp = [&](u64 tokens, u64& x) {
    const double T = static_cast<double>(tokens);
    const u64 h = em.produce(tokens * 2 * ff * 2, 2 * T * (D * D + 2 * D * F));
    const u64 next = em.produce(tokens * d * 2, 2 * T * F * D);
    em.free(h);
    em.replace(x, next);
  };
  std::vector<u64> moments;  // Adam's, bf16 like the parameters (zeros_like), made at the first optimizer step
  for (int s = 0; s < steps; ++s) {
    // Prompts of varied length (each repeated for its group), left-padded to the longest; each response ends
    // at its own length, and the batch decodes until the longest one has.
    u64 prompt = 0, longest = 0;
    for (u64 q = 0; q < prompts; ++q) prompt = std::max<u64>(prompt, static_cast<u64>(em.lognormal(5.3, 0.7, 8, 4096)));
    for (u64 q = 0; q < seqs; ++q)
      longest = std::max<u64>(longest, static_cast<u64>(em.lognormal(5.0, 0.8, 1, max_new)));
    const u64 kv_row = seqs * d * 2;  // one token's keys (or values) over the batch, one layer, bf16
    // ---- Rollout: prefill, then one token at a time (attention through SDPA: no score matrix is made) ----
    std::vector<u64> kv;
    {
      const u64 tokens = seqs * prompt;
      u64 x = em.produce(tokens * d * 2, 0);
      for (int l = 0; l < layers; ++l) {
        const double T = static_cast<double>(tokens);
        const u64 qkv = em.produce(tokens * 3 * d * 2, 2 * T * 3 * D * D);
        const u64 kv_len = static_kv ? prompt + static_cast<u64>(max_new) : prompt;
        kv.push_back(em.alloc(kv_len * kv_row));
        kv.push_back(em.alloc(kv_len * kv_row));
        em.free(qkv);
        mlp(tokens, x);
      }
      const u64 logits = em.produce(seqs * vocab * 4, 2 * static_cast<double>(seqs) * D * V);  // the last token's, fp32
      em.free(x);
      em.free(logits);
    }
    for (u64 t = 1; t <= longest; ++t) {
      u64 x = em.produce(seqs * d * 2, 0);
      for (int l = 0; l < layers; ++l) {
        const double T = static_cast<double>(seqs), L = static_cast<double>(prompt + t);
        const u64 qkv = em.produce(seqs * 3 * d * 2, 2 * T * 3 * D * D);
        if (!static_kv)
          for (int i = 0; i < 2; ++i) {  // torch.cat(past, new): a new tensor one token longer, keys then values
            u64& cache = kv[static_cast<std::size_t>(2 * l + i)];
            em.replace(cache, em.produce((prompt + t) * kv_row, 0));
          }
        em.kernel(2 * T * L * D, 0);  // attention over the cache
        em.free(qkv);
        mlp(seqs, x);
      }
      const u64 logits = em.produce(seqs * vocab * 4, 2 * static_cast<double>(seqs) * D * V);
      const u64 probs = em.produce(seqs * vocab * 4, 0);  // softmax for sampling
      em.free(logits);
      em.free(probs);
      em.free(x);
    }
    em.free_all(kv);
    const u64 len = prompt + longest;
    const u64 sequences = em.alloc(seqs * len * 8);  // token ids, int64
    if (empty) em.empty_cache();
    // The logits of a micro-batch's completions (bf16) and their log-softmax, one sequence at a time.
    auto completion_logits = [&](u64 rows, std::vector<u64>* row_lsm) {
      const u64 logits = em.produce(rows * longest * vocab * 2, 2 * static_cast<double>(rows * longest) * D * V);
      for (u64 r = 0; r < rows; ++r) {
        const u64 lsm = em.produce(longest * vocab * 2, 0);
        if (row_lsm) row_lsm->push_back(lsm); else em.free(lsm);
      }
      return logits;
    };
    // ---- Scoring: log-probabilities under the policy and the reference, micro-batch by micro-batch ----
    std::vector<u64> logprobs;
    for (int model = 0; model < (reference ? 2 : 1); ++model)
      for (u64 m0 = 0; m0 < seqs; m0 += static_cast<u64>(micro)) {
        const u64 rows = std::min<u64>(static_cast<u64>(micro), seqs - m0), tokens = rows * len;
        u64 x = em.produce(tokens * d * 2, 0);
        for (int l = 0; l < layers; ++l) {
          const u64 h = em.produce(tokens * 2 * ff * 2, static_cast<double>(tokens) * layer_flops_per_token);
          const u64 next = em.produce(tokens * d * 2, 0);
          em.free(h);
          em.replace(x, next);
        }
        const u64 logits = completion_logits(rows, nullptr);
        em.free(x);
        logprobs.push_back(em.produce(rows * longest * 4, 0));  // gathered at the chosen tokens
        em.free(logits);
      }
    if (empty) em.empty_cache();
    // ---- Training: forward and backward per micro-batch, gradients accumulated, one optimizer step ----
    std::vector<u64> grads;
    for (u64 m0 = 0; m0 < seqs; m0 += static_cast<u64>(micro)) {
      const u64 rows = std::min<u64>(static_cast<u64>(micro), seqs - m0), tokens = rows * len;
      const double T = static_cast<double>(tokens);
      std::vector<std::vector<u64>> kept(static_cast<std::size_t>(layers));
      u64 x = em.produce(tokens * d * 2, 0);
      for (int l = 0; l < layers; ++l) {
        auto& keep = kept[static_cast<std::size_t>(l)];
        keep.push_back(x);
        keep.push_back(em.produce(tokens * d * 2, 0));                       // normed input
        keep.push_back(em.produce(tokens * 3 * d * 2, 2 * T * 3 * D * D));   // q, k, v
        keep.push_back(em.produce(tokens * d * 2, 2 * T * D * D));           // attention output
        keep.push_back(em.produce(tokens * 2 * ff * 2, 2 * T * 2 * D * F));  // gate and up
        x = em.produce(tokens * d * 2, 2 * T * F * D);
      }
      std::vector<u64> row_lsm;  // kept for the backward of log_softmax
      const u64 logits = completion_logits(rows, &row_lsm);
      const u64 dlogits = em.produce(rows * longest * vocab * 2, 0);
      em.free_each(row_lsm);
      em.free(logits);
      u64 dx = em.produce(tokens * d * 2, 2 * 2 * static_cast<double>(rows * longest) * D * V);
      em.free(dlogits);
      em.free(x);
      const bool first = grads.empty();
      if (first) grads.push_back(em.alloc(shapes[0]));
      for (int l = layers - 1; l >= 0; --l) {
        const u64 dh = em.produce(tokens * 2 * ff * 2, 2 * 2 * T * 3 * D * F);
        if (first)  // this layer's parameter gradients (the order within a layer only roughly backward's)
          for (std::size_t i = 9; i-- > 0;) grads.push_back(em.alloc(shapes[1 + 9 * static_cast<std::size_t>(l) + i]));
        const u64 ndx = em.produce(tokens * d * 2, 2 * 2 * T * 4 * D * D);
        em.free(dh);
        em.free_all(kept[static_cast<std::size_t>(l)]);
        em.replace(dx, ndx);
      }
      em.free(dx);
    }
    em.free_each(logprobs);
    if (moments.empty())
      for (u64 n : shapes)
        for (int i = 0; i < 2; ++i) moments.push_back(em.alloc(n));
    // foreach Adam: torch._foreach_sqrt of the second moments, a tensor per parameter, then the update.
    std::vector<u64> tmp;
    for (u64 n : shapes) tmp.push_back(em.produce(n, 0));
    em.free_each(tmp);
    em.free_each(grads);  // zero_grad(set_to_none=True)
    em.free(sequences);
    if (empty) em.empty_cache();
  }
  em.free_each(moments);
}

// A key's value is held as a double: seeds stop at 1e15, below 2^53, so that every seed accepted is its own
// (past 2^53 neighbouring seeds would read as one). --max-of seed searches up to the same bound.
const std::vector<Generator>& generators() {
  static const std::vector<Generator> g = {
      {"unet2d", "2D U-Net training: activations halve and double by level, skips kept, crops vary per step",
       {{"dims", 2, 2, 3, "spatial dimensions"}, {"base", 64, 1, 1024, "channels at the top level"},
        {"res", 512, 16, 8192, "mean input side"}, {"jitter", 0.25, 0, 0.9, "input side varies by this share"},
        {"levels", 4, 1, 8, "levels"}, {"batch", 8, 1, 1024, "batch"}, {"train", 1, 0, 1, "1 training, 0 inference"},
        {"steps", 4, 1, 100000, "steps"}, {"seed", 1, 0, 1e15, "random seed"}},
       unet},
      {"unet3d", "3D U-Net volume inference: GiB-scale activations that halve and double, volumes vary per step",
       {{"dims", 3, 2, 3, "spatial dimensions"}, {"base", 32, 1, 1024, "channels at the top level"},
        {"res", 160, 16, 4096, "mean volume side"}, {"jitter", 0.25, 0, 0.9, "volume side varies by this share"},
        {"levels", 4, 1, 8, "levels"}, {"batch", 2, 1, 1024, "batch"}, {"train", 0, 0, 1, "1 training, 0 inference"},
        {"steps", 4, 1, 100000, "steps"}, {"seed", 1, 0, 1e15, "random seed"}},
       unet},
      {"moe", "mixture-of-experts training: per-expert token counts drawn anew every step",
       {{"layers", 8, 1, 1000, "layers"}, {"experts", 16, 1, 1024, "experts per layer"},
        {"d_model", 2048, 1, 65536, "model width"}, {"d_ff", 4096, 1, 262144, "expert hidden width"},
        {"tokens", 16384, 1, 1e8, "mean tokens per step (±50%)"}, {"topk", 2, 1, 64, "experts per token"},
        {"skew", 1.0, 0.01, 100, "Dirichlet concentration of the routing (small: uneven)"},
        {"train", 1, 0, 1, "1 training, 0 inference"}, {"steps", 4, 1, 100000, "steps"},
        {"seed", 1, 0, 1e15, "random seed"}},
       moe},
      {"serving", "LLM serving with continuous batching: per-request KV caches grow by blocks and finish at random",
       {{"layers", 32, 1, 1000, "layers"}, {"d_model", 4096, 1, 65536, "model width"},
        {"d_ff", 11008, 1, 262144, "MLP width"}, {"kv_heads", 8, 1, 1024, "KV heads"},
        {"head_dim", 128, 1, 4096, "head dimension"}, {"max_batch", 32, 1, 4096, "requests in flight"},
        {"block", 16, 1, 65536, "tokens a KV cache grows by"}, {"arrival", 0.3, 0.001, 1, "chance a request joins"},
        {"steps", 400, 3, 1e6, "iterations"}, {"seed", 1, 0, 1e15, "random seed"}},
       serving},
      {"fsdp", "sharded data parallel (ZeRO-3): parameters gathered on a communication stream, gradients reduce-scattered",
       {{"layers", 24, 1, 1000, "layers"}, {"d_model", 4096, 8, 65536, "model width"},
        {"world", 8, 1, 4096, "ranks the parameters are sharded over"}, {"batch", 4, 1, 4096, "sequences per step"},
        {"max_seq", 4096, 1, 1e6, "longest sequence"}, {"steps", 4, 1, 100000, "steps"},
        {"seed", 1, 0, 1e15, "random seed"}},
       fsdp},
      {"pipeline", "pipeline parallel (1F1B) on one stage: micro-batches of varying length in flight",
       {{"stages", 4, 1, 1024, "pipeline stages"}, {"rank", 0, 0, 1023, "this stage"},
        {"micro", 8, 1, 4096, "micro-batches per step"}, {"layers", 6, 1, 1000, "layers on this stage"},
        {"d_model", 4096, 1, 65536, "model width"}, {"d_ff", 16384, 1, 262144, "MLP width"},
        {"batch", 2, 1, 4096, "sequences per micro-batch"}, {"max_seq", 4096, 1, 1e6, "longest sequence"},
        {"steps", 3, 1, 100000, "steps"}, {"seed", 1, 0, 1e15, "random seed"}},
       pipeline},
      {"random", "random sizes over six decades, random lifetimes, several streams, steps that differ; live_gib is "
                 "only a cap (an allocation that would pass it is skipped), not a target: above what the steps reach "
                 "(about 8 GiB at the other keys' defaults) a larger value changes nothing",
       {{"min_bytes", 512, 1, 1e9, "smallest size (the largest is 10^6 times it)"},
        {"lifetime", 40, 1, 1e6, "mean lifetime, in operations"}, {"ops", 3000, 1, 1e7, "operations per step"},
        {"streams", 3, 1, 64, "streams"}, {"live_gib", 16, 0.001, 1e4, "a cap on live bytes, GiB (not a target)"},
        {"steps", 4, 1, 100000, "steps"}, {"seed", 1, 0, 1e15, "random seed"}},
       random_pattern},
      {"rl", "reinforcement learning of an LLM in bf16 (GRPO/PPO): rollouts whose KV cache grows a token at a time, "
             "scoring of the completions, training with gradients and optimizer state made lazily; lengths vary per step",
       {{"layers", 16, 1, 1000, "layers"}, {"d_model", 2048, 8, 65536, "model width"},
        {"d_ff", 5632, 1, 262144, "MLP width (gated)"}, {"vocab", 32000, 1, 262144, "vocabulary"},
        {"prompts", 8, 1, 1024, "prompts per step"}, {"group", 4, 1, 64, "responses per prompt"},
        {"max_new", 256, 1, 16384, "longest response"}, {"micro", 4, 1, 1024, "sequences per micro-batch"},
        {"ref", 1, 0, 1, "1: a reference model scores too"}, {"static_kv", 0, 0, 1, "1: a KV cache allocated once"},
        {"empty_cache", 0, 0, 1, "1: empty_cache between phases"}, {"steps", 3, 1, 100000, "steps"},
        {"seed", 1, 0, 1e15, "random seed"}},
       rl},
  };
  return g;
}

const Generator* find_generator(const std::string& name) {
  for (const auto& g : generators())
    if (name == g.name) return &g;
  return nullptr;
}

// The keys a generator reads as real numbers (D()); every other key is a count or a seed, an integer.
bool is_real_key(const std::string& key) {
  for (const char* k : {"arrival", "jitter", "lifetime", "live_gib", "min_bytes", "res", "skew", "tokens"})
    if (key == k) return true;
  return false;
}

// A key's value as its help and errors write it: a whole number in full (a seed's range is [0, 1000000000000000],
// as the parser takes it, not 1e+15), any other in the shortest form that reads back.
std::string number_text(double x) {
  char b[40];
  if (x == std::floor(x) && std::fabs(x) < 9e15) std::snprintf(b, sizeof b, "%lld", static_cast<long long>(x));
  else std::snprintf(b, sizeof b, "%.15g", x);
  return b;
}

// Keys bounded by another key of the same generator: `key` < `bound` (a pipeline's rank is one of its stages).
struct KeyBelow { const char* gen; const char* key; const char* bound; };
constexpr KeyBelow kKeysBelow[] = {{"pipeline", "rank", "stages"}};

// The error for a key `gen` does not have, naming the keys it has.
std::string unknown_key(const std::string& name, const Generator& gen, const std::string& key) {
  std::string names;
  for (const auto& k : gen.keys) names += std::string(names.empty() ? "" : ", ") + k.name;
  return "workload " + name + ": unknown key '" + key + "' (keys: " + names + ")";
}

}  // namespace

bool is_zoo_workload(const std::string& name) { return find_generator(name) != nullptr; }

std::string zoo_help() {
  std::string out;
  for (const auto& g : generators()) {
    // The description, wrapped at 110 columns like the keys below it.
    std::string line = "  " + std::string(g.name) + ":", word;
    std::istringstream words(g.what);
    while (words >> word) {
      if (line.size() + 1 + word.size() > 110) {
        out += line + "\n";
        line = "   ";
      }
      line += " " + word;
    }
    out += line + "\n    keys (default [range]):";
    std::size_t col = 26;
    for (std::size_t i = 0; i < g.keys.size(); ++i) {
      const Key& key = g.keys[i];
      std::ostringstream v;
      v << ' ' << key.name << '=' << number_text(key.def) << " [" << number_text(key.lo) << ", " << number_text(key.hi)
        << ']' << (i + 1 < g.keys.size() ? "," : "");
      if (col + v.str().size() > 110) {
        out += "\n     ";
        col = 5;
      }
      out += v.str();
      col += v.str().size();
    }
    out += "\n";
  }
  return out;
}

std::vector<std::string> zoo_names() {
  std::vector<std::string> n;
  for (const auto& g : generators()) n.push_back(g.name);
  return n;
}

bool zoo_key_range(const std::string& name, const std::string& key, double* lo, double* hi, std::string* error,
                   const std::string& options) {
  const Generator* gen = find_generator(name);
  if (!gen) {
    *error = "unknown workload '" + name + "'";
    return false;
  }
  // The value `other` has in `options`, else its default.
  auto value_of = [&](const char* other) {
    double v = 0;
    for (const auto& k : gen->keys)
      if (std::string(k.name) == other) v = k.def;
    std::stringstream kv(options);
    std::string item;
    while (std::getline(kv, item, ','))
      if (item.rfind(std::string(other) + "=", 0) == 0) v = std::strtod(item.c_str() + std::strlen(other) + 1, nullptr);
    return v;
  };
  std::string searchable;  // the keys with whole values to search between
  for (const auto& k : gen->keys) {
    if (key == k.name) {
      *lo = k.lo;
      *hi = k.hi;
      for (const KeyBelow& b : kKeysBelow)
        if (name == b.gen && key == b.bound) *lo = std::max(*lo, value_of(b.key) + 1);
        else if (name == b.gen && key == b.key) *hi = std::min(*hi, value_of(b.bound) - 1);
      return true;
    }
    if (std::floor(k.hi) > std::ceil(k.lo)) searchable += std::string(searchable.empty() ? "" : ", ") + k.name;
  }
  *error = "workload " + name + " has no key '" + key + "' to search" +
           (key == "batch" ? " (--max-batch searches batch)" : "") + "; --max-of KEY searches one of its keys: " +
           searchable;
  return false;
}

bool make_zoo_workload(const std::string& name, const std::string& options, formats::Trace* out,
                       std::string* error, bool* too_large) {
  const Generator* gen = find_generator(name);
  if (!gen) {
    *error = "unknown workload '" + name + "'";
    return false;
  }
  std::map<std::string, double> values;
  for (const auto& key : gen->keys) values[key.name] = key.def;
  std::stringstream kv(options);
  std::string item;
  std::vector<std::string> given;
  if (has_empty_item(options)) {
    *error = "workload " + name + ": an empty item in '" + options + "' (a ',' too many)";
    return false;
  }
  while (std::getline(kv, item, ',')) {
    const auto eq = item.find('=');
    const std::string key = item.substr(0, eq);
    if (std::find(given.begin(), given.end(), key) != given.end()) {
      *error = "workload " + name + ": key " + key + " is given twice in '" + options + "': give each key once";
      return false;
    }
    given.push_back(key);
    const Key* spec = nullptr;
    for (const auto& k : gen->keys)
      if (key == k.name) spec = &k;
    if (!spec) {
      *error = unknown_key(name, *gen, key);
      return false;
    }
    if (eq == std::string::npos) {
      *error = "workload " + name + ": option '" + item + "' is not key=value";
      return false;
    }
    const std::string v = item.substr(eq + 1);
    // The keys the generators read as counts are integers, written as such ('1.5', '0x10', ' 5' are refused,
    // not truncated); the others are decimal numbers, without spaces or a hexadecimal form.
    const bool integral = !is_real_key(key);
    long long whole = 0;
    char* end = nullptr;
    const double x = integral ? (integer_text(v, &whole) ? static_cast<double>(whole) : NAN)
                              : v.find_first_not_of("0123456789.eE+-") == std::string::npos
                                  ? std::strtod(v.c_str(), &end)
                                  : NAN;
    if (v.empty() || (end && *end) || !std::isfinite(x) || x < spec->lo || x > spec->hi) {
      std::ostringstream r;
      r << "workload " << name << ": " << key << "='" << v << "' is not " << (integral ? "an integer" : "a number")
        << " in [" << number_text(spec->lo) << ", " << number_text(spec->hi) << "]";
      *error = r.str();
      return false;
    }
    values[key] = x;
  }
  for (const KeyBelow& b : kKeysBelow)
    if (name == b.gen && values[b.key] >= values[b.bound]) {
      *error = "workload " + name + ": " + b.key + "=" + number_text(values[b.key]) + " is not one of its " + b.bound +
               "=" + number_text(values[b.bound]) + " (" + b.key + " counts " + b.bound + " from 0)";
      return false;
    }
  // random draws a size for every operation of every step, one its live_gib cap skips included
  // (kMaxWorkloadDraws: ops=10000000,steps=100000 made few events and ran for hours).
  if (name == "random" && values["ops"] * values["steps"] > kMaxWorkloadDraws) {
    *error = "workload:" + name + ":" + options + ": ops x steps = " + number_text(values["ops"] * values["steps"]) +
             " operations, more than " + number_text(kMaxWorkloadDraws) +
             " (each is drawn, even one the live_gib cap skips); give fewer ops or steps";
    if (too_large) *too_large = true;
    return false;
  }
  *out = formats::Trace{};
  out->source = "workload:" + name + (options.empty() ? "" : ":" + options);
  Emit em(out, static_cast<u64>(values["seed"]));
  const std::string spec = out->source;
  return generate_bounded(spec, out, error, too_large, [&] { gen->run(values, em); });
}

}  // namespace fragless::replay
