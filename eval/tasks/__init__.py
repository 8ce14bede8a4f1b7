"""lm-eval task configs shipped with Sonic (passed to lm-eval's TaskManager as an include path)."""
