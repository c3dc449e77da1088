/* mx_hash.h - a 64-bit hash of a byte range, order-dependent, at memory speed.
 *
 *   mx_hash64(p, n, seed): hash of the n bytes at p. Four independent lanes each take
 *     every fourth 64-bit word (h = rotl(h ^ w * K1, 31) * K2, the xxHash64 round), so
 *     the multiplies of the lanes overlap; the lanes, the tail bytes and n are folded at
 *     the end. Every byte and its position count: swapping two values, or any edit that
 *     keeps a sum, changes the hash (unlike a sum of words). Not cryptographic: it guards
 *     against mistakes (parameters edited between a forward and its backward), not
 *     against an adversary.
 */
#ifndef MX_HASH_H
#define MX_HASH_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>
#include "mx_compat.h"

#define MX_HASH_K1 0x9E3779B185EBCA87ULL
#define MX_HASH_K2 0xC2B2AE3D27D4EB4FULL
#define MX_HASH_K3 0x165667B19E3779F9ULL

MX_INLINE uint64_t mx_hash_rotl(uint64_t x, int r) { return (x << r) | (x >> (64 - r)); }

MX_INLINE uint64_t mx_hash_round(uint64_t h, uint64_t w) {
    return mx_hash_rotl(h + w * MX_HASH_K2, 31) * MX_HASH_K1;
}

static MX_UNUSED uint64_t mx_hash64(const void* p, size_t n, uint64_t seed) {
    const unsigned char* b = (const unsigned char*)p;
    uint64_t v[4], w, h;
    size_t i = 0, k;
    v[0] = seed + MX_HASH_K1 + MX_HASH_K2;
    v[1] = seed + MX_HASH_K2;
    v[2] = seed;
    v[3] = seed - MX_HASH_K1;
    for (; i + 32 <= n; i += 32) {
        for (k = 0; k < 4; k++) {
            memcpy(&w, b + i + 8 * k, 8);     /* unaligned-safe load */
            v[k] = mx_hash_round(v[k], w);
        }
    }
    h = mx_hash_rotl(v[0], 1) + mx_hash_rotl(v[1], 7) + mx_hash_rotl(v[2], 12)
        + mx_hash_rotl(v[3], 18);
    for (k = 0; k < 4; k++) h = (h ^ mx_hash_round(0, v[k])) * MX_HASH_K1 + MX_HASH_K3;
    h += (uint64_t)n;
    for (; i + 8 <= n; i += 8) {
        memcpy(&w, b + i, 8);
        h = mx_hash_rotl(h ^ mx_hash_round(0, w), 27) * MX_HASH_K1 + MX_HASH_K3;
    }
    for (; i < n; i++) h = mx_hash_rotl(h ^ (b[i] * MX_HASH_K3), 11) * MX_HASH_K1;
    h ^= h >> 33;
    h *= MX_HASH_K2;
    h ^= h >> 29;
    h *= MX_HASH_K3;
    h ^= h >> 32;
    return h;
}

#endif /* MX_HASH_H */
