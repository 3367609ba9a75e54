# LORAPIPE_SANITIZE="address;undefined" builds everything with those sanitizers.
if(LORAPIPE_SANITIZE)
  list(JOIN LORAPIPE_SANITIZE "," _lorapipe_sanitizers)
  add_compile_options(-fsanitize=${_lorapipe_sanitizers} -fno-omit-frame-pointer)
  add_link_options(-fsanitize=${_lorapipe_sanitizers})
endif()
