/* autodiff.h - reverse-mode differentiation of a graph.
 *
 * Walks the forward ops from last to first; each op kind's gradient builder
 * (compiler/ops.h) appends the ops computing its inputs' gradients, and where a
 * tensor feeds several ops their gradients are summed with `add` ops.  Every
 * parameter reached gets a gradient tensor (role MR_ROLE_GRAD, named
 * "grad/<parameter>", linked both ways through mr_tensor.grad / grad_of). */
#ifndef MR_AUTODIFF_H
#define MR_AUTODIFF_H

#include "compiler/graph.h"

/* Appends the backward of g's ops to g, differentiating tensor `out`.  The
 * gradient flowing into `out` is a new input tensor of out's shape, named
 * "grad/<out>", whose id goes to *seed (the runtime fills it: the loss
 * scale for a scalar loss).  Sets g->n_forward_ops.  Returns 0 or an error
 * from a gradient builder (MR_ENOMEM, MR_ENOTSUP). */
int mr_autodiff(struct mr_graph *g, int out, int *seed);

#endif
