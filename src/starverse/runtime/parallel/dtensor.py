"""``is_dtensor``: the DTensor test that does not import ``torch.distributed.tensor``.

Importing DTensor (and FSDP2, which imports it) costs about a second of CPU; importing the trainer or the rank
loop no longer pays it. No DTensor can exist before ``torch.distributed.tensor`` is imported (its class lives
there), so until then every answer is False without importing anything. The modules that shard (tensor
parallel, FSDP2, ZeRO-1) import it inside the functions that need it. A training rank still imports it later,
through torch itself: the first ``torch.optim`` optimizer built imports ``torch._dynamo``, which imports FSDP
(and ``transformers`` models import it too); what is saved is the cost in the processes that never build one
(``starverse train``/``demo`` refusing bad input, the test process, tools that only plan or check).
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, TypeGuard

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor


def is_dtensor(t: object) -> TypeGuard[DTensor]:
    """``t`` is a DTensor (False, at no import cost, while no module has imported ``torch.distributed.tensor``)."""
    mod = sys.modules.get("torch.distributed.tensor")
    return mod is not None and isinstance(t, mod.DTensor)
