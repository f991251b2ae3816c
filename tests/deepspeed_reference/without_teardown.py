"""Run a script (`python without_teardown.py script.py args...`) as `__main__`, then end
the process without interpreter teardown.

The reference runs go through it on DeepSpeed's side only. DeepSpeed's processes can
abort in teardown after the script has finished and written its results: "terminate
called without an active exception", SIGABRT, in 2 of the 8 two-process runs of one
job here, even after `destroy_process_group()`. The likely cause is the gloo threads of
process groups its modules still hold (torch's PR 179291 describes the abort). fzero's
side exits normally, as its users' scripts do. A script that raises still fails the
run, since the exception propagates before `os._exit`.
"""

import os
import runpy
import sys

script = sys.argv[1]
sys.argv = sys.argv[1:]
sys.path[0] = os.path.dirname(os.path.abspath(script))
runpy.run_path(script, run_name="__main__")
sys.stdout.flush()
sys.stderr.flush()
os._exit(0)
