# SPDX-License-Identifier: MIT
# Defines the imported target weft::nvjitlink (the toolkit's libnvJitLink, which CMake's FindCUDAToolkit names
# only from CMake 3.26 on) after find_package(CUDAToolkit). Used by weft's build and by its installed
# weftConfig.cmake; sets WEFT_NVJITLINK_LIBRARY to ...-NOTFOUND and defines nothing when the library is absent.
if(NOT TARGET weft::nvjitlink)
  find_library(WEFT_NVJITLINK_LIBRARY nvJitLink HINTS ${CUDAToolkit_LIBRARY_DIR})
  if(WEFT_NVJITLINK_LIBRARY)
    add_library(weft::nvjitlink SHARED IMPORTED)
    set_target_properties(weft::nvjitlink PROPERTIES IMPORTED_LOCATION ${WEFT_NVJITLINK_LIBRARY}
                          INTERFACE_INCLUDE_DIRECTORIES "${CUDAToolkit_INCLUDE_DIRS}")
  endif()
endif()
