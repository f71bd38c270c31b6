# `cmake --install build --prefix P`: the public headers, the libraries and a CMake package, so that a
# project outside this tree does
#   find_package(fragless CONFIG REQUIRED)          # with CMAKE_PREFIX_PATH=P
#   target_link_libraries(app PRIVATE fragless::core)
# Targets: fragless::core (the engine, static), fragless::capi (libfragless.so, the C ABI of fragless.h),
# fragless::torch (the LibTorch CPU adapter, torch_cpu.h; when LibTorch was found) and fragless::torch_cuda
# (fragless::torch::install(), torch_cuda.h; when LibTorch has CUDA). Include directories and dependencies
# come with the targets; the package finds Threads and, with fragless::torch, Torch itself.
# libfragless_preload.so is installed beside them for LD_PRELOAD.
include(GNUInstallDirs)
include(CMakePackageConfigHelpers)

set(FRAGLESS_CMAKE_DIR "${CMAKE_INSTALL_LIBDIR}/cmake/fragless")
set(exported fragless_core)
set_target_properties(fragless_core PROPERTIES EXPORT_NAME core)
if(TARGET fragless)
  list(APPEND exported fragless)
  set_target_properties(fragless PROPERTIES EXPORT_NAME capi)
  install(TARGETS fragless_preload LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR})
  install(FILES torch_plugin/include/fragless/fragless.h torch_plugin/include/fragless/torch_cpu.h
                torch_plugin/include/fragless/torch_cuda.h
          DESTINATION ${CMAKE_INSTALL_INCLUDEDIR}/fragless)
endif()
set(FRAGLESS_PACKAGE_TORCH OFF)
if(TARGET fragless_torch_cpu)
  list(APPEND exported fragless_torch_cpu)
  set_target_properties(fragless_torch_cpu PROPERTIES EXPORT_NAME torch)
  set(FRAGLESS_PACKAGE_TORCH ON)
endif()
if(TARGET fragless_torch)
  list(APPEND exported fragless_torch)
  set_target_properties(fragless_torch PROPERTIES EXPORT_NAME torch_cuda)
endif()
install(TARGETS ${exported} EXPORT fragless-targets
        ARCHIVE DESTINATION ${CMAKE_INSTALL_LIBDIR}
        LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR}
        INCLUDES DESTINATION ${CMAKE_INSTALL_INCLUDEDIR})
install(DIRECTORY allocator/include/fragless DESTINATION ${CMAKE_INSTALL_INCLUDEDIR})
install(EXPORT fragless-targets NAMESPACE fragless:: DESTINATION ${FRAGLESS_CMAKE_DIR})
configure_package_config_file(cmake/fragless-config.cmake.in "${CMAKE_BINARY_DIR}/fragless-config.cmake"
                              INSTALL_DESTINATION ${FRAGLESS_CMAKE_DIR})
write_basic_package_version_file("${CMAKE_BINARY_DIR}/fragless-config-version.cmake" COMPATIBILITY SameMinorVersion)
install(FILES "${CMAKE_BINARY_DIR}/fragless-config.cmake" "${CMAKE_BINARY_DIR}/fragless-config-version.cmake"
        DESTINATION ${FRAGLESS_CMAKE_DIR})
