"""What a conversion rank imports, preloaded once by the forkserver its ranks fork from
(``tools.hf_to_mcore``).

The filter comes first, before megatron-core is imported: the server starts without the
CLI's filters, and megatron's start-up notices (fallbacks, deprecations, experimental
classes; 0.19's differ from 0.16's) and compile-time SyntaxWarnings (module: the file's
path) are nothing a conversion's user acts on. What is missing is said in one line (the
accelerators)."""

import warnings

warnings.filterwarnings("ignore", module=r"(.*/)?megatron[./]")

import torch._dynamo  # noqa: E402,F401 - what the optimizer's constructor imports (torch/_compile.py)

import areal_mcore.actor.checkpoint  # noqa: E402,F401
import areal_mcore.actor.megatron_actor  # noqa: E402,F401
