// The pattern zoo: built-in workloads beyond the transformer ones, each a parameterised generator of the
// allocation pattern of a kind of job (vision U-Nets, mixture of experts, LLM serving, sharded data
// parallel, pipeline parallel, random). Every one repeats its step with shapes that change from step to
// step, so a policy is measured on patterns nobody tuned it for. Spec: workload:NAME[:key=value,...].
#pragma once
#include <string>
#include <vector>

#include "trace_model.h"

namespace fragless::replay {

bool is_zoo_workload(const std::string& name);
std::vector<std::string> zoo_names();
// One paragraph per generator: what it models and its keys with their defaults (for --help).
std::string zoo_help();
// `options` is the part after "NAME:" (may be empty). False with *error naming the key and the accepted
// range on a bad option.
// The accepted range of one key of a generator; false with *error (naming the keys) on an unknown key.
// `options`: the spec's other keys (key=value,...), where a key's range depends on them (a pipeline's rank is
// below its stages).
bool zoo_key_range(const std::string& name, const std::string& key, double* lo, double* hi, std::string* error,
                   const std::string& options = "");
// *too_large (if given): generation stopped past kMaxWorkloadEvents or out of host memory (workload.h).
bool make_zoo_workload(const std::string& name, const std::string& options, formats::Trace* out, std::string* error,
                       bool* too_large = nullptr);

}  // namespace fragless::replay
