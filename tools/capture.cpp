// fragless-capture: trains a small decoder-only transformer with LibTorch on the CPU over batches of
// variable-length sequences, with fragless installed as LibTorch's CPU allocator (host driver) and,
// with --trace, the tracer on: a real allocation trace from a real model, and the losses to compare with
// LibTorch's own allocator (--allocator default) bit for bit.
//
//   fragless-capture [--allocator fragless|default] [--policy classic|expandable|fragless]
//                    [--trace PATH] [--steps N] [--epochs E] [--seed S] [--layers L] [--d-model D]
//                    [--heads H] [--batch B] [--min-len N] [--max-len N] [--vocab V]
#include <torch/torch.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <string>

#include "fragless/config.h"
#include "fragless/torch_cpu.h"

namespace {

struct BlockImpl : torch::nn::Module {
  torch::nn::LayerNorm ln1{nullptr}, ln2{nullptr};
  torch::nn::Linear qkv{nullptr}, proj{nullptr}, fc1{nullptr}, fc2{nullptr};
  std::int64_t heads;
  BlockImpl(std::int64_t d, std::int64_t h) : heads(h) {
    ln1 = register_module("ln1", torch::nn::LayerNorm(torch::nn::LayerNormOptions({d})));
    ln2 = register_module("ln2", torch::nn::LayerNorm(torch::nn::LayerNormOptions({d})));
    qkv = register_module("qkv", torch::nn::Linear(d, 3 * d));
    proj = register_module("proj", torch::nn::Linear(d, d));
    fc1 = register_module("fc1", torch::nn::Linear(d, 4 * d));
    fc2 = register_module("fc2", torch::nn::Linear(4 * d, d));
  }
  torch::Tensor forward(torch::Tensor x) {
    const auto B = x.size(0), S = x.size(1), D = x.size(2), hd = D / heads;
    auto q = qkv(ln1(x)).view({B, S, 3, heads, hd}).permute({2, 0, 3, 1, 4});
    auto att = torch::matmul(q[0], q[1].transpose(-2, -1)) / std::sqrt(static_cast<double>(hd));
    auto causal = torch::ones({S, S}, torch::kBool).triu(1);
    att = torch::softmax(att.masked_fill(causal, -1e9), -1);
    auto y = torch::matmul(att, q[2]).transpose(1, 2).reshape({B, S, D});
    x = x + proj(y);
    return x + fc2(torch::gelu(fc1(ln2(x))));
  }
};
TORCH_MODULE(Block);

struct ModelImpl : torch::nn::Module {
  torch::nn::Embedding tok{nullptr}, pos{nullptr};
  torch::nn::ModuleList blocks;
  torch::nn::LayerNorm lnf{nullptr};
  torch::nn::Linear head{nullptr};
  ModelImpl(std::int64_t vocab, std::int64_t d, std::int64_t layers, std::int64_t heads, std::int64_t max_len) {
    tok = register_module("tok", torch::nn::Embedding(vocab, d));
    pos = register_module("pos", torch::nn::Embedding(max_len, d));
    blocks = register_module("blocks", torch::nn::ModuleList());
    for (std::int64_t l = 0; l < layers; ++l) blocks->push_back(Block(d, heads));
    lnf = register_module("lnf", torch::nn::LayerNorm(torch::nn::LayerNormOptions({d})));
    head = register_module("head", torch::nn::Linear(d, vocab));
  }
  torch::Tensor forward(torch::Tensor idx) {
    auto x = tok(idx) + pos(torch::arange(idx.size(1)));
    for (auto& b : *blocks) x = b->as<Block>()->forward(x);
    return head(lnf(x));
  }
};
TORCH_MODULE(Model);

int usage(const char* msg) {
  if (msg) std::fprintf(stderr, "fragless-capture: %s\n", msg);
  std::fprintf(msg ? stderr : stdout,
               "usage: fragless-capture [--allocator fragless|default] [--policy classic|expandable|fragless]\n"
               "         [--trace PATH] [--steps N] [--epochs E] [--seed S] [--layers L] [--d-model D] [--heads H]\n"
               "         [--batch B] [--min-len N] [--max-len N] [--vocab V]\n"
               "  trains a small decoder-only transformer on the CPU over batches of variable-length sequences\n"
               "  --allocator: fragless (LibTorch's CPU allocator replaced, host driver) or default (LibTorch's own)\n"
               "  --policy: the fragless policy (default fragless); only with --allocator fragless\n"
               "  --trace: record every allocation event to PATH (fragless native format); only with --allocator\n"
               "           fragless\n"
               "  --steps: optimizer steps per epoch (default 20); --epochs: epochs (default 3), the cache\n"
               "           emptied between them; the run makes steps x epochs steps in all\n"
               "  --batch: sequences per step (4); --min-len/--max-len: lengths drawn uniformly in [8, 96], each\n"
               "           batch padded to its longest (the padding ignored by the loss)\n"
               "  --seed (1), --layers (2), --d-model (64), --heads (4), --vocab (256): the model and data\n"
               "  prints one line per step (step, padded length, loss in hex float), to compare runs bit for bit\n");
  return msg ? 2 : 0;
}

}  // namespace

int main(int argc, char** argv) {
  std::string allocator = "fragless", policy = "fragless", trace;
  bool policy_given = false;
  long steps = 20, epochs = 3, seed = 1, layers = 2, d_model = 64, heads = 4, batch = 4, min_len = 8, max_len = 96,
       vocab = 256;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "-h" || a == "--help") return usage(nullptr);
    if (i + 1 >= argc) return usage(("missing value after " + a).c_str());
    const std::string v = argv[++i];
    auto num = [&](long* out) {
      char* end = nullptr;
      *out = std::strtol(v.c_str(), &end, 10);
      return !v.empty() && !*end && *out >= 0 && *out <= 1'000'000;
    };
    bool ok = true;
    if (a == "--allocator") ok = (allocator = v) == "fragless" || v == "default";
    else if (a == "--policy") {
      policy_given = true;
      ok = fragless::policy_from_name(policy = v).has_value();
    }
    else if (a == "--trace") ok = !(trace = v).empty();
    else if (a == "--steps") ok = num(&steps);
    else if (a == "--epochs") ok = num(&epochs);
    else if (a == "--seed") ok = num(&seed);
    else if (a == "--layers") ok = num(&layers);
    else if (a == "--d-model") ok = num(&d_model);
    else if (a == "--heads") ok = num(&heads);
    else if (a == "--batch") ok = num(&batch);
    else if (a == "--min-len") ok = num(&min_len);
    else if (a == "--max-len") ok = num(&max_len);
    else if (a == "--vocab") ok = num(&vocab);
    else return usage(("unknown option " + a).c_str());
    if (!ok) return usage(("bad value '" + v + "' for " + a).c_str());
  }
  // Each rule broken is named with the values given (the first one found).
  const std::string why =
      heads < 1 ? "--heads " + std::to_string(heads) + ": the model needs at least one head"
      : d_model < 1 || d_model % heads ? "--d-model " + std::to_string(d_model) + " is not a positive multiple of --heads " +
                                             std::to_string(heads) + " (each head gets d-model / heads dimensions)"
      : min_len < 2 ? "--min-len " + std::to_string(min_len) + ": a sequence needs at least 2 tokens (one to predict)"
      : max_len < min_len ? "--max-len " + std::to_string(max_len) + " is below --min-len " + std::to_string(min_len)
      : vocab < 2 ? "--vocab " + std::to_string(vocab) + ": at least 2 tokens"
      : batch < 1 ? "--batch " + std::to_string(batch) + ": at least one sequence a step"
      : steps < 1 ? "--steps " + std::to_string(steps) + ": at least one step an epoch (0 would train nothing)"
      : epochs < 1 ? "--epochs " + std::to_string(epochs) + ": at least one epoch (0 would train nothing)"
                   : "";
  if (!why.empty()) return std::fprintf(stderr, "fragless-capture: %s\n", why.c_str()), 2;
  // LibTorch's own allocator has no policy and no tracer: asking for either with it is a mistake, not a no-op.
  if (allocator == "default" && (policy_given || !trace.empty()))
    return usage(!trace.empty() ? "--trace needs --allocator fragless (LibTorch's own allocator records nothing)"
                                : "--policy needs --allocator fragless (LibTorch's own allocator has no policy)");
  if (allocator == "fragless") {
    std::string conf = "policy:" + policy + ",capacity_mb:8192";
    if (!trace.empty()) conf += ",trace:" + trace;
    std::string err;
    if (!fragless::torch::install_cpu_allocator(conf, &err)) return std::fprintf(stderr, "fragless-capture: %s\n", err.c_str()), 2;
  }
  at::set_num_threads(1);  // one thread: the same reduction order in every run
  torch::manual_seed(static_cast<std::uint64_t>(seed));
  Model model(vocab, d_model, layers, heads, max_len);
  torch::optim::AdamW opt(model->parameters(), torch::optim::AdamWOptions(1e-3).weight_decay(0.01));
  std::mt19937_64 rng(static_cast<std::uint64_t>(seed));
  std::uniform_int_distribution<long> len(min_len, max_len);
  long step = 0;
  for (long e = 0; e < epochs; ++e) {
    for (long s = 0; s < steps; ++s, ++step) {
      // A batch of variable-length sequences padded to the longest; padding is ignored by the loss.
      std::vector<long> lens(static_cast<std::size_t>(batch));
      long S = 0;
      for (auto& l : lens) S = std::max(S, l = len(rng));
      auto tokens = torch::randint(vocab, {batch, S + 1}, torch::kLong);
      auto target = tokens.slice(1, 1).clone();
      for (long b = 0; b < batch; ++b)
        if (lens[static_cast<std::size_t>(b)] < S) target[b].slice(0, lens[static_cast<std::size_t>(b)]).fill_(-100);
      auto logits = model->forward(tokens.slice(1, 0, S));
      auto loss = torch::nn::functional::cross_entropy(
          logits.reshape({-1, vocab}), target.reshape({-1}),
          torch::nn::functional::CrossEntropyFuncOptions().ignore_index(-100));
      opt.zero_grad();
      loss.backward();
      opt.step();
      std::printf("step %ld len %ld loss %a\n", step, S, loss.item<float>());
    }
    if (auto* eng = fragless::torch::cpu_engine()) eng->empty_cache();  // between epochs
  }
  if (auto* eng = fragless::torch::cpu_engine()) {
    const auto st = eng->stats();
    std::fprintf(stderr, "fragless-capture: policy %s, peak live %.1f MiB, peak reserved %.1f MiB, %lld allocations\n",
                 policy.c_str(), static_cast<double>(st.live_bytes.peak) / (1 << 20),
                 static_cast<double>(st.reserved_bytes.all().peak) / (1 << 20),
                 static_cast<long long>(st.allocation.all().allocated));
    // The allocator says at exit how many records were lost and why (once, with the final count).
    if (!fragless::torch::flush_cpu_trace().empty()) {
      std::fprintf(stderr, "fragless-capture: the trace is incomplete\n");
      return 1;
    }
  }
  return 0;
}
