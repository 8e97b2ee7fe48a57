"""The megatron-core trainer backend (tensor/pipeline/data parallelism). Importing this package imports no megatron."""
