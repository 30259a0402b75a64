"""The step loop: the scheduler (plan, run, update), speculative decoding, the draft model."""
