"""How the trained policy and its reference live on the data-parallel ranks (DESIGN "Scale").

`Replicated` (`--shard-policy none`, the default): every rank holds the whole policy, its gradients, its
optimizer state and the reference; the ranks sum their gradients with `World.sum_grads` after the backward.
`FullyShard` (`--shard-policy fsdp`): FSDP2 (`fully_shard` on each decoder layer, then the root) shards the
policy and the frozen reference, so each rank holds 1/N of the master weights, gradients and AdamW state; a
layer's parameters are all-gathered for its forward and backward, its gradients reduce-scattered.

The update is the same either way. Each rank's loss is already divided by the whole batch's token count, so
the ranks' gradients are *summed*: every sharded module gets a divide factor of 1 and sum-only collectives
(gloo has no average), and `clip_grad_norm_` over the sharded gradients is the global norm. Checkpoints hold
whole tensors, gathered one at a time onto rank 0's CPU, so resume and export do not depend on the sharding.

Rollouts sample from a whole model on every rank, with no collective: under FSDP2 the rollout copy
(`precision.InferenceCopy`) is a separate module refreshed one gathered parameter at a time, and the drafter
shares its embedding and head with that copy. The model must fit one device in the rollout dtype; FSDP2
divides the rest (float32 master weights, gradients and AdamW state, 16 bytes a parameter, and the reference)
by N.
"""

from __future__ import annotations

import sys

import torch

from sparkrl.errors import UserError
from sparkrl.model.transformer import Transformer
from sparkrl.train.distributed import World


def is_dtensor(t) -> bool:
    """Whether t is a sharded DTensor. FSDP2 is imported only when a run shards (importing it costs
    about a second of every command's start-up), and without the import no DTensor can exist."""
    mod = sys.modules.get("torch.distributed.tensor")
    return mod is not None and isinstance(t, mod.DTensor)


def full(t: torch.Tensor) -> torch.Tensor:
    """t itself, or the whole tensor of a sharded DTensor (gathered from every rank: a collective)."""
    return t.full_tensor() if is_dtensor(t) else t


def shard_like(whole: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """This rank's shard of `whole` when `like` is a sharded DTensor of its shape (cut locally, no
    communication: every rank holds `whole`); else `whole` itself."""
    if not is_dtensor(like) or whole.shape != like.shape:
        return whole
    from torch.distributed.tensor import distribute_tensor

    return distribute_tensor(whole.to(like.device, like.dtype), like.device_mesh, like.placements, src_data_rank=None)


class Replicated:
    """Every rank holds the whole policy; gradients are summed over the ranks after the backward."""

    sharded = False

    def __init__(self, world: World):
        self.world = world

    def wrap(self, model: Transformer, frozen: bool = False) -> Transformer:
        return model

    def reduce_grads(self, model: Transformer) -> None:
        self.world.sum_grads(model.parameters())

    def weights(self, model: Transformer) -> dict[str, torch.Tensor]:
        """The policy's `weights()` as whole tensors (on rank 0; called on every rank)."""
        return model.weights()

    def load_weights(self, model: Transformer, state: dict) -> tuple[list[str], list[str]]:
        return model.load_weights(state)

    def optimizer_state(self, opt: torch.optim.Optimizer) -> dict:
        """The optimizer's state_dict with whole tensors (on rank 0; called on every rank)."""
        return opt.state_dict()

    def load_optimizer_state(self, opt: torch.optim.Optimizer, state: dict) -> None:
        opt.load_state_dict(state)


class FullyShard(Replicated):
    """FSDP2: the policy and the reference sharded over the ranks (see the module doc)."""

    sharded = True

    def wrap(self, model: Transformer, frozen: bool = False) -> Transformer:
        """Shard `model` in place: each decoder layer, then the root (embedding, final norm, head).
        `logits` and `token_logprobs` (the head, called after the forward) gather like a forward. A frozen model (the
        reference: no backward) also frees its root's gathered parameters after each forward."""
        from torch.distributed.fsdp import fully_shard, register_fsdp_forward_method

        for layer in model.model.layers:
            fully_shard(layer)
        fully_shard(model, **({"reshard_after_forward": True} if frozen else {}))
        for method in ("logits", "token_logprobs"):
            register_fsdp_forward_method(model, method)
        for m in model.modules():
            if hasattr(m, "set_gradient_divide_factor"):  # the FSDP2 modules: sum the ranks' gradients
                m.set_gradient_divide_factor(1.0)
                m.set_force_sum_reduction_for_comms(True)
        return model

    def reduce_grads(self, model: Transformer) -> None:
        """Nothing: the backward passes reduce-scattered (summed) the gradients already."""

    def weights(self, model: Transformer) -> dict[str, torch.Tensor]:
        return self._gathered(model.weights())

    def load_weights(self, model: Transformer, state: dict) -> tuple[list[str], list[str]]:
        mine = model.state_dict()
        return model.load_weights({k: shard_like(v, mine[k]) if k in mine else v for k, v in state.items()})

    def optimizer_state(self, opt: torch.optim.Optimizer) -> dict:
        sd = opt.state_dict()
        return {**sd, "state": {i: self._gathered(s) for i, s in sd["state"].items()}}

    def load_optimizer_state(self, opt: torch.optim.Optimizer, state: dict) -> None:
        params = [p for group in opt.param_groups for p in group["params"]]  # state_dict's numbering
        mine = {
            i: {k: shard_like(v, params[i]) if torch.is_tensor(v) else v for k, v in s.items()}
            for i, s in state["state"].items()
        }
        opt.load_state_dict({**state, "state": mine})

    def _gathered(self, tensors: dict) -> dict:
        """Whole tensors, one gathered at a time, kept on rank 0's CPU ({} elsewhere)."""
        out = {}
        for k, v in tensors.items():
            v = full(v.detach()) if torch.is_tensor(v) else v
            if self.world.is_main:
                out[k] = v.cpu() if torch.is_tensor(v) else v
        return out


def sharding(choice: str, world: World) -> Replicated:
    """The `--shard-policy` variant for this world; refuses FSDP in one process (before any loading)."""
    if choice == "none":
        return Replicated(world)
    if world.size == 1:
        raise UserError(
            "--shard-policy fsdp shards the policy over the ranks torchrun starts, and this process runs "
            "alone; launch it with `torchrun --nproc-per-node N -m sparkrl train ...` (N >= 2), or drop "
            "the flag"
        )
    return FullyShard(world)
