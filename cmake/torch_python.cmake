# Note [The Python that imports torch]
# The OOM thrower, the CPU-allocator probe and the tests that run PyTorch need an interpreter that imports
# torch, and the python3 first on PATH may not have it (a pyenv or virtual environment's), while Debian's
# system interpreter has Debian's torch (python3-torch). FRAGLESS_TORCH_PYTHON names one; left empty, the
# first of the Python3 CMake finds and /usr/bin/python3 that imports torch is taken. The choice is printed
# here, and each test that runs PyTorch prints the interpreter and torch it ran. Sets:
#   FRAGLESS_TORCH_INTERPRETER  the interpreter ("" when none imports torch)
#   FRAGLESS_TORCH_VERSION, FRAGLESS_TORCH_CXX11_ABI, FRAGLESS_TORCH_INCLUDE, FRAGLESS_TORCH_LIBDIR
#   FRAGLESS_TORCH_HEADERS      whether that torch ships its C++ headers (c10/util/Exception.h)
set(FRAGLESS_TORCH_PYTHON "" CACHE FILEPATH "A Python interpreter that imports torch (empty: the first that does)")

set(FRAGLESS_TORCH_INTERPRETER "")
set(FRAGLESS_TORCH_HEADERS OFF)
if(FRAGLESS_TORCH_PYTHON)
  set(candidates "${FRAGLESS_TORCH_PYTHON}")
else()
  find_package(Python3 COMPONENTS Interpreter QUIET)
  set(candidates ${Python3_EXECUTABLE} /usr/bin/python3)
endif()
foreach(py IN LISTS candidates)
  if(NOT FRAGLESS_TORCH_INTERPRETER AND EXISTS "${py}")
    execute_process(
      COMMAND "${py}" -c "import os, torch; r = os.path.dirname(os.path.abspath(torch.__file__)); print(torch.__version__); print(int(getattr(torch._C, '_GLIBCXX_USE_CXX11_ABI', 1))); print(os.path.join(r, 'include')); print(os.path.join(r, 'lib'))"
      RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_QUIET OUTPUT_STRIP_TRAILING_WHITESPACE)
    if(rc EQUAL 0)
      string(REPLACE "\n" ";" out "${out}")
      list(GET out 0 FRAGLESS_TORCH_VERSION)
      list(GET out 1 FRAGLESS_TORCH_CXX11_ABI)
      list(GET out 2 FRAGLESS_TORCH_INCLUDE)
      list(GET out 3 FRAGLESS_TORCH_LIBDIR)
      set(FRAGLESS_TORCH_INTERPRETER "${py}")
    endif()
  endif()
endforeach()
if(FRAGLESS_TORCH_INTERPRETER)
  if(EXISTS "${FRAGLESS_TORCH_INCLUDE}/c10/util/Exception.h")
    set(FRAGLESS_TORCH_HEADERS ON)
  endif()
  message(STATUS "fragless: ${FRAGLESS_TORCH_INTERPRETER} imports torch ${FRAGLESS_TORCH_VERSION} (C++ headers: ${FRAGLESS_TORCH_HEADERS})")
elseif(FRAGLESS_TORCH_PYTHON)
  message(WARNING "fragless: FRAGLESS_TORCH_PYTHON=${FRAGLESS_TORCH_PYTHON} does not import torch: no OOM thrower, and the PyTorch tests report skipped")
else()
  message(STATUS "fragless: no Python here imports torch (tried: ${candidates}); the PyTorch tests report skipped")
endif()
