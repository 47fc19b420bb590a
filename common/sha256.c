/* sha256.c - SHA-256 with the x86-64 SHA extensions where present (see
 * sha256.h). */
#include "common/sha256.h"

#include <string.h>

#if defined(__x86_64__) && defined(__GNUC__)
#include <cpuid.h>
#include <immintrin.h>
#define HAVE_SHANI_PATH 1
#endif

static const uint32_t K[64] = {
    0x428a2f98, 0x71374491, 0xb5c0fbcf, 0xe9b5dba5, 0x3956c25b, 0x59f111f1, 0x923f82a4,
    0xab1c5ed5, 0xd807aa98, 0x12835b01, 0x243185be, 0x550c7dc3, 0x72be5d74, 0x80deb1fe,
    0x9bdc06a7, 0xc19bf174, 0xe49b69c1, 0xefbe4786, 0x0fc19dc6, 0x240ca1cc, 0x2de92c6f,
    0x4a7484aa, 0x5cb0a9dc, 0x76f988da, 0x983e5152, 0xa831c66d, 0xb00327c8, 0xbf597fc7,
    0xc6e00bf3, 0xd5a79147, 0x06ca6351, 0x14292967, 0x27b70a85, 0x2e1b2138, 0x4d2c6dfc,
    0x53380d13, 0x650a7354, 0x766a0abb, 0x81c2c92e, 0x92722c85, 0xa2bfe8a1, 0xa81a664b,
    0xc24b8b70, 0xc76c51a3, 0xd192e819, 0xd6990624, 0xf40e3585, 0x106aa070, 0x19a4c116,
    0x1e376c08, 0x2748774c, 0x34b0bcb5, 0x391c0cb3, 0x4ed8aa4a, 0x5b9cca4f, 0x682e6ff3,
    0x748f82ee, 0x78a5636f, 0x84c87814, 0x8cc70208, 0x90befffa, 0xa4506ceb, 0xbef9a3f7,
    0xc67178f2};

static uint32_t ror(uint32_t x, int n) { return (x >> n) | (x << (32 - n)); }

static uint32_t load_be32(const uint8_t *p) {
  return (uint32_t)p[0] << 24 | (uint32_t)p[1] << 16 | (uint32_t)p[2] << 8 | p[3];
}

/* The portable compression function over n 64-byte blocks. */
static void blocks_portable(uint32_t h[8], const uint8_t *p, size_t n) {
  for (; n > 0; n--, p += 64) {
    uint32_t w[64];
    for (int t = 0; t < 16; t++)
      w[t] = load_be32(p + 4 * t);
    for (int t = 16; t < 64; t++) {
      uint32_t s0 = ror(w[t - 15], 7) ^ ror(w[t - 15], 18) ^ (w[t - 15] >> 3);
      uint32_t s1 = ror(w[t - 2], 17) ^ ror(w[t - 2], 19) ^ (w[t - 2] >> 10);
      w[t] = w[t - 16] + s0 + w[t - 7] + s1;
    }
    uint32_t a = h[0], b = h[1], c = h[2], d = h[3], e = h[4], f = h[5], g = h[6], k = h[7];
    for (int t = 0; t < 64; t++) {
      uint32_t t1 = k + (ror(e, 6) ^ ror(e, 11) ^ ror(e, 25)) + ((e & f) ^ (~e & g)) + K[t] + w[t];
      uint32_t t2 = (ror(a, 2) ^ ror(a, 13) ^ ror(a, 22)) + ((a & b) ^ (a & c) ^ (b & c));
      k = g, g = f, f = e, e = d + t1, d = c, c = b, b = a, a = t1 + t2;
    }
    h[0] += a, h[1] += b, h[2] += c, h[3] += d, h[4] += e, h[5] += f, h[6] += g, h[7] += k;
  }
}

#ifdef HAVE_SHANI_PATH
/* The same with SHA-NI: the state is kept as the ABEF / CDGH register pair
 * the instructions expect, four rounds per step of the message schedule. */
__attribute__((target("sha,sse4.1,ssse3"))) static void blocks_shani(uint32_t h[8],
                                                                     const uint8_t *p,
                                                                     size_t n) {
  const __m128i bswap = _mm_set_epi64x(0x0c0d0e0f08090a0bll, 0x0405060700010203ll);
  __m128i tmp = _mm_shuffle_epi32(_mm_loadu_si128((const __m128i *)&h[0]), 0xb1); // CDAB
  __m128i st1 = _mm_shuffle_epi32(_mm_loadu_si128((const __m128i *)&h[4]), 0x1b); // EFGH
  __m128i st0 = _mm_alignr_epi8(tmp, st1, 8);                                   // ABEF
  st1 = _mm_blend_epi16(st1, tmp, 0xf0);                                        // CDGH
  for (; n > 0; n--, p += 64) {
    __m128i save0 = st0, save1 = st1, w[4];
#pragma GCC unroll 16 /* keeps w[] in registers */
    for (int i = 0; i < 16; i++) {
      __m128i m;
      if (i < 4) {
        m = w[i] = _mm_shuffle_epi8(_mm_loadu_si128((const __m128i *)(p + 16 * i)), bswap);
      } else { /* W[t..t+3] from W[t-16..t-1]: the four previous groups */
        __m128i x = _mm_sha256msg1_epu32(w[i & 3], w[(i + 1) & 3]);
        x = _mm_add_epi32(x, _mm_alignr_epi8(w[(i + 3) & 3], w[(i + 2) & 3], 4));
        m = w[i & 3] = _mm_sha256msg2_epu32(x, w[(i + 3) & 3]);
      }
      m = _mm_add_epi32(m, _mm_loadu_si128((const __m128i *)&K[4 * i]));
      st1 = _mm_sha256rnds2_epu32(st1, st0, m);
      st0 = _mm_sha256rnds2_epu32(st0, st1, _mm_shuffle_epi32(m, 0x0e));
    }
    st0 = _mm_add_epi32(st0, save0);
    st1 = _mm_add_epi32(st1, save1);
  }
  tmp = _mm_shuffle_epi32(st0, 0x1b);  // FEBA
  st1 = _mm_shuffle_epi32(st1, 0xb1);  // DCHG
  _mm_storeu_si128((__m128i *)&h[0], _mm_blend_epi16(tmp, st1, 0xf0)); // DCBA
  _mm_storeu_si128((__m128i *)&h[4], _mm_alignr_epi8(st1, tmp, 8));    // HGFE
}
#endif

int mr_sha256_accelerated(void) {
#ifdef HAVE_SHANI_PATH
  unsigned a, b, c, d;
  if (!__get_cpuid(1, &a, &b, &c, &d) || !(c & bit_SSE4_1) || !(c & bit_SSSE3))
    return 0;
  return __get_cpuid_count(7, 0, &a, &b, &c, &d) && (b & bit_SHA) != 0;
#else
  return 0;
#endif
}

static void blocks(struct mr_sha256 *s, const uint8_t *p, size_t n) {
#ifdef HAVE_SHANI_PATH
  if (s->fast) {
    blocks_shani(s->h, p, n);
    return;
  }
#endif
  blocks_portable(s->h, p, n);
}

void mr_sha256_init(struct mr_sha256 *s) {
  static const uint32_t iv[8] = {0x6a09e667, 0xbb67ae85, 0x3c6ef372, 0xa54ff53a,
                                 0x510e527f, 0x9b05688c, 0x1f83d9ab, 0x5be0cd19};
  memcpy(s->h, iv, sizeof iv);
  s->bytes = 0;
  s->fast = mr_sha256_accelerated();
}

void mr_sha256_update(struct mr_sha256 *s, const void *data, size_t n) {
  const uint8_t *p = data;
  size_t have = (size_t)(s->bytes % 64);
  s->bytes += n;
  if (have > 0) {
    size_t take = 64 - have < n ? 64 - have : n;
    memcpy(s->buf + have, p, take);
    p += take;
    n -= take;
    if (have + take < 64)
      return;
    blocks(s, s->buf, 1);
  }
  if (n >= 64)
    blocks(s, p, n / 64);
  p += n / 64 * 64;
  memcpy(s->buf, p, n % 64);
}

void mr_sha256_final(struct mr_sha256 *s, char hex[65]) {
  uint64_t bits = s->bytes * 8;
  size_t have = (size_t)(s->bytes % 64);
  uint8_t pad[128] = {0x80};
  size_t padlen = (have < 56 ? 56 : 120) - have;
  for (int i = 0; i < 8; i++)
    pad[padlen + (size_t)i] = (uint8_t)(bits >> (56 - 8 * i));
  mr_sha256_update(s, pad, padlen + 8);
  static const char digits[] = "0123456789abcdef";
  for (int i = 0; i < 8; i++)
    for (int j = 0; j < 4; j++) {
      uint8_t byte = (uint8_t)(s->h[i] >> (24 - 8 * j));
      hex[8 * i + 2 * j] = digits[byte >> 4];
      hex[8 * i + 2 * j + 1] = digits[byte & 15];
    }
  hex[64] = '\0';
}
