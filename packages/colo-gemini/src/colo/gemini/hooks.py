"""Module hooks that gather chunks before the modules that use them and release them after: colo.zero's ZeRO-3
pattern (`colo.zero.ChunkGatherer`), with the gathering done by the `ChunkManager` (device arena, tiers,
prefetch from the policy) instead of an all-gather into fresh memory.

From `ChunkGatherer` this keeps: the hook installation, the forward hook that releases a chunk once every module
owning it has run, the wrapping of module outputs so that backward re-gathers the chunks, and the saved-tensor
hooks around the model's forward (autograd saves views of parameters for backward, ``addmm`` saves
``weight.t()``; here those would point into arena blocks that are reused once the chunk is evicted, so a saved
tensor lying in a gathered chunk is packed as ``(chunk, offset, size, stride)`` and rebuilt in backward from the
chunk's current copy: no saved tensor pins or aliases device memory), and the release of frozen chunks (whose
release cannot wait for gradients) once the backward of every module call that used them has run
(`ChunkGatherer.release_after_backward`). It locates saved tensors, gathers and releases chunks through the manager.
"""

from __future__ import annotations

import torch

from colo.zero import Chunk, ChunkGatherer

from .manager import ChunkManager


class GeminiGatherer(ChunkGatherer):
    """Gathers chunks through a `ChunkManager` around the modules that own them.

    Args:
        chunks: all chunks, in packing order.
        manager: the chunk manager.
    """

    def __init__(self, chunks: list[Chunk], *, manager: ChunkManager) -> None:
        super().__init__(chunks, group=manager.group, keep_last_for_backward=False)  # the policy decides
        self.manager = manager

    def is_gathered(self, chunk: Chunk) -> bool:
        """Whether the chunk's parameters are usable now."""
        return self.manager.is_gathered(chunk)

    def prefetch(self, chunk: Chunk) -> None:
        """Bring the chunk's parameters to the device ahead of use, if there is room."""
        self.manager.prefetch(chunk)

    def gather(self, chunk: Chunk) -> None:
        """Gather for backward (the base class calls this from its output wrapper's backward)."""
        self.manager.gather(chunk, backward=True)

    def release(self, chunk: Chunk) -> None:
        """Release the chunk (after its last forward user, or once its gradients are reduced)."""
        self.manager.release(chunk)
        self.finished[chunk.index].clear()

    def prefetch_for_backward(self, chunks: list[Chunk]) -> None:
        """Nothing here: every gather asks the placement policy what to prefetch next, in backward as well."""

    # --- saved tensors ----------------------------------------------------------------------------------------

    def locate_saved(self, tensor: torch.Tensor) -> tuple[Chunk, int] | None:
        """``(chunk, offset in its full copy)`` when ``tensor`` lies in a gathered chunk's arena block."""
        if tensor.device != self.manager.device:
            return None
        return self.manager.locate(tensor)

    def full_copy_for_backward(self, chunk: Chunk) -> torch.Tensor:
        """Gather the chunk for backward through the manager and return its full copy."""
        self.manager.gather(chunk, backward=True)
        return self.manager.full_copy(chunk)

    # --- module hooks -----------------------------------------------------------------------------------------

    def _before_forward(self, module: torch.nn.Module, args):
        owned = self.module_chunks[id(module)]
        for chunk in owned:
            self.manager.gather(chunk, backward=False)
        return self.release_after_backward([chunk for chunk in owned if not chunk.trainable], args)
