"""``elastic_worker.py`` whose follower diverges right before the promotion's digest check.

In a worker that follows (a replacement), the first parameter is nudged by ``1e-3`` just
after it took the pusher's rest (``take_rest``), as a bit flip in its memory would: the pair's
digests differ at the promotion, the one failure a follow cannot see coming. Every flag is
``elastic_worker.py``'s.
"""

from __future__ import annotations

from typing import Any

import torch

from stalwart.elastic import follow_job

if __package__:
    from . import elastic_worker
else:  # run as a script by `stalwart run`
    import elastic_worker  # type: ignore[no-redef]

_take_rest = follow_job.take_rest


def _diverging_take_rest(state: Any, optimizer: Any, params: list[torch.Tensor],
                         buffers: list[torch.Tensor], src: int, group: Any) -> Any:  # fmt: skip
    out = _take_rest(state, optimizer, params, buffers, src, group)
    with torch.no_grad():
        params[0].view(-1)[0] += 1e-3
    return out


if __name__ == "__main__":
    follow_job.take_rest = _diverging_take_rest
    elastic_worker.main()
