"""Exact speculative decoding core: sampling parameters, logits processing, counter-based
randomness, the rejection sampler and the model runner. Knows nothing of Ray."""
