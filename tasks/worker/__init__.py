"""The code that runs inside Ray Train's workers: the model, the Petastorm loader and the per-worker training loop.

Everything here is shipped to the workers; it imports nothing of the pipeline's stages.
"""
