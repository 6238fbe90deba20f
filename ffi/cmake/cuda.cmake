# The CUDA module, built whenever a CUDA compiler is found; skipped with a message
# otherwise (the package works without it).
include(CheckLanguage)

# nvcc 13 rejects CMake's old default architectures, so pick them before CUDA is
# enabled: sm_90 always, plus the newer targets this nvcc lists. A user's
# -DCMAKE_CUDA_ARCHITECTURES=... wins.
function(nvfp4_pick_cuda_architectures out)
  set(arches 90)
  execute_process(COMMAND "${CMAKE_CUDA_COMPILER}" --list-gpu-arch
                  OUTPUT_VARIABLE listed RESULT_VARIABLE rc ERROR_QUIET)
  if(rc EQUAL 0)
    foreach(arch 100 120)
      if(listed MATCHES "compute_${arch}")
        list(APPEND arches ${arch})
      endif()
    endforeach()
  endif()
  set(${out} "${arches}" PARENT_SCOPE)
endfunction()

if(NOT DEFINED CMAKE_CUDA_COMPILER)
  # Where check_language would not look: the default toolkit path.
  find_program(NVFP4_NVCC nvcc PATHS /usr/local/cuda/bin NO_CACHE)
  if(NVFP4_NVCC)
    set(CMAKE_CUDA_COMPILER "${NVFP4_NVCC}")
  endif()
endif()
if(NOT CMAKE_CUDA_ARCHITECTURES AND CMAKE_CUDA_COMPILER)
  nvfp4_pick_cuda_architectures(picked)
  set(CMAKE_CUDA_ARCHITECTURES "${picked}")
endif()
check_language(CUDA)

if(NOT CMAKE_CUDA_COMPILER)
  message(STATUS "nvfp4_jax: no CUDA compiler found; skipping the CUDA kernels "
                 "(set CMAKE_CUDA_COMPILER to build them)")
  return()
endif()

enable_language(CUDA)
set(CMAKE_CUDA_STANDARD 17)
set(CMAKE_CUDA_STANDARD_REQUIRED ON)
message(STATUS "nvfp4_jax: building the CUDA kernels for sm ${CMAKE_CUDA_ARCHITECTURES}")

nvfp4_add_module(_nvfp4_cuda Cuda cuda/handlers.cu cuda/ms_eden.cu)
# The module's probe() names the architectures it was built for.
file(CONFIGURE OUTPUT "${CMAKE_CURRENT_BINARY_DIR}/cuda_config/nvfp4_cuda_config.h"
     CONTENT "#define NVFP4_CUDA_ARCHITECTURES \"${CMAKE_CUDA_ARCHITECTURES}\"\n" @ONLY)
target_include_directories(_nvfp4_cuda PRIVATE "${CMAKE_CURRENT_BINARY_DIR}/cuda_config")
target_compile_definitions(_nvfp4_cuda PRIVATE NVFP4_CUDA_PROBE)
# IEEE division, no FMA contraction, denormals kept: the bits of docs/NUMERICS.md.
target_compile_options(_nvfp4_cuda PRIVATE
  $<$<COMPILE_LANGUAGE:CUDA>:-O3 -fmad=false -prec-div=true -ftz=false>)
# A static runtime: the module imports on a machine with no GPU or driver, and the
# driver is only looked for on the first CUDA call.
set_target_properties(_nvfp4_cuda PROPERTIES CUDA_RUNTIME_LIBRARY Static)
