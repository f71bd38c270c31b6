"""The Python package: `pip install --no-build-isolation .` (README, "Installing").

Builds libfragless.so, libfragless_preload.so and, when the interpreter running the build imports a PyTorch
with its C++ headers, the OOM thrower (libfragless_torch_oom.so, built against that PyTorch), with CMake, and
puts them inside the `fragless` package next to its Python files, with fragless_build.json saying what was
built. Environment: CMAKE_ARGS (more CMake arguments), CMAKE_BUILD_PARALLEL_LEVEL (jobs),
FRAGLESS_PIP_BUILD_DIR (where CMake and setuptools build; default build-pip/ in the source tree).
"""
import json
import os
import re
import shlex
import shutil
import subprocess
import sys

from setuptools import setup
from setuptools.command.build_py import build_py
from setuptools.dist import Distribution

ROOT = os.path.dirname(os.path.abspath(__file__))
BUILD = os.path.abspath(os.environ.get("FRAGLESS_PIP_BUILD_DIR") or os.path.join(ROOT, "build-pip"))
# What CMake's fragless_python target leaves in its lib/ folder for the package (fragless_build.json lists
# which of the optional ones were built).
LIBRARIES = ["libfragless.so", "libfragless_preload.so", "libfragless_torch_oom.so"]


def version():
    with open(os.path.join(ROOT, "CMakeLists.txt")) as f:
        m = re.search(r"project\(fragless VERSION ([0-9.]+)", f.read())
    if not m:
        raise RuntimeError("fragless: no 'project(fragless VERSION x.y.z' in CMakeLists.txt")
    return m.group(1)


class Platform(Distribution):
    """A wheel with shared libraries in it is for one platform and one Python, not pure."""

    def has_ext_modules(self):
        return True


class BuildWithCMake(build_py):
    def run(self):
        super().run()
        cmake = shutil.which("cmake")
        if not cmake:
            raise RuntimeError("fragless: building needs CMake and a C++ compiler (Debian: apt-get install cmake g++)")
        tree = os.path.join(BUILD, "cmake")
        args = [cmake, "-S", ROOT, "-B", tree, "-DCMAKE_BUILD_TYPE=Release", "-DFRAGLESS_BUILD_TESTS=OFF",
                "-DFRAGLESS_BUILD_BENCH=OFF", "-DCMAKE_DISABLE_FIND_PACKAGE_Torch=ON",
                "-DFRAGLESS_TORCH_PYTHON=" + sys.executable] + shlex.split(os.environ.get("CMAKE_ARGS", ""))
        subprocess.check_call(args)
        jobs = os.environ.get("CMAKE_BUILD_PARALLEL_LEVEL") or str(os.cpu_count() or 2)
        subprocess.check_call([cmake, "--build", tree, "-j", jobs, "--target", "fragless_python"])
        lib = os.path.join(tree, "lib")
        with open(os.path.join(lib, "fragless_build.json")) as f:
            built = json.load(f)
        dest = os.path.join(self.build_lib, "fragless")
        os.makedirs(dest, exist_ok=True)
        for name in LIBRARIES + ["fragless_build.json"]:
            if os.path.exists(os.path.join(lib, name)):
                shutil.copy2(os.path.join(lib, name), os.path.join(dest, name))
        oom = built["torch_oom"]
        if oom["built"]:
            print("fragless: OOM thrower built for PyTorch %s" % oom["torch"])
        else:
            print("fragless: WARNING: no OOM thrower in this package (%s); out of memory will be a RuntimeError "
                  "unless a C++ compiler and PyTorch's headers are there at run time" % oom["reason"])
        if not built["cuda_driver"]:
            print("fragless: WARNING: built without the CUDA headers, so without the cuda driver: only "
                  "driver:host and driver:sim will work")


setup(
    version=version(),
    distclass=Platform,
    cmdclass={"build_py": BuildWithCMake},
    options={"build": {"build_base": os.path.join(BUILD, "setuptools")},
             "egg_info": {"egg_base": BUILD}},
)
