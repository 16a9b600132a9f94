"""Maximum inner product search over block embeddings (`searchers`)."""
