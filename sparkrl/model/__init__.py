"""The policy as a model: the Transformer (the eager PyTorch reference semantics every accelerated path is
tested against), its weights (loading, converting, the cache), Hugging Face export and memory-light
log-probabilities of the LM head. Imports nothing else of sparkrl but `errors`, `config` and `machine`."""
