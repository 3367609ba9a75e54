# libFuzzer targets (clang only): cmake -DLORAPIPE_FUZZ=ON -DLORAPIPE_TORCH=OFF
# -DCMAKE_CXX_COMPILER=clang++ -DCMAKE_C_COMPILER=clang, then run build/bin/<target> CORPUS_DIR.
option(LORAPIPE_FUZZ "Build the libFuzzer targets (needs clang)" OFF)

# lorapipe_add_fuzz_target(NAME SOURCE LIBRARY): a fuzzer over LIBRARY, which is instrumented
# too, so the fuzzer sees its coverage.
function(lorapipe_add_fuzz_target name source library)
  if(NOT LORAPIPE_FUZZ)
    return()
  endif()
  add_executable(${name} ${source})
  target_link_libraries(${name} PRIVATE ${library})
  target_compile_options(${library} PRIVATE -fsanitize=fuzzer-no-link,address,undefined)
  target_compile_options(${name} PRIVATE -fsanitize=fuzzer,address,undefined)
  target_link_options(${name} PRIVATE -fsanitize=fuzzer,address,undefined)
endfunction()
