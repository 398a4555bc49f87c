// What every AMX kernel needs before its first tile op: the process's permission to use tile state, and
// the per-thread tile configuration (palette 1: up to 8 tiles, each up to 16 rows of 64 bytes).
#pragma once

#if defined(__AMX_TILE__)
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdint>

namespace kvflow {

// Linux grants a process the AMX tile state only on request (arch_prctl ARCH_REQ_XCOMP_PERM for
// XFEATURE_XTILEDATA, kernel 5.16 and later); asked once per process.
inline bool amx_permitted() {
  static const bool ok = [] {
    constexpr long kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return ok;
}

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// GCC 12 treats ldtilecfg as not reading the configuration's bytes and drops the stores of its rows and
// columns (only the palette survives): every tile is then unconfigured and the first tile load raises
// SIGILL. The empty asm that takes the address and clobbers memory keeps those stores.
inline void load_tile_config(const TileConfig& c) {
  asm volatile("" : : "r"(&c) : "memory");
  _tile_loadconfig(&c);
}

}  // namespace kvflow
#endif
