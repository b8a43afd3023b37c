# SPDX-License-Identifier: MIT
# Install rules and the CMake package: `cmake --install <build> --prefix P` lays out
#   P/lib/libweft.a (or .so)                 the library, P's path written into it (weft-install-prefix)
#   P/include/weft/...                       the public headers, the device layer included
#   P/share/weft/kernels/<family>/...        the kernel templates the JIT compiles (+ kernels/ep/aot_specs.txt)
#   P/share/weft/weft_gin_device_sm90a.fatbin  the GIN device library (when the GIN backend is built)
#   P/bin/weftrun, weft-compile, weft-info   the tools (when built)
#   P/lib/cmake/weft/                        weftConfig.cmake, weftConfigVersion.cmake, weftTargets.cmake
# include/ and share/weft/kernels/ are fixed names: the JIT looks for exactly them (src/jit/paths.cpp).
include(GNUInstallDirs)
include(CMakePackageConfigHelpers)

set(WEFT_INSTALL_CMAKEDIR ${CMAKE_INSTALL_LIBDIR}/cmake/weft)
set(WEFT_INSTALL_INCLUDEDIR include)
set(WEFT_INSTALL_KERNELSDIR share/weft/kernels)

install(TARGETS weft EXPORT weftTargets
        ARCHIVE DESTINATION ${CMAKE_INSTALL_LIBDIR}
        LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR}
        RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR})
# Without the GIN backend its header would declare functions the library does not define.
set(weft_header_excludes)
if(NOT WEFT_HAVE_NCCL_GIN)
  set(weft_header_excludes REGEX "/net/gin\\.hpp$" EXCLUDE)
endif()
install(DIRECTORY ${PROJECT_SOURCE_DIR}/include/weft DESTINATION ${WEFT_INSTALL_INCLUDEDIR}
        FILES_MATCHING PATTERN "*.hpp" PATTERN "*.cuh" PATTERN "*.h" ${weft_header_excludes})
if(WEFT_HAVE_NCCL_GIN)
  # The GIN device library JIT kernels link (weft::net::GinBackend::device_library() looks in P/share/weft/).
  install(FILES ${CMAKE_BINARY_DIR}/lib/weft_gin_device_sm90a.fatbin DESTINATION share/weft)
endif()
install(DIRECTORY ${PROJECT_SOURCE_DIR}/kernels/ DESTINATION ${WEFT_INSTALL_KERNELSDIR}
        FILES_MATCHING PATTERN "*.cuh" PATTERN "*.hpp" PATTERN "*.h" PATTERN "*.txt")

# The tools that link weft find the toolkit's libraries where they were linked from, and libweft.so beside them.
foreach(tool weftrun weft-compile weft-info)
  if(TARGET ${tool})
    if(NOT tool STREQUAL "weftrun")  # weftrun links nothing from CUDA or weft
      set_target_properties(${tool} PROPERTIES INSTALL_RPATH_USE_LINK_PATH ON)
      if(WEFT_BUILD_SHARED)
        set_target_properties(${tool} PROPERTIES INSTALL_RPATH "\$ORIGIN/../${CMAKE_INSTALL_LIBDIR}")
      endif()
    endif()
    install(TARGETS ${tool} EXPORT weftTargets RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR})
  endif()
endforeach()

# Write the prefix the install really goes to (`--prefix`, DESTDIR excluded) into the installed library: the
# JIT's last search root (weft/detail/install_prefix.hpp). Runs after the library is copied (and its RPATH set).
if(IS_ABSOLUTE "${CMAKE_INSTALL_LIBDIR}")
  set(weft_installed_libdir "${CMAKE_INSTALL_LIBDIR}")
else()
  set(weft_installed_libdir "\${CMAKE_INSTALL_PREFIX}/${CMAKE_INSTALL_LIBDIR}")
endif()
install(CODE "
  set(weft_installed_library \"\$ENV{DESTDIR}${weft_installed_libdir}/$<TARGET_FILE_NAME:weft>\")
  message(STATUS \"Writing the install prefix \${CMAKE_INSTALL_PREFIX} into \${weft_installed_library}\")
  execute_process(COMMAND \"$<TARGET_FILE:weft-install-prefix>\" \"\${weft_installed_library}\"
                          \"\${CMAKE_INSTALL_PREFIX}\" RESULT_VARIABLE weft_status)
  if(NOT weft_status EQUAL 0)
    message(FATAL_ERROR \"weft-install-prefix failed (\${weft_status}) on \${weft_installed_library}\")
  endif()
")

install(EXPORT weftTargets NAMESPACE weft:: DESTINATION ${WEFT_INSTALL_CMAKEDIR})
get_target_property(WEFT_LIBRARY_TYPE weft TYPE)
configure_package_config_file(${CMAKE_CURRENT_LIST_DIR}/weftConfig.cmake.in
                              ${CMAKE_CURRENT_BINARY_DIR}/weftConfig.cmake
                              INSTALL_DESTINATION ${WEFT_INSTALL_CMAKEDIR}
                              PATH_VARS WEFT_INSTALL_INCLUDEDIR WEFT_INSTALL_KERNELSDIR)
# Before 1.0 a minor version may change the API, so only the same major.minor is compatible.
if(PROJECT_VERSION_MAJOR EQUAL 0)
  set(weft_compatibility SameMinorVersion)
else()
  set(weft_compatibility SameMajorVersion)
endif()
write_basic_package_version_file(${CMAKE_CURRENT_BINARY_DIR}/weftConfigVersion.cmake
                                 VERSION ${PROJECT_VERSION} COMPATIBILITY ${weft_compatibility})
install(FILES ${CMAKE_CURRENT_BINARY_DIR}/weftConfig.cmake ${CMAKE_CURRENT_BINARY_DIR}/weftConfigVersion.cmake
              ${CMAKE_CURRENT_LIST_DIR}/weft_nvjitlink.cmake ${CMAKE_CURRENT_LIST_DIR}/weft_cuda_target.cmake
        DESTINATION ${WEFT_INSTALL_CMAKEDIR})
