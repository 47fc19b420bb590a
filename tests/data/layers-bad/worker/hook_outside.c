/* a worker file that reads a test hook itself and ends the process in the
 * middle of its work: both refused */
static int quit_here(const char *v) { return v != 0; }
void step(void);
void step(void) {
  if (quit_here(getenv("MESHRUN_TEST_QUIT")))
    _exit(0);
}
