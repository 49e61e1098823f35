"""Training the project's own small GDN and KDA language models with optax (``leapquant train``).

``data``: the offline corpus (CPython standard-library sources, tokenized once); ``model``:
the two architectures' configs, initial parameters and the training forward; ``loop``: the
optimizer, the jitted step, resumable checkpoints and the time-budgeted loop; ``report``:
the decay spectrum, plots, ``TRAINING.md`` and ``SHA256SUMS``; ``cli``: the commands.
"""
