# LibTorch from the PyPI torch wheel in the project's virtual environment (scripts/deps.sh):
# CMake finds it through torch.utils.cmake_prefix_path of LORAPIPE_PYTHON.
set(LORAPIPE_PYTHON "$ENV{LORAPIPE_PYTHON}" CACHE FILEPATH "Python of the environment holding torch")
if(NOT LORAPIPE_PYTHON)
  find_program(LORAPIPE_PYTHON NAMES python3 python REQUIRED)
endif()
execute_process(
  COMMAND ${LORAPIPE_PYTHON} -c "import torch.utils; print(torch.utils.cmake_prefix_path)"
  OUTPUT_VARIABLE _lorapipe_torch_prefix
  OUTPUT_STRIP_TRAILING_WHITESPACE
  RESULT_VARIABLE _lorapipe_torch_rc)
if(NOT _lorapipe_torch_rc EQUAL 0)
  message(FATAL_ERROR "${LORAPIPE_PYTHON} cannot import torch: run ./test.sh or ./run.sh, which "
                      "install it, or pass -DLORAPIPE_PYTHON=<python with torch>")
endif()
list(APPEND CMAKE_PREFIX_PATH ${_lorapipe_torch_prefix})
# The wheel's CMake config finds the CUDA toolkit on its own; keep its arch list to ours.
if(NOT DEFINED ENV{TORCH_CUDA_ARCH_LIST})
  set(ENV{TORCH_CUDA_ARCH_LIST} "7.5;8.0;8.6;8.9;9.0")
endif()
find_package(Torch REQUIRED)

# One precompiled LibTorch header for the whole project: every LibTorch target reuses it, so
# the heavy headers are parsed once per build instead of once per translation unit.
add_library(lorapipe_torch_pch OBJECT ${PROJECT_SOURCE_DIR}/cmake/torch_pch.cpp)
target_link_libraries(lorapipe_torch_pch PUBLIC stdc++ ${TORCH_LIBRARIES})
target_compile_options(lorapipe_torch_pch PUBLIC ${TORCH_CXX_FLAGS})
target_precompile_headers(lorapipe_torch_pch PUBLIC <torch/torch.h>)

# Links `target` to LibTorch and reuses the shared precompiled header.
#
# libstdc++ is linked before LibTorch on purpose: the torch wheel's libtorch.so exports its own
# copy of std::filesystem (64 symbols), and whichever library comes first in the NEEDED list
# wins symbol lookup. LibTorch's copy crashes when called from our code (std::filesystem::
# remove_all jumps to a null pointer), so the system libstdc++ must come first.
function(lorapipe_use_torch target)
  target_link_libraries(${target} PUBLIC stdc++ ${TORCH_LIBRARIES})
  target_compile_options(${target} PUBLIC ${TORCH_CXX_FLAGS})
  target_precompile_headers(${target} REUSE_FROM lorapipe_torch_pch)
endfunction()
