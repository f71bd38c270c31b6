// Checks for the tests that run as two processes (tests/share, tests/preload): a failed check says which
// side failed it and where, and counts; REQUIRE ends the process.
#pragma once
#include <cstdio>
#include <cstdlib>

namespace process_checks {

inline int failures = 0;
inline const char* role = "exporter";             // which side this process is
inline const char* (*detail)() = nullptr;          // more to say about a failure (the library's last error)

// Evaluates its condition once (it may receive a message).
inline bool check(bool ok, const char* what, int line) {
  if (!ok) {
    if (detail) std::fprintf(stderr, "[%s] FAILED line %d: %s (last error: %s)\n", role, line, what, detail());
    else std::fprintf(stderr, "[%s] FAILED line %d: %s\n", role, line, what);
    ++failures;
  }
  return ok;
}

}  // namespace process_checks

#define CHECK(cond) process_checks::check(static_cast<bool>(cond), #cond, __LINE__)
#define REQUIRE(cond)                                                                   \
  do {                                                                                  \
    if (!process_checks::check(static_cast<bool>(cond), #cond, __LINE__)) std::exit(1); \
  } while (0)
