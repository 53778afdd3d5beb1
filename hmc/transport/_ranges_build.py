"""One pass over a long range list in C: what the bounds check, the overlap check of KV blocks, coalescing and the
total need to know, instead of about twenty numpy passes (`hmc.transport._ranges`). A cffi module in API mode,
compiled at install (setup.py compiles what `binding()` declares); where it cannot be, range lists are checked by numpy alone.

Why (docs/decisions.md, "Range checks in one C pass"): on the GPU hosts, checking and coalescing 16384 ranges took
100-110 us of a KV transfer's ~1 ms on the ipc path, one numpy call (~2-5 us there) per reduction.

- `hmc_range_facts(src, dst, lengths, n, max_slots, out)`: fills `out`:
  `negative` (an offset or a length below 0) and `overflow` (an end, or the total, past INT64_MAX): while either
  is set the other facts mean nothing; `src_end` and `dst_end`, the largest end on each side; `total`,
  `min_length`, `max_length`; `joins`, whether some range continues the one before it on both sides (coalescing
  has work to do); `grid`, whether all lengths are one L > 0 and all destination starts are equal modulo L;
  and, with `grid`, `disjoint`: 1 when no two destination blocks coincide, 0 when two do. Up to `max_slots` (>= 1)
  grid slots per range, a bitmap of the grid says; beyond, a hash set of the slots taken (a batch of KV blocks
  scattered over a cache far larger than itself: sorting 16384 of them took 0.6 ms on the CI VM). Returns 0, or -1
  when the bitmap or the set could not be allocated, or the set gave up on slots that collide in it (`disjoint` -1
  then: the caller checks it all with numpy).

The arrays are int64, contiguous, aligned and n long. The module never calls into Python.
"""

from __future__ import annotations

from typing import Any

__all__ = ["CDEF", "SOURCE", "binding"]

_FACTS = """
typedef struct {
    int64_t total, min_length, max_length;
    uint64_t src_end, dst_end;
    int negative, overflow, joins, grid, disjoint;
} hmc_range_facts_t;
"""
"""What the pass fills in: declared once, for cffi (`CDEF`) and for the compiler (`SOURCE`)."""

CDEF = _FACTS + r"""
int hmc_range_facts(const int64_t *src, const int64_t *dst, const int64_t *lengths, uint64_t n, uint64_t max_slots,
                    hmc_range_facts_t *out);
"""

SOURCE = r"""
#include <stdint.h>
#include <stdlib.h>

#if defined(__x86_64__) && defined(__GNUC__)
#define HMC_CLONES __attribute__((target_clones("avx2", "default")))  /* picked at load time by the CPU */
#else
#define HMC_CLONES
#endif
""" + _FACTS + r"""
static uint64_t slot_of(uint64_t d, uint64_t length, unsigned shift, int power) {
    return power ? d >> shift : d / length;
}

/* 1 when no two ranges take one grid slot, 0 when two do, -1 without memory or past the probe budget: open
   addressing in a table of at least 2n entries (a slot s kept as s + 1, so 0 is free), Fibonacci hashing, linear
   probing. The ranges may come from a peer: slots chosen to collide would make the probing quadratic, so past 8n
   probes in all the set gives up and the caller sorts (O(n log n)); random slots take about 1.5n. */
static int slots_disjoint_hashed(const int64_t *dst, uint64_t n, uint64_t length, unsigned shift, int power) {
    unsigned bits = 1;
    while (bits < 62 && ((uint64_t)1 << bits) < 2 * n) ++bits;
    const uint64_t mask = ((uint64_t)1 << bits) - 1;
    uint64_t *table = (uint64_t *)calloc((size_t)(mask + 1), sizeof(uint64_t));
    if (table == NULL) return -1;
    int disjoint = 1;
    uint64_t probes = 0;
    const uint64_t budget = 8 * n + 64;
    for (uint64_t i = 0; i < n && disjoint == 1; ++i) {
        const uint64_t key = slot_of((uint64_t)dst[i], length, shift, power) + 1;
        uint64_t at = (key * 0x9E3779B97F4A7C15ull) >> (64 - bits);
        while (table[at] != 0) {
            if (table[at] == key) {
                disjoint = 0;
                break;
            }
            if (++probes > budget) {
                disjoint = -1;
                break;
            }
            at = (at + 1) & mask;
        }
        table[at] = key;
    }
    free(table);
    return disjoint;
}

HMC_CLONES
int hmc_range_facts(const int64_t *src, const int64_t *dst, const int64_t *lengths, uint64_t n, uint64_t max_slots,
                    hmc_range_facts_t *out) {
    const uint64_t limit = (uint64_t)INT64_MAX;
    /* Branch-free loops the compiler vectorises (AVX2 where the CPU has it: numpy's reductions do, at ~0.15 ns an
       element): signs, extremes, ends, and the total as two 32-bit halves (no wrap below 2^32 ranges). */
    int64_t any = 0, min_length = n ? lengths[0] : 0, max_length = min_length;
    uint64_t src_end = 0, dst_end = 0, high = 0, low = 0;
    for (uint64_t i = 0; i < n; ++i) {
        const int64_t l = lengths[i];
        any |= src[i] | dst[i] | l;  /* the sign bit: some value is negative */
        min_length = l < min_length ? l : min_length;
        max_length = l > max_length ? l : max_length;
    }
    for (uint64_t i = 0; i < n; ++i) {
        const uint64_t l = (uint64_t)lengths[i];
        const uint64_t se = (uint64_t)src[i] + l, de = (uint64_t)dst[i] + l;  /* no wrap while both >= 0 */
        src_end = se > src_end ? se : src_end;
        dst_end = de > dst_end ? de : dst_end;
        high += l >> 32;
        low += l & 0xffffffffu;
    }
    high += low >> 32;  /* total = high * 2^32 + (low mod 2^32) */
    out->negative = any < 0;
    out->overflow = high > (limit >> 32) || src_end > limit || dst_end > limit;
    out->src_end = src_end;
    out->dst_end = dst_end;
    out->total = (int64_t)((high << 32) | (low & 0xffffffffu));
    out->min_length = min_length;
    out->max_length = max_length;
    out->grid = 0;
    out->disjoint = -1;
    int joins = 0;
    for (uint64_t i = 1; i < n; ++i)
        joins |= ((uint64_t)src[i - 1] + (uint64_t)lengths[i - 1] == (uint64_t)src[i]) & ((uint64_t)dst[i - 1] + (uint64_t)lengths[i - 1] == (uint64_t)dst[i]);
    out->joins = joins;
    if (!n || out->negative || out->overflow || min_length != max_length || min_length <= 0) return 0;
    /* Equal lengths L: the destination starts on one grid (equal modulo L), and each grid slot taken once. */
    const uint64_t length = (uint64_t)min_length, mask = length - 1;
    const int power = (length & mask) == 0;
    unsigned shift = 0;
    while (power && ((uint64_t)1 << shift) < length) ++shift;
    uint64_t last = 0;
    if (power) {
        uint64_t ored = 0, anded = ~(uint64_t)0, top = 0;
        for (uint64_t i = 0; i < n; ++i) {
            const uint64_t d = (uint64_t)dst[i];
            ored |= d;
            anded &= d;
            top = d > top ? d : top;
        }
        if ((ored & mask) != (anded & mask)) return 0;  /* the low bits differ somewhere: two phases */
        last = top >> shift;
    } else {
        const uint64_t phase = (uint64_t)dst[0] % length;
        for (uint64_t i = 0; i < n; ++i) {
            const uint64_t d = (uint64_t)dst[i];
            if (d % length != phase) return 0;
            const uint64_t slot = d / length;
            last = slot > last ? slot : last;
        }
    }
    out->grid = 1;
    const uint64_t span = last + 1;
    if (max_slots == 0 || span / max_slots > n) {  /* more slots than max_slots per range: a set of those taken */
        out->disjoint = slots_disjoint_hashed(dst, n, length, shift, power);
        return out->disjoint < 0 ? -1 : 0;
    }
    uint8_t *taken = (uint8_t *)calloc((size_t)(span / 8 + 1), 1);
    if (taken == NULL) return -1;
    out->disjoint = 1;
    for (uint64_t i = 0; i < n; ++i) {
        const uint64_t slot = slot_of((uint64_t)dst[i], length, shift, power);
        const uint8_t bit = (uint8_t)(1u << (slot & 7));
        if (taken[slot >> 3] & bit) {
            out->disjoint = 0;
            break;
        }
        taken[slot >> 3] |= bit;
    }
    free(taken);
    return 0;
}
"""


def binding() -> Any:
    """`hmc.transport._ranges_c`, declared for cffi; setup.py compiles it (`build_binding`)."""
    import cffi

    ffi = cffi.FFI()
    ffi.cdef(CDEF)
    ffi.set_source("hmc.transport._ranges_c", SOURCE, extra_compile_args=["-O3"])
    return ffi
