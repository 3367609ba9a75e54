# ccache when present. Its cache lives outside the clone (ccache's default per-user folder), and
# paths are hashed relative to the source folder, so every clone on the machine (CI's included)
# shares hits. The sloppiness settings let precompiled headers be cached.
find_program(CCACHE_PROGRAM ccache)
if(CCACHE_PROGRAM)
  set(_lorapipe_launcher
      ${CMAKE_COMMAND} -E env CCACHE_BASEDIR=${PROJECT_SOURCE_DIR} CCACHE_NOHASHDIR=true
      CCACHE_SLOPPINESS=pch_defines,time_macros,include_file_mtime,include_file_ctime
      ${CCACHE_PROGRAM})
  set(CMAKE_C_COMPILER_LAUNCHER ${_lorapipe_launcher})
  set(CMAKE_CXX_COMPILER_LAUNCHER ${_lorapipe_launcher})
  set(CMAKE_CUDA_COMPILER_LAUNCHER ${_lorapipe_launcher})
  message(STATUS "lorapipe: ccache ${CCACHE_PROGRAM}")
endif()
