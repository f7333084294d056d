"""Context parallelism that all-gathers multi-head latent attention's latent instead of its keys and values, when
compiler/context_gather.py says it is fewer values (DeepSeek-V3: 576 values a token against 128 heads x 320).

Each cp rank computes its T/cp tokens' normalised latent c_kv (B, T/cp, r) and rotated RoPE key (B, T/cp, 1, rope)
(models/common/latent_attention.py ``LatentKeys``, the identity point between them and ``kv_b``); here that point
all-gathers both over the cp ranks in the sequence's order (context_parallel.py ``gather_sequence``, one collective
for the two; backward: the reduce-scatter of their gradients, each rank's queries having used every token), so that
the rank's own ``kv_b`` (its TP shard of the heads) expands the whole sequence's keys and values (B, T, H/mp, ...).
Queries stay local; the attention core is told its keys and values are whole already (``ContextParallelAttention``'s
``whole_keys``) and keeps its document and causal logic over the global key positions. ``kv_b`` then multiplies T
rows instead of T/cp: r x H/mp (nope + v) x 2 FLOPs per extra row, which the planner prices (compiler/planner/work.py).

The swap happens on the model before tracing: the tracer specialises sequence lengths (compiler/trace.py), so
``GatheredLatent.trace_forward`` returns tensors of the gathered length and the traced ``kv_b``, its reshape and the
core take T keys; the engine then puts the eager module back (``restore_eager_modules``) to run the collective.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from compiler.parallelize.context_parallel import gather_sequence
from models import CausalAttention, LatentKeys
from models.spec import EagerModule


class GatheredLatent(EagerModule):
    """(latent (B, T/cp, r), k_rope (B, T/cp, 1, rope)) of this rank's chunks -> the whole sequence's (B, T, r) and
    (B, T, 1, rope), in the sequence's order."""

    def __init__(self, mesh: DeviceMesh):
        super().__init__()
        self.mesh = mesh

    def forward(self, latent: torch.Tensor, k_rope: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        r = latent.shape[-1]
        packed = torch.cat([latent, k_rope.flatten(2)], dim=-1)  # (B, T/cp, r + rope), the wider dtype of the two
        whole = gather_sequence(packed, self.mesh, dim=1)  # (B, T, r + rope)
        return whole[..., :r].to(latent.dtype), whole[..., r:].unsqueeze(2).to(k_rope.dtype)

    def trace_forward(self, latent: torch.Tensor, k_rope: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        cp = self.mesh.size()  # only the gathered shapes matter to the tracer
        return torch.cat([latent] * cp, dim=1), torch.cat([k_rope] * cp, dim=1)


def apply_latent_gather(model: nn.Module, mesh: DeviceMesh) -> int:
    """Every ``LatentKeys`` point of ``model`` (before tracing) gathers over the cp ``mesh``; returns how many."""
    points = [name for name, m in model.named_modules() if isinstance(m, LatentKeys)]
    for name in points:
        model.set_submodule(name, GatheredLatent(mesh))
    return len(points)


def cores_with_whole_keys(stage_module: nn.Module) -> set[str]:
    """Names of the attention cores whose keys and values a gathered latent expanded: those of an attention module
    (a ``GatheredLatent``'s parent) that holds one."""
    gathering = {name.rpartition(".")[0] for name, m in stage_module.named_modules() if isinstance(m, GatheredLatent)}
    return {name for name, m in stage_module.named_modules()
            if isinstance(m, CausalAttention) and name.rpartition(".")[0] in gathering}
