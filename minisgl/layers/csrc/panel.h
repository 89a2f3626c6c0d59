/* The 16-column bf16 panels' lane order (panel.c, the AVX2 build), shared with the
   decode chain's lookup of a tied table's rows in them (chain.c): lane 2j holds column j, lane
   2j+1 column 8+j, so a shift and a mask split a 32-bit pair into the two columns' fp32. */
#pragma once
#include <stdint.h>

static inline int64_t panel16_lane(int64_t c) { return c < 8 ? 2 * c : 2 * (c - 8) + 1; }
