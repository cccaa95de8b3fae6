/* What each object that runs on AMX tiles includes: the request for the tile state and the tiles'
   configuration (compile/kernels/amx.py). */
#ifndef BERT_AMX_H
#define BERT_AMX_H

#include "kernels.h"

#include <sys/syscall.h>
#include <unistd.h>

#define BERT_ARCH_REQ_XCOMP_PERM 0x1023
#define BERT_XFEATURE_XTILEDATA 18

/* Ask Linux for the tile state once per process, when the library is loaded (each object asks: the request
   is idempotent). */
__attribute__((constructor)) static void bert_amx_request_tiles(void) {
  syscall(SYS_arch_prctl, BERT_ARCH_REQ_XCOMP_PERM, BERT_XFEATURE_XTILEDATA);
}

typedef struct {
  uint8_t palette, start_row, reserved[14];
  uint16_t bytes_per_row[16];
  uint8_t rows[16];
} bert_amx_config;

/* Palette 1, eight tiles of 16 rows x 64 bytes: loaded where the calling thread's tiles are configured
   otherwise (reading the configuration back costs little; loading it, a quarter of a 32 x 32 x 384 call). */
static inline void bert_amx_configure(void) {
  static const bert_amx_config ours = {1, 0, {0}, {64, 64, 64, 64, 64, 64, 64, 64}, {16, 16, 16, 16, 16, 16, 16, 16}};
  bert_amx_config current;
  _tile_storeconfig(&current);
  if (memcmp(&current, &ours, sizeof ours) != 0) _tile_loadconfig(&ours);
}

#endif
