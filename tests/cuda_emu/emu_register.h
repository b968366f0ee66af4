// Registers the kernels of one .cu file with the runtime: a thunk per kernel that unpacks a
// cuLaunchKernel-style argument array (args[i] points at argument i's value) into a call, and the
// kernel's parameter types as codes the Python launcher checks its arguments against:
//   f2 f4 f8 (__half float double), i1..i8 / u1..u8 (signed / unsigned integers), b1 (bool),
//   h2 (__half2), v (void), x<bytes> (any other type); a pointer is '*', then 'c' if it points to
//   const, then the pointee's code (x8 for a pointer to a pointer).
// Included by the generated translation unit (build.py) after the .cu file itself.
#pragma once

#include <string>
#include <utility>

namespace lkv_emu {

using Thunk = void (*)(void* fn, void** args);

struct KernelEntry {
  const char* name;
  void* fn;
  Thunk thunk;
  std::string signature;
  int max_threads;  // __launch_bounds__, else the CUDA limit
};

int add_kernel(KernelEntry entry);  // runtime.cpp

template <typename T>
std::string scalar_code() {
  using U = std::remove_cv_t<T>;
  if constexpr (std::is_same_v<U, bool>) return "b1";
  else if constexpr (std::is_same_v<U, __half>) return "f2";
  else if constexpr (std::is_same_v<U, __half2>) return "h2";
  else if constexpr (std::is_void_v<U>) return "v";
  else if constexpr (std::is_floating_point_v<U>) return "f" + std::to_string(sizeof(U));
  else if constexpr (std::is_integral_v<U>) return (std::is_signed_v<U> ? "i" : "u") + std::to_string(sizeof(U));
  else return "x" + std::to_string(sizeof(U));
}

template <typename T>
std::string param_code() {
  if constexpr (std::is_pointer_v<T>) {
    using P = std::remove_pointer_t<T>;
    return std::string("*") + (std::is_const_v<P> ? "c" : "") + (std::is_pointer_v<P> ? "x8" : scalar_code<P>());
  } else {
    return scalar_code<T>();
  }
}

template <typename... A, std::size_t... I>
void call_unpacked(void (*f)(A...), void** args, std::index_sequence<I...>) {
  f(*static_cast<std::remove_cv_t<std::remove_reference_t<A>>*>(args[I])...);
}

template <typename... A>
void thunk(void* fn, void** args) {
  call_unpacked(reinterpret_cast<void (*)(A...)>(fn), args, std::index_sequence_for<A...>{});
}

template <typename... A>
KernelEntry make_entry(const char* name, void (*f)(A...), int max_threads) {
  std::string sig;
  ((sig += (sig.empty() ? "" : ","), sig += param_code<A>()), ...);
  return KernelEntry{name, reinterpret_cast<void*>(f), &thunk<A...>, sig, max_threads};
}

}  // namespace lkv_emu

#define LKV_EMU_KERNEL(name, max_threads) \
  static const int lkv_emu_reg_##name = ::lkv_emu::add_kernel(::lkv_emu::make_entry(#name, &name, (max_threads)));
