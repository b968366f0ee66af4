"""Speculative decoding: cheap drafts of the next tokens, verified in one pass of the model.

ngram.py drafts by prompt lookup over a sequence's own tokens; control.py holds the settings,
the draft length each branch earns from its acceptance, and how much the scheduler lets the
branches of a step draft. The acceptance rule is the sampler's (sampling.Sampler), the
verification loop the Generation's, the rollback of a rejected tail the engine's.
"""
