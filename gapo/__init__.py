"""gapo: Group Adaptive Clipping Policy Optimization, and the RLVR system around it."""

import os as _os

if _os.environ.get("GAPO_PARENT_PID"):  # started by a gapo process: tied to its life before any import takes seconds
    from gapo.proc import die_with_parent as _die_with_parent

    _die_with_parent()
