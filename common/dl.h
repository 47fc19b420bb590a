/* dl.h - loading a function from a shared object (dlopen + dlsym), with
 * errors that name the file.  The one place the programs load code. */
#ifndef MR_DL_H
#define MR_DL_H

/* Loads the shared object at path (for the life of the process) and sets
 * *fn to its function named symbol.  Returns 0, MR_ENOENT (the object
 * cannot be loaded, with dlerror's text) or MR_EINVAL (it has no such
 * symbol), each message naming path and symbol. */
int mr_dl_function(const char *path, const char *symbol, void (**fn)(void));

#endif
