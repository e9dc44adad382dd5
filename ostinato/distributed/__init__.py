"""Several processes, one engine: ranks and groups, the launcher, the worker loop, the
stage-to-stage transfer and the tensor-parallel collectives."""
