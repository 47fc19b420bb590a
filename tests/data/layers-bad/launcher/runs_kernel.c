/* a launcher file that runs a worker kernel: refused */
#include "worker/backend/cpu/kernels.h"
