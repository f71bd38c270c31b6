// Built-in workloads: the allocation sequence of decoder-only transformer training and inference steps
// over batches of variable-length sequences, so the replay runs with no input file at all.
#pragma once
#include <string>

#include "trace_model.h"

namespace fragless::replay {

// spec: "workload:NAME[:key=value,...]", NAME = transformer-train | transformer-infer. Keys: layers,
// d_model, heads, d_ff, vocab, batch, steps, seqlen (sharegpt | azure-conv | azure-code | arxiv | fixed:N),
// max_seq, dtype (fp32 | bf16), ckpt (0 | 1), seed. Returns false with *error on a bad spec.
bool make_workload(const std::string& spec, formats::Trace* out, std::string* error);

}  // namespace fragless::replay
