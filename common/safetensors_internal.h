/* safetensors_internal.h - what the safetensors reader and writer share. */
#ifndef MR_SAFETENSORS_INTERNAL_H
#define MR_SAFETENSORS_INTERNAL_H

#include <stddef.h>

#include "common/dtype.h"

/* Whether mr__st_convert handles src -> dst: identity for every dtype,
 * otherwise both among F32, BF16, F16, F64. */
int mr__st_can_convert(enum mr_dtype src, enum mr_dtype dst);

/* Converts n elements from src (src_dtype) to dst (dst_dtype); either
 * pointer may be unaligned.  Rounds to nearest even (via float). */
void mr__st_convert(enum mr_dtype dst_dtype, void *dst, enum mr_dtype src_dtype,
                    const void *src, size_t n);

#endif
