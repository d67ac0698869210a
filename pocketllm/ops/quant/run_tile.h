/* run_tile: one tile of a quantized kernel with its row and column counts as constants, so the
 * tile's accumulators stay in registers. Included by a kernel file after its tile(q, r0, c0, R, C,
 * o) and its TILE_R / TILE_C for the path compiled in, with TILE_Q naming the struct tile() reads. */
#if TILE_C >= 4
#define TILE_COLS(r) TILE_CASE(r, 1) TILE_CASE(r, 2) TILE_CASE(r, 3) TILE_CASE(r, 4)
#elif TILE_C == 2
#define TILE_COLS(r) TILE_CASE(r, 1) TILE_CASE(r, 2)
#elif TILE_C == 1
#define TILE_COLS(r) TILE_CASE(r, 1)
#else
#error "run_tile.h: TILE_C must be 1, 2 or at least 4"
#endif
#define TILE_CASE(r, c) \
    case (r) * 8 + (c): tile(q, r0, c0, r, c, o); break;

static void run_tile(const TILE_Q *q, int64_t r0, int64_t c0, int R, int C, float o[TILE_R][TILE_C]) {
    switch (R * 8 + C) {
#if TILE_R >= 4
        TILE_COLS(4)
#endif
#if TILE_R >= 3
        TILE_COLS(3)
#endif
#if TILE_R >= 2
        TILE_COLS(2)
#endif
        TILE_COLS(1)
        default: break; /* no other (R, C): run_tiles cuts tiles of at most TILE_R x TILE_C */
    }
}

#undef TILE_CASE
#undef TILE_COLS
