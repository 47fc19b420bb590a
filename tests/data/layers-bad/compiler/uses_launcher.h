/* a compiler header that reaches into the launcher: refused */
#include "launcher/cli.h"
