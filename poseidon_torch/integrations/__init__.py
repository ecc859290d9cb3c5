"""Where users already train: thin glue for Lightning (``lightning``) and the Hugging Face ``Trainer``
(``hf``). Each module imports its framework, an optional dependency, only when it is itself imported;
the machinery stays in PoseidonDDP and ServerOptimizer."""
