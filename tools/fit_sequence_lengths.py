#!/usr/bin/env python3
"""Fits the log-normal sequence-length parameters shipped in bench/replay/workload.cpp.

Usage: python3 tools/fit_sequence_lengths.py ../shared/data/seqlen
Prints mu and sigma of log(total tokens) and the observed range for each distribution.
"""
import csv
import math
import statistics
import sys
from pathlib import Path


def fit(name, values):
    values = [v for v in values if v > 0]
    logs = [math.log(v) for v in values]
    print(f"{name}: n={len(values)} mu={statistics.mean(logs):.4f} sigma={statistics.pstdev(logs):.4f} "
          f"min={min(values)} max={max(values)}")


def column_sum(path, *cols):
    with open(path) as f:
        return [sum(int(r[c]) for c in cols) for r in csv.DictReader(f)]


def main(root):
    d = Path(root)
    fit("sharegpt", column_sum(d / "sarathi_sharegpt_8k_filtered_stats_llama2_tokenizer.csv", "num_total_tokens"))
    fit("azure-conv", column_sum(d / "AzureLLMInferenceTrace_conv_2023.csv", "ContextTokens", "GeneratedTokens"))
    fit("azure-code", column_sum(d / "AzureLLMInferenceTrace_code_2023.csv", "ContextTokens", "GeneratedTokens"))
    fit("arxiv", column_sum(d / "vidur_arxiv_summarization_stats_llama2_tokenizer_filtered_v2.csv", "num_total_tokens"))


if __name__ == "__main__":
    if len(sys.argv) == 2 and sys.argv[1] in ("-h", "--help"):
        print(__doc__.strip())
        sys.exit(0)
    if len(sys.argv) > 2:
        sys.exit(__doc__.strip())
    root = Path(sys.argv[1] if len(sys.argv) > 1 else "../shared/data/seqlen")
    if not root.is_dir():
        sys.exit(f"fit_sequence_lengths: {root} is not a directory (the sequence-length CSVs, e.g. ../shared/data/seqlen)")
    try:
        main(root)
    except BrokenPipeError:
        sys.exit(0)
    except (OSError, KeyError, ValueError) as e:
        sys.exit(f"fit_sequence_lengths: cannot read the CSVs under {root}: {e!r}")
