# lorapipe_discover_tests(TARGET [gtest_discover_tests arguments...]): gtest_discover_tests
# with one change to how ctest reads a skip.
#
# CMake marks a discovered test skipped whenever its output holds "[  SKIPPED ]", whatever its
# exit code. GoogleTest prints that for every test of a suite whose SetUpTestSuite failed (a
# reference script that broke, a fixture that could not be built), so such a failure passed as a
# skip. Here only a skip the test asked for counts: GTEST_SKIP() with a message starting
# "lorapipe-skip:" (the reason follows); anything else is judged by its exit code. CMake's
# discovery script is wrapped (LorapipeGTestAddTests.cmake.in) to drop its default regex; it is
# CMake's internal _GOOGLETEST_DISCOVER_TESTS_SCRIPT, checked here, that names it.
# PROPERTIES, when given, must come last (as every call here has it).
set(LORAPIPE_GTEST_ADD_TESTS "${_GOOGLETEST_DISCOVER_TESTS_SCRIPT}")
if(LORAPIPE_GTEST_ADD_TESTS AND EXISTS "${LORAPIPE_GTEST_ADD_TESTS}")
  configure_file(${CMAKE_CURRENT_LIST_DIR}/LorapipeGTestAddTests.cmake.in
                 ${CMAKE_BINARY_DIR}/LorapipeGTestAddTests.cmake @ONLY)
  set(_GOOGLETEST_DISCOVER_TESTS_SCRIPT ${CMAKE_BINARY_DIR}/LorapipeGTestAddTests.cmake)
else()
  message(WARNING "this CMake's GoogleTest module has no _GOOGLETEST_DISCOVER_TESTS_SCRIPT: a "
                  "failed SetUpTestSuite will read as a skip")
endif()

function(lorapipe_discover_tests target)
  set(args ${ARGN})
  if(NOT "PROPERTIES" IN_LIST args)
    list(APPEND args PROPERTIES)
  endif()
  list(APPEND args SKIP_REGULAR_EXPRESSION "lorapipe-skip:")
  gtest_discover_tests(${target} ${args})
endfunction()
