# SPDX-License-Identifier: MIT
"""torch.nn modules built on weft's fused ops."""
import torch

from . import _runtime
from . import torch as weft_torch

__all__ = ["TensorParallelMLP"]


class TensorParallelMLP(torch.nn.Module):
    """A tensor-parallel (sequence-parallel) MLP over the World's ranks, or over `team` (a weft.Team: a TP group):

        h = act(AllGather(x_local) @ w1.T)    column-parallel, weft's AG+GEMM:  w1 [ffn/W, hidden]
        y_local = ReduceScatter(h @ w2.T)     row-parallel, weft's GEMM+RS:     w2 [hidden, ffn/W]

    W is the number of ranks (team members); x_local is this rank's [M/W, hidden] slice of the tokens (M the same on
    every rank, a multiple of W) and the
    result is its [M/W, hidden] slice of the output. Backward runs GEMM+RS for the first layer's input gradient and
    AG+GEMM for the second's (weft.torch). Every rank builds it with the same arguments and calls forward and
    backward in the same order (the ops are collective). hidden and ffn_hidden / W: multiples of 8.
    Weights start as torch.nn.init's defaults for this shard; load_full_weights shards full weights instead.
    """

    def __init__(self, hidden, ffn_hidden, *, activation=torch.nn.functional.gelu, dtype=torch.bfloat16,
                 device=None, team=None):
        super().__init__()
        world, cpp_team = _runtime._team_for(team, "TensorParallelMLP")
        self.team = team if cpp_team is not None else None
        w = cpp_team.num_ranks if cpp_team is not None else world.num_ranks
        if ffn_hidden % w != 0:
            raise ValueError(f"ffn_hidden: expected a multiple of the {w} ranks, got {ffn_hidden}")
        if hidden % 8 != 0 or (ffn_hidden // w) % 8 != 0:
            raise ValueError(f"hidden and ffn_hidden / ranks: expected multiples of 8, got {hidden} and "
                             f"{ffn_hidden // w}")
        if device is None:
            device = torch.device("cuda", world.device)
        self.hidden, self.ffn_hidden, self.num_ranks = hidden, ffn_hidden, w
        self.rank = cpp_team.rank if cpp_team is not None else world.rank
        self.activation = activation
        shard = ffn_hidden // w
        self.w1 = torch.nn.Parameter(torch.empty(shard, hidden, dtype=dtype, device=device))
        self.w2 = torch.nn.Parameter(torch.empty(hidden, shard, dtype=dtype, device=device))
        torch.nn.init.kaiming_uniform_(self.w1, a=5 ** 0.5)
        torch.nn.init.kaiming_uniform_(self.w2, a=5 ** 0.5)

    @torch.no_grad()
    def load_full_weights(self, w1_full, w2_full):
        """Takes this rank's shards of full weights w1 [ffn_hidden, hidden] and w2 [hidden, ffn_hidden]."""
        shard = self.ffn_hidden // self.num_ranks
        rows = slice(self.rank * shard, (self.rank + 1) * shard)
        if tuple(w1_full.shape) != (self.ffn_hidden, self.hidden):
            raise ValueError(f"w1_full: expected shape ({self.ffn_hidden}, {self.hidden}), got {tuple(w1_full.shape)}")
        if tuple(w2_full.shape) != (self.hidden, self.ffn_hidden):
            raise ValueError(f"w2_full: expected shape ({self.hidden}, {self.ffn_hidden}), got {tuple(w2_full.shape)}")
        self.w1.copy_(w1_full[rows])
        self.w2.copy_(w2_full[:, rows])

    def forward(self, x_local):
        h = self.activation(weft_torch.ag_gemm(x_local, self.w1, team=self.team))
        return weft_torch.gemm_rs(h, self.w2, team=self.team)
