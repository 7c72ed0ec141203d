"""Every difference between the torch versions torch_ext supports (2.9.1 .. 2.15.0), and nothing else.

No other module branches on the torch version: they import the Dynamo internals they need from here.

One module per concern: versions (which torch, known bugs), dynamo (tracing internals), runtime
(CUDA graphs, custom ops), aot (AOT compile), inductor (its per-process keys), speculation (restarts), joint
(Inductor's training compile with our inner compile), rng_hops (RNG-state HOPs called directly), fx_tracing (fx's
trace-time patches kept to their thread). Callers use
`torch_ext.compat.<name>`.
"""
from torch_ext.compat.versions import *  # noqa: F401,F403  (checks the version first)
from torch_ext.compat.versions import _release  # noqa: F401
from torch_ext.compat.dynamo import *  # noqa: F401,F403
from torch_ext.compat.runtime import *  # noqa: F401,F403
from torch_ext.compat.aot import *  # noqa: F401,F403
from torch_ext.compat.inductor import *  # noqa: F401,F403
from torch_ext.compat.speculation import *  # noqa: F401,F403
from torch_ext.compat.joint import *  # noqa: F401,F403
from torch_ext.compat.rng_hops import (GRAPH_SAFE_RNG_STATE_HOP, RNG_STATE_HOPS, direct_hop_call,  # noqa: F401
                                      is_rng_state_hop)
from torch_ext.compat.fx_tracing import *  # noqa: F401,F403
from torch_ext.compat import versions  # noqa: F401  (tests patch the running release there)
