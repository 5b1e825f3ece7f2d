# Fails unless each per-ISA object (the arguments after "--") defines no external symbol but its
# entry points. Anything else it defines with external linkage (an inline function, a std::
# template instantiated on std:: types) is a weak symbol the linker may choose for baseline
# callers too, which would then run AVX instructions on CPUs without them
# (csrc/blending_internal.hpp). Run by CMakeLists.txt as: cmake -DNM=<nm> -P <this> -- <objects>.
set(objects "")
set(seen_separator FALSE)
math(EXPR last "${CMAKE_ARGC} - 1")
foreach(i RANGE ${last})
  if(seen_separator)
    list(APPEND objects "${CMAKE_ARGV${i}}")
  elseif("${CMAKE_ARGV${i}}" STREQUAL "--")
    set(seen_separator TRUE)
  endif()
endforeach()

# tokenmill::blending::run_active_avx2 / run_active_avx512 / register_scan_avx512 and
# tokenmill::mt19937::twist_avx2 / twist_avx512 (Itanium-mangled); the personality pointer every
# object with exception handling carries (data, not code).
set(allowed "^_ZN9tokenmill(8blending(15run_active_avx2|17run_active_avx512|20register_scan_avx512)|7mt19937(10twist_avx2|12twist_avx512))E|^DW\\.ref\\.__gxx_personality_v0$")

set(failures "")
foreach(object ${objects})
  execute_process(COMMAND "${NM}" --defined-only --extern-only "${object}"
                  OUTPUT_VARIABLE listing RESULT_VARIABLE status ERROR_VARIABLE errors)
  if(NOT status EQUAL 0)
    message(FATAL_ERROR "${NM} failed on ${object}: ${errors}")
  endif()
  string(REPLACE "\n" ";" lines "${listing}")
  foreach(line ${lines})
    if(line MATCHES "^[0-9a-fA-F]* *[A-Za-z] (.+)$")
      set(symbol "${CMAKE_MATCH_1}")
      if(NOT symbol MATCHES "${allowed}")
        string(APPEND failures "\n  ${object}: ${symbol}")
      endif()
    endif()
  endforeach()
endforeach()
if(failures)
  message(FATAL_ERROR "per-ISA units define external symbols other than their entry points "
                      "(see csrc/blending_internal.hpp):${failures}")
endif()
