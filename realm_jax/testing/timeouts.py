"""How long a test waits for something that will happen.

A test never depends on the machine's speed: a wait for something that
will happen (a subprocess, a thread, a published index) is bounded only
by `HANG_SECONDS`, a bound that catches a hang and that no busy machine
reaches (the whole suite takes less). A test of a timeout itself passes
its own, short one.
"""

# 30 minutes: far beyond any one command of the suite on a loaded machine
# (the slowest takes ~11 minutes at load 6-9), yet a hung child still ends
# before CI's own limit.
HANG_SECONDS = 1800
