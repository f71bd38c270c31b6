// Built with the package against the PyTorch of the build (python/CMakeLists.txt), or by fragless.torch at run
// time into its cache when the installed one does not match the PyTorch it runs in (its headers, its libc10,
// its C++ ABI):
// throws c10::OutOfMemoryError, which PyTorch's bindings raise as torch.cuda.OutOfMemoryError. libfragless.so
// calls it through fragless_set_oom_thrower when memory runs out.
#include <c10/util/Exception.h>

#include <string>

extern "C" __attribute__((visibility("default"))) void fragless_throw_torch_oom(const char* message) {
  throw c10::OutOfMemoryError(c10::SourceLocation{"fragless_malloc", __FILE__, static_cast<uint32_t>(__LINE__)},
                              std::string(message));
}
