# ccache when present. Its cache lives outside the clone (ccache's default per-user folder), and
# paths are hashed relative to the source folder, so every clone on the machine (CI's included)
# shares hits. The sloppiness settings let precompiled headers be cached.
#
# Size: one build of lorapipe stores about 3 GB (LibTorch's debug information; the precompiled
# header alone is 900 MB before compression). Under ccache's default limit of 5 GB, a change to
# a widely included header stores a new generation that evicts the objects of the files that did
# not change (an incremental build never touches their entries, so they are the least recently
# used): a fresh clone then recompiled 45 of 185 units (measured: 553 s against 103 s with every
# unit a hit). Where ccache's limit is its default (`ccache --show-config` marks the setting's
# origin "(default)" in every 4.x; a limit from ccache.conf or from CCACHE_MAXSIZE at configure
# time shows another origin and is kept), lorapipe's compiles run with 12 GB, room for several
# generations. A CCACHE_MAXSIZE exported only when building is overridden by this one; ccache
# run outside lorapipe's build trims the cache to its own limit, as it always did.
find_program(CCACHE_PROGRAM ccache)
if(CCACHE_PROGRAM)
  set(_lorapipe_ccache_size "")
  execute_process(COMMAND ${CCACHE_PROGRAM} --show-config
                  OUTPUT_VARIABLE _lorapipe_ccache_config RESULT_VARIABLE _lorapipe_ccache_rc
                  ERROR_QUIET)
  if(_lorapipe_ccache_rc EQUAL 0 AND _lorapipe_ccache_config MATCHES "\\(default\\) max_size =")
    set(_lorapipe_ccache_size CCACHE_MAXSIZE=12G)
  endif()
  set(_lorapipe_launcher
      ${CMAKE_COMMAND} -E env CCACHE_BASEDIR=${PROJECT_SOURCE_DIR} CCACHE_NOHASHDIR=true
      CCACHE_SLOPPINESS=pch_defines,time_macros,include_file_mtime,include_file_ctime
      ${_lorapipe_ccache_size} ${CCACHE_PROGRAM})
  set(CMAKE_C_COMPILER_LAUNCHER ${_lorapipe_launcher})
  set(CMAKE_CXX_COMPILER_LAUNCHER ${_lorapipe_launcher})
  set(CMAKE_CUDA_COMPILER_LAUNCHER ${_lorapipe_launcher})
  message(STATUS "lorapipe: ccache ${CCACHE_PROGRAM} ${_lorapipe_ccache_size}")
endif()
