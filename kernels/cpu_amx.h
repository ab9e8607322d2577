// AMX set-up shared by the C++ CPU kernels of kernels/ (header-only; cpu_library.py hashes it with each source):
// OMNI_AMX is defined where the build targets AMX-BF16 with AVX512-BF16 (-march=native on such a CPU).
//
// amx_permitted: Linux lets a process use the AMX tile data only after it asks (arch_prctl ARCH_REQ_XCOMP_PERM =
// 0x1023 for XFEATURE_XTILEDATA = 18; Linux Documentation/arch/x86/xstate.rst); the grant is process-wide, asked
// once. configure_tiles: palette 1 with tiles 0-7 all 16 rows x 64 bytes, in the calling thread (release them with
// _tile_release when done, so no tile state stays live in the thread).

#pragma once

#if defined(__AMX_BF16__) && defined(__AMX_TILE__) && defined(__AVX512BF16__)
#define OMNI_AMX 1
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdint>

namespace omni {

inline bool amx_permitted() {
  static const bool permitted = syscall(SYS_arch_prctl, 0x1023, 18) == 0;
  return permitted;
}

inline void configure_tiles() {
  struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
  } config{};
  config.palette = 1;
  for (int t = 0; t < 8; ++t) config.colsb[t] = 64, config.rows[t] = 16;
  _tile_loadconfig(&config);
}

}  // namespace omni
#endif
